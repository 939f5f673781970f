"""One description per component: what export, optimization, engines and verification read.

A component (text_encoder, text_encoder_2 for SDXL, unet, vae_decoder, vae_encoder) is a torch module with named
inputs and outputs. Each input dimension is either fixed or an :class:`Axis` derived from
the pipeline-level :class:`ImageShape` (images per call, height, width in pixels); the
:class:`ShapeProfile` gives the min/opt/max image shape a compiled pipeline serves. Every
tensor shape anywhere in kasoku is computed from here.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from enum import Enum
from fractions import Fraction
from typing import Callable, Iterable, Mapping

import numpy as np
import torch

from .errors import KasokuError

COMPONENT_NAMES = ("text_encoder", "text_encoder_2", "unet", "vae_decoder", "vae_encoder")


class Precision(str, Enum):
    FP32 = "fp32"
    FP16 = "fp16"


class ShapeOutOfProfile(KasokuError, ValueError):
    """A shape the compiled profile does not serve."""


class InvalidProfile(KasokuError, ValueError):
    """A shape profile that cannot be built."""


@dataclass(frozen=True)
class ImageShape:
    """One pipeline call: `batch` images of `height` x `width` pixels."""

    batch: int
    height: int
    width: int

    def __str__(self) -> str:
        return f"{self.batch}x{self.height}x{self.width}"


@dataclass(frozen=True)
class ShapeProfile:
    """The range of image shapes an engine serves; height and width step by `multiple`."""

    min: ImageShape
    opt: ImageShape
    max: ImageShape
    multiple: int = 8

    def __post_init__(self) -> None:
        for dim in ("batch", "height", "width"):
            lo, mid, hi = (getattr(s, dim) for s in (self.min, self.opt, self.max))
            if not 1 <= lo <= mid <= hi:
                raise InvalidProfile(f"profile {dim} must satisfy 1 <= min <= opt <= max but is {lo}, {mid}, {hi}.")
            if dim != "batch" and any(v % self.multiple for v in (lo, mid, hi)):
                raise InvalidProfile(
                    f"profile {dim} values must be multiples of {self.multiple} but are {lo}, {mid}, {hi}."
                )

    def range_text(self, dim: str) -> str:
        return f"{getattr(self.min, dim)}..{getattr(self.max, dim)}"

    def check(self, shape: ImageShape) -> None:
        """Raise :class:`ShapeOutOfProfile` naming the allowed range when `shape` is not served."""
        for dim in ("batch", "height", "width"):
            value = getattr(shape, dim)
            lo, hi = getattr(self.min, dim), getattr(self.max, dim)
            if not lo <= value <= hi:
                flag = f"--{dim} {min(lo, value)}:{max(hi, value)}"
                raise ShapeOutOfProfile(
                    f"{dim}={value} is outside the compiled profile ({dim} {lo}..{hi}). "
                    f"Compile a wider profile, e.g. `kasoku compile MODEL {flag}`."
                )
            if dim != "batch" and value % self.multiple:
                raise ShapeOutOfProfile(
                    f"{dim}={value} must be a multiple of {self.multiple} for this model."
                )

    def to_dict(self) -> dict:
        return {
            "min": vars(self.min).copy(),
            "opt": vars(self.opt).copy(),
            "max": vars(self.max).copy(),
            "multiple": self.multiple,
        }

    @classmethod
    def from_ranges(
        cls,
        batch: tuple[int, int, int],
        height: tuple[int, int, int],
        width: tuple[int, int, int],
        multiple: int,
    ) -> "ShapeProfile":
        return cls(*(ImageShape(b, h, w) for b, h, w in zip(batch, height, width)), multiple=multiple)


@dataclass(frozen=True)
class Axis:
    """A dynamic dimension: `scale` x the image's `of` ("batch", "height" or "width").

    `min_scale` replaces `scale` at the profile's minimum: the U-Net and text encoder see 2x
    the images under classifier-free guidance, but 1x without it.
    """

    name: str
    of: str
    scale: Fraction = Fraction(1)
    min_scale: Fraction | None = None

    def at(self, shape: ImageShape, *, minimum: bool = False) -> int:
        scale = self.min_scale if (minimum and self.min_scale is not None) else self.scale
        return int(getattr(shape, self.of) * scale)


Dim = int | Axis


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dims: tuple[Dim, ...]
    dtype: torch.dtype = torch.float32
    high: int | None = None  # integer inputs (token ids) are drawn from [0, high)

    def shape_at(self, shape: ImageShape, *, minimum: bool = False) -> tuple[int, ...]:
        return tuple(d if isinstance(d, int) else d.at(shape, minimum=minimum) for d in self.dims)

    @property
    def dynamic_axes(self) -> dict[int, Axis]:
        return {i: d for i, d in enumerate(self.dims) if isinstance(d, Axis)}


@dataclass(frozen=True)
class AxisRange:
    min: int
    opt: int
    max: int
    step: int


@dataclass(frozen=True)
class ComponentSpec:
    """Everything kasoku knows about one exportable component."""

    name: str
    module: torch.nn.Module = field(repr=False, compare=False)
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[str, ...]
    profile: ShapeProfile
    config: Mapping = field(default_factory=dict, repr=False, compare=False)
    sample_input: Callable[[TensorSpec, tuple[int, ...], torch.Generator], torch.Tensor] = field(
        default=None, repr=False, compare=False
    )
    keep_fp32: str | None = None  # why this component stays fp32 when fp16 is asked for

    def precision_for(self, requested: Precision | str) -> Precision:
        """The precision this component is built in when `requested` is asked for."""
        requested = Precision(requested)
        return Precision.FP32 if requested == Precision.FP16 and self.keep_fp32 else requested

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    def axes(self) -> dict[str, tuple[Axis, AxisRange]]:
        """Every dynamic axis with its min/opt/max and step over the profile."""
        out: dict[str, tuple[Axis, AxisRange]] = {}
        for tensor in self.inputs:
            for axis in tensor.dynamic_axes.values():
                step = self.profile.multiple * axis.scale if axis.of != "batch" else 1
                out[axis.name] = (
                    axis,
                    AxisRange(
                        min=axis.at(self.profile.min, minimum=True),
                        opt=axis.at(self.profile.opt),
                        max=axis.at(self.profile.max),
                        step=max(1, int(step)),
                    ),
                )
        return out

    def input_shapes(self, shape: ImageShape) -> dict[str, tuple[int, ...]]:
        return {t.name: t.shape_at(shape) for t in self.inputs}

    def profile_shapes(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """min/opt/max shape of every input (what a TensorRT optimization profile needs)."""
        p = self.profile
        return {
            t.name: (t.shape_at(p.min, minimum=True), t.shape_at(p.opt), t.shape_at(p.max))
            for t in self.inputs
        }

    def sample_inputs(self, shape: ImageShape, seed: int = 0) -> dict[str, torch.Tensor]:
        """Deterministic random inputs for one image shape (the parity and timing inputs)."""
        generator = torch.Generator().manual_seed(seed)
        return {
            t.name: self.sample_input(t, t.shape_at(shape), generator) for t in self.inputs
        }

    @functools.cached_property
    def fingerprint(self) -> str:
        """Digest of the weights and the config: what the cache keys on (computed once)."""
        digest = hashlib.sha256()
        digest.update(self.name.encode())
        digest.update(json.dumps(_jsonable(self.config), sort_keys=True).encode())
        for name, tensor in sorted(self.module.state_dict().items()):
            digest.update(name.encode())
            digest.update(str(tuple(tensor.shape)).encode())
            digest.update(tensor.detach().to(torch.float32).contiguous().numpy().tobytes())
        return digest.hexdigest()

    @torch.no_grad()
    def run_torch(self, inputs: Mapping[str, np.ndarray | torch.Tensor]) -> dict[str, np.ndarray]:
        """The reference: the eager torch module on named inputs."""
        from .attention import exportable_attention

        args = [torch.as_tensor(np.asarray(inputs[name])) for name in self.input_names]
        with exportable_attention():
            outputs = self.module(*args)
        return {name: out.detach().cpu().numpy() for name, out in zip(self.outputs, outputs)}


def _jsonable(value):
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items() if not str(k).startswith("_")}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


# ---- torch wrappers: positional tensors in, a tuple of tensors out ---------------------------


class TextEncoderModule(torch.nn.Module):
    """A CLIP text encoder returning the named outputs the family's pipeline reads.

    SD 1.x/2.x read the last hidden state (and the pooled output); SDXL reads the penultimate
    hidden state of both encoders and the projected pooled embedding of the second."""

    def __init__(self, text_encoder: torch.nn.Module, outputs: tuple[str, ...]):
        super().__init__()
        self.text_encoder = text_encoder
        self.output_names = outputs

    def forward(self, input_ids: torch.Tensor):
        hidden_states = "penultimate_hidden_state" in self.output_names
        out = self.text_encoder(input_ids, output_hidden_states=hidden_states, return_dict=True)
        values = {"penultimate_hidden_state": lambda: out.hidden_states[-2]}
        return tuple(values[name]() if name in values else getattr(out, name) for name in self.output_names)


class UNetModule(torch.nn.Module):
    def __init__(self, unet: torch.nn.Module):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, encoder_hidden_states):
        return (self.unet(sample, timestep, encoder_hidden_states, return_dict=False)[0],)


class SDXLUNetModule(UNetModule):
    """SDXL's U-Net: the pooled text embedding and the size/crop ids as two more inputs."""

    def forward(self, sample, timestep, encoder_hidden_states, text_embeds, time_ids):
        added = {"text_embeds": text_embeds, "time_ids": time_ids}
        return (self.unet(sample, timestep, encoder_hidden_states, added_cond_kwargs=added, return_dict=False)[0],)


class VaeDecoderModule(torch.nn.Module):
    def __init__(self, vae: torch.nn.Module):
        super().__init__()
        self.vae = vae

    def forward(self, latent_sample):
        return (self.vae.decode(latent_sample, return_dict=False)[0],)


class VaeEncoderModule(torch.nn.Module):
    """Returns the latent distribution's parameters (mean and log-variance, stacked on channels),
    so that sampling with the caller's generator happens outside the engine, as in diffusers."""

    def __init__(self, vae: torch.nn.Module):
        super().__init__()
        self.vae = vae

    def forward(self, sample):
        return (self.vae.encode(sample, return_dict=False)[0].parameters,)


def _sample_input(tensor: TensorSpec, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if tensor.dtype in (torch.int64, torch.int32):
        return torch.randint(0, tensor.high or 2, shape, generator=generator, dtype=tensor.dtype)
    if tensor.name == "timestep":
        return torch.rand(shape, generator=generator) * 999.0
    if tensor.name == "time_ids":  # original size, crop top-left, target size in pixels
        return torch.randint(0, 1025, shape, generator=generator).to(torch.float32)
    if tensor.name == "sample" and len(shape) == 4 and shape[1] == 3:
        return torch.rand(shape, generator=generator) * 2.0 - 1.0  # an image in [-1, 1]
    return torch.randn(shape, generator=generator)



# ---- the specs of a Stable Diffusion pipeline ----------------------------------------------


def _vae_scale_factor(vae) -> int:
    return 2 ** (len(vae.config.block_out_channels) - 1)


def pixel_multiple(pipe) -> int:
    """Height and width must be multiples of this: the VAE's 8x times the U-Net's downsampling."""
    unet_levels = len(pipe.unet.config.block_out_channels) - 1
    return _vae_scale_factor(pipe.vae) * 2**unet_levels


def native_size(pipe) -> int:
    """diffusers' default image size: the U-Net's sample size times the VAE's scale factor."""
    return pipe.unet.config.sample_size * _vae_scale_factor(pipe.vae)


def default_profile(pipe, max_batch: int = 4) -> ShapeProfile:
    """min = half, opt = the model's native size, max = double; 1..`max_batch` images."""
    multiple = pixel_multiple(pipe)
    native = (native_size(pipe) // multiple) * multiple or multiple
    low = max(multiple, (native // 2 // multiple) * multiple)
    high = native * 2
    return ShapeProfile.from_ranges((1, 1, max_batch), (low, native, high), (low, native, high), multiple)


def profile_with_ranges(base: ShapeProfile, batch: tuple[int, ...] | None = None,
                        height: tuple[int, ...] | None = None, width: tuple[int, ...] | None = None) -> ShapeProfile:
    """`base` with the given dims replaced by (MIN, MAX) or (MIN, OPT, MAX) ranges; where no OPT is
    given, base's optimum clamped into the new range."""
    ranges = {}
    for dim, given in (("batch", batch), ("height", height), ("width", width)):
        low, opt, high = (getattr(base.min, dim), getattr(base.opt, dim), getattr(base.max, dim))
        if given:
            low, high = given[0], given[-1]
            opt = given[1] if len(given) == 3 else min(max(opt, low), high)
        ranges[dim] = (low, opt, high)
    return ShapeProfile.from_ranges(ranges["batch"], ranges["height"], ranges["width"], base.multiple)


SDXL_VAE_FP32 = (
    "SDXL's VAE overflows in fp16 (its config sets force_upcast), so it is built in fp32; give the pipeline "
    "a fp16-safe VAE (force_upcast false, such as madebyollin/sdxl-vae-fp16-fix) to build it in fp16"
)


def model_components(pipe) -> tuple[str, ...]:
    """The components this pipeline has, in COMPONENT_NAMES order."""
    from .families import family_of

    return _family_components(family_of(pipe))


def _family_components(family) -> tuple[str, ...]:
    return tuple(n for n in COMPONENT_NAMES if not n.startswith("text_encoder") or n in family.text_encoders)


def text_encoder_outputs(family, name: str) -> tuple[str, ...]:
    """What the family's pipeline reads from text encoder `name`."""
    if family.name != "sdxl":
        return ("last_hidden_state", "pooler_output")
    return ("text_embeds", "penultimate_hidden_state") if name == "text_encoder_2" else ("penultimate_hidden_state",)


def component_specs(
    pipe, profile: ShapeProfile | None = None, names: Iterable[str] | None = None
) -> dict[str, ComponentSpec]:
    """The component specs of a live diffusers pipeline (all it has, or `names`)."""
    from .families import family_of

    profile = profile or default_profile(pipe)
    family = family_of(pipe)
    available = _family_components(family)
    names = list(available if names is None else names)
    unknown = sorted(set(names) - set(COMPONENT_NAMES))
    if unknown:
        raise KasokuError(f"unknown component(s) {unknown}; choose from {list(COMPONENT_NAMES)}.")
    absent = [n for n in names if n not in available]
    if absent:
        raise KasokuError(f"this {family.title} model has no {', '.join(absent)}; "
                          f"its components are {', '.join(available)}.")
    xl = family.name == "sdxl"
    vae_scale = Fraction(1, _vae_scale_factor(pipe.vae))
    text_length = pipe.tokenizer.model_max_length
    latent_channels = pipe.vae.config.latent_channels
    unet_config = pipe.unet.config

    images = Axis("batch", "batch")
    guided = Axis("batch", "batch", Fraction(2), min_scale=Fraction(1))  # prompt + negative
    latent_h = Axis("latent_height", "height", vae_scale)
    latent_w = Axis("latent_width", "width", vae_scale)
    pixel_h = Axis("height", "height")
    pixel_w = Axis("width", "width")

    make = dict(profile=profile, sample_input=_sample_input)

    def text_encoder(name: str) -> ComponentSpec:
        encoder = getattr(pipe, name)
        outputs = text_encoder_outputs(family, name)
        return ComponentSpec(
            name=name,
            module=TextEncoderModule(encoder, outputs).eval(),
            inputs=(TensorSpec("input_ids", (guided, text_length), torch.int64, high=encoder.config.vocab_size),),
            outputs=outputs,
            config={**encoder.config.to_dict(), "kasoku_outputs": outputs},
            **make,
        )

    def unet() -> ComponentSpec:
        inputs = (
            TensorSpec("sample", (guided, unet_config.in_channels, latent_h, latent_w)),
            TensorSpec("timestep", (guided,)),
            TensorSpec("encoder_hidden_states", (guided, text_length, unet_config.cross_attention_dim)),
        )
        if xl:
            pooled = pipe.text_encoder_2.config.projection_dim
            id_width = unet_config.projection_class_embeddings_input_dim - pooled
            time_ids = id_width // unet_config.addition_time_embed_dim
            inputs += (TensorSpec("text_embeds", (guided, pooled)), TensorSpec("time_ids", (guided, time_ids)))
        return ComponentSpec(
            name="unet",
            module=(SDXLUNetModule if xl else UNetModule)(pipe.unet).eval(),
            inputs=inputs,
            outputs=("out_sample",),
            config=dict(unet_config),
            **make,
        )

    vae_fp32 = SDXL_VAE_FP32 if xl and pipe.vae.config.get("force_upcast", True) else None
    builders = {
        "text_encoder": lambda: text_encoder("text_encoder"),
        "text_encoder_2": lambda: text_encoder("text_encoder_2"),
        "unet": unet,
        "vae_decoder": lambda: ComponentSpec(
            name="vae_decoder",
            module=VaeDecoderModule(pipe.vae).eval(),
            inputs=(TensorSpec("latent_sample", (images, latent_channels, latent_h, latent_w)),),
            outputs=("sample",),
            config=dict(pipe.vae.config),
            keep_fp32=vae_fp32,
            **make,
        ),
        "vae_encoder": lambda: ComponentSpec(
            name="vae_encoder",
            module=VaeEncoderModule(pipe.vae).eval(),
            inputs=(TensorSpec("sample", (images, 3, pixel_h, pixel_w)),),
            outputs=("latent_parameters",),
            config=dict(pipe.vae.config),
            keep_fp32=vae_fp32,
            **make,
        ),
    }
    return {name: builders[name]() for name in names}
