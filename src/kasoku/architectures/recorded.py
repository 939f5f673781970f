"""Any component, from the calls its pipeline made to it: the spec, the graph's torch wrapper and the stand-in.

A component kasoku has no hand-written architecture for is described by its recorded calls
(:mod:`kasoku.core.recording`), made at a few probe shapes (:class:`Probe`: images, height, width, text tokens
and guidance, chosen so that each image dimension and their products change by a ratio of their own).
:func:`signatures` merges the calls of one component and method into :class:`Signature`\\ s, one per call
pattern (the tree of its arguments and its constants):

- each tensor argument is an engine input, named by its path (``encoder_hidden_states``,
  ``joint_attention_kwargs_scale``); each of its dimensions is fixed, or an :class:`~kasoku.core.components.Axis`
  fitted to the probes: a multiple of the images, the height, the width or a product of them (a packed token
  count), twice the images under classifier-free guidance and once without, the text tokens asked for (plus
  a template's fixed count), or a free axis where nothing explains it (a prompt's own length);
- a constant (None, ``return_dict=False``, a flag) is part of the graph and of its key; one that follows the
  image size (a list of patch grids) keys the graph to that size: the engine is built for one height and width;
  one that changes from call to call cannot be compiled, and says so;
- each output leaf the pipeline read is an engine output; one it never read is not computed (asking for it later
  is an error, never a silent zero); a distribution (a VAE's latents) crosses as its parameters.

:func:`recorded_spec` makes a :class:`~kasoku.core.components.ComponentSpec` of a signature: the same
description every hand-written architecture gives, so export, engines, parity, the cache and the checks are the
ones every component has. :class:`EngineRecorded` stands in for the module: diffusers calls it exactly as it
called the module (arguments, output structure, `config`, `dtype`, `device`, any attribute of the module).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..core.components import Axis, ComponentSpec, ShapeProfile, TensorSpec
from ..core.errors import KasokuError
from ..core.memory import GIB, fits_this_machine
from ..core.recording import Call, Distribution, Opaque, canonical_call
from ..core.standins import EngineModule, InvalidInput
from ..core.step_cache import FirstBlockRun
from ..core.weights import floating_dtype, weight_bytes
from .base import ModuleRef, config_dict

__all__ = ["EngineRecorded", "Probe", "Recording", "Signature", "UncompilableCall", "recorded_spec", "signatures"]

# part of every recorded graph's key: bumped when how a recorded call becomes a graph changes
RECORDED_GRAPH_VERSION = 2
IMAGE_DIMS = ("batch", "height", "width")
# every product of the image dimensions an axis may scale, simplest first
PRODUCTS = tuple(combo for size in (1, 2, 3) for combo in itertools.combinations(IMAGE_DIMS, size))
AREAS = tuple(dims for dims in PRODUCTS if len(dims) > 1 and "batch" not in dims)  # an image's area: packed tokens
MAX_TASK_SCALES = 3  # an axis at more scales of the image than this is not fitted as one (a free axis instead)


class UncompilableCall(KasokuError, ValueError):
    """A component whose recorded calls cannot become one graph (a constant that changes from call to call)."""


@dataclass(frozen=True)
class Probe:
    """One recorded pipeline call: `batch` images (one per prompt) of `height` x `width`, `tokens` the text tokens
    asked for (`max_sequence_length`; None where the pipeline takes none) and whether it ran with guidance."""

    batch: int
    height: int
    width: int
    tokens: int | None
    guidance: bool
    prompt: int = 0  # the first of the prompts it is called with (a second call at one shape takes other prompts)

    def product(self, dims: Sequence[str]) -> int:
        value = 1
        for dim in dims:
            value *= getattr(self, dim)
        return value


@dataclass
class Recording:
    """The calls of one pipeline call at `probe` (for `task`)."""

    probe: Probe
    task: str
    calls: list[Call]


@dataclass(frozen=True)
class RecordedInput:
    index: int  # the argument leaf it fills
    tensor: TensorSpec
    low: float  # the recorded values' range and how many distinct values they took: what sample inputs draw
    high: float
    distinct: int
    common: float  # the most common recorded value (a mask's)
    # a complex tensor (a rotary table) crosses as its real view, (..., 2) floats: what ONNX inputs can be
    complex: bool = False

    @property
    def kind(self) -> str:
        return "complex" if self.complex else _kind(self.tensor.dtype)

    def fed(self, value: torch.Tensor) -> torch.Tensor:
        """The call's tensor as the engine takes it (a complex one as its real view)."""
        return _real_view(value) if self.complex else value


@dataclass(frozen=True)
class RecordedOutput:
    index: int  # the output leaf it gives
    tensor: TensorSpec
    distribution: Distribution | None = None


@dataclass(frozen=True)
class Signature:
    """One call pattern of a component's method, as every recorded call of it at every probe agrees."""

    component: str  # the engine's component name ("transformer", "vae_decoder")
    attribute: str  # the pipeline attribute that holds the module ("vae")
    method: str
    arguments: pytree.TreeSpec = field(compare=False)
    paths: tuple[str, ...]
    constants: tuple[tuple[int, Any], ...]  # leaf index -> value, the same in every call
    keyed: tuple[tuple[int, Any], ...]  # leaf index -> value at the optimum probe: they follow the image size
    inputs: tuple[RecordedInput, ...]
    outputs: tuple[RecordedOutput, ...]
    output_tree: pytree.TreeSpec = field(compare=False)
    output_template: tuple[Any, ...] = field(compare=False)  # per output leaf: its recorded description
    output_paths: tuple[str, ...] = ()
    # where every dimension is fixed (a graph of one shape): the call it was recorded at, for the messages
    one_shape: str = field(default="", compare=False)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(i.tensor.name for i in self.inputs)

    @property
    def exact(self) -> bool:
        """Whether the graph serves one image size only (a constant follows the image size)."""
        return bool(self.keyed)

    @property
    def grows(self) -> bool:
        """A graph of one shape: the engine of the recorded call is compiled, and a call of another shape (a prompt
        of another length, another size, guidance or not) has its own built on its first call."""
        return bool(self.one_shape)

    def following_the_size_as(self, probed: Signature) -> Signature:
        """This signature (recorded at one shape) with the values that follow the image size in `probed` (the same
        call pattern recorded at several) taken as such, not as constants: a graph of one shape is built per value
        of them (Qwen-Image's `img_shapes`), where a constant refused every call at another size."""
        following = {index for index, _ in probed.keyed}
        return dataclasses.replace(
            self, constants=tuple((i, v) for i, v in self.constants if i not in following),
            keyed=tuple(sorted((*self.keyed, *((i, v) for i, v in self.constants if i in following)),
                               key=lambda kept: kept[0])))

    def shape_key(self, leaves: Sequence[Any] | None = None) -> tuple:
        """What picks the engine of a graph of one shape: the shape of each input and each value that follows the
        image size, in the call's `leaves` (None: as recorded)."""
        if leaves is None:
            shapes = tuple(tuple(int(d.scale) if isinstance(d, Axis) else d for d in _call_dims(slot))
                           for slot in self.inputs)
            return shapes, tuple(repr(v) for _, v in self.keyed)
        return (tuple(tuple(int(n) for n in leaves[slot.index].shape) for slot in self.inputs),
                tuple(repr(leaves[i]) for i, _ in self.keyed))

    def at_call(self, leaves: Sequence[Any] | None = None) -> Signature:
        """This graph of one shape at the call's `leaves` (None: as recorded): every input's dimensions and every
        value that follows the image size as there. The outputs' free dimensions take the size their axis has in
        the inputs, else as recorded (a grown graph's are measured: :meth:`with_output_shapes`)."""
        shapes, sizes = self.shape_key(leaves)[0], {}
        for slot, shape in zip(self.inputs, shapes):
            for d, axis in slot.tensor.dynamic_axes.items():
                sizes.setdefault(axis.name, shape[d])

        def input_at(slot: RecordedInput, shape: tuple[int, ...]) -> RecordedInput:
            dims = (*shape, 2) if slot.complex else shape
            return dataclasses.replace(slot, tensor=dataclasses.replace(slot.tensor, dims=dims))

        def output_at(out: RecordedOutput) -> RecordedOutput:
            dims = tuple(sizes.get(d.name, int(d.scale)) if isinstance(d, Axis) else d for d in out.tensor.dims)
            return dataclasses.replace(out, tensor=dataclasses.replace(out.tensor, dims=dims))

        keyed = self.keyed if leaves is None else tuple((i, leaves[i]) for i, _ in self.keyed)
        inputs = tuple(input_at(slot, shape) for slot, shape in zip(self.inputs, shapes))
        return dataclasses.replace(self, inputs=inputs, outputs=tuple(output_at(out) for out in self.outputs),
                                   keyed=keyed)

    def with_output_shapes(self, shapes: Sequence[Sequence[int]]) -> Signature:
        """This signature with its outputs of the given shapes (measured by running the module at the call)."""
        return dataclasses.replace(self, outputs=tuple(
            dataclasses.replace(out, tensor=dataclasses.replace(out.tensor, dims=tuple(int(n) for n in shape)))
            for out, shape in zip(self.outputs, shapes)))

    def described(self) -> dict[str, Any]:
        """What the graph is besides its module's config: part of its architecture key."""
        return {"version": RECORDED_GRAPH_VERSION, "method": self.method, "arguments": str(self.arguments),
                "paths": list(self.paths),
                "constants": [(i, repr(v)) for i, v in self.constants], "keyed": [(i, repr(v)) for i, v in self.keyed],
                "outputs": [o.tensor.name for o in self.outputs], "output_tree": str(self.output_tree)}

    @property
    def pattern(self) -> tuple:
        """What its calls share (the key recorded calls are grouped by): method, argument tree, the kind of each
        tensor leaf."""
        kinds = {slot.index: slot.kind for slot in self.inputs}
        return self.method, str(self.arguments), tuple(kinds.get(i, "") for i in range(len(self.paths)))

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.described(), sort_keys=True).encode()).hexdigest()[:16]

    def leaves(self, tensors: Sequence[torch.Tensor]) -> list[Any]:
        """The call's argument leaves: the constants where recorded, the tensors in the inputs' places."""
        leaves: list[Any] = [None] * len(self.paths)
        for index, value in (*self.constants, *self.keyed):
            leaves[index] = value
        for slot, tensor in zip(self.inputs, tensors):
            leaves[slot.index] = tensor
        return leaves

    def difference(self, leaves: Sequence[Any]) -> str | None:
        """What differs between a call's argument leaves and this pattern (None: the call fits)."""
        if len(leaves) != len(self.paths):
            return f"{len(leaves)} argument values where {len(self.paths)} were recorded"
        # a graph of one shape takes any shape and size-following values: they pick its engine (shape_key)
        for index, value in (*self.constants, *(() if self.grows else self.keyed)):
            if isinstance(leaves[index], torch.Tensor) or not _same(leaves[index], value):
                return f"`{self.paths[index]}` is {_shown(leaves[index])} but was {_shown(value)} when recorded"
        sizes: dict[str, tuple[int, str]] = {}
        for slot in self.inputs:
            value = leaves[slot.index]
            if not isinstance(value, torch.Tensor):
                return f"`{self.paths[slot.index]}` is {_shown(value)} but was a tensor when recorded"
            if _kind(value.dtype) != slot.kind:
                return (f"`{self.paths[slot.index]}` is a tensor of {value.dtype} where the engine takes "
                        f"{slot.tensor.dtype}")
            dims = _call_dims(slot)
            if value.ndim != len(dims) or not self.grows and any(
                    isinstance(d, int) and d != n for d, n in zip(dims, value.shape)):
                wanted = tuple(d if isinstance(d, int) else d.name for d in dims)
                return f"`{self.paths[slot.index]}` has shape {tuple(value.shape)} where the engine takes {wanted}"
            for d, axis in slot.tensor.dynamic_axes.items():
                size, where = sizes.setdefault(axis.name, (int(value.shape[d]), self.paths[slot.index]))
                if size != value.shape[d]:
                    return (f"`{self.paths[slot.index]}` has {value.shape[d]} along {axis.name} where `{where}` has "
                            f"{size}: one graph takes one size of it")
        return None


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # an object whose == is not a bool
        return a is b


def _shown(value: Any) -> str:
    text = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- merging recorded calls into signatures ----------------------------------------------------------------


def _pattern(call: Call) -> tuple:
    """What calls of one signature share: the method, the tree of the arguments, the kind of each tensor leaf (as
    :attr:`Signature.pattern`): a mask passed as booleans in one call and as integers in another is two graphs."""
    return (call.method, str(call.arguments),
            tuple(_kind(leaf.dtype) if isinstance(leaf, torch.Tensor) else "" for leaf in call.leaves))


def _real_view(tensor: torch.Tensor) -> torch.Tensor:
    """A complex tensor as engines take it: in single precision, (real, imaginary) along a last dimension of 2."""
    return torch.view_as_real(tensor.to(torch.complex64))


def _call_dims(slot: RecordedInput) -> tuple:
    """The input's dimensions as the call passes it (a complex one without the real view's last 2)."""
    return slot.tensor.dims[:-1] if slot.complex else slot.tensor.dims


def _kind(dtype: torch.dtype) -> str:
    """A tensor's kind, which picks its graph (its precision may change with the engine's; its kind does not)."""
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "bool" if dtype == torch.bool else "int"


def component_name(attribute: str, method: str) -> str:
    """The engine component of a module's method: the module's attribute for `forward`; a VAE's decoder and
    encoder as kasoku's hand-written families name them."""
    if method == "forward":
        return attribute
    if attribute.startswith("vae") and method in ("decode", "encode"):
        return attribute.replace("vae", f"vae_{method}r", 1)
    return f"{attribute}_{method}"


def signatures(recordings: Sequence[Recording], attribute: str, *, max_tokens: int) -> list[Signature]:
    """The signatures of every method the pipeline called on the module at `attribute`, across `recordings`
    (the first is the optimum: its values seed the graph's samples). A second pattern of the same method is a
    second engine, ``<name>_2``. `max_tokens` bounds the text-token axes. A pattern seen at one probe's shape only
    is a graph of one shape (:attr:`Signature.grows`)."""
    grouped: dict[tuple, list[tuple[Probe, Call]]] = {}
    for recording in recordings:
        for call in recording.calls:
            if call.component == attribute:
                grouped.setdefault(_pattern(call), []).append((recording.probe, call))
    found: list[Signature] = []
    per_method: dict[str, int] = {}
    for observed in grouped.values():
        method = observed[0][1].method
        per_method[method] = per_method.get(method, 0) + 1
        name = component_name(attribute, method)
        if per_method[method] > 1:
            name = f"{name}_{per_method[method]}"
        signature = _signature(name, attribute, observed, recordings[0].probe, max_tokens)
        shapes = {dataclasses.replace(probe, prompt=0) for probe, _ in observed}
        if len(shapes) == 1:  # seen at one shape only (the pipeline calls it so in one kind of call): one shape
            signature = dataclasses.replace(signature, one_shape=described_probe(observed[0][0]))
        found.append(signature)
    return found


def described_probe(probe: Probe) -> str:
    """A probe as a message names it: "1 image of 1024x768 with guidance, 512 text tokens"."""
    text = f"{probe.batch} image{'s' if probe.batch > 1 else ''} of {probe.height}x{probe.width} " \
           f"{'with' if probe.guidance else 'without'} guidance"
    return text + (f", {probe.tokens} text tokens" if probe.tokens is not None else "")


def _signature(name: str, attribute: str, observed: list[tuple[Probe, Call]], optimum: Probe,
               max_tokens: int) -> Signature:
    first = observed[0][1]
    constants, keyed = _constants(name, first, observed, optimum)
    axes = _AxisNamer(max_tokens)
    inputs = tuple(_input(first.paths[i], i, observed, axes) for i in first.tensor_indices)
    read = [any(call.outputs_read()[i] for _, call in observed) for i in range(len(first.output_leaves))]
    taken = {slot.tensor.name for slot in inputs}  # a graph's output cannot share an input's name (a U-Net's sample)
    outputs = tuple(_output(_unique(first.output_paths[i], taken), i, observed, axes)
                    for i, kind in enumerate(first.output_leaves)
                    if read[i] and not isinstance(kind, Opaque) and (isinstance(kind, (tuple, Distribution))))
    if not outputs:
        raise UncompilableCall(f"the pipeline read no tensor of {name}'s output when it was recorded.")
    return Signature(name, attribute, first.method, first.arguments, first.paths, constants, keyed, inputs, outputs,
                     first.output, first.output_leaves, first.output_paths)


def _unique(name: str, taken: set[str]) -> str:
    return name if name not in taken else f"{name}_out"


def _constants(name: str, first: Call, observed: list[tuple[Probe, Call]], optimum: Probe):
    """The leaves the same in every call, and those that follow the image size (keyed: their value at the
    optimum)."""
    constants, keyed = [], []
    for index, value in enumerate(first.leaves):
        # a generator is passed along, not computed with (a VAE's decode takes one it does not use): the graph
        # runs without it
        if isinstance(value, (torch.Tensor, torch.Generator)):
            continue
        values = [(probe, call.leaves[index]) for probe, call in observed]
        if all(_same(v, value) for _, v in values):
            constants.append((index, value))
            continue
        per_probe: dict[Probe, Any] = {}
        for probe, v in values:
            if probe in per_probe and not _same(per_probe[probe], v):
                raise UncompilableCall(
                    f"{name} is called with `{first.paths[index]}` changing from call to call "
                    f"({_shown(per_probe[probe])}, then {_shown(v)}): a graph cannot take it as a constant.")
            per_probe[probe] = v
        keyed.append((index, per_probe.get(optimum, value)))
    return tuple(constants), tuple(keyed)


class _AxisNamer:
    """Fits dimensions to the probes and names each fitted axis once per component (the same fit: the same axis,
    which torch.export then sees as one Dim)."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.free: dict[tuple, Axis] = {}

    def fit(self, observations: list[tuple[Probe, int]]) -> int | Axis:
        values = {v for _, v in observations}
        if len(values) == 1:
            return values.pop()
        fitted = _image_axis(observations)
        if fitted is not None:
            return fitted
        offset = _token_offset(observations)
        if offset is not None:
            opt = observations[0][1]
            return Axis.free("text_tokens" if offset == 0 else f"text_tokens_plus{offset}", opt, 1,
                             self.max_tokens + offset)
        fitted = _image_axis_per_task(observations) or _text_and_image_axis(observations, self.max_tokens)
        if fitted is not None:
            return fitted
        key = tuple(sorted(set(observations), key=repr))
        if key not in self.free:
            opt = observations[0][1]
            self.free[key] = Axis.free(f"tokens_{len(self.free)}", opt, 1, max(self.max_tokens, 4 * max(values)))
        return self.free[key]


def _image_axis(observations: list[tuple[Probe, int]]) -> Axis | None:
    """The simplest multiple of a product of image dimensions that gives every observed size; a batch multiple
    that doubles under guidance is a guided axis (twice the images with guidance, once without)."""
    for dims in PRODUCTS:
        scales = {(probe.guidance if "batch" in dims else None): Fraction(value, probe.product(dims))
                  for probe, value in observations}
        consistent = all(Fraction(value, probe.product(dims)) == scales[probe.guidance if "batch" in dims else None]
                         for probe, value in observations)
        if not consistent:
            continue
        with_guidance, without = scales.get(True), scales.get(False)
        if "batch" in dims and with_guidance is not None and without is not None and with_guidance != without:
            if with_guidance != 2 * without:
                continue
            return Axis(_axis_name(dims, with_guidance) + "_guided", dims[0] if len(dims) == 1 else dims,
                        with_guidance, min_scale=without)
        scale = next(iter(scales.values()))
        of = dims[0] if len(dims) == 1 else dims
        return Axis(_axis_name(dims, scale), of, scale, from_one=dims == ("batch",))
    return None


def _token_offset(observations: list[tuple[Probe, int]]) -> int | None:
    """The fixed count a text-token dimension adds to the tokens asked for (a prompt template's), if it is one."""
    if any(probe.tokens is None for probe, _ in observations):
        return None
    offsets = {value - probe.tokens for probe, value in observations}
    return offsets.pop() if len(offsets) == 1 and min(offsets | {0}) >= 0 else None


def _image_axis_per_task(observations: list[tuple[Probe, int]]) -> Axis | None:
    """A product of image dimensions taken at a few scales (:attr:`Axis.scales`), each of which gives the sizes seen
    at two image sizes or more: the pipeline's tasks call one graph with more or fewer tokens per image (Flux.2
    klein's inpainting appends the reference image's tokens). A free axis in its place was bounded by the probes'
    small sizes, and refused every full-size call."""
    for dims in AREAS:
        products: dict[Fraction, set[int]] = {}
        for probe, value in observations:
            products.setdefault(Fraction(value, probe.product(dims)), set()).add(probe.product(dims))
        if len(products) <= MAX_TASK_SCALES and all(len(seen) > 1 for seen in products.values()):
            probe, value = observations[0]  # the optimum's
            scale = Fraction(value, probe.product(dims))
            return Axis(f"{_axis_name(dims, scale)}_per_task", dims, scale, scales=(min(products), max(products)))
    return None


def _text_and_image_axis(observations: list[tuple[Probe, int]], max_tokens: int) -> Axis | None:
    """The text tokens asked for plus a multiple of a product of image dimensions: one sequence of the prompt's
    tokens and the image's (Ideogram 4's transformer input, Chroma's attention mask). A free axis in its place was
    bounded by the probes' small sizes, and refused every full-size call."""
    if any(probe.tokens is None for probe, _ in observations):
        return None
    for dims in AREAS:
        scales = {Fraction(value - probe.tokens, probe.product(dims)) for probe, value in observations}
        products = {probe.product(dims) for probe, _ in observations}
        if len(scales) == 1 and len(products) > 1 and (scale := scales.pop()) > 0:
            tokens = observations[0][0].tokens  # the optimum's
            return Axis(f"text_tokens_plus_{_axis_name(dims, scale)}", dims, scale, text=(1, tokens, max_tokens))
    return None


def _axis_name(dims: Sequence[str], scale: Fraction) -> str:
    text = "_x_".join(dims)
    if scale.numerator != 1:
        text += f"_x{scale.numerator}"
    if scale.denominator != 1:
        text += f"_div{scale.denominator}"
    return text


def _input(path: str, index: int, observed: list[tuple[Probe, Call]], axes: _AxisNamer) -> RecordedInput:
    tensors = [(probe, call.leaves[index]) for probe, call in observed]
    first = tensors[0][1]
    dtypes = {t.dtype for _, t in tensors}
    if len(dtypes) > 1 or any(t.ndim != first.ndim for _, t in tensors):
        raise UncompilableCall(f"`{path}` changes its dtype or rank from call to call "
                               f"({', '.join(sorted(str(d) for d in dtypes))}).")
    dims = tuple(axes.fit([(probe, int(t.shape[d])) for probe, t in tensors]) for d in range(first.ndim))
    if first.is_complex():
        first = _real_view(first)
        dims = (*dims, 2)
    values = first.detach().reshape(-1)
    if values.numel() and not values.is_floating_point():
        values = values.to(torch.float64)
    if values.numel():
        common_values, counts = torch.unique(values.to(torch.float64), return_counts=True)
        low, high = float(values.min()), float(values.max())
        distinct, common = int(common_values.numel()), float(common_values[counts.argmax()])
    else:
        low = high = common = 0.0
        distinct = 0
    return RecordedInput(index, TensorSpec(path, dims, first.dtype), low, high, distinct, common,
                         complex=tensors[0][1].is_complex())


def _output(path: str, index: int, observed: list[tuple[Probe, Call]], axes: _AxisNamer) -> RecordedOutput:
    kinds = [(probe, call.output_leaves[index]) for probe, call in observed]
    first = kinds[0][1]
    if isinstance(first, Distribution):
        shapes = [(probe, kind.shape) for probe, kind in kinds]
        dims = tuple(axes.fit([(probe, shape[d]) for probe, shape in shapes]) for d in range(len(first.shape)))
        return RecordedOutput(index, TensorSpec(path, dims, first.dtype), first)
    shape, dtype = first
    dims = tuple(axes.fit([(probe, kind[0][d]) for probe, kind in kinds]) for d in range(len(shape)))
    return RecordedOutput(index, TensorSpec(path, dims, dtype))


# ---- the spec, the graph's module and the stand-in ----------------------------------------------------------


class RecordedCallModule(torch.nn.Module):
    """What export traces: the recorded call of `method` on `module`, the signature's tensors in (in input order),
    the outputs the pipeline read out (a distribution as its parameters)."""

    def __init__(self, module: torch.nn.Module, signature: Signature):
        super().__init__()
        self.module = module
        self.signature = signature

    def forward(self, *tensors):
        tensors = [torch.view_as_complex(t.float()) if slot.complex else t
                   for slot, t in zip(self.signature.inputs, tensors)]
        args, kwargs = pytree.tree_unflatten(self.signature.leaves(tensors), self.signature.arguments)
        call = self.module if self.signature.method == "forward" else getattr(self.module, self.signature.method)
        leaves = pytree.tree_flatten(call(*args, **kwargs), is_leaf=Distribution.holds)[0]
        return tuple(leaves[o.index].parameters if o.distribution else leaves[o.index]
                     for o in self.signature.outputs)


def _sample_input(signature: Signature):
    by_name = {slot.tensor.name: slot for slot in signature.inputs}

    def sample(tensor: TensorSpec, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        slot = by_name[tensor.name]
        if slot.distinct <= 2 or slot.low == slot.high:
            # a mask open at every position (a recorded one is mostly padding: a row masked everywhere is where
            # runtimes legitimately differ), a flag or a fixed position as recorded
            value = slot.high if not tensor.dtype.is_floating_point else slot.common
            return torch.full(shape, value, dtype=tensor.dtype)
        if not tensor.dtype.is_floating_point:
            return torch.randint(int(slot.low), int(slot.high) + 1, shape, generator=generator, dtype=tensor.dtype)
        return (torch.rand(shape, generator=generator) * (slot.high - slot.low) + slot.low).to(tensor.dtype)

    return sample


def recorded_spec(signature: Signature, ref: ModuleRef, profile: ShapeProfile, *, takes_lora: bool = False,
                  one_shape: Callable[[], ComponentSpec] | None = None,
                  calibration: Mapping[str, Any] | None = None) -> ComponentSpec:
    """The component spec of a recorded signature of the module at `ref`; `takes_lora` where diffusers' LoRA loader
    changes the module, `one_shape` the spec its graph falls back to (see :class:`ComponentSpec`). `calibration`
    (the calls a denoiser is calibrated on) makes its int8 recipe the full one: activations in int8 too, calibrated
    on what it sees in its pipeline's own denoising loop, as the hand-written denoisers' are."""
    return ComponentSpec(
        name=signature.component,
        inputs=tuple(slot.tensor for slot in signature.inputs),
        outputs=tuple(out.tensor for out in signature.outputs),
        profile=profile,
        load_module=lambda: RecordedCallModule(ref.load(), signature),
        weights=ref.digest,
        config={**_configuration(ref.module), "_class": type(ref.module).__name__, "recorded": signature.described()},
        sample_input=_sample_input(signature),
        modules=(ref.path,),
        graph_kind="recorded",
        takes_lora=takes_lora,
        one_shape=one_shape,
        interleaved="." in ref.path,  # a block: the glue around it runs in torch
        **int8_recipe(ref.module, calibrated=calibration is not None),
        calibration=calibration or {},
        in_bf16=floating_dtype(ref.module) == torch.bfloat16,
    )


# What NNCF's calibration of a graph read in bf16 holds, in multiples of its bf16 weights: the weights, and the fp32
# model NNCF computes its statistics with (OpenVINO's fp32 compile of a 0.5 GB bf16 weight took 2.0 GB more).
CALIBRATION_HOLDS_BF16_WEIGHTS = 5


def int8_recipe(module: torch.nn.Module, calibrated: bool) -> dict[str, str]:
    """The int8 recipe of a graph of `module` (ComponentSpec's `int8`, and `int8_note`): a denoiser's is calibrated
    ("full"), unless its weights are read in bf16 and that calibration would not fit in this machine's memory; then
    weights only, which needs no calibration, with the reason."""
    if not calibrated:
        return {"int8": "weights"}
    if floating_dtype(module) != torch.bfloat16:
        return {"int8": "full"}
    weights = weight_bytes(module)
    if fits_this_machine(CALIBRATION_HOLDS_BF16_WEIGHTS * weights):
        return {"int8": "full"}
    held = CALIBRATION_HOLDS_BF16_WEIGHTS * weights / GIB
    return {"int8": "weights", "int8_note": (
        f"int8 weights only: calibrating its activations from its {weights / GIB:.1f} GiB of bf16 weights would hold "
        f"about {held:.0f} GiB (NNCF computes its statistics on an fp32 model), more than this machine has")}


def _configuration(module: torch.nn.Module) -> dict[str, Any]:
    """What the module's graph depends on besides the call: its config, or for a module without one (a block of
    a transformer) its structure: its layers as printed and the shape of every weight."""
    if hasattr(module, "config"):
        return config_dict(module.config)
    return {"structure": repr(module), "weights": {name: list(tensor.shape) for name, tensor in
                                                   itertools.chain(module.named_parameters(), module.named_buffers())}}


class Uncompiled(torch.Tensor):
    """An output the compiled component does not compute (the pipeline did not read it when recorded): any use
    is an error that says so, never a silent zero."""

    _what: str

    @staticmethod
    def __new__(cls, what: str):
        empty = torch.empty(0).as_subclass(cls)
        empty._what = what
        return empty

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        what = next(a._what for a in pytree.tree_leaves((args, kwargs or {})) if isinstance(a, Uncompiled))
        raise InvalidInput(what)


def _layout_difference(kwargs: Mapping[str, Any], signature: Signature) -> str:
    """How a call's arguments differ in their layout from the recorded ones (names given, or their nesting)."""
    recorded_args, recorded_kwargs = pytree.tree_unflatten(list(signature.paths), signature.arguments)
    given, recorded_names = set(kwargs), set(recorded_kwargs)
    if given != recorded_names:
        parts = []
        if given - recorded_names:
            parts.append(f"it is given {', '.join(f'`{n}`' for n in sorted(given - recorded_names))}")
        if recorded_names - given:
            parts.append(f"not {', '.join(f'`{n}`' for n in sorted(recorded_names - given))}")
        return " and ".join(parts) + ", unlike the recorded calls"
    changed = [name for name in kwargs if str(pytree.tree_flatten(kwargs[name])[1]) !=
               str(pytree.tree_flatten(recorded_kwargs[name])[1])]
    return f"{', '.join(f'`{n}`' for n in changed) or 'its arguments'} nest otherwise than in the recorded calls"


class EngineRecorded(EngineModule):
    """A module diffusers calls as it called the torch one when recorded: each recorded method (forward, decode,
    encode) runs the engine of the signature its arguments fit and hands back the recorded output structure;
    every other attribute is the module's own (its config, its VAE's scaling factors)."""

    def __init__(self, original: torch.nn.Module, engines: Mapping[str, Any], times, signatures: Iterable[Signature],
                 *, torch_module: torch.nn.Module | None = None,
                 grow: Callable[[Signature, list[Any]], Any] | None = None):
        found = tuple(signatures)
        super().__init__(original, engines, times, found[0].component)
        object.__setattr__(self, "_original", original)
        # the module with its weights, for the calls that have no engine (a graph kept in torch); None: every
        # call the pipeline made has one
        object.__setattr__(self, "_torch_module", torch_module)
        self._signatures = found
        # graphs of one shape: their engines by shape key (the compiled one: the recorded call's), and what builds
        # the engine of a shape no call asked for yet (None: such a call is refused)
        self._grow = grow
        self._at_shape: dict[tuple[str, tuple], Any] = {}

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_"):
                raise
            return getattr(self._original, name)

    def forward(self, *args, **kwargs):
        return self._recorded("forward", args, kwargs)

    def decode(self, *args, **kwargs):
        return self._recorded("decode", args, kwargs)

    def encode(self, *args, **kwargs):
        return self._recorded("encode", args, kwargs)

    def _recorded(self, method: str, args: tuple, kwargs: dict):
        args, kwargs = canonical_call(getattr(self._original, method), args, kwargs)
        leaves, tree = pytree.tree_flatten((args, kwargs))
        candidates = [s for s in self._signatures if s.method == method]
        if self._torch_module is not None and not any(
                str(tree) == str(s.arguments) and s.difference(leaves) is None for s in candidates):
            return getattr(self._torch_module, method)(*args, **kwargs)  # a call kept in torch
        if not candidates:
            raise InvalidInput(f"the compiled {self._component} was never called with `{method}` when kasoku recorded "
                               "the pipeline; call it as the pipeline did.")
        reasons = []
        for signature in candidates:
            reason = _layout_difference(kwargs, signature) if str(tree) != str(signature.arguments) else \
                signature.difference(leaves)
            if reason is None:
                return self._run_signature(signature, leaves)
            reasons.append(reason)
        raise InvalidInput(f"{candidates[0].component} cannot serve this call: {reasons[0]}. Its engine was compiled "
                           "from the calls diffusers made when kasoku recorded the pipeline; call it as those did.")

    def _engine_at_shape(self, signature: Signature, leaves: list[Any]):
        """The engine of a graph of one shape for this call: the compiled one at the recorded call's shape, else one
        built now (once per shape; kept in the cache). One built before the compiled engine changed (LoRA weights
        bound) would compute with the old weights: it is refused."""
        compiled = self._engines[signature.component]
        key = signature.shape_key(leaves)
        if key == signature.shape_key():
            return compiled
        built = self._at_shape.get((signature.component, key))
        if built is not None and built[0] == _weights_of(compiled):
            return built[1]
        if self._grow is None or built is not None:
            why = "its weights changed since (LoRA adapters)" if built is not None else "no compile is at hand"
            raise InvalidInput(f"{signature.component} runs engines of one shape, and this call's "
                               f"({_shapes(signature, leaves)}) has none: {why}. Call it at the compiled shape "
                               f"({signature.one_shape}), or compile for the shape you call.")
        engine = self._grow(signature, leaves)
        self._at_shape[signature.component, key] = (_weights_of(compiled), engine)
        return engine

    def _run_signature(self, signature: Signature, leaves: list[Any]):
        feeds = {slot.tensor.name: slot.fed(leaves[slot.index]) for slot in signature.inputs}
        if signature.grows:
            outputs = self._run_engine(signature.component, self._engine_at_shape(signature, leaves), feeds)
        else:
            outputs = self._run(signature.component, **feeds)
        out_leaves: list[Any] = []
        computed = {o.index: o for o in signature.outputs}
        for index, kind in enumerate(signature.output_template):
            if index in computed:
                value = outputs[computed[index].tensor.name]
                out_leaves.append(computed[index].distribution.rebuild(value) if computed[index].distribution
                                  else value)
            elif isinstance(kind, tuple):
                out_leaves.append(Uncompiled(f"{signature.component}'s output `{signature.output_paths[index]}` is "
                                             "not compiled: the pipeline did not read it when kasoku recorded it."))
            elif isinstance(kind, (Opaque, Distribution)):
                out_leaves.append(None)
            else:
                out_leaves.append(kind)
        return pytree.tree_unflatten(out_leaves, signature.output_tree)


def _weights_of(engine) -> tuple:
    """What changes when an engine's weights do: the engine (LoRA fused: a new one), its run-time weights (bound)."""
    return id(engine), tuple(id(tensor) for tensor in getattr(engine, "bound", {}).values())


def _shapes(signature: Signature, leaves: Sequence[Any]) -> str:
    return ", ".join(f"`{signature.paths[slot.index]}` {tuple(leaves[slot.index].shape)}" for slot in signature.inputs)


class StepCachedForward:
    """A denoiser's `forward` (an :class:`EngineRecorded`'s, or a torch module's whose blocks run on engines) that
    runs one pipeline call's step caching while it is set (:meth:`step_cache`; kasoku.core.step_cache): TaylorSeer
    on its whole output, or the first-block cache on its blocks (:class:`FirstBlockLoop`; `blocks` gives the
    module whose blocks it runs: this one, or a copy whose blocks run on engines).

    Each call of a step keeps its own state, found by its place in the step: a pipeline that runs its guidance as
    two calls a step (Chroma, Kandinsky 5, Lumina 2) names them to diffusers' hooks only sometimes (`cache_context`),
    but always passes both the same latents. A call whose first tensor equals the last call's is the next call of
    the same step."""

    def __init__(self, forward: Callable[..., Any], blocks: Callable[[], FirstBlockLoop]):
        self._forward = forward
        self._blocks = blocks
        self._run = None
        self._last: torch.Tensor | None = None
        self._place = 0

    def __call__(self, *args, **kwargs):
        if self._run is None:
            return self._forward(*args, **kwargs)
        first = next((leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)), None)
        same_step = first is not None and self._last is not None and first.shape == self._last.shape and \
            bool(torch.equal(first, self._last))
        self._place = self._place + 1 if same_step else 0
        self._last = None if first is None else first.detach().clone()  # the pipeline may change it in place
        if isinstance(self._run, FirstBlockRun):
            return self.first_block_loop().step(self._run, self._place, args, kwargs)
        return self._run.step(self._place, lambda: self._forward(*args, **kwargs))

    def first_block_loop(self) -> FirstBlockLoop:
        """The block loop the first-block cache runs (built on its first use: its blocks' engines are built by then)."""
        if not isinstance(self._blocks, FirstBlockLoop):
            self._blocks = self._blocks()
        return self._blocks

    @contextlib.contextmanager
    def step_cache(self, run) -> Iterator[None]:
        """`run` for one pipeline call (None: none), its state gone after it."""
        self._run, self._last, self._place = run, None, 0
        try:
            yield
        finally:
            self._run, self._last = None, None


def with_step_cache(module: torch.nn.Module, blocks: Callable[[], FirstBlockLoop]) -> torch.nn.Module:
    """`module` with a :class:`StepCachedForward` as its forward (`module.forward.step_cache(run)` sets a call's
    run); `module` is the pipeline's stand-in, never the user's torch module."""
    module.forward = StepCachedForward(module.forward, blocks)
    return module


# ---- the first-block cache on a denoiser's own blocks ------------------------------------------------------------


@dataclass(frozen=True)
class Carry:
    """Where a block returns the tokens it carries to the next: the image tokens (`hidden_states`) at `hidden` of
    its output tuple (None: the output is them), the text tokens (`encoder_hidden_states`) at `encoder` (None: not
    returned). diffusers' TransformerBlockRegistry says it for the blocks its cache hooks know; for the others it is
    read from a computed call, by shape."""

    hidden: int | None
    encoder: int | None = None
    length: int = 1
    arguments: tuple[str, str] = ("hidden_states", "encoder_hidden_states")  # the block's names for them (Z-Image: x)

    NAMES = ("hidden_states", "encoder_hidden_states")

    def given(self, named: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The carried tokens among a call's arguments (by name), under the names :meth:`carried` gives them."""
        return {name: named[argument] for name, argument in zip(self.NAMES, self.arguments)
                if isinstance(named.get(argument), torch.Tensor)}

    def carried(self, output: Any) -> dict[str, torch.Tensor]:
        if self.hidden is None:
            return {"hidden_states": output}
        found = {"hidden_states": output[self.hidden]}
        encoder = None if self.encoder is None else output[self.encoder]
        if isinstance(encoder, torch.Tensor) and not isinstance(encoder, Uncompiled):  # the last block's is not
            found["encoder_hidden_states"] = encoder                                    # read: not compiled
        return found

    def output(self, carried: Mapping[str, torch.Tensor]) -> Any:
        """An output of this block holding `carried` (its other places None, as diffusers' hooks return)."""
        if self.hidden is None:
            return carried["hidden_states"]
        out: list[Any] = [None] * self.length
        out[self.hidden] = carried["hidden_states"]
        if self.encoder is not None:
            out[self.encoder] = carried["encoder_hidden_states"]
        return tuple(out)


def carry_of(block: torch.nn.Module, arguments: Mapping[str, Any], output: Any) -> Carry:
    """The :class:`Carry` of `block` (a torch block or its engine stand-in) from one computed call."""
    from diffusers.hooks._helpers import TransformerBlockRegistry

    cls = type(getattr(block, "_original", block))
    try:
        known = TransformerBlockRegistry.get(cls)
    except ValueError:
        known = None
    length = len(output) if isinstance(output, (tuple, list)) else 1
    if known is not None and known.hidden_states_argument_name in arguments:
        return Carry(known.return_hidden_states_index if isinstance(output, (tuple, list)) else None,
                     known.return_encoder_hidden_states_index, length,
                     (known.hidden_states_argument_name, known.encoder_hidden_states_argument_name))
    if isinstance(output, torch.Tensor):  # the one argument of its shape (Z-Image names it x)
        same = [name for name, value in arguments.items()
                if isinstance(value, torch.Tensor) and value.shape == output.shape]
        if "hidden_states" in same or len(same) == 1:
            return Carry(None, arguments=("hidden_states" if "hidden_states" in same else same[0],
                                          "encoder_hidden_states"))
    places = {}
    for name in Carry.NAMES if isinstance(output, (tuple, list)) else ():
        given = arguments.get(name)
        matching = [i for i, out in enumerate(output) if isinstance(out, torch.Tensor)
                    and isinstance(given, torch.Tensor) and out.shape == given.shape]
        if len(matching) == 1:
            places[name] = matching[0]
    if "hidden_states" not in places or len(set(places.values())) < len(places):
        raise InvalidInput(f"the first-block cache cannot tell which output of {cls.__name__} carries the image tokens "
                           "to the next block; call without `cache_threshold` (cache_interval=N runs TaylorSeer).")
    return Carry(places["hidden_states"], places.get("encoder_hidden_states"), length)


def _named(block: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A block call's arguments by name (its torch module's parameters: an engine stand-in takes *args)."""
    return canonical_call(getattr(block, "_original", block).forward, args, kwargs)[1]


def loop_lists(module: torch.nn.Module) -> list[str]:
    """The block lists of `module` a first-block cache runs over, in order: those diffusers' cache hooks name
    (`transformer_blocks`, `single_transformer_blocks`, `layers`, ...; not a refiner's)."""
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS

    return [name for name, child in module.named_children() if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and
            isinstance(child, torch.nn.ModuleList) and len(child)]


def loop_size(module: torch.nn.Module) -> int:
    """How many blocks a first-block cache on `module` runs over."""
    return sum(len(getattr(module, name)) for name in loop_lists(module))


def check_loop(module: torch.nn.Module) -> None:
    """Refuse a first-block cache on `module` when its block lists hold fewer than two blocks."""
    count = loop_size(module)
    if count < 2:
        raise InvalidInput(f"{type(module).__name__} has {count} block(s) in the lists a first-block cache splits "
                           "(transformer_blocks, layers, ...); call without `cache_threshold` (cache_interval=N runs "
                           "TaylorSeer on its whole output).")


class _LoopBlock(torch.nn.Module):
    """One block of a :class:`FirstBlockLoop`, as the denoiser's code calls it."""

    def __init__(self, block: torch.nn.Module, loop: FirstBlockLoop, index: int):
        super().__init__()
        self.block = block
        self._loop = loop
        self._index = index

    def forward(self, *args, **kwargs):
        return self._loop.call(self._index, self.block, args, kwargs)


class FirstBlockLoop:
    """The first-block cache (diffusers' `FirstBlockCacheConfig`, ParaAttention's) on a denoiser's block loop: the
    blocks of its lists diffusers' cache hooks name (`transformer_blocks`, `single_transformer_blocks`, `layers`,
    ...; a refiner list runs every step), in order. The first block always runs; when its residual changed by no
    more than the threshold since the last step that ran every block, the other blocks hand on their inputs and the
    first block's output gets what they added on that step instead. `module` is the stand-in's own module (a copy:
    its block lists are replaced by wrapped ones)."""

    def __init__(self, module: torch.nn.Module, forward: Callable[..., Any]):
        check_loop(module)
        self._forward = forward
        self.blocks: list[torch.nn.Module] = []
        for name in loop_lists(module):
            wrapped = []
            for block in getattr(module, name):
                wrapped.append(_LoopBlock(block, self, len(self.blocks)))
                self.blocks.append(block)
            module._modules[name] = torch.nn.ModuleList(wrapped)
        self._carries: dict[int, Carry] = {}
        self._run: FirstBlockRun | None = None
        self._place: Any = None
        self._computes = True
        self._head: dict[str, torch.Tensor] = {}
        self._span = 0  # the last block a skipped step hands on (learnt on the first step, which runs every block)

    def step(self, run: FirstBlockRun, place: Any, args: tuple, kwargs: dict):
        """One denoiser call of a step under `run`: the module's forward, its blocks through :meth:`call`."""
        self._run, self._place, self._computes = run, place, True
        try:
            output = self._forward(*args, **kwargs)
        finally:
            self._run = None
        if not self._span:
            raise InvalidInput(f"the first-block cache found no block after the first that returns image tokens of "
                               f"its shape (of {len(self.blocks)}: a list after it works on joined text and image "
                               "tokens); call without `cache_threshold` (cache_interval=N runs TaylorSeer).")
        return output

    def call(self, index: int, block: torch.nn.Module, args: tuple, kwargs: dict):
        """Block `index` of the loop: the first decides; up to the last block whose image tokens have the first's
        shape (the span a skipped step hands on), the others run or hand on their inputs; the blocks after that span
        (a list working on joined text and image tokens: Chroma's single blocks) always run."""
        if self._run is None:
            return block(*args, **kwargs)
        if 0 < index <= self._span and not self._computes:
            return self._carries[index].output(self._carries[index].given(_named(block, args, kwargs)))
        output = block(*args, **kwargs)
        if index not in self._carries:
            self._carries[index] = carry_of(block, _named(block, args, kwargs), output)
        carry = self._carries[index]
        carried = carry.carried(output)
        if index == 0:
            given = carry.given(_named(block, args, kwargs))["hidden_states"]
            self._computes = self._run.computes_rest(self._place, carried["hidden_states"] - given)
            if self._computes:
                self._head = carried
                return output
            tail = self._run.tail(self._place)
            return carry.output({name: value + tail[name] if name in tail else value
                                 for name, value in carried.items()})
        if self._computes and carried["hidden_states"].shape == self._head["hidden_states"].shape and \
                index >= self._span:
            self._span = index  # the last block of the span so far: what it added since the first is the tail
            self._run.keep_tail(self._place, {name: carried[name] - start for name, start in self._head.items()
                                              if name in carried and carried[name].shape == start.shape})
        return output
