"""Export components to ONNX, always under :func:`exportable_attention`, and prove parity.

The cache keeps one graph per architecture (:func:`export_graph`): the exported graph with every
weight a named input and no weight data, so any checkpoint of the architecture binds its own weights
to it (:mod:`kasoku.core.weights`). :func:`export_component` writes a self-contained ONNX file (the graph
with the module's weights as initializers) for `kasoku export` and proves parity: ONNX Runtime (CPU)
runs it at two shapes inside its profile and compares with torch; a mismatch over the tolerance fails
the export.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import onnx
import torch
from torch.utils import _pytree as pytree

from .. import __version__
from ..core.attention import exportable_attention
from ..core.components import (
    ComponentSpec,
    ImageShape,
    Precision,
    ShapeProfile,
    export_dims_plan,
    torch_dynamic_shapes,
)
from ..core.console import to_json
from ..core.errors import KasokuError
from ..core.exportable_ops import exportable_ops
from ..core.extras import import_onnxruntime
from ..core.options import DEFAULT_EXPORTER, DEFAULT_OPSET, EXPORTERS
from ..core.parity import OutputParity, parity_against_torch, raise_on_failure
from ..core.weights import (
    PROTO_LIMIT,
    as_numpy,
    base_layers,
    bindable_tensors,
    graph_weights,
    onnx_files,
    save_with_weights,
    with_initializers,
)
from ..core.weights import module_weights as _module_weights
from ..model.pipeline_model import Model
from .onnx_complex import complex_ops_registered

logger = logging.getLogger(__name__)

# Bump when a change here changes the exported graphs: it is part of every export's cache key.
# 3: graphs without weights (weights are named inputs), keyed by architecture.
# 4: traced under exportable_ops (einsum's operands promoted, MoE layers routed in the graph): an export that failed
#    before is tried again.
EXPORT_CODE_VERSION = 4
# A protobuf cannot exceed 2 GiB, so larger models keep their weights in a side file.
EXTERNAL_DATA_THRESHOLD = PROTO_LIMIT


class ExportError(KasokuError, RuntimeError):
    """A component could not be exported to ONNX."""


@dataclass
class ExportedComponent:
    name: str
    path: Path
    exporter: str
    opset: int
    inputs: dict[str, list[int | str]]
    outputs: list[str]
    external_data: bool
    size_bytes: int
    seconds: float
    parity: list[OutputParity] = field(default_factory=list)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["path"] = str(self.path)
        data["parity"] = [p.to_dict() for p in self.parity]
        return data


def default_check_shapes(profile: ShapeProfile) -> list[ImageShape]:
    """Two shapes inside the profile with different resolutions and, where allowed, batch sizes
    (one when the profile is a single shape)."""
    opt, low, high = profile.opt, profile.min, profile.max
    second = ImageShape(batch=min(opt.batch + 1, high.batch), height=low.height, width=low.width)
    if second == opt:
        second = high
    return list(dict.fromkeys([opt, second]))


def _torchscript_dynamic_axes(spec: ComponentSpec) -> dict[str, dict[int, str]]:
    return {t.name: {i: a.name for i, a in t.dynamic_axes.items()} for t in spec.inputs}


@contextlib.contextmanager
def _quiet_exporter():
    """The exporters print progress and warnings meant for their developers, not our users: among them four lines per
    export that torchvision's optional operators are skipped (kasoku exports none). `kasoku -v` shows them."""
    from ..core.console import third_party_logs_shown

    if third_party_logs_shown():
        yield
        return
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        registration.setLevel(level)


def _weights_to_inputs(graph, names: set[str]) -> None:
    """An onnx_ir graph's weight initializers (those in `names`) as graph inputs without data."""
    for name in [n for n in graph.initializers if n in names]:
        value = graph.initializers.pop(name)
        value.const_value = None
        graph.inputs.append(value)


def _keep_small_addends(graph) -> None:
    """Give each tiny nonzero scalar that is added or subtracted (Sana's ``x / (y + 1e-15)``) the shape [1]: the
    ONNX optimizer's no-op rules take a scalar within 1e-8 of 0 for 0 and drop the addition, which turns 0 / 1e-15
    into 0 / 0. Broadcasting makes [1] the same as a scalar against any tensor of rank 1 or more."""
    import onnx_ir as ir

    for node in graph:
        if node.op_type != "Constant" or "value" not in node.attributes:
            continue
        tensor = node.attributes["value"].value
        array = tensor.numpy()
        if array.ndim != 0 or array.dtype.kind != "f" or not 0 < abs(float(array)) < 1e-7:
            continue
        uses = [(user, index) for user, index in node.outputs[0].uses()]
        if all(user.op_type in ("Add", "Sub") and _rank_at_least_one(user.inputs[1 - index]) for user, index in uses):
            node.attributes["value"] = ir.AttrTensor("value", ir.tensor(array.reshape(1)))
            node.outputs[0].shape = ir.Shape([1])


def _rank_at_least_one(value) -> bool:
    return value is not None and value.shape is not None and len(value.shape) >= 1


def _without_noop_squeezes(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """`program` without the squeezes of dimensions that can never be 1 (PixArt's ``squeeze(1)`` of its token
    count): torch leaves such a tensor as it is, but ONNX's Squeeze refuses any dimension that is not 1."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    graph = program.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims):
            continue
        source, dims = node.args[0], node.args[1]
        shape = source.meta["val"].shape
        if all(statically_known_true(shape[d] != 1) for d in ([dims] if isinstance(dims, int) else dims)):
            node.replace_all_uses_with(source)
            graph.erase_node(node)
    program.graph_module.recompile()
    return program


_SUGGESTED_DIM = re.compile(r"^\s*(\w+) = Dim\('\w+'(?:, min=(\d+))?(?:, max=(\d+))?\)", re.M)


def _within_suggested_ranges(spec: ComponentSpec, dynamic: dict, error: Exception) -> dict | None:
    """`dynamic` with its free axes (a prompt's tokens) narrowed to the range torch.export's guards allow, where
    they allow less than the spec's bounds (Gemma 2 branches on its sliding window: at most 4094 tokens; no
    dynamic dimension is 1); None where the error suggests no such range."""
    from torch.export import Dim

    free = {name for name, plan in export_dims_plan(spec).items() if plan[0] == "free"}
    suggested = {m.group(1): m.groups()[1:] for m in _SUGGESTED_DIM.finditer(str(error)) if m.group(1) in free}
    if not suggested:
        return None
    narrowed: dict[str, object] = {}

    def within(dim):
        name = getattr(dim, "__name__", None)
        if name not in suggested:
            return dim
        low, high = suggested[name]
        return narrowed.setdefault(name, Dim(name, min=max(dim.min, int(low or dim.min)),
                                             max=min(dim.max, int(high or dim.max))))

    return pytree.tree_map(within, dynamic)


_FIXED_DIM = re.compile(r"^\s*(\w+) = (\d+)\s*$", re.M)


def _specialized(error: Exception) -> Exception:
    """torch.export's "Constraints violated" where the model's code fixed a dynamic axis at its traced size (Python
    control flow on it: `len(tensor)`, a branch on a padding length), said so in one line; any other error as is."""
    fixed = _FIXED_DIM.findall(str(error))
    if not fixed:
        return error
    sizes = ", ".join(f"{name} at {size}" for name, size in fixed)
    return ValueError(f"the model's code fixes {sizes}, the size it was traced at (it branches on it in Python), so "
                      "no graph takes every size of it")


def _export_graph_to_file(spec: ComponentSpec, path: Path, exporter: str, opset: int, weights: set[str]) -> None:
    """The graph with `weights` as named inputs. The dynamo exporter runs without its optimizer, which
    would fold weights into new, unnamed constants (transposed projections, reshaped norms); its optimizer
    runs afterwards on the graph whose weights are inputs, so it folds only what no weight feeds."""
    example = spec.sample_inputs(spec.trace_shape())
    args = tuple(example[name] for name in spec.input_names)
    common = dict(input_names=list(spec.input_names), output_names=list(spec.output_names), opset_version=opset)
    with exportable_attention(), exportable_ops(), torch.no_grad(), _quiet_exporter():
        if exporter == "dynamo":
            dynamic = torch_dynamic_shapes(spec)

            def converted(module):
                with complex_ops_registered():
                    return torch.onnx.export(module, args, dynamo=True, dynamic_shapes=dynamic, verbose=False,
                                             optimize=False, **common)

            def captured():
                # torch.export's non-strict capture reasons through symbolic sizes where the ONNX exporter's own
                # capture can fail (PixArt's positional embedding); its program converts as it is, less the
                # squeezes ONNX cannot take
                try:
                    program = torch.export.export(spec.module, args, dynamic_shapes=dynamic, strict=False)
                except torch._dynamo.exc.UserError as error:
                    narrowed = _within_suggested_ranges(spec, dynamic, error)
                    if narrowed is None:
                        raise _specialized(error) from error
                    program = torch.export.export(spec.module, args, dynamic_shapes=narrowed, strict=False)
                return _without_noop_squeezes(program)

            # a recorded graph is always captured so; a hand-written one only where the exporter's capture fails
            recorded = spec.graph_kind == "recorded"
            try:
                program = converted(captured() if recorded else spec.module)
            except torch.onnx.errors.OnnxExporterError:
                if recorded:
                    raise
                program = converted(captured())
            _weights_to_inputs(program.model.graph, weights)
            _keep_small_addends(program.model.graph)
            program.optimize()
            program.save(str(path), external_data=False)
            return
        torch.onnx.export(spec.module, args, str(path), dynamo=False, do_constant_folding=False,
                          keep_initializers_as_inputs=True, dynamic_axes=_torchscript_dynamic_axes(spec), **common)
    model = onnx.load(str(path), load_external_data=False)
    kept = [t for t in model.graph.initializer if t.name not in weights]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    for side_file in onnx_files(path)[1:]:
        side_file.unlink()
    onnx.save_model(model, str(path))


@dataclass
class ExportedGraph:
    """An architecture graph: weights are named inputs (`weights`: how many), no weight data."""

    path: Path
    weights: int
    size_bytes: int
    seconds: float


def export_graph(spec: ComponentSpec, path: str | Path, *, exporter: str = DEFAULT_EXPORTER,
                 opset: int = DEFAULT_OPSET) -> ExportedGraph:
    """Export the architecture graph of `spec` to `path`: every weight a graph input named as in the
    module's state dict, no weight data (a PEFT-wrapped module exports as its base architecture). Every
    weight input must be a tensor of the module; anything else in the graph is independent of the weights."""
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter must be one of {EXPORTERS} but is {exporter!r}.")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with base_layers(spec.module):
        names = set(bindable_tensors(spec.module))
        try:
            _export_graph_to_file(spec, path, exporter, opset, names)
        except Exception as error:  # the exporters raise many kinds; name the component
            raise ExportError(f"exporting {spec.name} with the {exporter} exporter failed: {error}") from error
    model = onnx.load(str(path))
    for node in model.graph.node:  # the exporter's debugging notes (stack traces, FX nodes): most of the file
        del node.metadata_props[:]
    onnx.save_model(model, str(path))
    onnx.checker.check_model(model)
    strangers = [name for name in graph_weights(model, spec.input_names) if name not in names]
    if strangers:
        raise ExportError(f"the {exporter} exporter gave {spec.name} graph inputs that are not weights of the "
                          f"module: {', '.join(strangers[:5])}; weights cannot be bound to this graph by name.")
    return ExportedGraph(path, len(graph_weights(model, spec.input_names)), path.stat().st_size,
                         time.perf_counter() - start)


def module_weights(spec: ComponentSpec, graph: onnx.ModelProto) -> dict[str, torch.Tensor]:
    """The module's weights for `graph`'s weight inputs, in the graph's dtypes (the module is loaded)."""
    return _module_weights(spec.module, graph, spec.input_names, spec.name)


def ort_session(path: Path, threads: int | None = None, weights: dict[str, torch.Tensor] | None = None):
    """An ONNX Runtime CPU session of an ONNX file; of an architecture graph with `weights` bound as
    initializers at session creation (the session keeps them alive)."""
    ort = import_onnxruntime()
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    model = str(path)
    values = []
    if weights:
        model = with_initializers(onnx.load(str(path)), weights).SerializeToString()
        values = [ort.OrtValue.ortvalue_from_numpy(as_numpy(t)) for t in weights.values()]
        options.add_external_initializers(list(weights), values)
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    session.kasoku_weights = (weights, values)  # ONNX Runtime reads the caller's memory: it must outlive the session
    return session


def check_onnx_parity(
    spec: ComponentSpec,
    path: Path,
    shapes: Sequence[ImageShape],
    *,
    session=None,
    stage: str = "export",
    precision: Precision = Precision.FP32,
    weights: dict[str, torch.Tensor] | None = None,
) -> list[OutputParity]:
    """Run the ONNX file (an architecture graph with `weights` bound) in ONNX Runtime at each shape and
    compare with torch; raise on mismatch."""
    session = session or ort_session(path, weights=weights)

    def run(feeds):
        arrays = {name: value.numpy() if isinstance(value, torch.Tensor) else value for name, value in feeds.items()}
        return dict(zip(spec.output_names, session.run(list(spec.output_names), arrays)))

    results = parity_against_torch(spec, run, shapes, precision, seed=1)
    raise_on_failure(results, f"{stage} of {spec.name}")
    return results


def export_component(
    spec: ComponentSpec,
    path: str | Path,
    *,
    exporter: str = DEFAULT_EXPORTER,
    opset: int = DEFAULT_OPSET,
    check_shapes: Sequence[ImageShape] | None = None,
    external_data_threshold: int = EXTERNAL_DATA_THRESHOLD,
) -> ExportedComponent:
    """Export one component to a self-contained ONNX file at `path` (its architecture graph with the
    module's weights as initializers), run onnx.checker on it and prove parity with torch."""
    path = Path(path)
    start = time.perf_counter()
    graph_path = path.with_name(path.stem + ".graph.onnx")
    try:
        export_graph(spec, graph_path, exporter=exporter, opset=opset)
        graph = onnx.load(str(graph_path))
    finally:
        graph_path.unlink(missing_ok=True)
    tensors = module_weights(spec, graph)
    external = sum(t.numel() * t.element_size() for t in tensors.values()) > external_data_threshold
    save_with_weights(graph, tensors, path, external=external)
    onnx.checker.check_model(str(path))
    # None: the profile's default shapes; an empty list: no check (the caller compares elsewhere)
    shapes = default_check_shapes(spec.profile) if check_shapes is None else check_shapes
    parity = check_onnx_parity(spec, path, shapes) if shapes else []
    seconds = time.perf_counter() - start
    return ExportedComponent(
        name=spec.name,
        path=path,
        exporter=exporter,
        opset=opset,
        inputs={t.name: [d if isinstance(d, int) else d.name for d in t.dims] for t in spec.inputs},
        outputs=list(spec.output_names),
        external_data=external,
        size_bytes=sum(f.stat().st_size for f in onnx_files(path)),
        seconds=seconds,
        parity=parity,
    )


def versions() -> dict[str, str]:
    import diffusers
    import transformers

    onnxruntime = import_onnxruntime()
    return {
        "kasoku": __version__,
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
    }


@dataclass
class ExportManifest:
    model: str
    profile: dict
    exporter: str
    opset: int
    versions: dict[str, str]
    components: list[ExportedComponent]

    def to_dict(self) -> dict:
        data = asdict(self)
        data["components"] = [c.to_dict() for c in self.components]
        return data


def export_pipeline(
    model,
    outdir: str | Path,
    *,
    components: Iterable[str] | None = None,
    exporter: str = DEFAULT_EXPORTER,
    opset: int = DEFAULT_OPSET,
    profile: ShapeProfile | None = None,
    on_component=None,
    controlnet=None,
) -> ExportManifest:
    """Export the components of a diffusers pipeline (with `controlnet`: its ControlNet pipeline's) into
    `outdir` with a manifest.json."""
    specs = Model.load(model, controlnet=controlnet).specs(profile, components)
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    exported = []
    for spec in specs.values():
        if on_component:
            on_component(spec.name)
        exported.append(export_component(spec, outdir / spec.name / "model.onnx", exporter=exporter, opset=opset))
    manifest = ExportManifest(
        model=str(model) if not hasattr(model, "config") else type(model).__name__,
        profile=next(iter(specs.values())).profile.to_dict(),
        exporter=exporter,
        opset=opset,
        versions=versions(),
        components=exported,
    )
    (outdir / "manifest.json").write_text(to_json(manifest, indent=2))
    return manifest
