"""SD3.5-medium at full size with random weights: one transformer step (512x512 and 1024x1024, with guidance)
and the VAE decoder, torch eager fp32 against kasoku's engines in fp32, bf16 and int8; and Flux.1's two block
kinds at full width.

    python benchmarks/full_sd35.py [--stages sd35,flux] [--components transformer@512,transformer@1024,vae_decoder@1024]
    python benchmarks/full_sd35.py --stages sd35 --components transformer@512,transformer_first@512,transformer_rest@512
                                   [--contenders onnxruntime:fp32,openvino:fp32,openvino:bf16,openvino:int8]
                                   [--repeats 3] [--threads 2] [--smoke]
    python benchmarks/full_sd35.py --stages loop [--loop-thresholds auto] [--loop-intervals 3,5]
    python benchmarks/full_sd35.py --stages sd35 --components controlnet_0@512 --contenders openvino:fp32,openvino:bf16

SD3.5-medium's transformer (SD3Transformer2DModel: 24 MMDiT layers 1536 wide, dual attention in the first 13,
QK RMS norm) is 2.5B parameters, 9.9 GB in fp32: torch's copy and a runtime's do not share 24 GiB comfortably,
so each contender runs in its own process (as benchmarks/full_sdxl.py does): `torch` builds the component with
seeded random weights, times torch eager (FLOPs counted on the warm-up call), saves its inputs and outputs and
exports the ONNX file; then each `engine` stage compiles that file with every torch module on the meta device,
times the engine after a warm-up and compares it with torch's saved outputs (max|Δ| and relative error). The
engines are exact-shape (static, as `kasoku generate` builds them). T5-XXL (4.7B parameters, 19 GB in fp32)
does not fit beside its own export here: kasoku refuses it before reading a weight (see the README), and this
benchmark leaves it out. The text embeddings are the transformer's inputs: 77 CLIP + 256 T5 tokens.

`controlnet_0` is an SD3 ControlNet (SD3ControlNetModel, InstantX's kind: its own positional and context
embedding) at SD3.5-medium's width with 6 joint layers, seeded random weights: its engine is the ControlNet a
ControlNet pipeline runs beside the transformer every step (the transformer that adds its samples costs what the
plain one does, plus one addition per block).

The first-block cache (kasoku.core.step_cache): `transformer_first` and `transformer_rest` are components like the
transformer; with all three measured at a size, the report adds the 20-step loop they make at several counts of
full steps.

The `loop` stage runs the caching for real: SD3.5-medium's 20-step denoising loop at 512x512 with guidance 4.5
through kasoku's pipeline (transformer and VAE decoder with seeded random weights on the torch backend, which
holds one copy of the weights for all three transformer graphs; random prompt embeddings in place of the text
encoders), the same latents every time. The reference runs every block through the first-block graphs
(threshold 0, exact); the first-block cache at thresholds picked from the reference's measured changes (`auto`:
their median) and TaylorSeer at each
interval are timed and compared with it (PSNR and SSIM of the decoded images, and the steps each computed).
Results go to <date>-<host>-full_sd35-loop.md/.json.

Flux.1 at full size is 12B parameters (48 GB in fp32) and cannot be built on this machine at all: the `flux`
stage measures one full-width double-stream block (FluxTransformerBlock) and one single-stream block
(FluxSingleTransformerBlock) at 1024x1024 (4096 image tokens, 512 text tokens) instead, per backend. Their int8
engines take the transformers' recipe (int8 weights and activations), calibrated on seeded random block inputs.

Peer: `openvino-defaults`, OpenVINO through its own API on the same ONNX file with its defaults (bf16 on a CPU
with AMX), static shapes: the runtime optimum-intel's OpenVINO pipeline drives for the transformer.
optimum-intel's OVStableDiffusion3Pipeline itself is not run: its exporter converts a whole saved pipeline, T5-XXL
included, which this 24 GiB machine cannot hold beside its conversion (not attempted).

The matmul rate for the FLOP floor is measured once at the start. Each stage reports its peak resident memory.
--smoke runs the same stages on kasoku's tiny SD3 pipeline at 64x64 and a narrow Flux block (a check of this
script; results under /tmp/kasoku-full_sd35-smoke). Writes benchmarks/results/<date>-<host>-full_sd35.md/.json.
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
sys.path.insert(0, str(HERE))
from full_sd15 import _repeat  # noqa: E402 - the sibling benchmark's timing loop

WORK = HERE / ".models" / "sd35-work"
RESULTS = HERE / "results"
SMOKE_DIR = Path("/tmp/kasoku-full_sd35-smoke")
SMOKE = False
TEXT_TOKENS = 256
DEFAULT_COMPONENTS = "transformer@512,transformer@1024,vae_decoder@1024"
DEFAULT_CONTENDERS = "onnxruntime:fp32,openvino:fp32,openvino:bf16,openvino:int8,openvino-defaults:default"
FLUX_BLOCKS = ("flux_double_block", "flux_single_block")

# stabilityai/stable-diffusion-3.5-medium's configurations.
TRANSFORMER = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                   num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                   pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                   dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
VAE = dict(in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2, sample_size=1024,
           block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
           up_block_types=("UpDecoderBlock2D",) * 4, scaling_factor=1.5305, shift_factor=0.0609,
           use_quant_conv=False, use_post_quant_conv=False)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu")
CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
              num_attention_heads=20, max_position_embeddings=77, projection_dim=1280, hidden_act="gelu")
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False)
# an SD3 ControlNet of InstantX's kind at SD3.5-medium's width, 6 joint layers
CONTROLNET = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=6, attention_head_dim=64,
                  num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                  pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384)
FLUX_WIDTH = dict(dim=3072, num_attention_heads=24, attention_head_dim=128)  # black-forest-labs/FLUX.1-dev
# FLUX.1-dev's whole transformer (12B parameters; benchmarks/gpu_check.py builds it on a GPU) and its VAE
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, joint_attention_dim=4096,
                pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
                **{name: FLUX_WIDTH[name] for name in ("num_attention_heads", "attention_head_dim")})
FLUX_VAE = {**VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159}
FLUX_TOKENS = (4096, 512)  # 1024x1024 image tokens, T5 tokens
SEEDS = {"transformer": 3, "vae": 4, "flux_double_block": 5, "flux_single_block": 6, "loop": 7, "calibration": 8,
         "controlnet": 9}
LOOP_STEPS = 20
LOOP_SIZE = 512
LOOP_GUIDANCE = 4.5  # stabilityai/stable-diffusion-3.5-medium's model card


def use_smoke_model() -> None:
    global SMOKE, WORK, RESULTS, FLUX_WIDTH, FLUX_TOKENS
    SMOKE, WORK, RESULTS = True, SMOKE_DIR / "work", SMOKE_DIR / "results"
    FLUX_WIDTH, FLUX_TOKENS = dict(dim=64, num_attention_heads=2, attention_head_dim=32), (64, 16)


def _module(name: str, real: bool, build):
    """Seeded random weights when `real`, else the architecture on the meta device (no memory)."""
    if not real:
        with torch.device("meta"):
            return build()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEEDS[name])
        return build().eval()


def sd35_pipeline(real: tuple[str, ...] = ()):
    """The SD3.5-medium pipeline at full size; only the modules named in `real` hold weights, the text encoders
    never do (--smoke: the tiny SD3 pipeline)."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from kasoku.architectures.tiny import flow_match_scheduler, tiny_t5_tokenizer, tiny_tokenizer
    from kasoku.tools.tiny import tiny_pipeline

    if SMOKE:
        return tiny_pipeline(family="sd3")
    tokenizer, tokenizer_2, tokenizer_3 = tiny_tokenizer(), tiny_tokenizer("!"), tiny_t5_tokenizer()
    with torch.device("meta"):
        clip_l = CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_L))
        clip_g = CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_G))
        t5 = T5EncoderModel(T5Config(**T5_XXL))
    return StableDiffusion3Pipeline(
        transformer=_module("transformer", "transformer" in real, lambda: SD3Transformer2DModel(**TRANSFORMER)),
        vae=_module("vae", "vae" in real, lambda: AutoencoderKL(**VAE)),
        text_encoder=clip_l, tokenizer=tokenizer, text_encoder_2=clip_g, tokenizer_2=tokenizer_2,
        text_encoder_3=t5, tokenizer_3=tokenizer_3, scheduler=flow_match_scheduler(shift=3.0))


def parse_component(text: str) -> tuple[str, int]:
    name, _, size = text.partition("@")
    return name, int(size or 1024)


def _size(size: int) -> int:
    return 64 if SMOKE else size


def _spec(pipe, component: str, size: int):
    from kasoku.core.components import ImageShape, ShapeProfile
    from kasoku.model.pipeline_model import Model

    profile = ShapeProfile.exact(ImageShape(1, size, size), guidance=True, multiple=16, text_tokens=TEXT_TOKENS)
    return Model.of(pipe).specs(profile, [component])[component]


# ---- Flux.1's blocks as components of their own -------------------------------------------------------------


class FluxBlockModule(torch.nn.Module):
    """One Flux.1 block on (hidden_states, encoder_hidden_states, temb, rotary cos, rotary sin)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, hidden_states, encoder_hidden_states, temb, cos, sin):
        encoder, hidden = self.block(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                                     temb=temb, image_rotary_emb=(cos, sin))
        return hidden, encoder


def flux_block_spec(name: str, real: bool):
    """A full-width Flux.1 double- or single-stream block as a ComponentSpec (one image, 1024x1024; static)."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock

    from kasoku.core.components import ComponentSpec, ImageShape, ShapeProfile, TensorSpec

    kind = FluxTransformerBlock if name == "flux_double_block" else FluxSingleTransformerBlock
    module = FluxBlockModule(_module(name, real, lambda: kind(**FLUX_WIDTH)))
    image, text = FLUX_TOKENS
    dim, head = FLUX_WIDTH["dim"], FLUX_WIDTH["attention_head_dim"]
    profile = ShapeProfile.exact(ImageShape(1, 1024, 1024), guidance=False, multiple=16)
    return ComponentSpec(
        name=name,
        inputs=(TensorSpec("hidden_states", (1, image, dim)), TensorSpec("encoder_hidden_states", (1, text, dim)),
                TensorSpec("temb", (1, dim)), TensorSpec("cos", (image + text, head)),
                TensorSpec("sin", (image + text, head))),
        outputs=(TensorSpec("out_hidden_states", (1, image, dim)),
                 TensorSpec("out_encoder_hidden_states", (1, text, dim))),
        profile=profile, load_module=lambda: module, weights=lambda: f"{name}-seed-{SEEDS[name]}",
        config={"block": name, **FLUX_WIDTH}, graph_kind="mmdit", int8="full")


def sd35_controlnet_pipeline(real: bool):
    """The SD3.5-medium pipeline with the SD3 ControlNet (CONTROLNET), which holds weights when `real` (the
    transformer never does here; --smoke: the tiny SD3 pipeline and its tiny ControlNet)."""
    from diffusers import SD3ControlNetModel

    from kasoku.families import FAMILIES

    sd3 = FAMILIES["sd3"]
    if SMOKE:
        return sd3.with_controlnet(sd3.tiny_pipeline(), sd3.tiny_controlnet())
    from kasoku.architectures.sd3_controlnet import randomize_zeroed

    net = _module("controlnet", real, lambda: randomize_zeroed(SD3ControlNetModel(**CONTROLNET)))
    return sd3.with_controlnet(sd35_pipeline(), net)


def _component_spec(component: str, size: int, real: bool):
    if component in FLUX_BLOCKS:
        return flux_block_spec(component, real)
    if component.startswith("controlnet_"):
        return _spec(sd35_controlnet_pipeline(real), component, _size(size))
    # the first-block cache's graphs (transformer_first, transformer_rest) are the transformer's weights
    pipe = sd35_pipeline(real=(("vae",) if component.startswith("vae") else ("transformer",)) if real else ())
    return _spec(pipe, component, _size(size))


def _peak_mb() -> float:
    from kasoku.tools.benchmark import rss_mb

    return rss_mb("VmHWM")


def _key(component: str, size: int) -> str:
    return component if component in FLUX_BLOCKS else f"{component}@{size}"


# ---- stages (each in its own process) ------------------------------------------------------------------------


def stage_torch(component: str, size: int, repeats: int, work: Path) -> dict:
    from kasoku.build.export import export_component
    from kasoku.tools.benchmark import count_flops

    start = time.perf_counter()
    spec = _component_spec(component, size, real=True)
    build_s = time.perf_counter() - start
    inputs = spec.sample_inputs(spec.profile.opt, seed=3)
    start = time.perf_counter()
    flops = count_flops(spec, inputs)  # runs the call: the torch warm-up
    first = time.perf_counter() - start
    samples, reference = _repeat(lambda: spec.run_torch(inputs), repeats)
    key = _key(component, size)
    np.savez(work / f"{key}-io.npz", **{f"in.{k}": v.numpy() for k, v in inputs.items()},
             **{f"out.{k}": v for k, v in reference.items()})
    peak_torch = _peak_mb()
    exported = export_component(spec, work / "onnx" / spec.name / "model.onnx", check_shapes=[])
    return {"stage": "torch", "component": key, "build_s": build_s, "gflop": flops / 1e9,
            "shapes": {k: list(v.shape) for k, v in inputs.items()}, "first_call_s": first, "seconds": samples,
            "export_s": exported.seconds, "onnx_bytes": exported.size_bytes, "peak_mb_torch": peak_torch,
            "peak_mb": _peak_mb()}


def _openvino_defaults(spec, onnx: Path, threads: int):
    """OpenVINO through its own API on kasoku's exported ONNX file, its defaults (bf16 on a CPU with AMX), reshaped
    to the static shape: a peer. (run, {} stages)"""
    import openvino as ov

    core = ov.Core()
    model = core.read_model(str(onnx))
    model.reshape({name: ov.PartialShape(list(low)) for name, (low, _opt, _high) in spec.profile_shapes().items()})
    compiled = core.compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": threads})
    request = compiled.create_infer_request()

    def run(inputs):
        request.infer({k: np.asarray(v) for k, v in inputs.items()})
        return {n: torch.from_numpy(request.get_tensor(n).data.copy()) for n in spec.output_names}

    return run, {"inference_precision": str(compiled.get_property("INFERENCE_PRECISION_HINT"))}


def stage_engine(component: str, size: int, backend: str, precision: str, repeats: int, threads: int,
                 work: Path, calibration_samples: int = 32) -> dict:
    from kasoku.core.parity import compare_output
    from kasoku.pipeline.compiling import compile_components

    spec = _component_spec(component, size, real=False)  # every module on the meta device
    key = _key(component, size)
    io = np.load(work / f"{key}-io.npz")
    inputs = {k[3:]: io[k] for k in io.files if k.startswith("in.")}
    reference = {k[4:]: io[k] for k in io.files if k.startswith("out.")}
    start = time.perf_counter()
    if backend == "openvino-defaults":  # the peer
        run, stages = _openvino_defaults(spec, work / "onnx" / spec.name / "model.onnx", threads)
    else:
        options = dict(backend=backend, precision=precision, cache=work / "cache", onnx_dir=work / "onnx",
                       check_parity=False, threads=threads, label="sd35-random",
                       calibration_samples=calibration_samples)
        _calibrate(spec, options)
        pipe = sd35_controlnet_pipeline(real=False) if component.startswith("controlnet_") else sd35_pipeline()
        engines, report = compile_components(pipe, specs={spec.name: spec}, **options)
        run, stages = engines[spec.name].run, {s.stage: s.seconds for s in report.stages}
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    run(inputs)
    first = time.perf_counter() - start
    samples, out = _repeat(lambda: run(inputs), repeats)
    parity = [compare_output(spec.name, name, key, reference[name], out[name].float().numpy()) for name in reference]
    worst = max(parity, key=lambda p: p.rel_error)
    return {"stage": "engine", "component": key, "backend": backend, "precision": precision, "compile_s": compile_s,
            "stages": stages, "first_call_s": first, "seconds": samples,
            "max_abs_vs_torch": max(p.max_abs for p in parity), "rel_error_vs_torch": worst.rel_error,
            "peak_mb": _peak_mb()}


def _calibrate(spec, options: dict) -> None:
    """The calibration entry of an engine that calibrates (int8 with a calibrated recipe), made before kasoku's build,
    which then finds it: the transformer's inputs recorded by kasoku's own calibration in diffusers' denoising loop
    from seeded random prompt embeddings (the text encoders hold no weights here); a Flux block's, which no pipeline
    loop runs alone, seeded random inputs of its shapes (as random as its weights; the timed input's seed is not
    among them)."""
    from kasoku.build.compiler import Compiler
    from kasoku.core.cache import Cache
    from kasoku.core.options import CompileOptions
    from kasoku.model.pipeline_model import Model
    from kasoku.policies.calibration import recorded_samples, stored_samples

    fields = {k: v for k, v in options.items() if k not in ("cache", "label")}
    compiler = Compiler(Cache(options["cache"]), CompileOptions.of(None, **fields), label=options["label"])
    if not compiler.needs_samples(spec):
        return
    if spec.name in FLUX_BLOCKS:
        stored_samples(compiler, spec, lambda _parts: [
            {name: value.numpy() for name, value in
             spec.sample_inputs(spec.profile.opt, seed=SEEDS["calibration"] + index).items()}
            for index in range(options["calibration_samples"])])
        return
    pipe = sd35_pipeline()
    embeds = random_prompt_embeddings(pipe, spec.profile, torch.Generator().manual_seed(SEEDS["calibration"]))
    recorded_samples(compiler, Model.of(pipe), spec, prompt_inputs=embeds)


# ---- the real loop with step caching -------------------------------------------------------------------------


def random_prompt_embeddings(pipe, profile, generator: torch.Generator, guided: bool = True) -> dict:
    """Seeded random prompt embeddings of a transformer pipeline, as long as its denoiser's engines read them for
    `profile` (kasoku's fact for the family): a call's inputs without text encoders (the negative ones when
    `guided`)."""
    from kasoku.model.pipeline_model import Model

    model = Model.of(pipe)
    tokens = model.family.denoiser_text_length(model, profile)
    config = pipe.transformer.config
    rows = ("", "negative_") if guided else ("",)
    embeds = {f"{row}prompt_embeds": torch.randn(1, tokens, config.joint_attention_dim, generator=generator)
              for row in rows}
    embeds.update({f"{row}pooled_prompt_embeds": torch.randn(1, config.pooled_projection_dim, generator=generator)
                   for row in rows})
    return embeds


def _loop_inputs(pipe, size: int) -> dict:
    """Seeded random prompt embeddings (the CLIP tokens + TEXT_TOKENS T5 tokens) and initial latents: the call's inputs
    without text encoders."""
    from kasoku.core.components import ImageShape, ShapeProfile

    generator = torch.Generator().manual_seed(SEEDS["loop"])
    profile = ShapeProfile.exact(ImageShape(1, size, size), guidance=True, multiple=16, text_tokens=TEXT_TOKENS)
    latent = size // pipe.vae_scale_factor
    return {**random_prompt_embeddings(pipe, profile, generator),
            "latents": torch.randn(1, pipe.transformer.config.in_channels, latent, latent, generator=generator)}


def auto_threshold(changes: list[float]) -> float:
    """The median of the reference's step-to-step changes: where the change since the last full step is like one
    step's, about half the steps skip (how many do is measured, not assumed)."""
    return float(statistics.median(c for c in changes if np.isfinite(c)))


def stage_loop(thresholds: str, intervals: list[int], threads: int, work: Path) -> dict:
    import kasoku
    from kasoku.core.parity import psnr, ssim

    start = time.perf_counter()
    pipe = sd35_pipeline(real=("transformer", "vae"))
    size = _size(LOOP_SIZE)
    inputs = _loop_inputs(pipe, size)
    fast = kasoku.compile(pipe, "torch", components=("transformer", "vae_decoder"), step_cache=True,
                          cache_dir=work / "cache", threads=threads)
    build_s = time.perf_counter() - start

    def generate(**caching) -> dict:
        begun = time.perf_counter()
        image = fast(**inputs, num_inference_steps=LOOP_STEPS, guidance_scale=LOOP_GUIDANCE, height=size,
                     width=size, output_type="np", **caching).images[0]
        run = fast.last_step_cache
        full = LOOP_STEPS - (getattr(run, "skipped", 0) + getattr(run, "forecasts", 0))
        return {"caching": caching, "seconds": time.perf_counter() - begun, "full_steps": full,
                "changes": list(getattr(run, "changes", [])), "image": image}

    fast(**inputs, num_inference_steps=2, guidance_scale=LOOP_GUIDANCE, height=size, width=size,
         output_type="np", cache_threshold=0.0)  # warm-up: first calls pay one-time costs
    reference = generate(cache_threshold=0.0)
    chosen = [auto_threshold(reference["changes"]) if t == "auto" else float(t) for t in thresholds.split(",") if t]
    runs = [generate(cache_threshold=t) for t in chosen]
    runs += [generate(cache_interval=n) for n in intervals]
    for run in runs:
        run.update(psnr_db=psnr(reference["image"], run["image"]), ssim=ssim(reference["image"], run["image"]),
                   speedup=reference["seconds"] / run["seconds"])
    return {"stage": "loop", "size": size, "steps": LOOP_STEPS, "guidance": LOOP_GUIDANCE, "build_s": build_s,
            "reference": {k: v for k, v in reference.items() if k != "image"},
            "runs": [{k: v for k, v in run.items() if k != "image"} for run in runs], "peak_mb": _peak_mb()}


def loop_markdown(report: dict) -> str:
    loop = report["loop"]
    lines = [f"# kasoku full_sd35 loop: SD3.5-medium's {LOOP_STEPS}-step loop with step caching, random weights", "",
             f"{report['date']} · {report['cpu']} ({', '.join(report['flags']) or 'no AVX-512/AMX'}) · "
             f"{report['threads']} threads · torch {report['torch']}", ""]
    if loop.get("failed"):
        return "\n".join([*lines, f"The loop stage failed (exit {loop['returncode']})."])
    reference = loop["reference"]
    lines += [f"{loop['size']}x{loop['size']}, {loop['steps']} steps, guidance {loop['guidance']}, kasoku's pipeline "
              f"on the torch backend (transformer and VAE decoder; random prompt embeddings), the same latents. "
              f"Reference: every block runs (first-block graphs at threshold 0), {reference['seconds']:.0f} s. "
              f"Measured step-to-step changes of the first block's residual: "
              + ", ".join(f"{c:.3f}" for c in reference["changes"][1:]) + ".", "",
              "| caching | loop + decode s | speed-up | steps run in full | PSNR vs reference | SSIM |",
              "| --- | --- | --- | --- | --- | --- |",
              f"| none (threshold 0) | {reference['seconds']:.1f} | 1.00× | {reference['full_steps']} | reference "
              "| 1 |"]
    for run in loop["runs"]:
        caching = run["caching"]
        label = (f"first-block, threshold {caching['cache_threshold']:.3f}" if "cache_threshold" in caching
                 else f"TaylorSeer, interval {caching['cache_interval']}")
        lines.append(f"| {label} | {run['seconds']:.1f} | {run['speedup']:.2f}× | {run['full_steps']} | "
                     f"{run['psnr_db']:.1f} dB | {run['ssim']:.4f} |")
    lines += ["", f"Build {loop['build_s']:.0f} s; peak resident memory {loop['peak_mb'] / 1024:.1f} GiB."]
    return "\n".join(lines)


# ---- the run -------------------------------------------------------------------------------------------------


def _run_stage(args_list: list[str], name: str, work: Path, log, script: str = __file__) -> dict:
    """One stage of `script` (this benchmark, or a sibling's) in a fresh process, so that no two copies of the weights
    share the memory."""
    out = work / f"stage-{name}.json"
    log(f"stage {name}")
    out.unlink(missing_ok=True)
    result = subprocess.run([sys.executable, script, "--stage-json", str(out), *args_list])
    if result.returncode != 0:  # e.g. killed for memory, or refused by kasoku: reported, and the run goes on
        refused = json.loads(out.read_text()) if out.exists() else {}
        return {"failed": True, "returncode": result.returncode, **refused}
    return json.loads(out.read_text())


def markdown(report: dict) -> str:
    lines = ["# kasoku full_sd35: SD3.5-medium architecture and Flux.1 blocks, random weights",
             "", f"{report['date']} · {report['cpu']} ({', '.join(report['flags']) or 'no AVX-512/AMX'}) · "
                 f"{report['threads']} threads · torch {report['torch']} · fp32 matmul {report['matmul_gflops']:.0f} "
                 f"GFLOP/s · median of {report['repeats']} after a warm-up · each contender in its own process", "",
             "| component | contender | median s | min–max s | speed-up vs torch fp32 | FLOP floor s | time ÷ floor | "
             "max abs / rel. error vs torch | cold compile s | peak RSS MB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    refusals: list[str] = []
    for key, entry in report["components"].items():
        torch_run = entry["torch"]
        if torch_run.get("failed"):
            lines.append(f"| {key} | torch | failed (exit {torch_run['returncode']}) | | | | | | | |")
            continue
        floor = torch_run["gflop"] / report["matmul_gflops"]
        base = statistics.median(torch_run["seconds"])
        for name, run in [("torch eager fp32", torch_run), *entry["engines"].items()]:
            if run.get("failed"):
                lines.append(f"| {key} | kasoku {name} | failed (exit {run['returncode']}) | | | | | | | |")
                refusals += [f"{key}, kasoku {name}: {run['error']}"] if "error" in run else []
                continue
            median = statistics.median(run["seconds"])
            check = "—" if name.startswith("torch") else \
                f"{run['max_abs_vs_torch']:.1e} / {run['rel_error_vs_torch']:.1e}"
            compile_s = f"{run['compile_s']:.0f}" if "compile_s" in run else f"export {run['export_s']:.0f}"
            label = name if name.startswith("torch") or name.startswith("openvino-defaults") else f"kasoku {name}"
            lines.append(f"| {key} | {label} | {median:.2f} | {min(run['seconds']):.2f}–{max(run['seconds']):.2f} | "
                         f"{base / median:.2f}× | {floor:.2f} | {median / floor:.2f} | {check} | {compile_s} | "
                         f"{run['peak_mb']:.0f} |")
        lines.append(f"| {key} | shapes | {torch_run['shapes']} | {torch_run['gflop']:.0f} GFLOP | | | | | | |")
    lines += first_block_loop(report)
    lines += taylorseer_loop(report)
    if any(name.endswith(":int8") for entry in report["components"].values() for name in entry.get("engines", {})):
        samples = report.get("calibration_samples", 32)
        lines += ["", f"int8: kasoku's recipe per component (the transformer: int8 weights and activations, "
                      f"calibrated on {samples} transformer calls recorded in diffusers' denoising loop from random "
                      f"prompt embeddings; the Flux blocks: the same recipe, calibrated on {samples} seeded random "
                      "inputs; the VAE: int8 weights); its cold compile includes the recording and the calibration."]
    lines += ["", f"Peak resident memory of the run (largest stage): {report['peak_mb'] / 1024:.1f} GiB."]
    # what the run itself cannot say (a rerun, a stop), and why kasoku refused a contender
    lines += [f"- {note}" for note in [*report.get("notes", []), *refusals]]
    return "\n".join(lines)


def taylorseer_loop(report: dict) -> list[str]:
    """TaylorSeer's loop from the measured plain step: a computed step is one transformer call, a forecast step a
    few tensor operations on the output (no call), so the loop's speed-up is the steps over the computed steps
    (diffusers' rule: warm-up 3, then one in the interval)."""
    from kasoku.core.step_cache import TaylorSeerRun

    computed = {n: sum(TaylorSeerRun(n).computes(s) for s in range(LOOP_STEPS)) for n in (2, 3, 4)}
    lines = ["", f"TaylorSeer, a {LOOP_STEPS}-step transformer loop (warm-up 3): computed steps "
             + ", ".join(f"interval {n}: {k} of {LOOP_STEPS}" for n, k in computed.items()) + "; the loop's "
             "speed-up is the steps over the computed ones (forecasts are not engine calls):", "",
             "| size | contender | plain step s | uncached loop s | "
             + " | ".join(f"interval {n}: loop s (speed-up)" for n in computed) + " |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in computed) + " |"]
    rows = 0
    for key, part in report["components"].items():
        if not key.startswith("transformer@"):
            continue
        for contender, run in part["engines"].items():
            if run.get("failed"):
                continue
            plain = statistics.median(run["seconds"])
            lines.append(f"| {key.partition('@')[2]} | {contender} | {plain:.2f} | {plain * LOOP_STEPS:.0f} | "
                         + " | ".join(f"{plain * k:.0f} s ({LOOP_STEPS / k:.2f}×)" for k in computed.values())
                         + " |")
            rows += 1
    return lines if rows else []


def first_block_loop(report: dict) -> list[str]:
    """The first-block cache's loop from the measured step of each graph (per size and contender measured for all
    three): a full step runs transformer_first and transformer_rest, a skipped step transformer_first alone. How
    many steps skip is the threshold's and the weights' (random weights say nothing of it), so the loop is given
    for 20 steps at several counts of full steps."""
    lines = []
    components = report["components"]
    for key in [k for k in components if k.startswith("transformer@")]:
        size = key.partition("@")[2]
        parts = [components.get(f"transformer{p}@{size}") for p in ("", "_first", "_rest")]
        if any(p is None for p in parts):
            continue
        for contender in parts[0]["engines"]:
            runs = [p["engines"].get(contender) or {"failed": True} for p in parts]
            if any(r.get("failed") for r in runs):
                continue
            plain, first, rest = (statistics.median(r["seconds"]) for r in runs)
            if not lines:
                lines += ["", f"First-block cache, a {LOOP_STEPS}-step transformer loop from the measured steps "
                              "(full step: first + rest; skipped step: first):", "",
                          "| size | contender | plain step s | first s | rest s | full steps of 20: 20 | 10 | 7 | 5 |",
                          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
            loops = [LOOP_STEPS * plain / (full * (first + rest) + (LOOP_STEPS - full) * first)
                     for full in (20, 10, 7, 5)]
            lines.append(f"| {size} | {contender} | {plain:.2f} | {first:.2f} | {rest:.2f} | "
                         + " | ".join(f"{x:.2f}×" for x in loops) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="sd35,flux",
                        help="sd35 (the transformer and VAE), flux (two blocks), loop (the 20-step loop with step "
                             "caching, its own report)")
    parser.add_argument("--components", default=DEFAULT_COMPONENTS, help="NAME@SIZE, comma-separated")
    parser.add_argument("--contenders", default=DEFAULT_CONTENDERS, help="BACKEND:PRECISION, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--work", type=Path, default=WORK, help="scratch folder (~25 GB free disk)")
    parser.add_argument("--tag", default="",
                        help="appended to the results' file name (…-full_sd35-TAG.md), so that runs of one day with "
                             "other components or contenders keep their own files")
    parser.add_argument("--calibration-samples", type=int, default=8,
                        help="int8: transformer calls recorded to calibrate on (kasoku's default is 32; each costs a "
                             "recording call and an fp32 statistics call, about 40 s at 512x512 on 2 cores)")
    parser.add_argument("--loop-thresholds", default="auto",
                        help="loop: first-block cache thresholds, comma-separated; auto: the median of the reference "
                             "loop's step-to-step changes (default %(default)s)")
    parser.add_argument("--loop-intervals", default="3,5", type=lambda text: [int(n) for n in text.split(",") if n],
                        help="loop: TaylorSeer intervals, comma-separated (default 3,5)")
    parser.add_argument("--smoke", action="store_true", help=f"the tiny SD3 pipeline (results under {SMOKE_DIR})")
    parser.add_argument("--stage", choices=("torch", "engine", "loop"), help=argparse.SUPPRESS)
    parser.add_argument("--component", help=argparse.SUPPRESS)
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--stage-json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        default_work = args.work == WORK
        use_smoke_model()
        args.work = WORK if default_work else args.work

    from kasoku.core.console import console, quiet_third_party_logs

    quiet_third_party_logs()
    torch.set_num_threads(args.threads)
    if args.stage == "loop":
        args.work.mkdir(parents=True, exist_ok=True)
        result = stage_loop(args.loop_thresholds, args.loop_intervals, args.threads, args.work)
        args.stage_json.write_text(json.dumps(result, indent=2))
        return 0
    if args.stage:
        args.work.mkdir(parents=True, exist_ok=True)
        component, size = parse_component(args.component)
        if args.stage == "torch":
            result = stage_torch(component, size, args.repeats, args.work)
        else:
            from kasoku.core.errors import KasokuError

            backend, precision = args.contender.split(":")
            try:
                result = stage_engine(component, size, backend, precision, args.repeats, args.threads, args.work,
                                      args.calibration_samples)
            except KasokuError as error:  # kasoku refused (memory, say): the report says why
                args.stage_json.write_text(json.dumps({"failed": True, "returncode": 1, "error": str(error)}))
                console.print(f"kasoku refused: {error}", markup=False)
                return 1
        args.stage_json.write_text(json.dumps(result, indent=2))
        return 0

    from kasoku.backends.base import cpu_flags, cpu_name
    from kasoku.tools.benchmark import matmul_gflops

    def log(message: str) -> None:
        console.log(message, markup=False)

    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True, exist_ok=True)
    log(f"CPU: {cpu_name()} ({', '.join(cpu_flags()) or 'no AVX-512/AMX'}); measuring the fp32 matmul rate")
    report = {"date": datetime.date.today().isoformat(), "host": socket.gethostname(), "cpu": cpu_name(),
              "flags": cpu_flags(), "threads": args.threads, "torch": torch.__version__, "repeats": args.repeats,
              "matmul_gflops": matmul_gflops(), "components": {}, "smoke": args.smoke,
              "calibration_samples": args.calibration_samples, "tag": args.tag}
    common = ["--repeats", str(args.repeats), "--threads", str(args.threads), "--work", str(args.work),
              "--calibration-samples", str(args.calibration_samples), *(["--smoke"] if args.smoke else [])]
    stages = args.stages.split(",")
    if "loop" in stages:
        report["loop"] = _run_stage(["--stage", "loop", "--loop-thresholds", args.loop_thresholds,
                                     "--loop-intervals", ",".join(map(str, args.loop_intervals)), *common],
                                    "loop", args.work, log)
        write_loop_report(report)
        shutil.rmtree(args.work / "cache", ignore_errors=True)
    components = [c for c in args.components.split(",") if "sd35" in stages and c]
    components += list(FLUX_BLOCKS) if "flux" in stages else []
    for text in components:
        component, size = parse_component(text)
        key = _key(component, size)
        entry = report["components"][key] = {"engines": {}}
        entry["torch"] = _run_stage(["--stage", "torch", "--component", text, *common], f"torch-{key}", args.work,
                                    log)
        if not entry["torch"].get("failed"):
            for contender in args.contenders.split(","):
                entry["engines"][contender] = _run_stage(
                    ["--stage", "engine", "--component", text, "--contender", contender, *common],
                    f"engine-{key}-{contender.replace(':', '-')}", args.work, log)
        shutil.rmtree(args.work / "onnx", ignore_errors=True)  # free the disk before the next component
        shutil.rmtree(args.work / "cache", ignore_errors=True)
        write_report(report)  # after each component: what is done so far, in case a later stage is stopped
    return 0


def write_loop_report(report: dict) -> None:
    """The loop's own files (a run of the components the same day keeps its own)."""
    _write_results("full_sd35-loop", loop_markdown(report), {k: v for k, v in report.items() if k != "components"})


def write_report(report: dict) -> None:
    runs = [r for e in report["components"].values() for r in [e["torch"], *e["engines"].values()]]
    report["peak_mb"] = max((r["peak_mb"] for r in runs if "peak_mb" in r), default=0.0)
    tag = report.get("tag")
    _write_results(f"full_sd35-{tag}" if tag else "full_sd35", markdown(report), report)


def _write_results(name: str, text: str, data: dict) -> None:
    """<date>-<host>-NAME.md and .json under RESULTS, and the table on the console."""
    from kasoku.core.console import console

    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"{data['date']}-{socket.gethostname()}-{name}"
    stem.with_suffix(".md").write_text(text + "\n")
    stem.with_suffix(".json").write_text(json.dumps(data, indent=2))
    console.print(text, markup=False)
    console.print(f"wrote {stem}.md and .json")


if __name__ == "__main__":
    sys.exit(main())
