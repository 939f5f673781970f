"""The output folder: one PNG per job, written atomically, and results.jsonl with one writer."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..core.errors import KasokuError
from .jobs import Job

RESULTS_FILE = "results.jsonl"
STATE_DIR = ".kasoku-batch"  # images being written and each worker's status; removed after a run


class OutputNotWritable(KasokuError):
    """An output folder that kasoku batch cannot write."""



class BatchFailed(KasokuError):
    """A run that cannot finish: workers that cannot start, or jobs that kill every worker."""



def check_output_dir(out_dir: str | Path) -> Path:
    """Create the output folder if needed and prove it can be written; the absolute path."""
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise OutputNotWritable(f"--out {out} is a file, not a folder.")
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise OutputNotWritable(f"cannot create --out {out}: {existing} is a file.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputNotWritable(f"cannot write --out {out}: no write permission in {existing}.")
    results = out / RESULTS_FILE
    if results.exists() and (not results.is_file() or not os.access(results, os.W_OK)):
        raise OutputNotWritable(f"cannot append to {results}: it is not a writable file.")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f".kasoku-write-test-{os.getpid()}", "wb") as probe:
            probe.write(b"ok")
        os.remove(probe.name)
    except OSError as error:
        raise OutputNotWritable(f"cannot write --out {out}: {error.strerror or error}.") from None
    return out



# ---- the output folder -----------------------------------------------------------------------


@dataclass(frozen=True)
class JobResult:
    """One line of results.jsonl."""

    id: str
    seed: int
    file: str
    seconds: float  # this job's share of its pipeline call (the call's time / images in it)
    backend: str
    worker: str  # host:pid of the process that made the image
    images_in_call: int
    job_key: str


def write_atomically(path: Path, write: Callable[[Any], None], tmp_dir: Path) -> None:
    """`write(file)` to a temporary name, fsync, rename into place: readers see all or nothing."""
    tmp = tmp_dir / f"{path.name}.{socket.gethostname()}-{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class OutputDir:
    """The output folder during one run: this process holds a lock on it and is the only writer of
    results.jsonl; workers write images through the state folder's tmp/."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.results = self.path / RESULTS_FILE
        self.state = self.path / STATE_DIR
        self._lock_fd: int | None = None
        self._log = None

    def __enter__(self) -> OutputDir:
        self._lock_fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise BatchFailed(f"another kasoku batch is writing to {self.path}; wait for it or choose another "
                              "--out.") from None
        shutil.rmtree(self.state, ignore_errors=True)  # images half-written by a run that was killed
        (self.state / "tmp").mkdir(parents=True)
        (self.state / "workers").mkdir()
        return self

    def __exit__(self, *exc) -> None:
        if self._log is not None:
            self._log.close()
        shutil.rmtree(self.state, ignore_errors=True)
        os.close(self._lock_fd)

    def pending(self, jobs: list[Job]) -> tuple[list[Job], int]:
        """(jobs still to do, how many are done). Repairs results.jsonl first: a partial last line
        (a killed run), a line whose image is gone or that was written for a different job with the
        same id is dropped, so the job is done again and ends with exactly one line."""
        by_id = {job.id: job for job in jobs}
        kept, done, dropped = [], set(), 0
        for line in self._read_lines():
            record = _parse_result_line(line)
            job = by_id.get(record.get("id")) if record else None
            if record is None:
                dropped += 1
            elif job is None:
                kept.append(line)  # another prompts file's job: not ours to judge
            elif job.id in done or record.get("job_key") != job.key or not (self.path / job.file).is_file():
                dropped += 1
            else:
                done.add(job.id)
                kept.append(line)
        if dropped:
            write_atomically(self.results, lambda f: f.write("".join(f"{line}\n" for line in kept).encode()),
                             self.state / "tmp")
        self._log = open(self.results, "a", encoding="utf-8")
        return [job for job in jobs if job.id not in done], len(done)

    def _read_lines(self) -> list[str]:
        if not self.results.exists():
            return []
        text = self.results.read_text(encoding="utf-8", errors="replace")
        lines = text.split("\n")
        if not text.endswith("\n"):
            lines[-1] = ""  # a line cut short by a kill: never counts, even if it parses
        return [line for line in lines if line.strip()]

    def record(self, result: JobResult) -> None:
        """Append the result line once the image is in place; durable before the next job counts."""
        self._log.write(json.dumps(asdict(result)) + "\n")
        self._log.flush()
        os.fsync(self._log.fileno())


def _parse_result_line(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("id"), str) else None


