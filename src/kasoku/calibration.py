"""Calibration data for int8: a component's inputs recorded during the pipeline's own denoising runs.

As optimum-intel does for its hybrid mode, the U-Net is calibrated on what it actually sees: the
family's text-to-image pipeline runs over a built-in prompt set at the profile's optimum size,
with guidance, on engines of a higher precision (bf16 where the CPU has it natively, else fp32),
and every input the U-Net engine is called with is recorded until `samples` calls are collected.
The recording is a cache entry, so an int8 build calibrates once.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .components import ImageShape

CALIBRATION_FILE = "calibration.npz"
CALIBRATION_PROMPTS = (
    "a photograph of an astronaut riding a horse on mars",
    "a beautiful photograph of mt fuji during cherry blossom",
    "an oil painting of a castle on a hill at night, detailed",
    "a portrait of a woman with red hair, soft lighting, sharp focus",
    "a watercolor painting of a forest river in autumn",
    "a cinematic photo of a city street in the rain at night",
    "a drawing of a cat sitting on a sofa, high quality",
    "a digital illustration of a robot in a flower garden",
)


@dataclass(frozen=True)
class CalibrationPlan:
    """What the recording runs: prompts cycled until `samples` engine calls are recorded."""

    prompts: tuple[str, ...] = CALIBRATION_PROMPTS
    steps: int = 8
    samples: int = 32
    guidance: float = 7.5
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
        self.recorded.append({k: np.array(torch.as_tensor(v).detach().cpu().numpy()) for k, v in inputs.items()})
        return self._engine.run(inputs)


def record_inputs(pipe, engines: dict, component: str, shape: ImageShape, plan: CalibrationPlan
                  ) -> list[dict[str, np.ndarray]]:
    """`component`'s inputs during text-to-image runs of `pipe`'s family on `engines` (the text
    encoders' and the component's), at `shape`'s size, until `plan.samples` calls."""
    from .families import family_of
    from .standins import EngineTimes

    family = family_of(pipe)
    recorder = RecordingEngine(engines[component], plan.samples)
    runner = family.task_pipeline(pipe, "txt2img",
                                  **family.stand_ins(pipe, {**engines, component: recorder}, EngineTimes()))
    for index, prompt in enumerate(itertools.cycle(plan.prompts)):
        if len(recorder.recorded) >= plan.samples or index >= plan.samples:
            break
        try:
            runner(prompt, height=shape.height, width=shape.width, num_inference_steps=plan.steps,
                   guidance_scale=plan.guidance, generator=torch.Generator().manual_seed(plan.seed + index),
                   output_type="latent")
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
