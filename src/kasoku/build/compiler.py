"""Compile a pipeline's components into engines, every artefact through the cache.

Per component: export (the architecture graph, weights as named inputs) → optimize (backend's
passes) → engine (backend build, the checkpoint's weights bound) → load; a backend that builds from the
torch module (AOTInductor) has the engine stage only, keyed on the module's weights. Each stage is a cache
entry keyed by everything that changes it. The graph and its optimization are keyed by the architecture
alone (config, exporter, opset, the shapes it is traced at and its dynamic axes, passes, precision), so
every checkpoint of an architecture shares them, and every profile that traces alike (a text encoder's, whatever
the image sizes); only the engine is keyed by the weights too. The keys are computed, not walked: the
engine's key is derived from the export's and the optimization's key parts without opening those
entries, so a warm start opens only the final engine entry, checks its manifest cheaply and loads it
(what the runtime's own load costs). Only a miss walks the chain, building what is missing: for a
new checkpoint of a known architecture, only its engine.

The builder builds: what it needs beyond the options (int8 calibration samples, the precisions `fastest`
chose) is decided by the policies before it runs and handed to it (:mod:`kasoku.pipeline.compiling`).

`auto` picks per component: on a GPU TensorRT, then ONNX Runtime CUDA; on a CPU whichever of
ONNX Runtime and OpenVINO runs the component faster here. The choice is measured once per
architecture, profile, precision and machine (not per thread count or weights) and recorded in
the cache; `CompileReport.backends` says what `auto` resolved to, and passing that mapping back
as the backend builds exactly the same engines (what `kasoku batch` hands its workers).
"""

from __future__ import annotations

import contextlib
import gc
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import onnx
import torch

from ..backends import Engine, UnsupportedPrecision, cpu_candidates, get_backend, gpu_candidates
from ..backends.base import Backend, Source, cpu_name
from ..backends.int8 import CALIBRATED, INT4_RECIPE
from ..core.cache import Cache, CacheEntry, CacheError, default_cache_dir, digest_key, file_sha256
from ..core.components import ComponentSpec, Precision, ShapeProfile, traced_shapes
from ..core.errors import KasokuError
from ..core.extras import import_onnxruntime
from ..core.memory import NotEnoughMemory
from ..core.options import FASTEST, CalibrationPlan, CompileOptions, InvalidOptions
from ..core.parity import ParityError, QuantizationMissed, parity_against_torch, raise_on_failure
from ..core.weights import (
    GraphWeight,
    bind_named_parts,
    bindable_tensors,
    named_parts,
    onnx_files,
    read_graph_weights,
    run_time_weights,
)
from ..model.pipeline_model import Model
from .export import (
    EXPORT_CODE_VERSION,
    ExportError,
    check_onnx_parity,
    default_check_shapes,
    export_graph,
    module_weights,
)
from .optimize import optimize

ONNX_FILE = "model.onnx"
AUTO_REPEATS = 3

StageHook = Callable[[str, str], contextlib.AbstractContextManager]


class EngineLoadError(KasokuError):
    """A cached engine that its runtime cannot load although its files are intact."""


@dataclass
class KeyChain:
    """The key parts of one engine and of the entries it is built from (computed, not walked)."""

    export: dict[str, Any] | None  # None: the backend builds from the torch module (Source.MODULE)
    optimized: dict[str, Any] | None  # None: the backend runs no ONNX passes
    engine: dict[str, Any]
    calibration: dict[str, Any] | None  # int8 components calibrated on recorded inputs


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
    in_torch: dict[str, str] = field(default_factory=dict)  # component -> why it runs in torch, not on an engine

    def to_dict(self) -> dict:
        return asdict(self)

    def statuses(self) -> dict[tuple[str, str], str]:
        return {(s.component, s.stage): s.status for s in self.stages}

    @property
    def built(self) -> int:
        return sum(s.status != "reused" for s in self.stages)

    def merge(self, other: CompileReport) -> None:
        """Add what a later compile of more components of the same pipeline did (the step-cache engines)."""
        self.backends.update(other.backends)
        self.precisions.update(other.precisions)
        self.load_seconds.update(other.load_seconds)
        self.in_torch.update(other.in_torch)
        self.stages += other.stages
        self.notes += [note for note in other.notes if note not in self.notes]
        self.seconds += other.seconds


def _no_hook(component: str, stage: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _versions() -> dict[str, str]:
    import diffusers
    import transformers

    return {"torch": torch.__version__, "diffusers": diffusers.__version__, "transformers": transformers.__version__,
            "onnx": onnx.__version__, "kasoku_export": EXPORT_CODE_VERSION}


class Compiler:
    """One compile: the cache, the options and the hooks; :meth:`compile` is the entry point.

    `calibration` holds, per component, the recorded input samples an int8 engine that is not in the cache yet
    is calibrated on (kasoku.policies.calibration records them before the build: :meth:`needs_samples` says which)."""

    def __init__(self, cache: Cache, options: CompileOptions, *, on_stage: StageHook = _no_hook, label: str = "?",
                 calibration: dict[str, list] | None = None):
        self.cache = cache
        self.options = options
        self.on_stage = on_stage
        self.model = label
        self.calibration: dict[str, list] = dict(calibration or {})
        self.records: list[StageRecord] = []
        self.load_seconds: dict[str, float] = {}
        self.in_torch: dict[str, str] = {}  # component -> why it stays in torch (a recorded graph that failed)
        self.one_shape: dict[str, str] = {}  # component -> why its engine takes one shape (its dynamic graph failed)
        self.references: dict = {}  # torch's outputs for the parity checks, computed once per component and shape
        self.built: dict[tuple[str, str], str] = {}  # (component, backend) -> the engine entry this compile built
        self.intermediates: set[str] = set()  # export and optimization entries the engines were built from

    def precision(self, spec: ComponentSpec) -> Precision:
        """What `spec` is built in: the precision asked for it, unless its family keeps it fp32."""
        return spec.precision_for(self.options.precision_of(spec.name))

    # ---- key parts, computed without opening any entry --------------------------------------

    def export_parts(self, spec: ComponentSpec) -> dict[str, Any]:
        """The architecture graph's key: no weights (every checkpoint of the architecture shares it)."""
        if self.options.onnx_dir is not None:
            files = onnx_files(self._given_onnx(spec))
            return {"kind": "onnx-file", "component": spec.name, "files": [file_sha256(f) for f in files]}
        return {"kind": "graph", "component": spec.graph_id, "architecture": spec.architecture,
                "exporter": self.options.exporter, "opset": self.options.opset, "traced": traced_shapes(spec),
                **_versions()}

    def binds_weights(self) -> bool:
        """Whether engines are built from an architecture graph and a checkpoint's weights (not from ONNX files
        that hold their own weights)."""
        return self.options.onnx_dir is None

    def lora_targets(self, spec: ComponentSpec) -> tuple[str, ...]:
        """The modules whose weights stay inputs of `spec`'s engine (bound per LoRA adapter set)."""
        return self.options.lora_targets if spec.takes_lora and self.binds_weights() else ()

    def keeps_adapter_weights(self, spec: ComponentSpec, backend: Backend) -> bool:
        """Whether `spec`'s adapter weights (`run_time_parts`: IP-Adapters) stay inputs of its engine on `backend`
        (graph backends, at a precision that keeps run-time weights); elsewhere they are constants like the rest."""
        if not spec.run_time_parts or not self.binds_weights() or backend.builds_from != Source.ONNX:
            return False
        try:
            backend.check_run_time_weights(self.precision(spec))
        except KasokuError:
            return False
        return True

    def optimized_parts(self, spec: ComponentSpec, backend: Backend, source: str) -> dict[str, Any]:
        # The passes say everything precision changes in the graph (the fp16 pass); precisions that
        # are an inference setting (bf16) or NNCF's rewrite (int8) share the fp32 graph.
        precision = self.precision(spec)
        return {"kind": "optimized", "component": spec.name, "source": source,
                "passes": backend.optimization_passes(precision), "onnx": onnx.__version__,
                "onnxruntime": import_onnxruntime().__version__}

    def calibration_parts(self, spec: ComponentSpec, backend: Backend, source: str) -> dict[str, Any]:
        """The key of an int8 component's recorded calibration inputs: the graph, the plan, the shape, where they
        are recorded (the backend's say), and the weights."""
        plan = CalibrationPlan(samples=self.options.calibration_samples)
        if spec.profile.guidance is False:  # engines for guidance-free calls are calibrated on such calls
            plan = replace(plan, guidance=1.0)
        plan = replace(plan, **spec.calibration)  # the calls its pipeline takes (a distilled model's steps)
        return {"kind": "calibration", "component": spec.name, "source": source, "shape": vars(spec.profile.opt),
                "plan": plan.to_dict(), **backend.calibration_recording(),
                **({"weights": spec.fingerprint} if self.binds_weights() else {})}

    def engine_parts(self, spec: ComponentSpec, backend: Backend, source: str) -> dict[str, Any]:
        """The engine's key: its graph's, the checkpoint's weights, the backend's, the int8 recipe, and the LoRA
        targets kept as run-time weights."""
        precision = self.precision(spec)
        parts = {"kind": "engine", "component": spec.name, "source": source, "profile": spec.profile.to_dict(),
                 **backend.key(precision)}
        if precision == Precision.INT8:
            parts["int8_recipe"] = spec.int8
        if self.keeps_adapter_weights(spec, backend):  # one engine for every adapter of the architecture
            parts["weights"] = digest_key({"architecture": spec.architecture, "base": spec.base_weights()})
            parts["run_time_parts"] = list(spec.run_time_parts)
        elif self.binds_weights():
            parts["weights"] = spec.fingerprint
        if self.lora_targets(spec):
            parts["lora_targets"] = list(self.lora_targets(spec))
        return parts

    def module_parts(self, spec: ComponentSpec) -> dict[str, Any]:
        """What a backend that builds from the torch module reads: its weights and the code that runs them
        (keyed, never stored: there is no entry of this kind)."""
        code = {name: version for name, version in _versions().items() if name != "onnx"}
        return {"kind": "module", "component": spec.name, "weights": spec.fingerprint, **code}

    def chain(self, spec: ComponentSpec, backend: Backend) -> KeyChain:
        """The key parts of every entry from the export to `backend`'s engine of `spec`."""
        precision = self.precision(spec)
        if backend.builds_from == Source.MODULE:  # no export: the engine is built from the torch module
            return KeyChain(None, None, self.engine_parts(spec, backend, digest_key(self.module_parts(spec))), None)
        export_parts = self.export_parts(spec)
        optimized_parts = self.optimized_parts(spec, backend, digest_key(export_parts))
        if not optimized_parts["passes"]:  # no passes: the engine is built from the export itself
            optimized_parts = None
        engine_parts = self.engine_parts(spec, backend, digest_key(optimized_parts or export_parts))
        calibration_parts = None
        if backend.needs_calibration(spec, precision):
            calibration_parts = self.calibration_parts(spec, backend, digest_key(export_parts))
            engine_parts["calibration"] = digest_key(calibration_parts)
        return KeyChain(export_parts, optimized_parts, engine_parts, calibration_parts)

    def cached(self, spec: ComponentSpec) -> bool:
        """Whether `spec`'s engine is in the cache (for `auto`, with its choice recorded); builds nothing."""
        name = self.options.backend_for(spec.name)
        if name == "auto":
            name = self._recorded_choice(spec)
            if name is None:
                return False
        backend = self.backend(name)
        if backend.builds_from == Source.NOTHING:
            return True
        return self.cache.lookup(self.chain(spec, backend).engine) is not None

    def calibration_chain(self, spec: ComponentSpec) -> tuple[Backend, KeyChain] | None:
        """(the backend, the key chain) of `spec`'s engine when it is calibrated on recorded inputs (int8 on a
        backend that calibrates: `auto` resolves to the one backend that builds int8), else None."""
        name = self.options.backend_for(spec.name)
        if name == "auto":
            candidates, _ = self._auto_candidates(spec)
            if len(candidates) != 1:
                return None
            name = candidates[0]
        backend = self.backend(name)
        if not backend.needs_calibration(spec, self.precision(spec)):
            return None
        return backend, self.chain(spec, backend)

    def needs_samples(self, spec: ComponentSpec) -> bool:
        """Whether building `spec`'s engine needs recorded calibration inputs that were not handed in yet."""
        found = self.calibration_chain(spec)
        return found is not None and spec.name not in self.calibration and \
            self.cache.lookup(found[1].engine) is None

    # ---- stages ------------------------------------------------------------------------------

    def _record(self, spec: ComponentSpec, stage: str, status: str, entry: CacheEntry, seconds: float) -> None:
        """One stage's record; an entry this compile built and then reads again (the export `auto` measures the
        backends on, then builds the engine from) is its one `built` record, not a second `reused` one."""
        if any(r.key == entry.key and r.component == spec.name and r.stage == stage for r in self.records):
            return
        self.records.append(StageRecord(spec.name, stage, status, entry.key, seconds, entry.meta))

    def stage(self, spec: ComponentSpec, stage: str, parts: dict, build) -> CacheEntry:
        """The entry of `parts`, from the cache or built by `build(folder)` (under `on_stage`), recorded."""
        shown = f"{stage} {parts['backend']} {parts['precision']}" if parts.get("kind") == "engine" else stage
        start = time.perf_counter()
        entry = self.cache.lookup(parts)  # a hit shows no stage: only work is shown
        if entry is None:
            with self.on_stage(spec.name, shown):
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

            return self.stage(spec, "export", parts, copy)

        def build(tmp: Path) -> dict:
            # Proven against torch once, at the end of the chain (the engine); a failure there checks
            # this graph again, with the weights bound, to name the stage that broke it (see `engine_parity`).
            result = export_graph(spec, tmp / ONNX_FILE, exporter=self.options.exporter, opset=self.options.opset)
            return {"export_seconds": result.seconds, "weights": result.weights}

        if spec.graph_kind != "recorded":
            return self.stage(spec, "export", parts, build)
        # a recorded graph whose export failed falls back (one shape, torch): the next compile does so at once
        failed = self.cache.failed_export(parts)
        if failed is not None:
            raise ExportError(failed)
        try:
            return self.stage(spec, "export", parts, build)
        except ExportError as error:
            self.cache.remember_failed_export(parts, str(error))
            raise

    def optimized(self, spec: ComponentSpec, parts: dict, source: CacheEntry) -> CacheEntry:
        precision = self.precision(spec)

        def build(tmp: Path) -> dict:
            report = optimize(source.file(ONNX_FILE), tmp / ONNX_FILE, parts["passes"], spec=spec,
                              precision=precision)
            return {"passes": report.to_dict()["passes"]}

        return self.stage(spec, "optimize", parts, build)

    def built_engine(self, spec: ComponentSpec, backend: Backend, parts: dict, sources: list[CacheEntry],
                     calibration: Callable[[], list] | None = None) -> CacheEntry:
        """Build `spec`'s engine entry from `sources` (the export and its optimization; none for a backend that
        builds from the torch module), calibrated on `calibration()`'s samples where the backend says so."""
        precision = self.precision(spec)
        # A graph this compile exported is proven at two shapes of the profile; one from the cache was proven
        # when it was built, so only the weights are new: one shape, the profile's smallest, proves them.
        exported_now = any(r.component == spec.name and r.stage == "export" and r.status != "reused"
                           for r in self.records)

        def build(tmp: Path) -> dict:
            graph = sources[-1].file(ONNX_FILE) if sources else None  # None: built from the torch module
            weights = run_time = None
            if self.binds_weights() and graph is not None:
                weights = module_weights(spec, onnx.load(str(graph)))
                run_time = run_time_weights(weights, self.lora_targets(spec))
                if self.keeps_adapter_weights(spec, backend):
                    run_time |= named_parts(weights, spec.run_time_parts)
            meta = backend.build(spec, graph, tmp, precision, calibration=calibration, weights=weights,
                                 run_time=run_time or frozenset()) or {}
            if self.options.check_parity:
                engine = backend.load(spec, tmp, precision)
                shapes = None if exported_now or not self.binds_weights() else [spec.profile.min]
                meta["parity"] = [p.to_dict() for p in self.engine_parity(spec, engine, precision, sources, shapes,
                                                                          weights)]
            return meta

        try:
            return self.stage(spec, "engine", parts, build)
        except NotEnoughMemory as error:  # the next compile of this engine is refused before its work
            if error.free_bytes is not None:
                self.cache.remember_memory_stop(parts, error.free_bytes, str(error))
            raise

    def memory_stop(self, spec: ComponentSpec) -> dict[str, Any] | None:
        """What the cache remembers of an earlier build of `spec`'s calibrated engine that ran out of memory (the
        builds whose memory cannot be counted beforehand), or None."""
        chain = self.calibration_chain(spec)
        return None if chain is None else self.cache.memory_stop(chain[1].engine)

    def backend(self, name: str) -> Backend:
        backend = get_backend(name, self.options, shared_dir=self.cache.root / "shared" / name)
        backend.require()
        return backend

    def engine(self, spec: ComponentSpec, backend_name: str) -> Engine:
        """The engine of `spec` on `backend_name`: loaded from the cache, or built first."""
        backend = self.backend(backend_name)
        precision = self.precision(spec)
        backend.check_precision(precision)
        if self.lora_targets(spec):
            if backend.builds_from == Source.MODULE:
                raise KasokuError(f"the {backend.name} backend compiles the weights into its packages: it keeps no "
                                  "run-time weights (lora_targets); choose onnxruntime or openvino for LoRA targets.")
            backend.check_run_time_weights(precision)
        if backend.builds_from == Source.NOTHING:
            return backend.load(spec, None, precision)
        chain = self.chain(spec, backend)
        engine_parts = chain.engine
        calibration = None
        if chain.calibration is not None:
            def calibration() -> list:
                if spec.name not in self.calibration:
                    raise KasokuError(f"the int8 {spec.name} engine is calibrated on inputs recorded from the "
                                      "pipeline's own runs, which were not given; compile through kasoku.compile "
                                      "or kasoku.compile_components (they record them first).")
                return self.calibration[spec.name]
        start = time.perf_counter()
        entry = self.cache.lookup(engine_parts)
        if entry is not None:
            engine = self._load(spec, backend, entry, precision)
            if engine is not None:
                self._bind_adapter_weights(spec, backend, engine)
                self._record(spec, "engine", "reused", entry, time.perf_counter() - start)
                return engine
        with contextlib.ExitStack() as held:  # no other process drops a source while we build from it
            sources = self.sources(spec, backend, chain, held)
            entry = self.built_engine(spec, backend, engine_parts, sources, calibration)
        if not self.binds_weights():  # a user's ONNX files and their optimization hold weights: throwaway copies
            self.intermediates.update(source.key for source in sources)
        if self.records[-1].status != "reused":
            self.built[(spec.name, backend_name)] = entry.key
        engine = self._load(spec, backend, entry, precision)
        if engine is None:  # damaged between its build and its load
            raise EngineLoadError(f"the {backend.name} engine of {spec.name} in {entry.path} was damaged right "
                                  "after it was built; check the disk, then `kasoku cache check --repair`.")
        return engine

    def _bind_adapter_weights(self, spec: ComponentSpec, backend: Backend, engine: Engine) -> None:
        """An engine that keeps adapter weights as inputs starts on the values it was built with: bind the adapters
        the module holds now."""
        if self.keeps_adapter_weights(spec, backend):
            bind_named_parts(engine, spec.module, spec.run_time_parts)

    def sources(self, spec: ComponentSpec, backend: Backend, chain: KeyChain,
                held: contextlib.ExitStack) -> list[CacheEntry]:
        """The export and, where the backend runs passes, the optimized graph of `spec`: from the cache, built
        when missing, each held for reading until `held` closes."""
        if chain.export is None:  # built from the torch module: no graph
            return []
        sources = [self.exported(spec, chain.export)]
        held.enter_context(self.cache.reading(sources[0].key))
        if chain.optimized is not None:
            sources.append(self.optimized(spec, chain.optimized, sources[0]))
            held.enter_context(self.cache.reading(sources[1].key))
        return sources

    def graph_and_weights(self, spec: ComponentSpec, backend_name: str
                          ) -> tuple[Backend, Path | None, dict[str, GraphWeight]]:
        """What rebinding `spec`'s weights (LoRA adapters on a compiled pipeline) needs of the build: the backend,
        the graph its engine was built from (from the cache, built again if it was evicted; None for the torch
        reference, which binds the module's own tensors) and the graph's weights by name."""
        if not self.binds_weights():
            raise KasokuError(f"the {spec.name} engine was built from ONNX files that hold their own weights "
                              "(onnx_dir); LoRA adapters need engines compiled from the model itself.")
        backend = self.backend(backend_name)
        if backend.builds_from == Source.MODULE:
            raise KasokuError(f"the {backend.name} backend compiles the weights into its packages: LoRA adapters "
                              "cannot be rebound on its engines; compile a pipeline with the LoRA fused instead "
                              "(kasoku.compile on it builds engines with those weights).")
        if backend.builds_from == Source.NOTHING:
            return backend, None, {n: GraphWeight.of(n, t) for n, t in bindable_tensors(spec.module).items()}
        chain = self.chain(spec, backend)
        with contextlib.ExitStack() as held:
            graph = self.sources(spec, backend, chain, held)[-1].file(ONNX_FILE)
        return backend, graph, read_graph_weights(graph, spec.input_names)

    def finish(self) -> None:
        """Once every engine of this compile exists: drop the intermediates they were built from (unless
        `keep_intermediate`; another process reading one keeps it until the next compile), then evict down
        to KASOKU_CACHE_MAX, sparing what this compile uses."""
        if not self.options.keep_intermediate:
            for key in sorted(self.intermediates):
                self.cache.remove(key, wait=False)
        used = {record.key for record in self.records}
        self.cache.enforce_budget(keep=used - self.intermediates)

    def engine_parity(self, spec: ComponentSpec, engine: Engine, precision: Precision,
                      sources: list[CacheEntry], shapes=None, weights: dict | None = None) -> list:
        """The new engine against torch at `shapes` (default: two shapes of its profile): one check for the
        whole chain (export, passes, engine build). A mismatch checks the ONNX files of the chain in ONNX
        Runtime (the graphs with `weights` bound) to name the stage that broke parity."""
        shapes = shapes or default_check_shapes(spec.profile)
        try:
            return engine_parity(spec, engine, precision, self.references, shapes)
        except ParityError as error:
            # a graph read in bf16 cannot run in ONNX Runtime (no bf16 CPU kernels, and numpy has no bf16 to bind)
            for stage, entry in zip(("export", "optimization"), sources if not spec.in_bf16 else ()):
                graph = entry.file(ONNX_FILE)
                bound = None if weights is None else module_weights(spec, onnx.load(str(graph)))
                check_onnx_parity(spec, graph, shapes, stage=stage, weights=bound,
                                  precision=Precision.FP32 if stage == "export" else precision)
            if precision == Precision.INT8 and spec.int8 in CALIBRATED:  # the graphs match: quantization drifted
                raise QuantizationMissed(
                    f"the int8 engine of {spec.name} (weights and activations in int8, calibrated on its calls in the "
                    f"pipeline's runs) misses int8's contract against torch:\n  {error.failed}\nIts activations do "
                    f"not quantize within the contract: build it in bf16, or with int8 weights only (for a component "
                    f"other than the denoiser: leave it out of `int8_activations`).", failed=error.failed) from None
            if precision == Precision.INT8 and spec.int8 == INT4_RECIPE:
                raise QuantizationMissed(
                    f"the int8 engine of {spec.name} with int4 weights misses int8's contract against torch:\n  "
                    f"{error.failed}\nIts weights do not quantize to int4 within the contract: leave it out of "
                    f"`int4_weights` (int8 weights).", failed=error.failed) from None
            raise error

    def _load(self, spec: ComponentSpec, backend: Backend, entry: CacheEntry, precision: Precision) -> Engine | None:
        """The runtime's load of an entry; None when the entry turned out damaged (it is removed)."""
        start = time.perf_counter()
        try:
            with self.cache.reading(entry.key):  # eviction leaves an entry alone while it loads
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

    def _auto_candidates(self, spec: ComponentSpec) -> tuple[list[str], dict[str, Any] | None]:
        """(the backends `auto` picks from, the key parts of the recorded choice when it must measure)."""
        precision = self.precision(spec)
        gpu = [name for name in gpu_candidates() if _builds(name, precision)]
        if gpu:
            return gpu[:1], None
        candidates = [name for name in cpu_candidates() if _builds(name, precision)]
        if not candidates:
            refusals = (_refusal(name, precision) for name in cpu_candidates())  # each a sentence of its own
            reasons = " ".join(r[:1].upper() + r[1:] for r in refusals)
            raise UnsupportedPrecision(f"no backend here builds {precision.value}. {reasons}")
        if len(candidates) == 1:
            return candidates, None
        return candidates, {
            "kind": "auto-choice", "component": spec.name, "architecture": spec.architecture,
            "profile": spec.profile.to_dict(), "precision": precision.value,
            "machine": cpu_name(), "candidates": {name: get_backend(name).availability().version
                                                  for name in candidates},
        }

    def _recorded_choice(self, spec: ComponentSpec) -> str | None:
        candidates, parts = self._auto_candidates(spec)
        if parts is None:
            return candidates[0]
        entry = self.cache.lookup(parts)
        return entry.meta["choice"] if entry is not None else None

    def choose(self, spec: ComponentSpec) -> tuple[str, Engine | None]:
        """The backend for `spec` (the one asked for, or what `auto` resolves to here), and its engine
        where choosing already loaded it."""
        asked = self.options.backend_for(spec.name)
        if asked != "auto":
            return asked, None
        if self.binds_weights():
            spec.fingerprint  # noqa: B018 - the weights are read (and a damaged file said) before the cache is written
        candidates, parts = self._auto_candidates(spec)
        if parts is None:
            return candidates[0], None
        entry = self.cache.lookup(parts)
        if entry is not None:
            self._record(spec, "choose", "reused", entry, 0.0)
            return entry.meta["choice"], None
        def build(tmp: Path) -> dict:
            # One warm-up and one timed call of each candidate at the profile's optimum (the choice is a
            # ratio, and at full size each call is seconds), one engine in memory at a time: a full-size
            # U-Net engine is as large as its weights.
            timings = {}
            for name in candidates:
                engine = self.engine(spec, name)
                timings[name] = measure(engine, spec, repeats=1)
                del engine
                gc.collect()
            choice = min(timings, key=timings.get)
            (tmp / "choice.txt").write_text(choice)
            return {"choice": choice, "seconds": timings}

        entry = self.stage(spec, "choose", parts, build)
        choice = entry.meta["choice"]
        self._drop_losers(spec, [name for name in candidates if name != choice])
        return choice, None

    def _drop_losers(self, spec: ComponentSpec, losers: list[str]) -> None:
        """Engines `auto` built only to measure: once the choice is recorded, they leave the cache."""
        for name in losers:
            key = self.built.pop((spec.name, name), None)
            if key is not None:
                self.cache.remove(key)
                self.records = [r for r in self.records if r.key != key]

    def compile(self, specs: dict[str, ComponentSpec], on_done: Callable[[str], None] | None = None
                ) -> tuple[dict[str, Engine], dict[str, str]]:
        """The engine of each spec and the backend it runs on. A component compiled from recorded calls whose
        graph does not export, build or match torch stays in torch (`in_torch` says why); a hand-written one
        raises."""
        engines, chosen = {}, {}
        for name, spec in specs.items():
            try:
                chosen[name], engine = self.choose(spec)
                engines[name] = engine or self.engine(spec, chosen[name])
            except _stays_in_torch(spec) as error:
                _raise_refusal(error)
                self._raise_asked_quantization(spec, error)
                at_one_shape = self._at_one_shape(spec, error)
                if at_one_shape is None:
                    chosen[name] = "torch"
                else:
                    chosen[name], engines[name] = at_one_shape
            if on_done:
                on_done(name)
        return engines, chosen

    def _raise_asked_quantization(self, spec: ComponentSpec, error: BaseException) -> None:
        """A quantization the options asked for by name that misses the contract is refused with its remedy: the
        user asked for that engine, not for the component in torch."""
        asked = (*self.options.int8_activations, *self.options.int4_weights)
        if isinstance(error, QuantizationMissed) and spec.name in asked:
            raise error

    def _at_one_shape(self, spec: ComponentSpec, error: Exception) -> tuple[str, Engine] | None:
        """The engine of `spec`'s one-shape graph, where its dynamic one failed with `error` (`one_shape` says
        why); None where it has none or that fails too (`in_torch` says why)."""
        if spec.one_shape is None:
            self.in_torch[spec.name] = _first_line(error)
            return None
        try:
            fixed = spec.one_shape()
            choice, engine = self.choose(fixed)
            engine = engine or self.engine(fixed, choice)
        except Exception as second:
            _raise_refusal(second)
            # both reasons, each in its own room: the second says why no graph at all could be had
            self.in_torch[spec.name] = f"{_first_line(error, 160)}; at one shape: {_first_line(second, 200)}"
            return None
        self.one_shape[spec.name] = _first_line(error)
        return choice, engine


def _raise_refusal(error: BaseException) -> None:
    """A refusal that names its remedy (memory, options, the cache) stops the compile, recorded graph or not."""
    if isinstance(error, (NotEnoughMemory, InvalidOptions, CacheError)):
        raise error


def _stays_in_torch(spec: ComponentSpec) -> tuple[type[BaseException], ...]:
    """What keeps a component in torch instead of failing the compile: for a graph made from recorded calls,
    whatever its export, build or parity check raised (an op no exporter has, data-dependent control flow), but
    not a refusal that names a remedy (memory, options, the cache)."""
    return (Exception,) if spec.graph_kind == "recorded" else ()


def _first_line(error: BaseException, limit: int = 200) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _builds(backend: str, precision: Precision) -> bool:
    return not _refusal(backend, precision)


def _refusal(backend: str, precision: Precision) -> str:
    """Why `backend` cannot build `precision` here ("" when it can)."""
    try:
        get_backend(backend).check_precision(precision)
    except UnsupportedPrecision as error:
        return str(error)
    return ""


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


def engine_parity(spec: ComponentSpec, engine: Engine, precision: Precision, references: dict | None = None,
                  shapes=None) -> list:
    """The engine against torch (default: at the profile's optimum); raises on mismatch."""
    results = parity_against_torch(spec, engine.run, shapes or [spec.profile.opt], precision, seed=2,
                                   references=references)
    raise_on_failure(results, f"{engine.backend} engine of {spec.name}")
    return results


def cached_profile(model, options: CompileOptions, profiles, *, cache: Cache | None = None) -> ShapeProfile | None:
    """The first of `profiles` whose engines (every component `options` asks for) are all in the
    cache, or None; builds and measures nothing. `kasoku generate` asks this before it compiles a new
    exact-shape engine set: engines already built for a wider profile that serves the call are used."""
    found = cached_options(model, options, profiles, cache=cache, other_backends=False)
    return found.profile if found is not None else None


def cached_options(model, options: CompileOptions, profiles, *, cache: Cache | None = None,
                   other_backends: bool = True) -> CompileOptions | None:
    """`options` with the profile, and for the `auto` backend the backend, of the first engine set the cache holds
    for them (every component they ask for), or None; builds and measures nothing. For each of `profiles` in turn:
    the backend asked (`auto`: what it chose before); then, where it is `auto` and `other_backends`, each CPU backend
    that runs here, so that engines `kasoku compile --backend X` built serve a later command with default options."""
    if options.precision == FASTEST:
        return None
    model = Model.load(model, lazy=True)
    root = cache.root if cache is not None else Path(options.cache_dir or default_cache_dir())
    if not (root / "entries").is_dir():
        return None
    cache = cache or Cache(root)
    model.remember_digests_under(root)
    backends = [options.backend]
    if options.backend == "auto" and other_backends:
        from ..backends import cpu_candidates

        backends += cpu_candidates()
    for profile in profiles:
        specs = model.specs(profile, requested_components(model, options), cache_branch=options.cache_branch)
        for backend in backends:
            candidate = options.replace(profile=profile, backend=backend)
            compiler = Compiler(cache, candidate)
            if all(compiler.cached(spec) for spec in specs.values()):
                return candidate
    return None


def requested_components(model: Model, options: CompileOptions) -> tuple[str, ...] | None:
    """The components `options` asks for (None: every component the model has), with the step-cache
    graphs right after the denoiser (the ControlNets' U-Net in a ControlNet pipeline) where `step_cache` is set (and
    the denoiser is asked for)."""
    if not options.step_cache:
        return options.components
    family = model.family
    names = list(options.components or model.components)
    denoiser = family.denoiser_components(model)[-1]  # unet_controlnet in a ControlNet pipeline
    if denoiser in names and family.step_cache_components:
        at = names.index(denoiser) + 1
        names[at:at] = [name for name in family.step_cache_components if name not in names]
    return tuple(names)
