"""The queue and the dynamic batcher: images of requests that arrive within the batch window and
share a call key ride one engine call, each with its own seed.

One asyncio task on the server's event loop takes calls off the queue; the engine runs them on one
thread of its own (engine calls are CPU-bound and would stall the loop), one call at a time. The
grouping is `kasoku batch`'s, from one place (`kasoku.batch.jobs.plan_batches` over `call_key`):
the next call is the first batch that plan makes of everything waiting, so it holds the oldest
image and every image that can share its call, up to --max-batch. A call starts when the oldest
image has waited the batch window, or at once when it is full; while a call runs, newcomers
gather for the next one, so under load calls run back to back and full.

Nothing lost, nothing twice: each image has one future, resolved once, by the call that ran it.
A request past its deadline leaves the queue; a call whose every image is past its deadline or
abandoned stops between two denoising steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..batch.jobs import plan_batches
from .errors import QueueFull, TimedOut

# run(jobs, wanted) -> one result per job; `wanted()` turns False once no image of the call is awaited
RunCall = Callable[[list[Any], Callable[[], bool]], list[Any]]


@dataclass(eq=False)
class _Waiting:
    """One image in the queue."""

    job: Any
    future: asyncio.Future
    deadline: float  # time.monotonic()
    arrived: float = field(default_factory=time.monotonic)

    @property
    def call_key(self) -> tuple:
        return self.job.call_key

    @property
    def wanted(self) -> bool:
        return not self.future.done() and time.monotonic() < self.deadline


def timed_out() -> TimedOut:
    return TimedOut("the request was not answered within the server's --timeout; ask for fewer images or steps, or "
                    "retry when the server is less busy.")


class CallAbandoned(Exception):
    """Raised between denoising steps when no image of the call is awaited any more."""


class Batcher:
    """Queue images, run them in calls of up to `max_batch`, hand each request its own results.

    `on_call(size, seconds)` and `on_queue(depth)` report to the metrics."""

    def __init__(self, run: RunCall, *, max_batch: int, window_s: float, max_queue: int,
                 on_call: Callable[[int, float], None] | None = None, on_queue: Callable[[int], None] | None = None):
        self.run = run
        self.max_batch, self.window_s, self.max_queue = max_batch, window_s, max_queue
        self.on_call = on_call or (lambda size, seconds: None)
        self.on_queue = on_queue or (lambda depth: None)
        self.waiting: list[_Waiting] = []
        self.running: list[_Waiting] = []
        self.call_seconds = 0.0  # a running mean of recent calls, for Retry-After
        self._arrived = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._engine = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kasoku-engine")
        self._task: asyncio.Task | None = None

    # ---- the requests' side ---------------------------------------------------------------------

    async def submit(self, jobs: list[Any], deadline: float) -> list[Any]:
        """The results of `jobs` in order; QueueFull at once when they do not fit, TimedOut at `deadline`."""
        if len(self.waiting) + len(jobs) > self.max_queue:
            raise QueueFull(f"the queue holds {len(self.waiting)} of at most {self.max_queue} images "
                            f"(--max-queue) and this request adds {len(jobs)}; retry after the Retry-After seconds.",
                            retry_after=self.retry_after())
        loop = asyncio.get_running_loop()
        mine = [_Waiting(job, loop.create_future(), deadline) for job in jobs]
        self.waiting.extend(mine)
        self._changed()
        try:
            return await asyncio.wait_for(asyncio.gather(*(w.future for w in mine)),
                                          timeout=max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise timed_out() from None
        finally:  # answered, timed out or abandoned (client gone, server stopping): out of the queue either way
            for waiting in mine:
                if not waiting.future.done():
                    waiting.future.cancel()
            self._withdraw(mine)

    def retry_after(self) -> int:
        """Seconds until the queue has room, roughly: the calls ahead at the recent pace."""
        calls = math.ceil(len(self.waiting) / self.max_batch) + (1 if self.running else 0)
        return max(1, math.ceil(calls * self.call_seconds))

    @property
    def depth(self) -> int:
        return len(self.waiting)

    # ---- the engine's side ----------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve(), name="kasoku-batcher")

    async def stop(self, grace_s: float) -> None:
        """Finish what is queued and running (at most `grace_s`), then stop."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._drained(), grace_s)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._engine.shutdown(wait=False, cancel_futures=True)  # a call still running past the grace ends with us

    async def _drained(self) -> None:
        while self.waiting or self.running:
            self._idle.clear()
            await self._idle.wait()

    async def _serve(self) -> None:
        while True:
            await self._window()
            call = self._next_call()
            if call:
                await self._run(call)

    async def _window(self) -> None:
        """Until the oldest waiting image has waited the window, or its call is full."""
        while True:
            self._drop_unwanted()
            if not self.waiting:
                await self._wait_for_arrival(None)
                continue
            left = self.waiting[0].arrived + self.window_s - time.monotonic()
            if left <= 0 or len(self._plan()[0]) >= self.max_batch:
                return
            await self._wait_for_arrival(left)

    async def _wait_for_arrival(self, timeout: float | None) -> None:
        self._arrived.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._arrived.wait(), timeout)

    def _plan(self) -> list[list[_Waiting]]:
        return plan_batches(self.waiting, self.max_batch)

    def _next_call(self) -> list[_Waiting]:
        self._drop_unwanted()
        if not self.waiting:
            return []
        call = self._plan()[0]
        self._withdraw(call)
        return call

    async def _run(self, call: list[_Waiting]) -> None:
        self.running = call
        start = time.monotonic()
        try:
            results = await asyncio.get_running_loop().run_in_executor(
                self._engine, self.run, [w.job for w in call], lambda: any(w.wanted for w in call))
        except CallAbandoned:
            results = None
        except Exception as error:  # noqa: BLE001 - the call's own requests get the error; the server goes on
            for waiting in call:
                if not waiting.future.done():
                    waiting.future.set_exception(error)
            results = None
        finally:
            self.running = []
            self._changed()
        seconds = time.monotonic() - start
        self.call_seconds = seconds if not self.call_seconds else 0.7 * self.call_seconds + 0.3 * seconds
        self.on_call(len(call), seconds)
        for waiting, result in zip(call, results or ()):
            if not waiting.future.done():
                waiting.future.set_result(result)

    # ---- the queue ------------------------------------------------------------------------------

    def _drop_unwanted(self) -> None:
        """Images whose request timed out or went away leave the queue without running."""
        gone = [w for w in self.waiting if not w.wanted]
        for waiting in gone:
            if not waiting.future.done():
                waiting.future.set_exception(timed_out())
        self._withdraw(gone)

    def _withdraw(self, items: list[_Waiting]) -> None:
        if not items:
            return
        leaving = set(map(id, items))
        before = len(self.waiting)
        self.waiting = [w for w in self.waiting if id(w) not in leaving]
        if len(self.waiting) != before:
            self._changed()

    def _changed(self) -> None:
        self.on_queue(len(self.waiting))
        self._arrived.set()
        if not self.waiting and not self.running:
            self._idle.set()


__all__ = ["Batcher", "CallAbandoned", "RunCall"]
