"""Weights bound to an architecture's graph: what lets every checkpoint of one architecture share
one export.

The exported graph of a component holds no weights (:func:`kasoku.build.export.export_graph`): every
parameter and buffer of the torch module is a graph input named by its state-dict name
(``unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight``), and every other
constant in the graph is independent of the weights. Binding is therefore by name, with no
guesswork: graph weight ``N`` gets the module's tensor ``N`` in the dtype the graph declares for it
(a pass that converts the graph to fp16 declares fp16 weights; the cast is that pass re-run on the
weights alone). The backends bind at build (ONNX Runtime: external initializers at session
creation; OpenVINO: constants in place of the weight parameters before compiling; TensorRT: a
materialized file, refitted by name later) and, for engines compiled with LoRA targets, at run
time (the targeted weights stay engine inputs, bound once per adapter set).

A module carrying PEFT LoRA layers (a diffusers pipeline after ``load_lora_weights``) is exported
as its base architecture (:func:`base_layers`) and bound with its effective weights, the LoRA
deltas merged in exactly as PEFT's forward applies them (:func:`bindable_tensors`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from .errors import KasokuError

# Where the initializers of a graph whose weights are supplied at session creation claim to live: a file
# that never exists (ONNX Runtime never reads it, the caller's tensors replace them).
BOUND_LOCATION = "kasoku-bound-weights"
_LORA_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector",
               "lora_dropout")


class WeightBindingError(KasokuError):
    """Weights that do not fit the graph they are bound to."""


# ---- the module side: which tensors, under which names ------------------------------------------------


def _is_tuner_layer(module: torch.nn.Module) -> bool:
    """A PEFT adapter layer wrapping a base layer (duck-typed: kasoku does not need peft itself)."""
    return hasattr(module, "base_layer") and hasattr(module, "merged") and hasattr(module, "active_adapters")


def _effective_weight(name: str, layer) -> torch.Tensor:
    """The weight PEFT's forward computes with: merged adapters are already in the base weight; active
    unmerged LoRA adapters are added (W + scale B A, PEFT's own get_delta_weight); disabled adapters
    leave the base weight as it was before any merge."""
    base = layer.get_base_layer().weight.detach()
    if layer.disable_adapters:
        for adapter in reversed(layer.merged_adapters):  # PEFT's forward unmerges first
            base = base - layer.get_delta_weight(adapter).detach()
        return base
    if layer.merged:
        return base
    if not hasattr(layer, "lora_A"):
        raise KasokuError(f"{name} carries a {type(layer).__name__} adapter that kasoku cannot merge; fuse it "
                          "first (`pipe.fuse_lora()`), then compile.")
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    for adapter in active:
        if getattr(layer, "use_dora", {}).get(adapter) or getattr(layer, "lora_bias", {}).get(adapter):
            raise KasokuError(f"{name}: adapter {adapter!r} is a DoRA or has a LoRA bias, which kasoku cannot "
                              "merge; fuse it first (`pipe.fuse_lora()`), then compile.")
    for adapter in active:  # one at a time, in PEFT's order, as its merge adds them
        base = base + layer.get_delta_weight(adapter).detach()
    return base


def bindable_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `module` by the name the exported graph gives it; a PEFT layer's
    base parameters under the base layer's name (`to_q.weight`, not `to_q.base_layer.weight`), its weight
    with the active adapters merged, and the adapters' own tensors left out."""
    layers = {name: m for name, m in module.named_modules() if _is_tuner_layer(m)}
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in (*module.named_parameters(), *module.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        layer_name = next((n for n in layers if owner == n or owner.startswith(n + ".")), None)
        if layer_name is None:
            tensors[name] = tensor.detach()
            continue
        rest = owner[len(layer_name) + 1:]
        if rest.split(".")[0] in _LORA_PARTS:
            continue
        if rest != "base_layer":
            raise KasokuError(f"{name} belongs to a PEFT layer in a way kasoku does not know; fuse the adapters "
                              "first (`pipe.fuse_lora()`), then compile.")
        value = _effective_weight(layer_name, layers[layer_name]) if leaf == "weight" else tensor.detach()
        tensors[f"{layer_name}.{leaf}"] = value
    return tensors


@contextlib.contextmanager
def base_layers(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """`module` with each PEFT adapter layer replaced by its base layer while the block runs (what the
    exporter sees: the base architecture, under the base names); restored afterwards."""
    swapped = []
    for name, layer in list(module.named_modules()):
        if _is_tuner_layer(layer):
            parent_name, _, attribute = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, attribute, layer.get_base_layer())
            swapped.append((parent, attribute, layer))
    try:
        yield module
    finally:
        for parent, attribute, layer in reversed(swapped):
            setattr(parent, attribute, layer)


# ---- the graph side: which inputs are weights -----------------------------------------------------------

_NUMPY = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.BFLOAT16: np.float32,
          TensorProto.DOUBLE: np.float64, TensorProto.INT64: np.int64, TensorProto.INT32: np.int32,
          TensorProto.BOOL: np.bool_}
_TORCH = {TensorProto.FLOAT: torch.float32, TensorProto.FLOAT16: torch.float16, TensorProto.BFLOAT16: torch.bfloat16,
          TensorProto.DOUBLE: torch.float64, TensorProto.INT64: torch.int64, TensorProto.INT32: torch.int32,
          TensorProto.BOOL: torch.bool}


@dataclass(frozen=True)
class GraphWeight:
    """One weight input of an architecture graph: its name, static shape and ONNX element type."""

    name: str
    shape: tuple[int, ...]
    elem_type: int

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> GraphWeight:
        """The weight a graph would take for this tensor (what a backend without a graph binds: torch)."""
        elem_type = next(e for e, dtype in _TORCH.items() if dtype == tensor.dtype)
        return cls(name, tuple(tensor.shape), elem_type)

    @property
    def dtype(self) -> torch.dtype:
        return _TORCH[self.elem_type]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * torch.tensor([], dtype=self.dtype).element_size()


def graph_weights(model: onnx.ModelProto, input_names: Iterable[str]) -> dict[str, GraphWeight]:
    """The weight inputs of an architecture graph: every graph input that is not one of the component's
    own inputs (`input_names`), in graph order."""
    own = set(input_names)
    out = {}
    for value in model.graph.input:
        if value.name in own:
            continue
        dims = value.type.tensor_type.shape.dim
        if any(not d.HasField("dim_value") for d in dims):
            raise WeightBindingError(f"graph weight {value.name!r} has a dynamic shape; it is not a weight.")
        out[value.name] = GraphWeight(value.name, tuple(d.dim_value for d in dims), value.type.tensor_type.elem_type)
    return out


def read_graph_weights(path: Path, input_names: Iterable[str]) -> dict[str, GraphWeight]:
    return graph_weights(onnx.load(str(path), load_external_data=False), input_names)


def weights_for(weights: Mapping[str, GraphWeight], tensors: Mapping[str, torch.Tensor],
                component: str = "?") -> dict[str, torch.Tensor]:
    """Each graph weight's tensor, contiguous on the CPU in the graph's dtype; a graph weight the module
    does not have, or one of another shape, is an error naming it."""
    missing = [name for name in weights if name not in tensors]
    if missing:
        raise WeightBindingError(f"the {component} graph takes weights the module does not have: "
                                 f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; the graph belongs to "
                                 "another architecture. Clear the cache (`kasoku cache clear`) and compile again.")
    out = {}
    for name, weight in weights.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != weight.shape:
            raise WeightBindingError(f"{component} weight {name!r} has shape {tuple(tensor.shape)} but the graph "
                                     f"takes {weight.shape}.")
        out[name] = tensor.detach().to(device="cpu", dtype=weight.dtype).contiguous()
    return out


def run_time_weights(names: Iterable[str], targets: Iterable[str]) -> frozenset[str]:
    """The weights of the modules named in `targets` (module names matched as suffixes of the weight's
    module path: `to_q` matches `unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight`)."""
    suffixes = tuple(f".{target}.weight" for target in targets)
    return frozenset(n for n in names if suffixes and (n.endswith(suffixes) or f".{n}".endswith(suffixes)))


def named_parts(names: Iterable[str], parts: Iterable[str]) -> frozenset[str]:
    """The weights whose names hold one of `parts` as whole dotted pieces (".to_k_ip." in
    "unet.mid_block...attn2.processor.to_k_ip.0.weight")."""
    parts = tuple(f".{part.strip('.')}." for part in parts)
    return frozenset(n for n in names if parts and any(p in f".{n}" for p in parts))


def bind_named_parts(engine, module: torch.nn.Module, parts: Iterable[str]) -> None:
    """Bind into `engine` the module's current values of its run-time weights named by `parts` (an adapter's),
    its other run-time weights as they are."""
    current = bindable_tensors(module)
    engine.bind({**engine.bound, **{name: current[name] for name in named_parts(engine.bound, parts)}})


def floating_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype a module's weights were loaded in: that of most of its floating-point parameters (diffusers and
    transformers keep a few small modules in fp32 in a bf16 model)."""
    counts: dict[torch.dtype, int] = {}
    for parameter in module.parameters():
        if parameter.is_floating_point():
            counts[parameter.dtype] = counts.get(parameter.dtype, 0) + parameter.numel()
    return max(counts, key=counts.get, default=torch.float32)


def weight_bytes(module: torch.nn.Module) -> int:
    """The bytes of a module's weights in the dtype they are in (a meta-device module's too: nothing is read)."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def numpy_of(tensor: torch.Tensor) -> np.ndarray:
    """A tensor as a CPU numpy array; bfloat16, which numpy has no type for, widened to float32 (a copy)."""
    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array (no copy; bfloat16 has no numpy type and is refused)."""
    if tensor.dtype == torch.bfloat16:
        raise WeightBindingError("bfloat16 weights cannot be handed to the runtimes as numpy arrays.")
    return tensor.numpy()


def with_initializers(model: onnx.ModelProto, names: Iterable[str], location: str = BOUND_LOCATION) -> onnx.ModelProto:
    """A copy of `model` whose weight inputs `names` are initializers stored in `location` (external data
    that is never read: ONNX Runtime's `add_external_initializers` supplies them at session creation)."""
    names = set(names)
    bound = onnx.ModelProto()
    bound.CopyFrom(model)
    inputs = list(bound.graph.input)
    del bound.graph.input[:]
    for value in inputs:
        if value.name not in names:
            bound.graph.input.append(value)
            continue
        tensor = bound.graph.initializer.add()
        tensor.name = value.name
        tensor.data_type = value.type.tensor_type.elem_type
        tensor.dims.extend(d.dim_value for d in value.type.tensor_type.shape.dim)
        tensor.data_location = TensorProto.EXTERNAL
        for key, entry in (("location", location), ("offset", "0"), ("length", "0")):
            item = tensor.external_data.add()
            item.key, item.value = key, entry
    return bound


def save_with_weights(model: onnx.ModelProto, tensors: Mapping[str, torch.Tensor], path: Path, *,
                      external: bool) -> None:
    """Write `model` with `tensors` (graph weights, in the graph's dtypes) as its initializers: a plain ONNX
    file any runtime reads. With `external`, the weights go to `path`.data one tensor at a time (memory stays
    at one tensor; needed past protobuf's 2 GB)."""
    model = with_initializers(model, tensors, location=path.name + ".data")
    by_name = {t.name: t for t in model.graph.initializer}
    if not external:
        for name, tensor in tensors.items():
            proto = by_name[name]
            del proto.external_data[:]
            proto.data_location = TensorProto.DEFAULT
            proto.raw_data = as_numpy(tensor).tobytes()
        onnx.save_model(model, str(path))
        return
    with open(path.parent / (path.name + ".data"), "wb") as data:
        for name, tensor in tensors.items():
            payload = as_numpy(tensor).tobytes()
            offset = data.tell()
            data.write(payload)
            data.write(b"\0" * (-len(payload) % 64))
            entries = {e.key: e for e in by_name[name].external_data}
            entries["offset"].value, entries["length"].value = str(offset), str(len(payload))
    onnx.save_model(model, str(path))


def input_value_info(weight: GraphWeight) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(weight.name, weight.elem_type, list(weight.shape))


# ---- self-contained files: a graph with its weights written in ----------------------------------------

# A protobuf cannot exceed 2 GiB, so larger models keep their weights in a side file.
PROTO_LIMIT = 2 * 1024**3


def onnx_files(path: Path) -> list[Path]:
    """The ONNX file and its external-data side files."""
    files = [path]
    files += sorted(p for p in path.parent.glob(path.name + ".data*") if p.is_file())
    return files


def module_weights(module: torch.nn.Module, graph: onnx.ModelProto, input_names: Iterable[str],
                   component: str) -> dict[str, torch.Tensor]:
    """`module`'s weights for `graph`'s weight inputs (every graph input not in `input_names`), in the graph's
    dtypes."""
    return weights_for(graph_weights(graph, input_names), bindable_tensors(module), component)


def materialize(graph_path: Path, tensors: Mapping[str, torch.Tensor], path: Path) -> Path:
    """A self-contained ONNX file at `path`: the architecture graph at `graph_path` with `tensors` (its weights by
    graph name) as initializers; the weights in `path`.data when they pass protobuf's 2 GB."""
    graph = onnx.load(str(graph_path))
    external = sum(t.numel() * t.element_size() for t in tensors.values()) > PROTO_LIMIT
    path.parent.mkdir(parents=True, exist_ok=True)
    save_with_weights(graph, tensors, path, external=external)
    return path
