"""Jobs: one image per line of a JSONL prompts file, every line checked before any work starts."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ..core.choices import DEFAULT_GUIDANCE, DEFAULT_STEPS
from ..core.components import ImageShape, ShapeOutOfProfile, ShapeProfile
from ..core.errors import KasokuError
from ..core.step_cache import DEFAULT_SCHEDULE, METHODS, SCHEDULES

JOB_FIELDS = ("id", "prompt", "negative_prompt", "seed", "steps", "guidance", "height", "width", "control_image",
              "control_scale", "loras", "cache_interval", "cache_schedule", "ip_adapter", "ip_image", "ip_scale",
              "cache_method", "cache_threshold")
# Fields added after the first release: part of a job's key only when set to other than their default, so the
# results of jobs that do not use them keep their keys (a re-run skips them).
LATER_FIELDS = {"control_image": (), "control_scale": None, "loras": (), "cache_interval": 1,
                "cache_schedule": DEFAULT_SCHEDULE, "ip_adapter": (), "ip_image": (), "ip_scale": (),
                "cache_method": None, "cache_threshold": None}
RESULTS_FILE = "results.jsonl"
STATE_DIR = ".kasoku-batch"  # images being written and each worker's status; removed after a run
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # ids name files: no slashes, no hidden files
MAX_SEED = 2**63 - 1
MAX_LISTED_ERRORS = 20


class InvalidJobs(KasokuError, ValueError):
    """Lines of a prompts file that cannot be run; raised before any work starts."""



# ---- jobs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One image: one line of the prompts file."""

    id: str
    prompt: str
    seed: int
    negative_prompt: str | None = None
    steps: int | None = None  # None: the model family's default (`prepare` fills it in; 30 for SD 1.x/2.x/XL)
    guidance: float | None = None  # None: likewise (7.5 for SD 1.x/2.x/XL)
    height: int | None = None  # None: the model's native size (`prepare` fills it in)
    width: int | None = None
    control_image: tuple[str, ...] = ()  # one image file per ControlNet (absolute paths)
    control_scale: float | tuple[float, ...] | None = None  # one for all ControlNets, or one each; None: diffusers'
    loras: tuple[tuple[str, float], ...] = ()  # LoRA adapters (absolute path, weight); () runs the base weights
    cache_interval: int = 1  # step caching (kasoku.core.step_cache): one step in N computed (1: off)
    cache_schedule: str = DEFAULT_SCHEDULE
    cache_method: str | None = None  # None: the denoiser's default for an interval, first-block for a threshold
    cache_threshold: float | None = None  # the first-block cache's
    ip_adapter: tuple[str, ...] = ()  # IP-Adapter weights files (absolute paths); () runs no image prompt
    ip_image: tuple[str, ...] = ()  # the image prompt of each adapter (absolute paths)
    ip_scale: tuple[float, ...] = ()  # one scale per adapter (default 1.0 each)
    source: str = field(default="", compare=False)  # "prompts.jsonl:3", for messages

    @property
    def file(self) -> str:
        return f"{self.id}.png"

    @property
    def key(self) -> str:
        """A digest of everything that changes the image: a result line only counts for this job."""
        parts = {name: getattr(self, name) for name in JOB_FIELDS
                 if name not in LATER_FIELDS or getattr(self, name) != LATER_FIELDS[name]}
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def call_key(self) -> tuple:
        return call_key(self.height, self.width, self.steps, self.guidance, self.negative_prompt is not None,
                        control_scale=self.control_scale, loras=self.loras, caching=self.caching_arguments,
                        image_prompt=self.image_prompt)

    @property
    def caching_arguments(self) -> dict[str, Any]:
        """The pipeline's step-caching arguments of this job (those it sets)."""
        return caching_arguments(self)

    @property
    def image_prompt(self) -> tuple:
        """(adapters, images, scales): what the jobs of one call share (diffusers gives a call one image prompt)."""
        return (self.ip_adapter, self.ip_image, self.ip_scale) if self.ip_adapter else ()


# ---- which jobs share an engine call, and the call they share ----------------------------------
# `kasoku batch` and `kasoku serve` (its dynamic batcher) both group and call through these two and plan_batches.


def call_key(height: int | None, width: int | None, steps: int, guidance: float, negative: bool, *,
             task: str = "txt2img", strength: float | None = None,
             control_scale: float | tuple[float, ...] | None = None, loras: tuple = (),
             caching: Mapping[str, Any] | None = None, image_prompt: tuple = ()) -> tuple:
    """Jobs with equal call keys can share one pipeline call: one task, adapter set (LoRA paths and
    weights), size, steps, guidance and step caching (and strength for img2img and inpaint, the control
    scale with ControlNets, the image prompt with IP-Adapters), and negative prompts for all or for none (SDXL
    encodes a missing one as zeros, not as "")."""
    return (task, loras, height, width, steps, guidance, negative, strength, control_scale,
            tuple(sorted((caching or {}).items())), *((image_prompt,) if image_prompt else ()))


def caching_arguments(job: Any) -> dict[str, Any]:
    """The step-caching arguments (kasoku.core.step_cache) a batch or server job sets: its interval and schedule, its
    method and threshold where given."""
    given = {"cache_interval": getattr(job, "cache_interval", 1), "cache_schedule": getattr(job, "cache_schedule",
                                                                                               DEFAULT_SCHEDULE)}
    given.update({name: getattr(job, name) for name in ("cache_method", "cache_threshold")
                  if getattr(job, name, None) is not None})
    return given


def call_arguments(jobs: Sequence) -> dict[str, Any]:
    """The pipeline arguments of one call for jobs with one call key (anything with `prompt`,
    `negative_prompt`, `seed`, `steps` and `guidance`): their prompts, and one generator per job
    seeded with its seed, so each image gets its own noise whatever it is batched with; their step
    caching where they have it (:func:`caching_arguments`). The caller
    adds what its task takes (the size; the images and strength of img2img and inpaint)."""
    import torch

    first = jobs[0]
    # no negative prompt: the pipeline's own default (PixArt's is "", and None fails in its text cleaning)
    negative = {} if first.negative_prompt is None else {"negative_prompt": [job.negative_prompt for job in jobs]}
    return dict(
        prompt=[job.prompt for job in jobs], **negative,
        generator=[torch.Generator().manual_seed(job.seed) for job in jobs],
        num_inference_steps=first.steps, guidance_scale=first.guidance, **caching_arguments(first),
    )


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


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _control_images(value: Any, folder: Path) -> tuple[str, ...]:
    """`control_image`: a file or a list of files (one per ControlNet), relative to the prompts file's
    folder; each must be an image PIL can read."""
    from PIL import Image, UnidentifiedImageError

    paths = value if isinstance(value, list) else [value]
    if not paths or not all(isinstance(p, str) and p for p in paths):
        raise _LineError(f"`control_image` must be an image file or a list of them (one per ControlNet) but is "
                         f"{json.dumps(value)}.")
    resolved = []
    for path in paths:
        file = (folder / Path(path).expanduser()).absolute()
        try:
            with Image.open(file):  # reads the header only
                pass
        except (FileNotFoundError, IsADirectoryError):
            raise _LineError(f"`control_image` {path} does not exist (paths are relative to the prompts file's "
                             "folder).") from None
        except UnidentifiedImageError:
            raise _LineError(f"`control_image` {path} is not an image PIL can read.") from None
        resolved.append(str(file))
    return tuple(resolved)


def _control_scale(value: Any) -> float | tuple[float, ...]:
    if _is_number(value):
        return float(value)
    if isinstance(value, list) and value and all(_is_number(v) for v in value):
        return tuple(float(v) for v in value)
    raise _LineError(f"`control_scale` must be a number or a list of numbers (one per ControlNet) but is "
                     f"{json.dumps(value)}.")


def _loras(value: Any) -> tuple[tuple[str, float], ...]:
    """`loras`: a list of "PATH[:SCALE]" strings or {"path": ..., "scale": ...} objects; each file must exist
    (paths are made absolute: workers may run elsewhere)."""
    rule = 'a list of "PATH[:SCALE]" strings or {"path": ..., "scale": ...} objects'
    if not isinstance(value, list):
        raise _LineError(f"`loras` must be {rule} but is {json.dumps(value)}.")
    out = []
    for item in value:
        if isinstance(item, str):
            path, _, tail = item.rpartition(":")
            try:
                path, scale = (path, float(tail)) if path else (item, 1.0)
            except ValueError:
                path, scale = item, 1.0
        elif isinstance(item, dict) and set(item) <= {"path", "scale"} and isinstance(item.get("path"), str) and \
                (_is_int(item.get("scale", 1.0)) or isinstance(item.get("scale", 1.0), float)):
            path, scale = item["path"], float(item.get("scale", 1.0))
        else:
            raise _LineError(f"`loras` must be {rule} but has {json.dumps(item)}.")
        if not math.isfinite(scale):
            raise _LineError(f"`loras`: a scale must be a finite number but {json.dumps(item)} has {scale}.")
        resolved = Path(path).expanduser().absolute()
        if not resolved.exists():
            raise _LineError(f"`loras`: {path} does not exist.")
        out.append((str(resolved), scale))
    return tuple(out)


def _files(value: Any, name: str, folder: Path, *, image: bool) -> tuple[str, ...]:
    """A file or a list of files relative to the prompts file's folder, each existing (an image PIL can read)."""
    paths = value if isinstance(value, list) else [value]
    if not paths or not all(isinstance(p, str) and p for p in paths):
        raise _LineError(f"`{name}` must be a file or a list of files but is {json.dumps(value)}.")
    resolved = []
    for path in paths:
        file = (folder / Path(path).expanduser()).absolute()
        if not file.is_file():
            raise _LineError(f"`{name}` {path} does not exist (paths are relative to the prompts file's folder).")
        if image:
            from PIL import Image, UnidentifiedImageError

            try:
                with Image.open(file):  # reads the header only
                    pass
            except UnidentifiedImageError:
                raise _LineError(f"`{name}` {path} is not an image PIL can read.") from None
        resolved.append(str(file))
    return tuple(resolved)


def _image_prompt(record: dict, folder: Path) -> dict[str, tuple]:
    """`ip_adapter` (weights files), `ip_image` (one image per adapter) and `ip_scale` (a number, or one per
    adapter)."""
    if "ip_adapter" not in record:
        given = [name for name in ("ip_image", "ip_scale") if name in record]
        if given:
            raise _LineError(f"`{given[0]}` needs `ip_adapter` (the IP-Adapter weights file it is for).")
        return {}
    from ..runtime.image_prompts import IPAdapterError, check_adapter_file

    adapters = _files(record["ip_adapter"], "ip_adapter", folder, image=False)
    for path in adapters:
        try:
            check_adapter_file(path, "`ip_adapter`")
        except IPAdapterError as error:
            raise _LineError(str(error)) from None
    images = _files(record.get("ip_image", []), "ip_image", folder, image=True) if "ip_image" in record else ()
    if len(images) != len(adapters):
        raise _LineError(f"`ip_image` must give one image per IP-Adapter: {len(adapters)} adapter(s) but "
                         f"{len(images)} image(s).")
    scale = record.get("ip_scale", 1.0)
    scales = scale if isinstance(scale, list) else [scale] * len(adapters)
    if len(scales) != len(adapters) or not all(_is_number(s) for s in scales):
        raise _LineError(f"`ip_scale` must be a number or a list of {len(adapters)} (one per IP-Adapter) but is "
                         f"{json.dumps(scale)}.")
    return {"ip_adapter": adapters, "ip_image": images, "ip_scale": tuple(float(s) for s in scales)}


def parse_job(line: str, number: int, source: str, folder: Path = Path(".")) -> Job:
    """One JSONL line → a Job; seed and id default to the line number, so a re-run is the same run.
    `folder` is where a relative `control_image` path starts (the prompts file's folder)."""
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
        steps=_field(record, "steps", lambda v: _is_int(v) and v >= 1, "an integer >= 1", None),
        guidance=_float_or_none(_field(record, "guidance", _is_number, "a number", None)),
        height=_field(record, "height", _is_size, "a positive integer (pixels)", None),
        width=_field(record, "width", _is_size, "a positive integer (pixels)", None),
        control_image=_control_images(record["control_image"], folder) if "control_image" in record else (),
        control_scale=_control_scale(record["control_scale"]) if "control_scale" in record else None,
        loras=_loras(record["loras"]) if "loras" in record else (),
        cache_interval=_field(record, "cache_interval", lambda v: _is_int(v) and v >= 1,
                              "an integer >= 1 (1: no step caching)", 1),
        cache_schedule=_field(record, "cache_schedule", lambda v: v in SCHEDULES, f"one of {', '.join(SCHEDULES)}",
                              DEFAULT_SCHEDULE),
        cache_method=_field(record, "cache_method", lambda v: v in METHODS, f"one of {', '.join(METHODS)}", None),
        cache_threshold=_float_or_none(_field(record, "cache_threshold", lambda v: _is_number(v) and v >= 0,
                                              "a number >= 0 (0: every step runs every block)", None)),
        **_image_prompt(record, folder),
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
            job = parse_job(line, number, source, path.parent)
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


def with_native_size(jobs: list[Job], height: int, width: int, steps: int = DEFAULT_STEPS,
                     guidance: float = DEFAULT_GUIDANCE) -> list[Job]:
    """Jobs without a size get the model's native size, and without steps or guidance its family's defaults
    (before their keys are used)."""
    return [replace(job, height=job.height or height, width=job.width or width,
                    steps=job.steps if job.steps is not None else steps,
                    guidance=job.guidance if job.guidance is not None else guidance) for job in jobs]


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _control_errors(job: Job, controlnets: int) -> list[str]:
    """What is wrong with a job's control image(s) and scale for a pipeline with `controlnets` ControlNets."""
    from PIL import Image

    if not controlnets:
        given = [name for name in ("control_image", "control_scale") if getattr(job, name) not in ((), None)]
        return [f"`{given[0]}` needs --controlnet (the ControlNet it steers)."] if given else []
    wanted = f"{controlnets} control image{'s' if controlnets > 1 else ''}, one per ControlNet"
    if len(job.control_image) != controlnets:
        return [f"`control_image` must give {wanted}, but gives {len(job.control_image)}."]
    errors = []
    if isinstance(job.control_scale, tuple) and len(job.control_scale) != controlnets:
        errors.append(f"`control_scale` gives {len(job.control_scale)} scales for {controlnets} ControlNet"
                      f"{'s' if controlnets > 1 else ''}; give one number for all or a list of {controlnets}.")
    for path in job.control_image:
        with Image.open(path) as image:
            width, height = image.size
        if (height, width) != (job.height, job.width):
            errors.append(f"`control_image` {path} is {height}x{width} (height x width) but the job's image is "
                          f"{job.height}x{job.width}; give control images of the image's size.")
    return errors


def check_jobs(jobs: list[Job], profile: ShapeProfile, batch_size: int, max_steps: int | None = None,
               controlnets: int = 0, max_side: int | None = None) -> None:
    """Every job against what the compiled engines serve (and, with `controlnets` ControlNets, its control
    images and scale): one error listing each job that cannot run."""
    if batch_size < 1:
        raise InvalidJobs(f"--batch-size must be at least 1 but is {batch_size}.")
    if batch_size > profile.max.batch:
        raise InvalidJobs(f"--batch-size {batch_size} is more images per call than the profile serves "
                          f"(batch {profile.range_text('batch')}).")
    errors = []
    for job in jobs:
        if max_side is not None and max(job.height, job.width) > max_side:
            errors.append(f"{job.source}: {job.height}x{job.width} is more than this model serves: at most {max_side} "
                          "pixels per side.")
            continue
        try:
            profile.check(ImageShape(1, job.height, job.width))
        except ShapeOutOfProfile as error:
            errors.append(f"{job.source}: {error}")
        if max_steps is not None and job.steps > max_steps:
            errors.append(f"{job.source}: `steps` must be at most {max_steps} (what the model's scheduler runs) "
                          f"but is {job.steps}.")
        errors += [f"{job.source}: {error}" for error in _control_errors(job, controlnets)]
    if errors:
        hint = " (`kasoku batch` takes the same --height/--width MIN:MAX flags)"
        raise InvalidJobs(_listing(errors, "jobs do not fit the compiled engines") + hint)


class Batchable(Protocol):
    @property
    def call_key(self) -> tuple: ...


B = TypeVar("B", bound=Batchable)


def plan_batches(jobs: Sequence[B], batch_size: int) -> list[list[B]]:
    """Jobs that can share a call, in calls of up to `batch_size`, in the order given (so two runs of
    the same jobs make the same calls; the first call holds the first job)."""
    groups: dict[tuple, list[B]] = {}
    for job in jobs:
        groups.setdefault(job.call_key, []).append(job)
    return [group[i:i + batch_size] for group in groups.values() for i in range(0, len(group), batch_size)]

