"""Step caching inside the engines: DeepCache (Ma, Fang and Wang, "DeepCache: Accelerating Diffusion
Models for Free", CVPR 2024).

A U-Net's deep features change little from one denoising step to the next. On a *full* step the
whole U-Net runs and the input of the up layer at a chosen skip branch (the *deep feature*) is kept;
on the other steps only the outer layers run: the down layers up to that branch (so its skip feature
is computed fresh) and the up layers from that branch outwards, on the deep feature of the last full
step. kasoku builds this into the engines as two components from the same weights, exported,
optimized, built, cached and parity-checked like every other component:

- ``unet_full``: the whole U-Net, returning its noise prediction and the deep feature;
- ``unet_shallow``: the outer layers, taking the deep feature as one more input.

This module is what every step-caching method shares: the names, the schedules and one call's state
(:class:`StepCacheRun`). The U-Net's graphs (which layers a skip branch runs) are the U-Net's own, in
:mod:`kasoku.architectures.deepcache`.

A schedule says which steps of one call's denoising loop are full (the first always is):
``uniform`` (the paper's 1:N: every `interval`-th step) or ``nonuniform`` (the paper's non-uniform
1:N, Section 3.3: as many full steps, denser around a centre step; see :func:`full_steps`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import KasokuError

if TYPE_CHECKING:
    import torch

FULL = "unet_full"
SHALLOW = "unet_shallow"
COMPONENTS = (FULL, SHALLOW)
FEATURE = "deep_feature"
DEFAULT_BRANCH = 0  # the outermost skip branch: the reference implementation's default
SCHEDULES = ("uniform", "nonuniform")
DEFAULT_SCHEDULE = "uniform"
NONUNIFORM_POWER = 1.4  # the reference's p
NONUNIFORM_CENTER = 0.3  # c as a share of the loop: the reference's c = 15 of 50 steps



class InvalidStepCache(KasokuError, ValueError):
    """A step-caching setting that cannot be served (an interval, schedule or branch)."""


def check_interval(value: Any, name: str = "cache_interval") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidStepCache(f"`{name}` must be a positive int (1: every step runs the whole U-Net, no "
                               f"caching) but is {value!r}.")
    return value


def check_schedule(value: Any, name: str = "cache_schedule") -> str:
    if value not in SCHEDULES:
        raise InvalidStepCache(f"`{name}` must be one of {', '.join(SCHEDULES)} but is {value!r}.")
    return value


# ---- schedules ---------------------------------------------------------------------------------


def full_steps(length: int, interval: int, schedule: str = DEFAULT_SCHEDULE) -> tuple[int, ...]:
    """The steps (0-based) of a `length`-step denoising loop that run the whole U-Net.

    uniform: 0, N, 2N, ... (the paper's 1:N). nonuniform: the paper's non-uniform 1:N (Section 3.3),
    with as many full steps k = ceil(T / N) as the uniform schedule: i_k = l_k^p + c for l_k evenly
    spaced over [(-c)^(1/p), (T - c)^(1/p)) (signed powers), made integers and distinct, so full steps
    are densest around the centre step c = 0.3 T and sparser away from it; p starts at 1.4 and is
    lowered by 0.02 until the k integers are distinct, as the reference does (p = 1 always is: evenly
    spaced steps). The reference code raises negative numbers to fractional powers in complex numbers;
    kasoku computes the paper's formula with signed real powers."""
    check_interval(interval)
    check_schedule(schedule, "schedule")
    if interval == 1 or length <= 1:
        return tuple(range(length))
    if schedule == "uniform":
        return tuple(range(0, length, interval))
    return _nonuniform(length, math.ceil(length / interval))


def _signed_power(value: float, power: float) -> float:
    return math.copysign(abs(value) ** power, value)


def _nonuniform(length: int, count: int) -> tuple[int, ...]:
    center = round(NONUNIFORM_CENTER * length)
    for hundredths in range(round(NONUNIFORM_POWER * 100), 99, -2):
        power = hundredths / 100
        start, end = _signed_power(-center, 1 / power), _signed_power(length - center, 1 / power)
        points = (start + (end - start) * k / count for k in range(count))
        # the small epsilon keeps an integer that float rounding put just below itself
        steps = {0} | {min(length - 1, max(0, math.floor(_signed_power(x, power) + center + 1e-9))) for x in points}
        if len(steps) == count:
            return tuple(sorted(steps))
    raise AssertionError("unreachable: at p = 1 the steps are evenly spaced and distinct")


@dataclass
class StepCacheRun:
    """One pipeline call's step caching: the schedule, the step counter and the deep feature of the
    last full step. `loop_length` gives the number of U-Net calls of the call's denoising loop; it is
    read at the first step (a pipeline knows it only once its timesteps are set)."""

    interval: int
    schedule: str
    loop_length: Callable[[], int]
    step: int = 0
    feature: torch.Tensor | None = field(default=None, repr=False)
    full: frozenset[int] | None = None

    def denoise(self, run: Callable[..., dict[str, torch.Tensor]], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One denoising step: the full graph (its deep feature kept) or the shallow one on that feature.
        `run(component, **inputs)` runs an engine and returns its outputs."""
        if self.next_is_full():
            outputs = run(FULL, **inputs)
            self.feature = outputs[FEATURE]
            return outputs["out_sample"]
        return run(SHALLOW, **inputs, **{FEATURE: self.feature})["out_sample"]

    def next_is_full(self) -> bool:
        """Whether the next step runs the whole U-Net (and count it)."""
        if self.full is None:
            self.full = frozenset(full_steps(self.loop_length(), self.interval, self.schedule))
        full = self.feature is None or self.step in self.full
        self.step += 1
        return full


