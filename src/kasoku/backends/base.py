"""The one interface every backend implements.

A :class:`Backend` builds engine files from an architecture graph and a checkpoint's weights into a
folder (the cache stores that folder) and loads an :class:`Engine` from it. ``Engine.run`` is a
template method, as Polygraphy's runners are: it checks names, dtypes and the shape profile, puts the
inputs on the engine's device, then calls the backend's ``_run``. Engines take and return torch
tensors on their own device (numpy inputs are accepted too), so a pipeline on a GPU engine never
copies a tensor back to the CPU between steps.

Weights are bound when an engine is built (:mod:`kasoku.core.weights`): as constants, except the *run-time
weights* an engine compiled with LoRA targets keeps as inputs. Those are bound with
:meth:`Engine.bind` once per adapter set (ONNX Runtime and OpenVINO read them as inputs, TensorRT
refits them, torch runs its module with them); the entry stores their base values, so an engine
loaded from the cache starts on exactly the checkpoint's weights.
"""

from __future__ import annotations

import functools
import platform
import shutil
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from ..core.components import ComponentSpec, Precision, ShapeOutOfProfile, TensorSpec
from ..core.errors import KasokuError
from ..core.memory import limited_to_free_memory
from ..core.options import CompileOptions, InvalidOptions, check_cuda_graph_profile
from ..core.weights import WeightBindingError

BOUND_FILE = "bound.safetensors"  # in an engine entry: the base values of its run-time weights


class BackendUnavailable(KasokuError):
    """A backend's package, or the device it needs, is missing."""


class UnsupportedPrecision(KasokuError, ValueError):
    """A backend asked for a precision it does not build."""


@dataclass(frozen=True)
class Availability:
    name: str
    available: bool
    version: str | None = None
    devices: str | None = None
    reason: str | None = None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The CPU features that decide which precisions run fast (printed by every benchmark).
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
# An int8 dot product that accumulates in 32 bits (VNNI, AMX); without one, u8 x s8 products saturate 16-bit sums.
INT8_DOT_PRODUCT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def cpu_flags() -> list[str]:
    """Which of CPU_FLAGS this CPU has (Linux: /proc/cpuinfo)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                present = set(line.split(":", 1)[1].split())
                return [flag for flag in CPU_FLAGS if flag in present]
    except OSError:
        pass
    return []


def has_int8_dot_product() -> bool:
    """Whether this CPU multiplies int8 without saturating (VNNI or AMX): OpenVINO's int8 kernels on older CPUs (AVX2,
    AVX-512 without VNNI) saturate, which NNCF's overflow fix avoids with 7-bit weights."""
    return any(flag in INT8_DOT_PRODUCT_FLAGS for flag in cpu_flags())


@dataclass(frozen=True)
class GpuIdentity:
    """What about a GPU changes an engine built on it: its model, compute capability and driver."""

    name: str
    capability: tuple[int, int]
    driver: str

    def __str__(self) -> str:
        major, minor = self.capability
        return f"{self.name} (sm_{major}{minor}, driver {self.driver})"


@functools.lru_cache(maxsize=None)
def gpu_identity(index: int = 0) -> GpuIdentity | None:
    """GPU `index` as torch's CUDA sees it, with the NVIDIA driver's version; None without one."""
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    capability = tuple(torch.cuda.get_device_capability(index))
    return GpuIdentity(torch.cuda.get_device_name(index), capability, nvidia_driver_version())


def nvidia_driver_version() -> str:
    """The NVIDIA kernel driver's version (e.g. 580.159.03), read where it can be: NVML, the driver's
    /proc file, nvidia-smi; else the CUDA driver API version torch reports."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # not installed, or no NVML on this machine (containers, gVisor)
        pass
    try:
        version = driver_from_proc(Path("/proc/driver/nvidia/version").read_text())
        if version:
            return version
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=30, check=True).stdout.split()
            if out:
                return out[0]
        except (OSError, subprocess.SubprocessError):
            pass
    api = getattr(torch._C, "_cuda_getDriverVersion", lambda: "unknown")()
    return f"cuda-driver-api-{api}"


def driver_from_proc(text: str) -> str | None:
    """The version in /proc/driver/nvidia/version's first line ("NVRM version: NVIDIA UNIX x86_64 Kernel
    Module  580.159.03  ...")."""
    for word in text.splitlines()[0].split() if text else ():
        if "." in word and word.replace(".", "").isdigit():
            return word
    return None


class Engine(ABC):
    """A compiled component: named tensors in, named tensors out, on `device`."""

    backend: str = "?"
    memory_remedy: ClassVar[str] = ""  # what else a call that runs out of memory can do on this backend

    def __init__(self, spec: ComponentSpec, precision: Precision, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.spec = spec
        self.precision = Precision(precision)
        self.device = torch.device(device)
        self.dtype = dtype  # of its floating-point inputs and outputs
        self._axes = spec.axes()
        self._bound: dict[str, torch.Tensor] = {}  # run-time weights (LoRA targets), by graph name

    def run(self, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Check the inputs against the component's spec and profile, then run: on the CPU under the memory guard,
        since what a call holds grows with its shape beyond what the profile's check can count (onnxruntime's
        attention holds every score: the tiny Flux.2 klein's VAE decoder asked it for 16 GiB at 512x512)."""
        feeds = self._check_inputs(inputs)
        if self.device.type != "cpu":
            return self._run(feeds)
        shapes = ", ".join(f"{name} {tuple(value.shape)}" for name, value in feeds.items())
        with limited_to_free_memory(f"the {self.spec.name} engine ({self.backend}) on {shapes}",
                                    f"Call it with a smaller image or fewer images{self.memory_remedy}"):
            return self._run(feeds)

    __call__ = run

    @abstractmethod
    def _run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run checked, contiguous inputs on the engine's device; return every output by name. Engines with
        run-time weights read them from `self._bound`."""

    # ---- run-time weights ------------------------------------------------------------------------

    @property
    def bound(self) -> dict[str, torch.Tensor]:
        """The run-time weights this engine takes, as bound now (empty: all its weights are constants)."""
        return dict(self._bound)

    def bind(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Bind the run-time weights: the first call (at load) declares them; later calls give every one of
        them again, each of the same shape (a switch of LoRA adapters)."""
        if self._bound:
            wrong = sorted(set(tensors) ^ set(self._bound))
            if wrong:
                raise WeightBindingError(f"the {self.spec.name} engine binds {len(self._bound)} run-time weights; "
                                         f"{', '.join(wrong[:3])} {'is' if len(wrong) == 1 else 'are'} not among "
                                         "them or missing.")
            for name, tensor in tensors.items():
                if tuple(tensor.shape) != tuple(self._bound[name].shape):
                    raise WeightBindingError(f"{self.spec.name} weight {name!r} has shape {tuple(tensor.shape)} but "
                                             f"the engine binds {tuple(self._bound[name].shape)}.")
        initial = not self._bound
        device = self._bound_device()
        self._bound = {name: t.detach().to(device=device, dtype=self._bound[name].dtype if name in self._bound
                                           else t.dtype).contiguous() for name, t in tensors.items()}
        self._on_bind(initial)

    def _bound_device(self) -> torch.device:
        """Where run-time weights live (the engine's device: they are read as inputs)."""
        return self.device

    def _on_bind(self, initial: bool) -> None:
        """Hook after `bind` (`initial`: the values the engine was built with)."""
        return None

    def describe(self) -> dict[str, str]:
        return {"backend": self.backend, "component": self.spec.name, "precision": self.precision.value,
                "device": str(self.device)}

    def output_buffers(self, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Empty output tensors of the right shapes on the engine's device (for runtimes that write
        into memory they are given)."""
        shapes = self.spec.output_shapes({name: tuple(t.shape) for name, t in feeds.items()})
        dtypes = {t.name: self.io_dtype(t) for t in self.spec.outputs}
        return {name: torch.empty(shape, dtype=dtypes[name], device=self.device) for name, shape in shapes.items()}

    def io_dtype(self, tensor: TensorSpec) -> torch.dtype:
        """The dtype a tensor crosses into or out of the engine in: the engine's for floating-point tensors, except
        those a bf16 graph declares (a module read in bf16: the graph takes and gives what it was called with)."""
        if not tensor.dtype.is_floating_point or tensor.dtype == torch.bfloat16:
            return tensor.dtype
        return self.dtype

    def _check_inputs(self, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        expected = self.spec.input_names
        missing = [n for n in expected if n not in inputs]
        unexpected = [n for n in inputs if n not in expected]
        if missing or unexpected:
            raise KasokuError(
                f"{self.spec.name} takes inputs {list(expected)}; missing {missing}, unexpected {unexpected}."
            )
        feeds = {}
        seen: dict[str, tuple[str, int]] = {}  # axis -> (the first input that has it, its size there)
        for tensor in self.spec.inputs:
            value = _as_tensor(inputs[tensor.name])
            if value.ndim != len(tensor.dims):
                raise KasokuError(
                    f"{self.spec.name} input {tensor.name!r} must have {len(tensor.dims)} dimensions "
                    f"but has shape {tuple(value.shape)}."
                )
            for i, dim in enumerate(tensor.dims):
                if isinstance(dim, int) and value.shape[i] != dim:
                    raise KasokuError(
                        f"{self.spec.name} input {tensor.name!r} dimension {i} must be {dim} but is {value.shape[i]}."
                    )
            for i, axis in tensor.dynamic_axes.items():
                self._check_axis(tensor.name, i, axis.name, int(value.shape[i]))
                first, size = seen.setdefault(axis.name, (tensor.name, int(value.shape[i])))
                if size != value.shape[i]:
                    raise KasokuError(
                        f"{self.spec.name} inputs {first!r} and {tensor.name!r} must agree on {axis.name} but "
                        f"have {size} and {value.shape[i]} (shapes {tuple(inputs[first].shape)} and "
                        f"{tuple(value.shape)})."
                    )
            feeds[tensor.name] = value.to(device=self.device, dtype=self.io_dtype(tensor)).contiguous()
        return feeds

    def _check_axis(self, input_name: str, index: int, axis_name: str, value: int) -> None:
        axis, rng = self._axes[axis_name]
        if rng.min <= value <= rng.max and value % rng.step == 0:
            return
        if axis.is_free:  # no image dimension gives it: a wider image profile would not help
            raise ShapeOutOfProfile(
                f"{self.spec.name} input {input_name!r} dimension {index} ({axis_name}) is {value}, outside the "
                f"engine's {rng.min}..{rng.max}: a length no image size gives (a prompt's tokens, at most the "
                f"pipeline's max_sequence_length when kasoku recorded it). Call it with at most {rng.max}.")
        profile = self.spec.profile
        image = ", ".join(f"{dim} {profile.range_text(dim)}" for dim in axis.dims)
        if axis.text is not None:  # the prompt's tokens come first in this sequence
            image += f"; after at most {axis.text[2]} text tokens"
        flags = " ".join(f"--{dim} MIN:MAX" for dim in axis.dims)
        raise ShapeOutOfProfile(
            f"{self.spec.name} input {input_name!r} dimension {index} ({axis_name}) is {value}, outside the "
            f"engine's profile: {rng.min}..{rng.max} in steps of {rng.step} (image {image}). "
            f"Compile a wider profile, e.g. `kasoku compile MODEL {flags}`, or `ShapeProfile` in Python."
        )


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    array = np.asarray(value)  # not ascontiguousarray: it makes a 0-dim array (a scalar timestep) 1-dim
    return torch.from_numpy(array if array.flags.c_contiguous else array.copy(order="C"))  # shares its memory


class Source(str, Enum):
    """What a backend builds its engines from (which entries of the cache its engine's key chains to)."""

    ONNX = "onnx"  # the exported ONNX file, after the backend's passes: export → optimize → engine
    MODULE = "module"  # the component's torch module itself, keyed on its weights: engine only (inductor)
    NOTHING = "nothing"  # nothing is built: the engine is the torch module (the reference)


class Backend(ABC):
    """Builds engine files from an ONNX artefact (or the torch module, see `builds_from`) and loads
    engines from them."""

    name: ClassVar[str]
    extra: ClassVar[str | None] = None  # the pip extra that installs it
    builds_from: ClassVar[Source] = Source.ONNX
    # ONNX passes before this backend builds (see kasoku.build.optimize.PASSES); precision passes are added per
    # precision. Empty: the backend's own graph optimizer does it all when it builds (ONNX Runtime, OpenVINO).
    passes: ClassVar[tuple[str, ...]] = ()
    precisions: ClassVar[tuple[Precision, ...]] = (Precision.FP32, Precision.FP16)
    # why a precision the backend does not build is refused, by precision (a one-line reason)
    refused: ClassVar[Mapping[Precision, str]] = {}
    # bumped when what build() writes changes: part of the engine key, so old entries are never misread
    entry_format: ClassVar[int] = 1
    # the backend settings of CompileOptions this backend reads (each backend checks its own, see check_options)
    reads: ClassVar[tuple[str, ...]] = ("threads",)

    def __init__(self, options: CompileOptions | None = None, shared_dir: Path | None = None):
        self.options = options or CompileOptions()
        self.shared_dir = shared_dir  # a folder of the cache this backend may share across entries

    @classmethod
    @abstractmethod
    def availability(cls) -> Availability:
        """Whether the backend can run here, with its version and devices or the reason it cannot."""

    def require(self) -> Availability:
        """Raise :class:`BackendUnavailable` unless the backend can run here, and
        :class:`~kasoku.core.options.InvalidOptions` for options it cannot honour (both before any work)."""
        self.check_options()
        info = self.availability()
        if not info.available:
            raise BackendUnavailable(f"the {self.name} backend is unavailable: {info.reason}.{self.install_hint()}")
        return info

    def check_options(self) -> None:
        """Raise :class:`~kasoku.core.options.InvalidOptions` for a setting this backend cannot honour (a subclass
        checks the settings it reads)."""
        self.check_cuda_graph()

    def check_cuda_graph(self, asked: bool | None = None) -> None:
        """Raise :class:`~kasoku.core.options.InvalidOptions` when CUDA graphs are asked (default: by the options)
        of a backend whose engines do not replay them."""
        asked = self.options.cuda_graph if asked is None else asked
        if asked and not self.runs_cuda_graphs:
            raise InvalidOptions(
                f"`cuda_graph` (--cuda-graph) replays CUDA graphs on an NVIDIA GPU, which the {self.label} backend "
                "does not do. Use --backend tensorrt or onnxruntime-cuda, or drop --cuda-graph."
            )

    def check_engine_profile(self, spec: ComponentSpec) -> None:
        """Before building or loading `spec`'s engine: CUDA graphs need its profile static (the options may
        leave the profile to the model's default, which is not)."""
        if self.options.cuda_graph:
            check_cuda_graph_profile(spec.profile)

    def install_hint(self) -> str:
        return f" Install it with `pip install kasoku[{self.extra}]`." if self.extra else ""

    @property
    def label(self) -> str:
        """How messages name this backend (a provider alias for ONNX Runtime's GPU providers)."""
        return self.name

    @property
    def runs_cuda_graphs(self) -> bool:
        """Whether engines of this backend replay CUDA graphs when `options.cuda_graph` asks."""
        return False

    def check_precision(self, precision: Precision | str) -> None:
        """Raise :class:`UnsupportedPrecision` with a one-line reason for a precision this backend does not build."""
        precision = Precision(precision)
        if precision not in self.precisions:
            reason = self.refused.get(precision, f"it builds {', '.join(p.value for p in self.precisions)} only")
            raise UnsupportedPrecision(f"the {self.name} backend cannot build {precision.value}: {reason}. "
                                       f"Choose another --precision or --backend.")

    def key(self, precision: Precision) -> dict[str, Any]:
        """What about this backend changes a built engine: name, version, device, precision, and the
        options this backend reads (see :meth:`option_key`); nothing another backend reads."""
        info = self.availability()
        return {"backend": self.name, "version": info.version, "device": self.device_key(info),
                "precision": Precision(precision).value, "entry_format": self.entry_format, **self.option_key()}

    def device_key(self, info: Availability) -> str | None:
        """The device an engine is built for, as its key records it (a GPU backend: `GpuIdentity`)."""
        return info.devices

    def option_key(self) -> dict[str, Any]:
        """The options that change this backend's engines (threads only change how fast they run)."""
        return {}

    def optimization_passes(self, precision: Precision) -> list[str]:
        passes = list(self.passes)
        if Precision(precision) == Precision.FP16:
            passes.append("fp16")
        return passes

    def needs_calibration(self, spec: ComponentSpec, precision: Precision) -> bool:
        """Whether building `spec` in `precision` needs calibration samples (recorded inputs)."""
        return False

    def calibration_recording(self) -> dict[str, str]:
        """Where this backend's calibration samples are recorded: {"backend": name, "precision": value} (the
        engines the pipeline runs on while its inputs are recorded; part of the calibration's key)."""
        return {"backend": self.name, "precision": Precision.FP32.value}

    def check_run_time_weights(self, precision: Precision) -> None:
        """Raise for a precision whose engines cannot keep weights as run-time inputs (LoRA targets)."""
        return None

    @abstractmethod
    def build(self, spec: ComponentSpec, onnx_path: Path | None, out_dir: Path, precision: Precision, *,
              calibration: Callable[[], list] | None = None, weights: dict[str, torch.Tensor] | None = None,
              run_time: frozenset[str] = frozenset()) -> dict[str, Any]:
        """Write the engine files for `spec` into `out_dir`; return metadata for the manifest.

        `onnx_path` is an architecture graph and `weights` its weights by graph name (kasoku.core.weights), or,
        with `weights` None, an ONNX file that holds its own weights (a user's); it is None for a backend
        that builds from the torch module (`builds_from`). Weights named in `run_time` stay engine inputs
        (their base values go to the entry, see :func:`save_bound`); the others are constants.
        `calibration` returns the recorded input samples where :meth:`needs_calibration` says so."""

    @abstractmethod
    def load(self, spec: ComponentSpec, entry_dir: Path, precision: Precision) -> Engine:
        """Load an engine from files written by :meth:`build` (its run-time weights bound to their base)."""

    def bind_weights(self, spec: ComponentSpec, graph: Path, precision: Precision, weights: dict[str, torch.Tensor],
                     run_time: frozenset[str] = frozenset()) -> Engine:
        """An engine of the graph with these weights, in memory (what binding a checkpoint's or a LoRA's merged
        weights costs without a cache entry). The default builds into a temporary folder and loads."""
        import tempfile

        with tempfile.TemporaryDirectory(prefix="kasoku-bind-") as folder:
            self.build(spec, graph, Path(folder), precision, weights=weights, run_time=run_time)
            return self.load(spec, Path(folder), precision)


def save_bound(out_dir: Path, weights: Mapping[str, torch.Tensor], run_time: frozenset[str]) -> None:
    """The base values of an engine's run-time weights, beside its files."""
    if run_time:
        from safetensors.torch import save_file

        save_file({name: weights[name].contiguous() for name in sorted(run_time)}, str(out_dir / BOUND_FILE))


def load_bound(engine: Engine, entry_dir: Path) -> Engine:
    """Bind an engine loaded from `entry_dir` to the base values of its run-time weights (if it has any)."""
    path = entry_dir / BOUND_FILE
    if path.is_file():
        from safetensors.torch import load_file

        engine.bind(load_file(str(path)))
    return engine
