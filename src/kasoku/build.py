"""Compile a pipeline's components into engines, every artefact through the cache.

Per component: export (ONNX, parity-checked) → optimize (backend's passes, parity re-checked)
→ engine (backend build) → load. Each stage is a cache entry keyed by everything that changes
it. The keys are computed, not walked: the engine's key is derived from the export's and the
optimization's key parts without opening those entries, so a warm start opens only the final
engine entry, checks its manifest cheaply and loads it (what the runtime's own load costs).
Only a miss walks the chain, building what is missing.

`auto` picks per component: on a GPU TensorRT, then ONNX Runtime CUDA; on a CPU whichever of
ONNX Runtime and OpenVINO runs the component faster here. The choice is measured once per
architecture, profile, precision and machine (not per thread count or weights) and recorded in
the cache; `CompileReport.backends` says what `auto` resolved to, and passing that mapping back
as the backend builds exactly the same engines (what `kasoku batch` hands its workers).
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import onnx
import onnxruntime
import torch

from .backends import Engine, cpu_candidates, get_backend, gpu_candidates
from .backends.base import Backend, cpu_name
from .cache import Cache, CacheEntry, default_cache_dir, digest_key, file_sha256
from .components import ComponentSpec, Precision, component_specs
from .errors import KasokuError
from .export import EXPORT_CODE_VERSION, check_onnx_parity, default_check_shapes, export_component, onnx_files
from .families import family_of
from .fingerprint import WeightsFingerprints
from .optimize import optimize
from .options import CompileOptions
from .parity import parity_against_torch, raise_on_failure

ONNX_FILE = "model.onnx"
AUTO_REPEATS = 3

StageHook = Callable[[str, str], contextlib.AbstractContextManager]


class EngineLoadError(KasokuError):
    """A cached engine that its runtime cannot load although its files are intact."""


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
    load_seconds: dict[str, float] = field(default_factory=dict)  # component -> the runtime's load of its engine

    def to_dict(self) -> dict:
        return asdict(self)

    def statuses(self) -> dict[tuple[str, str], str]:
        return {(s.component, s.stage): s.status for s in self.stages}

    @property
    def built(self) -> int:
        return sum(s.status != "reused" for s in self.stages)


def _no_hook(component: str, stage: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _versions() -> dict[str, str]:
    import diffusers
    import transformers

    return {"torch": torch.__version__, "diffusers": diffusers.__version__, "transformers": transformers.__version__,
            "onnx": onnx.__version__, "kasoku_export": EXPORT_CODE_VERSION}


class Compiler:
    """One compile: the cache, the options and the hooks; :meth:`compile` is the entry point."""

    def __init__(self, cache: Cache, options: CompileOptions, *, on_stage: StageHook = _no_hook, label: str = "?"):
        self.cache = cache
        self.options = options
        self.on_stage = on_stage
        self.model = label
        self.records: list[StageRecord] = []
        self.load_seconds: dict[str, float] = {}

    # ---- key parts, computed without opening any entry --------------------------------------

    def export_parts(self, spec: ComponentSpec) -> dict[str, Any]:
        if self.options.onnx_dir is not None:
            files = onnx_files(self._given_onnx(spec))
            return {"kind": "onnx-file", "component": spec.name, "files": [file_sha256(f) for f in files]}
        return {"kind": "onnx", "component": spec.name, "weights": spec.fingerprint, "exporter": self.options.exporter,
                "opset": self.options.opset, "profile": spec.profile.to_dict(), **_versions()}

    def optimized_parts(self, spec: ComponentSpec, backend: Backend, source: str) -> dict[str, Any]:
        precision = spec.precision_for(self.options.precision)
        return {"kind": "optimized", "component": spec.name, "source": source,
                "passes": backend.optimization_passes(precision), "precision": precision.value,
                "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}

    def engine_parts(self, spec: ComponentSpec, backend: Backend, source: str) -> dict[str, Any]:
        precision = spec.precision_for(self.options.precision)
        return {"kind": "engine", "component": spec.name, "source": source, "profile": spec.profile.to_dict(),
                **backend.key(precision)}

    # ---- stages ------------------------------------------------------------------------------

    def _record(self, spec: ComponentSpec, stage: str, status: str, entry: CacheEntry, seconds: float) -> None:
        self.records.append(StageRecord(spec.name, stage, status, entry.key, seconds, entry.meta))

    def _stage(self, spec: ComponentSpec, stage: str, parts: dict, build) -> CacheEntry:
        with self.on_stage(spec.name, stage):
            start = time.perf_counter()
            entry = self.cache.get_or_build(parts, build, describe={"model": self.model, "component": spec.name})
            seconds = time.perf_counter() - start
        status = next(event for _kind, key, event in reversed(self.cache.events) if key == entry.key)
        self._record(spec, stage, status, entry, seconds)
        return entry

    def _given_onnx(self, spec: ComponentSpec) -> Path:
        path = self.options.onnx_dir / spec.name / ONNX_FILE
        if not path.is_file():
            raise KasokuError(f"{path} does not exist; `kasoku export MODEL {self.options.onnx_dir}` writes it.")
        return path

    def exported(self, spec: ComponentSpec, parts: dict) -> CacheEntry:
        if self.options.onnx_dir is not None:
            path = self._given_onnx(spec)

            def copy(tmp: Path) -> dict:  # an ONNX file the user exported (and maybe edited), keyed by its bytes
                for file in onnx_files(path):
                    shutil.copy2(file, tmp / file.name)
                return {"source": str(path)}

            return self._stage(spec, "export", parts, copy)

        def build(tmp: Path) -> dict:
            shapes = None if self.options.check_parity else []
            result = export_component(spec, tmp / ONNX_FILE, exporter=self.options.exporter, opset=self.options.opset,
                                      check_shapes=shapes)
            return {"parity": [p.to_dict() for p in result.parity], "export_seconds": result.seconds}

        return self._stage(spec, "export", parts, build)

    def optimized(self, spec: ComponentSpec, parts: dict, source: CacheEntry) -> CacheEntry:
        precision = spec.precision_for(self.options.precision)

        def build(tmp: Path) -> dict:
            report = optimize(source.file(ONNX_FILE), tmp / ONNX_FILE, parts["passes"], spec=spec,
                              precision=precision)
            parity = []
            if self.options.check_parity:
                parity = check_onnx_parity(spec, tmp / ONNX_FILE, default_check_shapes(spec.profile),
                                           stage="optimization", precision=precision)
            return {"passes": report.to_dict()["passes"], "parity": [p.to_dict() for p in parity]}

        return self._stage(spec, "optimize", parts, build)

    def built_engine(self, spec: ComponentSpec, backend: Backend, parts: dict, source: CacheEntry) -> CacheEntry:
        precision = spec.precision_for(self.options.precision)

        def build(tmp: Path) -> dict:
            meta = backend.build(spec, source.file(ONNX_FILE), tmp, precision) or {}
            if self.options.check_parity:
                engine = backend.load(spec, tmp, precision)
                meta["parity"] = [p.to_dict() for p in engine_parity(spec, engine, precision)]
            return meta

        return self._stage(spec, "engine", parts, build)

    def backend(self, name: str) -> Backend:
        backend = get_backend(name, self.options, shared_dir=self.cache.root / "shared" / name)
        backend.require()
        backend.check_precision(self.options.precision)
        return backend

    def engine(self, spec: ComponentSpec, backend_name: str) -> Engine:
        """The engine of `spec` on `backend_name`: loaded from the cache, or built first."""
        backend = self.backend(backend_name)
        precision = spec.precision_for(self.options.precision)
        if not backend.needs_onnx:
            return backend.load(spec, None, precision)
        export_parts = self.export_parts(spec)
        optimized_parts = self.optimized_parts(spec, backend, digest_key(export_parts))
        engine_parts = self.engine_parts(spec, backend, digest_key(optimized_parts))
        start = time.perf_counter()
        entry = self.cache.lookup(engine_parts)
        if entry is not None:
            engine = self._load(spec, backend, entry, precision)
            if engine is not None:
                self._record(spec, "engine", "reused", entry, time.perf_counter() - start)
                return engine
        source = self.exported(spec, export_parts)
        optimized = self.optimized(spec, optimized_parts, source)
        entry = self.built_engine(spec, backend, engine_parts, optimized)
        engine = self._load(spec, backend, entry, precision)
        if engine is None:  # damaged between its build and its load
            raise EngineLoadError(f"the {backend.name} engine of {spec.name} in {entry.path} was damaged right "
                                  "after it was built; check the disk, then `kasoku cache check --repair`.")
        return engine

    def _load(self, spec: ComponentSpec, backend: Backend, entry: CacheEntry, precision: Precision) -> Engine | None:
        """The runtime's load of an entry; None when the entry turned out damaged (it is removed)."""
        start = time.perf_counter()
        try:
            engine = backend.load(spec, entry.path, precision)
        except KasokuError:
            raise
        except Exception as error:  # the runtimes raise their own kinds on a bad file
            if self.cache.discard_if_damaged(entry):
                return None
            raise EngineLoadError(f"the {backend.name} engine of {spec.name} in {entry.path} does not load: "
                                  f"{error}. Remove it with `kasoku cache clear` and compile again.") from error
        self.load_seconds[spec.name] = time.perf_counter() - start
        return engine

    # ---- backend choice ----------------------------------------------------------------------

    def choose(self, spec: ComponentSpec) -> str:
        """The backend for `spec`: the one asked for, or what `auto` resolves to here."""
        asked = self.options.backend_for(spec.name)
        if asked != "auto":
            return asked
        gpu = gpu_candidates()
        if gpu:
            return gpu[0]
        candidates = cpu_candidates()
        if len(candidates) == 1:
            return candidates[0]
        parts = {
            "kind": "auto-choice", "component": spec.name, "architecture": spec.architecture,
            "profile": spec.profile.to_dict(), "precision": spec.precision_for(self.options.precision).value,
            "machine": cpu_name(), "candidates": {name: get_backend(name).availability().version
                                                  for name in candidates},
        }
        entry = self.cache.lookup(parts)
        if entry is None:
            def build(tmp: Path) -> dict:
                timings = {name: measure(self.engine(spec, name), spec) for name in candidates}
                choice = min(timings, key=timings.get)
                (tmp / "choice.txt").write_text(choice)
                return {"choice": choice, "median_seconds": timings}

            entry = self._stage(spec, "choose", parts, build)
        return entry.meta["choice"]

    def compile(self, specs: dict[str, ComponentSpec], on_done: Callable[[str], None] | None = None
                ) -> tuple[dict[str, Engine], dict[str, str]]:
        engines, chosen = {}, {}
        for name, spec in specs.items():
            chosen[name] = self.choose(spec)
            engines[name] = self.engine(spec, chosen[name])
            if on_done:
                on_done(name)
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
    options: CompileOptions | None = None,
    *,
    cache: Cache | str | Path | None = None,
    specs: dict[str, ComponentSpec] | None = None,
    on_stage: StageHook = _no_hook,
    label: str | None = None,
    **fields: Any,
) -> tuple[dict[str, Engine], CompileReport]:
    """Fill the cache for the components of `model` and load their engines.

    `options` (or its fields as keywords: backend, precision, profile, components, ...) says what to
    build; `cache` is a :class:`Cache` or its folder (default: the options' cache_dir). `specs` (from
    `component_specs`) lets a caller that compiles repeatedly reuse them. A model given as a folder
    is loaded lazily: torch weights are read only for the components that must be built."""
    from .loading import load_pipeline, model_label, release_module

    start = time.perf_counter()
    options = CompileOptions.of(options, **fields)
    pipe = load_pipeline(model, lazy=True)
    root = cache.root if isinstance(cache, Cache) else Path(cache or options.cache_dir or default_cache_dir())
    specs = specs or component_specs(pipe, options.profile, options.components, weights=WeightsFingerprints(root))
    if not isinstance(cache, Cache):  # created only once the model and its components are known to be fine
        cache = Cache(root)
    label = label or model_label(model)
    compiler = Compiler(cache, options, on_stage=on_stage, label=label)
    order = list(specs)

    def release_unneeded(done: str) -> None:
        # Free torch weights kasoku loaded itself once no later component needs them.
        later = {attr for name in order[order.index(done) + 1:] for attr in specs[name].modules}
        for attr in set(specs[done].modules) - later:
            for spec in specs.values():
                if attr in spec.modules:
                    spec.forget_module()
            release_module(pipe, attr)

    engines, chosen = compiler.compile(specs, on_done=release_unneeded)
    precision = options.precision
    report = CompileReport(
        model=label,
        precision=precision.value,
        profile=next(iter(specs.values())).profile.to_dict(),
        backends=chosen,
        stages=compiler.records,
        seconds=time.perf_counter() - start,
        family=family_of(pipe).name,
        precisions={name: spec.precision_for(precision).value for name, spec in specs.items()},
        notes=precision_notes(specs, precision),
        load_seconds=compiler.load_seconds,
    )
    return engines, report


def precision_notes(specs: dict[str, ComponentSpec], precision: Precision) -> list[str]:
    """One line per component built in another precision than asked, saying why."""
    return [f"{name}: {spec.keep_fp32}." for name, spec in specs.items()
            if spec.precision_for(precision) != precision]
