"""The one interface every backend implements.

A :class:`Backend` builds engine files from an optimized ONNX artefact into a folder (the
cache stores that folder) and loads an :class:`Engine` from it. ``Engine.run`` is a template
method, as Polygraphy's runners are: it checks names, dtypes and the shape profile, then
calls the backend's ``_run``. Every backend gets the same checks and the same errors.
"""

from __future__ import annotations

import platform
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ..components import ComponentSpec, Precision, ShapeOutOfProfile
from ..errors import KasokuError


class BackendUnavailable(KasokuError):
    """A backend's package, or the device it needs, is missing."""


@dataclass(frozen=True)
class Availability:
    name: str
    available: bool
    version: str | None = None
    devices: str | None = None
    reason: str | None = None


@dataclass
class EngineOptions:
    """Backend settings that change the built engine or how it runs (part of the cache key)."""

    threads: int | None = None
    device: str = "cpu"  # onnxruntime: "cpu", "cuda" or "tensorrt" (execution provider)
    builder_optimization_level: int = 3  # TensorRT
    cuda_graph: bool = False  # TensorRT, static shapes only
    timing_cache_dir: Path | None = None  # TensorRT: a timing cache shared by all builds
    extra: dict[str, Any] = field(default_factory=dict)

    def key(self) -> dict[str, Any]:
        # threads, CUDA graphs and the timing cache change how fast, not what is built
        return {"target": self.device, "builder_optimization_level": self.builder_optimization_level,
                **self.extra}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Engine(ABC):
    """A compiled component: named arrays in, named arrays out."""

    backend: str = "?"

    def __init__(self, spec: ComponentSpec, precision: Precision):
        self.spec = spec
        self.precision = Precision(precision)
        self._axes = spec.axes()

    def run(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Check the inputs against the component's spec and profile, then run."""
        feeds = self._check_inputs(inputs)
        return self._run(feeds)

    __call__ = run

    @abstractmethod
    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run checked, contiguous numpy inputs; return every output by name."""

    def describe(self) -> dict[str, str]:
        return {"backend": self.backend, "component": self.spec.name, "precision": self.precision.value}

    def _check_inputs(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        expected = self.spec.input_names
        missing = [n for n in expected if n not in inputs]
        unexpected = [n for n in inputs if n not in expected]
        if missing or unexpected:
            raise KasokuError(
                f"{self.spec.name} takes inputs {list(expected)}; missing {missing}, unexpected {unexpected}."
            )
        feeds = {}
        for tensor in self.spec.inputs:
            array = _to_numpy(inputs[tensor.name])
            dtype = np.int64 if tensor.dtype.is_floating_point is False else np.float32
            if array.ndim != len(tensor.dims):
                raise KasokuError(
                    f"{self.spec.name} input {tensor.name!r} must have {len(tensor.dims)} dimensions "
                    f"but has shape {array.shape}."
                )
            for i, dim in enumerate(tensor.dims):
                if isinstance(dim, int) and array.shape[i] != dim:
                    raise KasokuError(
                        f"{self.spec.name} input {tensor.name!r} dimension {i} must be {dim} but is {array.shape[i]}."
                    )
            for i, axis in tensor.dynamic_axes.items():
                self._check_axis(tensor.name, i, axis.name, int(array.shape[i]))
            feeds[tensor.name] = np.ascontiguousarray(array, dtype=dtype)
        return feeds

    def _check_axis(self, input_name: str, index: int, axis_name: str, value: int) -> None:
        axis, rng = self._axes[axis_name]
        if rng.min <= value <= rng.max and value % rng.step == 0:
            return
        image_range = self.spec.profile.range_text(axis.of)
        raise ShapeOutOfProfile(
            f"{self.spec.name} input {input_name!r} dimension {index} ({axis_name}) is {value}, outside the "
            f"engine's profile: {rng.min}..{rng.max} in steps of {rng.step} (image {axis.of} {image_range}). "
            f"Compile a wider profile, e.g. `kasoku compile MODEL --{axis.of} MIN:MAX`, or "
            f"`ShapeProfile` in Python."
        )


def _to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        return value.detach().cpu().numpy()
    return np.asarray(value)


class Backend(ABC):
    """Builds engine files from an ONNX artefact and loads engines from them."""

    name: ClassVar[str]
    extra: ClassVar[str | None] = None  # the pip extra that installs it
    needs_onnx: ClassVar[bool] = True
    # optimization passes for this backend (see kasoku.optimize.PASSES); fp16 is added by precision
    passes: ClassVar[tuple[str, ...]] = ("cleanup", "fold_constants", "infer_shapes")

    def __init__(self, options: EngineOptions | None = None):
        self.options = options or EngineOptions()

    @classmethod
    @abstractmethod
    def availability(cls) -> Availability:
        """Whether the backend can run here, with its version and devices or the reason it cannot."""

    def require(self) -> Availability:
        info = self.availability()
        if not info.available:
            hint = f" Install it with `pip install kasoku[{self.extra}]`." if self.extra else ""
            raise BackendUnavailable(f"the {self.name} backend is unavailable: {info.reason}.{hint}")
        return info

    def key(self, precision: Precision) -> dict[str, Any]:
        """What about this backend changes a built engine: name, version, device, options."""
        info = self.availability()
        return {"backend": self.name, "version": info.version, "device": info.devices, **self.options.key(),
                "precision": Precision(precision).value}

    def optimization_passes(self, precision: Precision) -> list[str]:
        passes = list(self.passes)
        if Precision(precision) == Precision.FP16:
            passes.append("fp16")
        return passes

    @abstractmethod
    def build(self, spec: ComponentSpec, onnx_path: Path, out_dir: Path, precision: Precision) -> dict[str, Any]:
        """Write the engine files for `spec` into `out_dir`; return metadata for the manifest."""

    @abstractmethod
    def load(self, spec: ComponentSpec, entry_dir: Path, precision: Precision) -> Engine:
        """Load an engine from files written by :meth:`build`."""
