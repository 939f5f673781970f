"""A step of Stable Diffusion 1.5's U-Net steered by a ControlNet, 512x512, fp32: the ControlNet and the U-Net
that takes its residuals, on each backend against torch eager, side by side, with the FLOP floor.

    python benchmarks/controlnet_sd15.py [--contenders torch,onnxruntime,openvino] [--threads 2] [--repeats 3]
                                         [--fresh-cache] [--tiny]

The model is full_sd15's (SD 1.5's architecture with random weights, benchmarks/.models/sd15-random) and a
ControlNet of SD 1.5's ControlNet architecture (ControlNetModel.from_unet: the U-Net's encoder and mid block,
the 16-32-96-256 conditioning embedding) with random weights, written once to
benchmarks/.models/sd15-controlnet-random. Each contender runs in its own process (the weights of two copies
do not share the memory); the torch stage counts the FLOPs (FlopCounterMode, which also warms up) and saves
the inputs and torch's outputs, so every other contender is checked against torch while it is timed. The
U-Net's residual inputs are the ControlNet's own outputs, as in a denoising step with guidance (batch 2).

`--tiny` runs the same stages on kasoku's tiny SD 1.x pipeline and tiny ControlNet at 64x64 (seconds), to
prove the stage works on a machine where the full size cannot run.

For benchmarks/full_sd15.py: `stage_controlnet(contender, args)` is a stage like its `speed` stage (it reads
args.repeats, args.threads, args.cache, args.work), and `markdown_controlnet(report)` the report's section:

    from controlnet_sd15 import markdown_controlnet, stage_controlnet
    STAGES["controlnet"] = stage_controlnet          # targets: --contenders
    lines += markdown_controlnet(report)             # in markdown(), after the speed section
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
CONTROLNET_DIR = HERE / ".models" / "sd15-controlnet-random"
TINY_DIR = HERE / ".models" / "tiny-sd-controlnet"
WORK = HERE / ".models" / "controlnet-work"
RESULTS = HERE / "results"
COMPONENTS = ("controlnet_0", "unet_controlnet")
SIZE = 512
TINY_SIZE = 64


def build_controlnet(directory: Path, model_dir: Path, seed: int = 0) -> Path:
    """SD 1.5's ControlNet architecture for the U-Net in `model_dir`, random weights, as a diffusers folder."""
    from diffusers import UNet2DConditionModel

    from kasoku.tiny import random_controlnet

    torch.manual_seed(seed)
    with torch.device("meta"):  # the U-Net only lends its config: no 3.4 GB of weights for it
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(model_dir / "unet"))
    random_controlnet(unet).save_pretrained(directory, safe_serialization=True)
    return directory


def _models(args) -> tuple[Path, Path, int]:
    """(pipeline folder, ControlNet folder, image size) of the run."""
    if getattr(args, "tiny", False):
        return TINY_DIR, TINY_DIR / "controlnet", TINY_SIZE
    from full_sd15 import MODEL_DIR

    return MODEL_DIR, CONTROLNET_DIR, SIZE


def _profile(pipe, size: int):
    from kasoku.components import ShapeProfile, pixel_multiple

    return ShapeProfile.from_ranges((1, 1, 1), (size,) * 3, (size,) * 3, pixel_multiple(pipe))


def stage_controlnet(contender: str, args) -> dict:
    """The ControlNet and its U-Net, one call each after warm-up, median of repeats. torch counts the FLOPs
    and saves its inputs and outputs (the U-Net's residuals are the ControlNet's outputs); every other
    contender is kasoku's engine on that backend, checked against them."""
    from kasoku.benchmark import count_flops, rss_mb
    from kasoku.components import ImageShape, component_specs
    from kasoku.loading import load_pipeline
    from kasoku.parity import compare_output

    model, controlnet, size = _models(args)
    io_file = args.work / f"controlnet-io-{size}.npz"
    result: dict = {"components": {}}
    if contender == "torch":
        pipe = load_pipeline(model, controlnet=controlnet)
        specs = component_specs(pipe, _profile(pipe, size), COMPONENTS)
        saved, residuals = {}, {}
        for name, spec in specs.items():
            inputs = spec.sample_inputs(ImageShape(1, size, size), seed=3)
            if name == "unet_controlnet":  # the same step: the ControlNet's inputs and outputs
                inputs = {k: residuals.get(k, saved.get(f"controlnet_0.in.{k}", v)) for k, v in inputs.items()}
                inputs = {k: torch.as_tensor(v) for k, v in inputs.items()}
            flops = count_flops(spec, inputs)  # runs the call: the warm-up
            samples, outputs = _repeat(lambda spec=spec, inputs=inputs: spec.run_torch(inputs), args.repeats)
            residuals = outputs
            saved.update({f"{name}.in.{k}": np.asarray(v) for k, v in inputs.items()})
            saved.update({f"{name}.out.{k}": v for k, v in outputs.items()})
            result["components"][name] = {"seconds": samples, "gflop": flops / 1e9,
                                          "shapes": {k: list(v.shape) for k, v in inputs.items()}}
        np.savez(io_file, **saved)
    else:
        from kasoku.build import compile_components

        io = np.load(io_file)
        pipe = load_pipeline(model, lazy=True, controlnet=controlnet)
        engines, report = compile_components(pipe, backend=contender, components=COMPONENTS,
                                             profile=_profile(pipe, size), cache=args.cache, threads=args.threads,
                                             label=f"{model.name}+controlnet")
        result["compile_s"] = report.seconds
        for name, engine in engines.items():
            inputs = {k.split(".", 2)[2]: io[k] for k in io.files if k.startswith(f"{name}.in.")}
            reference = {k.split(".", 2)[2]: io[k] for k in io.files if k.startswith(f"{name}.out.")}
            engine.run(inputs)  # warm-up
            samples, outputs = _repeat(lambda engine=engine, inputs=inputs: engine.run(inputs), args.repeats)
            worst = max((compare_output(name, out, f"1x{size}x{size}", reference[out], outputs[out])
                         for out in reference), key=lambda p: p.max_abs / p.limit)
            result["components"][name] = {"seconds": samples, "max_abs_vs_torch": worst.max_abs,
                                          "tolerance": worst.limit, "passed": worst.passed}
    return {**result, "peak_mb": rss_mb("VmHWM")}


def _repeat(fn, repeats: int):
    samples, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        samples.append(time.perf_counter() - start)
    return samples, out


# ---- the report --------------------------------------------------------------------------------------


def markdown_controlnet(report: dict) -> list[str]:
    """The ControlNet section of a report holding `machine` (its matmul_gflops) and `controlnet` (contender ->
    stage result): a row per component and contender, and the whole step (ControlNet + U-Net)."""
    stage = report.get("controlnet", {})
    torch_run = stage.get("torch", {})
    if not torch_run.get("components"):
        return []
    rate = report.get("machine", {}).get("matmul_gflops") or 1.0
    shapes = torch_run["components"][COMPONENTS[0]]["shapes"]
    lines = [f"## A U-Net step with a ControlNet: the ControlNet, then the U-Net with its residuals "
             f"(sample {'x'.join(map(str, shapes['sample']))}, control image "
             f"{'x'.join(map(str, shapes['controlnet_cond']))}), median after warm-up", "",
             "| component | contender | median s | min–max | speed-up vs torch | FLOP floor s | time ÷ floor | "
             "max abs vs torch |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    rows = {**{c: c for c in COMPONENTS}, "step": "**ControlNet + U-Net step**"}
    gflop = {c: torch_run["components"][c]["gflop"] for c in COMPONENTS}
    gflop["step"] = sum(gflop.values())
    for row, title in rows.items():
        base = _median_of(torch_run, row)
        for name, run in stage.items():
            if run.get("failed") or not run.get("components"):
                continue
            median = _median_of(run, row)
            floor = gflop[row] / rate
            check = "—" if name == "torch" else _check(run, row)
            spread = "" if row == "step" else \
                f"{min(run['components'][row]['seconds']):.2f}–{max(run['components'][row]['seconds']):.2f}"
            lines.append(f"| {title} ({gflop[row]:.0f} GFLOP) | {name} | {median:.2f} | {spread} | "
                         f"{base / median:.2f}× | {floor:.2f} | {median / floor:.2f} | {check} |")
    failed = [name for name, run in stage.items() if run.get("failed")]
    lines += [""] + [f"The {name} stage failed (exit {stage[name]['returncode']})." for name in failed]
    return lines


def _median_of(run: dict, row: str) -> float:
    if row == "step":
        return sum(statistics.median(run["components"][c]["seconds"]) for c in COMPONENTS)
    return statistics.median(run["components"][row]["seconds"])


def _check(run: dict, row: str) -> str:
    parts = [run["components"][c] for c in (COMPONENTS if row == "step" else (row,))]
    worst = max(p["max_abs_vs_torch"] for p in parts)
    return f"{worst:.1e}" + ("" if all(p["passed"] for p in parts) else " **over**")


# ---- the run on its own ------------------------------------------------------------------------------


def _stem(tiny: bool) -> Path:
    name = "controlnet_sd15" + ("-tiny" if tiny else "")
    return RESULTS / f"{datetime.date.today().isoformat()}-{socket.gethostname()}-{name}"


def _run_stage(target: str, args, log) -> dict:
    """One contender in a fresh process; a failure (killed for memory, say) is recorded and the run goes on."""
    out = args.work / f"stage-controlnet-{target}.json"
    out.unlink(missing_ok=True)
    log(f"stage controlnet:{target}")
    command = [sys.executable, __file__, "--stage", target, "--stage-json", str(out), "--threads", str(args.threads),
               "--repeats", str(args.repeats), "--cache", str(args.cache), *(["--tiny"] if args.tiny else [])]
    start = time.perf_counter()
    code = subprocess.run(command).returncode
    if code != 0 or not out.exists():
        return {"failed": True, "returncode": code, "wall_s": time.perf_counter() - start}
    return {**json.loads(out.read_text()), "wall_s": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contenders", default="torch,onnxruntime,openvino",
                        help="torch first (it saves the inputs and outputs the others are checked against)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=None, help="the benchmark's kasoku cache")
    parser.add_argument("--fresh-cache", action="store_true", help="empty the cache first")
    parser.add_argument("--tiny", action="store_true", help="the tiny SD 1.x pipeline and ControlNet, 64x64")
    parser.add_argument("--stage", help=argparse.SUPPRESS)
    parser.add_argument("--stage-json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.work = WORK / ("tiny" if args.tiny else "full")
    args.work.mkdir(parents=True, exist_ok=True)
    args.cache = args.cache or args.work / "cache"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(HERE))

    from kasoku.console import console, quiet_third_party_logs

    quiet_third_party_logs()
    torch.set_num_threads(args.threads)
    if args.stage:
        args.stage_json.write_text(json.dumps(stage_controlnet(args.stage, args), indent=2, default=str))
        return 0

    def log(message: str) -> None:
        console.log(message, markup=False)

    model, controlnet, _ = _models(args)
    if args.tiny and not (model / "model_index.json").exists():
        from kasoku.tiny import write_tiny_pipeline

        shutil.rmtree(model, ignore_errors=True)
        write_tiny_pipeline(model, controlnet=True)
    if not args.tiny:
        from full_sd15 import build_sd15

        if not (model / "model_index.json").exists():
            log(f"building SD 1.5 with random weights into {model}")
            build_sd15(model)
        if not (controlnet / "config.json").exists():
            log(f"building SD 1.5's ControlNet with random weights into {controlnet}")
            build_controlnet(controlnet, model)
    if args.fresh_cache:
        shutil.rmtree(args.cache, ignore_errors=True)
    from full_sd15 import machine_description

    log("measuring the fp32 matmul rate")
    report = {"machine": machine_description(args.threads), "controlnet": {}}
    for target in args.contenders.split(","):
        report["controlnet"][target] = _run_stage(target, args, log)
    RESULTS.mkdir(exist_ok=True)
    stem = _stem(args.tiny)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    m = report["machine"]
    text = "\n".join([f"# kasoku controlnet_sd15{' (tiny)' if args.tiny else ''}: fp32, random weights", "",
                      f"{m['date']} · {m['cpu']} ({', '.join(m['flags']) or 'no AVX-512/AMX'}) · {m['threads']} "
                      f"threads · torch {m['torch']} · fp32 matmul {m['matmul_gflops']:.0f} GFLOP/s · each "
                      "contender in its own process", "", *markdown_controlnet(report),
                      "", f"Command: `python benchmarks/controlnet_sd15.py {' '.join(argv or sys.argv[1:])}`"])
    stem.with_suffix(".md").write_text(text + "\n")
    console.print(text, markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
