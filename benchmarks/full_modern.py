"""The newest few-step families at full size with random weights: Sana Sprint (0.6B, 1.6B), Flux.2 klein (4B),
Z-Image-Turbo (6B) and Qwen-Image (20B); each component as its pipeline calls it, torch eager fp32 and bf16 against
kasoku's engines and OpenVINO's own defaults, each contender in its own process.

    python benchmarks/full_modern.py [--parts sana-0.6b/transformer@1024,sana-0.6b/vae_decoder@1024]
                                     [--contenders onnxruntime:fp32,openvino:bf16,openvino:int8,openvino-defaults]
                                     [--repeats 3] [--threads 2] [--smoke] [--tag TAG]
    python benchmarks/full_modern.py --list        # every part this script knows, with its configuration

A part is FAMILY/COMPONENT@SIZE (an image size in pixels) or FAMILY/COMPONENT@TOKENS (a text encoder's prompt
length). The configurations are the published ones as this machine can read them (diffusers' conversion scripts,
its class defaults, the model cards), said per family below and in the report; the weights are seeded random.

What fits and what does not (24 GiB, one copy of the weights in torch and one in the runtime, each contender in its
own process):
- Sana Sprint 0.6B (transformer 0.59B, DC-AE 0.31B: 2.4 and 1.3 GB in fp32) and 1.6B (6.4 GB) run whole;
  `sana-0.6b-lite` is Sana Sprint 0.6B with DC-AE-Lite, the lighter decoder its authors publish for it.
- Flux.2 klein 4B (5 double- and 20 single-stream blocks at 3072 wide), Z-Image-Turbo's 6B (30 layers at 3840) and
  Qwen-Image's 20B (60 dual-stream layers at 3072) cannot hold torch's fp32 copy beside a runtime's: their
  `transformer-N` parts are the same transformer class at its full width with N layers of each kind (`-1`: one
  double and one single block for Flux.2), the pipeline's own forward, embeddings and output included. The report
  gives the measured time and an estimate of the whole step: measured x (the whole transformer's FLOPs / the
  part's), both counted by torch on the meta device. The estimate says so.
- The LLM text encoders (Gemma 2 2B: 10.5 GB in fp32; Qwen3 4B: 16 GB) are measured with `text_encoder-N`: N of
  their decoder layers at full width with the whole vocabulary, estimated to the whole stack the same way.

Each component is a ComponentSpec written here around the module and the inputs its pipeline gives it (read from
diffusers' pipeline code), so that a part (a transformer with one layer of each kind, 4 layers of a text encoder) can
be measured where the whole pipeline does not fit or has no loop to run it; benchmarks/full_modern_image.py compiles
whole pipelines the way a user does (kasoku's generic path, from the pipeline's recorded calls). The engines are
exact-shape (static), as `kasoku generate` builds them for a call. `openvino-defaults` is OpenVINO's own API on the
same ONNX file with its defaults; optimum-intel's own pipeline runs in full_modern_image.py.

--smoke runs the same parts at toy widths (a check of this script; results under /tmp/kasoku-full_modern-smoke).
Writes benchmarks/results/<date>-<host>-full_modern[-TAG].md/.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from full_sd15 import _repeat  # noqa: E402 - the sibling benchmarks' timing loop, peer and stage runner
from full_sd35 import _openvino_defaults, _peak_mb, _run_stage  # noqa: E402

WORK = HERE / ".models" / "modern-work"
RESULTS = HERE / "results"
SMOKE_DIR = Path("/tmp/kasoku-full_modern-smoke")
SMOKE = False
DEFAULT_PARTS = "sana-0.6b/transformer@1024,sana-0.6b/transformer@512,sana-0.6b/vae_decoder@1024"
DEFAULT_CONTENDERS = "onnxruntime:fp32,openvino:fp32,openvino:bf16,openvino:int8,openvino-defaults:default"
# contenders' precisions that are int8 with another recipe (kasoku.backends.int8) than kasoku's for the part
BEYOND_RECIPE = {"int8-full": "full", "int4-weights": "int4-weights"}


@dataclasses.dataclass(frozen=True)
class Family:
    """A family's published configuration (where it comes from, in `source`), its steps and guidance."""

    title: str
    source: str
    steps: int
    guidance: str
    transformer: dict[str, Any]
    vae: dict[str, Any]
    text_encoder: dict[str, Any]


# Efficient-Large-Model/Sana_Sprint_*_1024px: diffusers' scripts/convert_sana_to_diffusers.py (SanaSprint_600M_P1_D28,
# SanaSprint_1600M_P1_D20); its DC-AE is dc-ae-f32c32-sana-1.x (scripts/convert_dcae_to_diffusers.py's sana-1.0
# layout); its text encoder Gemma 2 2B (google/gemma-2-2b-it's config)
_SANA = dict(in_channels=32, out_channels=32, caption_channels=2304, mlp_ratio=2.5, attention_bias=False,
             sample_size=32, patch_size=1, norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=None,
             qk_norm="rms_norm_across_heads", guidance_embeds=True)
_SANA_06 = dict(num_attention_heads=36, attention_head_dim=32, num_layers=28, num_cross_attention_heads=16,
                cross_attention_head_dim=72, cross_attention_dim=1152)
_SANA_16 = dict(num_attention_heads=70, attention_head_dim=32, num_layers=20, num_cross_attention_heads=20,
                cross_attention_head_dim=112, cross_attention_dim=2240)
_DC_AE = dict(in_channels=3, latent_channels=32, attention_head_dim=32,
              encoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
              decoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
              encoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
              decoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
              encoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
              decoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
              encoder_layers_per_block=(2, 2, 2, 3, 3, 3), decoder_layers_per_block=(3, 3, 3, 3, 3, 3),
              downsample_block_type="conv", upsample_block_type="interpolate", decoder_norm_types="rms_norm",
              decoder_act_fns="silu", scaling_factor=0.41407)
# DC-AE-Lite (mit-han-lab/dc-ae-lite-f32c32-sana-1.1-diffusers, which Sana's authors give Sana Sprint for faster
# decoding): DC-AE's encoder, a decoder of ResBlocks only (efficientvit's ae_model_zoo: depths 0,3,5,4,4,4, pixel
# shuffle upsampling, a SiLU before the last convolution)
_LITE_DECODER = dict(decoder_block_types="ResBlock", decoder_layers_per_block=(0, 3, 5, 4, 4, 4),
                     decoder_qkv_multiscales=((),) * 6, upsample_block_type="pixel_shuffle", decoder_conv_act_fn="silu")
_DC_AE_LITE = {**_DC_AE, **_LITE_DECODER}
_GEMMA2_2B = dict(kind="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_tokens=300)
# Qwen/Qwen3-4B's config: the text encoder of Flux.2 klein 4B and of Z-Image-Turbo
_QWEN3_4B = dict(kind="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_tokens=512)
# Flux.1's VAE layout with 16 latent channels (Z-Image-Turbo's); Flux.2's is AutoencoderKLFlux2's own defaults
_KL16 = dict(in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2,
             block_out_channels=(128, 256, 512, 512),
             down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
             scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)

FAMILIES = {
    "sana-0.6b": Family("Sana Sprint 0.6B", "convert_sana_to_diffusers.py SanaSprint_600M_P1_D28", 2,
                        "none (distilled)",
                        {**_SANA, **_SANA_06}, _DC_AE, _GEMMA2_2B),
    "sana-1.6b": Family("Sana Sprint 1.6B", "convert_sana_to_diffusers.py SanaSprint_1600M_P1_D20", 2,
                        "none (distilled)",
                        {**_SANA, **_SANA_16}, _DC_AE, _GEMMA2_2B),
    "sana-0.6b-lite": Family("Sana Sprint 0.6B with DC-AE-Lite", "convert_sana_to_diffusers.py SanaSprint_600M_P1_D28; "
                             "dc-ae-lite-f32c32-sana-1.1", 2, "none (distilled)", {**_SANA, **_SANA_06}, _DC_AE_LITE,
                             _GEMMA2_2B),
    # scripts/convert_flux2_to_diffusers.py's klein-4b
    "flux2-klein-4b": Family("Flux.2 klein 4B", "convert_flux2_to_diffusers.py klein-4b", 4, "none (distilled)",
                             dict(patch_size=1, in_channels=128, num_layers=5, num_single_layers=20,
                                  attention_head_dim=128, num_attention_heads=24, joint_attention_dim=7680,
                                  timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32),
                                  rope_theta=2000, eps=1e-6, guidance_embeds=False), {}, _QWEN3_4B),
    # ZImageTransformer2DModel's defaults are Tongyi-MAI/Z-Image-Turbo's
    "z-image-turbo": Family("Z-Image-Turbo", "ZImageTransformer2DModel's defaults", 8, "none (distilled)", {}, _KL16,
                            _QWEN3_4B),
    # QwenImageTransformer2DModel's defaults are Qwen/Qwen-Image's (60 layers)
    "qwen-image": Family("Qwen-Image", "QwenImageTransformer2DModel's defaults", 50, "true CFG 4.0 (two calls)",
                         dict(num_layers=60), {}, {}),
}
# the depth a reduced part keeps, by its suffix: "transformer-1", "text_encoder-4"
SEED = 11


def use_smoke_model() -> None:
    """Toy widths for every family: the script's check."""
    global SMOKE, WORK, RESULTS
    SMOKE, WORK, RESULTS = True, SMOKE_DIR / "work", SMOKE_DIR / "results"
    small_text = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    FAMILIES["sana-0.6b"] = dataclasses.replace(
        FAMILIES["sana-0.6b"], transformer={**_SANA, **dict(num_attention_heads=2, attention_head_dim=16, num_layers=2,
                                                           num_cross_attention_heads=2, cross_attention_head_dim=16,
                                                           cross_attention_dim=32, caption_channels=64)},
        vae={**_DC_AE, "encoder_block_out_channels": (8, 8, 16, 16, 32, 32),
             "decoder_block_out_channels": (8, 8, 16, 16, 32, 32),
             "encoder_layers_per_block": (1,) * 6, "decoder_layers_per_block": (1,) * 6, "attention_head_dim": 8},
        text_encoder={**_GEMMA2_2B, **small_text})
    FAMILIES["sana-0.6b-lite"] = dataclasses.replace(FAMILIES["sana-0.6b"], vae={
        **FAMILIES["sana-0.6b"].vae, **_LITE_DECODER, "decoder_layers_per_block": (0, 1, 1, 1, 1, 1)})
    FAMILIES["flux2-klein-4b"] = dataclasses.replace(
        FAMILIES["flux2-klein-4b"], transformer={**FAMILIES["flux2-klein-4b"].transformer, "num_attention_heads": 2,
                                                 "attention_head_dim": 32, "joint_attention_dim": 96,
                                                 "axes_dims_rope": (8, 8, 8, 8)},
        # its pipeline reads layers 9, 18 and 27, joined into the transformer's 96 = 3 x 32 wide text tokens
        text_encoder={**_QWEN3_4B, **small_text, "num_hidden_layers": 28, "hidden_size": 32, "head_dim": 16})
    FAMILIES["z-image-turbo"] = dataclasses.replace(FAMILIES["z-image-turbo"], transformer=dict(
        dim=64, n_heads=2, n_kv_heads=2, cap_feat_dim=64, axes_dims=[16, 8, 8]))
    FAMILIES["qwen-image"] = dataclasses.replace(FAMILIES["qwen-image"], transformer=dict(
        num_layers=60, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(8, 4, 4)))


# ---- the parts: a module, its inputs and outputs as the pipeline gives them ---------------------------------------


@dataclasses.dataclass(frozen=True)
class Part:
    family: str
    component: str  # transformer, transformer-N, vae_decoder, text_encoder, text_encoder-N
    size: int  # pixels (an image part) or tokens (a text encoder)

    @classmethod
    def parse(cls, text: str) -> Part:
        family, _, rest = text.partition("/")
        component, _, size = rest.partition("@")
        if family not in FAMILIES:
            raise SystemExit(f"unknown family {family!r}: choose from {', '.join(FAMILIES)}")
        return cls(family, component, int(size))

    @property
    def key(self) -> str:
        return f"{self.family}/{self.component}@{self.size}"

    @property
    def kind(self) -> str:
        return self.component.partition("-")[0]

    @property
    def depth(self) -> int | None:
        """The layers a reduced part keeps (None: the whole component)."""
        _, _, depth = self.component.partition("-")
        return int(depth) if depth else None


class Called(torch.nn.Module):
    """A module called as its pipeline calls it: `call(module, *inputs)` returns the output the pipeline reads."""

    def __init__(self, module: torch.nn.Module, call: Callable[..., torch.Tensor]):
        super().__init__()
        self.module, self.call = module, call

    def forward(self, *inputs):
        return (self.call(self.module, *inputs),)  # a tuple of outputs, as the spec names them


def _seeded(build: Callable[[], torch.nn.Module], real: bool) -> torch.nn.Module:
    if not real:
        with torch.device("meta"):
            return build()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        module = build().eval()
    for _name, buffer in module.named_buffers():  # torch.empty pads (Z-Image's): seeded values, not memory's
        if not torch.isfinite(buffer).all():
            buffer.zero_()
    for name, parameter in module.named_parameters():
        if "pad_token" in name:
            with torch.no_grad():
                parameter.normal_(generator=torch.Generator().manual_seed(SEED))
    return module


def _transformer(part: Part, depth: int | None):
    """The family's transformer (at `depth` layers of each kind where given), the way its pipeline calls it, and its
    inputs: (build, call, inputs [(name, shape, dtype, high)], output shape)."""
    import diffusers as d

    family = FAMILIES[part.family]
    config = dict(family.transformer)
    size = part.size
    if part.family.startswith("sana"):
        if depth:
            config["num_layers"] = depth
        latent = size // 32
        text = family.text_encoder["max_tokens"]
        return (lambda: d.SanaTransformer2DModel(**config),
                lambda m, x, text_states, mask, t, g: m(x, encoder_hidden_states=text_states,
                                                       encoder_attention_mask=mask, timestep=t, guidance=g,
                                                       return_dict=False)[0],
                [("hidden_states", (1, config["in_channels"], latent, latent), torch.float32, None),
                 ("encoder_hidden_states", (1, text, config["caption_channels"]), torch.float32, None),
                 ("encoder_attention_mask", (1, text), torch.int64, 2), ("timestep", (1,), torch.float32, None),
                 ("guidance", (1,), torch.float32, None)],
                (1, config["out_channels"], latent, latent))
    if part.family.startswith("flux2"):
        if depth:
            config.update(num_layers=depth, num_single_layers=depth)
        tokens, text = (size // 16) ** 2, 512
        return (lambda: d.Flux2Transformer2DModel(**config),
                lambda m, x, text_states, t, img_ids, txt_ids: m(hidden_states=x, timestep=t, guidance=None,
                                                                 encoder_hidden_states=text_states, txt_ids=txt_ids,
                                                                 img_ids=img_ids, return_dict=False)[0],
                [("hidden_states", (1, tokens, config["in_channels"]), torch.float32, None),
                 ("encoder_hidden_states", (1, text, config["joint_attention_dim"]), torch.float32, None),
                 ("timestep", (1,), torch.float32, None), ("img_ids", (1, tokens, 4), torch.int64, 64),
                 ("txt_ids", (1, text, 4), torch.int64, 64)],
                (1, tokens, config["in_channels"]))
    if part.family.startswith("z-image"):
        if depth:
            config["n_layers"] = depth
        latent, text = size // 8, 512
        dim = config.get("cap_feat_dim", 2560)
        return (lambda: d.ZImageTransformer2DModel(**config),
                lambda m, x, t, caption: m([x], t, [caption], return_dict=False)[0][0],
                [("latents", (16, 1, latent, latent), torch.float32, None), ("timestep", (1,), torch.float32, None),
                 ("cap_feats", (text, dim), torch.float32, None)],
                (16, 1, latent, latent))
    if part.family.startswith("qwen"):
        if depth:
            config["num_layers"] = depth
        latent, text = size // 16, 512
        width = config.get("joint_attention_dim", 3584)
        channels = config.get("in_channels", 64)
        return (lambda: d.QwenImageTransformer2DModel(**config),
                lambda m, x, text_states, mask, t: m(hidden_states=x, timestep=t, encoder_hidden_states=text_states,
                                                     encoder_hidden_states_mask=mask, img_shapes=[(1, latent, latent)],
                                                     return_dict=False)[0],
                [("hidden_states", (1, latent * latent, channels), torch.float32, None),
                 ("encoder_hidden_states", (1, text, width), torch.float32, None),
                 ("encoder_hidden_states_mask", (1, text), torch.int64, 2), ("timestep", (1,), torch.float32, None)],
                (1, latent * latent, config.get("out_channels") or channels // 4 * 4))
    raise SystemExit(f"{part.key}: no transformer written for {part.family}")


def _vae_decoder(part: Part, _depth):
    import diffusers as d

    family = FAMILIES[part.family]
    if part.family.startswith("sana"):
        latent = part.size // 32
        return (lambda: d.AutoencoderDC(**family.vae), lambda m, z: m.decode(z, return_dict=False)[0],
                [("latent", (1, family.vae["latent_channels"], latent, latent), torch.float32, None)],
                (1, 3, part.size, part.size))
    if part.family.startswith("z-image"):
        latent = part.size // 8
        return (lambda: d.AutoencoderKL(**family.vae), lambda m, z: m.decode(z, return_dict=False)[0],
                [("latent", (1, 16, latent, latent), torch.float32, None)], (1, 3, part.size, part.size))
    raise SystemExit(f"{part.key}: no VAE decoder written for {part.family}")


def _text_encoder(part: Part, depth: int | None):
    import transformers as tr

    config = dict(FAMILIES[part.family].text_encoder)
    kind = config.pop("kind")
    config.pop("max_tokens")
    if depth:
        config["num_hidden_layers"] = depth
    build = (lambda: tr.Gemma2Model(tr.Gemma2Config(**config, pad_token_id=0, bos_token_id=2, eos_token_id=1))) \
        if kind == "gemma2" else (lambda: tr.Qwen3Model(tr.Qwen3Config(**config)))
    return (build, lambda m, ids, mask: m(input_ids=ids, attention_mask=mask)[0],
            [("input_ids", (1, part.size), torch.int64, 1000), ("attention_mask", (1, part.size), torch.int64, 2)],
            (1, part.size, config["hidden_size"]))


BUILDERS = {"transformer": _transformer, "vae_decoder": _vae_decoder, "text_encoder": _text_encoder}


def _sample_input(tensor, shape, generator):
    """Masks of ones (a whole prompt), ids and positions in range, a timestep in (0, 1), the rest N(0, 1)."""
    if tensor.name.endswith("mask"):
        return torch.ones(shape, dtype=torch.int64)
    if tensor.high is not None:
        return torch.randint(0, tensor.high, shape, generator=generator, dtype=tensor.dtype)
    if tensor.name in ("timestep", "guidance"):
        return torch.full(shape, 0.5)
    return torch.randn(shape, generator=generator)


def part_spec(part: Part, real: bool, depth: int | None = None):
    """The part as a ComponentSpec (static shapes), its module holding seeded random weights when `real`."""
    from kasoku.core.components import ComponentSpec, ImageShape, ShapeProfile, TensorSpec

    build, call, inputs, output = BUILDERS[part.kind](part, part.depth if depth is None else depth)
    module = Called(_seeded(build, real), call)
    size = part.size if part.kind != "text_encoder" else 512
    profile = ShapeProfile.exact(ImageShape(1, size, size), guidance=False, multiple=16)
    name = part.key.replace("/", "_").replace("@", "_").replace(".", "").replace("-", "_")
    return ComponentSpec(
        name=name, inputs=tuple(TensorSpec(n, shape, dtype, high) for n, shape, dtype, high in inputs),
        outputs=(TensorSpec("out", output),), profile=profile, load_module=lambda: module,
        weights=lambda: f"{part.key}-seed-{SEED}", config={"part": part.key, **_published(part)},
        sample_input=_sample_input, graph_kind="vae" if part.kind == "vae_decoder" else "",
        int8="full" if part.kind == "transformer" else "weights")  # kasoku's recipes: a transformer's activations too


def _published(part: Part) -> dict[str, Any]:
    """The family's published configuration of the part's component (what its graph key names)."""
    family = FAMILIES[part.family]
    components = {"transformer": family.transformer, "vae_decoder": family.vae, "text_encoder": family.text_encoder}
    return components[part.kind]


def whole_ratio(part: Part, inputs: dict) -> float | None:
    """The whole component's FLOPs over the reduced part's, both counted on the meta device (the same counting
    for both: torch's counter on meta tensors does not count what it counts on real ones), for the estimate."""
    from kasoku.tools.benchmark import count_flops_meta

    if part.depth is None:
        return None
    try:
        counts = [count_flops_meta(part_spec(p, real=False).load_module(), inputs, part_spec(p, real=False).input_names)
                  for p in (dataclasses.replace(part, component=part.kind), part)]
    except Exception as error:  # noqa: BLE001 - an op without a meta kernel (Qwen3's mask calls .item())
        if part.kind != "text_encoder":
            print(f"no whole-component FLOP count for {part.key}: {type(error).__name__}: {error}", file=sys.stderr)
            return None
        # a text encoder's FLOPs are its decoder layers' (the embedding is a lookup): the layers' ratio
        return FAMILIES[part.family].text_encoder["num_hidden_layers"] / part.depth
    return counts[0] / counts[1]


def _file(part: Part) -> str:
    return part.key.replace("/", "--")


# ---- stages (each in its own process) ------------------------------------------------------------------------


def stage_torch(part: Part, repeats: int, work: Path) -> dict:
    from kasoku.build.export import export_component
    from kasoku.core.parity import compare_output
    from kasoku.tools.benchmark import count_flops

    start = time.perf_counter()
    spec = part_spec(part, real=True)
    build_s = time.perf_counter() - start
    inputs = spec.sample_inputs(spec.profile.opt, seed=3)
    start = time.perf_counter()
    flops = count_flops(spec, inputs)  # runs the call: the torch warm-up
    first = time.perf_counter() - start
    samples, reference = _repeat(lambda: spec.run_torch(inputs), repeats)
    np.savez(work / f"{_file(part)}-io.npz", **{f"in.{k}": v.numpy() for k, v in inputs.items()},
             **{f"out.{k}": v for k, v in reference.items()})
    peak_fp32 = _peak_mb()
    exported = export_component(spec, work / "onnx" / spec.name / "model.onnx", check_shapes=[])
    # torch bf16: the same module cast, float inputs cast (what `pipe.to(torch.bfloat16)` runs)
    module = spec.load_module().to(torch.bfloat16)
    cast = [v.to(torch.bfloat16) if v.is_floating_point() else v for v in inputs.values()]
    with torch.inference_mode():
        module(*cast)
        bf16_samples, bf16_out = _repeat(lambda: module(*cast), repeats)
    bf16_parity = compare_output(spec.name, "out", part.key, reference["out"], bf16_out[0].float().numpy())
    return {"stage": "torch", "part": part.key, "build_s": build_s, "gflop": flops / 1e9,
            "whole_ratio": whole_ratio(part, inputs),
            "shapes": {k: list(v.shape) for k, v in inputs.items()}, "first_call_s": first, "seconds": samples,
            "export_s": exported.seconds, "onnx_bytes": exported.size_bytes, "peak_mb_torch": peak_fp32,
            "bf16": {"seconds": bf16_samples, "max_abs_vs_torch": bf16_parity.max_abs,
                     "rel_error_vs_torch": bf16_parity.rel_error},
            "peak_mb": _peak_mb()}


def stage_engine(part: Part, backend: str, precision: str, repeats: int, threads: int, work: Path,
                 calibration_samples: int = 8) -> dict:
    from kasoku.core.parity import compare_output
    from kasoku.pipeline.compiling import compile_components

    spec = part_spec(part, real=False)  # the module on the meta device: the engine is built from the ONNX file
    if precision in BEYOND_RECIPE:  # int8 activations for a VAE or text encoder too; int4 weights for a text encoder
        precision, spec = "int8", dataclasses.replace(spec, int8=BEYOND_RECIPE[precision])
    io = np.load(work / f"{_file(part)}-io.npz")
    inputs = {k[3:]: io[k] for k in io.files if k.startswith("in.")}
    reference = {k[4:]: io[k] for k in io.files if k.startswith("out.")}
    start = time.perf_counter()
    if backend == "openvino-defaults":  # the peer
        run, stages = _openvino_defaults(spec, work / "onnx" / spec.name / "model.onnx", threads)
    else:
        options = dict(backend=backend, precision=precision, cache=work / "cache", onnx_dir=work / "onnx",
                       check_parity=False, threads=threads, label=f"{part.family}-random",
                       calibration_samples=calibration_samples)
        _calibrate(spec, options)
        engines, report = compile_components(_meta_pipeline(), specs={spec.name: spec}, **options)
        run, stages = engines[spec.name].run, {s.stage: s.seconds for s in report.stages}
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    run(inputs)
    first = time.perf_counter() - start
    samples, out = _repeat(lambda: run(inputs), repeats)
    parity = compare_output(spec.name, "out", part.key, reference["out"], out["out"].float().numpy())
    result = {"stage": "engine", "part": part.key, "backend": backend, "precision": precision,
              "compile_s": compile_s, "stages": stages, "first_call_s": first, "seconds": samples,
              "max_abs_vs_torch": parity.max_abs, "rel_error_vs_torch": parity.rel_error, "peak_mb": _peak_mb()}
    if part.component == "vae_decoder":  # the image the pipeline makes of it, against torch fp32's: the contracts' PSNR
        from kasoku.core.parity import psnr

        def image(x):
            return np.clip(np.asarray(x, np.float32) / 2 + 0.5, 0, 1)

        result["psnr_db_vs_torch"] = psnr(image(reference["out"]), image(out["out"].float().numpy()))
    return result


def _calibrate(spec, options: dict) -> None:
    """int8 with calibrated activations (a transformer's recipe): the calibration entry made before kasoku's build,
    which then finds it, from seeded random inputs of the part's shapes (as random as its weights; the timed input's
    seed is not among them). A real pipeline's are recorded in its denoising loop; no loop runs a part alone."""
    from kasoku.build.compiler import Compiler
    from kasoku.core.cache import Cache
    from kasoku.core.options import CompileOptions
    from kasoku.policies.calibration import stored_samples

    fields = {k: v for k, v in options.items() if k not in ("cache", "label")}
    compiler = Compiler(Cache(options["cache"]), CompileOptions.of(None, **fields), label=options["label"])
    if compiler.needs_samples(spec):
        stored_samples(compiler, spec, lambda _parts: [
            {name: value.numpy() for name, value in spec.sample_inputs(spec.profile.opt, seed=100 + index).items()}
            for index in range(options["calibration_samples"])])


def _meta_pipeline():
    """A pipeline for compile_components to hold (its modules are never read: the parts are given as specs)."""
    from kasoku.tools.tiny_families import tiny_family_pipeline

    return tiny_family_pipeline("sana-sprint")


# ---- the run -------------------------------------------------------------------------------------------------


def _row(key: str, label: str, run: dict, base: float, floor: float, estimate: float | None) -> str:
    median = statistics.median(run["seconds"])
    image = f" ({run['psnr_db_vs_torch']:.1f} dB)" if run.get("psnr_db_vs_torch") is not None else ""
    check = "—" if label == "torch eager fp32" else \
        f"{run['max_abs_vs_torch']:.1e} / {run['rel_error_vs_torch']:.1e}{image}"
    whole = f"{median * estimate:.1f}" if estimate else "—"
    compile_s = f"{run['compile_s']:.0f}" if "compile_s" in run else (
        f"export {run['export_s']:.0f}" if "export_s" in run else "—")
    peak = f"{run['peak_mb']:.0f}" if "peak_mb" in run else "(in torch's)"
    return (f"| {key} | {label} | {median:.2f} | {min(run['seconds']):.2f}–{max(run['seconds']):.2f} | "
            f"{base / median:.2f}× | {whole} | {floor:.2f} | {median / floor:.2f} | {check} | {compile_s} | {peak} |")


def markdown(report: dict) -> str:
    lines = ["# kasoku full_modern: Sana Sprint, Flux.2 klein, Z-Image-Turbo and Qwen-Image at full width, random "
             "weights", "",
             f"{report['date']} · {report['cpu']} ({', '.join(report['flags']) or 'no AVX-512/AMX'}) · "
             f"{report['threads']} threads · torch {report['torch']} · fp32 matmul {report['matmul_gflops']:.0f} "
             f"GFLOP/s · median of {report['repeats']} after a warm-up · each contender in its own process", "",
             "| part | contender | median s | min–max s | speed-up vs torch fp32 | whole component s (estimate) | "
             "FLOP floor s | time ÷ floor | max abs / rel. error vs torch fp32 (a decoder: its image's PSNR) | "
             "cold compile s | peak RSS MB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    refusals: list[str] = []
    for key, entry in report["parts"].items():
        torch_run = entry["torch"]
        if torch_run.get("failed"):
            lines.append(f"| {key} | torch | failed (exit {torch_run['returncode']}) | | | | | | | | |")
            continue
        floor = torch_run["gflop"] / report["matmul_gflops"]
        base = statistics.median(torch_run["seconds"])
        estimate = torch_run.get("whole_ratio")
        lines.append(_row(key, "torch eager fp32", torch_run, base, floor, estimate))
        lines.append(_row(key, "torch eager bf16", torch_run["bf16"], base, floor, estimate))
        for name, run in entry["engines"].items():
            if run.get("failed"):
                lines.append(f"| {key} | kasoku {name} | failed (exit {run['returncode']}) | | | | | | | | |")
                refusals += [f"{key}, kasoku {name}: {run['error']}"] if "error" in run else []
                continue
            label = name if name.startswith("openvino-defaults") else f"kasoku {name}"
            lines.append(_row(key, label, run, base, floor, estimate))
        whole = f"; the whole component ≈ {torch_run['gflop'] * estimate:.0f} GFLOP" if estimate else ""
        lines.append(f"| {key} | shapes | {torch_run['shapes']} | {torch_run['gflop']:.0f} GFLOP{whole} "
                     "| | | | | | | |")
    lines += ["", "Configurations: " + "; ".join(f"{FAMILIES[f].title}: {FAMILIES[f].source}" for f in
                                                  dict.fromkeys(k.partition('/')[0] for k in report["parts"])) + ".",
              "A part named `-N` keeps N layers of each kind at full width; its \"whole component\" column is the "
              "measured time x the whole component's FLOPs / the part's (an estimate, not a measurement).",
              "", f"Peak resident memory of the run (largest stage): {report['peak_mb'] / 1024:.1f} GiB."]
    lines += [f"- {note}" for note in [*report.get("notes", []), *refusals]]
    return "\n".join(lines)


def write_report(report: dict) -> None:
    runs = [r for e in report["parts"].values() for r in [e["torch"], *e["engines"].values()]]
    report["peak_mb"] = max((r["peak_mb"] for r in runs if "peak_mb" in r), default=0.0)
    write_results(RESULTS, "full_modern", report, markdown(report))


def write_results(folder: Path, script: str, report: dict, text: str) -> None:
    """`report` as <folder>/<date>-<host>-<script>[-TAG].json and its table `text` as .md beside it, printed."""
    from kasoku.core.console import console

    tag = report.get("tag")
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"{report['date']}-{socket.gethostname()}-{script}{'-' + tag if tag else ''}"
    # (a tag may hold a dot, "sana-1.6b": the suffixes are appended, never swapped for one)
    stem.with_name(stem.name + ".md").write_text(text + "\n")
    stem.with_name(stem.name + ".json").write_text(json.dumps(report, indent=2))
    console.print(text, markup=False)
    console.print(f"wrote {stem}.md and .json")


def list_parts() -> None:
    for name, family in FAMILIES.items():
        print(f"{name}: {family.title} ({family.source}); {family.steps} steps, guidance {family.guidance}")
    print("components: transformer[-N]@PIXELS, vae_decoder@PIXELS (sana, z-image), text_encoder[-N]@TOKENS")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--parts", default=DEFAULT_PARTS, help="FAMILY/COMPONENT@SIZE, comma-separated")
    parser.add_argument("--contenders", default=DEFAULT_CONTENDERS,
                        help="BACKEND:PRECISION, comma-separated; int8 is kasoku's recipe for the part (a "
                             "transformer's activations too, calibrated; weights only elsewhere), int8-full int8 "
                             "activations for any part, int4-weights int4 weights (by groups of 128) for a text "
                             "encoder or any part in int8 weights")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--work", type=Path, default=WORK, help="scratch folder (~15 GB free disk)")
    parser.add_argument("--tag", default="", help="appended to the results' file name (…-full_modern-TAG.md)")
    parser.add_argument("--calibration-samples", type=int, default=8,
                        help="int8: seeded random inputs a transformer's activations are calibrated on (default 8)")
    parser.add_argument("--list", action="store_true", help="the families and parts this script knows")
    parser.add_argument("--smoke", action="store_true", help=f"toy widths (results under {SMOKE_DIR})")
    parser.add_argument("--stage", choices=("torch", "engine"), help=argparse.SUPPRESS)
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--stage-json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.list:
        list_parts()
        return 0
    if args.smoke:
        default_work = args.work == WORK
        use_smoke_model()
        args.work = WORK if default_work else args.work

    from kasoku.core.console import console, quiet_third_party_logs

    quiet_third_party_logs()
    torch.set_num_threads(args.threads)
    if args.stage:
        args.work.mkdir(parents=True, exist_ok=True)
        part = Part.parse(args.part)
        if args.stage == "torch":
            result = stage_torch(part, args.repeats, args.work)
        else:
            from kasoku.core.errors import KasokuError

            backend, precision = args.contender.split(":")
            try:
                result = stage_engine(part, backend, precision, args.repeats, args.threads, args.work,
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
        console.print(f"[{time.strftime('%H:%M:%S')}] {message}", markup=False)

    parts = [Part.parse(text) for text in args.parts.split(",") if text]
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True, exist_ok=True)
    log(f"CPU: {cpu_name()} ({', '.join(cpu_flags()) or 'no AVX-512/AMX'}); measuring the fp32 matmul rate")
    report = {"date": datetime.date.today().isoformat(), "host": socket.gethostname(), "cpu": cpu_name(),
              "flags": cpu_flags(), "threads": args.threads, "torch": torch.__version__, "repeats": args.repeats,
              "matmul_gflops": matmul_gflops(), "parts": {}, "smoke": args.smoke, "tag": args.tag,
              "configs": {name: dataclasses.asdict(FAMILIES[name]) for name in dict.fromkeys(p.family for p in parts)}}
    common = ["--repeats", str(args.repeats), "--threads", str(args.threads), "--work", str(args.work),
              "--calibration-samples", str(args.calibration_samples), *(["--smoke"] if args.smoke else [])]
    for part in parts:
        entry = report["parts"][part.key] = {"engines": {}}
        entry["torch"] = _run_stage(["--stage", "torch", "--part", part.key, *common], f"torch-{_file(part)}",
                                    args.work, log, script=__file__)
        if not entry["torch"].get("failed"):
            for contender in args.contenders.split(","):
                entry["engines"][contender] = _run_stage(
                    ["--stage", "engine", "--part", part.key, "--contender", contender, *common],
                    f"engine-{_file(part)}-{contender.replace(':', '-')}", args.work, log, script=__file__)
        shutil.rmtree(args.work / "onnx", ignore_errors=True)  # free the disk before the next part
        shutil.rmtree(args.work / "cache", ignore_errors=True)
        write_report(report)  # after each part: what is done so far, in case a later stage is stopped
    return 0


if __name__ == "__main__":
    sys.exit(main())
