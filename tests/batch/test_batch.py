"""kasoku batch on the tiny pipeline: one image and one result line per job, in this process and on
Ray, through interruptions and killed workers; bad input is refused before any work."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from PIL import Image

from kasoku.batch import (
    RESULTS_FILE,
    STATE_DIR,
    BatchFailed,
    InvalidJobs,
    Job,
    OutputDir,
    check_fits,
    default_workers,
    plan_batches,
    prepare,
    read_jobs,
    run_ray,
)
from kasoku.cli import main

pytestmark = pytest.mark.integration  # exports or builds engines

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="Ray is not installed: pip install 'kasoku[ray]' (`make setup` does)")

STEPS = 20  # long enough for a kill to land mid-run, short enough for the suite (~0.1 s per image)
JOBS = 12


def write_jobs(path: Path, count: int = JOBS) -> Path:
    """Jobs of two sizes, with and without negative prompts and guidance, some with their own id."""
    lines = []
    for i in range(count):
        job = {"prompt": f"a photo of thing {i}", "steps": STEPS, "seed": 100 + i}
        if i % 3 == 0:
            job.update(height=32, width=32)
        if i % 4 == 1:
            job["negative_prompt"] = "blurry"
        if i % 5 == 2:
            job["guidance"] = 1.0
        if i == 7:
            job["id"] = "seven"
        lines.append(json.dumps(job))
    path.write_text("\n".join(lines) + "\n")
    return path


def batch_args(model, prompts, out, cache_root, *extra) -> list[str]:
    return ["batch", str(model), str(prompts), "--out", str(out), "--backend", "onnxruntime",
            "--cache-dir", str(cache_root), *extra]


def images(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.png"))}


def result_lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / RESULTS_FILE).read_text().splitlines()]


def assert_exactly_once(out: Path, count: int = JOBS) -> None:
    lines = result_lines(out)
    assert len(lines) == count and len({line["id"] for line in lines}) == count
    assert sorted(line["file"] for line in lines) == sorted(images(out))
    assert not (out / STATE_DIR).exists(), "temporary files and worker status are removed after a run"


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return write_jobs(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


@pytest.fixture(scope="module")
def reference(tiny_dir, tiny_cache, prompts, tmp_path_factory) -> Path:
    """The 12 jobs in this process, batch size 4 (this also compiles the engines into the cache)."""
    out = tmp_path_factory.mktemp("reference") / "out"
    summary = out.parent / "summary.json"
    assert main(batch_args(tiny_dir, prompts, out, tiny_cache.root, "--batch-size", "4", "--json", str(summary))) == 0
    return out


# ---- reading jobs ----------------------------------------------------------------------------


def test_jobs_default_their_id_and_seed_to_the_line_number(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b", "id": 7, "seed": 3, "negative_prompt": null, '
                    '"guidance": 2, "height": 32, "width": 48}\n')
    first, second = read_jobs(path)
    # steps and guidance the model family's (prepare fills them in, as the native size)
    assert (first.id, first.seed, first.steps, first.height, first.source) == ("000001", 1, None, None, f"{path}:1")
    assert (second.id, second.seed, second.guidance, second.height, second.width) == ("7", 3, 2.0, 32, 48)
    assert first.file == "000001.png" and first.key != second.key


def test_every_malformed_line_is_named_with_its_rule(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join([
        '{"prompt": "ok", "id": "a"}',
        '{"prompt": "x",',  # 2: not JSON
        '{"prompt": "x", "promt": "y"}',  # 3: unknown field
        '{"prompt": "x", "seed": "7"}',  # 4: wrong type
        '{"negative_prompt": "x"}',  # 5: no prompt
        '{"prompt": "x", "id": "a"}',  # 6: duplicate id
        '{"prompt": "x", "id": "../up"}',  # 7: an id that is not a file name
        '["prompt"]',  # 8: not an object
        '{"prompt": "x", "steps": 0}',  # 9: out of range
    ]) + "\n")
    with pytest.raises(InvalidJobs) as error:
        read_jobs(path)
    message = str(error.value)
    assert message.startswith(f"8 lines of {path} cannot be run")
    for number, words in [(2, "not valid JSON"), (3, "unknown field 'promt'; the fields are id, prompt"),
                          (4, '`seed` must be an integer in 0..'), (5, "`prompt` is missing"),
                          (6, "id 'a' is already the id of line 1"), (7, "`id` names the image file"),
                          (8, "a job is a JSON object, not list"), (9, "`steps` must be an integer >= 1 but is 0")]:
        assert f"{path}:{number}: {words}" in message
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(InvalidJobs, match="has no jobs"):
        read_jobs(empty)


def test_batches_group_jobs_that_can_share_a_call():
    jobs = [Job(str(i), "p", i, height=32 if i % 2 else 64, width=32 if i % 2 else 64, steps=2,
                negative_prompt="blurry" if i == 6 else None) for i in range(8)]
    batches = plan_batches(jobs, 2)
    assert [[j.id for j in b] for b in batches] == [["0", "2"], ["4"], ["1", "3"], ["5", "7"], ["6"]]


def test_a_job_is_done_only_when_its_image_and_its_result_line_exist(tmp_path):
    jobs = [Job(f"j{i}", "p", i, height=64, width=64) for i in range(5)]

    def line(job, **change) -> str:
        return json.dumps({"id": job.id, "file": job.file, "job_key": job.key, **change})

    for job in jobs[:4]:
        Image.new("RGB", (8, 8)).save(tmp_path / job.file)
    other = json.dumps({"id": "from-another-file", "file": "x.png", "job_key": "k"})
    (tmp_path / RESULTS_FILE).write_text("\n".join([
        line(jobs[0]),  # done
        line(jobs[0]),  # the same job twice: one line stays
        line(jobs[1], job_key="an older job with this id"),  # redone
        other,  # not ours: kept
        line(jobs[4]),  # no image: redone
        line(jobs[2]) + "\n" + line(jobs[3])[:20],  # 2 done; 3 cut short by a kill: redone
    ]))
    with OutputDir(tmp_path) as output:
        todo, done = output.pending(jobs)
    assert [j.id for j in todo] == ["j1", "j3", "j4"] and done == 2
    assert (tmp_path / RESULTS_FILE).read_text() == f"{line(jobs[0])}\n{other}\n{line(jobs[2])}\n"


class _FakeRay:
    """The one Ray call that sizing the pool needs: a 2-CPU cluster without GPUs."""

    @staticmethod
    def cluster_resources() -> dict:
        return {"CPU": 2.0}


def test_workers_fill_the_cluster_and_never_wait_for_resources_it_lacks():
    assert default_workers(_FakeRay, cpus_per_worker=1, gpus_per_worker=0) == 2
    assert default_workers(_FakeRay, cpus_per_worker=2, gpus_per_worker=0) == 1
    check_fits(_FakeRay, 2, 1, 0)
    with pytest.raises(BatchFailed, match="3 workers x 1 CPUs each need 3 CPUs but the Ray cluster has 2; ask for "
                                          "fewer --workers or a smaller --threads"):
        check_fits(_FakeRay, 3, 1, 0)
    with pytest.raises(BatchFailed, match="need 1 GPUs but the Ray cluster has 0"):
        check_fits(_FakeRay, 1, 1, 1)


# ---- running -----------------------------------------------------------------------------------


def test_local_run_writes_one_image_and_one_line_per_job_and_a_rerun_does_nothing(reference, tiny_dir, tiny_cache,
                                                                                  prompts, capsys):
    assert_exactly_once(reference)
    lines = {line["id"]: line for line in result_lines(reference)}
    assert lines["seven"] == {**lines["seven"], "seed": 107, "file": "seven.png", "backend": "onnxruntime"}
    assert set(lines["000001"]) == {"id", "seed", "file", "seconds", "backend", "worker", "images_in_call", "job_key"}
    assert Image.open(reference / "000001.png").size == (32, 32)
    assert Image.open(reference / "seven.png").size == (64, 64)
    summary = json.loads((reference.parent / "summary.json").read_text())
    assert summary["generated"] == JOBS and summary["images_per_second"] > 0
    stamps = {p.name: p.stat().st_mtime_ns for p in reference.glob("*.png")}

    again = reference.parent / "again.json"
    assert main(batch_args(tiny_dir, prompts, reference, tiny_cache.root, "--json", str(again))) == 0
    assert json.loads(again.read_text())["skipped"] == JOBS and json.loads(again.read_text())["generated"] == 0
    assert {p.name: p.stat().st_mtime_ns for p in reference.glob("*.png")} == stamps
    assert_exactly_once(reference)


def test_batched_calls_make_the_same_bytes_as_one_job_per_call(reference, tiny_dir, tiny_cache, prompts, tmp_path):
    assert main(batch_args(tiny_dir, prompts, tmp_path / "out", tiny_cache.root, "--batch-size", "1")) == 0
    assert images(tmp_path / "out") == images(reference)


@pytest.mark.slow(reason="Ray's start and its workers' compiles (the local batch tests stay)")
@needs_ray
def test_ray_gives_the_same_images_byte_for_byte(reference, tiny_dir, tiny_cache, prompts, tmp_path, capsys):
    summary = tmp_path / "ray.json"
    args = batch_args(tiny_dir, prompts, tmp_path / "out", tiny_cache.root, "--batch-size", "4",
                      "--ray", "--workers", "2", "--json", str(summary))
    assert main(args) == 0
    assert images(tmp_path / "out") == images(reference)
    assert_exactly_once(tmp_path / "out")
    report = json.loads(summary.read_text())
    assert report["mode"] == "ray" and len(report["workers"]) == 2
    assert all(w["engine_seconds"] > 0 and w["startup_seconds"] >= w["engine_seconds"] for w in report["workers"])
    assert all(w["built_stages"] == 0 for w in report["workers"]), "workers only load engines from the cache"
    assert len({line["worker"] for line in result_lines(tmp_path / "out")}) == 2, "both workers made images"
    assert "engines from the cache" in capsys.readouterr().out


def test_an_interrupted_run_finishes_with_every_job_done_once(reference, tiny_dir, tiny_cache, prompts, tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "kasoku.cli", *batch_args(tiny_dir, prompts, out, tiny_cache.root,
                                                              "--batch-size", "2")]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while _count_lines(out / RESULTS_FILE) < 3 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    done_before = {line["file"]: (out / line["file"]).stat().st_mtime_ns for line in result_lines(out)}
    assert 3 <= len(done_before) < JOBS, "the run was killed part-way"

    summary = tmp_path / "rerun.json"
    assert main(batch_args(tiny_dir, prompts, out, tiny_cache.root, "--batch-size", "2", "--json", str(summary))) == 0
    report = json.loads(summary.read_text())
    assert report["skipped"] == len(done_before) and report["generated"] == JOBS - len(done_before)
    assert {name: (out / name).stat().st_mtime_ns for name in done_before} == done_before, "done jobs are not redone"
    assert_exactly_once(out)
    assert images(out) == images(reference)


def _count_lines(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


@needs_ray
@pytest.mark.slow  # waits for Ray to notice a killed actor and start another: most of a minute on two cores
def test_a_killed_ray_worker_has_its_jobs_retried(reference, tiny_dir, tiny_cache, prompts, tmp_path):
    out = tmp_path / "out"
    plan = prepare(tiny_dir, read_jobs(prompts), out, batch_size=1, backend="onnxruntime",
                   cache_dir=tiny_cache.root, threads=1)
    killed: list[int] = []
    stop = threading.Event()

    def kill_a_busy_worker() -> None:
        """From outside, as an OOM killer or a lost node would: SIGKILL a worker that is on a job."""
        while not stop.is_set() and not killed:
            if _count_lines(out / RESULTS_FILE) >= 2:
                for status in (out / STATE_DIR / "workers").glob("*.json"):
                    worker = json.loads(status.read_text())
                    if worker["jobs"]:
                        os.kill(worker["pid"], signal.SIGKILL)
                        killed.append(worker["pid"])
                        break
            time.sleep(0.005)

    killer = threading.Thread(target=kill_a_busy_worker, daemon=True)
    killer.start()
    try:
        result = run_ray(plan, workers=2)
    finally:
        stop.set()
        killer.join()
    assert killed, "a worker was killed during the run"
    assert result.retried_batches >= 1 and result.generated == JOBS
    assert_exactly_once(out)
    assert images(out) == images(reference)


# ---- bad input ---------------------------------------------------------------------------------


def _bad_prompts(tmp_path, text: str) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", ["malformed line", "size outside the profile", "output is a file",
                                  "output under a file"])
def test_bad_input_is_refused_before_any_work(case, tiny_dir, tmp_path, capsys):
    good = '{"prompt": "a cat", "steps": 2}\n'
    out = tmp_path / "out"
    prompts, expected = _bad_prompts(tmp_path, good), None
    if case == "malformed line":
        prompts = _bad_prompts(tmp_path, good + '{"prompt": "a dog", "steps": 2, "sedd": 1}\n')
        expected = f"{prompts}:2: unknown field 'sedd'"
    elif case == "size outside the profile":
        prompts = _bad_prompts(tmp_path, good + '{"prompt": "a dog", "height": 200}\n')
        expected = f"{prompts}:2: height=200 is outside the compiled profile (height 32..128)"
    elif case == "output is a file":
        out.write_text("not a folder")
        expected = f"--out {out} is a file, not a folder"
    else:
        (tmp_path / "file").write_text("")
        out = tmp_path / "file" / "out"
        expected = f"cannot create --out {out}: {tmp_path / 'file'} is a file"
    cache = tmp_path / "cache"
    before = sorted(tmp_path.rglob("*"))
    assert main(batch_args(tiny_dir, prompts, out, cache)) == 1
    assert expected in capsys.readouterr().out.replace("\n", "")
    assert sorted(tmp_path.rglob("*")) == before, "nothing written: no output folder, no cache entry"


def test_ray_flag_without_ray_names_the_extra(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    prompts = _bad_prompts(tmp_path, '{"prompt": "a cat"}\n')
    assert main(batch_args(tiny_dir, prompts, tmp_path / "out", tmp_path / "cache", "--ray")) == 1
    assert "pip install 'kasoku[ray]'" in capsys.readouterr().out
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["batch", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag, words in [("--out DIR", "results.jsonl"), ("--ray [ADDRESS]", "kasoku[ray]"),
                        ("--workers", "each holding one pipeline"), ("--batch-size", "images per engine call"),
                        ("--backend", "auto"), ("--threads", "CPUs Ray reserves"), ("--height MIN:MAX", "serve"),
                        ("--gpus-per-worker", "GPUs"), ("--cache-dir", "KASOKU_CACHE"), ("--json", "summary")]:
        assert flag in out and words in out, flag
