"""One-shot GPU check: build, check and time kasoku's GPU backends on whatever NVIDIA GPU is here.

    python benchmarks/gpu_check.py [--models sd15,sdxl,sd35,flux] [--budget-s 600] [--steps 30] [--repeats 3]
                                   [--trt-opt-level 3] [--keep-cache] [--dry-run] [--smoke]

Models, random weights, built once into benchmarks/.models/ (in the model's precision):
- sd15: full-size SD 1.5 at 512x512 (benchmarks/full_sd15.py's build_sd15), fp16, guidance 7.5;
- sdxl: SDXL base at 1024x1024 (benchmarks/full_sdxl.py's configurations), fp16, guidance 7.5;
- sd35: SD3.5-medium's transformer and 16-channel VAE at 1024x1024 (benchmarks/full_sd35.py's configurations),
  bf16 (its model card's dtype), guidance 4.5 (classifier-free: two rows per image);
- flux: Flux.1-dev's transformer (12B: 19 double- and 38 single-stream blocks, the guidance embedding) and VAE at
  1024x1024, bf16, guidance 3.5 embedded (one row per image).
The transformer families are called with seeded random prompt embeddings (77 CLIP + 256 T5 tokens for SD3.5, 512
T5 tokens for Flux) and have no text encoders: T5-XXL (9.5 GB in bf16) and the CLIPs run once per image, and
building them would spend the lent machine's minutes on what is not measured. kasoku serves such a call without
text-encoder engines, as diffusers does.

Per model, each stage in its own process (so its peak GPU memory is its own):

- reference: diffusers eager in the model's precision (its default SDPA attention) and the same pipeline with
  `torch.compile` on its denoiser: one image of --steps steps from fixed initial latents, compile time, median
  seconds of --repeats after a warm-up, peak GPU memory. The eager image is the reference image.
- <backend>: `inductor` (AOTInductor: torch's own compiler, the one accelerated path the lent GPU machines can
  run, so it comes first), native TensorRT, ONNX Runtime CUDA and the ONNX Runtime TensorRT provider (SD 1.5 and
  SDXL); then, with budget left, TensorRT fp16 with CUDA graphs on exact-shape engines (SD 1.5). Each: cold
  compile (export, optimize, engine seconds per component, in a fresh cache), parity per component against torch
  fp32 (on the GPU, TF32 off) at the profile's min, opt and max, the warm load (a second `kasoku.compile` on that
  cache: each engine's load), the same image (PSNR against diffusers eager), its seconds and peak GPU memory.

A backend that cannot run here is skipped with the reason; stages are run in that order until --budget-s is
spent, and the rest are listed as not run. On a machine without an NVIDIA GPU it prints what it would run and
exits 0; `--smoke` instead runs every stage of the chosen models on the CPU with kasoku's tiny pipelines of the
same families at 64x64 (fp32; ONNX Runtime stands in for the GPU backends; results under
/tmp/kasoku-gpu_check-smoke): a check of this script before a lent GPU's minutes are spent on it. Writes
benchmarks/results/<date>-<host>-gpu_check.json and .md after every stage. Targets, SD 1.5 at 512x512, 30 steps,
against diffusers eager fp16 on the same GPU: TensorRT fp16 at least 2.5x (issue 14), inductor fp16 at least 1.8x
(issue 19); every image PSNR >= 30 dB against diffusers eager.

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
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the sibling benchmarks' model builders
RESULTS = HERE / "results"
WORK = HERE / ".models" / "gpu-check"
SMOKE_DIR = Path("/tmp/kasoku-gpu_check-smoke")
DEVICE = "cuda"  # --smoke: "cpu"
PROMPT = "a photo of an astronaut riding a horse on mars"
SEED = 0
# SD 1.5 against diffusers eager fp16, per backend: the speed-up each must reach
TARGET_SPEEDUPS = {"sd15:tensorrt:fp16": 2.5, "sd15:inductor:fp16": 1.8}
TARGET_PSNR_DB = 30.0
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Model:
    name: str
    title: str
    folder: Path
    size: int
    multiple: int  # the profile's min and max are one multiple below and above the size
    dtype: str = "fp16"  # diffusers eager's and kasoku's GPU engines' precision
    guidance_scale: float = 7.5
    cfg: bool = True  # classifier-free guidance: two rows per image (Flux's guidance is embedded: one)
    # T5 tokens of the random prompt embeddings the model is called with (it has no text encoders);
    # None: it is called with PROMPT and encodes it
    text_tokens: int | None = None
    pixels: int = 8  # the step of height and width (the transformer families patch 2x2 latents: 16)

    def profile(self, exact: bool = False):
        """One image; height and width from size - multiple to size + multiple."""
        from kasoku.core.components import ImageShape, ShapeProfile

        shape = ImageShape(1, self.size, self.size)
        if exact:
            return ShapeProfile.exact(shape, guidance=self.cfg, multiple=self.pixels, text_tokens=self.text_tokens)
        low, high = self.size - self.multiple, self.size + self.multiple
        return ShapeProfile.from_ranges((1, 1, 1), (low, self.size, high), (low, self.size, high), self.pixels,
                                        guidance=self.cfg, text_tokens=self.text_tokens)


MODELS = {
    "sd15": Model("sd15", "SD 1.5 (random weights)", HERE / ".models" / "sd15-random", 512, 64),
    "sdxl": Model("sdxl", "SDXL base (random weights)", HERE / ".models" / "sdxl-random", 1024, 128),
    "sd35": Model("sd35", "SD3.5-medium (random weights, random prompt embeddings)",
                  HERE / ".models" / "sd35-random-bf16", 1024, 128, "bf16", 4.5, text_tokens=256, pixels=16),
    "flux": Model("flux", "Flux.1-dev (random weights, random prompt embeddings)",
                  HERE / ".models" / "flux-dev-random-bf16", 1024, 128, "bf16", 3.5, cfg=False, text_tokens=512,
                  pixels=16),
}
SMOKE_FAMILIES = {"sd15": "sd1", "sdxl": "sdxl", "sd35": "sd3", "flux": "flux"}


def use_smoke_models() -> None:
    """--smoke: the same families' tiny pipelines at 64x64 on the CPU in fp32, ONNX Runtime as the backend."""
    global DEVICE, RESULTS, WORK
    DEVICE, RESULTS, WORK = "cpu", SMOKE_DIR / "results", SMOKE_DIR / "work"
    for name, model in MODELS.items():
        MODELS[name] = replace(model, title=f"tiny {SMOKE_FAMILIES[name]} (--smoke)", folder=SMOKE_DIR / name,
                               size=64, multiple=16, dtype="fp32", text_tokens=model.text_tokens and 16)


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
    for name in models:
        model = MODELS[name]
        stages.append(Stage(name, "reference"))
        if DEVICE == "cpu":  # --smoke
            stages.append(Stage(name, "onnxruntime", "fp32"))
            continue
        # inductor first: on the lent machines (torch only) it is the one backend that runs, and the budget is short
        stages += [Stage(name, "inductor", model.dtype), Stage(name, "tensorrt", model.dtype)]
        if model.dtype == "fp16":
            stages += [Stage(name, "tensorrt", "fp32"), Stage(name, "onnxruntime-cuda", "fp16"),
                       Stage(name, "onnxruntime-tensorrt", "fp16")]
        if name == "sd15":
            stages.append(Stage(name, "tensorrt", "fp16", cuda_graph=True))
    return stages


def why_not(stage: Stage) -> str | None:
    """Why `stage` cannot run here (None: it can), asked before a process is started for it."""
    if stage.backend == "reference":
        return None
    from kasoku.backends import BACKENDS, get_backend
    from kasoku.core.errors import KasokuError

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
        if DEVICE == "cpu":  # --smoke: no device memory to watch
            return 0
        free, total = torch.cuda.mem_get_info()
        return total - free

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._used())

    @property
    def mib(self) -> float:
        return (self.peak - self.baseline) / 2**20


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> tuple[list[float], object]:
    """Seconds of each of `repeats` calls (device synchronised), and the last result."""
    samples, result = [], None
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        result = fn()
        synchronize()
        samples.append(time.perf_counter() - start)
    return samples, result


# ---- the models ----------------------------------------------------------------------------------------------


def ensure_model(model: Model) -> None:
    if (model.folder / "model_index.json").exists():
        return
    if DEVICE == "cpu":
        pipe = _smoke_pipeline(model)
    elif model.name == "sd15":
        from full_sd15 import build_sd15

        build_sd15(model.folder)
        return
    elif model.name == "sdxl":
        from full_sdxl import sdxl_pipeline

        pipe = sdxl_pipeline(real=("vae", "text_encoder", "text_encoder_2", "unet"))
    else:
        pipe = _transformer_pipeline(model)
    pipe.save_pretrained(model.folder, safe_serialization=True)


def _random_module(build, seed: int, dtype: torch.dtype):
    """Seeded random weights, initialised on the GPU where there is one (Flux's 12B parameters take minutes on a
    CPU), kept on the CPU in `dtype` for saving."""
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        module = build()
    return module.to("cpu", dtype).eval()


def _transformer_pipeline(model: Model):
    """SD3.5-medium or Flux.1-dev at full size without text encoders (the calls give prompt embeddings); the
    tokenizers are kasoku's tiny ones: the pipelines read their lengths, never their vocabularies here."""
    from diffusers import (
        AutoencoderKL,
        FluxPipeline,
        FluxTransformer2DModel,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from full_sd35 import FLUX_DEV, FLUX_VAE, TRANSFORMER, VAE

    from kasoku.architectures.tiny import flow_match_scheduler, tiny_t5_tokenizer, tiny_tokenizer

    dtype = DTYPES[model.dtype]
    clip = tiny_tokenizer()
    clip.model_max_length = 77  # CLIP's
    if model.name == "sd35":
        return StableDiffusion3Pipeline(
            transformer=_random_module(lambda: SD3Transformer2DModel(**TRANSFORMER), 3, dtype),
            vae=_random_module(lambda: AutoencoderKL(**VAE), 4, dtype), scheduler=flow_match_scheduler(shift=3.0),
            text_encoder=None, tokenizer=clip, text_encoder_2=None, tokenizer_2=tiny_tokenizer("!"),
            text_encoder_3=None, tokenizer_3=tiny_t5_tokenizer())
    return FluxPipeline(
        transformer=_random_module(lambda: FluxTransformer2DModel(**FLUX_DEV), 3, dtype),
        vae=_random_module(lambda: AutoencoderKL(**FLUX_VAE), 4, dtype),
        scheduler=flow_match_scheduler(shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256,
                                       max_image_seq_len=4096, base_shift=0.5, max_shift=1.15),
        text_encoder=None, tokenizer=clip, text_encoder_2=None, tokenizer_2=tiny_t5_tokenizer())


def _smoke_pipeline(model: Model):
    """The family's tiny pipeline; without its text encoders where the model is called with embeddings."""
    from kasoku.families import FAMILIES

    pipe = FAMILIES[SMOKE_FAMILIES[model.name]].tiny_pipeline()
    if model.text_tokens:
        pipe.register_modules(**{name: None for name in pipe.components if name.startswith("text_encoder")})
    return pipe


def call_inputs(model: Model, work: Path) -> dict[str, torch.Tensor]:
    """The same initial latents (and prompt embeddings, for the models without text encoders) for every pipeline:
    fp32 on the CPU, seeded, kept in the work folder."""
    path = work / f"{model.name}-inputs.pt"
    if path.exists():
        return torch.load(path)
    from full_sd35 import random_prompt_embeddings

    from kasoku.model.loading import load_pipeline
    from kasoku.model.pipeline_model import Model as KasokuModel

    pipe = load_pipeline(model.folder, lazy=True)  # configs only: the weights stay on disk
    generator = torch.Generator().manual_seed(SEED)
    denoiser = getattr(pipe, KasokuModel.of(pipe).family.denoiser)
    latent = model.size // pipe.vae_scale_factor
    if model.name == "flux":  # packed: 2x2 latent patches of 16 channels per token
        shape = (1, (latent // 2) ** 2, denoiser.config.in_channels)
    else:
        shape = (1, denoiser.config.in_channels, latent, latent)
    inputs = {"latents": torch.randn(shape, generator=generator)}
    if model.text_tokens:
        inputs.update(random_prompt_embeddings(pipe, model.profile(), generator, guided=model.cfg))
    torch.save(inputs, path)
    return inputs


def image(pipe, model: Model, inputs: dict[str, torch.Tensor], steps: int) -> np.ndarray:
    text = {} if model.text_tokens else {"prompt": PROMPT}
    return pipe(**text, **inputs, num_inference_steps=steps, height=model.size, width=model.size,
                guidance_scale=model.guidance_scale, output_type="np").images


def _absent(model: Model) -> dict[str, None]:
    """What diffusers' from_pretrained must be told is absent (the text encoders of the models called with
    embeddings), as a user loading such a pipeline tells it."""
    if not model.text_tokens:
        return {}
    index = json.loads((model.folder / "model_index.json").read_text())
    return {name: None for name in index if name.startswith("text_encoder")}


def _on_device(inputs: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: tensor.to(DEVICE, dtype) for name, tensor in inputs.items()}


# ---- stages (each in its own process) ----------------------------------------------------------------


def stage_reference(model: Model, args) -> dict:
    """diffusers eager and torch.compile on its denoiser, in the model's precision: compile time, seconds, image,
    peak memory."""
    from diffusers import DiffusionPipeline

    from kasoku.core.parity import psnr
    from kasoku.families import family_of

    dtype = DTYPES[model.dtype]
    inputs = _on_device(call_inputs(model, args.work), dtype)
    eager_name, compiled_name = f"diffusers eager {model.dtype}", f"torch.compile {model.dtype}"
    result: dict = {}
    with GpuMemoryPeak() as memory:
        pipe = DiffusionPipeline.from_pretrained(model.folder, torch_dtype=dtype, **_absent(model)).to(DEVICE)
        pipe.set_progress_bar_config(disable=True)
        denoiser = family_of(pipe).denoiser
        warmup, _ = timed(lambda: image(pipe, model, inputs, args.steps), 1)
        seconds, eager = timed(lambda: image(pipe, model, inputs, args.steps), args.repeats)
    np.save(args.work / f"{model.name}-diffusers.npy", eager)
    processors = getattr(pipe, denoiser).attn_processors
    result[eager_name] = {"first_call_s": warmup[0], "seconds": seconds, "peak_gpu_mib": memory.mib,
                          "attention": type(processors[next(iter(processors))]).__name__, "denoiser": denoiser}
    with GpuMemoryPeak() as memory:
        setattr(pipe, denoiser, torch.compile(getattr(pipe, denoiser)))
        first, _ = timed(lambda: image(pipe, model, inputs, args.steps), 1)  # compiles
        seconds, compiled = timed(lambda: image(pipe, model, inputs, args.steps), args.repeats)
    result[compiled_name] = {"compile_and_first_call_s": first[0], "seconds": seconds,
                             "peak_gpu_mib": memory.mib, "psnr_db": psnr(eager, compiled)}
    return result


def _reference_outputs(spec, inputs: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """torch fp32 on the GPU, TF32 off: the parity reference."""
    from kasoku.core.attention import exportable_attention

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    module = spec.module.to(DEVICE, torch.float32)
    with torch.no_grad(), exportable_attention():
        outputs = module(*(inputs[name].to(DEVICE) for name in spec.input_names))
    return {name: out.float().cpu().numpy() for name, out in zip(spec.output_names, outputs)}


def inputs_at(spec, which: str, seed: int = 5) -> dict[str, torch.Tensor]:
    """Inputs at the profile's "min", "opt" or "max" shape of every input."""
    generator = torch.Generator().manual_seed(seed)
    index = ("min", "opt", "max").index(which)
    return {t.name: spec.sample_input(t, spec.profile_shapes()[t.name][index], generator) for t in spec.inputs}


def parity(engines: dict, precision: str) -> dict:
    """Per component, the worst output at the profile's min, opt and max, against torch fp32."""
    from kasoku.core.parity import compare_outputs

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
        empty_cache()
    return rows


def empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def stage_backend(model: Model, stage: Stage, args) -> dict:
    """Cold compile, per-component parity at min/opt/max, the warm load, the image against diffusers eager,
    its seconds."""
    import kasoku
    from kasoku.core.parity import psnr
    from kasoku.model.loading import load_pipeline
    from kasoku.model.pipeline_model import Model as KasokuModel
    from kasoku.pipeline.compiling import compile_components

    # what text-to-image runs of this model (no text encoders where it has none)
    components = KasokuModel.of(load_pipeline(model.folder, lazy=True)).task_components("txt2img")
    # kasoku's own build-time parity check (torch on the CPU) is off: the check below replaces it, on the GPU
    options = dict(backend=stage.backend, precision=stage.precision, profile=model.profile(exact=stage.cuda_graph),
                   trt_opt_level=args.trt_opt_level, cuda_graph=stage.cuda_graph, check_parity=False,
                   components=components)
    with GpuMemoryPeak() as build_memory:
        start = time.perf_counter()
        engines, report = compile_components(model.folder, cache=args.cache, label=model.name, **options)
        compile_s = time.perf_counter() - start
    stages: dict[str, dict[str, float]] = {}
    for record in report.stages:
        stages.setdefault(record.component, {})[record.stage] = round(record.seconds, 2)
    checked = parity(engines, stage.precision)
    del engines
    empty_cache()
    reference = np.load(args.work / f"{model.name}-diffusers.npy")
    inputs = call_inputs(model, args.work)  # fp32 on the CPU, as a user's: the pipeline moves them
    with GpuMemoryPeak() as run_memory:
        diffusers_pipe = load_pipeline(model.folder)
        start = time.perf_counter()
        pipe = kasoku.compile(diffusers_pipe, cache=args.cache, label=model.name, **options)  # warm: loads only
        warm_s = time.perf_counter() - start
        pipe.set_progress_bar_config(disable=True)
        warmup, _ = timed(lambda: image(pipe, model, inputs, args.steps), 1)
        seconds, images = timed(lambda: image(pipe, model, inputs, args.steps), args.repeats)
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

    on_gpu = DEVICE == "cuda"
    return {"host": socket.gethostname(), "date": datetime.date.today().isoformat(),
            "gpu": str(gpu_identity(0)) if on_gpu else "the CPU (--smoke)",
            "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30 if on_gpu else 0,
            "torch": torch.__version__, "cuda": torch.version.cuda, "tensorrt": installed_trt_version(),
            "onnxruntime": version("onnxruntime"), "onnxruntime-gpu": version("onnxruntime-gpu"),
            "diffusers": version("diffusers"), "polygraphy": version("polygraphy")}


def _stem() -> Path:
    return RESULTS / f"{datetime.date.today().isoformat()}-{socket.gethostname()}-gpu_check"


def _write(report: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    _stem().with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    _stem().with_suffix(".md").write_text(markdown(report) + "\n")


def _launch(stage: Stage, args, timeout: float) -> dict:
    """`stage` in a fresh process, killed at `timeout` seconds; a failure is recorded and the run goes on."""
    out = args.work / f"stage-{stage.name.replace(':', '-')}.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, __file__, "--stage", json.dumps(stage.__dict__), "--stage-json", str(out),
               "--steps", str(args.steps), "--repeats", str(args.repeats), "--trt-opt-level",
               str(args.trt_opt_level), "--work", str(args.work)] + (["--smoke"] if DEVICE == "cpu" else [])
    start = time.perf_counter()
    try:
        done = subprocess.run(command, timeout=timeout, stderr=subprocess.PIPE, text=True)
    except subprocess.TimeoutExpired:
        return {"status": "stopped at the time budget", "wall_s": time.perf_counter() - start}
    sys.stderr.write(done.stderr)
    if done.returncode != 0 or not out.exists():
        last = (done.stderr.strip().splitlines() or [""])[-1]
        return {"status": f"failed (exit {done.returncode})", "reason": last[:300],
                "wall_s": time.perf_counter() - start}
    return {"status": "done", **json.loads(out.read_text()), "wall_s": time.perf_counter() - start}


def describe_plan(stages: list[Stage]) -> str:
    lines = []
    for stage in stages:
        model = MODELS[stage.model]
        if stage.backend == "reference":
            what = (f"diffusers eager {model.dtype} (SDPA) and torch.compile on its denoiser: {model.title} at "
                    f"{model.size}x{model.size}, one image, the reference image")
        else:
            graphs = " with CUDA graphs (exact shape)" if stage.cuda_graph else ""
            what = (f"kasoku {stage.backend} {stage.precision}{graphs}: cold compile, parity at min/opt/max, the "
                    f"image's PSNR vs diffusers {model.dtype}, seconds, peak memory")
        lines.append(f"  {stage.name:40s} {what}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="sd15,sdxl,sd35,flux",
                        help="comma-separated, from sd15, sdxl, sd35, flux (run in the order given; default: all)")
    parser.add_argument("--budget-s", type=float, default=600.0, help="start no stage after this (default 600)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trt-opt-level", type=int, default=3)
    parser.add_argument("--work", type=Path, help=f"scratch: latents, images, the cache (default {WORK})")
    parser.add_argument("--keep-cache", action="store_true", help="reuse the last run's engines (compile is warm)")
    parser.add_argument("--dry-run", action="store_true", help="print what would run, and run nothing")
    parser.add_argument("--smoke", action="store_true",
                        help="run every stage on the CPU with the tiny pipelines of the same families (a check of "
                             "this script; results under /tmp/kasoku-gpu_check-smoke)")
    parser.add_argument("--stage", help=argparse.SUPPRESS)
    parser.add_argument("--stage-json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.smoke:
        use_smoke_models()
    args.work = args.work or WORK
    args.cache = args.work / "cache"
    if args.stage:
        from kasoku.core.console import quiet_third_party_logs

        quiet_third_party_logs()
        result = run_stage(Stage(**json.loads(args.stage)), args)
        args.stage_json.write_text(json.dumps(result, indent=2, default=str))
        return 0

    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    stages = plan(models)
    if args.dry_run or not (torch.cuda.is_available() or args.smoke):
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
        guidance = "guidance" if model.cfg else "embedded guidance (one row an image)"
        eager_name, compiled_name = f"diffusers eager {model.dtype}", f"torch.compile {model.dtype}"
        lines += [f"## {model.title}, {model.size}x{model.size}, one image with {guidance} "
                  f"{model.guidance_scale}", "",
                  f"| pipeline | s / image | vs {eager_name} | vs torch.compile | PSNR vs {eager_name} | "
                  "compile s | warm load s | peak GPU MiB (build / run) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        ref = rows.get(f"{model.name}:reference", {})
        eager = _median(ref[eager_name]["seconds"]) if ref.get("status") == "done" else None
        compiled = _median(ref[compiled_name]["seconds"]) if ref.get("status") == "done" else None
        if not eager:
            lines.append(f"| {eager_name} and torch.compile | {ref.get('status')}: {ref.get('reason', '')} "
                         "| | | | | | |")
        else:
            r = ref[eager_name]
            lines.append(f"| {eager_name} ({r['attention']}) | {eager:.2f} | 1.00× | {compiled / eager:.2f}× | "
                         f"reference | – | – | – / {r['peak_gpu_mib']:.0f} |")
            r = ref[compiled_name]
            lines.append(f"| diffusers + torch.compile({ref[eager_name]['denoiser']}) {model.dtype} | {compiled:.2f} | "
                         f"{eager / compiled:.2f}× | 1.00× | {r['psnr_db']:.1f} dB | "
                         f"{r['compile_and_first_call_s']:.0f} (first call) | – (compiles in every process) | "
                         f"– / {r['peak_gpu_mib']:.0f} |")
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
    where = "GPU, TF32 off" if DEVICE == "cuda" else "CPU"
    out = [f"Parity against torch fp32 ({where}), worst output's relative error at the profile's min / opt / max:",
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
        speedup = _median(ref[f"diffusers eager {MODELS['sd15'].dtype}"]["seconds"]) / _median(run["seconds"])
        lines.append(f"Target ({title}): {speedup:.2f}×, {'met' if speedup >= target else 'not met'}; image "
                     f"{run['psnr_db']:.1f} dB against diffusers eager.")
    images = [(n, r["psnr_db"]) for n, r in stages.items() if r.get("status") == "done" and "psnr_db" in r]
    low = [f"{n} {p:.1f} dB" for n, p in images if p < TARGET_PSNR_DB]
    if images:
        lines.append(f"Images at PSNR ≥ {TARGET_PSNR_DB:.0f} dB against diffusers eager in the model's precision: "
                     + ("all" if not low else "not all: " + ", ".join(low)) + ".")
    return lines


if __name__ == "__main__":
    sys.exit(main())
