"""The driver: every check before any work (`prepare`), then one loop (`drive`) that hands batches
to a runner (this process, or Ray actors) and records each result as it comes back."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..core.choices import DEFAULT_BATCH_SIZE
from ..core.errors import KasokuError
from ..core.options import CompileOptions
from ..core.step_cache import InvalidStepCache, StepCaching
from .jobs import InvalidJobs, Job, check_jobs, plan_batches, with_native_size
from .output import JobResult, OutputDir, check_output_dir
from .worker import BatchWorker, PipelineRecipe, StageHook, WorkerInfo, batch_profile, describe_backends


@dataclass
class BatchPlan:
    """Checked jobs, a writable output folder and how to load the pipeline: ready to run."""

    jobs: list[Job]
    out_dir: Path
    recipe: PipelineRecipe
    batch_size: int
    reference: Any = field(default=None, repr=False)  # the loaded diffusers pipeline (this process only)


def _portable_model(model, what: str = "model") -> str:
    """A model folder as an absolute path (Ray workers do not share our working directory)."""
    if isinstance(model, (str, Path)) and Path(model).expanduser().exists():
        return str(Path(model).expanduser().absolute())
    if not isinstance(model, (str, Path)):
        raise KasokuError(f"kasoku batch takes a {what} folder or hub id (workers load it themselves), "
                          f"not a {type(model).__name__}.")
    return str(model)


def prepare(model, jobs: list[Job], out_dir: str | Path, *, batch_size: int = DEFAULT_BATCH_SIZE,
            controlnet: list[str | Path] | None = None, options: CompileOptions | None = None,
            height: tuple[int, ...] | None = None, width: tuple[int, ...] | None = None, **fields) -> BatchPlan:
    """Every check before any work: the jobs (and their control images, with `controlnet` folders) against
    the profile the engines will serve, then the output folder (created last, so a bad job writes nothing).
    Reads the model's configs, not its weights nor the engines."""
    from ..core.cache import default_cache_dir
    from ..core.schedulers import most_steps
    from ..pipeline.checks import MAX_SIZE_FACTOR

    options = CompileOptions.of(options, **fields)
    model = _portable_model(model)
    controlnets = tuple(_portable_model(c, "ControlNet") for c in
                        (controlnet if isinstance(controlnet, (list, tuple)) else [controlnet] if controlnet else []))
    recipe = PipelineRecipe(model=model, options=options, controlnets=controlnets)
    reference = recipe.reference()
    native = reference.native_size
    jobs = with_native_size(jobs, native, native, *reference.command_defaults())
    profile = batch_profile(reference, batch_size, height, width, jobs)
    check_jobs(jobs, profile, batch_size, max_steps=most_steps(reference.scheduler),
               max_side=MAX_SIZE_FACTOR * native,
               controlnets=reference.controlnets)
    if _needs_step_cache_graphs(jobs, reference.family.cache_methods):  # built by the driver before any worker
        options = options.replace(step_cache=True)
    out = check_output_dir(out_dir)
    cache = (options.cache_dir or default_cache_dir()).absolute()
    options = options.replace(cache_dir=cache, profile=profile)
    if height is None and width is None:  # engines the cache holds that serve every job come first
        options = _cached_engines(reference, options, jobs, batch_size) or options
    recipe = PipelineRecipe(model=model, options=options, controlnets=controlnets)
    return BatchPlan(jobs=jobs, out_dir=out, recipe=recipe, batch_size=batch_size, reference=reference)


def _cached_engines(reference, options: CompileOptions, jobs: list[Job], batch_size: int) -> CompileOptions | None:
    """The options of engines already in the cache that serve every job at `batch_size` (for the jobs' own profile,
    else the model's default one; with the `auto` backend, those any backend built): what `kasoku compile` built
    serves the batch, and a read-only cache is never asked to build."""
    from dataclasses import replace

    from ..build.compiler import cached_options
    from ..core.components import ShapeOutOfProfile

    base = reference.default_profile()
    candidates = [options.profile]
    for profile in (base, replace(base, guidance=options.profile.guidance)):
        try:
            check_jobs(jobs, profile, batch_size)
        except (InvalidJobs, ShapeOutOfProfile):
            continue
        candidates.append(profile)
    return cached_options(reference, options, list(dict.fromkeys(candidates)))


def _needs_step_cache_graphs(jobs: list[Job], methods: tuple[str, ...]) -> bool:
    """Whether any job's step caching runs graphs of its own (DeepCache's, the first-block cache's); a job whose
    step caching this model cannot run is refused with its line."""
    needed = False
    for job in jobs:
        try:
            needed |= bool(StepCaching.of(methods, **job.caching_arguments).graphs)
        except InvalidStepCache as error:
            raise InvalidJobs(f"{job.source}: {error}") from None
    return needed


# ---- running ---------------------------------------------------------------------------------


@dataclass
class BatchResult:
    out_dir: str
    results_file: str
    mode: str  # local | ray
    jobs: int
    skipped: int  # done by an earlier run
    generated: int
    seconds: float  # generating, from the first worker ready to the last image
    images_per_second: float
    batch_size: int
    backend: str = ""
    workers: list[WorkerInfo] = field(default_factory=list)
    retried_batches: int = 0  # batches handed to another worker after theirs died
    worker_restarts: list[WorkerInfo] = field(default_factory=list)  # workers Ray started again

    def to_dict(self) -> dict:
        return asdict(self)


OnStart = Callable[[int, int], None]  # (jobs to do, jobs already done)
OnResult = Callable[[JobResult], None]


class Runner(Protocol):
    """Where batches run: `start` readies the workers, `run` yields results as batches finish."""

    mode: str
    backend: str  # what the workers' engines run on ("onnxruntime", or per component)

    def start(self) -> list[WorkerInfo]: ...

    def run(self, batches: list[list[Job]]) -> Iterator[JobResult]: ...

    def close(self) -> None: ...

    def extra(self) -> dict[str, Any]: ...


def no_stage(component: str, stage: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def drive(plan: BatchPlan, make_runner: Callable[[list[list[Job]]], Runner], *, mode: str,
          on_start: OnStart | None = None, on_result: OnResult | None = None,
          on_workers: Callable[[list[WorkerInfo]], None] | None = None) -> BatchResult:
    """The one driver loop: lock the output folder, skip what is done, start the runner, record every
    result as it comes back (only here: results.jsonl has one writer)."""
    with OutputDir(plan.out_dir) as output:
        todo, skipped = output.pending(plan.jobs)
        if not todo:
            return _result(plan, output, mode, skipped, 0, 0.0, [])
        batches = plan_batches(todo, plan.batch_size)
        runner = make_runner(batches)
        try:
            infos = runner.start()
            if on_workers:
                on_workers(infos)
            if on_start:
                on_start(len(todo), skipped)
            start = time.perf_counter()
            for result in runner.run(batches):
                output.record(result)
                if on_result:
                    on_result(result)
            seconds = time.perf_counter() - start
        finally:
            runner.close()
        return _result(plan, output, runner.mode, skipped, len(todo), seconds, infos, runner.backend,
                       **runner.extra())


def _result(plan: BatchPlan, output: OutputDir, mode: str, skipped: int, generated: int, seconds: float,
            workers: list[WorkerInfo], backend: str = "", **extra) -> BatchResult:
    return BatchResult(out_dir=str(plan.out_dir), results_file=str(output.results), mode=mode, jobs=len(plan.jobs),
                       skipped=skipped, generated=generated, seconds=round(seconds, 3),
                       images_per_second=round(generated / seconds, 3) if seconds > 0 else 0.0,
                       batch_size=plan.batch_size, backend=backend, workers=workers, **extra)


class LocalRunner:
    """One worker in this process."""

    mode = "local"

    def __init__(self, plan: BatchPlan, on_stage: StageHook):
        self.plan = plan
        self.on_stage = on_stage
        self.worker: BatchWorker | None = None
        self.backend = ""

    def start(self) -> list[WorkerInfo]:
        self.worker = BatchWorker(self.plan.recipe, str(self.plan.out_dir), self.plan.reference, self.on_stage)
        self.backend = self.worker.backend
        return [self.worker.info()]

    def run(self, batches: list[list[Job]]) -> Iterator[JobResult]:
        for batch in batches:
            yield from self.worker.run(batch)

    def close(self) -> None:
        self.worker = None

    def extra(self) -> dict[str, Any]:
        return {}


def run_local(plan: BatchPlan, *, on_start: OnStart | None = None, on_result: OnResult | None = None,
              on_stage: StageHook | None = None) -> BatchResult:
    """Every pending job in this process, with one pipeline."""
    return drive(plan, lambda _batches: LocalRunner(plan, on_stage or no_stage), mode="local", on_start=on_start,
                 on_result=on_result)


__all__ = ["BatchPlan", "BatchResult", "LocalRunner", "Runner", "drive", "prepare", "run_local",
           "describe_backends"]
