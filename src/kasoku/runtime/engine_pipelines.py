"""A model's diffusers pipelines on engines: the runtime every image kasoku makes goes through.

The seed needed a custom pipeline per task (stable_diffusion_tensorrt_txt2img, ...). kasoku does not
re-write the recipe: the torch modules of a diffusers pipeline are replaced by engine-backed stand-ins
(the family says which, its architectures define them), and diffusers' own pipelines of that family run
unchanged on top of them, one per task. Call signature, schedulers, image processing, callbacks and
outputs are therefore diffusers' own, and the same seed gives the same image.

:class:`EnginePipelines` is that runtime alone, with no checks of its own: :class:`kasoku.KasokuPipeline`
checks every call first and runs it here; int8 calibration and ``precision="fastest"`` run it directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..backends import Engine
from ..core.errors import KasokuError
from ..core.standins import EngineTimes, InvalidInput
from ..core.step_cache import StepCaching, run_for
from ..model.pipeline_model import Model

__all__ = ["EnginePipelines"]


class EnginePipelines:
    """`model`'s diffusers pipelines for `tasks` (default: every task its family has a pipeline for) on stand-ins
    over `engines`.

    `engines` is read on every call: rebinding weights (LoRA) swaps its entries under the stand-ins."""

    def __init__(self, model: Model, engines: Mapping[str, Engine], times: EngineTimes | None = None,
                 tasks: Iterable[str] | None = None):
        self.model = model
        self.engines = engines
        self.times = times or EngineTimes()
        self.stand_ins = model.family.stand_ins(model, engines, self.times)
        self.pipes = {task: model.task_pipeline(task, **self.stand_ins)
                      for task in (model.pipeline_tasks if tasks is None else tasks)}
        self._step_cache_target = model.family.step_cache_target(self.stand_ins, model)

    def __call__(self, task: str, *, step_cache=None, **kwargs: Any):
        """diffusers' call of the `task` pipeline (its own arguments), with `step_cache` for this call only."""
        pipe = self.pipes[task]
        try:
            if step_cache is None:
                return pipe(**kwargs)
            with self._step_cache_target.step_cache(step_cache):
                return pipe(**kwargs)
        except ValueError as error:
            if isinstance(error, KasokuError):
                raise
            # diffusers' own input checks (a size its resolution binning has no bucket for): one line, not a trace
            raise InvalidInput(f"diffusers' {type(pipe).__name__} refused the call: {error}") from error

    def step_cache_run(self, task: str, caching: StepCaching):
        """One call's step-caching state (None when `caching` is off); a DeepCache loop's length is read from the
        pipeline once its timesteps are set."""
        pipe = self.pipes[task]
        return run_for(caching, loop_length=lambda: pipe.num_timesteps)
