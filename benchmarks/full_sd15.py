"""The `full` workload of docs/BENCHMARKS.md: Stable Diffusion 1.5 at full size, random weights.

    python benchmarks/full_sd15.py [--stages cold,warm,runtime,speed] [--backends onnxruntime,openvino]
                                   [--threads 2] [--repeats 3] [--fresh-cache]

A backend (in --backends and --contenders) may name its precision: `inductor:bf16`, `openvino:bf16`
(default fp32). The inductor comparison: each contender's engines for one 512x512 profile, compiled
cold, loaded warm and timed per component beside OpenVINO in one run:

    python benchmarks/full_sd15.py --stages speed --fresh-cache \
        --contenders torch,openvino:bf16,inductor:bf16,openvino,inductor

Builds the SD 1.5 architecture (CLIP ViT-L text encoder, the 860M-parameter U-Net, the VAE) with
random weights once into benchmarks/.models/ (no weights can be downloaded here), then runs stages,
each in its own process so that no two copies of the weights share the memory (the run's peak is
the largest stage's VmHWM):

- cold:<backend>     `compile_components(folder)` into the benchmark's cache (export, optimize, engines),
                     as `kasoku compile` does; compile seconds per stage, peak memory.
- warm:<backend>     a new user's warm start: the diffusers pipeline is loaded (timed apart), then
                     `kasoku.compile(pipe)` on the warm cache, with each engine's load time; and, in
                     another process, `KasokuPipeline.from_pretrained(folder)` (reads no weights).
- runtime:<backend>  the runtime's own load of the same engine files, with the same settings
                     (ONNX Runtime InferenceSession; OpenVINO compile_model with the entry's blob cache;
                     AOTInductor: torch._inductor.aoti_load_package of the package).
- speed:<contender>  one call per component after warm-up, median of repeats, against torch eager
                     (torch, onnxruntime, openvino), with the FLOP floor; the components' inputs and
                     torch's outputs are saved by the torch stage, so every contender is checked; and what
                     the contender's engines for this profile cost: the compile (cold with --fresh-cache) and
                     the load of the same engines again from the cache.
- controlnet:<contender>  a U-Net step steered by a ControlNet (SD 1.5's ControlNet architecture, random
                     weights, built once into benchmarks/.models/): the ControlNet, then the U-Net that takes
                     its residuals, one call each after warm-up, against torch eager, with the FLOP floor and
                     the whole step; checked against torch's outputs as the speed stage is.
- lora:<backend>     checkpoints and LoRA adapters without re-export (benchmarks/lora.py): the cold compile of
                     the base, the compile of a second checkpoint (the architecture with other random weights,
                     built into benchmarks/.models/sd15-random-2), the switch between two adapters (ranks 4 and
                     64 on the U-Net's attention projections) with run-time weights and with constant weights,
                     and the U-Net's speed with bound weights against constant and run-time weights.
- image:kasoku-tuned-32, image:kasoku-tuned-40  `kasoku tune` at 512x512 and the largest --steps (every precision x
                     step-caching setting on exact-shape engines, judged against the fp32 engines' images; shared by
                     both, its time reported), then `recipe="fastest"` at 32 and at 40 dB, timed as the others:
                     `--stages image --images diffusers,openvino-genai,kasoku-fp32-static,kasoku-bf16-static,`
                     `kasoku-tuned-32,kasoku-tuned-40 --steps 20`.
- deepcache:<backend> step caching: a 20-step 512x512 image with guidance at cache intervals 1, 2, 3, 5
                     (and 3 non-uniform) on one backend, fp32: loop and image seconds, the shallow graph's
                     share of the U-Net's FLOPs, PSNR and SSIM against interval 1
                     (`--stages deepcache --backends openvino`).

Every stage's result is merged into benchmarks/results/<date>-<host>-full_sd15.json, and the markdown
beside it is written again from everything measured that day, so stages can be run one at a time.
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
MODEL_DIR = HERE / ".models" / "sd15-random"
CONTROLNET_DIR = HERE / ".models" / "sd15-controlnet-random"
SECOND_MODEL_DIR = HERE / ".models" / "sd15-random-2"  # the same architecture, other weights (stage lora)
WORK = HERE / ".models" / "sd15-work"
RESULTS = HERE / "results"
TXT2IMG = ("text_encoder", "unet", "vae_decoder")
CONTROLNET_STEP = ("controlnet_0", "unet_controlnet")
SIZE = 512
MULTIPLE = 64  # SD 1.5's height/width step: the VAE's 8x times the U-Net's three downsamplings
SMOKE_DIR = Path("/tmp/kasoku-full_sd15-smoke")  # --smoke: every stage on the tiny pipeline, results kept apart


def use_smoke_model() -> None:
    """Point every stage at the tiny pipeline (64x64, steps of 16) and keep its results apart."""
    global MODEL_DIR, CONTROLNET_DIR, SECOND_MODEL_DIR, WORK, RESULTS, SIZE, MULTIPLE
    MODEL_DIR, WORK, RESULTS = SMOKE_DIR / "model", SMOKE_DIR / "work", SMOKE_DIR / "results"
    CONTROLNET_DIR = MODEL_DIR / "controlnet"
    SECOND_MODEL_DIR = SMOKE_DIR / "model-2"
    SIZE, MULTIPLE = 64, 16
    from kasoku.tools.tiny import write_tiny_pipeline

    for folder, seed in ((MODEL_DIR, 0), (SECOND_MODEL_DIR, 1)):
        if not (folder / "model_index.json").exists():
            write_tiny_pipeline(folder, seed=seed)
    if not (CONTROLNET_DIR / "config.json").exists():
        from kasoku.tools.tiny import write_tiny_controlnet

        write_tiny_controlnet(CONTROLNET_DIR)


def build_sd15(directory: Path, seed: int = 0) -> Path:
    """SD 1.5's architecture and scheduler at full size with random weights, as a diffusers folder."""
    from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from kasoku.architectures.tiny import tiny_tokenizer
    from kasoku.families import FAMILIES

    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer()  # a real CLIP BPE tokenizer; ids fall inside the full vocabulary
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    ))
    unet = UNet2DConditionModel(
        sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768, attention_head_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    )
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, sample_size=512,
        block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
    )
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=FAMILIES["sd1"].tiny_scheduler("epsilon"), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(directory, safe_serialization=True)
    return directory


def peak_mb() -> float:
    from kasoku.tools.benchmark import rss_mb

    return rss_mb("VmHWM")


def weights_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.safetensors"))


def cache_bytes(cache: Path) -> int:
    return sum(p.stat().st_size for p in (cache / "entries").rglob("*") if p.is_file()) if cache.exists() else 0


# ---- stages (each runs in its own process) -----------------------------------------------------------


def backend_precision(target: str) -> tuple[str, str]:
    """A --backends/--contenders entry: `backend` or `backend:precision` (fp32 when not named)."""
    backend, _, precision = target.partition(":")
    return backend, precision or "fp32"


def cache_for(args, target: str) -> Path:
    """Each backend (and precision) compiles into a cache of its own, so its size is its own."""
    return args.cache / target.replace(":", "-")


def stage_model(target: str, args) -> dict:
    folder, seed = (SECOND_MODEL_DIR, 1) if target == "sd15-2" else (MODEL_DIR, 0)
    start = time.perf_counter()
    build_sd15(folder, seed=seed)
    return {"seconds": time.perf_counter() - start, "weights_bytes": weights_bytes(folder), "peak_mb": peak_mb()}


def stage_cold(target: str, args) -> dict:
    from kasoku.pipeline.compiling import compile_components

    backend, precision = backend_precision(target)
    shutil.rmtree(cache_for(args, target), ignore_errors=True)  # cold means cold
    start = time.perf_counter()
    _, report = compile_components(MODEL_DIR, backend=backend, precision=precision, components=TXT2IMG,
                                   cache=cache_for(args, target), threads=args.threads, label="sd15-random")
    seconds = time.perf_counter() - start
    per_stage: dict[str, dict[str, float]] = {}
    for record in report.stages:
        per_stage.setdefault(record.component, {})[record.stage] = round(record.seconds, 2)
    return {"seconds": seconds, "stages": per_stage, "backends": report.backends, "built": report.built,
            "precisions": report.precisions, "cache_bytes": cache_bytes(cache_for(args, target)),
            "weights_bytes": weights_bytes(MODEL_DIR),
            "peak_mb": peak_mb()}


def preheat(folder: Path) -> None:
    """Read every file under `folder` once, untimed, so that the stages compared (kasoku's warm start,
    the runtime's own load) all find the engine files in the page cache: a fair comparison of the loads,
    not of the disk."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                while handle.read(1 << 24):
                    pass


def stage_warm(target: str, args) -> dict:
    import kasoku
    from kasoku.model.loading import load_pipeline

    backend, precision = backend_precision(target)
    preheat(cache_for(args, target))
    start = time.perf_counter()
    pipe = load_pipeline(MODEL_DIR)
    load_pipe = time.perf_counter() - start
    start = time.perf_counter()
    fast = kasoku.compile(pipe, backend, precision=precision, components=TXT2IMG, cache_dir=cache_for(args, target),
                          threads=args.threads)
    seconds = time.perf_counter() - start
    report = fast.compile_report
    return {"diffusers_load_s": load_pipe, "compile_s": seconds, "load_seconds": report.load_seconds,
            "built": report.built, "backends": report.backends,
            "engine_keys": {s.component: s.key for s in report.stages if s.stage == "engine"}, "peak_mb": peak_mb()}


def stage_warm_folder(target: str, args) -> dict:
    import kasoku

    backend, precision = backend_precision(target)
    preheat(cache_for(args, target))
    start = time.perf_counter()
    fast = kasoku.KasokuPipeline.from_pretrained(MODEL_DIR, backend, precision=precision, components=TXT2IMG,
                                                 cache_dir=cache_for(args, target), threads=args.threads)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "load_seconds": fast.compile_report.load_seconds, "built": fast.compile_report.built,
            "peak_mb": peak_mb()}


def stage_runtime(target: str, args) -> dict:
    """The runtimes' own load of the engine files the warm stage used, with kasoku's settings."""
    keys = _results(args)["warm"][target]["engine_keys"]
    backends = _results(args)["warm"][target]["backends"]
    preheat(cache_for(args, target))
    seconds = {}
    for component, key in keys.items():
        entry = cache_for(args, target) / "entries" / key
        start = time.perf_counter()
        if backends[component] == "inductor":  # torch's public load (it probes the CPU's ISA with g++ first)
            from torch._inductor import aoti_load_package

            aoti_load_package(str(entry / "model.pt2"))
        elif backends[component] == "onnxruntime":
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.log_severity_level = 3
            options.intra_op_num_threads = args.threads
            ort.InferenceSession(str(entry / "model.onnx"), options, providers=["CPUExecutionProvider"])
        else:
            import openvino as ov

            blob = np.memmap(entry / "model.blob", dtype=np.uint8, mode="c")
            ov.Core().import_model(ov.Tensor(blob, shared_memory=True), "CPU", {
                "INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY",
                "INFERENCE_NUM_THREADS": args.threads})
        seconds[component] = time.perf_counter() - start
    return {"load_seconds": seconds, "backends": backends, "peak_mb": peak_mb()}


def stage_speed(contender: str, args) -> dict:
    """One call per component after warm-up; torch also counts FLOPs and saves inputs and outputs."""
    from kasoku.core.components import ImageShape, ShapeProfile
    from kasoku.core.parity import compare_output
    from kasoku.model.loading import load_pipeline
    from kasoku.model.pipeline_model import component_specs
    from kasoku.tools.benchmark import count_flops

    profile = ShapeProfile.from_ranges((1, 1, 1), (SIZE,) * 3, (SIZE,) * 3, MULTIPLE)
    io_file = args.work / "speed-io.npz"
    result: dict = {"components": {}}
    if contender == "torch":
        pipe = load_pipeline(MODEL_DIR)
        specs = component_specs(pipe, profile, TXT2IMG)
        saved = {}
        for name, spec in specs.items():
            inputs = spec.sample_inputs(ImageShape(1, SIZE, SIZE), seed=3)
            flops = count_flops(spec, inputs)  # runs the call: the warm-up
            samples, outputs = _repeat(lambda spec=spec, inputs=inputs: spec.run_torch(inputs), args.repeats)
            saved.update({f"{name}.in.{k}": v.numpy() for k, v in inputs.items()})
            saved.update({f"{name}.out.{k}": v for k, v in outputs.items()})
            result["components"][name] = {"seconds": samples, "gflop": flops / 1e9,
                                          "shapes": {k: list(v.shape) for k, v in inputs.items()}}
        np.savez(io_file, **saved)
    else:
        from kasoku.pipeline.compiling import compile_components

        io = np.load(io_file)
        backend, precision = backend_precision(contender)

        def compile_engines():
            return compile_components(MODEL_DIR, backend=backend, precision=precision, components=TXT2IMG,
                                      profile=profile, cache=args.cache, threads=args.threads, label="sd15-random")

        start = time.perf_counter()
        engines, report = compile_engines()
        result["compile_s"] = time.perf_counter() - start  # cold where `built` names every component
        result["built"] = sorted({r.component for r in report.stages if r.status != "reused"})
        for name, engine in engines.items():
            inputs = {k.split(".", 2)[2]: io[k] for k in io.files if k.startswith(f"{name}.in.")}
            reference = {k.split(".", 2)[2]: io[k] for k in io.files if k.startswith(f"{name}.out.")}
            engine.run(inputs)
            samples, outputs = _repeat(lambda engine=engine, inputs=inputs: engine.run(inputs), args.repeats)
            worst = max((compare_output(name, out, "1x512x512", reference[out], outputs[out],
                                        report.precisions[name]) for out in reference),
                        key=lambda p: p.max_abs / p.limit)
            result["components"][name] = {"seconds": samples, "max_abs_vs_torch": worst.max_abs,
                                          "tolerance": worst.limit, "passed": worst.passed}
        del engines
        start = time.perf_counter()
        compile_engines()  # the same engines from the warm cache: what a new process pays
        result["warm_load_s"] = time.perf_counter() - start
    return {**result, "peak_mb": peak_mb()}


def build_controlnet(directory: Path, model_dir: Path, seed: int = 0) -> Path:
    """SD 1.5's ControlNet architecture (ControlNetModel.from_unet: the U-Net's encoder and mid block, the
    16-32-96-256 conditioning embedding) for the U-Net in `model_dir`, random weights, as a diffusers folder."""
    from diffusers import UNet2DConditionModel

    from kasoku.architectures.tiny import random_controlnet

    torch.manual_seed(seed)
    with torch.device("meta"):  # the U-Net only lends its config: none of its weights are made
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(model_dir / "unet"))
    random_controlnet(unet).save_pretrained(directory, safe_serialization=True)
    return directory


def stage_controlnet(contender: str, args) -> dict:
    """A U-Net step steered by a ControlNet: the ControlNet, then the U-Net with its residuals, one call each
    after warm-up, median of repeats. torch builds the ControlNet when it is missing, counts the FLOPs and
    saves its inputs and outputs (the U-Net's residual inputs are the ControlNet's own outputs); every other
    contender is kasoku's engine on that backend, checked against them."""
    from kasoku.core.components import ImageShape, ShapeProfile
    from kasoku.core.parity import compare_output
    from kasoku.model.loading import load_pipeline
    from kasoku.model.pipeline_model import component_specs
    from kasoku.tools.benchmark import count_flops

    profile = ShapeProfile.from_ranges((1, 1, 1), (SIZE,) * 3, (SIZE,) * 3, MULTIPLE)
    io_file = args.work / "controlnet-io.npz"
    result: dict = {"components": {}}
    if contender == "torch":
        if not (CONTROLNET_DIR / "config.json").exists():
            build_controlnet(CONTROLNET_DIR, MODEL_DIR)
        pipe = load_pipeline(MODEL_DIR, controlnet=CONTROLNET_DIR)
        specs = component_specs(pipe, profile, CONTROLNET_STEP)
        saved, residuals = {}, {}
        for name, spec in specs.items():
            inputs = spec.sample_inputs(ImageShape(1, SIZE, SIZE), seed=3)
            if name == "unet_controlnet":  # the same step: the ControlNet's inputs, and its outputs as residuals
                inputs = {k: torch.as_tensor(residuals.get(k, saved.get(f"controlnet_0.in.{k}", v)))
                          for k, v in inputs.items()}
            flops = count_flops(spec, inputs)  # runs the call: the warm-up
            samples, residuals = _repeat(lambda spec=spec, inputs=inputs: spec.run_torch(inputs), args.repeats)
            saved.update({f"{name}.in.{k}": np.asarray(v) for k, v in inputs.items()})
            saved.update({f"{name}.out.{k}": v for k, v in residuals.items()})
            result["components"][name] = {"seconds": samples, "gflop": flops / 1e9,
                                          "shapes": {k: list(v.shape) for k, v in inputs.items()}}
        np.savez(io_file, **saved)
    else:
        from kasoku.pipeline.compiling import compile_components

        io = np.load(io_file)
        pipe = load_pipeline(MODEL_DIR, lazy=True, controlnet=CONTROLNET_DIR)
        engines, report = compile_components(pipe, backend=contender, components=CONTROLNET_STEP, profile=profile,
                                             cache=args.cache, threads=args.threads, label="sd15-random+controlnet")
        result["compile_s"] = report.seconds
        for name, engine in engines.items():
            inputs = {k.split(".", 2)[2]: io[k] for k in io.files if k.startswith(f"{name}.in.")}
            reference = {k.split(".", 2)[2]: io[k] for k in io.files if k.startswith(f"{name}.out.")}
            engine.run(inputs)
            samples, outputs = _repeat(lambda engine=engine, inputs=inputs: engine.run(inputs), args.repeats)
            worst = max((compare_output(name, out, f"1x{SIZE}x{SIZE}", reference[out], outputs[out])
                         for out in reference), key=lambda p: p.max_abs / p.limit)
            result["components"][name] = {"seconds": samples, "max_abs_vs_torch": worst.max_abs,
                                          "tolerance": worst.limit, "passed": worst.passed}
    return {**result, "peak_mb": peak_mb()}


def _repeat(fn, repeats: int):
    samples, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        samples.append(time.perf_counter() - start)
    return samples, out


def stage_ov_probe(_target: str, args) -> dict:
    """OpenVINO's two warm loads of the U-Net: its compiled blob imported (what kasoku keeps), or its IR
    compiled again (what an IR-only entry would cost); the blob comes from the openvino cold stage."""
    import tempfile

    import openvino as ov

    from kasoku.build.export import export_component
    from kasoku.core.cache import Cache

    entry = next(e for e in Cache(cache_for(args, "openvino")).list() if e.kind == "engine" and e.component == "unet")
    config = {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": args.threads}
    start = time.perf_counter()
    blob = np.memmap(cache_for(args, "openvino") / "entries" / entry.key / "model.blob", dtype=np.uint8, mode="c")
    ov.Core().import_model(ov.Tensor(blob, shared_memory=True), "CPU", config)
    import_s = time.perf_counter() - start
    del blob
    from kasoku.model.pipeline_model import Model

    pipe = Model.load(MODEL_DIR)
    spec = pipe.specs(names=["unet"])["unet"]
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        export_component(spec, Path(tmp) / "model.onnx", check_shapes=[])
        del pipe, spec
        model = ov.Core().read_model(str(Path(tmp) / "model.onnx"))
        ov.save_model(model, str(Path(tmp) / "model.xml"), compress_to_fp16=False)
        del model
        ir_bytes = sum(f.stat().st_size for f in Path(tmp).glob("model.*") if f.suffix in (".xml", ".bin"))
        start = time.perf_counter()
        ov.Core().compile_model(str(Path(tmp) / "model.xml"), "CPU", config)
        ir_s = time.perf_counter() - start
    return {"blob_import_s": import_s, "blob_bytes": entry.size_bytes, "ir_compile_s": ir_s, "ir_bytes": ir_bytes,
            "peak_mb": peak_mb()}


IMAGE_PROMPT = "a beautiful photograph of mt fuji during cherry blossom"
DEFAULT_IMAGE_STEPS = (4, 20)
# kasoku's contenders: backend, precision and shapes (static: exact-shape engines for the one image; dynamic: the
# model's default range, what `kasoku compile MODEL` builds); backend "auto" as a user gets it, and inductor
# (not in the default --images: its cold compiles are long).
KASOKU_IMAGES = {f"kasoku-{p}-{shape}": ("auto", p, shape) for p in ("fp32", "bf16", "int8")
                 for shape in ("static", "dynamic")}
INDUCTOR_IMAGES = {f"kasoku-inductor-{p}-{shape}": ("inductor", p, shape) for p in ("fp32", "bf16")
                   for shape in ("static", "dynamic")}
# kasoku's tuned recipe (`kasoku tune`, then recipe="fastest") at each bound in dB from the fp32 engines; the tuning
# (every precision x step-caching setting, exact-shape engines, at the largest --steps) is shared by both and timed
TUNED_IMAGES = {"kasoku-tuned-32": 32.0, "kasoku-tuned-40": 40.0}
# peers: the virtual environment each runs in (created when missing; their pins conflict with kasoku's)
PEERS = {"optimum-intel-f32-static": "optimum-intel", "optimum-intel-default-dynamic": "optimum-intel",
         "optimum-intel-default-static": "optimum-intel", "openvino-genai": "optimum-intel",
         "optimum-onnx": "optimum-onnx"}
PEER_INSTALLS = {
    "optimum-intel": [["torch==2.13.0", "optimum-intel[openvino]", "diffusers", "openvino-genai"]],
    "optimum-onnx": [["torch==2.13.0", "optimum-onnx", "diffusers", "onnxruntime"]],
    # a source distribution only: pip builds stable-diffusion.cpp with cmake and the C++ compiler (-march=native)
    "stable-diffusion-cpp": [["stable-diffusion-cpp-python==0.4.7", "numpy"]],
}
PEERS_DIR = HERE / ".peers"


def latents_file(args) -> Path:
    """The initial latents every contender starts from (1x4x64x64, seed 0)."""
    path = args.work / "latents.npy"
    if not path.exists():
        np.save(path, torch.randn((1, 4, SIZE // 8, SIZE // 8), generator=torch.Generator().manual_seed(0)).numpy())
    return path


def peer_python(venv: str) -> Path:
    """The peer's virtual environment, created with its pinned installs when missing."""
    python = PEERS_DIR / venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_DIR / venv)], check=True)
        for packages in PEER_INSTALLS[venv]:
            subprocess.run([str(python), "-m", "pip", "install", "-q", *packages], check=True)
        # PyPI's torchvision does not match the torch 2.13 build here and breaks transformers' import
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision"], check=False)
    return python


def stage_image(contender: str, args) -> dict:
    """One 512x512 image with guidance from the shared latents: warm-up, then `repeats` timed calls at each
    step count; the last image of each is saved for the comparison with diffusers."""
    out = args.work / "images" / f"{contender}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if contender in PEERS:
        subprocess.run([str(peer_python(PEERS[contender])), str(HERE / "peer_run.py"), contender, "--model",
                        str(MODEL_DIR), "--work", str(args.work / "peers"), "--latents", str(latents_file(args)),
                        "--out", str(out), "--prompt", IMAGE_PROMPT, "--size", str(SIZE), "--steps",
                        ",".join(map(str, args.steps)), "--repeats", str(args.repeats), "--threads",
                        str(args.threads)], check=True)
        return json.loads(out.read_text())
    import kasoku
    from kasoku.core.components import ImageShape, ShapeProfile
    from kasoku.families import FAMILIES
    from kasoku.model.loading import load_pipeline

    latents = torch.from_numpy(np.load(latents_file(args)))
    result: dict = {}
    start = time.perf_counter()
    if contender in TUNED_IMAGES:
        pipe = tuned_pipeline(contender, args, result)
    elif contender == "diffusers":
        pipe = FAMILIES["sd1"].task_pipeline(load_pipeline(MODEL_DIR), "txt2img")
        result["load_s"] = time.perf_counter() - start
    else:
        backend, precision, shape = {**KASOKU_IMAGES, **INDUCTOR_IMAGES}[contender]
        cache = args.work / "images" / f"{contender}-cache"
        shutil.rmtree(cache, ignore_errors=True)  # each kasoku contender compiles cold
        profile = ShapeProfile.exact(ImageShape(1, SIZE, SIZE), guidance=True, multiple=MULTIPLE) \
            if shape == "static" else None
        pipe = kasoku.KasokuPipeline.from_pretrained(MODEL_DIR, backend, precision=precision, profile=profile,
                                                     components=TXT2IMG, cache_dir=cache, threads=args.threads)
        report = pipe.compile_report
        result.update(compile_s=time.perf_counter() - start, backends=report.backends, precisions=report.precisions,
                      cache_bytes=cache_bytes(cache))

    def generate(steps):
        return pipe(IMAGE_PROMPT, num_inference_steps=steps, guidance_scale=7.5, height=SIZE, width=SIZE,
                    latents=latents, output_type="np").images[0]

    start = time.perf_counter()
    generate(1)
    result["warmup_s"] = time.perf_counter() - start
    images, result["seconds"] = {}, {}
    for steps in args.steps:
        result["seconds"][str(steps)], image = _repeat(lambda steps=steps: generate(steps), args.repeats)
        images[f"steps{steps}"] = np.asarray(image, np.float32)
    np.savez(out.with_suffix(".npz"), **images)
    if contender in TUNED_IMAGES:
        if contender == list(TUNED_IMAGES)[-1]:
            shutil.rmtree(args.work / "images" / "tuned-cache", ignore_errors=True)
    elif contender != "diffusers":
        shutil.rmtree(args.work / "images" / f"{contender}-cache", ignore_errors=True)  # several GB each
    return {**result, "peak_mb": peak_mb()}


def tuned_pipeline(contender: str, args, result: dict):
    """`kasoku tune` at this size and the largest --steps (resumed when an earlier contender tuned), then the
    pipeline of the recorded winner at the contender's bound."""
    import kasoku
    from kasoku.tools.tune import PRECISIONS, TUNE_PROMPTS, markdown, tune

    cache = args.work / "images" / "tuned-cache"
    min_psnr = TUNED_IMAGES[contender]
    begun = time.perf_counter()
    report = tune(MODEL_DIR, steps=max(args.steps), size=(SIZE, SIZE), guidance=7.5, min_psnr=min_psnr,
                  cache_dir=cache, threads=args.threads, prompts=TUNE_PROMPTS[:args.tune_prompts],
                  budget_s=args.tune_budget_s,
                  precisions=args.tune_precisions.split(",") if args.tune_precisions else PRECISIONS,
                  on_trial=lambda t, done, total: print(f"tune {done}/{total}: {t.recipe.label}: {t.seconds or 0:.1f} "
                                                        f"s, {t.psnr_db or 0:.1f} dB {t.error or ''}", flush=True))
    result["tune_s"] = time.perf_counter() - begun
    result["front"] = [{"recipe": t.recipe.label, "seconds": t.seconds, "psnr_db": t.psnr_db, "ssim": t.ssim}
                       for t in report.front]
    result["trials"] = [t.to_dict() for t in report.record.trials]
    result["tune_table"] = markdown(report)
    begun = time.perf_counter()
    pipe = kasoku.KasokuPipeline.from_pretrained(MODEL_DIR, recipe="fastest", min_psnr=min_psnr, components=TXT2IMG,
                                                 cache_dir=cache, threads=args.threads)
    chosen = pipe.recipe
    result.update(compile_s=time.perf_counter() - begun, backends=pipe.compile_report.backends,
                  precisions=pipe.compile_report.precisions, recipe=chosen.recipe.label,
                  tuned_psnr_db=chosen.trial.psnr_db, tuned_ssim=chosen.trial.ssim, cache_bytes=cache_bytes(cache))
    return pipe


def compare_images(args) -> dict:
    """PSNR and SSIM of every contender's images against diffusers fp32's (same latents)."""
    from kasoku.core.parity import psnr, ssim

    folder = args.work / "images"
    reference_file = folder / "diffusers.npz"
    if not reference_file.exists():
        return {}
    reference = np.load(reference_file)
    out = {}
    for path in sorted(folder.glob("*.npz")):
        if path.stem == "diffusers":
            continue
        images = np.load(path)
        out[path.stem] = {key: {"psnr_db": psnr(reference[key], images[key]), "ssim": ssim(reference[key], images[key])}
                          for key in images.files if key in reference.files}
    return out


FIDELITY_PRECISIONS = ("fp32", "bf16", "int8")


def stage_fidelity(precision: str, args) -> dict:
    """The fidelity contract at full size (OpenVINO, exact-shape 512x512 engines): each component's relative
    error against torch fp32 at 512x512, and the images of verify's prompts at the contract's steps against the
    fp32 engines' (saved by the fp32 stage), with the same seed."""
    import kasoku
    from kasoku.core.components import ImageShape, Precision, ShapeProfile
    from kasoku.core.parity import TOLERANCES, parity_against_torch, psnr, ssim
    from kasoku.model.loading import load_pipeline
    from kasoku.model.pipeline_model import component_specs
    from kasoku.tools.verification import FIDELITY_PROMPTS

    folder = args.work / "fidelity"
    folder.mkdir(parents=True, exist_ok=True)
    profile = ShapeProfile.exact(ImageShape(1, SIZE, SIZE), guidance=True, multiple=MULTIPLE)
    pipe = load_pipeline(MODEL_DIR)
    fast = kasoku.compile(pipe, "openvino", precision=precision, profile=profile, components=TXT2IMG,
                          cache_dir=folder / f"cache-{precision}", threads=args.threads)
    specs = component_specs(pipe, profile, TXT2IMG)
    components = {}
    for name, engine in fast.engines.items():
        results = parity_against_torch(specs[name], engine.run, [profile.opt], Precision(precision), seed=11)
        components[name] = {r.output: {"rel_error": r.rel_error, "max_abs": r.max_abs, "passed": r.passed}
                            for r in results}
    steps = TOLERANCES[Precision.BF16].image_steps
    images = {}
    for index, prompt in enumerate(FIDELITY_PROMPTS):
        images[f"prompt{index}"] = fast(prompt, num_inference_steps=steps, height=SIZE, width=SIZE, output_type="np",
                                        generator=torch.Generator().manual_seed(0)).images
    np.savez(folder / f"{precision}.npz", **images)
    shutil.rmtree(folder / f"cache-{precision}", ignore_errors=True)
    result = {"components": components, "steps": steps, "prompts": list(FIDELITY_PROMPTS), "peak_mb": peak_mb()}
    reference_file = folder / "fp32.npz"
    if precision != "fp32" and reference_file.exists():
        reference = np.load(reference_file)
        result["images"] = [{"psnr_db": psnr(reference[k], images[k]), "ssim": ssim(reference[k], images[k])}
                            for k in images]
    return result


def stage_lora(backend: str, args) -> dict:
    """benchmarks/lora.py's measurements at full size, in a cache of their own (emptied first)."""
    from lora import measure  # benchmarks/lora.py: this folder is the script's

    result = measure(MODEL_DIR, SECOND_MODEL_DIR, backend, args.work / f"lora-{backend}", threads=args.threads,
                     repeats=args.repeats, rank_a=4, rank_b=8 if args.smoke else 64,  # tiny projections: 32 wide
                     log=lambda message: print(message, flush=True))
    return {**result, "weights_bytes": weights_bytes(MODEL_DIR), "peak_mb": peak_mb()}


def stage_ort_qdq(_target: str, args) -> dict:
    """ONNX Runtime's own int8 (static QDQ quantization, per channel, the pipeline's own calibration samples)
    on the full U-Net, against kasoku's int8 (NNCF on OpenVINO) and ONNX Runtime fp32, one call each at
    512x512 with guidance after a warm-up: the measurement behind ONNX Runtime refusing --precision int8."""
    import tempfile

    import onnxruntime as ort
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    import kasoku
    from kasoku.core.components import ImageShape, ShapeProfile
    from kasoku.policies.calibration import CalibrationPlan, load_samples

    profile = ShapeProfile.exact(ImageShape(1, SIZE, SIZE), guidance=True, multiple=MULTIPLE)
    cache = args.work / "qdq-cache"
    shutil.rmtree(cache, ignore_errors=True)
    start = time.perf_counter()
    fast = kasoku.KasokuPipeline.from_pretrained(MODEL_DIR, "openvino", precision="int8", profile=profile,
                                                 components=("text_encoder", "unet"), cache_dir=cache,
                                                 threads=args.threads, keep_intermediate=True)
    openvino_compile_s = time.perf_counter() - start
    from kasoku.core.cache import Cache

    entries = Cache(cache).list()
    samples = load_samples(cache / "entries" / next(e.key for e in entries if e.kind == "calibration")
                           / "calibration.npz")
    feeds = {k: np.asarray(v) for k, v in samples[len(samples) // 2].items()}
    result: dict = {"calibration_samples": len(samples), "openvino_int8_compile_s": openvino_compile_s}
    int8_unet = fast.engines["unet"]
    result["openvino_int8_s"] = _repeat(lambda engine=int8_unet: engine.run(feeds), args.repeats + 1)[0][1:]
    onnx_file = cache / "entries" / next(e.key for e in entries if e.kind == "onnx" and e.component == "unet") \
        / "model.onnx"
    del fast, int8_unet
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    session = ort.InferenceSession(str(onnx_file), options, providers=["CPUExecutionProvider"])
    result["onnxruntime_fp32_s"] = _repeat(lambda s=session: s.run(None, feeds), args.repeats + 1)[0][1:]
    reference = session.run(None, feeds)[0]
    del session

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter(samples)

        def get_next(self):
            return next(self.items, None)

    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        target = Path(tmp) / "unet-int8.onnx"
        start = time.perf_counter()
        try:
            quantize_static(str(onnx_file), str(target), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            use_external_data_format=True)
        except Exception as error:  # noqa: BLE001 - a probe: report what ONNX Runtime's tool did
            result.update(quantize_failed=f"{type(error).__name__}: {str(error).splitlines()[0][:300]}")
            return {**result, "peak_mb": peak_mb()}
        result["onnxruntime_quantize_s"] = time.perf_counter() - start
        session = ort.InferenceSession(str(target), options, providers=["CPUExecutionProvider"])
        result["onnxruntime_int8_s"] = _repeat(lambda: session.run(None, feeds), args.repeats + 1)[0][1:]
        out = session.run(None, feeds)[0]
        result["onnxruntime_int8_rel_error"] = float(np.linalg.norm(out - reference) / np.linalg.norm(reference))
    result["plan"] = CalibrationPlan().to_dict()
    shutil.rmtree(cache, ignore_errors=True)
    return {**result, "peak_mb": peak_mb()}


# Step caching (DeepCache): (cache_interval, schedule) per run, interval 1 first (the reference: no caching).
DEEPCACHE_RUNS = ((1, "uniform"), (2, "uniform"), (3, "uniform"), (5, "uniform"), (3, "nonuniform"))
DEEPCACHE_STEPS = 20
UNET_ENGINES = ("unet", "unet_full", "unet_shallow")


def deepcache_flops(branch: int) -> dict:
    """GFLOP of one call of the plain U-Net, the full and the shallow graph (batch 2: guidance, 512x512),
    counted on the meta device (no weights are read, nothing is computed)."""
    from kasoku.architectures.deepcache import Branch, StepCacheFullModule, StepCacheShallowModule
    from kasoku.architectures.unet import UNetModule
    from kasoku.core.components import ImageShape, ShapeProfile
    from kasoku.model.pipeline_model import Model
    from kasoku.tools.benchmark import count_flops_meta

    model = Model.load(MODEL_DIR, lazy=True)  # every module on the meta device
    unet = model.pipe.unet
    geometry = Branch.of(unet.config, branch)
    profile = ShapeProfile.exact(ImageShape(1, SIZE, SIZE), guidance=True, multiple=MULTIPLE)
    specs = model.specs(profile, UNET_ENGINES, cache_branch=branch)
    modules = {"unet": UNetModule(unet), "unet_full": StepCacheFullModule(unet, geometry),
               "unet_shallow": StepCacheShallowModule(unet, geometry)}
    return {name: count_flops_meta(modules[name], specs[name].sample_inputs(profile.opt), specs[name].input_names)
            / 1e9 for name in UNET_ENGINES}


def stage_deepcache(backend: str, args) -> dict:
    """Step caching at full size, side by side on one backend in fp32 with exact-shape 512x512 engines: a 20-step
    image with guidance from the shared latents at each of DEEPCACHE_RUNS (a warm-up call of each, then the median
    of `repeats`): the whole call, the denoising loop (the call less its text encoder and VAE decoder engine time),
    the U-Net engines' calls and seconds, and the image's PSNR and SSIM against interval 1's; with the FLOPs of the
    plain U-Net and of the full and shallow graphs (the shallow graph's share of the U-Net's FLOPs)."""
    import kasoku
    from kasoku.core.components import ImageShape, ShapeProfile
    from kasoku.core.parity import psnr, ssim
    from kasoku.core.step_cache import DEFAULT_BRANCH

    flops = deepcache_flops(DEFAULT_BRANCH)
    cache = args.work / f"deepcache-cache-{backend}"
    shutil.rmtree(cache, ignore_errors=True)
    profile = ShapeProfile.exact(ImageShape(1, SIZE, SIZE), guidance=True, multiple=MULTIPLE)
    start = time.perf_counter()
    pipe = kasoku.KasokuPipeline.from_pretrained(MODEL_DIR, backend, profile=profile, components=TXT2IMG,
                                                 cache_dir=cache, threads=args.threads, step_cache=True)
    compile_s = time.perf_counter() - start
    latents = torch.from_numpy(np.load(latents_file(args)))

    def call(interval: int, schedule: str) -> tuple[float, float, np.ndarray]:
        """(whole call s, denoising loop s, image)"""
        pipe.times.reset()
        begin = time.perf_counter()
        image = pipe(IMAGE_PROMPT, num_inference_steps=DEEPCACHE_STEPS, guidance_scale=7.5, height=SIZE, width=SIZE,
                     latents=latents, output_type="np", cache_interval=interval, cache_schedule=schedule).images[0]
        whole = time.perf_counter() - begin
        return whole, whole - pipe.times.seconds["text_encoder"] - pipe.times.seconds["vae_decoder"], image

    # warm-up: the first call of each engine allocates; a short cached call reaches every engine once
    pipe(IMAGE_PROMPT, num_inference_steps=4, guidance_scale=7.5, height=SIZE, width=SIZE, latents=latents,
         output_type="np", cache_interval=2)
    runs, images = {}, {}
    for interval, schedule in DEEPCACHE_RUNS:
        samples = [call(interval, schedule) for _ in range(args.repeats)]
        label = f"{interval}-{schedule}"
        images[label] = np.asarray(samples[-1][2], np.float32)
        calls = {n: pipe.times.calls[n] for n in UNET_ENGINES if pipe.times.calls.get(n)}
        runs[label] = {"interval": interval, "schedule": schedule, "unet_calls": calls,
                       "full_calls": calls.get("unet", 0) + calls.get("unet_full", 0),
                       "seconds": [whole for whole, _, _ in samples], "loop_seconds": [loop for _, loop, _ in samples],
                       "unet_seconds": {n: pipe.times.seconds[n] for n in calls}}
    reference = images[f"{DEEPCACHE_RUNS[0][0]}-{DEEPCACHE_RUNS[0][1]}"]
    for label, run in runs.items():
        run["psnr_db"], run["ssim"] = psnr(reference, images[label]), ssim(reference, images[label])
        run["gflop"] = sum(run["unet_calls"][n] * flops[n] for n in run["unet_calls"])
    np.savez(args.work / f"deepcache-{backend}.npz", **images)
    shutil.rmtree(cache, ignore_errors=True)  # several GB
    return {"backend": backend, "backends": pipe.compile_report.backends, "compile_s": compile_s,
            "steps": DEEPCACHE_STEPS, "branch": DEFAULT_BRANCH, "gflop_per_call": flops, "runs": runs,
            "peak_mb": peak_mb()}


STAGES = {"model": stage_model, "cold": stage_cold, "warm": stage_warm, "warm-folder": stage_warm_folder,
          "runtime": stage_runtime, "speed": stage_speed, "ov-probe": stage_ov_probe, "image": stage_image,
          "fidelity": stage_fidelity, "ort-qdq": stage_ort_qdq,
          "controlnet": stage_controlnet, "lora": stage_lora, "deepcache": stage_deepcache}


# ---- the run -----------------------------------------------------------------------------------------


def _stem() -> Path:
    return RESULTS / f"{datetime.date.today().isoformat()}-{socket.gethostname()}-full_sd15"


def _results(args) -> dict:
    path = _stem().with_suffix(".json")
    return json.loads(path.read_text()) if path.exists() else {}


def _run_stage(stage: str, target: str, args, log) -> dict:
    """One stage in a fresh process; a failure (killed for memory, say) is recorded and the run goes on."""
    out = args.work / f"stage-{stage}-{target}.json"
    out.unlink(missing_ok=True)
    log(f"stage {stage}:{target}")
    command = [sys.executable, __file__, "--stage", stage, "--target", target, "--stage-json", str(out),
               "--threads", str(args.threads), "--repeats", str(args.repeats), "--cache", str(args.cache),
               "--steps", ",".join(map(str, args.steps)), "--tune-prompts", str(args.tune_prompts),
               *(["--tune-budget-s", str(args.tune_budget_s)] if args.tune_budget_s else []),
               *(["--tune-precisions", args.tune_precisions] if args.tune_precisions else []),
               *(["--smoke"] if args.smoke else [])]
    start = time.perf_counter()
    code = subprocess.run(command).returncode
    if code != 0 or not out.exists():
        return {"failed": True, "returncode": code, "wall_s": time.perf_counter() - start}
    return {**json.loads(out.read_text()), "wall_s": time.perf_counter() - start}


def _record(stage: str, target: str, result: dict, machine: dict) -> None:
    path = _stem().with_suffix(".json")
    report = json.loads(path.read_text()) if path.exists() else {}
    report.setdefault("machine", machine)
    report.setdefault(stage, {})[target] = result
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    _stem().with_suffix(".md").write_text(markdown(report) + "\n")


def machine_description(threads: int) -> dict:
    from kasoku.backends.base import cpu_name
    from kasoku.tools.benchmark import cpu_flags, matmul_gflops

    return {"host": socket.gethostname(), "cpu": cpu_name(), "flags": cpu_flags(), "threads": threads,
            "torch": torch.__version__, "matmul_gflops": matmul_gflops(), "date": datetime.date.today().isoformat()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="cold,warm,warm-folder,runtime",
                        help=f"comma-separated, in order, from {', '.join(STAGES)} (default: the warm start)")
    parser.add_argument("--backends", default="onnxruntime,openvino", help="kasoku backends (cold, warm, runtime)")
    parser.add_argument("--contenders", default="torch,onnxruntime,openvino",
                        help="for the speed and controlnet stages (torch first: the others are checked against it)")
    parser.add_argument("--images", default=",".join(["diffusers", *KASOKU_IMAGES, *TUNED_IMAGES, *PEERS]),
                        help="for the image stage: diffusers, kasoku-{fp32,bf16,int8}-{static,dynamic} (auto), "
                             f"{', '.join(TUNED_IMAGES)} (kasoku tune, then its recipe at 32 and 40 dB), "
                             f"kasoku-inductor-{{fp32,bf16}}-{{static,dynamic}}, and the peers {', '.join(PEERS)}")
    parser.add_argument("--steps", default=",".join(map(str, DEFAULT_IMAGE_STEPS)),
                        type=lambda text: tuple(int(s) for s in text.split(",")),
                        help="for the image stage: the step counts timed (default %(default)s)")
    parser.add_argument("--tune-prompts", type=int, default=3,
                        help="for the tuned contenders: prompts each recipe is timed and judged on (default 3)")
    parser.add_argument("--tune-budget-s", type=float, default=None,
                        help="for the tuned contenders: the tuner's budget in seconds (a rerun resumes; default none)")
    parser.add_argument("--tune-precisions", default=None,
                        help="for the tuned contenders: the precisions the tuner tries, comma-separated (default: "
                             "the tuner's, fp32,bf16,int8)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=WORK / "cache", help="the benchmark's kasoku cache")
    parser.add_argument("--fresh-cache", action="store_true", help="empty the cache first (cold means cold)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"run the stages on the built-in tiny pipeline at 64x64 (a check of this script; "
                             f"results under {SMOKE_DIR})")
    parser.add_argument("--stage", choices=list(STAGES), help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--stage-json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        use_smoke_model()
        if args.cache == WORK / "cache":
            args.cache = SMOKE_DIR / "work" / "cache"
    args.work = WORK
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from kasoku.core.console import console, quiet_third_party_logs

    quiet_third_party_logs()
    torch.set_num_threads(args.threads)
    if args.stage:
        args.stage_json.write_text(json.dumps(STAGES[args.stage](args.target, args), indent=2, default=str))
        return 0

    def log(message: str) -> None:
        console.log(message, markup=False)

    if args.fresh_cache:
        shutil.rmtree(args.cache, ignore_errors=True)
    log("measuring the fp32 matmul rate")
    machine = machine_description(args.threads)
    log(f"{machine['cpu']} ({', '.join(machine['flags']) or 'no AVX-512/AMX'}), {args.threads} threads")
    if not (MODEL_DIR / "model_index.json").exists():  # built in a process of its own: its memory goes with it
        log(f"building SD 1.5 with random weights into {MODEL_DIR}")
        _record("model", "sd15", _run_stage("model", "sd15", args, log), machine)
    if "lora" in args.stages.split(",") and not (SECOND_MODEL_DIR / "model_index.json").exists():
        log(f"building a second SD 1.5 checkpoint (other random weights) into {SECOND_MODEL_DIR}")
        _record("model", "sd15-2", _run_stage("model", "sd15-2", args, log), machine)
    for stage in args.stages.split(","):
        targets = {"speed": args.contenders.split(","), "controlnet": args.contenders.split(","),
                   "ov-probe": ["unet"], "ort-qdq": ["unet"],
                   "image": args.images.split(","),
                   "fidelity": list(FIDELITY_PRECISIONS)}.get(stage, args.backends.split(","))
        for target in targets:
            _record(stage, target, _run_stage(stage, target, args, log), machine)
    if "image" in args.stages.split(","):
        path = _stem().with_suffix(".json")
        report = json.loads(path.read_text())
        report["image_vs_diffusers"] = compare_images(args)
        path.write_text(json.dumps(report, indent=2, default=str))
        _stem().with_suffix(".md").write_text(markdown(report) + "\n")
    console.print(_stem().with_suffix(".md").read_text(), markup=False)
    return 0


# ---- the report --------------------------------------------------------------------------------------


def _median(values) -> float:
    return statistics.median(values)


def markdown(report: dict) -> str:
    m = report.get("machine", {})
    lines = ["# kasoku full_sd15: SD 1.5 architecture, random weights, fp32", "",
             f"{m.get('date')} · {m.get('cpu')} ({', '.join(m.get('flags', [])) or 'no AVX-512/AMX'}) · "
             f"{m.get('threads')} threads · torch {m.get('torch')} · fp32 matmul {m.get('matmul_gflops', 0):.0f} "
             "GFLOP/s · each stage in its own process", ""]
    peaks = [r["peak_mb"] for stage in STAGES for r in report.get(stage, {}).values() if "peak_mb" in r]
    if "cold" in report:
        lines += ["## Cold compile (`kasoku compile`, text encoder + U-Net + VAE decoder, default profile), "
                  "each backend into an empty cache of its own", "",
                  "| backend | seconds | seconds per stage and component | cache size | weights | cache ÷ weights | "
                  "peak RSS |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for backend, r in report["cold"].items():
            if r.get("failed"):
                lines.append(f"| {backend} | failed (exit {r['returncode']}) | | | | |")
                continue
            stages = "; ".join(f"{c} " + ", ".join(f"{k} {v:.0f}" for k, v in st.items())
                               for c, st in r["stages"].items())
            lines.append(f"| {backend} | {r['seconds']:.0f} | {stages} | {r['cache_bytes'] / 1e9:.2f} GB | "
                         f"{r['weights_bytes'] / 1e9:.2f} GB | {r['cache_bytes'] / r['weights_bytes']:.2f}× | "
                         f"{r['peak_mb'] / 1024:.1f} GiB |")
        lines.append("")
    if "warm" in report:
        lines += ["## Warm start: `kasoku.compile(pipe)` on a warm cache against the runtime's own load of the "
                  "same engine files", "",
                  "| backend | component | runtime's own load s | kasoku's load s | ratio |",
                  "| --- | --- | --- | --- | --- |"]
        for backend, warm in report["warm"].items():
            runtime = report.get("runtime", {}).get(backend, {})
            if warm.get("failed"):
                lines.append(f"| {backend} | failed | | | |")
                continue
            own = runtime.get("load_seconds", {})
            for component, seconds in warm["load_seconds"].items():
                base = own.get(component)
                lines.append(f"| {backend} | {component} ({warm['backends'][component]}) | "
                             f"{base:.2f} | {seconds:.2f} | {seconds / base:.2f}× |" if base else
                             f"| {backend} | {component} | - | {seconds:.2f} | - |")
            total_own = sum(own.values()) if own else None
            folder = report.get("warm-folder", {}).get(backend, {})
            ratio = f"{warm['compile_s'] / total_own:.2f}×" if total_own else "-"
            lines.append(f"| {backend} | **`kasoku.compile(pipe)`, whole** | "
                         f"{total_own:.2f} (sum) | **{warm['compile_s']:.2f}** | {ratio} |" if total_own else
                         f"| {backend} | **`kasoku.compile(pipe)`, whole** | - | {warm['compile_s']:.2f} | - |")
            if folder and not folder.get("failed"):
                lines.append(f"| {backend} | `KasokuPipeline.from_pretrained(folder)`, whole (reads no weights) | "
                             f"| {folder['seconds']:.2f} | |")
            lines.append(f"| {backend} | (diffusers' own `from_pretrained`, before kasoku) | | "
                         f"{warm['diffusers_load_s']:.2f} | |")
        lines.append("")
    if "ov-probe" in report:
        r = report["ov-probe"].get("unet", {})
        if not r.get("failed"):
            lines += ["## OpenVINO's warm load of the U-Net: what the entry keeps", "",
                      "| entry holds | size | warm load s |", "| --- | --- | --- |",
                      f"| the compiled blob (kasoku keeps this) | {r['blob_bytes'] / 1e9:.2f} GB | "
                      f"{r['blob_import_s']:.2f} |",
                      f"| the IR (compiled again at load) | {r['ir_bytes'] / 1e9:.2f} GB | {r['ir_compile_s']:.2f} |",
                      ""]
    if "speed" in report and "torch" in report["speed"]:
        torch_run = report["speed"]["torch"]
        rate = m.get("matmul_gflops") or 1.0
        lines += ["## One call per component, 512×512 (U-Net batch 2: guidance), median after warm-up", "",
                  "| component | contender | median s | min–max | speed-up vs torch | FLOP floor s | time ÷ floor | "
                  "max abs vs torch |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for component, t in torch_run.get("components", {}).items():
            floor = t["gflop"] / rate
            base = _median(t["seconds"])
            for name, run in report["speed"].items():
                r = run.get("components", {}).get(component)
                if not r:
                    continue
                median = _median(r["seconds"])
                check = "—" if name == "torch" else (f"{r['max_abs_vs_torch']:.1e}"
                                                     + ("" if r["passed"] else " **over**"))
                lines.append(f"| {component} ({t['gflop']:.0f} GFLOP) | {name} | {median:.2f} | "
                             f"{min(r['seconds']):.2f}–{max(r['seconds']):.2f} | {base / median:.2f}× | {floor:.2f} | "
                             f"{median / floor:.2f} | {check} |")
        lines += ["", *_speed_compile_lines(report["speed"]), *_inductor_lines(report["speed"]), ""]
    lines += _controlnet_table(report)
    if "ort-qdq" in report:
        r = report["ort-qdq"].get("unet", {})
        if not r.get("failed"):
            lines += ["## int8 U-Net step (512x512, batch 2), median after a warm-up: NNCF on OpenVINO against ONNX "
                      "Runtime's own static QDQ quantization (same calibration samples)", "",
                      "| engine | s / step |", "| --- | --- |",
                      f"| ONNX Runtime fp32 | {_median(r['onnxruntime_fp32_s']):.2f} |",
                      f"| kasoku int8 (NNCF hybrid, OpenVINO) | {_median(r['openvino_int8_s']):.2f} |",
                      "| ONNX Runtime int8 (quantize_static, QDQ, per channel) | "
                      + (f"{_median(r['onnxruntime_int8_s']):.2f} (rel. error {r['onnxruntime_int8_rel_error']:.3f},"
                         f" quantized in {r['onnxruntime_quantize_s']:.0f} s) |" if "onnxruntime_int8_s" in r
                         else f"failed: {r.get('quantize_failed')} |"), ""]
    if "lora" in report:
        from lora import markdown as lora_markdown

        lines += [lora_markdown(report["lora"], "Checkpoints and LoRA adapters without re-export (stage lora)").replace(
            "# ", "## ", 1), ""]
    if "image" in report:
        lines += _image_table(report)
    if "fidelity" in report:
        lines += _fidelity_table(report)
    if "deepcache" in report:
        lines += _deepcache_table(report)
    if peaks:
        lines.append(f"Peak resident memory of the run (largest stage): {max(peaks) / 1024:.1f} GiB.")
    return "\n".join(lines)


def _controlnet_table(report: dict) -> list[str]:
    """The controlnet stage: a row per component and contender, and the whole step (ControlNet + U-Net)."""
    stage = report.get("controlnet", {})
    torch_run = stage.get("torch", {})
    if not torch_run.get("components"):
        return []
    rate = report.get("machine", {}).get("matmul_gflops") or 1.0
    shapes = torch_run["components"][CONTROLNET_STEP[0]]["shapes"]
    lines = [f"## A U-Net step with a ControlNet, {SIZE}x{SIZE}: the ControlNet (sample "
             f"{'x'.join(map(str, shapes['sample']))}, control image {'x'.join(map(str, shapes['controlnet_cond']))}),"
             " then the U-Net with its residuals, median after warm-up", "",
             "| component | contender | median s | min–max | speed-up vs torch | FLOP floor s | time ÷ floor | "
             "max abs vs torch |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    gflop = {c: torch_run["components"][c]["gflop"] for c in CONTROLNET_STEP}
    gflop["step"] = sum(gflop.values())
    for row in (*CONTROLNET_STEP, "step"):
        title = "**ControlNet + U-Net step**" if row == "step" else row
        base = _step_median(torch_run, row)
        for name, run in stage.items():
            if run.get("failed") or not run.get("components"):
                continue
            median, floor = _step_median(run, row), gflop[row] / rate
            parts = [run["components"][c] for c in (CONTROLNET_STEP if row == "step" else (row,))]
            spread = "" if row == "step" else f"{min(parts[0]['seconds']):.2f}–{max(parts[0]['seconds']):.2f}"
            check = "—" if name == "torch" else (f"{max(p['max_abs_vs_torch'] for p in parts):.1e}"
                                                 + ("" if all(p["passed"] for p in parts) else " **over**"))
            lines.append(f"| {title} ({gflop[row]:.0f} GFLOP) | {name} | {median:.2f} | {spread} | "
                         f"{base / median:.2f}× | {floor:.2f} | {median / floor:.2f} | {check} |")
    failed = [name for name, run in stage.items() if run.get("failed")]
    return [*lines, "", *(f"The controlnet stage of {name} failed (exit {stage[name]['returncode']})."
                          for name in failed)]


def _step_median(run: dict, row: str) -> float:
    """The median seconds of a component, or of the step: the sum of its components' medians."""
    names = CONTROLNET_STEP if row == "step" else (row,)
    return sum(_median(run["components"][c]["seconds"]) for c in names)


def _speed_compile_lines(speed: dict) -> list[str]:
    """What the speed stage's engines (the 512x512 profile) cost to compile and to load again from the cache."""
    rows = [(name, run) for name, run in speed.items() if "compile_s" in run]
    if not rows:
        return []
    lines = ["| contender | compile s (components built) | warm load s (the three engines from the cache) |",
             "| --- | --- | --- |"]
    for name, run in rows:
        built = ", ".join(run["built"]) or "none: all from the cache"
        lines.append(f"| {name} | {run['compile_s']:.1f} ({built}) | {run['warm_load_s']:.2f} |")
    return [*lines, ""]


def _inductor_lines(speed: dict) -> list[str]:
    """Where inductor stands against OpenVINO per component, at fp32 and at bf16 (each where both ran)."""
    lines = []
    for precision in ("fp32", "bf16"):
        ours, theirs = (speed.get(name if precision == "bf16" else name.split(":")[0], {}).get("components", {})
                        for name in (f"inductor:{precision}", f"openvino:{precision}"))
        common = [c for c in TXT2IMG if c in ours and c in theirs]
        if common:
            ratios = ", ".join(f"{c} {_median(theirs[c]['seconds']) / _median(ours[c]['seconds']):.2f}×"
                               for c in common)
            lines.append(f"inductor {precision} against OpenVINO {precision} (OpenVINO's time ÷ inductor's: above 1× "
                         f"inductor is faster): {ratios}.")
    return lines


def _image_table(report: dict) -> list[str]:
    images, versus = report["image"], report.get("image_vs_diffusers", {})
    measured = sorted({int(s) for r in images.values() for s in r.get("seconds", {})})
    step_counts = measured or list(DEFAULT_IMAGE_STEPS)
    base = {steps: _median(images["diffusers"]["seconds"][str(steps)]) for steps in step_counts
            if str(steps) in images["diffusers"].get("seconds", {})} \
        if "diffusers" in images and not images["diffusers"].get("failed") else {}
    lines = [f"## One {SIZE}x{SIZE} image with guidance, the same initial latents for every contender "
             "(genai: its own noise), median of the timed calls after a warm-up", "",
             "| pipeline | export / cold compile s | " + " | ".join(f"{s} steps s (vs diffusers)" for s in step_counts)
             + " | " + " | ".join(f"PSNR / SSIM vs diffusers, {s} steps" for s in step_counts) + " | peak RSS |",
             "| --- | --- | " + " | ".join(["---"] * 2 * len(step_counts)) + " | --- |"]
    for name, r in images.items():
        if r.get("failed"):
            lines.append(f"| {name} | failed (exit {r['returncode']}) |" + " |" * (2 * len(step_counts) + 1))
            continue
        built = r.get("compile_s", r.get("export_s"))
        cells = []
        for steps in step_counts:
            if str(steps) not in r["seconds"]:
                cells.append("-")
                continue
            median = _median(r["seconds"][str(steps)])
            speedup = f" ({base[steps] / median:.2f}×)" if steps in base else ""
            cells.append(f"{median:.1f}{speedup}")
        for steps in step_counts:
            v = versus.get(name, {}).get(f"steps{steps}")
            cells.append("—" if name == "diffusers" else (f"{v['psnr_db']:.1f} dB / {v['ssim']:.4f}" if v else "-"))
        detail = ""
        if "recipe" in r:
            detail = (f" (recipe: {r['recipe']}, tuned {r['tuned_psnr_db']:.1f} dB / {r['tuned_ssim']:.4f} from the "
                      f"fp32 engines; tuning {r['tune_s']:.0f} s)")
        elif "backends" in r:
            detail = " (" + ", ".join(f"{c}: {r['backends'][c]} {r['precisions'][c]}" for c in r["backends"]) + ")"
        lines.append(f"| {name}{detail} | {'-' if built is None else f'{built:.0f}'} | " + " | ".join(cells)
                     + f" | {r['peak_mb'] / 1024:.1f} GiB |")
    return [*lines, "", *_against_genai(images, step_counts), *_tune_tables(images)]


def _against_genai(images: dict, step_counts: list[int]) -> list[str]:
    """Each kasoku contender's speed-up over openvino-genai's defaults in the same run (the issue's yardstick)."""
    genai = images.get("openvino-genai", {})
    if genai.get("failed") or not genai.get("seconds"):
        return []
    lines = []
    for steps in step_counts:
        if str(steps) not in genai["seconds"]:
            continue
        base = _median(genai["seconds"][str(steps)])
        ratios = [f"{name} {base / _median(r['seconds'][str(steps)]):.2f}×" for name, r in images.items()
                  if name.startswith("kasoku") and not r.get("failed") and str(steps) in r.get("seconds", {})]
        lines.append(f"Against openvino-genai's defaults at {steps} steps ({base:.1f} s): {', '.join(ratios)}.")
    return [*lines, ""]


def _tune_tables(images: dict) -> list[str]:
    """The tuner's table (every trial, the front), once: the tuned contenders share one tuning."""
    table = next((r["tune_table"] for r in images.values() if r.get("tune_table")), None)
    return [table.replace("## ", "### ", 1), ""] if table else []


def _fidelity_table(report: dict) -> list[str]:
    lines = [f"## Fidelity (OpenVINO, exact-shape {SIZE}x{SIZE} engines): each component against torch fp32, "
             "the images of verify's three prompts at 20 steps against the fp32 engines' (same seed)", "",
             "| precision | text encoder rel. error | U-Net rel. error | VAE decoder rel. error | image PSNR, worst | "
             "image SSIM, worst |", "| --- | --- | --- | --- | --- | --- |"]
    for precision, r in report["fidelity"].items():
        if r.get("failed"):
            lines.append(f"| {precision} | failed | | | | |")
            continue
        errors = [max(o["rel_error"] for o in r["components"][c].values()) for c in TXT2IMG]
        images = r.get("images")
        worst = (f"{min(i['psnr_db'] for i in images):.1f} dB", f"{min(i['ssim'] for i in images):.4f}") \
            if images else ("(reference)", "(reference)")
        lines.append(f"| {precision} | " + " | ".join(f"{e:.2e}" for e in errors) + f" | {worst[0]} | {worst[1]} |")
    return [*lines, ""]


def _deepcache_table(report: dict) -> list[str]:
    rate = report.get("machine", {}).get("matmul_gflops") or 1.0
    lines = []
    for backend, r in report["deepcache"].items():
        if r.get("failed"):
            lines += [f"## Step caching (DeepCache) on {backend}: failed (exit {r['returncode']})", ""]
            continue
        flops = r["gflop_per_call"]
        base = r["runs"][next(iter(r["runs"]))]
        share = flops["unet_shallow"] / flops["unet"]
        lines += [f"## Step caching (DeepCache, branch {r['branch']}) on {backend}, fp32, exact-shape "
                  f"{SIZE}x{SIZE} engines: a {r['steps']}-step image with guidance from the same latents, median of "
                  "the timed calls after a warm-up", "",
                  f"One U-Net call (batch 2): plain {flops['unet']:.4g} GFLOP, full graph {flops['unet_full']:.4g} "
                  f"GFLOP, shallow graph {flops['unet_shallow']:.4g} GFLOP (**{share:.1%} of the U-Net's FLOPs**). "
                  "Loop: the call less its text encoder and VAE decoder time.", "",
                  "| interval | schedule | full steps | loop s (min–max) | loop speed-up | whole image s | image "
                  "speed-up | U-Net GFLOP | U-Net FLOP floor s | PSNR / SSIM vs interval 1 |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for run in r["runs"].values():
            loop, whole = _median(run["loop_seconds"]), _median(run["seconds"])
            quality = "—" if run is base else f"{run['psnr_db']:.1f} dB / {run['ssim']:.4f}"
            spread = f"{min(run['loop_seconds']):.1f}–{max(run['loop_seconds']):.1f}"
            lines.append(f"| {run['interval']} | {run['schedule']} | {run['full_calls']} of "
                         f"{sum(run['unet_calls'].values())} | {loop:.1f} ({spread}) | "
                         f"{_median(base['loop_seconds']) / loop:.2f}× | {whole:.1f} | "
                         f"{_median(base['seconds']) / whole:.2f}× | {run['gflop']:.0f} | {run['gflop'] / rate:.1f} | "
                         f"{quality} |")
        lines.append("")
    return lines


if __name__ == "__main__":
    sys.exit(main())
