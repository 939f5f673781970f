"""`kasoku serve` on the built-in tiny pipeline: images/s and p50/p95 latency at concurrency 1, 4 and
16, with dynamic batching on (--max-batch 4) and off (--max-batch 1), beside `kasoku batch` on the
same jobs (same prompts, seeds, steps and size) in the same run.

    python benchmarks/serve_tiny.py [--requests 48] [--steps 20] [--max-batch 4] [--repeats 3] [--cache-dir DIR]

Each server is a real `kasoku serve` process on 127.0.0.1 (ONNX Runtime engines built for its
profile, compiled before anything is timed), loaded by client threads on this machine, each with
its own keep-alive connection: a request is one image; images/s is requests / wall time of a round,
latency is each request's, as its client saw it. `kasoku batch` (in this process, batch size
--max-batch) counts its generating phase. Writes benchmarks/results/<date>-<machine>-serve-tiny.md
and .json. Outputs are checked while timing: every answer is the image of its own seed, and the
server's images are compared with `kasoku batch`'s for the same jobs (max pixel difference).
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import datetime
import http.client
import io
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
CONCURRENCY = (1, 4, 16)
SIZE = 64


def job(i: int, steps: int) -> dict:
    return {"prompt": f"a photo of thing number {i}", "seed": i, "steps": steps}


# ---- a server and its load -------------------------------------------------------------------


class ServerProcess:
    def __init__(self, model: Path, cache: Path, max_batch: int, log: Path):
        command = [sys.executable, "-m", "kasoku.cli", "serve", str(model), "--backend", "onnxruntime",
                   "--cache-dir", str(cache), "--port", "0", "--max-batch", str(max_batch), "--log-level", "warning",
                   "--max-queue", "256"]
        self.log = log
        with open(log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            listening = re.search(r"listening on http://([\d.]+):(\d+)", text)
            if listening and re.search(r"^ready:", text, re.M):
                self.host, self.port = listening[1], int(listening[2])
                self.ready_line = re.search(r"^ready:.*$", text, re.M)[0]
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"kasoku serve exited:\n{text}")
            time.sleep(0.2)
        raise RuntimeError(f"kasoku serve was not ready in 600 s:\n{log.read_text(errors='replace')}")

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(120)


def load(server: ServerProcess, jobs: list[dict], concurrency: int) -> tuple[float, list[float], dict[int, str]]:
    """Every job once, `concurrency` at a time: (wall seconds, latencies, seed -> base64 PNG)."""
    lock = threading.Lock()
    todo = iter(jobs)
    latencies: list[float] = []
    images: dict[int, str] = {}

    def client() -> None:
        connection = http.client.HTTPConnection(server.host, server.port, timeout=300)
        try:
            while True:
                with lock:
                    body = next(todo, None)
                if body is None:
                    return
                start = time.perf_counter()
                connection.request("POST", "/v1/images/generations", json.dumps({**body, "size": f"{SIZE}x{SIZE}"}),
                                   {"Content-Type": "application/json"})
                response = connection.getresponse()
                answer = json.loads(response.read())
                seconds = time.perf_counter() - start
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {answer}")
                image = answer["data"][0]
                if image["seed"] != body["seed"]:
                    raise RuntimeError(f"asked for seed {body['seed']}, got {image['seed']}")
                with lock:
                    latencies.append(seconds)
                    images[body["seed"]] = image["b64_json"]
        finally:
            connection.close()

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(client) for _ in range(concurrency)]:
            future.result()
    wall = time.perf_counter() - start
    if len(images) != len(jobs):
        raise RuntimeError(f"{len(jobs)} requests, {len(images)} distinct answers")
    return wall, latencies, images


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def metrics_batch_sizes(server: ServerProcess) -> dict[str, float]:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=30)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    connection.close()
    values = {}
    for name in ("kasoku_serve_batch_size_sum", "kasoku_serve_batch_size_count"):
        values[name] = float(re.search(rf"^{name} (\S+)$", text, re.M)[1])
    return values


# ---- the run ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> Path:
    from kasoku.batch.jobs import DEFAULT_BATCH_SIZE

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48, help="requests (one image each) per timed round")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-batch", type=int, default=DEFAULT_BATCH_SIZE,
                        help="--max-batch with batching on, and kasoku batch's --batch-size (default: their default)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="engine cache (default: a new temporary folder, so the engines are built first)")
    args = parser.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import numpy as np
    from PIL import Image

    from kasoku.batch import parse_job, prepare, run_local
    from kasoku.batch.worker import PipelineRecipe
    from kasoku.core.console import console, quiet_third_party_logs
    from kasoku.core.options import CompileOptions
    from kasoku.serve.config import Size, prepare_serving
    from kasoku.tools.tiny import write_tiny_pipeline

    quiet_third_party_logs()
    work = Path(tempfile.mkdtemp(prefix="kasoku-serve-bench-"))
    model = write_tiny_pipeline(work / "tiny-sd")
    cache = args.cache_dir or work / "cache"
    jobs = [job(i, args.steps) for i in range(args.requests)]
    options = CompileOptions(backend="onnxruntime", cache_dir=cache)
    modes = {"batching on": args.max_batch, "batching off": 1}

    start = time.perf_counter()
    for max_batch in modes.values():  # each server's own engines (its exact profile), built before any timing
        config, reference = prepare_serving(model, options, sizes=(Size(SIZE, SIZE),), max_batch=max_batch)
        PipelineRecipe(config.model, config.options).load(reference)
    compile_seconds = time.perf_counter() - start
    console.log(f"compiled (or loaded) the servers' engines in {compile_seconds:.1f} s")
    load_before = os.getloadavg()[0]

    # Both servers stay up for the whole run and their rounds alternate (on, off, and at concurrency 16
    # also kasoku batch), so a shared machine's load falls on every contender alike.
    servers = {mode: ServerProcess(model, cache, max_batch, work / f"serve-{max_batch}.log")
               for mode, max_batch in modes.items()}
    prompts = [parse_job(json.dumps(body), i + 1, "bench") for i, body in enumerate(jobs)]
    batch_dir = work / "batch"

    def run_batch() -> dict:
        shutil.rmtree(batch_dir, ignore_errors=True)
        plan = prepare(model, prompts, batch_dir, batch_size=args.max_batch, options=options)
        result = run_local(plan)
        return {"wall_s": result.seconds, "images_per_second": result.images_per_second}

    rows, server_images, batch_runs = [], {}, []
    try:
        for mode, server in servers.items():
            console.log(f"{mode}: {server.ready_line}")
        run_batch()  # compiles kasoku batch's engines (its own profile): not counted
        for concurrency in CONCURRENCY:
            runs = {mode: [] for mode in servers}
            before = {}
            for mode, server in servers.items():
                load(server, [job(10_000 + i, args.steps) for i in range(2 * concurrency)], concurrency)  # warm-up
                before[mode] = metrics_batch_sizes(server)
            for repeat in range(args.repeats):
                for mode, server in servers.items():
                    wall, latencies, images = load(server, jobs, concurrency)
                    server_images.setdefault(mode, images)
                    runs[mode].append({"wall_s": round(wall, 3), "images_per_second": round(len(jobs) / wall, 3),
                                       "p50_s": round(percentile(latencies, 50), 4),
                                       "p95_s": round(percentile(latencies, 95), 4)})
                    console.log(f"{mode}, concurrency {concurrency} #{repeat + 1}: "
                                f"{runs[mode][-1]['images_per_second']:.2f} img/s, p50 {runs[mode][-1]['p50_s']:.3f} "
                                f"s, p95 {runs[mode][-1]['p95_s']:.3f} s")
                if concurrency == CONCURRENCY[-1]:
                    batch_runs.append(run_batch())
                    console.log(f"kasoku batch #{repeat + 1}: {batch_runs[-1]['images_per_second']:.2f} img/s")
            for mode, server in servers.items():
                after = metrics_batch_sizes(server)
                calls = after["kasoku_serve_batch_size_count"] - before[mode]["kasoku_serve_batch_size_count"]
                served = after["kasoku_serve_batch_size_sum"] - before[mode]["kasoku_serve_batch_size_sum"]
                rows.append({"setup": f"kasoku serve, {mode}", "max_batch": modes[mode], "concurrency": concurrency,
                             "mean_batch_size": round(served / calls, 2) if calls else None, "runs": runs[mode]})
    finally:
        codes = {mode: server.stop() for mode, server in servers.items()}
    if any(codes.values()):
        raise RuntimeError(f"kasoku serve exited with {codes} after SIGTERM")
    rows.sort(key=lambda row: (row["setup"] != "kasoku serve, batching on", row["concurrency"]))
    rows.append({"setup": "kasoku batch (no HTTP)", "max_batch": args.max_batch, "concurrency": None,
                 "mean_batch_size": None, "runs": batch_runs})

    # a fast wrong answer is not a result: the server's images against batch's for the same jobs
    drift = {}
    for mode, images in server_images.items():
        worst = 0
        for i, body in enumerate(jobs):
            served = np.asarray(Image.open(io.BytesIO(base64.b64decode(images[body["seed"]]))).convert("RGB"))
            batched = np.asarray(Image.open(batch_dir / f"{prompts[i].id}.png").convert("RGB"))
            worst = max(worst, int(np.abs(served.astype(int) - batched.astype(int)).max()))
        drift[mode] = worst

    report = {
        "date": datetime.date.today().isoformat(),
        "machine": {"host": socket.gethostname(), "cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(), "python": platform.python_version()},
        "model": "built-in tiny SD 1.x pipeline (kasoku tiny), onnxruntime, fp32",
        "requests": args.requests, "steps": args.steps, "size": f"{SIZE}x{SIZE}", "guidance": 7.5,
        "repeats": args.repeats, "compile_seconds": round(compile_seconds, 2), "cache_given": bool(args.cache_dir),
        "load_average_1m": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        "max_pixel_difference_vs_batch": drift,
        "setups": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    suffix = "" if args.max_batch == DEFAULT_BATCH_SIZE else f"-max-batch-{args.max_batch}"
    stem = RESULTS / f"{report['date']}-{report['machine']['host']}-serve-tiny{suffix}"
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
    engines = (f"engines loaded from a cache an earlier run built ({report['compile_seconds']} s)"
               if report.get("cache_given") else f"engines compiled once beforehand ({report['compile_seconds']} s)")
    lines = [
        "# kasoku serve: built-in tiny SD 1.x pipeline",
        "",
        f"{report['date']} · {cpu} · {report['machine']['cores']} cores · {report['requests']} requests of one "
        f"{report['size']} image, {report['steps']} steps, guidance {report['guidance']} · onnxruntime fp32 · median "
        f"of {report['repeats']} rounds · {engines} · clients on the same machine · 1-minute load average "
        f"{report['load_average_1m']['before']} before, {report['load_average_1m']['after']} after",
        "",
        "| setup | max images per call | concurrency | images/s (min–max) | p50 latency s | p95 latency s "
        "| mean images per call |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["setups"]:
        rates = [r["images_per_second"] for r in row["runs"]]
        p50 = f"{_median([r['p50_s'] for r in row['runs']]):.3f}" if "p50_s" in row["runs"][0] else "-"
        p95 = f"{_median([r['p95_s'] for r in row['runs']]):.3f}" if "p95_s" in row["runs"][0] else "-"
        lines.append(f"| {row['setup']} | {row['max_batch']} | {row['concurrency'] or '-'} | {_median(rates):.2f} "
                     f"({min(rates):.2f}–{max(rates):.2f}) | {p50} | {p95} | {row['mean_batch_size'] or '-'} |")
    by = {(r["setup"], r["concurrency"]): _median([x["images_per_second"] for x in r["runs"]])
          for r in report["setups"]}
    on, off = by.get(("kasoku serve, batching on", 16)), by.get(("kasoku serve, batching off", 16))
    if on and off:
        lines += ["", f"At concurrency 16, dynamic batching serves {on / off:.2f}x the images/s of batching off."]
    if max(report["load_average_1m"].values()) > report["machine"]["cores"]:
        lines += ["", "The machine was shared during this run (load average above its core count): absolute figures "
                  "are below a quiet machine's; compare the rows of this run with each other only."]
    lines += ["", "Max pixel difference (0-255) of the server's images from `kasoku batch`'s for the same jobs: "
              + ", ".join(f"{mode} {value}" for mode, value in report["max_pixel_difference_vs_batch"].items())
              + " (each setup runs engines built for its own profile)."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
