"""`kasoku verify`: does every engine still compute what torch computes?

Each component's engine runs at the smallest, typical and largest shape of its profile on
random inputs and is compared with the torch component (max abs / rel error, cosine, NaN and
Inf counts); then an image from the accelerated pipeline is compared with diffusers' torch
pipeline (PSNR, max pixel difference). Tolerances come from the one table in kasoku.parity.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from .components import ImageShape, Precision, ShapeProfile, component_specs
from .families import family_of
from .options import CompileOptions
from .parity import TOLERANCES, OutputParity, parity_against_torch, psnr, ssim

VERIFY_PROMPT = "a photo of an astronaut riding a horse on mars"
VERIFY_SEED = 0
# A lower precision's images are held to the fp32 engines' on these prompts (the fidelity contract).
FIDELITY_PROMPTS = (VERIFY_PROMPT, "a watercolor painting of a red fox in the snow",
                    "a photograph of a lighthouse at sunset, detailed")


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
    family: str = ""
    notes: list[str] = field(default_factory=list)
    damaged_entries: list[str] = field(default_factory=list)  # cache entries whose checksums do not match

    @property
    def passed(self) -> bool:
        return (all(c.passed for c in self.components) and (self.image is None or self.image.passed)
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
    options: CompileOptions | None = None,
    image: bool = True,
    on_stage=None,
    **fields,
) -> VerifyReport:
    """Compare every engine with torch at three shapes, and an image with diffusers; check the full
    checksums of the engines' cache entries. `options` (or its fields as keywords) as for compile."""
    from .cache import Cache
    from .loading import load_pipeline, model_label
    from .pipeline import KasokuPipeline, compile

    options = CompileOptions.of(options, backend=backend, **fields).replace(check_parity=False)
    reference = load_pipeline(model)
    label = model_label(model)
    kwargs = {"on_stage": on_stage} if on_stage else {}
    compared_with_fp32 = image and options.precision != Precision.FP32
    # the fp32 engines the images are held to are built from the same exports: keep them until then
    first = options.replace(keep_intermediate=True) if compared_with_fp32 else options
    pipe: KasokuPipeline = compile(reference, options=first, label=label, **kwargs)
    specs = component_specs(reference, pipe.profile)
    report = VerifyReport(model=label, precision=options.precision_label,
                          backends={n: e.backend for n, e in pipe.engines.items()},
                          family=family_of(reference).title, notes=pipe.compile_report.notes)
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
    return report


def image_parity(reference, pipe, precision: Precision, options: CompileOptions | None = None,
                 on_stage=None) -> ImageParity:
    """The precision's image contract: fp32 against diffusers' own torch image; a lower precision
    against kasoku's fp32 engines on the same backend, on FIDELITY_PROMPTS at the contract's steps,
    with the same initial latents (the same seed). PSNR and SSIM, the worst over the prompts."""
    from .pipeline import compile

    tolerance = TOLERANCES[precision]
    family = family_of(reference)
    task = family.tasks(reference)[0]
    extra = _inpaint_inputs(pipe.profile.opt) if task == "inpaint" else {}
    if tolerance.image_reference == "diffusers":
        expected_pipe, prompts = family.task_pipeline(reference, task), (VERIFY_PROMPT,)
    else:
        kwargs = {"on_stage": on_stage} if on_stage else {}
        fp32 = (options or CompileOptions()).replace(precision=Precision.FP32, profile=pipe.profile)
        expected_pipe, prompts = compile(reference, options=fp32, **kwargs), FIDELITY_PROMPTS
    shape = pipe.profile.opt

    def run(p, prompt):
        return p(prompt, num_inference_steps=tolerance.image_steps, height=shape.height, width=shape.width,
                 generator=torch.Generator().manual_seed(VERIFY_SEED), output_type="np", **extra).images

    rows = []
    for prompt in prompts:
        expected, actual = run(expected_pipe, prompt), run(pipe, prompt)
        rows.append({"prompt": prompt, "psnr_db": float(psnr(expected, actual)), "ssim": ssim(expected, actual),
                     "max_abs": float(np.abs(np.nan_to_num(actual) - expected).max()),
                     "nan": int(np.isnan(actual).sum())})
    worst_psnr, worst_ssim = min(r["psnr_db"] for r in rows), min(r["ssim"] for r in rows)
    nan = sum(r["nan"] for r in rows)
    return ImageParity(psnr_db=worst_psnr, max_abs=max(r["max_abs"] for r in rows), bound_db=tolerance.image_psnr_db,
                       nan=nan, ssim=worst_ssim, bound_ssim=tolerance.image_ssim, reference=tolerance.image_reference,
                       passed=nan == 0 and worst_psnr >= tolerance.image_psnr_db and worst_ssim >= tolerance.image_ssim,
                       shape=f"1x{shape.height}x{shape.width}, {tolerance.image_steps} steps, {len(prompts)} prompt(s)",
                       per_prompt=rows)


def _image_precision(pipe) -> Precision:
    """The contract an image is held to: the lowest precision among its engines' (fp32 < fp16 < bf16 < int8)."""
    order = list(Precision)
    return max((Precision(p) for p in pipe.compile_report.precisions.values()), key=order.index)


def _inpaint_inputs(shape: ImageShape) -> dict:
    """An inpainting model inpaints a square of a random image."""
    from PIL import Image

    size = shape.height, shape.width
    rng = np.random.default_rng(VERIFY_SEED)
    image = Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8))
    mask = np.zeros(size, dtype=np.uint8)
    mask[size[0] // 4: 3 * size[0] // 4, size[1] // 4: 3 * size[1] // 4] = 255
    return {"image": image, "mask_image": Image.fromarray(mask)}


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
    if report.image:
        i = report.image
        lines += ["", f"Image vs {i.reference} ({i.shape}): PSNR {i.psnr_db:.1f} dB (bound {i.bound_db:.0f} dB), "
                      f"SSIM {i.ssim:.4f} (bound {i.bound_ssim:.2f}), max pixel difference {i.max_abs:.2e}, "
                      f"NaN {i.nan}: {'PASSED' if i.passed else 'FAILED'}"]
    lines += [""] + [f"Note: {note}" for note in report.notes] if report.notes else []
    lines += [""] + [f"Damaged cache entry: {entry}" for entry in report.damaged_entries] \
        if report.damaged_entries else []
    failed = report.failed_components + (["cache"] if report.damaged_entries else [])
    verdict = "PASSED" if report.passed else f"FAILED: {', '.join(failed) or 'image'}"
    lines += ["", f"**{verdict}**"]
    return "\n".join(lines)
