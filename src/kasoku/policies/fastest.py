"""`--precision fastest`: per component, the fastest precision whose measured image drift fits.

`auto` never lowers precision by itself; this is how a user lets it. The images of the model's
own task (text-to-image, or inpainting for an inpainting model) at the profile's optimum size, on
verify's fidelity prompts at the contract's steps and with the same initial latents, are the
measure: first all fp32 (the reference), then, component by component from the one that takes the
longest, each faster precision in turn, fastest first; a precision is kept when every image stays
at least `min_psnr` dB from the fp32 images. What was tried, kept and refused, and why, goes into the
compile report's notes.
"""

from __future__ import annotations

import torch

from ..build.compiler import Compiler, measure
from ..core.cache import Cache
from ..core.components import ComponentSpec, Precision
from ..core.errors import KasokuError
from ..core.options import CompileOptions
from ..core.parity import TOLERANCES, psnr
from ..model.pipeline_model import Model
from ..runtime.engine_pipelines import EnginePipelines
from . import calibration
from .fidelity import FIDELITY_PROMPTS, VERIFY_SEED, contract_steps, diffusers_inputs, task_inputs

# Fastest first: what is tried for each component (those its backend cannot build here are skipped).
CANDIDATES = (Precision.INT8, Precision.BF16, Precision.FP16)
PROMPTS = 2  # of verify's fidelity prompts
SPEED_MARGIN = 0.95  # a precision must take at most this share of fp32's time to be worth its drift


def choose_precisions(model: Model, specs: dict[str, ComponentSpec], options: CompileOptions, cache: Cache, *,
                      on_stage) -> tuple[dict[str, Precision], list[str]]:
    """(component -> precision, notes saying what was chosen and why)."""
    task = model.task
    profile = next(iter(specs.values())).profile
    shape = profile.opt
    extra = diffusers_inputs(model, task, task_inputs(model, task, shape))
    steps = contract_steps(model, task, TOLERANCES[Precision.BF16].image_steps)
    measured = [n for n in model.task_components(task) if n in specs]

    built: dict[str, set[tuple[Precision, str]]] = {}  # the trials' engine entries: (precision, key) per component

    def engines_for(precisions: dict[str, Precision]):
        compiler = Compiler(cache, options.replace(precision=precisions), on_stage=on_stage, label=model.label)
        calibration.provide(compiler, model, specs)
        engines = {name: compiler.engine(spec, compiler.choose(spec)[0]) for name, spec in specs.items()}
        for (name, _backend), key in compiler.built.items():
            built.setdefault(name, set()).add((precisions[name], key))
        return engines

    def images(engines) -> list:
        run = EnginePipelines(model, engines, tasks=(task,))
        return [run(task, prompt=prompt, num_inference_steps=steps, height=shape.height, width=shape.width,
                    output_type="np", generator=torch.Generator().manual_seed(VERIFY_SEED), **extra).images
                for prompt in FIDELITY_PROMPTS[:PROMPTS]]

    chosen = {name: Precision.FP32 for name in specs}
    fp32 = engines_for(chosen)
    reference = images(fp32)
    seconds = {name: {Precision.FP32: measure(fp32[name], specs[name], repeats=1)} for name in measured}
    notes = [f"{name}: fp32 (not run by {task}; its drift cannot be measured here)"
             for name in specs if name not in measured]
    for name in sorted(measured, key=lambda n: -seconds[n][Precision.FP32]):
        tried = []
        for precision in CANDIDATES:
            trial = {**chosen, name: precision}
            try:
                engines = engines_for(trial)
            except KasokuError as error:  # a precision this backend or CPU cannot build
                tried.append(f"{precision.value} cannot be built here ({str(error).splitlines()[0]})")
                continue
            seconds[name][precision] = measure(engines[name], specs[name], repeats=1)
            share = seconds[name][precision] / seconds[name][Precision.FP32]
            if share > SPEED_MARGIN:
                tried.append(f"{precision.value} is not faster ({share:.2f}x fp32's time)")
                continue
            drift = min(psnr(r, a) for r, a in zip(reference, images(engines)))
            if drift >= options.min_psnr:
                chosen = trial
                tried.append(f"{precision.value}: {1 / share:.2f}x fp32's speed, images {drift:.1f} dB from fp32 "
                             f"(>= {options.min_psnr:g})")
                break
            tried.append(f"{precision.value} drifts to {drift:.1f} dB (< {options.min_psnr:g})")
        notes.append(f"{name}: {chosen[name].value} (" + "; ".join(tried) + ")")
    if not options.keep_intermediate:  # the trials' engines in the precisions not chosen leave the cache
        for name, entries in built.items():
            for precision, key in entries:
                if precision != chosen[name]:
                    cache.remove(key, wait=False)
    return chosen, notes
