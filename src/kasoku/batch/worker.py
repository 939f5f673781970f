"""What a worker holds (one compiled pipeline) and does (a batch of jobs into PNGs); the same class
runs in this process and as a Ray actor, so both make the same pipeline calls and write the same bytes."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ..core.components import ShapeProfile
from ..core.options import CompileOptions
from .jobs import Job, call_arguments
from .output import STATE_DIR, JobResult, write_atomically

StageHook = Callable[[str, str], contextlib.AbstractContextManager]


@dataclass(frozen=True)
class PipelineRecipe:
    """How a worker loads its compiled pipeline from the cache. Small and picklable: it travels to
    Ray workers, so paths are absolute, the cache folder is explicit and, once the driver has
    compiled, `options.backend` is the mapping component -> backend that `auto` resolved to, so every
    worker runs exactly the driver's engines."""

    model: str
    options: CompileOptions
    controlnets: tuple[str, ...] = ()  # ControlNet folders (absolute paths), in order

    def reference(self):
        """The model (with its ControlNets), its modules on the meta device until needed."""
        from ..model.pipeline_model import Model

        return Model.load(self.model, lazy=True, controlnet=list(self.controlnets) or None, label=self.model)

    def load(self, reference=None, on_stage: StageHook | None = None):
        """A KasokuPipeline; from the cache when the engines are built (the usual case)."""
        from ..pipeline.kasoku_pipeline import compile

        reference = reference if reference is not None else self.reference()
        options = self.options
        if options.components is None:
            options = options.replace(components=txt2img_components(reference))
        return compile(reference, options=options, on_stage=on_stage, label=self.model)

    def resolved(self, pipeline) -> PipelineRecipe:
        """This recipe with the backends a compiled pipeline runs (what `auto` chose)."""
        backends = dict(pipeline.compile_report.backends)
        return replace(self, options=self.options.replace(backend=backends, components=tuple(backends)))


def txt2img_components(pipe) -> tuple[str, ...]:
    """The components text-to-image runs (never the VAE encoder)."""
    from ..model.pipeline_model import Model

    return Model.of(pipe).task_components("txt2img")


def batch_profile(pipe, batch_size: int, height: tuple[int, ...] | None = None,
                  width: tuple[int, ...] | None = None, jobs=()) -> ShapeProfile:
    """What the engines serve: up to `batch_size` images per call; the height and width ranges
    (MIN:MAX or MIN:OPT:MAX, as for `kasoku compile`) where given, else the jobs' one size when they
    share it (exact-shape engines: static height and width), else the model's default range; and
    guidance when every job uses it, none when no job does."""
    from dataclasses import replace

    from ..core.components import profile_with_ranges
    from ..model.pipeline_model import Model

    model = Model.of(pipe)
    base = model.default_profile()
    sizes = {(job.height, job.width) for job in jobs}
    if len(sizes) == 1 and None not in next(iter(sizes)):
        (h, w), = sizes
        height, width = height or (h, h, h), width or (w, w, w)
    guided = {model.doubles_batch({"guidance_scale": job.guidance}) for job in jobs}
    batch = (1, 1, max(base.max.batch, batch_size)) if jobs else \
        (base.min.batch, base.opt.batch, max(base.max.batch, batch_size))
    profile = profile_with_ranges(base, batch, height, width)
    return replace(profile, guidance=next(iter(guided))) if len(guided) == 1 else profile


class AdapterSwitch:
    """The LoRA adapter set a pipeline runs, switched per call (`kasoku batch`'s batches, `kasoku serve`'s calls):
    each file is loaded once, and a switch rebinds the run-time weights."""

    def __init__(self, pipeline):
        self.pipeline = pipeline
        self._names: dict[str, str] = {}  # LoRA file -> its adapter name in the pipeline
        self._running: tuple | None = ()  # the adapter set the pipeline runs now (None: not known)

    def load(self, path: str) -> str:
        """The adapter name of the file at `path`, loaded into the pipeline on first use."""
        if path not in self._names:
            self._names[path] = f"lora{len(self._names)}"
            self.pipeline.load_lora_weights(path, adapter_name=self._names[path])
            self._running = None  # loading activates the adapter (diffusers' way): the next `use` sets the set
        return self._names[path]

    def use(self, loras: tuple[tuple[str, float], ...]) -> None:
        """Run ((path, scale), ...) from the next call on; () runs the base weights."""
        if loras == self._running:
            return
        for path, _scale in loras:
            self.load(path)
        self.pipeline.set_adapters([self._names[path] for path, _ in loras], [scale for _, scale in loras])
        self._running = loras


class ImagePromptSwitch:
    """The IP-Adapters a pipeline runs, switched per call: an adapter set is loaded when it changes (its engines
    come from the cache after the first; a second adapter of the same kind binds its weights), and unloaded for
    calls without an image prompt."""

    def __init__(self, pipeline):
        self.pipeline = pipeline
        self._running: tuple[str, ...] = ()

    def use(self, image_prompt: tuple) -> dict:
        """The call arguments of `image_prompt` ((adapters, images, scales), or () for none), its adapters loaded."""
        from PIL import Image

        adapters, images, scales = image_prompt or ((), (), ())
        if adapters != self._running:
            if adapters:
                from ..runtime.image_prompts import file_arguments

                self.pipeline.load_ip_adapter(**file_arguments(adapters, family=self.pipeline.family))
            else:
                self.pipeline.unload_ip_adapter()
            self._running = adapters
        if not adapters:
            return {}
        self.pipeline.set_ip_adapter_scale(list(scales) if len(scales) > 1 else scales[0])
        opened = [Image.open(path).convert("RGB") for path in images]
        return {"ip_adapter_image": opened if len(opened) > 1 else opened[0]}


# ---- the worker --------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerInfo:
    """What starting one worker cost, timed inside it (and, for Ray workers, by the driver)."""

    name: str  # host:pid
    node: str
    pid: int
    import_seconds: float  # torch, diffusers, kasoku: paid once per fresh process
    model_seconds: float  # the diffusers pipeline (tokenizer, scheduler, configs, weights to fingerprint)
    engine_seconds: float  # the engines: loaded from the cache, or built first where `built_stages`
    built_stages: int = 0  # cache entries this worker had to build (0 on Ray: the driver built them)
    startup_seconds: float | None = None  # Ray: from asking for the worker to its first answer (spawn and all)

    @property
    def load_seconds(self) -> float:
        return self.model_seconds + self.engine_seconds


def describe_backends(pipeline) -> str:
    """"onnxruntime" when every engine runs on it, else "text_encoder=openvino, unet=onnxruntime, ..."."""
    backends = {name: engine.backend for name, engine in pipeline.engines.items()}
    if len(set(backends.values())) == 1:
        return next(iter(backends.values()))
    return ", ".join(f"{name}={backend}" for name, backend in backends.items())


class BatchWorker:
    """Holds one compiled pipeline and turns batches of jobs into PNGs in the output folder.

    The same class runs in this process (run_local) and as a Ray actor (run_ray): both make the same
    pipeline calls, so they write the same bytes."""

    def __init__(self, recipe: PipelineRecipe, out_dir: str, reference=None, on_stage: StageHook | None = None):
        start = time.perf_counter()
        import torch

        from ..core.console import quiet_third_party_logs

        quiet_third_party_logs()
        imported = time.perf_counter()
        if recipe.options.threads:  # the scheduler's and latents' torch ops share the worker's CPUs
            torch.set_num_threads(recipe.options.threads)
        reference = reference if reference is not None else recipe.reference()
        loaded = time.perf_counter()
        self.pipeline = recipe.load(reference, on_stage)
        self.seconds = (imported - start, loaded - imported, time.perf_counter() - loaded)
        self.node = socket.gethostname()
        self.name = f"{self.node}:{os.getpid()}"
        self.backend = describe_backends(self.pipeline)
        self.out = Path(out_dir)
        self.tmp = self.out / STATE_DIR / "tmp"
        self.status_file = self.out / STATE_DIR / "workers" / f"{self.node}-{os.getpid()}.json"
        self.adapters = AdapterSwitch(self.pipeline)
        self.image_prompts = ImagePromptSwitch(self.pipeline)
        self._write_status([])  # also proves that this node can write the output folder

    def info(self) -> WorkerInfo:
        imports, model, engines = (round(s, 3) for s in self.seconds)
        report = self.pipeline.compile_report
        built = sum(stage.status != "reused" for stage in report.stages) if report else 0
        return WorkerInfo(self.name, self.node, os.getpid(), imports, model, engines, built)

    def run(self, batch: list[Job]) -> list[JobResult]:
        """Generate one call's images, write each atomically; the results for the driver to record."""
        self._write_status(batch)
        images, seconds = self._generate(batch)
        for job, image in zip(batch, images):
            write_atomically(self.out / job.file, lambda f, image=image: image.save(f, format="PNG"), self.tmp)
        self._write_status([])
        share = seconds / len(batch)
        return [JobResult(job.id, job.seed, job.file, round(share, 6), self.backend, self.name, len(batch), job.key)
                for job in batch]

    def _generate(self, batch: list[Job]):
        first = batch[0]
        self.adapters.use(first.loras)  # a batch shares one adapter set (its call key)
        image_prompt = self.image_prompts.use(first.image_prompt)  # and one image prompt
        start = time.perf_counter()
        images = self.pipeline(**call_arguments(batch), height=first.height, width=first.width,
                               **_control_arguments(batch), **image_prompt).images
        return images, time.perf_counter() - start

    def _write_status(self, batch: list[Job]) -> None:
        """Which jobs this worker is on (a folder of these shows a run's progress per worker)."""
        status = {"worker": self.name, "pid": os.getpid(), "jobs": [job.id for job in batch], "since": time.time()}
        write_atomically(self.status_file, lambda f: f.write(json.dumps(status).encode()), self.tmp)




def _control_arguments(batch: list[Job]) -> dict:
    """The batch's control images (one per job, or per job one per ControlNet: diffusers' per-prompt
    nested form) and its control scale (the jobs of one call share it)."""
    from PIL import Image

    first = batch[0]
    if not first.control_image:
        return {}
    images = [[Image.open(path).convert("RGB") for path in job.control_image] for job in batch]
    arguments = {"control_image": [per_job[0] for per_job in images] if len(first.control_image) == 1 else images}
    if first.control_scale is not None:
        scale = first.control_scale
        arguments["controlnet_conditioning_scale"] = list(scale) if isinstance(scale, tuple) else scale
    return arguments
