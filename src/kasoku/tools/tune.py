"""`kasoku tune`: measure the compositions of speed-ups on this machine, keep the fastest within a fidelity bound.

Each candidate :class:`~kasoku.policies.recipes.Recipe` (a precision × a step-caching setting × the tiny VAE or the
model's own × exact-shape or range engines) is run on a fixed prompt set from fixed latents, timed per image,
and its images are held to the fp32 engines' (PSNR and SSIM, the worst prompt). The trials and their Pareto
front go into the cache (:class:`~kasoku.policies.recipes.RecipeBook`), written after every trial, so an interrupted
tuning resumes where it stopped; ``recipe="fastest"`` then runs the winner.

The recipe is a numbered recipe:
1. checks first: the size, steps, bound and budget, before any engine is built;
2. the record of this model, machine, backend and shape (resumed when its settings match);
3. the fp32 reference: the fp32 engines' images (kept beside the record);
4. the candidates, grouped by the engines they need (one compile per precision, VAE and shape; step caching
   reuses them), each warmed up, then timed and judged, until done or the budget is spent;
5. the front, and the winner at ``min_psnr``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.cache import default_cache_dir
from ..core.choices import TUNE_PRECISIONS
from ..core.components import ImageShape, ShapeProfile
from ..core.errors import KasokuError
from ..core.parity import psnr, ssim
from ..core.precision import Precision
from ..core.step_cache import DEEPCACHE, FIRST_BLOCK, TAYLORSEER
from ..model.pipeline_model import Model
from ..pipeline.checks import InvalidInput
from ..policies.fidelity import FIDELITY_PROMPTS, VERIFY_SEED, diffusers_inputs, seeded_call, task_inputs
from ..policies.recipes import Recipe, RecipeBook, Trial, TuneRecord, machine_identity, model_identity, record_key

__all__ = ["CACHING_SETTINGS", "PRECISIONS", "TuneReport", "candidate_recipes", "tune", "markdown", "plot"]

PRECISIONS = TUNE_PRECISIONS
# The step-caching settings tried per method (the call arguments of kasoku.core.step_cache): DeepCache's intervals as
# its paper's; TaylorSeer's up to diffusers' default interval of 5 and one past it (at 20 steps with its 3 warm-up
# steps, 4 and 5 compute the same 7 steps: 6 is the next that saves one); the first-block thresholds around
# diffusers' suggested 0.05-0.12.
CACHING_SETTINGS: dict[str, tuple[dict[str, Any], ...]] = {
    DEEPCACHE: tuple({"cache_method": DEEPCACHE, "cache_interval": n} for n in (2, 3, 5)),
    TAYLORSEER: tuple({"cache_method": TAYLORSEER, "cache_interval": n} for n in (2, 3, 5, 6)),
    FIRST_BLOCK: tuple({"cache_method": FIRST_BLOCK, "cache_threshold": t} for t in (0.05, 0.1, 0.2)),
}
TUNE_PROMPTS = FIDELITY_PROMPTS
WARMUP_STEPS = 2  # an untimed call before a recipe's images: first calls of an engine pay one-time costs

TrialHook = Callable[[Trial, int, int], None]  # (trial, its number, how many) after each measured trial


@dataclass
class TuneReport:
    """What a tuning found: the record (every trial, the front), what this run measured and what it left."""

    record: TuneRecord
    path: Path
    measured: int  # trials measured by this run
    resumed: int  # trials read from an earlier run of the same tuning
    left: int  # candidates the budget left unmeasured (a rerun measures them)
    min_psnr: float | None
    winner: Trial | None

    @property
    def front(self) -> list[Trial]:
        return self.record.front


def candidate_recipes(methods: Iterable[str], *, precisions: Iterable[str] = PRECISIONS,
                      caching: dict[str, tuple[dict[str, Any], ...]] | None = None, tiny_vae: str | None = None,
                      range_engines: bool = False) -> list[Recipe]:
    """Every composition to measure, the fp32 reference first: each precision × (no caching, each setting of the
    family's methods) × (the model's VAE, the tiny one when given) × (exact-shape engines, the range's too with
    `range_engines`)."""
    settings = caching if caching is not None else CACHING_SETTINGS
    cachings = [None, *(s for method in methods for s in settings.get(method, ()))]
    recipes = [Recipe.of("fp32")]
    for exact in (True, False) if range_engines else (True,):
        for vae in (None, tiny_vae) if tiny_vae else (None,):
            for precision in precisions:
                for arguments in cachings:
                    recipe = Recipe.of(precision, arguments, vae, exact)
                    if recipe not in recipes:
                        recipes.append(recipe)
    return recipes


def tune(
    model: Any,
    *,
    backend: str = "auto",
    steps: int | None = None,
    size: tuple[int, int] | None = None,
    guidance: float | None = None,
    min_psnr: float | None = None,
    budget_s: float | None = None,
    tiny_vae: str | Path | None = None,
    precisions: Iterable[str] = PRECISIONS,
    caching: dict[str, tuple[dict[str, Any], ...]] | None = None,
    range_engines: bool = False,
    prompts: Iterable[str] = TUNE_PROMPTS,
    cache_dir: str | Path | None = None,
    threads: int | None = None,
    restart: bool = False,
    on_trial: TrialHook | None = None,
    on_stage=None,
) -> TuneReport:
    """Measure the candidate recipes of `model` (a folder, a hub id when online, a live pipeline) on this machine.

    `size` is (width, height) (default: the model's native), `steps` and `guidance` the calls' (default: the
    family's); `min_psnr` picks the report's winner (the record keeps the whole front, any bound can be asked of
    it later); `budget_s` stops starting trials once that many seconds have passed (a rerun resumes);
    `caching` replaces CACHING_SETTINGS; `restart` drops an earlier record of the same tuning."""
    # 1. checks first
    prompts = [str(p) for p in prompts]
    start = time.perf_counter()
    model = Model.load(model, lazy=True, label=None if isinstance(model, Model) else _label(model))
    precisions = _checked_precisions(precisions)
    default_steps, default_guidance = model.command_defaults()
    steps = default_steps if steps is None else steps
    guidance = default_guidance if guidance is None else float(guidance)
    profile = _tune_profile(model, size, guidance)
    shape = profile.opt
    if not isinstance(steps, int) or steps < 1:
        raise InvalidInput(f"`steps` must be a positive whole number but is {steps!r}.")
    if budget_s is not None and budget_s <= 0:
        raise InvalidInput(f"`budget_s` must be a positive number of seconds but is {budget_s!r}.")
    if not prompts:
        raise InvalidInput("`prompts` is empty; the tuner judges recipes by their images of at least one prompt.")
    if tiny_vae is not None and not Path(tiny_vae).is_dir():
        raise InvalidInput(f"the tiny VAE {tiny_vae} is not a folder; give an AutoencoderTiny folder (TAESD), as "
                           "`kasoku tiny --tiny-vae` or diffusers' save_pretrained writes.")
    task = model.task
    extra = diffusers_inputs(model, task, task_inputs(model, task, ImageShape(1, shape.height, shape.width)))

    # 2. the record
    root = Path(cache_dir or default_cache_dir()).expanduser()
    model.remember_digests_under(root)
    book = RecipeBook(root)
    machine = machine_identity(threads)
    digest = model_identity(model)
    key = record_key(digest, machine, backend, shape.height, shape.width, bool(profile.guidance), steps)
    record = None if restart else book.load(key)
    reference_images = book.load_reference(key) if record is not None else None
    if record is None or not record.settings_match(guidance, prompts) or reference_images is None:
        record = TuneRecord(key=key, model=model.label, model_digest=digest, machine=machine, backend=backend,
                            height=shape.height, width=shape.width, guidance=guidance, guided=bool(profile.guidance),
                            steps=steps, prompts=prompts)
        reference_images = None
    candidates = candidate_recipes(model.family.cache_methods, precisions=precisions, caching=caching,
                                   tiny_vae=str(Path(tiny_vae).resolve()) if tiny_vae else None,
                                   range_engines=range_engines)
    todo = [r for r in candidates if record.trial_for(r) is None]
    resumed = len(candidates) - len(todo)

    def images_of(pipe, recipe: Recipe) -> tuple[list, list[float]]:
        call = dict(num_inference_steps=steps, guidance_scale=guidance, height=shape.height, width=shape.width,
                    output_type="np", **extra, **recipe.call_arguments)
        pipe(prompts[0], **{**call, "num_inference_steps": min(WARMUP_STEPS, steps)})  # warm-up, untimed
        images, seconds = [], []
        for index, prompt in enumerate(prompts):
            begun = time.perf_counter()
            images.append(seeded_call(pipe, prompt, VERIFY_SEED + index, **call).images)
            seconds.append(time.perf_counter() - begun)
        return images, seconds

    def over_budget() -> bool:  # the fp32 reference runs whatever the budget: nothing is judged without it
        return budget_s is not None and reference_images is not None and time.perf_counter() - start > budget_s

    measured = 0
    for group in _engine_groups(todo):
        if over_budget():
            break
        # 3./4. one compile per precision, VAE and shape; the reference's group first
        first = group[0]
        try:
            pipe = _compile(model, first, group, backend, profile, root, threads, on_stage)
        except KasokuError as error:
            if first.is_reference:
                raise  # nothing can be judged without the fp32 engines
            for recipe in group:
                record.trials.append(Trial(recipe, error=_first_line(error)))
                measured += 1
                _report(on_trial, record.trials[-1], record, candidates)
            book.save(record)
            continue
        for recipe in group:
            if over_budget():
                break
            try:
                images, seconds = images_of(pipe, recipe)
            except KasokuError as error:  # a guard rail (NaN, a constant image) or a call this recipe cannot make
                if recipe.is_reference:
                    raise
                trial = Trial(recipe, error=_first_line(error))
            else:
                if recipe.is_reference:
                    reference_images = images
                    book.save_reference(key, images)
                trial = Trial(recipe, seconds=statistics.median(seconds),
                              psnr_db=min(psnr(r, a) for r, a in zip(reference_images, images)),
                              ssim=min(ssim(r, a) for r, a in zip(reference_images, images)))
            record.trials.append(trial)
            measured += 1
            book.save(record)  # after every trial: an interrupted run resumes from here
            _report(on_trial, trial, record, candidates)
        del pipe
    # 5. the front and the winner
    left = sum(record.trial_for(r) is None for r in candidates)
    record.complete = left == 0
    path = book.save(record)
    winner = record.winner(min_psnr) if min_psnr is not None and record.front else None
    return TuneReport(record=record, path=path, measured=measured, resumed=resumed, left=left, min_psnr=min_psnr,
                      winner=winner)


def _label(model: Any) -> str | None:
    return str(model) if isinstance(model, (str, Path)) else None


def _checked_precisions(precisions: Iterable[str]) -> tuple[str, ...]:
    out = []
    for value in precisions:
        try:
            out.append(Precision(str(value).strip()).value)
        except ValueError:
            raise InvalidInput(f"the tuner's precisions are among {', '.join(p.value for p in Precision)} but one "
                               f"is {value!r}.") from None
    if Precision.FP32.value not in out:
        out.insert(0, Precision.FP32.value)  # the reference every recipe is judged against
    return tuple(dict.fromkeys(out))


def _tune_profile(model: Model, size: tuple[int, int] | None, guidance: float) -> ShapeProfile:
    """The exact-shape profile of the tuned calls: one image of `size` (width, height), with or without guidance."""
    base = model.default_profile()
    width, height = size or (base.opt.width, base.opt.height)
    for name, value in (("width", width), ("height", height)):
        if not isinstance(value, int) or value < base.multiple or value % base.multiple:
            raise InvalidInput(f"the tuned {name} must be a positive multiple of {base.multiple} for this model but "
                               f"is {value!r}.")
    guided = model.doubles_batch({"guidance_scale": guidance})
    return ShapeProfile.exact(ImageShape(1, height, width), guidance=guided, multiple=base.multiple,
                              text_tokens=base.text_tokens)


def _engine_groups(recipes: list[Recipe]) -> list[list[Recipe]]:
    """The recipes by the engines they run (precision, VAE, shape), in order: step caching only changes calls."""
    groups: dict[tuple, list[Recipe]] = {}
    for recipe in recipes:
        groups.setdefault((recipe.precision, recipe.tiny_vae, recipe.exact_shape), []).append(recipe)
    return list(groups.values())


def _compile(model: Model, recipe: Recipe, group: list[Recipe], backend: str, profile: ShapeProfile, root: Path,
             threads: int | None, on_stage):
    from ..pipeline.kasoku_pipeline import compile

    step_cache = any(_graphs(model, r) for r in group)
    target = Model.load(model, tiny_vae=recipe.tiny_vae) if recipe.tiny_vae else model
    pipe = compile(target, backend, precision=recipe.precision, components=model.task_components(model.task),
                   profile=profile if recipe.exact_shape else model.default_profile(), step_cache=step_cache,
                   cache_dir=root, threads=threads, label=model.label, **({"on_stage": on_stage} if on_stage else {}))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _graphs(model: Model, recipe: Recipe) -> tuple[str, ...]:
    from ..core.step_cache import StepCaching

    return StepCaching.of(model.family.cache_methods, **recipe.call_arguments).graphs


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _report(hook: TrialHook | None, trial: Trial, record: TuneRecord, candidates: list[Recipe]) -> None:
    if hook is not None:
        done = sum(record.trial_for(r) is not None for r in candidates)
        hook(trial, done, len(candidates))


# ---- what the tuner shows -------------------------------------------------------------------------


def markdown(report: TuneReport) -> str:
    """The trials as a table (the front marked), fastest first, and the winner."""
    record = report.record
    front = record.front
    reference = next((t for t in record.trials if t.recipe.is_reference and t.ok), None)
    lines = [f"## kasoku tune: {record.model}, {record.width}x{record.height}, {record.steps} steps, guidance "
             f"{record.guidance:g}, backend {record.backend}",
             "",
             f"{record.machine['cpu']}, {record.machine['threads']} threads, CPU flags: "
             f"{', '.join(record.machine['flags']) or 'none of note'}. Each recipe: median seconds per image of "
             f"{len(record.prompts)} prompts, the worst prompt's PSNR/SSIM against the fp32 engines' images from "
             "the same latents. ★: on the Pareto front (nothing is both faster and closer).",
             "",
             "| recipe | s / image | speed-up vs fp32 | PSNR vs fp32 | SSIM | front |",
             "| --- | --- | --- | --- | --- | --- |"]
    for trial in sorted((t for t in record.trials if t.ok), key=lambda t: t.seconds):
        speed = f"{reference.seconds / trial.seconds:.2f}x" if reference else "—"
        db = "reference" if trial.recipe.is_reference else f"{trial.psnr_db:.1f} dB"
        lines.append(f"| {trial.recipe.label} | {trial.seconds:.3f} | {speed} | {db} | {trial.ssim:.4f} | "
                     f"{'★' if trial in front else ''} |")
    lines.append("")
    failed: dict[str, list[str]] = {}
    for trial in record.trials:
        if not trial.ok:
            failed.setdefault(trial.error or "failed", []).append(trial.recipe.label)
    for error, labels in failed.items():
        lines.append(f"- not measured here: {', '.join(labels)}: {error}")
    if failed:
        lines.append("")
    if report.left:
        lines.append(f"{report.left} candidate(s) not measured yet (the budget ran out): run the same command again to "
                     "measure them; what is measured is kept.")
    if report.winner is not None:
        lines.append(f"Winner at {report.min_psnr:g} dB: **{report.winner.recipe.label}** "
                     f"({report.winner.seconds:.3f} s per image). Run it with `kasoku generate MODEL PROMPT --recipe "
                     f"fastest --min-psnr {report.min_psnr:g}` or `kasoku.compile(pipe, recipe=\"fastest\", "
                     f"min_psnr={report.min_psnr:g})`.")
    return "\n".join(lines)


def plot(report: TuneReport, path: str | Path) -> Path:
    """A PNG chart of the trials, seconds per image against PSNR from the fp32 engines, the front joined."""
    try:
        import matplotlib
    except ImportError:
        raise KasokuError("the chart needs matplotlib: pip install 'kasoku[plot]' (or leave out --chart).") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record = report.record
    measured = [t for t in record.trials if t.ok and not t.recipe.is_reference]
    reference = next((t for t in record.trials if t.recipe.is_reference and t.ok), None)
    ceiling = max([t.psnr_db for t in measured] + [0.0]) + 5  # where the reference (infinite PSNR) is drawn
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.scatter([t.seconds for t in measured], [t.psnr_db for t in measured], color="tab:gray", label="recipes")
    for trial in measured:
        ax.annotate(trial.recipe.label, (trial.seconds, trial.psnr_db), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    front = [(t.seconds, ceiling if t.recipe.is_reference else t.psnr_db) for t in record.front]
    ax.plot([x for x, _ in front], [y for _, y in front], color="tab:red", marker="o", label="Pareto front")
    if reference is not None:
        ax.scatter([reference.seconds], [ceiling], color="black", marker="*", s=120, label="fp32 (reference)")
    if report.min_psnr is not None:
        ax.axhline(report.min_psnr, color="tab:blue", linestyle="--", label=f"min PSNR {report.min_psnr:g} dB")
    ax.set_xlabel("seconds per image")
    ax.set_ylabel("PSNR vs fp32 engines (dB)")
    ax.set_title(f"kasoku tune · {record.width}x{record.height}, {record.steps} steps · {record.machine['cpu']}",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
