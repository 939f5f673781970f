"""Compile a pipeline's components into engines, every artefact through the cache.

Per component: export (ONNX, parity-checked) → optimize (backend's passes, parity re-checked)
→ engine (backend build) → load. Each stage is a cache entry keyed by everything that
changes it, so a second compile reuses all of them. `backend="auto"` picks per component:
on a GPU TensorRT, then ONNX Runtime CUDA; on a CPU whichever of ONNX Runtime and OpenVINO
runs the component faster here, measured once and remembered in the cache.
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import onnx
import onnxruntime
import torch

from .backends import Engine, EngineOptions, cpu_candidates, get_backend, gpu_candidates
from .backends.base import Backend
from .cache import Cache, CacheEntry, file_sha256
from .components import ComponentSpec, Precision, ShapeProfile, component_specs
from .errors import KasokuError
from .export import (
    DEFAULT_EXPORTER,
    DEFAULT_OPSET,
    check_onnx_parity,
    default_check_shapes,
    export_component,
    onnx_files,
)
from .families import family_of
from .optimize import optimize
from .parity import parity_against_torch, raise_on_failure

ONNX_FILE = "model.onnx"
AUTO_REPEATS = 3

StageHook = Callable[[str, str], contextlib.AbstractContextManager]


@dataclass
class StageRecord:
    component: str
    stage: str  # export | optimize | engine | choose
    status: str  # built | reused | rebuilt
    key: str
    seconds: float
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class CompileReport:
    model: str
    precision: str
    profile: dict
    backends: dict[str, str] = field(default_factory=dict)  # component -> backend used
    stages: list[StageRecord] = field(default_factory=list)
    seconds: float = 0.0
    family: str = ""
    precisions: dict[str, str] = field(default_factory=dict)  # component -> precision it was built in
    notes: list[str] = field(default_factory=list)  # what the user should know (a component kept fp32, ...)

    def to_dict(self) -> dict:
        return asdict(self)

    def statuses(self) -> dict[tuple[str, str], str]:
        return {(s.component, s.stage): s.status for s in self.stages}


def _no_hook(component: str, stage: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


class Compiler:
    """Holds the cache, options and hooks for one compile; `compile()` is the entry point."""

    def __init__(
        self,
        cache: Cache,
        *,
        precision: Precision = Precision.FP32,
        exporter: str = DEFAULT_EXPORTER,
        opset: int = DEFAULT_OPSET,
        options: EngineOptions | None = None,
        on_stage: StageHook = _no_hook,
        describe_model: str = "?",
        check_parity: bool = True,
        onnx_dir: Path | None = None,
    ):
        self.cache = cache
        self.precision = Precision(precision)
        self.exporter = exporter
        self.opset = opset
        self.options = options or EngineOptions()
        if self.options.timing_cache_dir is None:
            self.options.timing_cache_dir = cache.root / "tensorrt"
        self.on_stage = on_stage
        self.model = describe_model
        self.check_parity = check_parity
        self.onnx_dir = Path(onnx_dir) if onnx_dir else None
        self.records: list[StageRecord] = []

    # ---- one cache entry per stage -----------------------------------------------------------

    def _stage(self, spec: ComponentSpec, stage: str, parts: dict, build) -> CacheEntry:
        with self.on_stage(spec.name, stage):
            start = time.perf_counter()
            entry = self.cache.get_or_build(parts, build, describe={"model": self.model, "component": spec.name})
            seconds = time.perf_counter() - start
        status = next(event for _kind, key, event in reversed(self.cache.events) if key == entry.key)
        self.records.append(StageRecord(spec.name, stage, status, entry.key, seconds, entry.meta))
        return entry

    def exported(self, spec: ComponentSpec) -> CacheEntry:
        if self.onnx_dir is not None:
            return self.given_onnx(spec)
        parts = {
            "kind": "onnx", "component": spec.name, "weights": spec.fingerprint, "exporter": self.exporter,
            "opset": self.opset, "torch": torch.__version__, "onnx": onnx.__version__,
            "profile": spec.profile.to_dict(),
        }

        def build(tmp: Path) -> dict:
            result = export_component(spec, tmp / ONNX_FILE, exporter=self.exporter, opset=self.opset)
            return {"parity": [p.to_dict() for p in result.parity], "export_seconds": result.seconds}

        return self._stage(spec, "export", parts, build)

    def given_onnx(self, spec: ComponentSpec) -> CacheEntry:
        """An ONNX file the user exported (and maybe edited): keyed by its bytes, not the weights."""
        path = self.onnx_dir / spec.name / ONNX_FILE
        if not path.is_file():
            raise KasokuError(f"{path} does not exist; `kasoku export MODEL {self.onnx_dir}` writes it.")
        files = onnx_files(path)
        parts = {"kind": "onnx-file", "component": spec.name, "files": [file_sha256(f) for f in files]}

        def build(tmp: Path) -> dict:
            for file in files:
                shutil.copy2(file, tmp / file.name)
            return {"source": str(path)}

        return self._stage(spec, "export", parts, build)

    def optimized(self, spec: ComponentSpec, backend: Backend, source: CacheEntry) -> CacheEntry:
        precision = spec.precision_for(self.precision)
        passes = backend.optimization_passes(precision)
        parts = {
            "kind": "optimized", "component": spec.name, "source": source.key, "passes": passes,
            "precision": precision.value, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
        }

        def build(tmp: Path) -> dict:
            report = optimize(source.file(ONNX_FILE), tmp / ONNX_FILE, passes, component=spec.name,
                              precision=precision)
            parity = []
            if self.check_parity:
                parity = check_onnx_parity(spec, tmp / ONNX_FILE, default_check_shapes(spec.profile),
                                           stage="optimization", precision=precision)
            return {"passes": report.to_dict()["passes"], "parity": [p.to_dict() for p in parity]}

        return self._stage(spec, "optimize", parts, build)

    def engine_entry(self, spec: ComponentSpec, backend: Backend, source: CacheEntry) -> CacheEntry:
        precision = spec.precision_for(self.precision)
        parts = {
            "kind": "engine", "component": spec.name, "source": source.key,
            "profile": spec.profile.to_dict(), **backend.key(precision),
        }

        def build(tmp: Path) -> dict:
            meta = backend.build(spec, source.file(ONNX_FILE), tmp, precision) or {}
            if self.check_parity:
                engine = backend.load(spec, tmp, precision)
                meta["parity"] = [p.to_dict() for p in engine_parity(spec, engine, precision)]
            return meta

        return self._stage(spec, "engine", parts, build)

    def engine(self, spec: ComponentSpec, backend_name: str) -> Engine:
        backend = get_backend(backend_name, EngineOptions(**vars(self.options)))
        backend.require()
        if not backend.needs_onnx:
            return backend.load(spec, None, spec.precision_for(self.precision))
        onnx_entry = self.exported(spec)
        optimized = self.optimized(spec, backend, onnx_entry)
        entry = self.engine_entry(spec, backend, optimized)
        return backend.load(spec, entry.path, spec.precision_for(self.precision))

    # ---- backend choice ------------------------------------------------------------------------

    def choose(self, spec: ComponentSpec, backend: str) -> str:
        if backend != "auto":
            return backend
        gpu = gpu_candidates()
        if gpu:
            return gpu[0]
        candidates = cpu_candidates()
        if len(candidates) == 1:
            return candidates[0]
        versions = {name: get_backend(name).availability().version for name in candidates}
        parts = {
            "kind": "auto-choice", "component": spec.name, "weights": spec.fingerprint,
            "profile": spec.profile.to_dict(), "candidates": versions,
            "precision": spec.precision_for(self.precision).value,
            "device": get_backend(candidates[0]).availability().devices, "threads": self.options.threads,
        }

        def build(tmp: Path) -> dict:
            timings = {name: measure(self.engine(spec, name), spec) for name in candidates}
            choice = min(timings, key=timings.get)
            (tmp / "choice.txt").write_text(choice)
            return {"choice": choice, "median_seconds": timings}

        entry = self._stage(spec, "choose", parts, build)
        return entry.meta["choice"]

    def compile(self, specs: dict[str, ComponentSpec], backend: str = "auto") -> tuple[dict[str, Engine], dict]:
        engines, chosen = {}, {}
        for name, spec in specs.items():
            chosen[name] = self.choose(spec, backend)
            engines[name] = self.engine(spec, chosen[name])
        return engines, chosen


def measure(engine: Engine, spec: ComponentSpec, repeats: int = AUTO_REPEATS) -> float:
    """Median seconds of `repeats` runs at the profile's optimum, after one warm-up run."""
    feeds = spec.sample_inputs(spec.profile.opt)
    engine.run(feeds)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.run(feeds)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def engine_parity(spec: ComponentSpec, engine: Engine, precision: Precision) -> list:
    """The built engine against torch at the profile's optimum; raises on mismatch."""
    results = parity_against_torch(spec, engine.run, [spec.profile.opt], precision, seed=2)
    raise_on_failure(results, f"{engine.backend} engine of {spec.name}")
    return results


def compile_components(
    model,
    *,
    backend: str = "auto",
    precision: Precision | str = Precision.FP32,
    profile: ShapeProfile | None = None,
    components: Iterable[str] | None = None,
    cache: Cache | str | Path | None = None,
    exporter: str = DEFAULT_EXPORTER,
    opset: int = DEFAULT_OPSET,
    options: EngineOptions | None = None,
    on_stage: StageHook = _no_hook,
    label: str | None = None,
    check_parity: bool = True,
    onnx_dir: str | Path | None = None,
    specs: dict[str, ComponentSpec] | None = None,
) -> tuple[dict[str, Engine], CompileReport]:
    """Fill the cache for the components of `model` and load their engines.

    `specs` (from `component_specs`) lets a caller that compiles repeatedly reuse them, so the
    weights are fingerprinted once rather than on every call."""
    from .loading import load_pipeline

    start = time.perf_counter()
    pipe = load_pipeline(model)
    specs = specs or component_specs(pipe, profile, components)
    cache = cache if isinstance(cache, Cache) else Cache(cache)
    label = label or (str(model) if isinstance(model, (str, Path)) else type(model).__name__)
    compiler = Compiler(cache, precision=Precision(precision), exporter=exporter, opset=opset, options=options,
                        on_stage=on_stage, describe_model=label, check_parity=check_parity, onnx_dir=onnx_dir)
    engines, chosen = compiler.compile(specs, backend)
    report = CompileReport(
        model=label,
        precision=Precision(precision).value,
        profile=next(iter(specs.values())).profile.to_dict(),
        backends=chosen,
        stages=compiler.records,
        seconds=time.perf_counter() - start,
        family=family_of(pipe).name,
        precisions={name: spec.precision_for(precision).value for name, spec in specs.items()},
        notes=precision_notes(specs, Precision(precision)),
    )
    return engines, report


def precision_notes(specs: dict[str, ComponentSpec], precision: Precision) -> list[str]:
    """One line per component built in another precision than asked, saying why."""
    return [f"{name}: {spec.keep_fp32}." for name, spec in specs.items()
            if spec.precision_for(precision) != precision]
