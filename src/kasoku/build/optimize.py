"""Graph optimization passes over exported ONNX models, composed per backend.

Each pass takes a ModelProto and returns one (so they chain, as onnx-graphsurgeon's do) and
states what holds after it. :func:`optimize` runs a list of passes, reports the node count
before and after each, and re-checks parity with torch on the result.
"""

from __future__ import annotations

import heapq
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
from onnx.external_data_helper import uses_external_data

from ..core.components import ComponentSpec, Precision
from ..core.errors import KasokuError
from ..core.extras import import_onnxruntime
from ..core.weights import PROTO_LIMIT

# Ops kept in fp32 in every fp16 graph; each component's spec adds its own (the VAE's
# normalization and upsampling activations exceed fp16's range on real weights).
_FP16_ALWAYS_FP32 = ["Softmax", "LayerNormalization"]


class OptimizationError(KasokuError):
    """A graph pass failed."""


@dataclass
class PassContext:
    component: str
    precision: Precision = Precision.FP32
    graph_kind: str = ""  # ONNX Runtime's transformer optimizer's name for the graph: clip, unet, vae
    fp16_keep_ops: tuple[str, ...] = ()  # the component's ops that stay fp32 in an fp16 graph
    io_names: tuple[str, ...] = ()  # the component's own inputs and outputs (other graph inputs are weights)

    @classmethod
    def of(cls, spec: ComponentSpec, precision: Precision) -> PassContext:
        return cls(spec.name, Precision(precision), spec.graph_kind, spec.fp16_keep_ops,
                   (*spec.input_names, *spec.output_names))


@dataclass
class PassReport:
    name: str
    nodes_before: int
    nodes_after: int
    seconds: float


@dataclass
class OptimizeReport:
    component: str
    passes: list[PassReport] = field(default_factory=list)

    @property
    def nodes_before(self) -> int:
        return self.passes[0].nodes_before if self.passes else 0

    @property
    def nodes_after(self) -> int:
        return self.passes[-1].nodes_after if self.passes else 0

    def to_dict(self) -> dict:
        return {"component": self.component, "passes": [asdict(p) for p in self.passes]}


# ---- passes ----------------------------------------------------------------------------------


def cleanup_toposort(model: onnx.ModelProto, ctx: PassContext) -> onnx.ModelProto:
    """After: no node whose outputs are unused, nodes in topological order (onnx-graphsurgeon)."""
    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(model)
    graph.cleanup().toposort()
    return gs.export_onnx(graph)


def fold_constants(model: onnx.ModelProto, ctx: PassContext) -> onnx.ModelProto:
    """After: every subgraph computable from initializers alone is one initializer
    (onnx-graphsurgeon's folding, evaluated with ONNX Runtime), dead nodes removed."""
    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(model)
    graph.fold_constants(error_ok=True).cleanup().toposort()
    return gs.export_onnx(graph)


def infer_shapes(model: onnx.ModelProto, ctx: PassContext) -> onnx.ModelProto:
    """After: value_info carries the shapes ONNX can infer (through a file for models over 2 GB)."""
    if _initializer_bytes(model) < PROTO_LIMIT:
        return onnx.shape_inference.infer_shapes(model)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        save_model(model, path)
        onnx.shape_inference.infer_shapes_path(str(path), str(path))
        return onnx.load(str(path))


def ort_transformer_fusions(model: onnx.ModelProto, ctx: PassContext) -> onnx.ModelProto:
    """After: attention, LayerNorm and GELU subgraphs are ONNX Runtime contrib ops (CPU-capable
    fusions only). The result runs only in ONNX Runtime."""
    import_onnxruntime()  # a clear error naming the extras when neither is installed
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    if not ctx.graph_kind:
        raise OptimizationError(f"ONNX Runtime's fusions do not know the {ctx.component} graph.")
    model_type = ctx.graph_kind
    options = FusionOptions(model_type)
    # GroupNorm, NHWC conv, BiasSplitGelu and BiasAdd fusions produce CUDA-only kernels.
    for flag in ("enable_group_norm", "enable_skip_group_norm", "enable_nhwc_conv", "enable_bias_splitgelu",
                 "enable_bias_add", "enable_packed_kv", "enable_packed_qkv"):
        if hasattr(options, flag):
            setattr(options, flag, False)
    optimized = optimize_model(model, model_type=model_type, num_heads=0, hidden_size=0,
                               optimization_options=options, opt_level=0)
    return optimized.model


def _to_half_types(model: onnx.ModelProto, ctx: PassContext) -> onnx.ModelProto:
    """ONNX Runtime's float16 converter: float tensors fp16 except the component's own inputs and outputs and
    the keep-list; weight inputs of an architecture graph are declared fp16, so weights are bound in fp16 (the
    pass re-run on the weights alone: a cast)."""
    import_onnxruntime()  # a clear error naming the extras when neither is installed
    from onnxruntime.transformers.float16 import convert_float_to_float16

    keep = sorted(set(_FP16_ALWAYS_FP32) | set(ctx.fp16_keep_ops))
    keep_io = list(ctx.io_names) if ctx.io_names else True
    model = convert_float_to_float16(model, keep_io_types=keep_io, op_block_list=keep, disable_shape_infer=True)
    toposort(model.graph)  # the converter appends its input casts last; TensorRT's parser reads nodes in order
    return model


def toposort(graph: onnx.GraphProto) -> None:
    """Order `graph`'s nodes so that each comes after the nodes whose outputs it reads (Kahn's algorithm,
    keeping the given order where it is free), in place and without touching any weight."""
    nodes = list(graph.node)
    producer = {name: i for i, node in enumerate(nodes) for name in node.output if name}
    users: dict[int, list[int]] = {}
    waiting = []
    for i, node in enumerate(nodes):
        needs = {producer[name] for name in node.input if name in producer and producer[name] != i}
        for j in needs:
            users.setdefault(j, []).append(i)
        waiting.append(len(needs))
    ready = [i for i, count in enumerate(waiting) if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for user in users.get(i, ()):
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, user)
    if len(order) != len(nodes):
        raise OptimizationError(f"the graph {graph.name!r} has a cycle: {len(nodes) - len(order)} nodes wait on "
                                "each other.")
    del graph.node[:]
    graph.node.extend(nodes[i] for i in order)


def _load_float_weights(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    """Float weights still in their file (graph-only models over 2 GB) read into memory: the converter
    needs their values (it cannot read an absolute external location, and would retype a weight it has not
    read). Returns each one's file reference (no data), by name: the fp32 bytes stay readable there."""
    references = {}
    for tensor in model.graph.initializer:
        if tensor.data_type == onnx.TensorProto.FLOAT and uses_external_data(tensor):
            reference = onnx.TensorProto()
            reference.CopyFrom(tensor)
            references[tensor.name] = reference
            _set_raw(tensor, onnx.TensorProto.FLOAT, _read_external(tensor))
    return references


def _external_fp32(tensor: onnx.TensorProto) -> np.ndarray:
    """The fp32 values of a weight in its file."""
    return np.frombuffer(_read_external(tensor), dtype=np.float32)


def _set_raw(tensor: onnx.TensorProto, data_type: int, payload: bytes) -> None:
    """`tensor` holds `payload` in memory as `data_type` (no longer in a side file)."""
    tensor.data_type = data_type
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.DEFAULT
    del tensor.float_data[:]
    del tensor.int32_data[:]
    tensor.raw_data = payload


def to_fp16(model: onnx.ModelProto, ctx: PassContext) -> onnx.ModelProto:
    """After: float tensors are fp16 except the component's own inputs/outputs and the component's fp32
    keep-list (ops known to overflow); in graph-only models over 2 GB too (their weights are then held
    in memory, in fp16, until saved)."""
    if ctx.precision != Precision.FP16:
        return model
    _load_float_weights(model)
    return _to_half_types(model, ctx)


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """fp32 values rounded to bfloat16 (to nearest, ties to even; NaN stays NaN), as uint16 bit patterns."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)


def _to_bf16_tensor(tensor: onnx.TensorProto, fp32: np.ndarray | None) -> None:
    """An fp16-typed tensor becomes bf16, from its fp32 values where known (no rounding through fp16)."""
    if fp32 is None:
        fp32 = onnx.numpy_helper.to_array(tensor).astype(np.float32).ravel()
    _set_raw(tensor, onnx.TensorProto.BFLOAT16, bf16_bits(fp32).tobytes())


def _retype_value(type_proto: onnx.TypeProto) -> None:
    kind = type_proto.WhichOneof("value")
    if kind == "tensor_type" and type_proto.tensor_type.elem_type == onnx.TensorProto.FLOAT16:
        type_proto.tensor_type.elem_type = onnx.TensorProto.BFLOAT16
    elif kind in ("sequence_type", "optional_type"):
        _retype_value(getattr(type_proto, kind).elem_type)


class _Fp32Weights(dict):
    """fp32 values by name: those kept from memory, else read from their file when asked."""

    def __init__(self, in_memory: dict[str, np.ndarray], in_file: dict[str, onnx.TensorProto]):
        super().__init__(in_memory)
        self.in_file = in_file

    def get(self, name, default=None):
        if name in self:
            return self[name]
        return _external_fp32(self.in_file[name]) if name in self.in_file else default


def _retype_fp16_graph(graph: onnx.GraphProto, weights: dict[str, np.ndarray],
                       constants: dict[str, np.ndarray]) -> None:
    """Every fp16 type, weight, constant and cast target in `graph` (and its subgraphs) becomes bf16."""
    for tensor in graph.initializer:
        if tensor.data_type == onnx.TensorProto.FLOAT16:
            _to_bf16_tensor(tensor, weights.get(tensor.name))
    for value in (*graph.input, *graph.output, *graph.value_info):
        _retype_value(value.type)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == onnx.TensorProto.FLOAT16:
                _to_bf16_tensor(attr.t, constants.get(node.output[0]) if node.op_type == "Constant" else None)
            elif attr.type == onnx.AttributeProto.INT and attr.name in ("to", "dtype") \
                    and attr.i == onnx.TensorProto.FLOAT16:
                attr.i = onnx.TensorProto.BFLOAT16
            elif attr.type == onnx.AttributeProto.GRAPH:
                _retype_fp16_graph(attr.g, weights, constants)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    _retype_fp16_graph(sub, weights, constants)


def to_bf16(model: onnx.ModelProto, ctx: PassContext) -> onnx.ModelProto:
    """After: the fp16 pass's graph in bfloat16: float tensors are bf16 except graph inputs/outputs and
    the same fp32 keep-list; weights and constants are rounded from their fp32 values (not through fp16,
    whose range clamps). For TensorRT's strongly typed networks (ONNX Runtime's CPU kernels have no bf16)."""
    if ctx.precision != Precision.BF16:
        return model
    in_memory = {t.name: onnx.numpy_helper.to_array(t).astype(np.float32).ravel() for t in model.graph.initializer
                 if t.data_type == onnx.TensorProto.FLOAT and not uses_external_data(t)}
    in_file = _load_float_weights(model)
    weights = _Fp32Weights(in_memory, in_file)
    constants = {node.output[0]: onnx.numpy_helper.to_array(attr.t).astype(np.float32).ravel()
                 for node in model.graph.node if node.op_type == "Constant"
                 for attr in node.attribute if attr.name == "value" and attr.t.data_type == onnx.TensorProto.FLOAT}
    model = _to_half_types(model, ctx)
    _retype_fp16_graph(model.graph, weights, constants)
    return model


PASSES: dict[str, Callable[[onnx.ModelProto, PassContext], onnx.ModelProto]] = {
    "cleanup": cleanup_toposort,
    "fold_constants": fold_constants,
    "infer_shapes": infer_shapes,
    "ort_fusions": ort_transformer_fusions,
    "fp16": to_fp16,
    "bf16": to_bf16,
}


# ---- running passes --------------------------------------------------------------------------


def _initializer_bytes(model: onnx.ModelProto) -> int:
    return sum(len(t.raw_data) for t in model.graph.initializer)


def save_model(model: onnx.ModelProto, path: Path) -> None:
    """Save, with weights in a side file when the protobuf would pass 2 GB or already has one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if any(uses_external_data(t) for t in model.graph.initializer):
        _save_streaming(model, path)
    elif _initializer_bytes(model) >= PROTO_LIMIT:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data", size_threshold=1024)
    else:
        onnx.save_model(model, str(path))


def _read_external(tensor: onnx.TensorProto) -> bytes:
    info = {entry.key: entry.value for entry in tensor.external_data}
    with open(info["location"], "rb") as source:
        source.seek(int(info.get("offset", 0)))
        return source.read(int(info["length"])) if "length" in info else source.read()


def _save_streaming(model: onnx.ModelProto, path: Path) -> None:
    """Write every weight into `path`.data one tensor at a time: weights still in the source file
    (graph-only mode, absolute locations) are copied from it, new ones (folded, converted) come
    from memory. Memory stays at one tensor, whatever the model's size."""
    location = path.name + ".data"
    with open(path.parent / location, "wb") as data:
        for tensor in model.graph.initializer:
            if uses_external_data(tensor):
                payload = _read_external(tensor)
            elif len(tensor.raw_data) >= 1024:
                payload, tensor.raw_data = tensor.raw_data, b""
            else:
                continue
            offset = data.tell()
            data.write(payload)
            data.write(b"\0" * (-len(payload) % 64))  # aligned, as onnx writes them
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", location), ("offset", str(offset)), ("length", str(len(payload)))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
    onnx.save_model(model, str(path))


def load_graph(source: Path) -> onnx.ModelProto:
    """The model with its weights in memory when they fit a protobuf; over 2 GB, the graph only:
    weights stay in their file, referenced by absolute path so that a pass can still read one
    tensor when it needs its values, and are copied tensor by tensor when saved."""
    model = onnx.load(str(source), load_external_data=False)
    external = [t for t in model.graph.initializer if uses_external_data(t)]
    if not external:
        return model
    if sum(int({e.key: e.value for e in t.external_data}.get("length", 0)) for t in external) < PROTO_LIMIT:
        return onnx.load(str(source))
    for tensor in external:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = str((source.parent / entry.value).resolve())
    return model


def optimize(
    source: Path,
    target: Path,
    passes: Sequence[str],
    *,
    spec: ComponentSpec,
    precision: Precision = Precision.FP32,
) -> OptimizeReport:
    """Run `passes` in order on the ONNX file `source` of the component `spec` and write the result
    to `target`."""
    unknown = [p for p in passes if p not in PASSES]
    if unknown:
        raise ValueError(f"unknown pass(es) {unknown}; known passes: {list(PASSES)}.")
    ctx = PassContext.of(spec, precision)
    component = spec.name
    model = load_graph(Path(source))
    report = OptimizeReport(component=component)
    for name in passes:
        before = len(model.graph.node)
        start = time.perf_counter()
        try:
            model = PASSES[name](model, ctx)
        except Exception as error:  # passes call into several libraries; name the pass
            raise OptimizationError(f"the {name} pass failed on {component}: {error}") from error
        report.passes.append(PassReport(name, before, len(model.graph.node), time.perf_counter() - start))
    save_model(model, target)
    return report
