"""kasoku batch on Ray: Ray Core actors, each a BatchWorker holding one pipeline, fed by the driver.

The driver compiles first, so workers only load from the cache, and it hands them the backends that
`auto` resolved to, so every worker runs exactly the driver's engines. A batch whose actor dies (a
killed process, a lost node) goes back to the queue for the next free worker, while Ray restarts
the actor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..core.errors import KasokuError
from .driver import BatchPlan, BatchResult, OnResult, OnStart, drive, no_stage
from .jobs import Job
from .output import BatchFailed, JobResult
from .worker import BatchWorker, PipelineRecipe, StageHook, WorkerInfo, describe_backends

RAY_EXTRA = "pip install 'kasoku[ray]'"
LOCAL_RAY = "local"  # `--ray` without an address: ray.init(address="local") starts a Ray instance here

# A batch whose worker dies this many times fails the run: its jobs are what kills the workers.
MAX_ATTEMPTS = 3
ACTOR_RESTARTS = 3
# Two batches per worker: the next one is already queued on the worker while the driver records
# the last, so a worker never idles waiting for the driver.
IN_FLIGHT_PER_WORKER = 2


class RayNotInstalled(KasokuError, ImportError):
    """`--ray` without the ray extra."""


def import_ray():
    """Ray, or an error naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise RayNotInstalled(f"--ray needs Ray, which is not installed here: {RAY_EXTRA}") from None
    return ray


@contextlib.contextmanager
def ray_session(address: str | None, cpus_wanted: int) -> Iterator[Any]:
    """Ray, connected: a new local instance for "local" (with CPUs for every worker asked for), or the
    cluster at `address`. A session this function started is shut down after; one already running
    (`ray.init` called by the caller) is used and left alone."""
    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    quiet = dict(log_to_driver=False, logging_level=logging.WARNING)  # workers' errors come back as exceptions
    try:
        if address in (None, LOCAL_RAY):
            ray.init(address=LOCAL_RAY, num_cpus=max(os.cpu_count() or 1, cpus_wanted), include_dashboard=False,
                     **quiet)
        else:
            ray.init(address=address, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as error:
        where = "start a local Ray instance" if address in (None, LOCAL_RAY) else f"reach the Ray cluster at {address}"
        raise BatchFailed(f"cannot {where}: {error}") from None
    try:
        yield ray
    finally:
        ray.shutdown()


@dataclass
class _Task:
    worker: int
    batch: list[Job]
    attempts: int


class RayWorkerPool:
    """Ray actors, each a BatchWorker, and the driver's queue of batches.

    A batch whose actor dies is put back at the front of the queue and goes to the next worker
    with room; Ray restarts the actor (`max_restarts`), which we probe before handing it work again.
    The driver does the retries itself (`max_task_retries=0`), so it always knows who has what."""

    def __init__(self, ray, recipe: PipelineRecipe, out_dir: Path, count: int, gpus_per_worker: float = 0.0):
        self.ray = ray
        self.cpus = recipe.options.threads or 1
        actor = ray.remote(num_cpus=self.cpus, num_gpus=gpus_per_worker, max_restarts=ACTOR_RESTARTS,
                           max_task_retries=0)(BatchWorker)
        self.actors = [actor.remote(recipe, str(out_dir)) for _ in range(count)]
        self.retried_batches = 0
        self.restarts: list[WorkerInfo] = []

    def start(self) -> list[WorkerInfo]:
        """Wait for every worker to load its pipeline; what each start cost."""
        start = time.perf_counter()
        refs = {actor.info.remote(): index for index, actor in enumerate(self.actors)}
        infos: list[WorkerInfo | None] = [None] * len(self.actors)
        waiting = list(refs)
        while waiting:
            ready, waiting = self.ray.wait(waiting, num_returns=1)
            index = refs[ready[0]]
            try:
                info = self.ray.get(ready[0])
            except self.ray.exceptions.RayError as error:
                raise BatchFailed(f"Ray worker {index} could not load the pipeline: {_cause(error)}") from None
            infos[index] = replace(info, startup_seconds=round(time.perf_counter() - start, 3))
        return infos

    def run(self, batches: list[list[Job]]) -> Iterator[JobResult]:
        """Results as batches finish; every batch once, whichever workers die on the way."""
        queue = deque(_Task(-1, batch, 0) for batch in batches)
        in_flight: dict[Any, _Task] = {}
        probes: dict[Any, int] = {}  # info() calls to restarted actors: back when they answer
        load = [0] * len(self.actors)
        usable = set(range(len(self.actors)))
        while queue or in_flight:
            self._submit(queue, in_flight, load, usable)
            if not in_flight and not probes:
                raise BatchFailed(f"every Ray worker died; {sum(len(t.batch) for t in queue)} jobs are not done. "
                                  "Run the same command again to finish them.")
            [ref], _ = self.ray.wait([*in_flight, *probes], num_returns=1)
            if ref in probes:
                self._probed(ref, probes, usable)
                continue
            task = in_flight.pop(ref)
            load[task.worker] -= 1
            try:
                results = self.ray.get(ref)
            except (self.ray.exceptions.RayActorError, self.ray.exceptions.WorkerCrashedError) as error:
                self._worker_died(task, error, queue, probes, usable)
                continue
            except self.ray.exceptions.RayTaskError as error:
                cause = getattr(error, "cause", None)
                raise (cause if isinstance(cause, KasokuError) else error) from None
            yield from results

    def _submit(self, queue: deque, in_flight: dict, load: list[int], usable: set[int]) -> None:
        while queue:
            room = [index for index in usable if load[index] < IN_FLIGHT_PER_WORKER]
            if not room:
                return
            index = min(room, key=lambda i: (load[i], i))
            task = queue.popleft()
            task.worker = index
            in_flight[self.actors[index].run.remote(task.batch)] = task
            load[index] += 1

    def _worker_died(self, task: _Task, error, queue: deque, probes: dict, usable: set[int]) -> None:
        ids = ", ".join(job.id for job in task.batch)
        if task.attempts + 1 >= MAX_ATTEMPTS:
            raise BatchFailed(f"jobs {ids} failed {MAX_ATTEMPTS} times: their worker died each time "
                              f"(last: {_cause(error)}). Run the same command to retry them.")
        self.retried_batches += 1
        queue.appendleft(_Task(-1, task.batch, task.attempts + 1))
        if task.worker in usable:  # not yet probing this worker (its other batch may fail too)
            usable.discard(task.worker)
            probes[self.actors[task.worker].info.remote()] = task.worker

    def _probed(self, ref, probes: dict, usable: set[int]) -> None:
        index = probes.pop(ref)
        try:
            self.restarts.append(self.ray.get(ref))
        except self.ray.exceptions.RayError:
            return  # out of restarts: the other workers finish the queue
        usable.add(index)

    def close(self) -> None:
        for actor in self.actors:
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)


def _cause(error: Exception) -> str:
    text = str(getattr(error, "cause", None) or error).strip()
    return text.splitlines()[-1] if text else type(error).__name__


def default_workers(ray, cpus_per_worker: int, gpus_per_worker: float) -> int:
    """As many workers as the cluster has room for: its GPUs when workers take GPUs, else its CPUs."""
    resources = ray.cluster_resources()
    if gpus_per_worker:
        return max(1, int(resources.get("GPU", 0) // gpus_per_worker))
    return max(1, int(resources.get("CPU", 1) // cpus_per_worker))


def check_fits(ray, count: int, cpus_per_worker: int, gpus_per_worker: float) -> None:
    """Workers that the cluster cannot hold would wait for resources forever: say so instead."""
    resources = ray.cluster_resources()
    for name, each, flag in (("CPU", cpus_per_worker, "--threads"), ("GPU", gpus_per_worker, "--gpus-per-worker")):
        have = resources.get(name, 0)
        if count * each > have:
            raise BatchFailed(f"{count} workers x {each:g} {name}s each need {count * each:g} {name}s but the Ray "
                              f"cluster has {have:g}; ask for fewer --workers or a smaller {flag}.")




class RayRunner:
    """Ray actors as the driver loop's runner."""

    mode = "ray"

    def __init__(self, plan: BatchPlan, batches: list[list[Job]], address: str | None, workers: int | None,
                 gpus_per_worker: float, on_stage: StageHook):
        self.plan, self.batches = plan, batches
        self.address, self.workers, self.gpus = address, workers, gpus_per_worker
        self.on_stage = on_stage
        self.backend = ""
        self.pool: RayWorkerPool | None = None
        self._session = contextlib.ExitStack()

    def start(self) -> list[WorkerInfo]:
        # Compile here, once, before any worker starts: the workers then only load from the cache,
        # and they get the backends resolved here, not `auto` to resolve again.
        pipeline = self.plan.recipe.load(self.plan.reference, self.on_stage)
        self.backend = describe_backends(pipeline)
        recipe = self.plan.recipe.resolved(pipeline)
        del pipeline
        self.plan.reference = None  # the workers hold their own; free ours
        cpus = recipe.options.threads or 1
        ray = self._session.enter_context(ray_session(self.address, (self.workers or 1) * cpus))
        count = min(self.workers or default_workers(ray, cpus, self.gpus), len(self.batches))
        check_fits(ray, count, cpus, self.gpus)
        self.pool = RayWorkerPool(ray, recipe, self.plan.out_dir, count, self.gpus)
        with self.on_stage("batch", f"starting {count} Ray worker{'s' if count > 1 else ''}"):
            return self.pool.start()

    def run(self, batches: list[list[Job]]) -> Iterator[JobResult]:
        yield from self.pool.run(batches)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        self._session.close()

    def extra(self) -> dict[str, Any]:
        if self.pool is None:
            return {}
        return {"retried_batches": self.pool.retried_batches, "worker_restarts": self.pool.restarts}


def run_ray(plan: BatchPlan, *, address: str | None = LOCAL_RAY, workers: int | None = None,
            gpus_per_worker: float = 0.0, on_start: OnStart | None = None, on_result: OnResult | None = None,
            on_stage: StageHook | None = None, on_workers: Callable[[list[WorkerInfo]], None] | None = None,
            ) -> BatchResult:
    """Every pending job on Ray: `workers` actors (default: as many as the cluster holds), each with one
    pipeline loaded from the cache; `address` "local" starts a Ray instance on this machine."""
    import_ray()
    if workers is not None and workers < 1:
        raise KasokuError(f"--workers must be at least 1 but is {workers}.")
    return drive(plan, lambda batches: RayRunner(plan, batches, address, workers, gpus_per_worker,
                                                 on_stage or no_stage),
                 mode="ray", on_start=on_start, on_result=on_result, on_workers=on_workers)
