"""`kasoku verify`: does every engine still compute what torch computes?

Each component's engine runs at the smallest, typical and largest shape of its profile on
random inputs and is compared with the torch component (max abs / rel error, cosine, NaN and
Inf counts); then an image from the accelerated pipeline is compared with diffusers' torch
pipeline (PSNR, max pixel difference); with step caching (`cache_interval` > 1), its images are
compared with the same engines' without it. Tolerances come from the one table in kasoku.core.parity.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ..core.cache import Cache
from ..core.components import ImageShape, Precision, ShapeProfile
from ..core.options import CompileOptions
from ..core.parity import (
    STEP_CACHE_INTERVAL,
    TOLERANCES,
    OutputParity,
    parity_against_torch,
    psnr,
    ssim,
    step_cache_contract,
)
from ..core.step_cache import DEFAULT_SCHEDULE, FIRST_BLOCK, InvalidStepCache, StepCaching
from ..model.pipeline_model import Model
from ..pipeline.kasoku_pipeline import KasokuPipeline, compile
from ..policies.fidelity import (  # noqa: F401 - verify's prompts and seed, where callers read them
    FIDELITY_PROMPTS,
    VERIFY_PROMPT,
    VERIFY_SEED,
    contract_steps,
    diffusers_inputs,
    inpaint_inputs,
    seeded_call,
    task_inputs,
)
from ..runtime.image_prompts import load_files


@dataclass
class ImageParity:
    psnr_db: float  # the worst over the prompts
    max_abs: float
    bound_db: float
    nan: int
    passed: bool
    shape: str
    ssim: float = 1.0  # the worst over the prompts
    bound_ssim: float = 0.0
    reference: str = "diffusers"  # what the images are compared with
    per_prompt: list[dict] = field(default_factory=list)


@dataclass
class VerifyReport:
    model: str
    precision: str
    backends: dict[str, str]
    components: list[OutputParity] = field(default_factory=list)
    image: ImageParity | None = None
    step_cache: ImageParity | None = None  # images with step caching against the same engines without it
    family: str = ""
    notes: list[str] = field(default_factory=list)
    damaged_entries: list[str] = field(default_factory=list)  # cache entries whose checksums do not match

    @property
    def passed(self) -> bool:
        return (all(c.passed for c in self.components) and all(i.passed for i in (self.image, self.step_cache) if i)
                and not self.damaged_entries)

    @property
    def failed_components(self) -> list[str]:
        return sorted({c.component for c in self.components if not c.passed})

    def to_dict(self) -> dict:
        data = asdict(self)
        data["passed"] = self.passed
        data["failed_components"] = self.failed_components
        return data


def verification_shapes(profile: ShapeProfile) -> dict[str, ImageShape]:
    return {"smallest": profile.min, "typical": profile.opt, "largest": profile.max}


def verify(
    model,
    backend: str | None = None,
    *,
    controlnet=None,
    tiny_vae=None,
    options: CompileOptions | None = None,
    image: bool = True,
    on_stage=None,
    cache_interval: int = 1,
    cache_schedule: str = DEFAULT_SCHEDULE,
    ip_adapter=None,
    cache_method: str | None = None,
    cache_threshold: float | None = None,
    cache_order: int | None = None,
    cache_warmup: int | None = None,
    **fields,
) -> VerifyReport:
    """Compare every engine with torch at three shapes, and an image with diffusers; check the full
    checksums of the engines' cache entries. `controlnet` (ControlNet folders or models) verifies the
    ControlNet pipeline, `tiny_vae` (an AutoencoderTiny or its folder) the pipeline on it. `options` (or
    its fields as keywords) as for compile. With step caching (`cache_interval` > 1, `cache_threshold`, ...:
    the pipeline's call arguments, kasoku.core.step_cache) its engines are verified too, and the images of calls
    with it are compared with the same engines' without step caching. `ip_adapter` (IP-Adapter weights files,
    their image encoder beside the first) verifies the image encoder and the U-Net with image prompts, and
    images with a random image prompt."""
    options = CompileOptions.of(options, backend=backend, **fields).replace(check_parity=False)
    reference = Model.load(model, controlnet=controlnet, tiny_vae=tiny_vae)
    try:
        caching = StepCaching.of(reference.family.cache_methods, cache_interval=cache_interval,
                                 cache_schedule=cache_schedule, cache_method=cache_method,
                                 cache_threshold=cache_threshold, cache_order=cache_order, cache_warmup=cache_warmup)
    except InvalidStepCache as error:
        raise InvalidStepCache(f"{reference.family.title}: {error}") from None
    if caching.graphs:
        options = options.replace(step_cache=True)
    if ip_adapter:
        load_files(reference, ip_adapter)
    label = reference.label
    kwargs = {"on_stage": on_stage} if on_stage else {}
    compared_with_fp32 = image and options.precision != Precision.FP32
    # the fp32 engines the images are held to are built from the same exports: keep them until then
    first = options.replace(keep_intermediate=True) if compared_with_fp32 else options
    pipe: KasokuPipeline = compile(reference, options=first, label=label, **kwargs)
    specs = reference.specs(pipe.profile, list(pipe.engines), cache_branch=options.cache_branch)
    report = VerifyReport(model=label, precision=options.precision_label,
                          backends={n: e.backend for n, e in pipe.engines.items()},
                          family=reference.family.title, notes=pipe.compile_report.notes)
    cache = Cache(options.cache_dir)
    for stage in pipe.compile_report.stages:
        if stage.stage == "engine":
            problem = cache.verify(cache.entries / stage.key, stage.key)
            if problem is not None:
                report.damaged_entries.append(f"{stage.component} engine {stage.key[:12]}: {problem}")
    for name, engine in pipe.engines.items():
        shapes = dict.fromkeys(verification_shapes(pipe.profile).values())
        built_in = Precision(pipe.compile_report.precisions[name])  # an SDXL VAE kept fp32 is held to fp32's bound
        report.components += parity_against_torch(specs[name], engine.run, shapes, built_in, seed=11)
    if image:
        report.image = image_parity(reference, pipe, _image_precision(pipe), options, on_stage)
    if image and caching.active:
        report.step_cache = step_cache_parity(reference, pipe, caching)
    return report


def image_parity(reference: Model, pipe: KasokuPipeline, precision: Precision, options: CompileOptions | None = None,
                 on_stage=None) -> ImageParity:
    """The precision's image contract: fp32 against diffusers' own torch image; a lower precision
    against kasoku's fp32 engines on the same backend, on FIDELITY_PROMPTS at the contract's steps,
    with the same initial latents (the same seed). PSNR and SSIM, the worst over the prompts."""
    tolerance = TOLERANCES[precision]
    task = reference.task
    shape = pipe.profile.opt
    steps = contract_steps(reference, task, tolerance.image_steps)
    extra = task_inputs(reference, task, shape)
    if tolerance.image_reference == "diffusers":
        expected_pipe, prompts = reference.task_pipeline(task), (VERIFY_PROMPT,)
        expected_extra = {**diffusers_inputs(reference, task, extra), **pipe.fixed_arguments}
    else:
        kwargs = {"on_stage": on_stage} if on_stage else {}
        fp32 = (options or CompileOptions()).replace(precision=Precision.FP32, profile=pipe.profile,
                                                     int8_activations=(), int4_weights=())
        expected_pipe, prompts = compile(reference, options=fp32, **kwargs), FIDELITY_PROMPTS
        expected_extra = extra

    def run(p, prompt, inputs):
        return seeded_call(p, prompt, VERIFY_SEED, num_inference_steps=steps, height=shape.height,
                           width=shape.width, output_type="np", **inputs).images

    return _compare_images(prompts, lambda prompt: run(expected_pipe, prompt, expected_extra),
                           lambda prompt: run(pipe, prompt, extra),
                           tolerance, shape, tolerance.image_reference, steps)


def step_cache_parity(reference: Model, pipe: KasokuPipeline, caching: StepCaching) -> ImageParity:
    """Step caching's contract (its method's entry of the tolerance table): the images of calls with `caching`
    against the same engines' without it, on FIDELITY_PROMPTS at the contract's steps, with the same initial
    latents (the same seed)."""
    tolerance = TOLERANCES[step_cache_contract(caching.method)]
    task = reference.task
    shape = pipe.profile.opt
    extra = inpaint_inputs(shape) if task == "inpaint" else {}

    def run(prompt, **cache):
        return seeded_call(pipe, prompt, VERIFY_SEED, num_inference_steps=tolerance.image_steps, height=shape.height,
                           width=shape.width, output_type="np", **extra, **cache).images

    beyond = ""
    if caching.method != FIRST_BLOCK and caching.interval > STEP_CACHE_INTERVAL:
        beyond = f"; beyond the contract's interval {STEP_CACHE_INTERVAL}"
    return _compare_images(FIDELITY_PROMPTS, run, lambda prompt: run(prompt, **caching.arguments()),
                           tolerance, shape, f"{tolerance.image_reference} ({caching}{beyond})", tolerance.image_steps)


def _compare_images(prompts, expected, actual, tolerance, shape: ImageShape, reference: str,
                    steps: int) -> ImageParity:
    """PSNR and SSIM of `actual(prompt)` against `expected(prompt)` per prompt, the worst against the bounds."""
    rows = []
    for prompt in prompts:
        want, got = expected(prompt), actual(prompt)
        rows.append({"prompt": prompt, "psnr_db": float(psnr(want, got)), "ssim": ssim(want, got),
                     "max_abs": float(np.abs(np.nan_to_num(got) - want).max()), "nan": int(np.isnan(got).sum())})
    worst_psnr, worst_ssim = min(r["psnr_db"] for r in rows), min(r["ssim"] for r in rows)
    nan = sum(r["nan"] for r in rows)
    return ImageParity(psnr_db=worst_psnr, max_abs=max(r["max_abs"] for r in rows), bound_db=tolerance.image_psnr_db,
                       nan=nan, ssim=worst_ssim, bound_ssim=tolerance.image_ssim, reference=reference,
                       passed=nan == 0 and worst_psnr >= tolerance.image_psnr_db and worst_ssim >= tolerance.image_ssim,
                       shape=f"1x{shape.height}x{shape.width}, {steps} steps, {len(prompts)} prompt(s)",
                       per_prompt=rows)


def _image_precision(pipe) -> Precision:
    """The contract an image is held to: the lowest precision among its engines' (fp32 < fp16 < bf16 < int8)."""
    order = list(Precision)
    return max((Precision(p) for p in pipe.compile_report.precisions.values()), key=order.index)


def _bound(c: OutputParity) -> str:
    return f"max abs {c.limit:.1e}" if c.limit != float("inf") else f"rel error {c.rel_error_limit:.1e}"


def markdown(report: VerifyReport) -> str:
    """The report as a markdown table (what the terminal shows)."""
    lines = [
        f"# kasoku verify: {report.model} ({', '.join(filter(None, (report.family, report.precision)))})",
        "",
        "| status | component | output | shape | max abs | rel error | cosine | NaN | Inf | tolerance |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in report.components:
        lines.append(f"| {'PASSED' if c.passed else 'FAILED'} | {c.component} ({report.backends[c.component]}) | "
                     f"{c.output} | {c.shape} | {c.max_abs:.2e} | {c.rel_error:.2e} | {c.cosine:.6f} | {c.nan} | "
                     f"{c.inf} | {_bound(c)} |")
    for title, i in (("Image", report.image), ("Step caching: image", report.step_cache)):
        if i:
            lines += ["", f"{title} vs {i.reference} ({i.shape}): PSNR {i.psnr_db:.1f} dB (bound {i.bound_db:.0f} "
                          f"dB), SSIM {i.ssim:.4f} (bound {i.bound_ssim:.2f}), max pixel difference {i.max_abs:.2e}, "
                          f"NaN {i.nan}: {'PASSED' if i.passed else 'FAILED'}"]
    lines += [""] + [f"Note: {note}" for note in report.notes] if report.notes else []
    lines += [""] + [f"Damaged cache entry: {entry}" for entry in report.damaged_entries] \
        if report.damaged_entries else []
    failed = report.failed_components + (["cache"] if report.damaged_entries else [])
    failed += [name for name, i in (("image", report.image), ("step caching", report.step_cache)) if i and not i.passed]
    verdict = "PASSED" if report.passed else f"FAILED: {', '.join(failed)}"
    lines += ["", f"**{verdict}**"]
    return "\n".join(lines)
