"""This machine's free memory, and the guard that turns running out of it into a clear error.

A build whose memory can be counted beforehand is refused before it starts (`compiling.check_memory`). Some
steps' memory cannot be counted: NNCF's int8 calibration holds activations whose size depends on the model's
graph, its shape and NNCF's own choices (the SD3.5-medium transformer's fit at 512x512 and took more than
22 GiB at 1024x1024). Those run under :func:`limited_to_free_memory`: the process's data limit is lowered to
what the machine has free, less a floor, so that an allocation past it fails inside the step (OpenVINO and
numpy raise) and becomes :class:`NotEnoughMemory`, where the kernel's out-of-memory killer would otherwise end
the process without a word.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import KasokuError

MEMORY_CHECK_ENV = "KASOKU_MEMORY_CHECK"  # "0" skips the checks and the guard (a machine with swap, say)
GIB = 1024**3
# What a guarded step leaves free for the rest of the machine: the larger of 1.5 GiB and 6% of its memory.
FLOOR_BYTES, FLOOR_SHARE = int(1.5 * GIB), 0.06


class NotEnoughMemory(KasokuError, MemoryError):
    """A build that does not fit in this machine's memory: refused before it starts, or stopped by the guard.
    `free_bytes`: the memory that was free (None where it is not known)."""

    def __init__(self, message: str, free_bytes: int | None = None):
        super().__init__(message)
        self.free_bytes = free_bytes


def _kib_field(path: str, field: str) -> int | None:
    """A `Field:  N kB` line of a /proc file, in bytes (None where there is none)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    return _kib_field("/proc/meminfo", "MemAvailable")


def process_memory(field: str = "VmRSS") -> int | None:
    """This process's memory from /proc/self/status in bytes: VmRSS (resident now), VmHWM (its peak), VmData (the
    data segment, what RLIMIT_DATA counts); None where there is none."""
    return _kib_field("/proc/self/status", field)


def memory_floor() -> int:
    """The memory a guarded step leaves free, in bytes."""
    return max(FLOOR_BYTES, int(FLOOR_SHARE * (machine_memory() or 0)))


def machine_memory() -> int | None:
    """MemTotal of /proc/meminfo in bytes (None where there is none)."""
    return _kib_field("/proc/meminfo", "MemTotal")


def fits_this_machine(nbytes: int) -> bool:
    """Whether a step holding `nbytes` fits in this machine's memory less the floor (True where that is not known, or
    the checks are off): a decision that depends on the machine, not on what else runs now."""
    total = machine_memory()
    return not checks_memory() or total is None or nbytes <= total - memory_floor()


def checks_memory() -> bool:
    return os.environ.get(MEMORY_CHECK_ENV) != "0"


# How an allocation past the limit reads in OpenVINO's, C++'s and the C library's errors (ENOMEM), and a thread
# whose stack found no room.
_OUT_OF_MEMORY = ("failed to allocate", "bad_alloc", "bad allocation", "cannot allocate memory",
                  "can't allocate memory", "out of memory", "resource temporarily unavailable",
                  "can't start new thread")


def _out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation that failed (numpy's MemoryError, OpenVINO's RuntimeError, ...)."""
    return isinstance(error, MemoryError) or any(text in str(error).lower() for text in _OUT_OF_MEMORY)


@dataclass
class _Limit:
    """The data limit the guarded blocks running now share: set by the first, restored by the last to leave."""

    held: int = 0
    saved: tuple[int, int] = (0, 0)  # (soft, hard) before the first
    free: int = 0  # bytes the limit allowed beyond the process's data when the first set it


_LIMIT, _LIMIT_LOCK = _Limit(), threading.Lock()


@contextlib.contextmanager
def limited_to_free_memory(what: str, remedy: str) -> Iterator[None]:
    """Run the block with this process's data limit at its present size plus the machine's free memory less
    :func:`memory_floor`; an allocation past it raises :class:`NotEnoughMemory` naming `what` and `remedy`.
    Refused at once where less than the floor is free. Blocks that run at once (nested, or on other threads: a
    server's engines) share the limit the first one set, which the last one to leave takes off. A no-op where
    Linux's limits or /proc are missing, or with KASOKU_MEMORY_CHECK=0."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        resource = None
    if resource is None or not checks_memory():
        yield
        return
    floor = memory_floor()

    def refusal(detail: str) -> NotEnoughMemory:
        return NotEnoughMemory(f"{what} needs more memory than this machine has free: {detail}. {remedy}; or use "
                               f"a machine with more memory, or set {MEMORY_CHECK_ENV}=0 to try anyway.", free)

    with _LIMIT_LOCK:
        free, used = available_memory(), process_memory("VmData")
        unknown = _LIMIT.held == 0 and (free is None or used is None)
        if _LIMIT.held == 0 and not unknown:
            if free <= floor:
                raise refusal(f"{free / GIB:.1f} GiB free, and kasoku keeps {floor / GIB:.1f} GiB for the rest of "
                              "the machine")
            soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
            limit = used + free - floor if soft == resource.RLIM_INFINITY else min(used + free - floor, soft)
            resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
            _LIMIT.saved, _LIMIT.free = (soft, hard), limit - used
        _LIMIT.held += not unknown
    if unknown:
        yield
        return
    try:
        yield
    except Exception as error:  # NNCF's and the runtimes' own error classes too
        if isinstance(error, NotEnoughMemory) or not _out_of_memory(error):
            raise  # an inner guard's refusal names its own step
        raise refusal(f"it stopped when it reached the {_LIMIT.free / GIB:.1f} GiB that were free "
                      f"(less {floor / GIB:.1f} GiB kept for the rest of the machine)") from error
    finally:
        with _LIMIT_LOCK:
            _LIMIT.held -= 1
            if _LIMIT.held == 0:
                resource.setrlimit(resource.RLIMIT_DATA, _LIMIT.saved)


def return_freed_memory() -> None:
    """Hand back to the system the memory glibc keeps after large frees. A full-size pipeline's recorded runs free
    gigabytes of activations that stay in the process's heap, which the memory guard then sees as used (Sana Sprint
    1.6B's first compile was refused for them). A no-op where the C library is not glibc."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
