"""Numeric parity between an engine and the torch reference: one tolerance table, one compare."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

import numpy as np

from .components import Precision
from .errors import KasokuError


@dataclass(frozen=True)
class Tolerance:
    """max|engine - torch| <= rel_to_peak * max(1, max|torch|), per output."""

    rel_to_peak: float
    image_psnr_db: float
    strict: bool  # False: drift is reported, only NaN/Inf fails


TOLERANCES: dict[Precision, Tolerance] = {
    Precision.FP32: Tolerance(rel_to_peak=1e-4, image_psnr_db=40.0, strict=True),
    Precision.FP16: Tolerance(rel_to_peak=5e-2, image_psnr_db=25.0, strict=False),
}


def as_numpy(value) -> np.ndarray:
    """A numpy array of an array or a torch tensor on any device."""
    if hasattr(value, "detach"):
        value = value.detach().float().cpu() if value.dtype.is_floating_point else value.detach().cpu()
    return np.asarray(value)


class ParityError(KasokuError, AssertionError):
    """An engine's output differs from torch by more than the tolerance."""


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
    limit: float
    passed: bool

    def line(self) -> str:
        status = "PASSED" if self.passed else "FAILED"
        return (
            f"{status} | {self.component}.{self.output} @ {self.shape} | max_abs={self.max_abs:.2e} "
            f"(tol {self.limit:.1e}) | cos={self.cosine:.6f} | nan={self.nan} inf={self.inf}"
        )

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
    limit = tolerance.rel_to_peak * max(1.0, peak)
    passed = nan == 0 and inf == 0 and (max_abs <= limit or not tolerance.strict)
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
) -> list[OutputParity]:
    """`run` (named numpy inputs -> named outputs) against the torch component of `spec` on the
    same random inputs, at each image shape."""
    results: list[OutputParity] = []
    for shape in shapes:
        inputs = {k: v.numpy() for k, v in spec.sample_inputs(shape, seed=seed).items()}
        results += compare_outputs(spec.name, str(shape), spec.run_torch(inputs), run(inputs), precision)
    return results


def raise_on_failure(results: list[OutputParity], stage: str) -> None:
    failed = [r for r in results if not r.passed]
    if failed:
        lines = "\n  ".join(r.line() for r in failed)
        raise ParityError(
            f"{stage}: the engine does not match torch.\n  {lines}\n"
            "This is a bug in the export of this component (or a model that is not "
            "deterministic in eval mode); please report it with the lines above."
        )


def psnr(reference: np.ndarray, actual: np.ndarray, peak: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB of two images with values in [0, peak]."""
    mse = float(np.mean((np.asarray(reference, np.float64) - np.asarray(actual, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(peak**2 / mse)
