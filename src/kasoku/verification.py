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
from .parity import TOLERANCES, OutputParity, parity_against_torch, psnr

VERIFY_PROMPT = "a photo of an astronaut riding a horse on mars"
VERIFY_STEPS = 4
VERIFY_SEED = 0


@dataclass
class ImageParity:
    psnr_db: float
    max_abs: float
    bound_db: float
    nan: int
    passed: bool
    shape: str


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
    pipe: KasokuPipeline = compile(reference, options=options, label=label, **kwargs)
    specs = component_specs(reference, pipe.profile)
    report = VerifyReport(model=label, precision=options.precision.value,
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
        built_in = specs[name].precision_for(options.precision)  # an SDXL VAE stays fp32: hold it to fp32's bound
        report.components += parity_against_torch(specs[name], engine.run, shapes, built_in, seed=11)
    if image:
        report.image = image_parity(reference, pipe, options.precision)
    return report


def image_parity(reference, pipe, precision: Precision) -> ImageParity:
    family = family_of(reference)
    if family.tasks(reference)[0] == "inpaint":  # an inpainting model: inpaint a square
        size = pipe.profile.opt.height, pipe.profile.opt.width
        rng = np.random.default_rng(VERIFY_SEED)
        from PIL import Image

        image = Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8))
        mask = np.zeros(size, dtype=np.uint8)
        mask[size[0] // 4: 3 * size[0] // 4, size[1] // 4: 3 * size[1] // 4] = 255
        extra = {"image": image, "mask_image": Image.fromarray(mask)}
        torch_pipe = family.task_pipeline(reference, "inpaint")
    else:
        extra = {}
        torch_pipe = family.task_pipeline(reference, "txt2img")
    shape = pipe.profile.opt

    def run(p):
        return p(VERIFY_PROMPT, num_inference_steps=VERIFY_STEPS, height=shape.height, width=shape.width,
                 generator=torch.Generator().manual_seed(VERIFY_SEED), output_type="np", **extra).images

    expected, actual = run(torch_pipe), run(pipe)
    value = float(psnr(expected, actual))
    bound = TOLERANCES[precision].image_psnr_db
    nan = int(np.isnan(actual).sum())
    return ImageParity(psnr_db=value, max_abs=float(np.abs(np.nan_to_num(actual) - expected).max()),
                       bound_db=bound, nan=nan, passed=nan == 0 and value >= bound,
                       shape=f"1x{shape.height}x{shape.width}, {VERIFY_STEPS} steps")


def markdown(report: VerifyReport) -> str:
    """The report as a markdown table (what the terminal shows)."""
    lines = [
        f"# kasoku verify: {report.model} ({', '.join(filter(None, (report.family, report.precision)))})",
        "",
        "| status | component | output | shape | max abs | max rel | cosine | NaN | Inf | tolerance |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in report.components:
        lines.append(f"| {'PASSED' if c.passed else 'FAILED'} | {c.component} ({report.backends[c.component]}) | "
                     f"{c.output} | {c.shape} | {c.max_abs:.2e} | {c.max_rel:.2e} | {c.cosine:.6f} | {c.nan} | "
                     f"{c.inf} | {c.limit:.1e} |")
    if report.image:
        i = report.image
        lines += ["", f"Image vs diffusers ({i.shape}): PSNR {i.psnr_db:.1f} dB (bound {i.bound_db:.0f} dB), "
                      f"max pixel difference {i.max_abs:.2e}, NaN {i.nan}: {'PASSED' if i.passed else 'FAILED'}"]
    lines += [""] + [f"Note: {note}" for note in report.notes] if report.notes else []
    lines += [""] + [f"Damaged cache entry: {entry}" for entry in report.damaged_entries] \
        if report.damaged_entries else []
    failed = report.failed_components + (["cache"] if report.damaged_entries else [])
    verdict = "PASSED" if report.passed else f"FAILED: {', '.join(failed) or 'image'}"
    lines += ["", f"**{verdict}**"]
    return "\n".join(lines)
