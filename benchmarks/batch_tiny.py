"""`kasoku batch` throughput on the built-in tiny pipeline: in this process, and on a local Ray
instance with 1 and 2 workers, plus what starting a Ray worker costs (imports, model, engines
from the cache).

    python benchmarks/batch_tiny.py [--jobs 96] [--steps 20] [--batch-size 4] [--repeats 3]

Writes benchmarks/results/<date>-<machine>-batch-tiny.md and .json. Images/s counts the
generating phase only (first worker ready → last image written); "wall s" is the whole run,
start-up included. The engines are compiled once before anything is timed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

# (label, ray?, workers, threads per engine, batch size or None for --batch-size)
SETUPS = [
    ("local, 1 process, batch 1", False, 1, None, 1),
    ("local, 1 process", False, 1, None, None),
    ("local, 1 process, 1 thread", False, 1, 1, None),
    ("ray, 1 worker", True, 1, 1, None),
    ("ray, 2 workers", True, 2, 1, None),
]


def write_prompts(path: Path, jobs: int, steps: int) -> Path:
    lines = [json.dumps({"prompt": f"a photo of thing number {i}", "seed": i, "steps": steps}) for i in range(jobs)]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_once(model: Path, prompts: Path, cache: Path, out: Path, *, ray: bool, workers: int, threads: int | None,
             batch_size: int):
    from kasoku.batch import prepare, read_jobs, run_local, run_ray

    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    plan = prepare(model, read_jobs(prompts), out, batch_size=batch_size, backend="onnxruntime", cache_dir=cache,
                   threads=threads)  # CompileOptions fields
    result = run_ray(plan, workers=workers) if ray else run_local(plan)
    return result, time.perf_counter() - start


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=96)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kasoku.batch import PipelineRecipe, batch_profile
    from kasoku.core.console import console, quiet_third_party_logs
    from kasoku.core.options import CompileOptions
    from kasoku.model.loading import load_pipeline
    from kasoku.tools.tiny import write_tiny_pipeline

    quiet_third_party_logs()
    work = Path(tempfile.mkdtemp(prefix="kasoku-batch-bench-"))
    model = write_tiny_pipeline(work / "tiny-sd")
    cache = work / "cache"
    prompts = write_prompts(work / "prompts.jsonl", args.jobs, args.steps)
    start = time.perf_counter()
    reference = load_pipeline(model)
    PipelineRecipe(str(model), CompileOptions(backend="onnxruntime", cache_dir=cache,
                                              profile=batch_profile(reference, max(args.batch_size, 1)))
                   ).load(reference)
    compile_seconds = time.perf_counter() - start
    console.log(f"compiled the tiny engines in {compile_seconds:.1f} s")

    load_before = os.getloadavg()[0]
    rows = []
    for label, ray, workers, threads, batch_size in SETUPS:
        runs = []
        for repeat in range(args.repeats):
            result, wall = run_once(model, prompts, cache, work / "out", ray=ray, workers=workers, threads=threads,
                                    batch_size=batch_size or args.batch_size)
            runs.append({"images_per_second": result.images_per_second, "seconds": result.seconds, "wall_s": wall,
                         "workers": [w.__dict__ for w in result.workers]})
            console.log(f"{label} #{repeat + 1}: {result.images_per_second:.2f} img/s, {wall:.1f} s wall")
        rows.append({"setup": label, "ray": ray, "workers": workers, "threads": threads,
                     "batch_size": batch_size or args.batch_size, "runs": runs})

    report = {
        "date": datetime.date.today().isoformat(),
        "machine": {"host": socket.gethostname(), "cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(), "python": platform.python_version()},
        "model": "built-in tiny SD 1.x pipeline (kasoku tiny), onnxruntime, fp32",
        "jobs": args.jobs, "steps": args.steps, "size": "64x64", "guidance": 7.5, "repeats": args.repeats,
        "compile_seconds": round(compile_seconds, 2),
        # the machine may be shared: the 1-minute load average around the timed runs says how busy it was
        "load_average_1m": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        "setups": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"{report['date']}-{report['machine']['host']}-batch-tiny"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(report) + "\n")
    console.print(markdown(report), markup=False)
    shutil.rmtree(work, ignore_errors=True)
    return stem


def _median(values) -> float:
    return statistics.median(values) if values else float("nan")


def markdown(report: dict) -> str:
    from kasoku.tools.info import system_info

    cpu = system_info()["machine"]["cpu"]
    lines = [
        "# kasoku batch: built-in tiny SD 1.x pipeline",
        "",
        f"{report['date']} · {cpu} · {report['machine']['cores']} cores · {report['jobs']} jobs of "
        f"{report['size']}, {report['steps']} steps, guidance {report['guidance']} · onnxruntime fp32 · "
        f"median of {report['repeats']} runs · engines compiled once beforehand ({report['compile_seconds']} s) · "
        f"1-minute load average {report['load_average_1m']['before']} before, {report['load_average_1m']['after']} "
        "after",
        "",
        "| setup | threads per engine | batch size | images/s (min–max) | wall s, start-up included |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in report["setups"]:
        rates = [r["images_per_second"] for r in row["runs"]]
        walls = [r["wall_s"] for r in row["runs"]]
        lines.append(f"| {row['setup']} | {row['threads'] or 'runtime default'} | {row['batch_size']} | "
                     f"{_median(rates):.2f} ({min(rates):.2f}–{max(rates):.2f}) | {_median(walls):.1f} |")
    lines += ["", "Start-up of one worker (median over its runs and workers, seconds):", "",
              "| setup | ready (driver's view) | imports | model (diffusers) | engines from the cache |",
              "| --- | --- | --- | --- | --- |"]
    for row in report["setups"]:
        workers = [w for r in row["runs"] for w in r["workers"]]
        ready = [w["startup_seconds"] for w in workers if w["startup_seconds"] is not None]
        lines.append(f"| {row['setup']} | {f'{_median(ready):.2f}' if ready else '-'} | "
                     f"{_median([w['import_seconds'] for w in workers]):.2f} | "
                     f"{_median([w['model_seconds'] for w in workers]):.2f} | "
                     f"{_median([w['engine_seconds'] for w in workers]):.2f} |")
    lines += ["", "Local runs load in the process that checked the jobs, which has already imported everything "
              "and loaded the model; a Ray worker is a fresh process and pays both."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
