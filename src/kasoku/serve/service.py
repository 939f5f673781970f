"""What one server process (or one Ray Serve replica) holds and does: the compiled pipeline, the
batcher and the metrics; a checked request in, its images out."""

from __future__ import annotations

import asyncio
import base64
import inspect
import io
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from ..batch.jobs import call_arguments
from ..batch.worker import AdapterSwitch, PipelineRecipe, StageHook, describe_backends
from ..core.errors import KasokuError
from .batching import Batcher, CallAbandoned
from .config import ServeConfig
from .errors import InvalidRequest, NotReady
from .fields import ImageRequest, ServeJob, task_arguments
from .metrics import Metrics


class EnginesNotCached(KasokuError):
    """A Ray Serve replica found engines missing from the cache: replicas load, they never build."""


class ImageService:
    """The engines, the queue and the counts behind the HTTP routes (:mod:`kasoku.serve.app`)."""

    def __init__(self, config: ServeConfig):
        self.config = config
        self.metrics = Metrics(config.max_batch)
        self.pipeline = None
        self.batcher: Batcher | None = None
        self.replica = f"{socket.gethostname()}:{os.getpid()}"
        self.startup: dict[str, Any] = {}  # what loading the engines took and found
        self.failure: str | None = None  # why the engines could not be loaded

    # ---- engines ----------------------------------------------------------------------------------

    def load(self, reference=None, on_stage: StageHook | None = None, *, build: bool = True) -> None:
        """Compile or load the engines (blocking; minutes when they must be built). With `build` False
        (Ray Serve replicas) engines missing from the cache are an error, not a build."""
        start = time.perf_counter()
        if not build:
            self._check_cached()
        pipeline = PipelineRecipe(self.config.model, self.config.options).load(reference, on_stage)
        pipeline.set_progress_bar_config(disable=True)
        report = pipeline.compile_report
        self.startup = {"seconds": round(time.perf_counter() - start, 3), "engines_built": report.built,
                        "backends": describe_backends(pipeline)}
        self.adapters = AdapterSwitch(pipeline)
        for _name, path in self.config.loras:  # each adapter read once, before the first request
            self.adapters.load(path)
        if self.config.ip_adapter is not None:  # its engines built (or loaded) before the first request
            from ..runtime.image_prompts import file_arguments

            pipeline.load_ip_adapter(**file_arguments([self.config.ip_adapter], family=pipeline.family))
        self.pipeline = pipeline
        self.metrics.ready.set(1)

    def _check_cached(self) -> None:
        from ..build.compiler import cached_profile

        options = self.config.options
        if cached_profile(self.config.model, options, [options.profile]) is None:
            raise EnginesNotCached(
                f"the engines of {self.config.model} are not in the cache at {options.cache_dir}: Ray Serve replicas "
                "load engines, the driver builds them. On a cluster, every node must see the model and --cache-dir "
                "at the same paths (shared storage).")

    @property
    def ready(self) -> bool:
        return self.pipeline is not None and self.batcher is not None

    async def start(self) -> None:
        self.batcher = Batcher(self._run_call, max_batch=self.config.max_batch,
                               window_s=self.config.batch_window_ms / 1000, max_queue=self.config.max_queue,
                               on_call=self._on_call, on_queue=self.metrics.queue_depth.set)
        self.batcher.start()

    async def stop(self) -> None:
        """Finish what is queued and running (the HTTP server has stopped taking requests by now)."""
        if self.batcher is not None:
            await self.batcher.stop(grace_s=self.config.timeout)

    # ---- requests ---------------------------------------------------------------------------------

    def check(self, request: ImageRequest) -> None:
        """What only the compiled pipeline can say (its profile, its engines, the model's own rules),
        for a call of this request's images, before anything is queued: a request that passes can
        share any call its call key allows."""
        if not self.ready:
            raise NotReady(self._not_ready_message(), retry_after=5)
        kwargs = request.call_arguments(min(request.n, self.config.max_batch))
        if self.config.ip_adapter is not None and request.image_prompt is None:
            kwargs.update(self._blank_prompt(request.size.width, request.size.height))
        image, mask = kwargs.pop("image", None), kwargs.pop("mask_image", None)
        try:
            self.pipeline.check_inputs(request.task, kwargs.pop("prompt"), image, mask, **kwargs)
        except KasokuError as error:
            raise InvalidRequest(str(error)) from None

    def _not_ready_message(self) -> str:
        if self.failure:
            return f"the engines could not be loaded: {self.failure}"
        return "the engines are still loading; GET /readyz answers 200 once they are."

    async def generate(self, request: ImageRequest, arrived: float) -> list[Any]:
        """The request's images (PIL), in seed order; raises QueueFull or TimedOut."""
        self.check(request)
        images = await self.batcher.submit(request.jobs(), deadline=arrived + self.config.timeout)
        self.metrics.images.inc(len(images))
        return images

    def _run_call(self, jobs: list[ServeJob], wanted) -> list[Any]:
        """One engine call (on the engine thread): the shared call arguments of `kasoku batch`, plus
        what the task takes; it stops between steps once no image of it is awaited."""

        self.metrics.running.set(len(jobs))
        try:
            self.adapters.use(jobs[0].loras)  # a call shares one adapter set (its call key)
            prompt = self._image_prompt(jobs[0])
            return self.pipeline(**call_arguments(jobs), **task_arguments(jobs), **prompt,
                                 **_stopping_between_steps(self.pipeline, wanted)).images
        finally:
            self.metrics.running.set(0)

    def _image_prompt(self, job: ServeJob) -> dict[str, Any]:
        """The server's IP-Adapter at the job's scale (its image in `task_arguments`); without an image prompt, at
        scale 0 on a blank image: the U-Net's own result."""
        if self.config.ip_adapter is None:
            return {}
        if job.image_prompt is not None:
            self.pipeline.set_ip_adapter_scale(job.image_prompt.scale)
            return {}
        self.pipeline.set_ip_adapter_scale(0.0)
        return self._blank_prompt(job.width, job.height)

    @staticmethod
    def _blank_prompt(width: int, height: int) -> dict[str, Any]:
        from PIL import Image

        return {"ip_adapter_image": Image.new("RGB", (width, height))}

    def _on_call(self, size: int, seconds: float) -> None:
        self.metrics.call(size, seconds)

    # ---- answers ----------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """What GET /readyz says."""
        options = self.config.options
        return {"ready": self.ready, "model": self.config.model_name, "sizes": [str(s) for s in self.config.sizes],
                "max_batch": self.config.max_batch, "batch_window_ms": self.config.batch_window_ms,
                "max_queue": self.config.max_queue, "timeout": self.config.timeout,
                "precision": options.precision_label, "profile": options.profile.to_dict(), "replica": self.replica,
                "loras": list(self.config.lora_names),
                **self.startup,
                **({"failure": self.failure} if self.failure else {})}


def png_base64(images: list[Any]) -> list[str]:
    """Each image as base64 PNG (what `response_format` b64_json carries)."""
    encoded = []
    for image in images:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        encoded.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return encoded


async def encode(images: list[Any]) -> list[str]:
    return await asyncio.to_thread(png_base64, images)


__all__ = ["EnginesNotCached", "ImageService", "encode", "png_base64"]


def _stopping_between_steps(pipeline, wanted: Callable[[], bool]) -> dict[str, Any]:
    """The step callback that stops a call once none of its images is awaited, in the form the pipeline takes:
    `callback_on_step_end`, or the older `callback` with `callback_steps` (PixArt's); none where it has neither."""
    def stop_when_unwanted(*args):
        if not wanted():
            raise CallAbandoned()
        return args[-1] if len(args) == 4 else None  # the new form hands back its callback kwargs

    parameters = inspect.signature(pipeline).parameters
    if "callback_on_step_end" in parameters:
        return {"callback_on_step_end": stop_when_unwanted}
    if "callback" in parameters and "callback_steps" in parameters:
        return {"callback": stop_when_unwanted, "callback_steps": 1}
    return {}
