"""Graph optimization passes over exported ONNX models, composed per backend.

Each pass takes a ModelProto and returns one (so they chain, as onnx-graphsurgeon's do) and
states what holds after it. :func:`optimize` runs a list of passes, reports the node count
before and after each, and re-checks parity with torch on the result.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx
from onnx.external_data_helper import uses_external_data

from .components import ComponentSpec, Precision
from .errors import KasokuError

PROTO_LIMIT = 2 * 1024**3

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


def to_fp16(model: onnx.ModelProto, ctx: PassContext) -> onnx.ModelProto:
    """After: float tensors are fp16 except the component's own inputs and outputs and the component's
    fp32 keep-list (ops known to overflow); weight inputs of an architecture graph are declared fp16, so
    weights are bound in fp16 (the pass re-run on the weights alone: a cast)."""
    if ctx.precision != Precision.FP16:
        return model
    from onnxruntime.transformers.float16 import convert_float_to_float16

    keep = sorted(set(_FP16_ALWAYS_FP32) | set(ctx.fp16_keep_ops))
    keep_io = list(ctx.io_names) if ctx.io_names else True
    return convert_float_to_float16(model, keep_io_types=keep_io, op_block_list=keep, disable_shape_infer=True)


PASSES: dict[str, Callable[[onnx.ModelProto, PassContext], onnx.ModelProto]] = {
    "cleanup": cleanup_toposort,
    "fold_constants": fold_constants,
    "infer_shapes": infer_shapes,
    "ort_fusions": ort_transformer_fusions,
    "fp16": to_fp16,
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
