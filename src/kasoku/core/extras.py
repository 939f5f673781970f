"""Optional dependencies that the user chooses by extra, imported lazily with an error naming the extra.

ONNX Runtime is one of them: kasoku checks every export against torch in it and it is the onnxruntime
backend, but it comes as two packages that install the same `onnxruntime` module and cannot coexist
(onnxruntime issue 26996: with both installed only the CPU provider remains). So the core depends on
neither; `kasoku[cpu]` installs onnxruntime and `kasoku[gpu]` onnxruntime-gpu.
"""

from __future__ import annotations

from importlib import metadata
from types import ModuleType

from .errors import KasokuError

ORT_DISTRIBUTIONS = {"cpu": "onnxruntime", "gpu": "onnxruntime-gpu"}  # extra -> the package it installs
ORT_CHOICE = ("`pip install 'kasoku[cpu]'` (onnxruntime: the CPU provider) or `pip install 'kasoku[gpu]'` "
              "(onnxruntime-gpu: the CUDA and TensorRT providers too), not both")


class MissingOnnxRuntime(KasokuError, ImportError):
    """Neither ONNX Runtime extra is installed."""


def import_onnxruntime() -> ModuleType:
    """The `onnxruntime` module, or :class:`MissingOnnxRuntime` naming both extras."""
    try:
        import onnxruntime
    except ImportError as error:
        raise MissingOnnxRuntime(
            f"ONNX Runtime is not installed ({error}); kasoku checks every ONNX export against torch in it and runs "
            f"its onnxruntime backend on it. Install one of its two extras: {ORT_CHOICE}."
        ) from None
    return onnxruntime


def installed_ort_distributions() -> list[str]:
    """Which of onnxruntime and onnxruntime-gpu are installed (more than one is a broken install)."""
    found = []
    for name in ORT_DISTRIBUTIONS.values():
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        found.append(name)
    return found


def ort_conflict(installed: list[str]) -> str | None:
    """What is wrong, and the fix, when both ONNX Runtime packages are installed; None otherwise."""
    if len(installed) < 2:
        return None
    return (f"both {' and '.join(installed)} are installed; they share the `onnxruntime` module and only the CPU "
            "provider remains (onnxruntime issue 26996). Fix: `pip uninstall -y onnxruntime onnxruntime-gpu`, then "
            "`pip install 'kasoku[gpu]'`")
