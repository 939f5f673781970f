"""Recipes: compositions of kasoku's speed-ups, and the tuner's records of which is fastest within a fidelity bound.

A :class:`Recipe` is one composition: a precision for every component, a step-caching setting (the call
arguments of :mod:`kasoku.core.step_cache`), the tiny VAE or the model's own, exact-shape engines or the model's
range. ``kasoku tune`` (:mod:`kasoku.tools.tune`) measures recipes against the fp32 engines and keeps a
:class:`TuneRecord` per model, machine, backend and shape in the cache folder (``recipes/``); the record is
written after every trial, so an interrupted tuning resumes where it stopped. ``recipe="fastest"`` on
``kasoku.compile`` (and ``--recipe fastest`` on generate, batch and serve) reads the record and runs its
winner: the fastest recipe on the Pareto front whose images stay at least ``min_psnr`` dB from the fp32 engines'.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..backends.base import cpu_flags, cpu_name
from ..core.cache import CorruptEntryWarning, atomic_write_text
from ..core.errors import KasokuError

__all__ = ["ChosenRecipe", "NoTunedRecipe", "Recipe", "RecipeBook", "Trial", "TuneRecord",
           "machine_identity", "model_identity", "pareto_front", "recorded_winner", "with_recipe"]

RECIPES_DIR = "recipes"  # under the cache folder
# the denoiser and text encoders are what a tuning is of: a swapped VAE (the tiny one) is part of the recipe
IDENTITY_MODULES = ("unet", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3")


class NoTunedRecipe(KasokuError, LookupError):
    """``recipe="fastest"`` for a model, machine and shape that were never tuned."""


@dataclass(frozen=True)
class Recipe:
    """One composition of speed-ups, as `kasoku tune` measures it and `recipe="fastest"` runs it."""

    precision: str = "fp32"
    caching: tuple[tuple[str, Any], ...] = ()  # step-caching call arguments (name, value), sorted
    tiny_vae: str | None = None  # the AutoencoderTiny folder that replaces the VAE, or None: the model's own
    exact_shape: bool = True  # engines for the tuned shape only (faster on CPUs), or the model's default range

    @classmethod
    def of(cls, precision: str = "fp32", caching: dict[str, Any] | None = None, tiny_vae: str | Path | None = None,
           exact_shape: bool = True) -> Recipe:
        return cls(str(precision), tuple(sorted((caching or {}).items())), str(tiny_vae) if tiny_vae else None,
                   exact_shape)

    @property
    def call_arguments(self) -> dict[str, Any]:
        """The step-caching arguments a call runs with (those of kasoku.core.step_cache.StepCaching.ARGUMENTS)."""
        return dict(self.caching)

    @property
    def is_reference(self) -> bool:
        """fp32 engines of the model as it is, every step computed: what every recipe is judged against."""
        return self.precision == "fp32" and not self.caching and self.tiny_vae is None

    @property
    def label(self) -> str:
        parts = [self.precision]
        arguments = self.call_arguments
        if arguments:
            method = arguments.get("cache_method") or ("first-block" if "cache_threshold" in arguments else "caching")
            setting = (f"threshold {arguments['cache_threshold']:g}" if "cache_threshold" in arguments
                       else f"interval {arguments.get('cache_interval', 1)}")
            parts.append(f"{method} {setting}")
        if self.tiny_vae:
            parts.append("tiny VAE")
        if not self.exact_shape:
            parts.append("range engines")
        return " + ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"precision": self.precision, "caching": dict(self.caching), "tiny_vae": self.tiny_vae,
                "exact_shape": self.exact_shape}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Recipe:
        return cls.of(data["precision"], data.get("caching"), data.get("tiny_vae"), data.get("exact_shape", True))


@dataclass
class Trial:
    """One recipe as measured: median seconds per image, and its images' worst PSNR/SSIM against the fp32
    engines' (the same prompts and latents); `error` when it could not be built or run here."""

    recipe: Recipe
    seconds: float | None = None
    psnr_db: float | None = None  # inf for the reference itself
    ssim: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.seconds is not None and self.psnr_db is not None

    def to_dict(self) -> dict[str, Any]:
        psnr = None if self.psnr_db is None else ("inf" if math.isinf(self.psnr_db) else self.psnr_db)
        return {"recipe": self.recipe.to_dict(), "seconds": self.seconds, "psnr_db": psnr, "ssim": self.ssim,
                "error": self.error}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trial:
        psnr = data.get("psnr_db")
        return cls(Recipe.from_dict(data["recipe"]), data.get("seconds"),
                   math.inf if psnr == "inf" else psnr, data.get("ssim"), data.get("error"))


def pareto_front(trials: list[Trial]) -> list[Trial]:
    """The trials no other beats on both speed and fidelity, fastest first: each one slower than the one
    before it and strictly closer to the fp32 images."""
    front: list[Trial] = []
    for trial in sorted((t for t in trials if t.ok), key=lambda t: (t.seconds, -t.psnr_db)):
        if not front or trial.psnr_db > front[-1].psnr_db:
            front.append(trial)
    return front


@dataclass
class TuneRecord:
    """Every trial of one tuning: a model on a machine and backend, at one shape, steps and guidance."""

    key: str
    model: str  # the label the user gave (a folder, a hub id)
    model_digest: str
    machine: dict[str, Any]
    backend: str
    height: int
    width: int
    guidance: float
    guided: bool  # classifier-free guidance: batch-2 denoiser engines (Flux's embedded guidance is none)
    steps: int
    prompts: list[str]
    trials: list[Trial] = field(default_factory=list)
    complete: bool = False
    updated: float = 0.0

    @property
    def front(self) -> list[Trial]:
        return pareto_front(self.trials)

    def trial_for(self, recipe: Recipe) -> Trial | None:
        return next((t for t in self.trials if t.recipe == recipe), None)

    def winner(self, min_psnr: float) -> Trial:
        """The fastest recipe of the front whose images stay at least `min_psnr` dB from the fp32 engines' (the
        reference itself when none other does)."""
        fitting = [t for t in self.front if t.psnr_db >= min_psnr]
        if not fitting:
            raise NoTunedRecipe(f"the tuning of {self.model} at {self.width}x{self.height} has no measured recipe "
                                f"(its fp32 reference was not measured); run `kasoku tune {self.model}` again to "
                                "resume it.")
        return fitting[0]

    def settings_match(self, guidance: float, prompts: list[str]) -> bool:
        """Whether a tuning with these settings continues this record (else it starts over)."""
        return self.guidance == guidance and list(self.prompts) == list(prompts)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["trials"] = [t.to_dict() for t in self.trials]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TuneRecord:
        trials = [Trial.from_dict(t) for t in data.pop("trials", [])]
        return cls(**data, trials=trials)


def machine_identity(threads: int | None = None) -> dict[str, Any]:
    """What about this machine decides which recipe is fastest: the CPU, the precision features it has, and the
    threads an engine uses."""
    import torch

    return {"cpu": cpu_name(), "flags": cpu_flags(), "threads": threads or torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def model_identity(model) -> str:
    """A digest of the model's family and its denoiser and text encoders' weights (its VAE is part of a recipe)."""
    pipe = model.pipe
    digests = {attr: model.weights.of(pipe, attr) for attr in IDENTITY_MODULES if getattr(pipe, attr, None) is not None}
    return _digest({"family": model.family.name, **digests})


def _digest(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def record_key(model_digest: str, machine: dict[str, Any], backend: str, height: int, width: int,
               guided: bool, steps: int) -> str:
    """The record's file name: model and machine, then backend, shape and steps (a model's records list together)."""
    return f"{_prefix(model_digest, machine)}-{backend}-{width}x{height}-{'cfg' if guided else 'nocfg'}-{steps}"


def _prefix(model_digest: str, machine: dict[str, Any]) -> str:
    return f"{model_digest[:16]}-{_digest(machine)[:8]}"


class RecipeBook:
    """The tuning records in a cache folder (`<cache>/recipes/<key>.json`, the reference images beside them)."""

    def __init__(self, root: str | Path):
        self.folder = Path(root) / RECIPES_DIR

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.json"

    def images_path(self, key: str) -> Path:
        return self.folder / f"{key}-reference.npz"

    def load(self, key: str) -> TuneRecord | None:
        """The record, or None when there is none; a damaged one is said and ignored (a tuning starts over)."""
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            return TuneRecord.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as error:
            warnings.warn(f"the tuning record {path} is damaged ({error}); it is ignored and tuned again.",
                          CorruptEntryWarning, stacklevel=2)
            return None

    def save(self, record: TuneRecord) -> Path:
        record.updated = time.time()
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path(record.key)
        atomic_write_text(path, json.dumps(record.to_dict(), indent=1))
        return path

    def save_reference(self, key: str, images: list) -> None:
        import numpy as np

        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.images_path(key).with_suffix(f".{os.getpid()}.npz")
        np.savez(tmp, *images)
        os.replace(tmp, self.images_path(key))

    def load_reference(self, key: str) -> list | None:
        import numpy as np

        path = self.images_path(key)
        if not path.is_file():
            return None
        try:
            with np.load(path) as data:
                return [data[f"arr_{i}"] for i in range(len(data.files))]
        except (OSError, ValueError, KeyError):
            return None

    def records_of(self, model_digest: str, machine: dict[str, Any], backend: str | None = None) -> list[TuneRecord]:
        """Every record of this model on this machine (one per backend and tuned shape; of `backend` only where
        given), newest first."""
        if not self.folder.is_dir():
            return []
        paths = sorted(self.folder.glob(f"{_prefix(model_digest, machine)}-*.json"))
        records = [r for r in (self.load(p.stem) for p in paths) if r is not None]
        return sorted((r for r in records if backend is None or r.backend == backend), key=lambda r: -r.updated)


def recorded_winner(model, *, backend: str | dict, profile, min_psnr: float, threads: int | None,
                    root: str | Path) -> tuple[TuneRecord, Trial]:
    """The tuning record of `model` on this machine that `profile` asks for, and its winner at `min_psnr`.

    The record is the newest of the profile's shape and guidance (its optimum, for a range); a model tuned at one
    shape only is found whatever the profile. `backend` given as a mapping (what `auto` resolved to) matches
    the record of any backend."""
    machine = machine_identity(threads)
    asked = backend if isinstance(backend, str) else None
    model.remember_digests_under(root)  # a warm start reads the weights' digests from the cache, not the weights
    records = RecipeBook(root).records_of(model_identity(model), machine, asked)
    if profile is not None:
        shape = profile.opt
        same = [r for r in records if (r.height, r.width) == (shape.height, shape.width)
                and (profile.guidance is None or r.guided == profile.guidance)]
        records = same or (records if len({(r.height, r.width, r.guided) for r in records}) == 1 else [])
    elif len({(r.height, r.width, r.guided) for r in records}) > 1:
        sizes = ", ".join(sorted({f"{r.width}x{r.height}" for r in records}))
        raise NoTunedRecipe(f"{model.label} is tuned at several sizes ({sizes}) on this machine; say which: a "
                            "profile of that size (kasoku.compile(..., profile=...)) or --width/--height.")
    if not records:
        at = f" at {profile.opt.width}x{profile.opt.height}" if profile is not None else ""
        size = f" --size {profile.opt.width}x{profile.opt.height}" if profile is not None else ""
        from ..core.cache import default_cache_dir

        if Path(root).expanduser().resolve() != default_cache_dir().expanduser().resolve():
            size += f" --cache-dir {root}"
        raise NoTunedRecipe(f"recipe 'fastest' needs a tuning of {model.label}{at} on this machine "
                            f"({machine['cpu']}, {machine['threads']} threads, backend {asked or 'any'}), and the "
                            f"cache at {root} has none. Run `kasoku tune {model.label}{size} --min-psnr "
                            f"{min_psnr:g}` first (it measures the compositions of speed-ups here and records the "
                            "fastest), or compile without a recipe.")
    record = records[0]
    return record, record.winner(min_psnr)


@dataclass(frozen=True)
class ChosenRecipe:
    """The recipe a `recipe="fastest"` compile runs, with what the tuning measured of it."""

    recipe: Recipe
    trial: Trial
    record: TuneRecord
    min_psnr: float

    @property
    def call_arguments(self) -> dict[str, Any]:
        """The step caching its calls run when a call turns on none of its own."""
        return self.recipe.call_arguments

    @property
    def note(self) -> str:
        record, trial = self.record, self.trial
        fidelity = "the fp32 reference itself" if trial.recipe.is_reference else \
            f"images {trial.psnr_db:.1f} dB from the fp32 engines'"
        return (f"recipe fastest at {self.min_psnr:g} dB: {self.recipe.label} ({trial.seconds:.3f} s per image, "
                f"{fidelity}, as tuned at {record.width}x{record.height}, {record.steps} steps on this machine)")


def with_recipe(model, options, root: str | Path):
    """(model, options, ChosenRecipe): `options` with `recipe` resolved into the precision, the profile (the tuned
    shape, unless the caller gave one) and the step-cache engines its caching runs; the model with the tuned tiny VAE
    unless its VAE is a tiny one already (the caller's)."""
    from ..core.components import ImageShape, ShapeProfile
    from ..core.step_cache import StepCaching
    from ..model.pipeline_model import Model

    record, trial = recorded_winner(model, backend=options.backend, profile=options.profile,
                                    min_psnr=options.min_psnr, threads=options.threads, root=root)
    recipe = trial.recipe
    profile = options.profile
    if profile is None:
        base = model.default_profile()
        profile = base if not recipe.exact_shape else ShapeProfile.exact(
            ImageShape(1, record.height, record.width), guidance=record.guided, multiple=base.multiple,
            text_tokens=base.text_tokens)
    graphs = StepCaching.of(model.family.cache_methods, **recipe.call_arguments).graphs
    options = options.replace(recipe=None, precision=recipe.precision, profile=profile,
                              step_cache=options.step_cache or bool(graphs))
    if recipe.tiny_vae and type(getattr(model.pipe, "vae", None)).__name__ != "AutoencoderTiny":
        model = Model.load(model, tiny_vae=recipe.tiny_vae)
    return model, options, ChosenRecipe(recipe, trial, record, options.min_psnr)
