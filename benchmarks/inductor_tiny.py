"""The inductor backend on the built-in tiny pipeline, beside ONNX Runtime and OpenVINO.

    python benchmarks/inductor_tiny.py [--threads 2] [--repeats 20] [--no-auto]

- compile: `kasoku compile` of the txt2img components per contender (backend and precision), in a new
  process on an empty cache (cold), then again in a new process on that cache (warm: each engine's load).
- auto: a cold `kasoku compile --backend auto` of the same components, with and without
  KASOKU_AUTO_INDUCTOR=1: what measuring inductor among the CPU candidates costs and what it wins.
- speed: every contender's U-Net, loaded in one process from its warm cache, called in turns (a noisy
  machine slows all of them alike) at the profile's optimum and maximum; median and min of the repeats,
  with max|Δ| against torch fp32 and whether the output keeps its precision's contract.

bf16 contenders run only where the CPU has native bf16. Writes
benchmarks/results/<date>-<host>-inductor_tiny.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TXT2IMG = ("text_encoder", "unet", "vae_decoder")
CONTENDERS = ("onnxruntime:fp32", "openvino:fp32", "inductor:fp32", "openvino:bf16", "inductor:bf16")


def kasoku_compile(model: Path, backend: str, precision: str, cache: Path, threads: int,
                   env: dict[str, str] | None = None) -> dict:
    """`kasoku compile` in a new process; its report, reduced to what the tables show."""
    report_file = cache.with_name(f"{cache.name}-{time.monotonic_ns()}.json")
    command = [sys.executable, "-m", "kasoku.cli", "compile", str(model), "--backend", backend, "--precision",
               precision, "--components", *TXT2IMG, "--cache-dir", str(cache), "--threads", str(threads),
               "--json", str(report_file)]
    start = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    report = json.loads(report_file.read_text())
    stages: dict[str, dict[str, float]] = {}
    for s in report["stages"]:
        stages.setdefault(s["component"], {})[s["stage"]] = round(s["seconds"], 2)
    return {"wall_s": wall, "seconds": report["seconds"], "built": report["built"], "backends": report["backends"],
            "stages": stages, "load_seconds": report["load_seconds"]}


def speed(model: Path, caches: dict[str, Path], threads: int, repeats: int) -> dict:
    """Each contender's U-Net from its warm cache, called in turns; torch eager fp32 beside them."""
    from kasoku.core.components import Precision
    from kasoku.core.parity import compare_output
    from kasoku.model.loading import load_pipeline
    from kasoku.model.pipeline_model import component_specs
    from kasoku.pipeline.compiling import compile_components

    torch.set_num_threads(threads)
    spec = component_specs(load_pipeline(model), None, ["unet"])["unet"]
    runs = {"torch:fp32": lambda inputs: spec.run_torch(inputs)}
    for name, cache in caches.items():
        backend, precision = name.split(":")
        engines, _ = compile_components(model, backend=backend, precision=precision, components=["unet"],
                                        cache=cache, threads=threads)
        runs[name] = engines["unet"].run
    results = {}
    for which in ("opt", "max"):
        shape = getattr(spec.profile, which)
        inputs = spec.sample_inputs(shape, seed=3)
        reference = spec.run_torch(inputs)["out_sample"]
        times: dict[str, list[float]] = {name: [] for name in runs}
        outputs = {name: run(inputs)["out_sample"] for name, run in runs.items()}  # warm-up
        for _ in range(repeats):
            for name, run in runs.items():
                start = time.perf_counter()
                run(inputs)
                times[name].append(time.perf_counter() - start)
        results[which] = {
            "shape": {k: list(v.shape) for k, v in inputs.items()},
            "contenders": {name: {
                "median_ms": statistics.median(t) * 1e3, "min_ms": min(t) * 1e3,
                "check": compare_output("unet", "out_sample", str(shape), reference, outputs[name],
                                        Precision(name.split(":")[1])).to_dict()} for name, t in times.items()},
        }
    return results


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = ["# kasoku inductor_tiny: the inductor backend on the tiny SD 1.x pipeline", "",
             f"{m['date']} · {m['cpu']} ({', '.join(m['flags'])}) · {m['threads']} threads · torch {m['torch']} · "
             f"load average at the start {m['load_average']}", "",
             "## Compile (`kasoku compile`, text_encoder + unet + vae_decoder, default profile, each in a new process)",
             "", "| contender | cold s | per component (stage s) | warm s (whole process) | warm: engine loads s |",
             "| --- | --- | --- | --- | --- |"]
    for name, r in report["compile"].items():
        per = "; ".join(f"{c}: " + " ".join(f"{st} {v}" for st, v in s.items()) for c, s in r["cold"]["stages"].items())
        loads = ", ".join(f"{c} {v * 1e3:.0f} ms" for c, v in r["warm"]["load_seconds"].items())
        lines.append(f"| {name} | {r['cold']['seconds']:.1f} | {per} | {r['warm']['wall_s']:.1f} | {loads} |")
    if report.get("auto"):
        lines += ["", "## Cold `auto` (fp32): the CPU candidates with and without inductor", "",
                  "| candidates | cold s | chosen |", "| --- | --- | --- |"]
        for name, r in report["auto"].items():
            chosen = ", ".join(f"{c}={b}" for c, b in r["backends"].items())
            lines.append(f"| {name} | {r['seconds']:.1f} | {chosen} |")
    lines += ["", "## One U-Net call (in turns, median and min of the repeats)", "",
              "| shape | contender | median ms | min ms | max abs vs torch fp32 | contract |",
              "| --- | --- | --- | --- | --- | --- |"]
    for which, r in report["speed"].items():
        for name, c in r["contenders"].items():
            check = c["check"]
            lines.append(f"| {which} {r['shape']['sample']} | {name} | {c['median_ms']:.1f} | {c['min_ms']:.1f} | "
                         f"{check['max_abs']:.1e} | {'passed' if check['passed'] else 'FAILED'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-auto", action="store_true", help="skip the two cold `auto` compiles")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from kasoku.backends import AUTO_INDUCTOR_ENV
    from kasoku.backends import inductor as inductor_backend
    from kasoku.backends.base import cpu_flags, cpu_name
    from kasoku.backends.openvino import native_bf16
    from kasoku.core.console import console, quiet_third_party_logs
    from kasoku.tools.tiny import write_tiny_pipeline

    quiet_third_party_logs()
    work = Path(tempfile.mkdtemp(prefix="kasoku-inductor-tiny-"))
    model = write_tiny_pipeline(work / "tiny-sd")
    bf16 = native_bf16() and inductor_backend.native_bf16()
    contenders = [c for c in CONTENDERS if bf16 or not c.endswith(":bf16")]
    report: dict = {"machine": {"date": datetime.date.today().isoformat(), "host": socket.gethostname(),
                                "cpu": cpu_name(), "flags": cpu_flags(), "threads": args.threads,
                                "torch": torch.__version__, "load_average": os.getloadavg()[0]},
                    "compile": {}, "auto": {}}
    caches = {}
    for name in contenders:
        backend, precision = name.split(":")
        caches[name] = work / f"cache-{backend}-{precision}"
        console.log(f"compile {name}: cold, then warm")
        cold = kasoku_compile(model, backend, precision, caches[name], args.threads)
        warm = kasoku_compile(model, backend, precision, caches[name], args.threads)
        report["compile"][name] = {"cold": cold, "warm": warm}
    if not args.no_auto:
        for label, env in (("onnxruntime, openvino", {AUTO_INDUCTOR_ENV: "0"}),
                           ("onnxruntime, openvino, inductor", {AUTO_INDUCTOR_ENV: "1"})):
            console.log(f"cold auto: {label}")
            cache = work / f"cache-auto-inductor-{env[AUTO_INDUCTOR_ENV]}"
            report["auto"][label] = kasoku_compile(model, "auto", "fp32", cache, args.threads, env)
    console.log("one U-Net call per contender, in turns")
    report["speed"] = speed(model, caches, args.threads, args.repeats)
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"{report['machine']['date']}-{report['machine']['host']}-inductor_tiny"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    stem.with_suffix(".md").write_text(markdown(report) + "\n")
    console.print(markdown(report), markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
