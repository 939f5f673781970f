"""Export components to ONNX, always under :func:`exportable_attention`, and prove parity.

Right after a component is written, ONNX Runtime (CPU) runs it at two shapes inside its
profile and compares with torch; a mismatch over the tolerance fails the export.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import onnx
import torch

from . import __version__
from .attention import exportable_attention
from .components import ComponentSpec, ImageShape, Precision, ShapeProfile, component_specs
from .errors import KasokuError
from .options import DEFAULT_EXPORTER, DEFAULT_OPSET, EXPORTERS
from .parity import OutputParity, parity_against_torch, raise_on_failure

logger = logging.getLogger(__name__)

# Bump when a change here changes the exported graphs: it is part of every export's cache key.
EXPORT_CODE_VERSION = 2
# A protobuf cannot exceed 2 GiB, so larger models keep their weights in a side file.
EXTERNAL_DATA_THRESHOLD = 2 * 1024**3


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


def _export_shape(profile: ShapeProfile) -> ImageShape:
    # Export traces at the optimum, but with every dynamic size >= 2: torch.export specializes
    # sizes 0 and 1, which would freeze the batch.
    opt, high = profile.opt, profile.max
    return ImageShape(batch=min(max(2, opt.batch), high.batch), height=opt.height, width=opt.width)


def _parameter_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.state_dict().values())


def _dynamo_dynamic_shapes(spec: ComponentSpec) -> dict[str, dict[int, object]]:
    from torch.export import Dim

    dims: dict[str, object] = {}
    for name, (_axis, rng) in spec.axes().items():
        if rng.min == rng.max:
            continue
        if rng.step > 1:
            base = Dim(f"{name}_div{rng.step}", min=math.ceil(rng.min / rng.step), max=rng.max // rng.step)
            dims[name] = rng.step * base
        else:
            dims[name] = Dim(name, min=rng.min, max=rng.max)
    return {
        t.name: {i: dims[a.name] for i, a in t.dynamic_axes.items() if a.name in dims}
        for t in spec.inputs
    }


def _torchscript_dynamic_axes(spec: ComponentSpec) -> dict[str, dict[int, str]]:
    return {t.name: {i: a.name for i, a in t.dynamic_axes.items()} for t in spec.inputs}


@contextlib.contextmanager
def _quiet_exporter():
    """The exporters print progress and warnings meant for their developers, not our users."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def _export_to_file(
    spec: ComponentSpec, path: Path, exporter: str, opset: int, external_data: bool
) -> None:
    example = spec.sample_inputs(_export_shape(spec.profile))
    args = tuple(example[name] for name in spec.input_names)
    common = dict(input_names=list(spec.input_names), output_names=list(spec.output_names), opset_version=opset)
    with exportable_attention(), torch.no_grad(), _quiet_exporter():
        if exporter == "dynamo":
            program = torch.onnx.export(
                spec.module, args, dynamo=True, dynamic_shapes=_dynamo_dynamic_shapes(spec), verbose=False, **common
            )
            program.save(str(path), external_data=external_data)
        else:
            torch.onnx.export(
                spec.module, args, str(path), dynamo=False, dynamic_axes=_torchscript_dynamic_axes(spec), **common
            )
            if external_data:
                _move_weights_to_external_data(path)


def _move_weights_to_external_data(path: Path) -> None:
    model = onnx.load(str(path))
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=path.name + ".data",
        size_threshold=1024,
    )


def onnx_files(path: Path) -> list[Path]:
    """The ONNX file and its external-data side files."""
    files = [path]
    files += sorted(p for p in path.parent.glob(path.name + ".data*") if p.is_file())
    return files


def ort_session(path: Path, threads: int | None = None):
    from .extras import import_onnxruntime

    ort = import_onnxruntime()
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def check_onnx_parity(
    spec: ComponentSpec,
    path: Path,
    shapes: Sequence[ImageShape],
    *,
    session=None,
    stage: str = "export",
    precision: Precision = Precision.FP32,
) -> list[OutputParity]:
    """Run the ONNX file in ONNX Runtime at each shape and compare with torch; raise on mismatch."""
    session = session or ort_session(path)

    def run(feeds):
        return dict(zip(spec.output_names, session.run(list(spec.output_names), feeds)))

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
    """Export one component to `path`, run onnx.checker on it and prove parity with torch."""
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter must be one of {EXPORTERS} but is {exporter!r}.")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    external = _parameter_bytes(spec.module) > external_data_threshold
    start = time.perf_counter()
    try:
        _export_to_file(spec, path, exporter, opset, external)
    except Exception as error:  # the exporters raise many kinds; name the component
        raise ExportError(f"exporting {spec.name} with the {exporter} exporter failed: {error}") from error
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

    from .extras import import_onnxruntime

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
) -> ExportManifest:
    """Export the components of a diffusers pipeline into `outdir` with a manifest.json."""
    from .loading import load_pipeline

    pipe = load_pipeline(model)
    specs = component_specs(pipe, profile, components)
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
    (outdir / "manifest.json").write_text(json.dumps(manifest.to_dict(), indent=2))
    return manifest
