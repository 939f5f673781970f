"""AOTInductor: torch's own compiler, ahead of time, into a package that loads without compiling.

Built from the component's torch module, not from ONNX: `torch.export` with the dynamic dims the
spec derives from its profile (static where the profile holds one value: an exact-shape engine),
then `torch._inductor.aoti_compile_and_package` into the cache entry. On a CPU that is C++ with
oneDNN (AMX for bf16 where the CPU has it), on a GPU Triton kernels; the weights are inside the
package's shared library, so the package is the whole engine.

A load opens the package with the runtime's own loader: no tracing and no compile. It does not go
through `torch._inductor.aoti_load_package`, whose device check compiles CPU-ISA probe programs with
g++ at every load (1-2 s, 16 s with a cold inductor cache) only to log a warning (pytorch#191715):
kasoku's key already holds the CPU's ISA flags or the GPU's compute capability, so a package is only
ever loaded where it was built.

Precisions: fp32 and bf16 (where the CPU has native bf16) on a CPU; fp32, bf16 and fp16 on a GPU. The
module is cast to the precision and compiled in it; the engine takes and returns fp32 like every
kasoku engine, casting at its edges (inputs the component reads in fp32 at every precision, the
U-Net's timestep, stay fp32 as diffusers leaves them). Inputs are checked by `Engine.run` against the
profile before the package runs: the package's own checks are off unless AOTI_RUNTIME_CHECK_INPUTS=1.
"""

from __future__ import annotations

import copy
import functools
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from ..core.attention import exportable_attention
from ..core.components import ComponentSpec, Precision, torch_dynamic_shapes
from ..core.exportable_ops import exportable_ops
from .base import Availability, Backend, Engine, Source, UnsupportedPrecision, cpu_flags, cpu_name, gpu_identity

PACKAGE_FILE = "model.pt2"
MODEL_NAME = "model"  # the model's name inside the package (aoti_compile_and_package's default)
COMPUTE_DTYPES = {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
NO_BF16 = ("this CPU has no native bf16 (neither AVX512-BF16 nor AMX): inductor would emulate it, slower than "
           "fp32")
NO_FP16_ON_CPU = "fp16 is a GPU precision for inductor; on the CPU choose bf16 (native bf16 CPUs) or fp32"


def target_device() -> torch.device:
    """Where inductor engines are built and run: the first CUDA GPU torch sees, else the CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX), read from its flags."""
    return any(flag in cpu_flags() for flag in NATIVE_BF16_FLAGS)


def device_description(device: torch.device) -> str:
    """What a package is tied to, for the engine's key: the GPU, its compute capability and driver, or the CPU
    and its ISA flags (a package holds code for the ISA it was built on; model names alone can hide it)."""
    if device.type == "cuda":
        return f"cuda: {gpu_identity(device.index or 0)}"
    return f"cpu: {cpu_name()} ({' '.join(cpu_flags()) or 'no AVX-512/AMX'})"


def inductor_configs(device: torch.device) -> dict[str, Any]:
    """The inductor settings of every package (part of the engine's key).

    freezing: the weights are constants of the graph, so inductor folds what depends on them alone and,
    on the CPU, prepacks them for oneDNN's convolutions and matmuls (it takes effect only under no_grad,
    which :func:`compile_package` holds). cpp.dynamic_threads: CPU kernels follow torch.set_num_threads at
    run time instead of the thread count the build ran with."""
    configs: dict[str, Any] = {"freezing": True}
    if device.type == "cpu":
        configs["cpp.dynamic_threads"] = True
    return configs


def compute_input(tensor_spec, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An input as the compiled module reads it: floating inputs in the compute dtype unless the
    component reads them in fp32 at every precision."""
    if value.is_floating_point() and not tensor_spec.always_fp32:
        return value.to(dtype)
    return value


def export_program(spec: ComponentSpec, device: torch.device, dtype: torch.dtype):
    """`torch.export` of the component in `dtype` on `device`, with the spec's dynamic dims (static dims
    where the profile holds one value), traced under exportable_attention as the ONNX export is."""
    module = spec.module
    if device.type != "cpu" or dtype != torch.float32:  # the spec's module stays the fp32 CPU reference
        module = copy.deepcopy(module).to(device=device, dtype=dtype)
    example = spec.sample_inputs(spec.trace_shape())
    args = tuple(compute_input(t, example[t.name], dtype).to(device) for t in spec.inputs)
    with exportable_attention(), exportable_ops(), torch.no_grad():
        return torch.export.export(module, args, dynamic_shapes=torch_dynamic_shapes(spec))


def compile_package(program, path: Path, configs: dict[str, Any]) -> None:
    with torch.no_grad():  # freezing applies only without grad (inductor's compile_fx checks)
        torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=configs)


def load_package(path: Path, device: torch.device):
    """The package's runtime loader (its `run` takes and returns lists of tensors), opened directly: no
    compile, and not the Python wrapper's ISA probe. Where torch's loader class takes other arguments than
    2.8 to 2.13 give it, the public `aoti_load_package` opens the package instead."""
    index = device.index if device.type == "cuda" and device.index is not None else -1
    try:
        return torch._C._aoti.AOTIModelPackageLoader(str(path), MODEL_NAME, False, 1, index)
    except (AttributeError, TypeError):  # a torch without this class, or with another signature
        return public_loader(path, index)


def public_loader(path: Path, index: int):
    """The runtime loader through torch's public API, its ISA probe skipped (it only warns, and the
    engine's key already pins the ISA)."""
    from torch._inductor import aoti_load_package, config

    with config.patch({"cpp.vec_isa_ok": True}):
        return aoti_load_package(str(path), device_index=index).loader


class InductorEngine(Engine):
    """An AOTInductor package: fp32 tensors in and out on the package's device, computed in the
    precision it was compiled in."""

    backend = "inductor"

    def __init__(self, spec: ComponentSpec, precision: Precision, loader, device: torch.device,
                 threads: int | None = None):
        super().__init__(spec, precision, device)
        self.loader = loader
        self.compute_dtype = COMPUTE_DTYPES[self.precision]
        self.threads = threads

    def _run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.threads and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)  # CPU packages follow torch's thread count (dynamic_threads)
        inputs = [compute_input(t, feeds[t.name], self.compute_dtype) for t in self.spec.inputs]
        outputs = self.loader.run(inputs)
        return {name: out.to(self.dtype) if out.is_floating_point() else out
                for name, out in zip(self.spec.output_names, outputs)}


class InductorBackend(Backend):
    name = "inductor"
    builds_from = Source.MODULE
    precisions = (Precision.FP32, Precision.BF16, Precision.FP16)
    refused = {Precision.INT8: "kasoku's int8 is NNCF's, on OpenVINO; use --backend openvino"}

    @classmethod
    def availability(cls) -> Availability:
        compiler = os.environ.get("CXX", "g++")
        if shutil.which(compiler) is None:
            return Availability(cls.name, False, torch.__version__,
                                reason=f"no C++ compiler ({compiler}, or $CXX) is on PATH; AOTInductor compiles C++")
        device = target_device()
        if device.type == "cuda" and not _has_triton():
            return Availability(cls.name, False, torch.__version__,
                                reason="triton is not installed; AOTInductor generates Triton kernels for a GPU")
        return Availability(cls.name, True, torch.__version__, device_description(device))

    def check_precision(self, precision: Precision | str) -> None:
        super().check_precision(precision)
        precision = Precision(precision)
        if target_device().type != "cpu":
            return
        reason = {Precision.FP16: NO_FP16_ON_CPU, Precision.BF16: None if native_bf16() else NO_BF16}.get(precision)
        if reason:
            raise UnsupportedPrecision(f"the {self.name} backend cannot build {precision.value} here: {reason}. "
                                       "Choose another --precision or --backend.")

    def option_key(self) -> dict[str, Any]:
        return {"inductor_configs": inductor_configs(target_device())}

    def build(self, spec: ComponentSpec, onnx_path: Path | None, out_dir: Path, precision: Precision, *,
              calibration=None, weights=None, run_time: frozenset[str] = frozenset()) -> dict[str, Any]:
        self.require()
        device, dtype = target_device(), COMPUTE_DTYPES[Precision(precision)]
        start = time.perf_counter()
        program = export_program(spec, device, dtype)
        exported = time.perf_counter()
        configs = inductor_configs(device)
        compile_package(program, out_dir / PACKAGE_FILE, configs)
        dynamic = sorted(name for name, (_axis, rng) in spec.axes().items() if rng.min != rng.max)
        return {"export_seconds": exported - start, "compile_seconds": time.perf_counter() - exported,
                "device": str(device), "dynamic_axes": dynamic, "inductor_configs": configs}

    def load(self, spec: ComponentSpec, entry_dir: Path, precision: Precision) -> Engine:
        self.require()
        device = target_device()
        return InductorEngine(spec, precision, load_package(entry_dir / PACKAGE_FILE, device), device,
                              self.options.threads)


@functools.cache
def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None
