"""The backends layer: engines per backend behind one interface; `auto` picks per component.

A backend builds engine files from an ONNX file (or a torch module) into a cache entry and loads them:
ONNX Runtime, OpenVINO, TensorRT, inductor (AOTInductor) and the torch reference, one module each.

May import: the core only.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..core.choices import BACKEND_CHOICES, BACKEND_NAMES, PROVIDER_ALIASES
from ..core.options import CompileOptions
from .base import Availability, Backend, BackendUnavailable, Engine, UnsupportedPrecision
from .inductor import InductorBackend, target_device
from .onnxruntime import OnnxRuntimeBackend
from .openvino import OpenVinoBackend
from .tensorrt import TensorRTBackend
from .torch_eager import TorchBackend

BACKENDS: dict[str, type[Backend]] = {
    cls.name: cls for cls in (TensorRTBackend, OnnxRuntimeBackend, OpenVinoBackend, InductorBackend, TorchBackend)
}
if tuple(BACKENDS) != BACKEND_NAMES:
    raise RuntimeError(f"kasoku.core.choices.BACKEND_NAMES {BACKEND_NAMES} must name the registry's backends "
                       f"{tuple(BACKENDS)}: add the new backend there too (the commands offer it from there).")


def get_backend(name: str, options: CompileOptions | None = None, shared_dir: Path | None = None) -> Backend:
    """A backend by name (see BACKEND_CHOICES except "auto", which kasoku.build.compiler resolves)."""
    if name in PROVIDER_ALIASES:
        return OnnxRuntimeBackend(options, shared_dir, provider=PROVIDER_ALIASES[name])
    if name not in BACKENDS:
        raise BackendUnavailable(f"unknown backend {name!r}; choose from {', '.join(BACKEND_CHOICES)}.")
    return BACKENDS[name](options, shared_dir)


def backend_availability() -> list[Availability]:
    return [cls.availability() for cls in BACKENDS.values()]


def gpu_candidates() -> list[str]:
    """GPU backends in order of preference that can run here."""
    from ..core.extras import MissingOnnxRuntime, import_onnxruntime

    names = []
    if TensorRTBackend.availability().available:
        names.append("tensorrt")
    try:
        if "CUDAExecutionProvider" in import_onnxruntime().get_available_providers():
            names.append("onnxruntime-cuda")
    except MissingOnnxRuntime:
        pass
    if target_device().type == "cuda" and InductorBackend.availability().available:
        names.append("inductor")
    return names


# `auto` on a CPU also measures inductor when this is set to 1: opt-in, because its compile costs about as much
# as the other candidates' together (tens of seconds per tiny component, see docs/BENCHMARKS.md).
AUTO_INDUCTOR_ENV = "KASOKU_AUTO_INDUCTOR"


def cpu_candidates() -> list[str]:
    """The CPU backends `auto` measures that can run here."""
    candidates = [OnnxRuntimeBackend, OpenVinoBackend]
    if os.environ.get(AUTO_INDUCTOR_ENV) == "1":
        candidates.append(InductorBackend)
    return [cls.name for cls in candidates if cls.availability().available]


__all__ = [
    "Availability", "Backend", "BackendUnavailable", "Engine", "UnsupportedPrecision", "BACKENDS", "BACKEND_CHOICES",
    "PROVIDER_ALIASES", "get_backend", "backend_availability", "gpu_candidates", "cpu_candidates",
]
