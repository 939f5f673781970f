"""`compile_components`: resolve the policies, then build: every component's engine, through the cache.

The order is the point. What the options leave open is decided first, by the policies, each handing the
builder data: ``precision="fastest"`` measures and chooses a precision per component
(:mod:`kasoku.policies.fastest`), and int8 components whose engines are not in the cache yet get their calibration
inputs recorded (:mod:`kasoku.policies.calibration`). Then the builder (:class:`kasoku.build.compiler.Compiler`)
builds or loads each engine, and torch weights kasoku loaded itself are released once no later component needs them.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

from ..backends import Engine, UnsupportedPrecision, get_backend
from ..build.compiler import Compiler, CompileReport, StageHook, _no_hook, requested_components
from ..core.cache import Cache, default_cache_dir
from ..core.components import ComponentSpec
from ..core.errors import KasokuError
from ..core.memory import (
    GIB,
    MEMORY_CHECK_ENV,
    NotEnoughMemory,
    available_memory,
    checks_memory,
    return_freed_memory,
)
from ..core.options import FASTEST, CompileOptions, InvalidOptions, Precision
from ..core.weights import run_time_weights
from ..model.loading import model_label
from ..model.pipeline_model import Model
from ..policies import calibration, quantization
from ..policies.fastest import choose_precisions

__all__ = ["NotEnoughMemory", "available_memory", "compile_components", "precision_notes"]


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

    `model` is a folder, a hub id, a live diffusers pipeline or a :class:`~kasoku.model.pipeline_model.Model`. `options`
    (or its fields as keywords: backend, precision, profile, components, ...) says what to build; `cache`
    is a :class:`Cache` or its folder (default: the options' cache_dir). `specs` (from the model's
    `specs`) lets a caller that compiles repeatedly reuse them. A model given as a folder is loaded
    lazily: torch weights are read only for the components that must be built."""
    start = time.perf_counter()
    options = CompileOptions.of(options, **fields)
    model = Model.load(model, lazy=True, label=label)
    root = cache.root if isinstance(cache, Cache) else Path(cache or options.cache_dir or default_cache_dir())
    model.remember_digests_under(root)
    specs = specs or model.specs(options.profile, requested_components(model, options),
                                 cache_branch=options.cache_branch)
    if not isinstance(cache, Cache):  # created only once the model and its components are known to be fine
        cache = Cache(root)
    label = model_label(label) if label else model.label  # a folder by its absolute path, however it was typed
    if label == type(model.pipe).__name__:  # a live pipeline: its weights are its identity, not its class
        label = live_label(model, specs)
    notes: list[str] = []
    asked = options.precision_label
    if options.precision == FASTEST:
        options, notes = _fastest(model, specs, options, cache, on_stage)
    specs = quantization.with_int4_weights(calibration.with_activations(model, specs, options), options)
    check_lora_targets(model, specs, options)
    check_bf16_backends(specs, options)
    compiler = Compiler(cache, options, on_stage=on_stage, label=label)
    check_memory(model, {name: spec for name, spec in specs.items() if not _surely_cached(compiler, model, spec)},
                 compiler)
    calibration.provide(compiler, model, specs)
    order = list(specs)
    model.prefetch_digests(attr for name in order for attr in specs[name].modules)

    def release_unneeded(done: str) -> None:
        # Free torch weights kasoku loaded itself once no later component needs them.
        later = {attr for name in order[order.index(done) + 1:] for attr in specs[name].modules}
        for attr in set(specs[done].modules) - later:
            for spec in specs.values():
                if attr in spec.modules:
                    spec.forget_module()
            model.release(attr)
        return_freed_memory()

    engines, chosen = compiler.compile(specs, on_done=release_unneeded)
    parts = model.family.part_specs(model, next(iter(specs.values())).profile if specs else model.default_profile(),
                                    {**model.family.in_torch(model), **compiler.in_torch}, options.step_cache)
    if parts:  # a component kept in torch whose parts compile (a denoiser's blocks)
        more, more_chosen = compiler.compile(parts)
        engines.update(more)
        chosen.update(more_chosen)
        specs = {**specs, **parts}
    compiler.finish()
    model.memo["engine_builder"] = functools.partial(_grown_engine, compiler, dict(chosen))
    model.family.keep_in_torch(model, compiler.in_torch)
    model.family.at_one_shape(model, compiler.one_shape)
    in_torch = model.family.in_torch(model)
    chosen.update({name: "torch" for name in in_torch if name not in chosen})  # kept before any build, too
    report = CompileReport(
        model=label,
        precision=asked,
        profile=next(iter(specs.values())).profile.to_dict(),
        backends=chosen,
        stages=compiler.records,
        seconds=time.perf_counter() - start,
        family=model.family.name,
        precisions={name: compiler.precision(spec).value for name, spec in specs.items()},
        notes=notes + precision_notes(specs, options) + model.notes + in_torch_notes(in_torch, chosen) +
        one_shape_notes(model.family.one_shape(model), specs, model.family.grows_by_shape(model)),
        load_seconds=compiler.load_seconds,
        in_torch=in_torch,
    )
    return engines, report


def live_label(model: Model, specs: dict[str, ComponentSpec]) -> str:
    """How the cache names a live pipeline's entries: its class and the digest of the weights compiled
    (`StableDiffusionPipeline@3f2a9c1e0b7d`), so that `kasoku cache clear` of that name removes this pipeline's
    engines only, not every live pipeline of its class. The digests are the ones the cache keys read anyway."""
    import hashlib

    modules = sorted({path for spec in specs.values() for path in spec.modules})
    digest = hashlib.sha256("".join(model.weights.of(model.pipe, path) for path in modules).encode()).hexdigest()
    return f"{type(model.pipe).__name__}@{digest[:12]}"


def _grown_engine(compiler: Compiler, chosen: dict[str, str], spec: ComponentSpec) -> Engine:
    """The engine of a component's graph of one shape at a call's other shape, built after the compile as it built
    the rest: the component's backend and precision, through the cache."""
    if compiler.precision(spec) == Precision.INT8:
        raise KasokuError(f"{spec.name} runs int8 engines of one shape, calibrated when compiled; a call of another "
                          "shape has none. Call it at the compiled shape, or compile it in fp32 or bf16, which build "
                          "the engine of a new shape on its first call.")
    return compiler.engine(spec, chosen[spec.name])


# What building one component's engine holds at once, in units of its weights: the torch module and the
# engine's own copy (measured at full size: the SDXL U-Net, 10.3 GB, peaked at 22.5 GiB on OpenVINO).
BUILD_FOOTPRINT = 2.0
# A build the guard stopped is tried again once this much more memory is free than when it stopped: what the
# guard saw free was measured mid-build, after the export and the recording had taken their share.
RETRY_MARGIN = 2 * GIB


def check_lora_targets(model: Model, specs: dict[str, ComponentSpec], options: CompileOptions) -> None:
    """LoRA targets must name modules the components LoRA changes have (their weights' names are read from the
    modules as they are, on the meta device too: no weight is read)."""
    if not options.lora_targets or options.onnx_dir is not None:
        return
    takers = [spec for spec in specs.values() if spec.takes_lora]
    names = [name for spec in takers for path in spec.modules for name, _ in model.ref(path).module.named_parameters()]
    if takers and not run_time_weights(names, options.lora_targets):
        raise InvalidOptions(f"`lora_targets` ({', '.join(options.lora_targets)}) match no module of "
                             f"{', '.join(s.name for s in takers)}; give module names such as to_q or to_out.0 "
                             "(matched as the end of a module's path), or the preset attention.")


def check_bf16_backends(specs: dict[str, ComponentSpec], options: CompileOptions) -> None:
    """A component whose weights were read in bf16 computes in bf16 (or int8): a backend named for it must build
    bf16 (`auto` chooses among those that do)."""
    for name, spec in specs.items():
        backend = options.backend_for(name)
        if not spec.in_bf16 or backend == "auto":
            continue
        try:
            get_backend(backend, options).check_precision(Precision.BF16)
        except UnsupportedPrecision as error:
            raise InvalidOptions(f"{name}'s weights were read in bfloat16, so its engine computes in bf16, and "
                                 f"{error} Compile it with backend='openvino' (or 'auto'), or read the weights in "
                                 "float32.") from None


def _surely_cached(compiler: Compiler, model: Model, spec: ComponentSpec) -> bool:
    """Whether `spec`'s engine is in the cache, asked only where that reads no weights (a module whose digest is
    not known yet is taken to be built)."""
    return _digests_known(model, spec) and compiler.cached(spec)


def _digests_known(model: Model, spec: ComponentSpec) -> bool:
    """Whether the cache keys of `spec`'s entries can be computed without reading a weight."""
    return all(model.digest_known(path) for path in spec.modules)


def check_memory(model: Model, specs: dict[str, ComponentSpec], compiler: Compiler | None = None) -> None:
    """Refuse, before any weight is read, a component whose engine build would not fit in the memory this machine
    has free: an out-of-memory kill mid-build loses the work and says nothing. The build holds about
    BUILD_FOOTPRINT x the component's weights (the module loaded for it is counted only where it is not
    in memory already). With the `compiler`, a build that ran out of memory here before (the cache remembers the
    builds the memory guard stopped) is refused too while not RETRY_MARGIN more memory is free than then, asked
    only where that reads no weights."""
    free = available_memory()
    if free is None or not checks_memory():
        return
    for name, spec in specs.items():
        weights = sum(model.weight_bytes(path) for path in spec.modules)
        loaded = all(model.is_loaded(path) for path in spec.modules)
        needed = weights * (BUILD_FOOTPRINT - (1.0 if loaded else 0.0))
        if needed > free:
            t5 = "; SD3 runs without its T5, text_encoder_3=None" if name == "text_encoder_3" else ""
            fp32 = [path for path in spec.modules if not model.in_bf16(path)]
            bf16 = (" Read its weights in bf16 (`KasokuPipeline.from_pretrained(..., torch_dtype=torch.bfloat16)`, "
                    "or a pipeline loaded so) to halve it." if model.family.generic and fp32 else "")
            raise NotEnoughMemory(
                f"{name} has {weights / GIB:.1f} GiB of {'fp32' if fp32 else 'bf16'} weights; building its engine "
                f"needs about {needed / GIB:.1f} GiB and this machine has {free / GIB:.1f} GiB free.{bf16} Leave it "
                f"out (`components=` / `--components`, without {name}{t5}), build it on a machine with more memory, "
                f"or set {MEMORY_CHECK_ENV}=0 to try anyway.", free)
        stop = compiler.memory_stop(spec) if compiler is not None and _digests_known(model, spec) else None
        if stop is not None and free < stop["free_bytes"] + RETRY_MARGIN:
            raise NotEnoughMemory(f"{name}: this build ran out of memory here before, with "
                                  f"{stop['free_bytes'] / GIB:.1f} GiB free ({free / GIB:.1f} GiB are free now), so it "
                                  f"is refused before its export and calibration. What it said then: {stop['message']}",
                                  free)


def _fastest(model: Model, specs: dict[str, ComponentSpec], options: CompileOptions, cache: Cache,
             on_stage: StageHook) -> tuple[CompileOptions, list[str]]:
    """The options with `fastest` resolved to a precision per component, and the notes that say why."""
    step_cache = model.family.step_cache_components
    measured = {name: spec for name, spec in specs.items() if name not in step_cache}
    chosen, notes = choose_precisions(model, measured, options, cache, on_stage=on_stage)
    # the step-cache graphs are the denoiser's: they take its precision (their drift is measured as caching's)
    denoiser = model.family.denoiser
    chosen.update({name: chosen[denoiser] for name in specs if name in step_cache and denoiser in chosen})
    return options.replace(precision=chosen), notes


def one_shape_notes(one_shape: dict[str, str], specs: dict[str, ComponentSpec], grows: tuple[str, ...] = ()
                    ) -> list[str]:
    """One line per component whose engine takes one shape of the profile's several: the optimum's (and, where it
    `grows`, the engine of another call shape is built on that shape's first call)."""
    def shape(name: str) -> str:
        if name in grows:
            return ("engines of one shape: the profile's optimum is compiled, and a call of another shape (a prompt of "
                    "another length, another size, guidance or not) builds its own on its first call")
        return "an engine of one shape, the profile's optimum"

    return [f"{name} runs {shape(name)}, since {reason}" for name, reason in one_shape.items()
            if name in specs and (not specs[name].profile.is_static or name in grows)]


def in_torch_notes(in_torch: dict[str, str], chosen: dict[str, str] | None = None) -> list[str]:
    """One line per component that runs in torch instead of on an engine, with the reason, and how many of its
    blocks run on engines where its blocks were compiled in its place (`chosen`: the backend of each)."""
    notes = []
    for name, reason in in_torch.items():
        blocks = [backend for part, backend in (chosen or {}).items() if part.startswith(f"{name}.")]
        if "." in name and name.split(".")[0] in in_torch:
            continue  # said with its module's line
        ran = f"; {sum(b != 'torch' for b in blocks)} of its {len(blocks)} blocks run on engines" if blocks else ""
        notes.append(f"{name} stays in torch: {reason}{ran}")
    return notes


def precision_notes(specs: dict[str, ComponentSpec], options: CompileOptions) -> list[str]:
    """One line per component built in another precision than asked, saying why."""
    notes = []
    for name, spec in specs.items():
        asked = options.precision_of(name)
        if spec.precision_for(asked) != asked:
            notes.append(f"{name}: {spec.precision_reason(asked)}.")
        elif asked == Precision.INT8 and spec.int8_note:
            notes.append(f"{name}: {spec.int8_note}.")
    return notes
