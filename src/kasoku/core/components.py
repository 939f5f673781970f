"""One description per component: what export, optimization, engines and verification read.

A component (a text encoder, a denoiser, the VAE decoder or encoder, ...) is a torch module with
named inputs and outputs. Each tensor dimension is either fixed or an :class:`Axis` derived from
the pipeline-level :class:`ImageShape` (images per call, height, width in pixels): a scale of one
image dimension (a latent's height) or of a product of them (a transformer's packed token count);
the :class:`ShapeProfile` gives the min/opt/max image shape a compiled pipeline serves. Every tensor
shape anywhere in kasoku is computed from here, torch.export's dynamic dims included. What a
component's module and tensors are is its architecture's business (:mod:`kasoku.architectures`),
which components a pipeline has its family's (:mod:`kasoku.families`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from .attention import exportable_attention
from .errors import KasokuError
from .precision import Precision  # noqa: F401 - the enum's home for callers of components


class ShapeOutOfProfile(KasokuError, ValueError):
    """A shape the compiled profile does not serve."""


class InvalidProfile(KasokuError, ValueError):
    """A shape profile that cannot be built."""


IMAGE_DIMS = ("batch", "height", "width")


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
    # True: every call uses classifier-free guidance (the U-Net and text encoder see 2x the images);
    # False: no call does; None: either (their batch ranges from 1x to 2x).
    guidance: bool | None = None
    # The tokens a long-prompt text encoder (T5) reads: the pipelines' `max_sequence_length`. None: the
    # family's default (and for families without such an encoder, nothing).
    text_tokens: int | None = None

    def __post_init__(self) -> None:
        for dim in IMAGE_DIMS:
            lo, mid, hi = (getattr(s, dim) for s in (self.min, self.opt, self.max))
            if not 1 <= lo <= mid <= hi:
                raise InvalidProfile(f"profile {dim} must satisfy 1 <= min <= opt <= max but is {lo}, {mid}, {hi}.")
            if dim != "batch" and any(v % self.multiple for v in (lo, mid, hi)):
                raise InvalidProfile(
                    f"profile {dim} values must be multiples of {self.multiple} but are {lo}, {mid}, {hi}."
                )
        if self.text_tokens is not None and (not isinstance(self.text_tokens, int) or self.text_tokens < 1):
            raise InvalidProfile(f"profile text_tokens must be a positive int but is {self.text_tokens!r}.")

    @property
    def is_static(self) -> bool:
        """One shape (images, height, width and guidance): what exact-shape engines serve."""
        return self.min == self.max and self.guidance is not None

    def serves(self, shape: ImageShape, guidance: bool) -> bool:
        try:
            self.check(shape)
        except ShapeOutOfProfile:
            return False
        return self.guidance in (None, guidance)

    @classmethod
    def exact(cls, shape: ImageShape, guidance: bool, multiple: int, text_tokens: int | None = None) -> ShapeProfile:
        """The profile of one shape: engines built for it are exact-shape (static) engines."""
        return cls(shape, shape, shape, multiple, guidance, text_tokens)

    def range_text(self, dim: str) -> str:
        return f"{getattr(self.min, dim)}..{getattr(self.max, dim)}"

    def check(self, shape: ImageShape, *, python: bool = False) -> None:
        """Raise :class:`ShapeOutOfProfile` naming the allowed range when `shape` is not served, and how to widen it:
        the CLI flag, or with `python` (the caller is Python code) the `profile=` to compile with."""
        for dim in IMAGE_DIMS:
            value = getattr(shape, dim)
            lo, hi = getattr(self.min, dim), getattr(self.max, dim)
            if not lo <= value <= hi:
                raise ShapeOutOfProfile(f"{dim}={value} is outside the compiled profile ({dim} {lo}..{hi}). "
                                        + self.covering(self._on_step(shape)).widening_advice(dim, python))
            if dim != "batch" and value % self.multiple:
                raise ShapeOutOfProfile(
                    f"{dim}={value} must be a multiple of {self.multiple} for this model."
                )

    def _on_step(self, shape: ImageShape) -> ImageShape:
        """`shape` with its height and width on this profile's step: up above its range, down below it."""
        def fit(dim: str) -> int:
            value, step = getattr(shape, dim), self.multiple
            return -(-value // step) * step if value > getattr(self.max, dim) else max(value // step * step, step)

        return ImageShape(shape.batch, fit("height"), fit("width"))

    def widening_advice(self, dim: str, python: bool) -> str:
        """How to compile this profile: the CLI flag of `dim`, or the Python `profile=` (and its growing default)."""
        if not python:
            flag = f"--{dim} {self.range_text(dim).replace('..', ':')}"
            return f"Compile a wider profile, e.g. `kasoku compile MODEL {flag}`."
        ranges = ", ".join(f"{d}=({getattr(self.min, d)}, {getattr(self.opt, d)}, {getattr(self.max, d)})"
                           for d in IMAGE_DIMS)
        return (f"Compile a wider profile, e.g. `kasoku.compile(pipe, profile=ShapeProfile.from_ranges({ranges}, "
                f"multiple={self.multiple}))`, or leave out `profile=` and `strict_shapes=True`: the engines then grow "
                "with the calls.")

    def covering(self, shape: ImageShape, guidance: bool | None = None, text_tokens: int | None = None
                 ) -> ShapeProfile:
        """This profile widened to serve `shape` too; calls with and without guidance where it served only the other
        (`guidance`), and `text_tokens` where given. The optimum stays."""
        low = ImageShape(*(min(getattr(self.min, d), getattr(shape, d)) for d in IMAGE_DIMS))
        high = ImageShape(*(max(getattr(self.max, d), getattr(shape, d)) for d in IMAGE_DIMS))
        both = guidance is not None and self.guidance not in (None, guidance)
        return ShapeProfile(low, self.opt, high, self.multiple, None if both else self.guidance,
                            text_tokens or self.text_tokens)

    def to_dict(self) -> dict:
        data = {
            "min": vars(self.min).copy(),
            "opt": vars(self.opt).copy(),
            "max": vars(self.max).copy(),
            "multiple": self.multiple,
        }
        if self.guidance is not None:  # absent for a profile that serves both (keys stay as they were)
            data["guidance"] = self.guidance
        if self.text_tokens is not None:  # absent unless given (keys stay as they were)
            data["text_tokens"] = self.text_tokens
        return data

    @classmethod
    def from_dict(cls, data: Mapping) -> ShapeProfile:
        return cls(*(ImageShape(**data[k]) for k in ("min", "opt", "max")), multiple=int(data["multiple"]),
                   guidance=data.get("guidance"), text_tokens=data.get("text_tokens"))

    @classmethod
    def from_ranges(
        cls,
        batch: tuple[int, int, int],
        height: tuple[int, int, int],
        width: tuple[int, int, int],
        multiple: int,
        guidance: bool | None = None,
        text_tokens: int | None = None,
    ) -> ShapeProfile:
        return cls(*(ImageShape(b, h, w) for b, h, w in zip(batch, height, width)), multiple=multiple,
                   guidance=guidance, text_tokens=text_tokens)


@dataclass(frozen=True, repr=False)
class Axis:
    """A dynamic dimension: `scale` x the image's `of` ("batch", "height" or "width"), or `scale` x the
    product of several image dimensions (`of` a tuple: a transformer's packed tokens, height x width / 256).

    `min_scale` replaces `scale` at the profile's minimum: the denoiser and text encoder see 2x
    the images under classifier-free guidance, but 1x without it. `from_one`: the axis is 1 at the
    profile's minimum whatever its batch, for the encoders, which see one row per prompt or input image
    (diffusers repeats their outputs for `num_images_per_prompt`): exact-shape engines for N images
    still encode one prompt.
    """

    name: str
    of: str | tuple[str, ...]
    scale: Fraction = Fraction(1)
    min_scale: Fraction | None = None
    from_one: bool = False
    # A free axis (a prompt's tokens): no image dimension gives it (`of` is empty); it is `scale` at the profile's
    # optimum and ranges over `bounds` (min, max) whatever the image shape.
    bounds: tuple[int, int] | None = None
    # (least, largest) scale where the pipeline's tasks call the module at several scales of the image (Flux.2
    # klein's inpainting appends the reference image's tokens to the image's: twice text-to-image's). `scale` is the
    # optimum's; the profile's minimum takes the least and its maximum the largest.
    scales: tuple[Fraction, Fraction] | None = None
    # (least, optimum, most) text tokens before the image's: a sequence of a prompt's tokens and the image's packed
    # ones (Ideogram 4's joint sequence, Chroma's attention mask), `scale` x the product of `of` plus the tokens.
    text: tuple[int, int, int] | None = None

    def __repr__(self) -> str:
        # the architecture key reads this text: an axis without `from_one` keeps the text (and keys) it had
        text = f"Axis(name={self.name!r}, of={self.of!r}, scale={self.scale!r}, min_scale={self.min_scale!r}"
        text += ", from_one=True" if self.from_one else ""
        text += f", scales={self.scales!r}" if self.scales else ""
        text += f", text={self.text!r}" if self.text else ""
        return text + (f", bounds={self.bounds!r})" if self.bounds else ")")

    @classmethod
    def free(cls, name: str, opt: int, low: int, high: int) -> Axis:
        """An axis no image dimension gives: `opt` at the profile's optimum, `low`..`high` in every profile."""
        return cls(name, (), Fraction(opt), bounds=(low, high))

    @property
    def is_free(self) -> bool:
        return self.bounds is not None

    @property
    def dims(self) -> tuple[str, ...]:
        """The image dimensions this axis scales (one, or the several whose product it scales)."""
        return (self.of,) if isinstance(self.of, str) else tuple(self.of)

    @property
    def is_product(self) -> bool:
        return len(self.dims) > 1

    def at(self, shape: ImageShape, *, minimum: bool = False) -> int:
        if minimum and self.from_one:
            return 1
        if self.text is not None:
            return self._scaled(shape, self.scale) + self.text[1]
        return self._scaled(shape, self.min_scale if (minimum and self.min_scale is not None) else self.scale)

    def _scaled(self, shape: ImageShape, scale: Fraction) -> int:
        return int(math.prod(getattr(shape, dim) for dim in self.dims) * scale)

    def in_profile(self, profile: ShapeProfile, which: str) -> int:
        """The axis at the profile's "min", "opt" or "max": a guidance axis takes 1x the images where
        the profile has no guidance, and 1x only at its minimum where the profile allows either."""
        if self.bounds is not None:
            return {"min": self.bounds[0], "max": self.bounds[1]}.get(which, int(self.scale))
        shape = getattr(profile, which)
        if self.text is not None:
            return self._scaled(shape, self.scale) + self.text[("min", "opt", "max").index(which)]
        if self.scales is not None:
            return self._scaled(shape, {"min": self.scales[0], "max": self.scales[1]}.get(which, self.scale))
        if self.min_scale is not None and profile.guidance is not None:
            return self.at(shape, minimum=not profile.guidance)
        return self.at(shape, minimum=which == "min")


Dim = int | Axis


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dims: tuple[Dim, ...]
    dtype: torch.dtype = torch.float32
    high: int | None = None  # integer inputs (token ids) are drawn from [0, high)
    # An input the component reads in fp32 at every precision (diffusers embeds the U-Net's timestep in
    # fp32 itself, also in a bf16 or fp16 pipeline): engines that compute in a lower dtype leave it as is.
    always_fp32: bool = False

    def shape_at(self, shape: ImageShape, *, minimum: bool = False) -> tuple[int, ...]:
        return tuple(d if isinstance(d, int) else d.at(shape, minimum=minimum) for d in self.dims)

    def in_profile(self, profile: ShapeProfile, which: str) -> tuple[int, ...]:
        return tuple(d if isinstance(d, int) else d.in_profile(profile, which) for d in self.dims)

    @property
    def dynamic_axes(self) -> dict[int, Axis]:
        return {i: d for i, d in enumerate(self.dims) if isinstance(d, Axis)}


@dataclass(frozen=True)
class AxisRange:
    min: int
    opt: int
    max: int
    step: int


def default_sample_input(tensor: TensorSpec, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """A random input of the spec's kind (the parity and timing inputs; an architecture may give its own)."""
    if tensor.dtype in (torch.int64, torch.int32):
        return torch.randint(0, tensor.high or 2, shape, generator=generator, dtype=tensor.dtype)
    if tensor.name == "timestep":
        return torch.rand(shape, generator=generator) * 999.0
    if tensor.name == "time_ids":  # original size, crop top-left, target size in pixels
        return torch.randint(0, 1025, shape, generator=generator).to(torch.float32)
    if tensor.name == "sample" and len(shape) == 4 and shape[1] == 3:
        return torch.rand(shape, generator=generator) * 2.0 - 1.0  # an image in [-1, 1]
    if tensor.name in ("controlnet_cond", "conditioning_scale"):
        return torch.rand(shape, generator=generator)  # control images are not normalised: [0, 1]
    return torch.randn(shape, generator=generator)


@dataclass(frozen=True)
class ComponentSpec:
    """Everything kasoku knows about one exportable component.

    The torch module is built on first use (`load_module`), so that a warm start that finds every
    engine in the cache never loads torch weights; `weights` returns the digest of the weights the
    module has (remembered per weights file where it can be, see :mod:`kasoku.model.fingerprint`).
    """

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    profile: ShapeProfile
    load_module: Callable[[], torch.nn.Module] = field(repr=False, compare=False)
    weights: Callable[[], str] = field(repr=False, compare=False)
    config: Mapping = field(default_factory=dict, repr=False, compare=False)
    sample_input: Callable[[TensorSpec, tuple[int, ...], torch.Generator], torch.Tensor] = field(
        default=default_sample_input, repr=False, compare=False
    )
    # precision -> why this component is built in fp32 when that precision is asked for (SDXL's VAE in fp16)
    fp32_for: Mapping[Precision, str] = field(default_factory=dict, compare=False)
    # its module's weights are bf16 (a pipeline read in bf16): its graph takes, computes and gives bf16, and fp32 or
    # fp16 asked of it builds bf16
    in_bf16: bool = False
    graph_kind: str = ""  # what ONNX Runtime's transformer optimizer calls this graph: clip, unet, vae
    fp16_keep_ops: tuple[str, ...] = ()  # ops that overflow in fp16 in this component, kept fp32
    modules: tuple[str, ...] = ()  # the pipeline attributes whose weights it uses ("vae", "unet", ...)
    int8: str = "weights"  # int8 recipe (kasoku.backends.int8): "weights", "int4-weights", or "full" (activations)
    int8_note: str = field(default="", compare=False)  # why a denoiser's int8 is weights only (said when int8 is asked)
    # the calibration plan's fields its pipeline's calls need (a distilled model's steps and guidance; see
    # kasoku.core.options.CalibrationPlan): the calls it is calibrated on are calls its pipeline takes
    calibration: Mapping[str, Any] = field(default_factory=dict, compare=False)
    takes_lora: bool = False  # LoRA adapters change its weights (diffusers loads them into this component)
    # Weights whose graph names hold one of these stay engine inputs wherever the backend keeps run-time weights
    # (IP-Adapters: a switch binds them); the engine is then keyed on `base_weights`, the digest of the others.
    run_time_parts: tuple[str, ...] = ()
    base_weights: Callable[[], str] | None = field(default=None, repr=False, compare=False)
    # What its architecture graph is named by, when not `name`: components that differ by their slot only (a second
    # ControlNet of one architecture) share one graph and export once.
    graph_name: str = ""
    # The same component as a graph of one shape (the profile's optimum), which a graph compiled from recorded calls
    # falls back to where its dynamic graph does not export or build (a dimension that is a sum of two axes).
    one_shape: Callable[[], ComponentSpec] | None = field(default=None, repr=False, compare=False)
    # Its calls alternate with torch work on the same cores (a block whose module's glue runs in torch): an engine's
    # threads must not spin between them (ONNX Runtime's do by default, and slow the torch work down).
    interleaved: bool = field(default=False, compare=False)

    @property
    def graph_id(self) -> str:
        """The name its architecture graph is keyed by (see `graph_name`)."""
        return self.graph_name or self.name

    def precision_for(self, requested: Precision | str) -> Precision:
        """The precision this component is built in when `requested` is asked for."""
        requested = Precision(requested)
        if requested in self.fp32_for:
            return Precision.FP32
        if self.in_bf16 and requested in (Precision.FP32, Precision.FP16):
            return Precision.BF16
        return requested

    def precision_reason(self, requested: Precision | str) -> str:
        """Why it is built in another precision than `requested` (see `precision_for`)."""
        requested = Precision(requested)
        if requested in self.fp32_for:
            return self.fp32_for[requested]
        return f"its weights were read in bfloat16, so its engine computes in bf16 (asked: {requested.value})"

    @functools.cached_property
    def module(self) -> torch.nn.Module:
        return self.load_module().eval()

    def forget_module(self) -> None:
        """Drop the built module (its weights are freed once nothing else holds them)."""
        self.__dict__.pop("module", None)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)

    def axes(self) -> dict[str, tuple[Axis, AxisRange]]:
        """Every dynamic input axis with its min/opt/max and step over the profile."""
        out: dict[str, tuple[Axis, AxisRange]] = {}
        for tensor in self.inputs:
            for axis in tensor.dynamic_axes.values():
                step = self.profile.multiple * axis.scale if axis.of != "batch" and len(axis.dims) == 1 else 1
                out[axis.name] = (
                    axis,
                    AxisRange(
                        min=axis.in_profile(self.profile, "min"),
                        opt=axis.in_profile(self.profile, "opt"),
                        max=axis.in_profile(self.profile, "max"),
                        step=max(1, int(step)),
                    ),
                )
        return out

    def input_shapes(self, shape: ImageShape) -> dict[str, tuple[int, ...]]:
        return {t.name: t.shape_at(shape) for t in self.inputs}

    def output_shapes(self, input_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The shape of every output for inputs of these shapes. An output axis takes the value of
        the input axis of the same name, else the image size it scales (e.g. the VAE decoder's
        pixel height from its input's latent height). Inputs left out are not read (an output shaped as an input
        that is not known yet)."""
        values: dict[str, int] = {}
        image: dict[str, Fraction] = {}
        for tensor in self.inputs:
            if tensor.name not in input_shapes:
                continue
            for index, axis in tensor.dynamic_axes.items():
                value = int(input_shapes[tensor.name][index])
                values[axis.name] = value
                if axis.min_scale is None and len(axis.dims) == 1:
                    image.setdefault(axis.of, Fraction(value) / axis.scale)
        return {
            t.name: tuple(d if isinstance(d, int) else values.get(d.name) or int(image[d.of] * d.scale)
                          for d in t.dims)
            for t in self.outputs
        }

    def profile_shapes(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """min/opt/max shape of every input (what a TensorRT optimization profile needs)."""
        return {t.name: tuple(t.in_profile(self.profile, w) for w in ("min", "opt", "max")) for t in self.inputs}

    def trace_shape(self) -> ImageShape:
        """The shape its graph is traced at: :func:`export_shape`; a recorded graph's has its height and width
        apart and off the optimum, so that a module's branch on "the size I was built for" (PixArt's positional
        embedding, kept for its sample size and recomputed for any other) is traced in its general form."""
        shape = export_shape(self.profile)
        if self.graph_kind != "recorded":
            return shape
        low, high, step = self.profile.min, self.profile.max, self.profile.multiple
        height = _moved(shape.height, step, low.height, high.height)
        width = _moved(shape.width, -step, low.width, high.width, avoid=height)
        return ImageShape(shape.batch, height, width)

    def sample_inputs(self, shape: ImageShape, seed: int = 0) -> dict[str, torch.Tensor]:
        """Deterministic random inputs for one image shape (the parity and timing inputs); with
        guidance unless the profile has none."""
        generator = torch.Generator().manual_seed(seed)
        return {name: self.sample_input(t, size, generator)
                for (name, size), t in zip(self.sample_shapes(shape).items(), self.inputs)}

    def sample_shapes(self, shape: ImageShape) -> dict[str, tuple[int, ...]]:
        """The shape of each input :meth:`sample_inputs` gives: with guidance unless the profile has none."""
        no_guidance = self.profile.guidance is False
        return {t.name: t.shape_at(shape, minimum=no_guidance) for t in self.inputs}

    @functools.cached_property
    def architecture(self) -> str:
        """Digest of what the graph is, whatever its weights: name, config and tensors."""
        described = {
            "name": self.graph_id,
            "config": architecture_config(self.config),
            "inputs": [(t.name, [str(d) for d in t.dims], str(t.dtype)) for t in self.inputs],
            "outputs": [(t.name, [str(d) for d in t.dims]) for t in self.outputs],
            **({"in_bf16": True} if self.in_bf16 else {}),  # its weights and outputs in bf16 (inputs may be ids)
        }
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()

    @functools.cached_property
    def fingerprint(self) -> str:
        """Digest of the architecture and the weights: what the exported graph is keyed on."""
        return hashlib.sha256(f"{self.architecture}:{self.weights()}".encode()).hexdigest()

    @torch.no_grad()
    def run_torch(self, inputs: Mapping[str, np.ndarray | torch.Tensor]) -> dict[str, np.ndarray]:
        """The reference: the eager torch module on named inputs (a bf16 module's outputs as fp32 arrays)."""
        from .weights import numpy_of  # here: core.weights imports onnx, which importing the specs need not

        args = [inputs[name] if isinstance(inputs[name], torch.Tensor) else torch.as_tensor(np.asarray(inputs[name]))
                for name in self.input_names]
        with exportable_attention():
            outputs = self.module(*args)
        return {name: numpy_of(out) for name, out in zip(self.output_names, outputs)}


# Config entries that say how a module was saved or read, not what its graph is: a pipeline saved to a folder and
# loaded back gains them (transformers writes `architectures`, and `dtype`: the file's in a meta stand-in, the one
# read in once loaded) and must keep its architecture key. The dtype the graph's weights take is `in_bf16`.
_NOT_ARCHITECTURE = frozenset({"architectures", "transformers_version", "dtype", "torch_dtype"})


def architecture_config(config: Mapping) -> dict:
    """A module's config as plain data, without the entries that say how it was saved or read (`_name_or_path`,
    `architectures`, `dtype`, ...): what the keys of its graph, its recording and its weights' digest memo read."""
    return _jsonable(config)


def _architecture_entry(key: str) -> bool:
    return not (key.startswith("_") or key in _NOT_ARCHITECTURE)


def _jsonable(value):
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items() if _architecture_entry(str(k))}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)




# ---- profiles ------------------------------------------------------------------------------------


def default_profile(native: int, multiple: int, max_batch: int = 4) -> ShapeProfile:
    """A model's default range: min = half its `native` size, opt = native, max = double, in steps of
    `multiple` pixels; 1..`max_batch` images."""
    native = (native // multiple) * multiple or multiple
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
    return ShapeProfile.from_ranges(ranges["batch"], ranges["height"], ranges["width"], base.multiple, base.guidance,
                                    base.text_tokens)


def profile_serving(base: ShapeProfile, shape: ImageShape) -> ShapeProfile:
    """`base` widened just enough to serve `shape`."""
    low = ImageShape(*(min(getattr(base.min, d), getattr(shape, d)) for d in IMAGE_DIMS))
    high = ImageShape(*(max(getattr(base.max, d), getattr(shape, d)) for d in IMAGE_DIMS))
    return ShapeProfile(low, base.opt, high, base.multiple, base.guidance, base.text_tokens)


# ---- torch.export's view of a spec (the ONNX exporter and AOTInductor both trace through it) ------------


def export_shape(profile: ShapeProfile) -> ImageShape:
    """The shape a component is traced at: the optimum, but with every dynamic size >= 2 (torch.export
    specializes sizes 0 and 1, which would freeze the batch)."""
    opt, high = profile.opt, profile.max
    return ImageShape(batch=min(max(2, opt.batch), high.batch), height=opt.height, width=opt.width)


def _moved(value: int, step: int, low: int, high: int, avoid: int | None = None) -> int:
    """`value` a step or two away (`step`'s way first) within low..high and not `avoid`, nor the minimum where that
    is one step (torch.export would trace its Dim at 1 and specialize it); itself where none is."""
    for candidate in (value + step, value - step, value + 2 * step, value - 2 * step):
        if low <= candidate <= high and candidate != avoid and candidate > abs(step):
            return candidate
    return value


def export_dims_plan(spec: ComponentSpec) -> dict[str, tuple[str, str, int, int, int]]:
    """How torch.export sees each dynamic axis: (kind, base Dim's name, its min, its max, factor). Axes of one
    image size at several scales (a ControlNet's latent sample and pixel conditioning image, a U-Net's residuals
    at each level) are "scaled": multiples of one Dim of that size, so torch.export sees how they relate instead
    of a constraint violation. A stepped axis is a multiple of a Dim of its own ("step"); an axis of a product of
    image dims (packed tokens) is a Dim of its own: torch.export derives dims linearly only."""
    axes = spec.axes()
    multiple = spec.profile.multiple
    plan: dict[str, tuple[str, str, int, int, int]] = {}
    for name, (axis, rng) in axes.items():
        if rng.min == rng.max:
            continue
        scaled = [a for a, _ in axes.values() if a.of == axis.of and a.of != "batch"]
        if len(scaled) > 1 and len(axis.dims) == 1:
            plan[name] = ("scaled", f"{axis.of}_div{multiple}", getattr(spec.profile.min, axis.of) // multiple,
                          getattr(spec.profile.max, axis.of) // multiple, int(multiple * axis.scale))
        elif rng.step > 1:
            plan[name] = ("step", f"{name}_div{rng.step}", math.ceil(rng.min / rng.step), rng.max // rng.step,
                          rng.step)
        else:
            plan[name] = ("free", name, rng.min, rng.max, 1)
    return plan


def torch_export_dims(spec: ComponentSpec) -> dict[str, object]:
    """torch.export Dims per dynamic axis name, as :func:`export_dims_plan` lays them out."""
    from torch.export import Dim

    bases: dict[str, object] = {}  # one Dim per base name: the scaled axes of an image size share theirs
    dims: dict[str, object] = {}
    for name, (kind, base, low, high, factor) in export_dims_plan(spec).items():
        if kind == "free":
            dims[name] = Dim(base, min=low, max=high)
            continue
        if base not in bases:
            bases[base] = Dim(base, min=low, max=high)
        dims[name] = factor * bases[base]
    return dims


def traced_shapes(spec: ComponentSpec) -> dict[str, Any]:
    """What a trace of `spec` depends on besides its module: the inputs' shapes at the traced shape and the
    dynamic axes' Dims. Profiles that agree on these give the same graph (a text encoder's, whatever the image
    sizes), so the graph's key holds this rather than the whole profile."""
    shapes = spec.sample_shapes(spec.trace_shape())  # as traced: once the images where the profile has no guidance
    return {"inputs": {name: list(shape) for name, shape in shapes.items()},
            "dims": {name: list(plan) for name, plan in export_dims_plan(spec).items()}}


def torch_dynamic_shapes(spec: ComponentSpec, module: torch.nn.Module | None = None) -> dict[str, object]:
    """The dynamic shapes of the inputs, keyed as torch.export binds them to the module's forward: by
    parameter name, and a *args parameter (a variable number of inputs) as a tuple in input order."""
    import inspect

    dims = torch_export_dims(spec)
    per_input = {t.name: {i: dims[a.name] for i, a in t.dynamic_axes.items() if a.name in dims} for t in spec.inputs}
    forward = (module if module is not None else spec.module).forward
    bound = inspect.signature(forward).bind(*spec.input_names).arguments
    return {parameter: tuple(per_input[n] for n in names) if isinstance(names, tuple) else per_input[names]
            for parameter, names in bound.items()}
