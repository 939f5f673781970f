"""The content-addressed cache: atomic entries, verification, leftovers, locking."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import subprocess
import sys

import pytest

from kasoku.core.cache import MANIFEST, TMP_PREFIX, Cache, CorruptEntryWarning, digest_key


def write_files(tmp):
    (tmp / "a.bin").write_bytes(b"x" * 1000)
    (tmp / "sub").mkdir()
    (tmp / "sub" / "b.txt").write_text("hello")
    return {"note": "built"}


def test_build_once_then_reuse(tmp_path):
    cache = Cache(tmp_path)
    first = cache.get_or_build({"kind": "t", "v": 1}, write_files)
    second = cache.get_or_build({"kind": "t", "v": 1}, lambda tmp: pytest.fail("must not rebuild"))
    assert first.built and not second.built and first.path == second.path
    assert second.meta == {"note": "built"}
    manifest = json.loads((first.path / MANIFEST).read_text())
    assert set(manifest["files"]) == {"a.bin", "sub/b.txt"}
    assert [e[2] for e in cache.events] == ["built", "reused"]


def test_key_is_a_digest_of_every_part(tmp_path):
    assert digest_key({"a": 1, "b": 2}) == digest_key({"b": 2, "a": 1})
    assert digest_key({"a": 1}) != digest_key({"a": 2})
    cache = Cache(tmp_path)
    one = cache.get_or_build({"kind": "t", "precision": "fp32"}, write_files)
    two = cache.get_or_build({"kind": "t", "precision": "fp16"}, write_files)
    assert one.key != two.key and two.built


@pytest.mark.parametrize("damage", ["truncate", "delete", "manifest"])
def test_damaged_entry_is_rebuilt_with_a_warning(tmp_path, damage):
    cache = Cache(tmp_path)
    entry = cache.get_or_build({"kind": "t"}, write_files)
    target = entry.path / "a.bin"
    if damage == "truncate":
        target.write_bytes(b"x" * 10)
    elif damage == "alter":
        target.write_bytes(b"y" * 1000)
    elif damage == "delete":
        target.unlink()
    else:
        (entry.path / MANIFEST).write_text("{not json")
    with pytest.warns(CorruptEntryWarning, match="corrupt"):
        again = cache.get_or_build({"kind": "t"}, write_files)
    assert again.built and (again.path / "a.bin").read_bytes() == b"x" * 1000
    assert cache.events[-1][2] == "rebuilt"
    assert cache.verify(again.path) is None


def test_a_hit_checks_sizes_and_check_finds_altered_bytes(tmp_path):
    cache = Cache(tmp_path)
    entry = cache.get_or_build({"kind": "t"}, write_files)
    (entry.path / "a.bin").write_bytes(b"y" * 1000)  # same size, other bytes: a hit does not read them
    assert cache.lookup({"kind": "t"}) is not None
    damaged = cache.check()
    assert [(info.key, problem) for info, problem in damaged] == [(entry.key, "a.bin does not match its checksum")]
    assert cache.check(repair=True) and not entry.path.exists()
    assert cache.lookup({"kind": "t"}) is None
    rebuilt = cache.get_or_build({"kind": "t"}, write_files)
    assert rebuilt.built and (rebuilt.path / "a.bin").read_bytes() == b"x" * 1000


def test_cache_check_cli_reports_and_repairs(tmp_path, capsys):
    from kasoku.cli import main

    cache = Cache(tmp_path)
    entry = cache.get_or_build({"kind": "t"}, write_files, describe={"model": "/m/one", "component": "unet"})
    assert main(["cache", "check", "--cache-dir", str(tmp_path)]) == 0
    (entry.path / "sub" / "b.txt").write_text("HELLO")
    assert main(["cache", "check", "--cache-dir", str(tmp_path)]) == 1
    assert "DAMAGED | " + entry.key[:12] in capsys.readouterr().out
    assert main(["cache", "check", "--repair", "--cache-dir", str(tmp_path)]) == 0
    assert "removed" in capsys.readouterr().out and not entry.path.exists()


def test_failed_build_leaves_nothing(tmp_path):
    cache = Cache(tmp_path)

    def broken(tmp):
        (tmp / "half").write_text("partial")
        raise RuntimeError("builder died")

    with pytest.raises(RuntimeError, match="builder died"):
        cache.get_or_build({"kind": "t"}, broken)
    assert list(cache.entries.iterdir()) == [cache.entries / f".{digest_key({'kind': 't'})}.lock"]


def test_leftover_from_a_killed_build_is_ignored_and_cleaned(tmp_path):
    cache = Cache(tmp_path)
    key = digest_key({"kind": "t"})
    leftover = cache.entries / f"{TMP_PREFIX}{key}-99999-deadbeef"
    leftover.mkdir(parents=True)
    (leftover / "a.bin").write_bytes(b"garbage")
    assert cache.list() == []
    entry = cache.get_or_build({"kind": "t"}, write_files)
    assert entry.built and not leftover.exists()


def _slow_build_in_process(root, result_file):
    import time

    cache = Cache(root)

    def build(tmp):
        time.sleep(1.0)
        write_files(tmp)
        return {"pid": os.getpid()}

    entry = cache.get_or_build({"kind": "t"}, build)
    with open(result_file, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "built": entry.built, "meta": entry.meta}) + "\n")


def test_concurrent_builders_wait_on_the_lock(tmp_path):
    result = tmp_path / "results.jsonl"
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_slow_build_in_process, args=(tmp_path / "cache", result)) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    rows = [json.loads(line) for line in result.read_text().splitlines()]
    assert sorted(r["built"] for r in rows) == [False, True]
    assert len({r["meta"]["pid"] for r in rows}) == 1  # both use the one build


def test_list_and_clear(tmp_path):
    cache = Cache(tmp_path)
    cache.get_or_build({"kind": "a"}, write_files, describe={"model": "/m/one", "component": "unet"})
    cache.get_or_build({"kind": "b"}, write_files, describe={"model": "/m/two", "component": "unet"})
    assert {(e.model, e.kind) for e in cache.list()} == {("/m/one", "a"), ("/m/two", "b")}
    assert cache.clear("one") == 1
    assert [e.model for e in cache.list()] == ["/m/two"]
    assert cache.clear() == 1 and cache.list() == []


@pytest.mark.integration  # two fresh interpreters
def test_cache_cli(tmp_path):
    cache = Cache(tmp_path)
    cache.get_or_build({"kind": "a"}, write_files, describe={"model": "/m/one", "component": "unet"})
    env = {**os.environ, "KASOKU_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "kasoku.cli", "cache", "ls"], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert "/m/one" in out and "1 entries" in out
    out = subprocess.run([sys.executable, "-m", "kasoku.cli", "cache", "clear"], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert "removed 1 entry" in out and cache.list() == []


def _tree(path):
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mode) for p in path.rglob("*"))


def test_listing_a_missing_cache_creates_nothing(tmp_path):
    cache = Cache(tmp_path / "absent")
    assert cache.list() == [] and cache.lookup({"kind": "a"}) is None and cache.clear() == 0
    assert not (tmp_path / "absent").exists()


def test_clear_names_a_model_by_its_folder_not_by_its_name(tmp_path, monkeypatch):
    cache = Cache(tmp_path / "cache")
    one, two = tmp_path / "a" / "tiny-sd", tmp_path / "b" / "tiny-sd"
    for folder in (one, two):
        folder.mkdir(parents=True)
        cache.get_or_build({"kind": "e", "m": str(folder)}, write_files, describe={"model": str(folder)})
    monkeypatch.chdir(tmp_path / "a")
    assert cache.clear("./tiny-sd") == 1  # this folder's entries, not the other tiny-sd's
    assert [e.model for e in cache.list()] == [str(two)]
    cache.get_or_build({"kind": "e", "m": str(one)}, write_files, describe={"model": str(one)})
    monkeypatch.chdir(tmp_path)
    from kasoku.core.cache import CacheError

    with pytest.raises(CacheError, match=r"'tiny-sd' names 2 models in the cache .* give the folder's path"):
        cache.clear("tiny-sd")


def reaching_the_interpreter(as_user: list[str]) -> list[str]:
    """What the other user needs to run this interpreter and the checkout's code: nothing where they are readable by
    all, else (a checkout in a private folder: under /root, or made by mktemp -d) the capability to read and search
    any folder (CAP_DAC_READ_SEARCH), which grants no write: the cache stays read-only to it. That files the cache
    writes are readable by others is asserted apart (test_cache_files_are_readable_by_whom_the_cache_folder_is)."""
    probe = [sys.executable, "-c", "import kasoku.cli"]
    if subprocess.run([*as_user, *probe], capture_output=True).returncode == 0:
        return []
    caps = ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    if subprocess.run([*as_user, *caps, *probe], capture_output=True).returncode != 0:
        pytest.skip("the checkout's interpreter is in a private folder, and setpriv cannot grant another user "
                    "CAP_DAC_READ_SEARCH here")
    return caps


@contextlib.contextmanager
def read_only_copy(tiny_dir, cache_root, prepare=None):
    """A baked container image or a shared NFS cache: a copy of the model and of the cache (after `prepare(model,
    cache)`), the cache made read-only, and a runner of `python -m kasoku.cli` as a user other than its owner (root
    bypasses file modes); yields (run, model, cache, out)."""
    import shutil
    import tempfile
    from pathlib import Path

    as_user: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: no other user to run the read-only generation as")
        as_user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]  # nobody
        as_user += reaching_the_interpreter(as_user)
    root = Path(tempfile.mkdtemp(prefix="kasoku-read-only-"))
    try:
        os.chmod(root, 0o755)
        model, cache, out = root / "model", root / "cache", root / "out"
        shutil.copytree(tiny_dir, model)
        shutil.copytree(cache_root, cache, ignore=shutil.ignore_patterns(".*.lock"))
        if prepare is not None:
            prepare(model, cache)
        out.mkdir(mode=0o777)
        os.chmod(out, 0o777)
        for path in (*cache.rglob("*"), cache):
            os.chmod(path, 0o555 if path.is_dir() else 0o444)
        for path in (*model.rglob("*"), model):
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        env = {**os.environ, "HOME": str(out), "HF_HUB_OFFLINE": "1"}

        def run(*arguments: str):
            return subprocess.run([*as_user, sys.executable, "-m", "kasoku.cli", *arguments], env=env,
                                  capture_output=True, text=True, timeout=600)

        yield run, model, cache, out
    finally:
        for path in (root, *root.rglob("*")):
            if path.is_dir():
                os.chmod(path, 0o755)  # so that rmtree can empty it, whoever runs the tests
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.integration  # a generation in a fresh interpreter, as another user
def test_a_warm_read_only_cache_serves_without_writing(tiny_dir, tiny_cache, tiny_compiled):
    with read_only_copy(tiny_dir, tiny_cache.root) as (run, model, cache, out):
        before = _tree(cache)
        result = run("generate", str(model), "a cat", "--backend", "onnxruntime", "--steps", "2", "--cache-dir",
                     str(cache), "-o", str(out / "cat.png"))
        assert result.returncode == 0, result.stdout + result.stderr
        assert (out / "cat.png").stat().st_size > 0
        assert _tree(cache) == before  # not a lock file, not a touched manifest


@pytest.mark.integration  # kasoku compile, then generate and batch with default options as another user
def test_generate_and_batch_with_default_options_use_what_kasoku_compile_built(tiny_dir, tiny_cache, tiny_compiled):
    """`kasoku compile --backend onnxruntime` at build time; `generate` and `batch` with their default options
    (`auto` backend, the call's own shape) on the read-only copy take the engines the cache holds."""
    from kasoku.cli import main

    def compile_into(model, cache):
        assert main(["compile", str(model), "--backend", "onnxruntime", "--cache-dir", str(cache)]) == 0

    with read_only_copy(tiny_dir, tiny_cache.root, compile_into) as (run, model, cache, out):
        before = _tree(cache)
        result = run("generate", str(model), "a cat", "--steps", "2", "--cache-dir", str(cache),
                     "-o", str(out / "cat.png"))
        assert result.returncode == 0, result.stdout + result.stderr
        assert (out / "cat.png").stat().st_size > 0
        jobs = out / "jobs.jsonl"
        jobs.write_text('{"prompt": "a cat", "steps": 2}\n{"prompt": "a dog", "steps": 2}\n')
        result = run("batch", str(model), str(jobs), "--out", str(out / "batch"), "--cache-dir", str(cache))
        assert result.returncode == 0, result.stdout + result.stderr
        assert len(list((out / "batch").glob("*.png"))) == 2
        assert _tree(cache) == before


def _private_blob(tmp):
    """What OpenVINO does with its compiled blob: a file written with mode 0640."""
    write_files(tmp)
    os.chmod(tmp / "a.bin", 0o640)


@pytest.mark.parametrize("root_mode, readable", [(0o755, True), (0o700, False)])
def test_cache_files_are_readable_by_whom_the_cache_folder_is(tmp_path, root_mode, readable):
    root = tmp_path / "cache"
    root.mkdir(mode=root_mode)
    os.chmod(root, root_mode)
    entry = Cache(root).get_or_build({"kind": "e"}, _private_blob)
    if readable:
        assert all(p.stat().st_mode & 0o004 for p in (entry.path, *entry.path.rglob("*")))
    else:  # a private cache: nothing is widened (its folder keeps other users out anyway)
        assert (entry.path / "a.bin").stat().st_mode & 0o777 == 0o640


def _look_up_as_another_user(root, parts, answers):
    if os.geteuid() == 0:  # root reads every file: the lookup runs as nobody
        os.setgid(65534)
        os.setuid(65534)
    try:
        Cache(root).lookup(parts)
        answers.put("served")
    except Exception as error:  # noqa: BLE001 - the answer is what the test reads
        answers.put(f"{type(error).__name__}: {error}")


def test_an_unreadable_cache_file_is_named_as_unreadable_not_damaged():
    """A forked process (the modules already loaded) of another user, or a file of mode 0 for a user who is not
    root, reads an entry whose file it may not read: the file is named, with its owner and mode."""
    import shutil
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp(prefix="kasoku-unreadable-"))
    try:
        os.chmod(folder, 0o755)
        entry = Cache(folder / "cache").get_or_build({"kind": "e"}, write_files)
        os.chmod(entry.path / "a.bin", 0o600 if os.geteuid() == 0 else 0o000)
        context = multiprocessing.get_context("fork")
        answers = context.Queue()
        child = context.Process(target=_look_up_as_another_user, args=(folder / "cache", {"kind": "e"}, answers))
        child.start()
        answer = answers.get(timeout=60)
        child.join(timeout=60)
        assert answer.startswith("CacheError: cache file ") and "a.bin (owner " in answer, answer
        assert "is unreadable by this user" in answer and "chmod -R a+rX" in answer and "damaged" not in answer
    finally:
        os.chmod(folder, 0o755)
        shutil.rmtree(folder, ignore_errors=True)
