"""Calibration data for int8: a component's inputs recorded during the pipeline's own denoising runs.

As optimum-intel does for its hybrid mode, the denoiser is calibrated on what it actually sees: the
family's text-to-image pipeline runs over a built-in prompt set at the profile's optimum size,
with guidance, on engines of a higher precision (where the quantizing backend says: bf16 where the CPU
has it natively, else fp32), and every input the denoiser engine is called with is recorded until
`samples` calls are collected. The recording is a cache entry, so an int8 build calibrates once.
Another component whose int8 activations are asked for (`CompileOptions.int8_activations`: the VAE
decoder) is calibrated so too, on its own calls in a few such runs (the decoder's: the latents decoded).

This is a policy: it runs before the builder and hands it the samples (:func:`provide`), so the builder
never runs the pipeline itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..build.compiler import Compiler, StageRecord
from ..core.components import ComponentSpec, ImageShape, Precision
from ..core.options import CalibrationPlan, CompileOptions, InvalidOptions  # the plan's home is options
from ..core.weights import numpy_of
from ..model.pipeline_model import Model
from ..runtime.engine_pipelines import EnginePipelines
from .quantization import int8_components

CALIBRATION_FILE = "calibration.npz"
DECODER = "vae_decoder"  # the component past the denoising loop: its calibration runs decode their latents
# The pipeline runs a component other than a denoiser is calibrated on (at most `calibration_samples`): it is called
# once or twice a run. NNCF's statistics of DC-AE-Lite's decoder from 2 latents kept Sana Sprint's 1024x1024 image at
# 44.9 dB from torch fp32 (benchmarks/full_modern.py, 2026-12-07).
CALIBRATION_RUNS = 4


class _Enough(Exception):
    """Raised by the recorder once the plan's samples are recorded (ends the pipeline call)."""


class RecordingEngine:
    """An engine that records (numpy copies of) its checked inputs, then runs."""

    def __init__(self, engine, samples: int):
        self._engine = engine
        self.spec, self.device, self.dtype, self.backend = engine.spec, engine.device, engine.dtype, engine.backend
        self.samples = samples
        self.recorded: list[dict[str, np.ndarray]] = []

    def run(self, inputs):
        if len(self.recorded) >= self.samples:
            raise _Enough
        # copies (an engine's input buffers are reused), bf16 ones as fp32: what NNCF calibrates with
        self.recorded.append({k: np.array(numpy_of(torch.as_tensor(v))) for k, v in inputs.items()})
        return self._engine.run(inputs)


def record_inputs(model: Model, engines: dict, component: str, shape: ImageShape, plan: CalibrationPlan,
                  prompt_inputs: dict | None = None, fixed: dict | None = None) -> list[dict[str, np.ndarray]]:
    """`component`'s inputs during text-to-image runs of `model`'s family on `engines` (the text
    encoders' and the component's), at `shape`'s size, until `plan.samples` calls. `prompt_inputs`
    (prompt embeddings) stand in for the plan's prompts where no text encoder can run (a benchmark's
    model with random weights and no text encoders). `fixed`: the arguments the engines fix
    (:meth:`Model.fixed_arguments`)."""
    recorder = RecordingEngine(engines[component], plan.samples)
    runner = EnginePipelines(model, {**engines, component: recorder}, tasks=("txt2img",))
    output = "np" if component == DECODER else "latent"  # the latents are decoded only to calibrate the decoder
    for index, prompt in enumerate(itertools.cycle(plan.prompts)):
        if len(recorder.recorded) >= plan.samples or index >= plan.samples:
            break
        try:
            runner("txt2img", **(prompt_inputs or {"prompt": prompt}), height=shape.height, width=shape.width,
                   num_inference_steps=plan.steps, guidance_scale=plan.guidance,
                   generator=torch.Generator().manual_seed(plan.seed + index), output_type=output, **(fixed or {}))
        except _Enough:
            break
    return recorder.recorded


def save_samples(samples: list[dict[str, np.ndarray]], path: Path) -> None:
    np.savez(path, **{f"{i}/{name}": value for i, sample in enumerate(samples) for name, value in sample.items()})


def load_samples(path: Path) -> list[dict[str, np.ndarray]]:
    with np.load(path) as data:
        samples: dict[int, dict[str, np.ndarray]] = {}
        for key in data.files:
            index, name = key.split("/", 1)
            samples.setdefault(int(index), {})[name] = data[key]
    return [samples[i] for i in sorted(samples)]


def stored_samples(compiler: Compiler, spec: ComponentSpec,
                   make: Callable[[dict[str, Any]], list[dict[str, np.ndarray]]]) -> list[dict[str, np.ndarray]]:
    """`spec`'s calibration samples: from the cache, or made by `make(parts)` (the calibration key's parts: the
    recording backend, precision and plan) and stored there first."""
    _backend, chain = compiler.calibration_chain(spec)

    def build(tmp: Path) -> dict:
        samples = make(chain.calibration)
        save_samples(samples, tmp / CALIBRATION_FILE)
        return {"samples": len(samples)}

    entry = compiler.stage(spec, "calibrate", chain.calibration, build)
    return load_samples(entry.file(CALIBRATION_FILE))


def recorded_samples(compiler: Compiler, model: Model, spec: ComponentSpec, prompt_inputs: dict | None = None
                     ) -> list[dict[str, np.ndarray]]:
    """`spec`'s calibration samples: from the cache, or recorded first on engines of the recording precision
    (built by a compile of their own, dropped afterwards unless `keep_intermediate`). With `prompt_inputs`
    (see :func:`record_inputs`) no text encoder is built."""

    def record(parts: dict[str, Any]) -> list[dict[str, np.ndarray]]:
        names = model.family.calibration_components(spec.name, model)
        if prompt_inputs:  # the prompt's embeddings are given: no text encoder runs
            encoders = {slot.name for slot in model.family.present_text_encoders(model)}
            names = tuple(name for name in names if name not in encoders)
        specs = model.specs(spec.profile, [n for n in names if n != spec.name])
        specs[spec.name] = spec
        recording = compiler.options.replace(precision=Precision(parts["precision"]), backend=parts["backend"])
        sub = Compiler(compiler.cache, recording, on_stage=compiler.on_stage, label=compiler.model)
        engines = {name: sub.engine(specs[name], parts["backend"]) for name in names}
        plan = CalibrationPlan.from_dict(parts["plan"])
        calls = "decoded images" if spec.name == DECODER else \
            "denoising steps" if spec.name in model.family.denoiser_components(model) else "calls"
        with compiler.on_stage(spec.name, f"calibrating on {plan.samples} {calls}"):
            samples = record_inputs(model, engines, spec.name, spec.profile.opt, plan, prompt_inputs,
                                    model.fixed_arguments(spec.profile))
        compiler.records += [StageRecord(r.component, f"calibration {r.stage}", r.status, r.key, r.seconds, r.detail)
                             for r in sub.records]
        compiler.intermediates |= sub.intermediates
        if not compiler.options.keep_intermediate:  # the recording engines were only a means
            for key in sub.built.values():
                compiler.cache.remove(key, wait=False)
        return samples

    return stored_samples(compiler, spec, record)


def with_activations(model: Model, specs: dict[str, ComponentSpec], options: CompileOptions
                     ) -> dict[str, ComponentSpec]:
    """`specs` with the int8 recipe of each component `options.int8_activations` names made the calibrated one
    (activations in int8 too), calibrated on CALIBRATION_RUNS of the pipeline's text-to-image runs with its
    denoiser's steps and guidance. Refused before any work where the compile does not build the component in int8,
    or text-to-image does not run it (no call to record)."""
    names = int8_components("int8_activations", specs, options)
    if not names:
        return specs
    ran = model.family.task_components("txt2img", model)
    denoiser = next((specs[name] for name in model.family.denoiser_components(model) if name in specs), None)
    plan = {**(denoiser.calibration if denoiser is not None else {}),
            "samples": min(options.calibration_samples, CALIBRATION_RUNS)}
    chosen = dict(specs)
    for name in names:
        if name not in ran:
            raise InvalidOptions(f"`int8_activations` names {name}, which text-to-image does not run: its int8 "
                                 f"activations are calibrated on its calls in text-to-image runs. Leave it out.")
        if specs[name].int8 != "full":  # a denoiser is calibrated on its own steps already
            chosen[name] = replace(specs[name], int8="full", calibration=plan)
    return chosen


def provide(compiler: Compiler, model: Model, specs: dict[str, ComponentSpec]) -> None:
    """Hand `compiler` the calibration samples of every spec whose int8 engine it will have to build."""
    for spec in specs.values():
        if compiler.needs_samples(spec):
            compiler.calibration[spec.name] = recorded_samples(compiler, model, spec)
