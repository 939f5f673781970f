"""Numeric parity between an engine and the torch reference: one tolerance table, one compare.

The table is the fidelity contract of every precision. Per component, each output of an fp32 engine
is held to max|engine - torch fp32| <= rel_to_peak x max(1, max|torch fp32|) (exact parity); a
lower precision's output to its relative error ||engine - torch fp32|| / ||torch fp32|| <= rel_error
(bf16 rounds every element: the worst single element says little, the error's norm says how far
the output moved). Per image, fp32 is
held to diffusers' own torch image (same seed), and every lower precision to kasoku's fp32
engines on the same backend, at `image_steps` steps with the same initial latents, by PSNR and
SSIM. The lower precisions' bounds were set from measurements on the full-size architectures
(benchmarks/full_sd15.py, stage `fidelity`; the numbers are in the README) with a margin, so a
regression fails `kasoku verify --precision X` and any finite output does not pass by itself.

Step caching (kasoku.core.step_cache) has its own entry, STEP_CACHE: its components are held to their
precision's per-output bounds like every component; its images (a call with `cache_interval` N)
are held to the same engines' images without caching, on verify's prompts with the same initial
latents (`kasoku verify --cache-interval N`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

import numpy as np
import torch

from .components import Precision
from .errors import KasokuError


@dataclass(frozen=True)
class Tolerance:
    """A precision's contract: per output, max|engine - torch fp32| <= rel_to_peak * max(1, max|torch|)
    where set, and ||engine - torch fp32|| / ||torch fp32|| <= rel_error where set; per image, PSNR and
    SSIM against the reference image at `image_steps` steps."""

    rel_to_peak: float | None
    rel_error: float | None
    image_psnr_db: float
    image_ssim: float
    image_steps: int  # denoising steps of the images compared
    image_reference: str  # "diffusers": its torch fp32 pipeline; "fp32 engines": kasoku's, same backend


STEP_CACHE = "step-cache"  # the table's key for step caching's image contract (DeepCache's)
STEP_CACHE_INTERVAL = 3  # the interval the step-cache bound is set at; larger ones are held to it too
TAYLORSEER_CACHE = "step-cache:taylorseer"
FIRST_BLOCK_CACHE = "step-cache:first-block"


def step_cache_contract(method: str) -> str:
    """The tolerance table's key of a step-caching method's image contract (kasoku.core.step_cache.METHODS)."""
    return {"deepcache": STEP_CACHE, "taylorseer": TAYLORSEER_CACHE, "first-block": FIRST_BLOCK_CACHE}[method]


TOLERANCES: dict[Precision | str, Tolerance] = {
    Precision.FP32: Tolerance(rel_to_peak=1e-4, rel_error=None, image_psnr_db=40.0, image_ssim=0.99, image_steps=4,
                              image_reference="diffusers"),
    Precision.FP16: Tolerance(rel_to_peak=None, rel_error=2e-2, image_psnr_db=30.0, image_ssim=0.9, image_steps=20,
                              image_reference="fp32 engines"),
    # bf16 and int8: measured on OpenVINO at full size (SD 1.5, random weights, 512x512 exact-shape engines,
    # 2026-11-30): worst component rel. error bf16 0.024 (VAE decoder; U-Net 0.016), int8 0.087 (U-Net); worst
    # image of verify's three prompts at 20 steps against the fp32 engines bf16 49.4 dB / SSIM 0.9997, int8
    # 40.5 dB / 0.9980. The image bounds keep 8-9 dB below those; the relative errors keep 2x, except bf16's,
    # which the tiny U-Net (narrow channels, random weights) needs at 0.056: its bound stays 1e-1.
    Precision.BF16: Tolerance(rel_to_peak=None, rel_error=1e-1, image_psnr_db=40.0, image_ssim=0.99, image_steps=20,
                              image_reference="fp32 engines"),
    # int8 with int4 weights (`CompileOptions.int4_weights`) is held to int8's bounds: on the LLM text encoders at full
    # width with random weights (full_modern.py --tag int4, 2026-12-07) 4 of their layers gave relative errors 0.30
    # (Gemma 2, 300 tokens) and 0.51 (Qwen3-4B, 512) against int8 weights' 0.029 and 0.055: their engines are refused.
    Precision.INT8: Tolerance(rel_to_peak=None, rel_error=2e-1, image_psnr_db=32.0, image_ssim=0.97, image_steps=20,
                              image_reference="fp32 engines"),
    # Measured at full size (full_sd15.py --stages deepcache: SD 1.5, 512x512, 20 steps with guidance, OpenVINO fp32,
    # 2026-11-30): interval 3 gave 37.5 dB / SSIM 0.9961 against interval 1 (non-uniform 37.9 dB, interval 2
    # 43.8 dB, interval 5 33.3 dB / 0.9897); the tiny pipeline 41.7 dB at 3. The bound keeps 5.5 dB below interval 3.
    STEP_CACHE: Tolerance(rel_to_peak=None, rel_error=None, image_psnr_db=32.0, image_ssim=0.98, image_steps=20,
                          image_reference="the same engines without step caching"),
    # Measured at full size with random weights, 20 steps against every block (2026-12-03): SD3.5-medium at 512x512
    # (full_sd35.py --stages loop) TaylorSeer interval 3 42.0 dB / SSIM 0.9980, interval 5 37.9 dB / 0.9948, the
    # first-block cache at 0.533 (14 of 20 steps in full) 57.4 dB; SD 1.5's U-Net (kasoku tune in full_sd15.py)
    # TaylorSeer 3 53.2 dB, 5 41.6 dB, 6 38.5 dB. The tiny SD3 and Flux pipelines stay above 40 dB at interval 3 and
    # diffusers' suggested thresholds (0.05-0.12). DeepCache's bound stays: 10 dB below SD3.5's interval 3, 6 below 5.
    TAYLORSEER_CACHE: Tolerance(rel_to_peak=None, rel_error=None, image_psnr_db=32.0, image_ssim=0.98,
                                image_steps=20, image_reference="the same engines without step caching"),
    FIRST_BLOCK_CACHE: Tolerance(rel_to_peak=None, rel_error=None, image_psnr_db=32.0, image_ssim=0.98,
                                 image_steps=20, image_reference="the same engines without step caching"),
}


def as_numpy(value) -> np.ndarray:
    """A numpy array of an array or a torch tensor on any device."""
    if hasattr(value, "detach"):
        value = value.detach().float().cpu() if value.dtype.is_floating_point else value.detach().cpu()
    return np.asarray(value)


class ParityError(KasokuError, AssertionError):
    """An engine's output differs from torch by more than the tolerance (`failed`: the outputs' lines)."""

    def __init__(self, message: str, failed: str = ""):
        super().__init__(message)
        self.failed = failed


class QuantizationMissed(ParityError):
    """An int8 engine whose graphs match torch but whose quantization misses int8's contract (the message names the
    remedy). Where an option asked for that quantization (`int8_activations`, `int4_weights`), it is a refusal: a
    component compiled from recorded calls does not stay in torch for it."""


@dataclass
class OutputParity:
    component: str
    output: str
    shape: str
    max_abs: float
    max_rel: float
    cosine: float
    nan: int
    inf: int
    limit: float  # on max_abs (inf where the precision bounds the relative error instead)
    passed: bool
    rel_error: float = 0.0  # ||engine - torch|| / ||torch||
    rel_error_limit: float = float("inf")

    def line(self) -> str:
        status = "PASSED" if self.passed else "FAILED"
        bound = (f"max_abs={self.max_abs:.2e} (tol {self.limit:.1e})" if self.limit != float("inf") else
                 f"rel_error={self.rel_error:.2e} (tol {self.rel_error_limit:.1e}) | max_abs={self.max_abs:.2e}")
        return (f"{status} | {self.component}.{self.output} @ {self.shape} | {bound} | cos={self.cosine:.6f} | "
                f"nan={self.nan} inf={self.inf}")

    def to_dict(self) -> dict:
        return asdict(self)


def compare_output(
    component: str,
    output: str,
    shape: str,
    reference: np.ndarray,
    actual: np.ndarray,
    precision: Precision = Precision.FP32,
) -> OutputParity:
    tolerance = TOLERANCES[Precision(precision)]
    ref = as_numpy(reference).astype(np.float64)
    got = as_numpy(actual).astype(np.float64)
    if ref.shape != got.shape:
        raise ParityError(
            f"{component}.{output} @ {shape}: engine output shape {got.shape} != torch shape {ref.shape}."
        )
    nan, inf = int(np.isnan(got).sum()), int(np.isinf(got).sum())
    finite = np.isfinite(got)
    diff = np.abs(np.where(finite, got, 0.0) - ref)
    peak = float(np.abs(ref).max()) if ref.size else 0.0
    max_abs = float(diff.max()) if diff.size else 0.0
    denom = float(np.linalg.norm(ref) * np.linalg.norm(np.where(finite, got, 0.0)))
    cosine = float((ref * np.where(finite, got, 0.0)).sum() / denom) if denom else 1.0
    limit = tolerance.rel_to_peak * max(1.0, peak) if tolerance.rel_to_peak is not None else float("inf")
    norm = float(np.linalg.norm(ref))
    rel_error = float(np.linalg.norm(diff)) / norm if norm else float(diff.max(initial=0.0))
    rel_error_limit = tolerance.rel_error if tolerance.rel_error is not None else float("inf")
    passed = nan == 0 and inf == 0 and max_abs <= limit and rel_error <= rel_error_limit
    return OutputParity(
        component=component,
        output=output,
        shape=shape,
        max_abs=max_abs,
        max_rel=max_abs / max(peak, 1e-12),
        cosine=cosine,
        nan=nan,
        inf=inf,
        limit=limit,
        passed=passed,
        rel_error=rel_error,
        rel_error_limit=rel_error_limit,
    )


def compare_outputs(
    component: str,
    shape: str,
    reference: Mapping[str, np.ndarray],
    actual: Mapping[str, np.ndarray],
    precision: Precision = Precision.FP32,
) -> list[OutputParity]:
    return [
        compare_output(component, name, shape, reference[name], actual[name], precision)
        for name in reference
    ]


def parity_against_torch(
    spec,
    run: Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]],
    shapes,
    precision: Precision = Precision.FP32,
    seed: int = 0,
    references: dict | None = None,
) -> list[OutputParity]:
    """`run` (named torch inputs -> named outputs) against the torch component of `spec` on the
    same random inputs, at each image shape. `references` remembers torch's outputs across calls
    (several engines of one component are checked against one torch run)."""
    results: list[OutputParity] = []
    for shape in shapes:
        inputs = spec.sample_inputs(shape, seed=seed)  # torch tensors: a bf16 graph's have no numpy dtype
        # keyed by the inputs themselves: a component's graph of one shape draws other inputs than its dynamic one
        key = (spec.name, tuple((name, tuple(value.shape), str(value.dtype), hash(_bytes(value)))
                                for name, value in inputs.items()))
        expected = references.get(key) if references is not None else None
        if expected is None:
            expected = spec.run_torch(inputs)
            if references is not None:
                references[key] = expected
        results += compare_outputs(spec.name, str(shape), expected, run(inputs), precision)
    return results


def _bytes(tensor) -> bytes:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def raise_on_failure(results: list[OutputParity], stage: str) -> None:
    failed = [r for r in results if not r.passed]
    if failed:
        lines = "\n  ".join(r.line() for r in failed)
        raise ParityError(
            f"{stage}: the engine does not match torch.\n  {lines}\n"
            "This is a bug in the export of this component (or a model that is not "
            "deterministic in eval mode); please report it with the lines above.", failed=lines
        )


def psnr(reference: np.ndarray, actual: np.ndarray, peak: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB of two images with values in [0, peak]."""
    mse = float(np.mean((np.asarray(reference, np.float64) - np.asarray(actual, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(peak**2 / mse)


def ssim(reference: np.ndarray, actual: np.ndarray, peak: float = 1.0) -> float:
    """Mean structural similarity (Wang et al. 2004: 11x11 Gaussian window, sigma 1.5, K1 0.01, K2 0.03)
    of images with values in [0, peak], HWC or NHWC, averaged over channels and images."""
    import torch.nn.functional as F

    def nchw(images):
        x = torch.as_tensor(np.asarray(images, np.float64))
        x = x[None] if x.ndim == 3 else x
        return x.permute(0, 3, 1, 2).reshape(-1, 1, x.shape[1], x.shape[2])

    x, y = nchw(reference), nchw(actual)
    coords = torch.arange(11, dtype=torch.float64) - 5
    g = torch.exp(-(coords**2) / (2 * 1.5**2))
    g = (g / g.sum())
    window = (g[:, None] * g[None, :])[None, None]
    size = min(11, x.shape[-1], x.shape[-2])
    if size < 11:  # images smaller than the window: a centred crop of it
        start = (11 - size) // 2
        window = window[..., start:start + size, start:start + size]
        window = window / window.sum()

    def blur(z):
        return F.conv2d(z, window)

    c1, c2 = (0.01 * peak) ** 2, (0.03 * peak) ** 2
    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x**2
    var_y = blur(y * y) - mu_y**2
    cov = blur(x * y) - mu_x * mu_y
    value = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))
    return float(value.mean())
