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
        self.config = original.config
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

    def cache_context(self, name: str) -> contextlib.AbstractContextManager:
        """diffusers' CacheMixin names the branch of a step it runs (cond, uncond); the engines keep no torch
        hooks, so there is nothing to switch."""
        return contextlib.nullcontext()

    def _run(self, component: str, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        start = time.perf_counter()
        outputs = self._engines[component].run(inputs)
        self._times.seconds[component] += time.perf_counter() - start
        self._times.calls[component] += 1
        return outputs


def timesteps_for(timestep, batch: int) -> torch.Tensor:
    """diffusers' timestep (a number or a 0-d/1-d tensor) as the engines take it: fp32, one per image."""
    return torch.as_tensor(timestep, dtype=torch.float32).reshape(-1).expand(batch).contiguous()


@contextlib.contextmanager
def call_state(owner: Any, attribute: str, value: Any) -> Iterator[None]:
    """`owner.attribute` is `value` for one pipeline call (a step-cache run), and None again after it."""
    setattr(owner, attribute, value)
    try:
        yield
    finally:
        setattr(owner, attribute, None)
