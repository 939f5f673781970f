"""`kasoku batch`: one image per line of a JSONL file, in this process or on a Ray cluster.

The flow, each step one function:

    read_jobs (every line checked) → prepare (sizes against the profile the engines will serve,
    the output folder; nothing heavy yet) → run_local | run_ray → <id>.png + results.jsonl

Nothing lost, nothing twice. An image is written under a temporary name and renamed into place;
its line in results.jsonl is appended (flushed and fsynced) only afterwards, and only by the
driver (this process), so the results file has a single writer. A job counts as done when its
image and a result line for the same job (same key) both exist, so re-running the same command
after an interruption finishes the rest and leaves one image and one line per job.

On Ray we use Ray Core actors, not a scheduler of our own: each worker is an actor that holds one
compiled pipeline, loaded from the kasoku cache once when it starts (the driver compiles first, so
workers only load). The driver hands out batches; a batch whose worker dies (a killed process, a
lost node) goes back to the queue for the next free worker, while Ray restarts the actor.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
import socket
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .components import ImageShape, ShapeOutOfProfile, ShapeProfile
from .errors import KasokuError

JOB_FIELDS = ("id", "prompt", "negative_prompt", "seed", "steps", "guidance", "height", "width")
DEFAULT_STEPS = 30
DEFAULT_GUIDANCE = 7.5
DEFAULT_BATCH_SIZE = 4
RESULTS_FILE = "results.jsonl"
STATE_DIR = ".kasoku-batch"  # images being written and each worker's status; removed after a run
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # ids name files: no slashes, no hidden files
MAX_SEED = 2**63 - 1
MAX_LISTED_ERRORS = 20
RAY_EXTRA = "pip install 'kasoku[ray]'"
LOCAL_RAY = "local"  # `--ray` without an address: ray.init(address="local") starts a Ray instance here

# A batch whose worker dies this many times fails the run: its jobs are what kills the workers.
MAX_ATTEMPTS = 3
ACTOR_RESTARTS = 3
# Two batches per worker: the next one is already queued on the worker while the driver records
# the last, so a worker never idles waiting for the driver.
IN_FLIGHT_PER_WORKER = 2

StageHook = Callable[[str, str], contextlib.AbstractContextManager]


class InvalidJobs(KasokuError, ValueError):
    """Lines of a prompts file that cannot be run; raised before any work starts."""


class OutputNotWritable(KasokuError):
    """An output folder that kasoku batch cannot write."""


class RayNotInstalled(KasokuError, ImportError):
    """`--ray` without the ray extra."""


class BatchFailed(KasokuError):
    """A run that cannot finish: workers that cannot start, or jobs that kill every worker."""


# ---- jobs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One image: one line of the prompts file."""

    id: str
    prompt: str
    seed: int
    negative_prompt: str | None = None
    steps: int = DEFAULT_STEPS
    guidance: float = DEFAULT_GUIDANCE
    height: int | None = None  # None: the model's native size (`prepare` fills it in)
    width: int | None = None
    source: str = field(default="", compare=False)  # "prompts.jsonl:3", for messages

    @property
    def file(self) -> str:
        return f"{self.id}.png"

    @property
    def key(self) -> str:
        """A digest of everything that changes the image: a result line only counts for this job."""
        parts = {name: getattr(self, name) for name in JOB_FIELDS}
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def call_key(self) -> tuple:
        """Jobs with equal call keys can share one pipeline call: one size, steps and guidance, and
        negative prompts for all or for none (SDXL encodes a missing one as zeros, not as "")."""
        return (self.height, self.width, self.steps, self.guidance, self.negative_prompt is not None)


class _LineError(ValueError):
    pass


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_size(value: Any) -> bool:
    return _is_int(value) and value > 0  # multiples and ranges: check_jobs, once the model is known


def _field(record: dict, name: str, check: Callable[[Any], bool], rule: str, default: Any) -> Any:
    if name not in record:
        return default
    value = record[name]
    if not check(value):
        raise _LineError(f"`{name}` must be {rule} but is {json.dumps(value)}.")
    return value


def parse_job(line: str, number: int, source: str) -> Job:
    """One JSONL line → a Job; seed and id default to the line number, so a re-run is the same run."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise _LineError(f"not valid JSON ({error.msg} at column {error.colno}).") from None
    if not isinstance(record, dict):
        raise _LineError(f"a job is a JSON object, not {type(record).__name__}.")
    unknown = sorted(set(record) - set(JOB_FIELDS))
    if unknown:
        raise _LineError(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                         f"the fields are {', '.join(JOB_FIELDS)}.")
    if "prompt" not in record:
        raise _LineError("`prompt` is missing.")
    job_id = _field(record, "id", lambda v: isinstance(v, str) or _is_int(v), "a string or an integer", None)
    job_id = f"{number:06d}" if job_id is None else str(job_id)
    if not ID_PATTERN.fullmatch(job_id):
        raise _LineError(f"`id` names the image file, so it must be 1-128 letters, digits, '.', '_' or '-', "
                         f"starting with a letter or digit, but is {job_id!r}.")
    return Job(
        id=job_id,
        prompt=_field(record, "prompt", lambda v: isinstance(v, str), "a string", None),
        negative_prompt=_field(record, "negative_prompt", lambda v: v is None or isinstance(v, str),
                               "a string or null", None),
        seed=_field(record, "seed", lambda v: _is_int(v) and 0 <= v <= MAX_SEED,
                    f"an integer in 0..{MAX_SEED}", number),
        steps=_field(record, "steps", lambda v: _is_int(v) and v >= 1, "an integer >= 1", DEFAULT_STEPS),
        guidance=float(_field(record, "guidance", lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v),
                              "a number", DEFAULT_GUIDANCE)),
        height=_field(record, "height", _is_size, "a positive integer (pixels)", None),
        width=_field(record, "width", _is_size, "a positive integer (pixels)", None),
        source=source,
    )


def _listing(errors: list[str], what: str) -> str:
    if len(errors) == 1:
        return errors[0]
    shown = errors[:MAX_LISTED_ERRORS]
    more = f"\n  ... and {len(errors) - len(shown)} more" if len(errors) > len(shown) else ""
    return f"{len(errors)} {what}:\n  " + "\n  ".join(shown) + more


def read_jobs(path: str | Path) -> list[Job]:
    """Every line of a JSONL prompts file, all checked before any is run (blank lines are skipped).

    Raises :class:`InvalidJobs` listing each bad line as ``file:line: what is wrong``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidJobs(f"the prompts file {path} does not exist.") from None
    except IsADirectoryError:
        raise InvalidJobs(f"the prompts file {path} is a folder; give a .jsonl file.") from None
    except UnicodeDecodeError:
        raise InvalidJobs(f"the prompts file {path} is not UTF-8 text.") from None
    jobs: list[Job] = []
    errors: list[str] = []
    lines_of: dict[str, int] = {}
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        source = f"{path}:{number}"
        try:
            job = parse_job(line, number, source)
        except _LineError as error:
            errors.append(f"{source}: {error}")
            continue
        if job.id in lines_of:
            errors.append(f"{source}: id {job.id!r} is already the id of line {lines_of[job.id]}; ids must be unique.")
            continue
        lines_of[job.id] = number
        jobs.append(job)
    if errors:
        raise InvalidJobs(_listing(errors, f"lines of {path} cannot be run"))
    if not jobs:
        raise InvalidJobs(f"the prompts file {path} has no jobs; write one JSON object per line, "
                          'e.g. {"prompt": "a photo of a cat", "seed": 1}.')
    return jobs


def with_native_size(jobs: list[Job], height: int, width: int) -> list[Job]:
    """Jobs without a size get the model's native size (before their keys are used)."""
    return [replace(job, height=job.height or height, width=job.width or width) for job in jobs]


def check_jobs(jobs: list[Job], profile: ShapeProfile, batch_size: int, max_steps: int | None = None) -> None:
    """Every job against what the compiled engines serve: one error listing each job that cannot run."""
    if batch_size < 1:
        raise InvalidJobs(f"--batch-size must be at least 1 but is {batch_size}.")
    if batch_size > profile.max.batch:
        raise InvalidJobs(f"--batch-size {batch_size} is more images per call than the profile serves "
                          f"(batch {profile.range_text('batch')}).")
    errors = []
    for job in jobs:
        try:
            profile.check(ImageShape(1, job.height, job.width))
        except ShapeOutOfProfile as error:
            errors.append(f"{job.source}: {error}")
        if max_steps is not None and job.steps > max_steps:
            errors.append(f"{job.source}: `steps` must be at most {max_steps} (the scheduler's training steps) "
                          f"but is {job.steps}.")
    if errors:
        hint = " (`kasoku batch` takes the same --height/--width MIN:MAX flags)"
        raise InvalidJobs(_listing(errors, "jobs do not fit the compiled engines") + hint)


def plan_batches(jobs: list[Job], batch_size: int) -> list[list[Job]]:
    """Jobs that can share a call, in calls of up to `batch_size`, in file order (so two runs of the
    same jobs make the same calls)."""
    groups: dict[tuple, list[Job]] = {}
    for job in jobs:
        groups.setdefault(job.call_key, []).append(job)
    return [group[i:i + batch_size] for group in groups.values() for i in range(0, len(group), batch_size)]


# ---- what a worker loads ---------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineRecipe:
    """How a worker loads its compiled pipeline from the cache. Small and picklable: it travels to
    Ray workers, so paths are absolute and the cache folder is explicit."""

    model: str
    backend: str = "auto"
    precision: str = "fp32"
    cache_dir: str | None = None
    profile: ShapeProfile | None = None
    threads: int | None = None  # per engine; Ray reserves as many CPUs per worker
    components: tuple[str, ...] | None = None  # None: the model's, less the VAE encoder (txt2img only)

    def load(self, reference=None, on_stage: StageHook | None = None):
        """A KasokuPipeline; from the cache when the engines are built (the usual case)."""
        from .backends import EngineOptions
        from .loading import load_pipeline
        from .pipeline import compile

        reference = reference if reference is not None else load_pipeline(self.model)
        return compile(reference, self.backend, precision=self.precision, cache_dir=self.cache_dir,
                       profile=self.profile, components=self.components or txt2img_components(reference),
                       options=EngineOptions(threads=self.threads), on_stage=on_stage, label=self.model)


def txt2img_components(pipe) -> tuple[str, ...]:
    """Every component of the model but the VAE encoder, which text-to-image never runs."""
    from .components import model_components

    return tuple(name for name in model_components(pipe) if name != "vae_encoder")


def batch_profile(pipe, batch_size: int, height: tuple[int, ...] | None = None,
                  width: tuple[int, ...] | None = None) -> ShapeProfile:
    """The model's default profile (the one `kasoku compile MODEL` builds), widened to `batch_size`
    images per call, with the height and width ranges (MIN:MAX or MIN:OPT:MAX, as for `kasoku
    compile`) where given."""
    from .components import default_profile, profile_with_ranges

    base = default_profile(pipe)
    batch = (base.min.batch, base.opt.batch, max(base.max.batch, batch_size))
    return profile_with_ranges(base, batch, height, width)


@dataclass
class BatchPlan:
    """Checked jobs, a writable output folder and how to load the pipeline: ready to run."""

    jobs: list[Job]
    out_dir: Path
    recipe: PipelineRecipe
    batch_size: int
    reference: Any = field(default=None, repr=False)  # the loaded diffusers pipeline (this process only)


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


def _portable_model(model) -> str:
    """A model folder as an absolute path (Ray workers do not share our working directory)."""
    if isinstance(model, (str, Path)) and Path(model).expanduser().exists():
        return str(Path(model).expanduser().absolute())
    if not isinstance(model, (str, Path)):
        raise KasokuError("kasoku batch takes a model folder or hub id (workers load it themselves), "
                          f"not a {type(model).__name__}.")
    return str(model)


def prepare(model, jobs: list[Job], out_dir: str | Path, *, batch_size: int = DEFAULT_BATCH_SIZE,
            backend: str = "auto", precision: str = "fp32", cache_dir: str | Path | None = None,
            threads: int | None = None, height: tuple[int, ...] | None = None,
            width: tuple[int, ...] | None = None) -> BatchPlan:
    """Every check before any work: the jobs against the profile the engines will serve, then the
    output folder (created last, so a bad job writes nothing). Loads the model, not the engines."""
    from .cache import default_cache_dir
    from .components import native_size
    from .loading import load_pipeline

    model = _portable_model(model)
    reference = load_pipeline(model)
    profile = batch_profile(reference, batch_size, height, width)
    native = native_size(reference)
    jobs = with_native_size(jobs, native, native)
    check_jobs(jobs, profile, batch_size, max_steps=reference.scheduler.config.num_train_timesteps)
    out = check_output_dir(out_dir)
    cache = Path(cache_dir).expanduser().absolute() if cache_dir else default_cache_dir().absolute()
    recipe = PipelineRecipe(model=model, backend=backend, precision=str(getattr(precision, "value", precision)),
                            cache_dir=str(cache), profile=profile, threads=threads)
    return BatchPlan(jobs=jobs, out_dir=out, recipe=recipe, batch_size=batch_size, reference=reference)


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

        from .console import quiet_third_party_logs
        from .loading import load_pipeline

        quiet_third_party_logs()
        imported = time.perf_counter()
        if recipe.threads:
            torch.set_num_threads(recipe.threads)  # the scheduler's and latents' torch ops share the worker's CPUs
        reference = reference if reference is not None else load_pipeline(recipe.model)
        loaded = time.perf_counter()
        self.pipeline = recipe.load(reference, on_stage)
        self.seconds = (imported - start, loaded - imported, time.perf_counter() - loaded)
        self.node = socket.gethostname()
        self.name = f"{self.node}:{os.getpid()}"
        self.backend = describe_backends(self.pipeline)
        self.out = Path(out_dir)
        self.tmp = self.out / STATE_DIR / "tmp"
        self.status_file = self.out / STATE_DIR / "workers" / f"{self.node}-{os.getpid()}.json"
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
        import torch

        first = batch[0]
        start = time.perf_counter()
        images = self.pipeline(
            [job.prompt for job in batch],
            negative_prompt=None if first.negative_prompt is None else [job.negative_prompt for job in batch],
            generator=[torch.Generator().manual_seed(job.seed) for job in batch],  # one per job: its own noise
            num_inference_steps=first.steps, guidance_scale=first.guidance, height=first.height, width=first.width,
        ).images
        return images, time.perf_counter() - start

    def _write_status(self, batch: list[Job]) -> None:
        """Which jobs this worker is on (a folder of these shows a run's progress per worker)."""
        status = {"worker": self.name, "pid": os.getpid(), "jobs": [job.id for job in batch], "since": time.time()}
        write_atomically(self.status_file, lambda f: f.write(json.dumps(status).encode()), self.tmp)


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


def _no_stage(component: str, stage: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _result(plan: BatchPlan, output: OutputDir, mode: str, skipped: int, generated: int, seconds: float,
            workers: list[WorkerInfo], backend: str = "", **extra) -> BatchResult:
    return BatchResult(out_dir=str(plan.out_dir), results_file=str(output.results), mode=mode, jobs=len(plan.jobs),
                       skipped=skipped, generated=generated, seconds=round(seconds, 3),
                       images_per_second=round(generated / seconds, 3) if seconds > 0 else 0.0,
                       batch_size=plan.batch_size, backend=backend, workers=workers, **extra)


def run_local(plan: BatchPlan, *, on_start: OnStart | None = None, on_result: OnResult | None = None,
              on_stage: StageHook | None = None) -> BatchResult:
    """Every pending job in this process, with one pipeline."""
    with OutputDir(plan.out_dir) as output:
        todo, skipped = output.pending(plan.jobs)
        if not todo:
            return _result(plan, output, "local", skipped, 0, 0.0, [])
        worker = BatchWorker(plan.recipe, str(plan.out_dir), plan.reference, on_stage)
        if on_start:
            on_start(len(todo), skipped)
        start = time.perf_counter()
        for batch in plan_batches(todo, plan.batch_size):
            for result in worker.run(batch):
                output.record(result)
                if on_result:
                    on_result(result)
        return _result(plan, output, "local", skipped, len(todo), time.perf_counter() - start, [worker.info()],
                       worker.backend)


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
        self.cpus = recipe.threads or 1
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


def run_ray(plan: BatchPlan, *, address: str | None = LOCAL_RAY, workers: int | None = None,
            gpus_per_worker: float = 0.0, on_start: OnStart | None = None, on_result: OnResult | None = None,
            on_stage: StageHook | None = None, on_workers: Callable[[list[WorkerInfo]], None] | None = None,
            ) -> BatchResult:
    """Every pending job on Ray: `workers` actors (default: as many as the cluster holds), each with one
    pipeline loaded from the cache; `address` "local" starts a Ray instance on this machine."""
    import_ray()
    if workers is not None and workers < 1:
        raise KasokuError(f"--workers must be at least 1 but is {workers}.")
    on_stage = on_stage or _no_stage
    cpus = plan.recipe.threads or 1
    with OutputDir(plan.out_dir) as output:
        todo, skipped = output.pending(plan.jobs)
        if not todo:
            return _result(plan, output, "ray", skipped, 0, 0.0, [])
        # Compile here, once, before any worker starts: the workers then only load from the cache.
        backend = describe_backends(plan.recipe.load(plan.reference, on_stage))
        plan.reference = None  # the workers hold their own; free ours
        batches = plan_batches(todo, plan.batch_size)
        with ray_session(address, (workers or 1) * cpus) as ray:
            count = min(workers or default_workers(ray, cpus, gpus_per_worker), len(batches))
            check_fits(ray, count, cpus, gpus_per_worker)
            pool = RayWorkerPool(ray, plan.recipe, plan.out_dir, count, gpus_per_worker)
            try:
                with on_stage("batch", f"starting {count} Ray worker{'s' if count > 1 else ''}"):
                    infos = pool.start()
                if on_workers:
                    on_workers(infos)
                if on_start:
                    on_start(len(todo), skipped)
                start = time.perf_counter()
                for result in pool.run(batches):
                    output.record(result)
                    if on_result:
                        on_result(result)
                seconds = time.perf_counter() - start
            finally:
                pool.close()
        return _result(plan, output, "ray", skipped, len(todo), seconds, infos, backend,
                       retried_batches=pool.retried_batches, worker_restarts=pool.restarts)
