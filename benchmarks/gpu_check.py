"""One-shot GPU check: build, check and time kasoku's GPU backends on whatever NVIDIA GPU is here.

    python benchmarks/gpu_check.py [--models sd15,sdxl] [--budget-s 600] [--steps 30] [--repeats 3]
                                   [--trt-opt-level 3] [--keep-cache] [--dry-run]

Models: full-size SD 1.5 at 512x512 (benchmarks/full_sd15.py's build_sd15) and SDXL at 1024x1024
(benchmarks/full_sdxl.py's configurations), random weights, built once into benchmarks/.models/.
Per model, each stage in its own process (so its peak GPU memory is its own):

- reference: diffusers eager fp16 (its default SDPA attention) and the same pipeline with
  `torch.compile(unet)`: one image of --steps steps from fixed initial latents, compile time, median
  seconds of --repeats after a warm-up, peak GPU memory. The eager fp16 image is the reference image.
- <backend>: `inductor` fp16 (AOTInductor: torch's own compiler, the one accelerated path the lent GPU
  machines can run, so it comes first), native TensorRT fp16 and fp32, ONNX Runtime CUDA and the ONNX
  Runtime TensorRT provider (fp16); then, with budget left, TensorRT fp16 with CUDA graphs on exact-shape
  engines. Each: cold compile (export, optimize, engine seconds per component, in a fresh cache), parity
  per component against torch fp32 (on the GPU, TF32 off) at the profile's min, opt and max, the warm
  load (a second `kasoku.compile` on that cache: each engine's load), the same image (PSNR against
  diffusers fp16), its seconds and peak GPU memory.

A backend that cannot run here is skipped with the reason; stages are run in that order (SD 1.5 first)
until --budget-s is spent, and the rest are listed as not run. On a machine without an NVIDIA GPU it
prints what it would run and exits 0. Writes benchmarks/results/<date>-<host>-gpu_check.json and .md
after every stage. Targets, SD 1.5 at 512x512, 30 steps, against diffusers eager fp16 on the same GPU:
TensorRT fp16 at least 2.5x (issue 14), inductor fp16 at least 1.8x (issue 19); every image PSNR >= 30 dB
against diffusers fp16.

What travels to a lent GPU machine (no package index there, 64 MiB a call): this working tree and the
wheels benchmarks/gpu_wheels.py downloads (diffusers and TensorRT's pure-Python helpers).
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
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the sibling benchmarks' model builders
RESULTS = HERE / "results"
WORK = HERE / ".models" / "gpu-check"
PROMPT = "a photo of an astronaut riding a horse on mars"
SEED = 0
# SD 1.5 against diffusers eager fp16, per backend: the speed-up each must reach
TARGET_SPEEDUPS = {"sd15:tensorrt:fp16": 2.5, "sd15:inductor:fp16": 1.8}
TARGET_PSNR_DB = 30.0


@dataclass(frozen=True)
class Model:
    name: str
    title: str
    folder: Path
    size: int
    multiple: int  # the profile's min and max are one multiple below and above the size

    def profile(self, exact: bool = False):
        """One image with guidance; height and width from size - multiple to size + multiple."""
        from kasoku.components import ImageShape, ShapeProfile

        shape = ImageShape(1, self.size, self.size)
        if exact:
            return ShapeProfile.exact(shape, guidance=True, multiple=8)
        low, high = self.size - self.multiple, self.size + self.multiple
        return ShapeProfile.from_ranges((1, 1, 1), (low, self.size, high), (low, self.size, high), 8, guidance=True)


MODELS = {
    "sd15": Model("sd15", "SD 1.5 (random weights)", HERE / ".models" / "sd15-random", 512, 64),
    "sdxl": Model("sdxl", "SDXL base (random weights)", HERE / ".models" / "sdxl-random", 1024, 128),
}


@dataclass(frozen=True)
class Stage:
    model: str
    backend: str  # "reference" or a kasoku backend name
    precision: str = "fp16"
    cuda_graph: bool = False

    @property
    def name(self) -> str:
        suffix = "-cuda-graph" if self.cuda_graph else ""
        return f"{self.model}:{self.backend}" + ("" if self.backend == "reference" else f":{self.precision}{suffix}")


def plan(models: list[str]) -> list[Stage]:
    """Every stage, in the order they run: per model the reference, then the backends."""
    stages = []
    for model in models:
        # inductor first: on the lent machines (torch only) it is the one backend that runs, and the budget is short
        stages += [Stage(model, "reference"), Stage(model, "inductor", "fp16"), Stage(model, "tensorrt", "fp16"),
                   Stage(model, "tensorrt", "fp32"), Stage(model, "onnxruntime-cuda", "fp16"),
                   Stage(model, "onnxruntime-tensorrt", "fp16")]
        if model == "sd15":
            stages.append(Stage(model, "tensorrt", "fp16", cuda_graph=True))
    return stages


def why_not(stage: Stage) -> str | None:
    """Why `stage` cannot run here (None: it can), asked before a process is started for it."""
    if stage.backend == "reference":
        return None
    from kasoku.backends import BACKENDS, get_backend
    from kasoku.errors import KasokuError

    if stage.backend == "inductor" and "inductor" not in BACKENDS:
        return "kasoku.backends.BACKENDS has no 'inductor' backend in this checkout"
    try:
        backend = get_backend(stage.backend)
        backend.require()
        backend.check_precision(stage.precision)
    except KasokuError as error:
        return str(error)
    return None


# ---- measuring ---------------------------------------------------------------------------------------


class GpuMemoryPeak:
    """Peak device memory in use (every allocator: torch, TensorRT, ONNX Runtime) while the block runs,
    sampled every 20 ms, above what was in use when it began."""

    def __enter__(self):
        self.baseline = self.peak = self._used()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._used())

    @staticmethod
    def _used() -> int:
        free, total = torch.cuda.mem_get_info()
        return total - free

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._used())

    @property
    def mib(self) -> float:
        return (self.peak - self.baseline) / 2**20


def timed(fn, repeats: int) -> tuple[list[float], object]:
    """Seconds of each of `repeats` calls (device synchronised), and the last result."""
    samples, result = [], None
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return samples, result


def ensure_model(model: Model) -> None:
    if (model.folder / "model_index.json").exists():
        return
    if model.name == "sd15":
        from full_sd15 import build_sd15

        build_sd15(model.folder)
    else:
        from full_sdxl import sdxl_pipeline

        sdxl_pipeline(real=("vae", "text_encoder", "text_encoder_2", "unet")).save_pretrained(
            model.folder, safe_serialization=True)


def initial_latents(model: Model, work: Path) -> torch.Tensor:
    """The same initial latents for every pipeline (fp32, CPU), kept in the work folder."""
    path = work / f"{model.name}-latents.pt"
    if not path.exists():
        generator = torch.Generator().manual_seed(SEED)
        torch.save(torch.randn((1, 4, model.size // 8, model.size // 8), generator=generator), path)
    return torch.load(path)


def image(pipe, model: Model, latents: torch.Tensor, steps: int) -> np.ndarray:
    return pipe(PROMPT, num_inference_steps=steps, height=model.size, width=model.size, latents=latents,
                guidance_scale=7.5, output_type="np").images


# ---- stages (each in its own process) ----------------------------------------------------------------


def stage_reference(model: Model, args) -> dict:
    """diffusers eager fp16 (SDPA) and torch.compile(unet): compile time, seconds, image, peak memory."""
    from diffusers import DiffusionPipeline

    from kasoku.parity import psnr

    latents = initial_latents(model, args.work).to("cuda", torch.float16)
    result: dict = {}
    with GpuMemoryPeak() as memory:
        pipe = DiffusionPipeline.from_pretrained(model.folder, torch_dtype=torch.float16).to("cuda")
        pipe.set_progress_bar_config(disable=True)
        warmup, _ = timed(lambda: image(pipe, model, latents, args.steps), 1)
        seconds, eager = timed(lambda: image(pipe, model, latents, args.steps), args.repeats)
    np.save(args.work / f"{model.name}-diffusers-fp16.npy", eager)
    result["diffusers eager fp16"] = {"first_call_s": warmup[0], "seconds": seconds, "peak_gpu_mib": memory.mib,
                                      "attention": type(pipe.unet.attn_processors[next(iter(
                                          pipe.unet.attn_processors))]).__name__}
    with GpuMemoryPeak() as memory:
        pipe.unet = torch.compile(pipe.unet)
        first, _ = timed(lambda: image(pipe, model, latents, args.steps), 1)  # compiles
        seconds, compiled = timed(lambda: image(pipe, model, latents, args.steps), args.repeats)
    result["torch.compile fp16"] = {"compile_and_first_call_s": first[0], "seconds": seconds,
                                    "peak_gpu_mib": memory.mib, "psnr_db": psnr(eager, compiled)}
    return result


def _reference_outputs(spec, inputs: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """torch fp32 on the GPU, TF32 off: the parity reference."""
    from kasoku.attention import exportable_attention

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    module = spec.module.to("cuda", torch.float32)
    with torch.no_grad(), exportable_attention():
        outputs = module(*(inputs[name].to("cuda") for name in spec.input_names))
    return {name: out.float().cpu().numpy() for name, out in zip(spec.output_names, outputs)}


def inputs_at(spec, which: str, seed: int = 5) -> dict[str, torch.Tensor]:
    """Inputs at the profile's "min", "opt" or "max" shape of every input."""
    generator = torch.Generator().manual_seed(seed)
    index = ("min", "opt", "max").index(which)
    return {t.name: spec.sample_input(t, spec.profile_shapes()[t.name][index], generator) for t in spec.inputs}


def parity(engines: dict, precision: str) -> dict:
    """Per component, the worst output at the profile's min, opt and max, against torch fp32."""
    from kasoku.parity import compare_outputs

    rows = {}
    for name, engine in engines.items():
        spec = engine.spec
        rows[name] = {}
        for which in ("min", "opt", "max"):
            inputs = inputs_at(spec, which)
            results = compare_outputs(name, which, _reference_outputs(spec, inputs), engine.run(inputs), precision)
            worst = max(results, key=lambda r: r.rel_error)
            rows[name][which] = {"shapes": {k: list(v.shape) for k, v in inputs.items()}, "passed": all(
                r.passed for r in results), "rel_error": worst.rel_error, "max_abs": worst.max_abs,
                                 "nan": sum(r.nan for r in results)}
        spec.forget_module()
        torch.cuda.empty_cache()
    return rows


def stage_backend(model: Model, stage: Stage, args) -> dict:
    """Cold compile, per-component parity at min/opt/max, the warm load, the image against diffusers fp16,
    its seconds."""
    import kasoku
    from kasoku.compiling import compile_components
    from kasoku.families import family_of
    from kasoku.loading import load_pipeline
    from kasoku.parity import psnr

    # kasoku's own build-time parity check (torch on the CPU) is off: the check below replaces it, on the GPU
    options = dict(backend=stage.backend, precision=stage.precision, profile=model.profile(exact=stage.cuda_graph),
                   trt_opt_level=args.trt_opt_level, cuda_graph=stage.cuda_graph, check_parity=False,
                   components=family_of(load_pipeline(model.folder, lazy=True)).task_components("txt2img"))
    with GpuMemoryPeak() as build_memory:
        start = time.perf_counter()
        engines, report = compile_components(model.folder, cache=args.cache, label=model.name, **options)
        compile_s = time.perf_counter() - start
    stages: dict[str, dict[str, float]] = {}
    for record in report.stages:
        stages.setdefault(record.component, {})[record.stage] = round(record.seconds, 2)
    checked = parity(engines, stage.precision)
    del engines
    torch.cuda.empty_cache()
    reference = np.load(args.work / f"{model.name}-diffusers-fp16.npy")
    latents = initial_latents(model, args.work)
    with GpuMemoryPeak() as run_memory:
        diffusers_pipe = load_pipeline(model.folder)
        start = time.perf_counter()
        pipe = kasoku.compile(diffusers_pipe, cache=args.cache, label=model.name, **options)  # warm: loads only
        warm_s = time.perf_counter() - start
        pipe.set_progress_bar_config(disable=True)
        warmup, _ = timed(lambda: image(pipe, model, latents, args.steps), 1)
        seconds, images = timed(lambda: image(pipe, model, latents, args.steps), args.repeats)
    return {"compile_s": compile_s, "stages": stages, "precisions": report.precisions, "notes": report.notes,
            "warm_compile_s": warm_s, "warm_load_s": pipe.compile_report.load_seconds,
            "warm_built": pipe.compile_report.built, "parity": checked, "first_call_s": warmup[0],
            "seconds": seconds, "psnr_db": psnr(reference, images),
            "nan": int(np.isnan(images).sum()), "peak_gpu_mib_build": build_memory.mib,
            "peak_gpu_mib_run": run_memory.mib}


def run_stage(stage: Stage, args) -> dict:
    model = MODELS[stage.model]
    ensure_model(model)
    if stage.backend == "reference":
        return stage_reference(model, args)
    return stage_backend(model, stage, args)


# ---- the run -----------------------------------------------------------------------------------------


def machine() -> dict:
    from importlib import metadata

    from kasoku.backends.base import gpu_identity
    from kasoku.backends.tensorrt import installed_trt_version

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    identity = gpu_identity(0)
    return {"host": socket.gethostname(), "date": datetime.date.today().isoformat(),
            "gpu": str(identity), "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30,
            "torch": torch.__version__, "cuda": torch.version.cuda, "tensorrt": installed_trt_version(),
            "onnxruntime": version("onnxruntime"), "onnxruntime-gpu": version("onnxruntime-gpu"),
            "diffusers": version("diffusers"), "polygraphy": version("polygraphy")}


def _stem() -> Path:
    return RESULTS / f"{datetime.date.today().isoformat()}-{socket.gethostname()}-gpu_check"


def _write(report: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    _stem().with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    _stem().with_suffix(".md").write_text(markdown(report) + "\n")


def _launch(stage: Stage, args, timeout: float) -> dict:
    """`stage` in a fresh process, killed at `timeout` seconds; a failure is recorded and the run goes on."""
    out = args.work / f"stage-{stage.name.replace(':', '-')}.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, __file__, "--stage", json.dumps(stage.__dict__), "--stage-json", str(out),
               "--steps", str(args.steps), "--repeats", str(args.repeats), "--trt-opt-level",
               str(args.trt_opt_level), "--work", str(args.work)]
    start = time.perf_counter()
    try:
        code = subprocess.run(command, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return {"status": "stopped at the time budget", "wall_s": time.perf_counter() - start}
    if code != 0 or not out.exists():
        return {"status": f"failed (exit {code})", "wall_s": time.perf_counter() - start}
    return {"status": "done", **json.loads(out.read_text()), "wall_s": time.perf_counter() - start}


def describe_plan(stages: list[Stage]) -> str:
    lines = []
    for stage in stages:
        model = MODELS[stage.model]
        if stage.backend == "reference":
            what = (f"diffusers eager fp16 (SDPA) and torch.compile(unet): {model.title} at {model.size}x{model.size}, "
                    "one image, the reference image")
        else:
            graphs = " with CUDA graphs (exact shape)" if stage.cuda_graph else ""
            what = (f"kasoku {stage.backend} {stage.precision}{graphs}: cold compile, parity at min/opt/max, the "
                    "image's PSNR vs diffusers fp16, seconds, peak memory")
        lines.append(f"  {stage.name:40s} {what}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="sd15,sdxl", help="comma-separated, from sd15, sdxl (in this order)")
    parser.add_argument("--budget-s", type=float, default=600.0, help="start no stage after this (default 600)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trt-opt-level", type=int, default=3)
    parser.add_argument("--work", type=Path, default=WORK, help="scratch: latents, images, the cache")
    parser.add_argument("--keep-cache", action="store_true", help="reuse the last run's engines (compile is warm)")
    parser.add_argument("--dry-run", action="store_true", help="print what would run, and run nothing")
    parser.add_argument("--stage", help=argparse.SUPPRESS)
    parser.add_argument("--stage-json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.cache = args.work / "cache"
    if args.stage:
        from kasoku.console import quiet_third_party_logs

        quiet_third_party_logs()
        result = run_stage(Stage(**json.loads(args.stage)), args)
        args.stage_json.write_text(json.dumps(result, indent=2, default=str))
        return 0

    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    stages = plan(models)
    if args.dry_run or not torch.cuda.is_available():
        from kasoku.backends import BACKENDS

        why = "--dry-run" if args.dry_run else f"no NVIDIA GPU is visible to torch {torch.__version__}"
        inductor = "registered" if "inductor" in BACKENDS else "not registered in kasoku.backends.BACKENDS: skipped"
        print(f"gpu_check: {why}; nothing is run. On a GPU it would run, in this order, within "
              f"{args.budget_s:.0f} s (the inductor backend: {inductor}):\n{describe_plan(stages)}")
        return 0
    return run(stages, args)


def run(stages: list[Stage], args) -> int:
    deadline = time.perf_counter() + args.budget_s
    args.work.mkdir(parents=True, exist_ok=True)
    if not args.keep_cache:
        shutil.rmtree(args.cache, ignore_errors=True)
    report = {"machine": machine(), "steps": args.steps, "repeats": args.repeats, "budget_s": args.budget_s,
              "trt_opt_level": args.trt_opt_level, "command": " ".join(sys.argv), "stages": {}}
    for stage in stages:
        reason = why_not(stage)
        left = deadline - time.perf_counter()
        if reason is None and stage.backend != "reference" \
                and report["stages"].get(f"{stage.model}:reference", {}).get("status") != "done":
            reason = "the model's reference stage did not finish"
        if reason is not None:
            result = {"status": "skipped", "reason": reason}
        elif left < 30:
            result = {"status": "not run", "reason": f"the {args.budget_s:.0f} s budget was spent"}
        else:
            print(f"gpu_check: {stage.name} ({left:.0f} s of the budget left)", flush=True)
            result = _launch(stage, args, timeout=left)
        report["stages"][stage.name] = result
        _write(report)
    print(_stem().with_suffix(".md").read_text())
    return 0


# ---- the report --------------------------------------------------------------------------------------


def _median(values) -> float:
    return statistics.median(values)


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"# kasoku gpu_check: {m['gpu']}", "",
             f"{m['date']} · {m['host']} · {m['gpu_memory_gib']:.0f} GiB · torch {m['torch']} (CUDA {m['cuda']}) · "
             f"TensorRT {m['tensorrt']} · onnxruntime {m['onnxruntime']} / onnxruntime-gpu {m['onnxruntime-gpu']} · "
             f"diffusers {m['diffusers']} · {report['steps']} steps, median of {report['repeats']} after a warm-up · "
             f"`{report['command']}`", ""]
    for model in MODELS.values():
        rows = {name: r for name, r in report["stages"].items() if name.split(":")[0] == model.name}
        if not rows:
            continue
        lines += [f"## {model.title}, {model.size}x{model.size}, one image with guidance", "",
                  "| pipeline | s / image | vs diffusers eager fp16 | vs torch.compile | PSNR vs diffusers fp16 | "
                  "compile s | warm load s | peak GPU MiB (build / run) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        ref = rows.get(f"{model.name}:reference", {})
        eager = _median(ref["diffusers eager fp16"]["seconds"]) if ref.get("status") == "done" else None
        compiled = _median(ref["torch.compile fp16"]["seconds"]) if ref.get("status") == "done" else None
        if not eager:
            lines.append(f"| diffusers eager fp16 and torch.compile | {ref.get('status')}: {ref.get('reason', '')} "
                         "| | | | | | |")
        else:
            r = ref["diffusers eager fp16"]
            lines.append(f"| diffusers eager fp16 ({r['attention']}) | {eager:.2f} | 1.00× | {compiled / eager:.2f}× | "
                         f"reference | – | – | – / {r['peak_gpu_mib']:.0f} |")
            r = ref["torch.compile fp16"]
            lines.append(f"| diffusers + torch.compile(unet) fp16 | {compiled:.2f} | {eager / compiled:.2f}× | 1.00× | "
                         f"{r['psnr_db']:.1f} dB | {r['compile_and_first_call_s']:.0f} (first call) | "
                         f"– (compiles in every process) | – / {r['peak_gpu_mib']:.0f} |")
        for name, r in rows.items():
            if name.endswith(":reference"):
                continue
            label = "kasoku " + name.split(":", 1)[1].replace(":", " ")
            if r.get("status") != "done":
                lines.append(f"| {label} | {r.get('status')}: {r.get('reason', '')} | | | | | | |")
                continue
            seconds = _median(r["seconds"])
            target = " (target ≥ 30 dB)" if r["psnr_db"] < TARGET_PSNR_DB else ""
            warm = f"{sum(r['warm_load_s'].values()):.2f}" + (" (built again!)" if r["warm_built"] else "")
            lines.append(f"| {label} | {seconds:.2f} | {eager / seconds:.2f}× | {compiled / seconds:.2f}× | "
                         f"{r['psnr_db']:.1f} dB{target} | {r['compile_s']:.0f} | {warm} | "
                         f"{r['peak_gpu_mib_build']:.0f} / {r['peak_gpu_mib_run']:.0f} |" if eager else
                         f"| {label} | {seconds:.2f} | – | – | – | {r['compile_s']:.0f} | {warm} | |")
        lines.append("")
        lines += _parity_lines(rows)
        lines += _build_lines(rows)
    lines += _target_lines(report)
    return "\n".join(lines)


def _parity_lines(rows: dict) -> list[str]:
    out = ["Parity against torch fp32 (GPU, TF32 off), worst output's relative error at the profile's min / opt / max:",
           "", "| engine | component | min | opt | max |", "| --- | --- | --- | --- | --- |"]
    for name, r in rows.items():
        for component, shapes in (r.get("parity") or {}).items():
            cells = [f"{s['rel_error']:.1e}" + ("" if s["passed"] else " **over**") for s in shapes.values()]
            out.append(f"| {name} | {component} | " + " | ".join(cells) + " |")
    return out + [""]


def _build_lines(rows: dict) -> list[str]:
    out = ["Cold compile seconds per component (export / optimize / engine):", ""]
    for name, r in rows.items():
        if r.get("stages"):
            parts = "; ".join(f"{c}: " + " / ".join(f"{k} {v:.0f}" for k, v in s.items())
                              for c, s in r["stages"].items())
            out.append(f"- {name}: {parts}")
    return out + [""]


def _target_lines(report: dict) -> list[str]:
    stages = report["stages"]
    ref = stages.get("sd15:reference", {})
    lines = []
    for name, target in TARGET_SPEEDUPS.items():
        run = stages.get(name, {})
        title = f"SD 1.5 {name.split(':', 1)[1].replace(':', ' ')} ≥ {target}× diffusers eager fp16"
        if run.get("status") != "done" or ref.get("status") != "done":
            lines.append(f"Target ({title}): not measured in this run ({run.get('status', 'not planned')}).")
            continue
        speedup = _median(ref["diffusers eager fp16"]["seconds"]) / _median(run["seconds"])
        lines.append(f"Target ({title}): {speedup:.2f}×, {'met' if speedup >= target else 'not met'}; image "
                     f"{run['psnr_db']:.1f} dB against diffusers fp16.")
    images = [(n, r["psnr_db"]) for n, r in stages.items() if r.get("status") == "done" and "psnr_db" in r]
    low = [f"{n} {p:.1f} dB" for n, p in images if p < TARGET_PSNR_DB]
    if images:
        lines.append(f"Images at PSNR ≥ {TARGET_PSNR_DB:.0f} dB against diffusers fp16: "
                     + ("all" if not low else "not all: " + ", ".join(low)) + ".")
    return lines


if __name__ == "__main__":
    sys.exit(main())
