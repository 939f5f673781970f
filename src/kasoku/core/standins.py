"""What every engine-backed stand-in shares: it looks like the torch component to diffusers and runs engines.

diffusers' own pipelines run unchanged on top of stand-ins: each looks like the torch component to
diffusers (its config, dtype, device and call signature) and runs a compiled engine instead. The
stand-ins report the engine's real device and dtype, so diffusers creates latents where the
engines read them (on a GPU engine, no tensor crosses to the CPU between steps). Each architecture
module (:mod:`kasoku.architectures`) defines the stand-ins of its torch modules on this base.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import KasokuError


class InvalidInput(KasokuError, ValueError):
    """A pipeline argument that cannot be served; raised before any engine runs."""


@dataclass
class EngineTimes:
    """Seconds spent in each engine (and how many calls) since the last reset."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


class EngineModule(torch.nn.Module):
    """Looks like the torch component to diffusers (config, dtype, device); runs engines.

    `engines` maps component names to engines (objects with `run(inputs) -> outputs`, `spec`, `dtype` and
    `device`, see kasoku.backends.Engine); the stand-in reads it on every call, so rebinding weights swaps
    entries under it."""

    def __init__(self, original: torch.nn.Module, engines: Mapping[str, Any], times: EngineTimes, component: str):
        super().__init__()
        self.config = getattr(original, "config", None)  # a block of a transformer has none
        self._engines = engines
        self._times = times
        self._component = component

    @property
    def engine(self):
        """This stand-in's engine (for its dtype and device: another of the pipeline's engines when its
        own was not compiled, e.g. the VAE in a run that keeps the latents)."""
        return self._engines.get(self._component) or next(iter(self._engines.values()))

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.dtype

    @property
    def device(self) -> torch.device:
        return self.engine.device

    _cache_branch: str | None = None

    @contextlib.contextmanager
    def cache_context(self, name: str, **_where: Any) -> Iterator[None]:
        """diffusers' CacheMixin: the pipeline names the branch of a step it runs (Flux's true CFG: "cond", then
        "uncond"); step caching keeps a state per branch (kasoku.core.step_cache), as diffusers' hooks do."""
        before, self._cache_branch = self._cache_branch, name
        try:
            yield
        finally:
            self._cache_branch = before

    def _run(self, component: str, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        return self._run_engine(component, self._engines[component], inputs)

    def _run_engine(self, component: str, engine, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`engine` (one of `component`'s) on `inputs`, timed as `component` and its outputs checked."""
        start = time.perf_counter()
        outputs = engine.run(dict(inputs))
        self._times.seconds[component] += time.perf_counter() - start
        self._times.calls[component] += 1
        check_outputs(component, getattr(engine, "precision", None), outputs)
        return outputs


class BrokenEngineOutput(KasokuError, RuntimeError):
    """An engine gave NaN, Inf or (for an image or a denoiser's prediction) one value everywhere: never an image."""


# Outputs a working engine never fills with one value (a decoded image, a denoiser's prediction); others may be
# (a ControlNet's residuals at conditioning scale 0 are zeros).
NEVER_CONSTANT = ("sample", "out_sample")


def check_outputs(component: str, precision: Any, outputs: Mapping[str, torch.Tensor]) -> None:
    """Raise :class:`BrokenEngineOutput`, naming the component and precision, for an output that is not finite, or
    constant where it never is: a black image is an error, not a result."""
    for name, value in outputs.items():
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() == 0:
            continue
        what = f"the {component} engine ({getattr(precision, 'value', precision) or 'its precision'})"
        if not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            raise BrokenEngineOutput(
                f"{what} gave {bad} NaN/Inf value(s) in {name!r} of {value.numel()}; the image is not returned. "
                "Check the inputs (prompt embeddings, latents) for NaN/Inf, or compile the component in fp32 "
                "(--precision fp32) if this precision overflows.")
        if name in NEVER_CONSTANT and value.numel() > 1 and bool(value.amax() == value.amin()):
            raise BrokenEngineOutput(
                f"{what} gave {name!r} as one value everywhere ({float(value.reshape(-1)[0]):g}): a blank image; "
                "it is not returned. Run `kasoku verify MODEL` to find the component that differs from torch.")


def timesteps_for(timestep, batch: int) -> torch.Tensor:
    """diffusers' timestep (a number or a 0-d/1-d tensor) as the engines take it: fp32, one per image."""
    return torch.as_tensor(timestep, dtype=torch.float32).reshape(-1).expand(batch).contiguous()


class StepCacheTargets:
    """Stand-ins that share one call's step-cache run: a U-Net, and the ControlNets that feed it (they skip the steps
    the run does not compute in full)."""

    def __init__(self, targets: Iterator[Any] | tuple[Any, ...]):
        self.targets = tuple(targets)

    @contextlib.contextmanager
    def step_cache(self, run) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for target in self.targets:
                stack.enter_context(target.step_cache(run))
            yield


@contextlib.contextmanager
def call_state(owner: Any, attribute: str, value: Any) -> Iterator[None]:
    """`owner.attribute` is `value` for one pipeline call (a step-cache run), and None again after it."""
    setattr(owner, attribute, value)
    try:
        yield
    finally:
        setattr(owner, attribute, None)
