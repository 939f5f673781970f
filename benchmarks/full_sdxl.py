"""SDXL at full size, random weights, fp32: U-Net step and VAE decode at 1024x1024.

    python benchmarks/full_sdxl.py [--repeats 3] [--threads 2] [--components unet,vae_decoder]
                                   [--backends onnxruntime,openvino] [--deepcache] [--smoke]

The SDXL base architecture (2.6B-parameter U-Net with added size/crop conditioning, the
SDXL VAE) cannot sit in 24 GiB twice: torch's U-Net is 10.3 GB in fp32, and so is every
runtime's copy. So each contender runs in its own process, one after the other, in one run:

1. `torch` (per component): builds the component with seeded random weights, times torch
   eager (FLOPs counted on the warm-up call), saves the inputs and outputs, then exports the
   ONNX file with kasoku (parity is checked against the saved outputs in step 2 instead of
   holding torch and ONNX Runtime at once);
2. `engine` (per component and backend): kasoku compiles that ONNX file through the cache
   (optimize, engine build) with every torch module on the meta device, times the engine
   after a warm-up and compares with torch's outputs.

With --deepcache, the step-cache graphs (unet_full, unet_shallow: DeepCache's full and shallow U-Net,
branch 0) go through the same two stages (`stage_deepcache`), for one step of each and the shallow
graph's share of the FLOPs.

--smoke runs the same stages on kasoku's tiny SDXL pipeline at 64x64 (a check of this script; results
under /tmp/kasoku-full_sdxl-smoke).

The matmul rate for the FLOP floor is measured once at the start, in the parent. Each stage
reports its peak resident memory (VmHWM); the largest is the run's peak. BENCHMARK.md's
rules otherwise hold: same inputs, threads and precision, median of repeats after warm-up.
Writes benchmarks/results/<date>-<host>-full_sdxl.md and .json. About an hour on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
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
WORK = HERE / ".models" / "sdxl-work"
RESULTS = HERE / "results"
SIZE = 1024
SMOKE_DIR = Path("/tmp/kasoku-full_sdxl-smoke")  # --smoke: the tiny SDXL pipeline, results kept apart
SMOKE = False
SEEDS = {"text_encoder": 1, "text_encoder_2": 2, "unet": 3, "vae": 4}

# stabilityai/stable-diffusion-xl-base-1.0's configurations.
UNET = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
    use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,
)
VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, sample_size=1024,
    block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, scaling_factor=0.13025, force_upcast=True,
)
TEXT = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
            max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu")
TEXT_2 = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
              num_attention_heads=20, max_position_embeddings=77, projection_dim=1280, hidden_act="gelu")


def _module(name: str, real: bool, build):
    """Seeded random weights when `real`, else the architecture on the meta device (no memory)."""
    if not real:
        with torch.device("meta"):
            return build()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEEDS[name])
        return build()


def use_smoke_model() -> None:
    """Point every stage at the tiny SDXL pipeline (64x64) and keep its results apart."""
    global SMOKE, WORK, RESULTS, SIZE
    SMOKE, WORK, RESULTS, SIZE = True, SMOKE_DIR / "work", SMOKE_DIR / "results", 64


def sdxl_pipeline(real: tuple[str, ...] = ()):
    """The SDXL base pipeline at full size; only the modules named in `real` hold weights (--smoke: the tiny
    SDXL pipeline, every module with its deterministic weights)."""
    from diffusers import AutoencoderKL, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from kasoku.architectures.tiny import tiny_tokenizer
    from kasoku.families import FAMILIES

    if SMOKE:
        return FAMILIES["sdxl"].tiny_pipeline()

    tokenizer, tokenizer_2 = tiny_tokenizer(), tiny_tokenizer("!")  # real CLIP BPE; ids inside the full vocab

    def text(config, cls, tok):
        return cls(CLIPTextConfig(**config, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id))

    return StableDiffusionXLPipeline(
        vae=_module("vae", "vae" in real, lambda: AutoencoderKL(**VAE)),
        text_encoder=_module("text_encoder", "text_encoder" in real, lambda: text(TEXT, CLIPTextModel, tokenizer)),
        text_encoder_2=_module("text_encoder_2", "text_encoder_2" in real,
                               lambda: text(TEXT_2, CLIPTextModelWithProjection, tokenizer_2)),
        tokenizer=tokenizer, tokenizer_2=tokenizer_2,
        unet=_module("unet", "unet" in real, lambda: UNet2DConditionModel(**UNET)),
        scheduler=FAMILIES["sdxl"].tiny_scheduler("epsilon"), add_watermarker=False,
    )


def _module_of(component: str) -> str:
    """The pipeline attribute whose weights a component uses (the step-cache graphs are the U-Net's)."""
    return "vae" if component.startswith("vae") else "unet" if component.startswith("unet") else component


def _spec(pipe, component: str, size: int):
    from kasoku.core.components import ShapeProfile
    from kasoku.model.pipeline_model import component_specs

    profile = ShapeProfile.from_ranges((1, 1, 1), (size,) * 3, (size,) * 3, 32)  # one image, with guidance
    return component_specs(pipe, profile, [component])[component]


def _peak_mb() -> float:
    from kasoku.tools.benchmark import rss_mb

    return rss_mb("VmHWM")


def _repeat(fn, repeats: int) -> tuple[list[float], dict]:
    """Seconds of each of `repeats` calls, and the last call's outputs."""
    samples, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        samples.append(time.perf_counter() - start)
    return samples, out


# ---- stages (each in its own process) --------------------------------------------------------------


def stage_torch(component: str, size: int, repeats: int, work: Path, export: bool = True) -> dict:
    from kasoku.build.export import export_component
    from kasoku.core.components import ImageShape
    from kasoku.tools.benchmark import count_flops

    start = time.perf_counter()
    pipe = sdxl_pipeline(real=(_module_of(component),))
    spec = _spec(pipe, component, size)
    build_s = time.perf_counter() - start
    inputs = spec.sample_inputs(ImageShape(1, size, size), seed=3)
    start = time.perf_counter()
    flops = count_flops(spec, inputs)  # runs the call: the torch warm-up
    first = time.perf_counter() - start
    samples, reference = _repeat(lambda: spec.run_torch(inputs), repeats)
    np.savez(work / f"{component}-io.npz", **{f"in.{k}": v.numpy() for k, v in inputs.items()},
             **{f"out.{k}": v for k, v in reference.items()})
    result = {"stage": "torch", "component": component, "build_s": build_s, "gflop": flops / 1e9,
              "shapes": {k: list(v.shape) for k, v in inputs.items()}, "first_call_s": first, "seconds": samples,
              "peak_mb_torch": _peak_mb()}
    if export:
        exported = export_component(spec, work / "onnx" / component / "model.onnx", check_shapes=[])
        result.update(export_s=exported.seconds, onnx_bytes=exported.size_bytes)
    return {**result, "peak_mb": _peak_mb()}


def stage_engine(component: str, backend: str, size: int, repeats: int, threads: int, work: Path) -> dict:
    from kasoku.core.parity import compare_output
    from kasoku.pipeline.compiling import compile_components

    pipe = sdxl_pipeline()  # every module on the meta device: the engines need the specs, not the weights
    spec = _spec(pipe, component, size)
    io = np.load(work / f"{component}-io.npz")
    inputs = {k[3:]: io[k] for k in io.files if k.startswith("in.")}
    reference = {k[4:]: io[k] for k in io.files if k.startswith("out.")}
    start = time.perf_counter()
    engines, report = compile_components(
        pipe, backend=backend, specs={component: spec}, cache=work / "cache", onnx_dir=work / "onnx",
        check_parity=False, threads=threads, label="sdxl-random")
    compile_s = time.perf_counter() - start
    engine = engines[component]
    start = time.perf_counter()
    engine.run(inputs)
    first = time.perf_counter() - start
    samples, out = _repeat(lambda: engine.run(inputs), repeats)
    parity = [compare_output(component, name, f"1x{size}x{size}", reference[name], out[name]) for name in reference]
    worst = max(parity, key=lambda p: p.max_abs / p.limit)
    return {"stage": "engine", "component": component, "backend": backend, "compile_s": compile_s,
            "stages": {s.stage: s.seconds for s in report.stages}, "first_call_s": first, "seconds": samples,
            "max_abs_vs_torch": worst.max_abs, "tolerance": worst.limit, "parity_passed": worst.passed,
            "peak_mb": _peak_mb()}


DEEPCACHE_GRAPHS = ("unet_full", "unet_shallow")


def stage_deepcache(report: dict, args, common: list[str], log) -> None:
    """Step caching (DeepCache, branch 0): one U-Net step of the full graph and of the shallow graph, each as a
    component of its own (torch eager with its FLOPs, export, then each backend's engine), into report["deepcache"]."""
    entry = report.setdefault("deepcache", {})
    for graph in DEEPCACHE_GRAPHS:
        runs = entry[graph] = {"torch": _run_stage("torch", graph, None, common, args.work, log), "engines": {}}
        if not runs["torch"].get("failed"):
            for backend in args.backends.split(","):
                runs["engines"][backend] = _run_stage("engine", graph, backend, common, args.work, log)
        shutil.rmtree(args.work / "onnx", ignore_errors=True)
        shutil.rmtree(args.work / "cache", ignore_errors=True)


def _deepcache_lines(report: dict) -> list[str]:
    entry = report["deepcache"]
    full, shallow = (entry[g]["torch"] for g in DEEPCACHE_GRAPHS)
    if full.get("failed") or shallow.get("failed"):
        return ["", "Step caching: the torch stage of a graph failed; see the JSON."]
    lines = ["", f"## Step caching (DeepCache, branch 0): one U-Net step at {report['size']}x{report['size']}, batch 2",
             "", f"Shallow graph: {shallow['gflop']:.4g} GFLOP, **{shallow['gflop'] / full['gflop']:.1%}** of the full "
                 f"graph's {full['gflop']:.4g} GFLOP.", "",
             "| contender | full graph s | shallow graph s | shallow ÷ full (time) | full / shallow max abs vs torch |",
             "| --- | --- | --- | --- | --- |"]
    contenders = [("torch eager", full, shallow)]
    engines = [entry[g]["engines"] for g in DEEPCACHE_GRAPHS]
    contenders += [(f"kasoku {b}", engines[0][b], engines[1].get(b, {})) for b in engines[0]]
    for name, a, b in contenders:
        if a.get("failed") or b.get("failed") or not a or not b:
            lines.append(f"| {name} | failed | | | |")
            continue
        ta, tb = statistics.median(a["seconds"]), statistics.median(b["seconds"])
        check = "—" if name == "torch eager" else f"{a['max_abs_vs_torch']:.1e} / {b['max_abs_vs_torch']:.1e}"
        lines.append(f"| {name} | {ta:.2f} | {tb:.2f} | {tb / ta:.1%} | {check} |")
    return lines


# ---- the run ---------------------------------------------------------------------------------------


def _run_stage(stage: str, component: str, backend: str | None, common: list[str], work: Path, log) -> dict:
    """One stage in a fresh process, so that no two copies of the weights share the memory."""
    name = "-".join(filter(None, (stage, component, backend)))
    out = work / f"stage-{name}.json"
    args = ["--stage", stage, "--component", component, *(["--backend", backend] if backend else []), *common]
    log(f"stage {name}")
    result = subprocess.run([sys.executable, __file__, "--stage-json", str(out), *args])
    if result.returncode != 0:  # e.g. killed for memory: reported, and the run goes on
        return {"failed": True, "returncode": result.returncode}
    return json.loads(out.read_text())


def markdown(report: dict) -> str:
    lines = [f"# kasoku full_sdxl: SDXL base architecture, random weights, fp32, {report['size']}x{report['size']}",
             "",
             f"{report['date']} · {report['cpu']} · {report['threads']} threads · torch {report['torch']} · "
             f"fp32 matmul {report['matmul_gflops']:.0f} GFLOP/s · median of {report['repeats']} after warm-up · "
             f"each contender in its own process", "",
             "| component | contender | median s | min–max s | speed-up vs torch | FLOP floor s | time ÷ floor | "
             "max abs vs torch (tol) | cold compile s | first call s | peak RSS MB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for component, entry in report["components"].items():
        torch_run = entry["torch"]
        if torch_run.get("failed"):
            lines.append(f"| {component} | torch | failed (exit {torch_run['returncode']}) | | | | | | | | |")
            continue
        floor = torch_run["gflop"] / report["matmul_gflops"]
        base = statistics.median(torch_run["seconds"])
        for name, run in [("torch eager", torch_run), *entry["engines"].items()]:
            if run.get("failed"):
                lines.append(f"| {component} | kasoku {name} | failed (exit {run['returncode']}) | | | | | | | | |")
                continue
            median = statistics.median(run["seconds"])
            check = "—" if name == "torch eager" else (
                f"{run['max_abs_vs_torch']:.1e} ({run['tolerance']:.0e})"
                + ("" if run.get("parity_passed", True) else " **over**"))
            compile_s = f"{run['compile_s']:.0f}" if "compile_s" in run else f"export {run['export_s']:.0f}"
            label = name if name == "torch eager" else f"kasoku {name}"
            lines.append(f"| {component} | {label} | {median:.2f} | {min(run['seconds']):.2f}–{max(run['seconds']):.2f}"
                         f" | {base / median:.2f}× | {floor:.2f} | {median / floor:.2f} | {check} | {compile_s} | "
                         f"{run['first_call_s']:.1f} | {run['peak_mb']:.0f} |")
        lines.append(f"| {component} | shapes | {torch_run['shapes']} | {torch_run['gflop']:.0f} GFLOP | | | | | | | |")
    if "deepcache" in report:
        lines += _deepcache_lines(report)
    lines += ["", f"Peak resident memory of the run (largest stage): {report['peak_mb'] / 1024:.1f} GiB."]
    retimed = [c for c, e in report["components"].items() if e["torch"].get("retimed")]
    if retimed:
        first = {c: ", ".join(f"{s:.1f}" for s in report["components"][c]["torch"]["first_run_seconds"])
                 for c in retimed}
        lines.append(f"Torch eager of {', '.join(retimed)} timed again alone on the machine (`--retime-torch`); the "
                     "first timings, taken while another job ran: " + "; ".join(f"{c} {s} s" for c, s in first.items())
                     + ".")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--size", type=int, default=SIZE, help=f"image height and width (default {SIZE})")
    parser.add_argument("--components", default="unet,vae_decoder")
    parser.add_argument("--backends", default="onnxruntime,openvino")
    parser.add_argument("--work", type=Path, default=WORK, help="scratch folder (~50 GB free disk for the U-Net)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the torch stage (timings, outputs, ONNX file) a stopped run left in --work")
    parser.add_argument("--retime-torch", metavar="COMPONENTS",
                        help="time torch eager again for these components (no export) and update today's results; "
                             "for a torch stage that shared the machine with another job")
    parser.add_argument("--deepcache", action="store_true",
                        help="step caching: also time one step of the U-Net's full and shallow graphs (unet_full, "
                             "unet_shallow) per backend; with --components '' only those")
    parser.add_argument("--smoke", action="store_true",
                        help=f"run the stages on the built-in tiny SDXL pipeline at 64x64 (a check of this script; "
                             f"results under {SMOKE_DIR})")
    parser.add_argument("--no-export", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", choices=("torch", "engine"), help=argparse.SUPPRESS)
    parser.add_argument("--component", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--stage-json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        full_size = (WORK, SIZE)
        use_smoke_model()
        args.work = WORK if args.work == full_size[0] else args.work
        args.size = SIZE if args.size == full_size[1] else args.size

    from kasoku.core.console import console, quiet_third_party_logs

    quiet_third_party_logs()
    torch.set_num_threads(args.threads)
    if args.stage:
        args.work.mkdir(parents=True, exist_ok=True)
        if args.stage == "torch":
            result = stage_torch(args.component, args.size, args.repeats, args.work, export=not args.no_export)
        else:
            result = stage_engine(args.component, args.backend, args.size, args.repeats, args.threads, args.work)
        args.stage_json.write_text(json.dumps(result, indent=2))
        return 0

    from kasoku.backends.base import cpu_name
    from kasoku.tools.benchmark import matmul_gflops

    def log(message: str) -> None:
        console.log(message, markup=False)

    if args.retime_torch:
        return retime_torch(args, log)
    if not args.resume:
        shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True, exist_ok=True)
    log("measuring the fp32 matmul rate")
    report = {"date": datetime.date.today().isoformat(), "host": socket.gethostname(), "cpu": cpu_name(),
              "threads": args.threads, "torch": torch.__version__, "repeats": args.repeats, "size": args.size,
              "matmul_gflops": matmul_gflops(), "components": {}}
    common = ["--repeats", str(args.repeats), "--threads", str(args.threads), "--work", str(args.work),
              "--size", str(args.size), *(["--smoke"] if args.smoke else [])]
    for component in filter(None, args.components.split(",")):
        entry = report["components"][component] = {"engines": {}}
        done = args.work / f"stage-torch-{component}.json"
        if args.resume and done.exists() and (args.work / "onnx" / component / "model.onnx").exists():
            log(f"stage torch-{component}: kept from the stopped run")
            entry["torch"] = json.loads(done.read_text())
        else:
            entry["torch"] = _run_stage("torch", component, None, common, args.work, log)
        if not entry["torch"].get("failed"):
            for backend in args.backends.split(","):
                entry["engines"][backend] = _run_stage("engine", component, backend, common, args.work, log)
        shutil.rmtree(args.work / "onnx", ignore_errors=True)  # free the disk before the next component
        shutil.rmtree(args.work / "cache", ignore_errors=True)
    if args.deepcache:
        stage_deepcache(report, args, common, log)
    write_report(report, _stem(report["date"], args.size))
    return 0


def _stem(date: str, size: int) -> Path:
    suffix = "" if size == SIZE else f"-{size}px"
    return RESULTS / f"{date}-{socket.gethostname()}-full_sdxl{suffix}"


def write_report(report: dict, stem: Path) -> None:
    from kasoku.core.console import console

    entries = [*report["components"].values(), *report.get("deepcache", {}).values()]
    runs = [r for e in entries for r in [e["torch"], *e["engines"].values()]]
    report["peak_mb"] = max((r["peak_mb"] for r in runs if "peak_mb" in r), default=0.0)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text(markdown(report) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    console.print(markdown(report), markup=False)
    console.print(f"wrote {stem}.md and .json")


def retime_torch(args, log) -> int:
    """Torch eager timed again, alone on the machine, into today's report (export figures kept)."""
    stem = _stem(datetime.date.today().isoformat(), args.size)
    report = json.loads(stem.with_suffix(".json").read_text())
    common = ["--repeats", str(args.repeats), "--threads", str(args.threads), "--work", str(args.work),
              "--size", str(args.size), "--no-export", *(["--smoke"] if args.smoke else [])]
    args.work.mkdir(parents=True, exist_ok=True)
    for component in args.retime_torch.split(","):
        old = report["components"][component]["torch"]
        new = _run_stage("torch", component, None, common, args.work, log)
        if new.get("failed"):
            log(f"torch-{component} failed again; the report keeps the first timing")
            continue
        report["components"][component]["torch"] = {
            **new, "export_s": old.get("export_s"), "onnx_bytes": old.get("onnx_bytes"),
            "peak_mb": max(new["peak_mb"], old.get("peak_mb", 0.0)), "retimed": True,
            "first_run_seconds": old.get("seconds")}
    write_report(report, stem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
