"""OpenVINO on the CPU, through its own API on the same optimized ONNX file.

The model is reshaped to the component's profile (static dimensions where the profile holds one
value: an exact-shape engine; bounded dynamic ones elsewhere), int8-quantized through NNCF when
asked (kasoku.quantize), compiled once at build time and exported as OpenVINO's compiled blob:
the cache entry is that blob alone (one copy of the weights), and a warm load imports it instead
of reading an IR and compiling again. OpenVINO's own model cache writes the blob while it compiles
(`export_model` would hold a second copy of the compiled weights in memory at the build's peak) and the
entry takes that file as it is: what `export_model` writes after one header line, which the load skips.
The inference precision is always explicit (OpenVINO otherwise picks bf16 on CPUs that have it) and
read back after compiling: a precision the CPU did not apply is an error, never a silent fp32 run.
Engines read their inputs from the torch tensors' memory and write their
outputs into torch tensors (no copies).

Weights are bound before compiling: each weight parameter of the architecture graph is replaced by a
Constant over the checkpoint's tensor (shared memory, no copy), so OpenVINO's own constant folding and
weight repacking see them as an exported model's. Run-time weights (LoRA targets) stay parameters and
are set on the infer request once per adapter set.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.components import ComponentSpec, Precision
from ..core.memory import limited_to_free_memory
from ..core.weights import as_numpy
from .base import (
    Availability,
    Backend,
    BackendUnavailable,
    Engine,
    UnsupportedPrecision,
    has_int8_dot_product,
    load_bound,
    save_bound,
)

BLOB_FILE = "model.blob"
# OpenVINO's model cache writes its blob as one XML line (the runtime's version) and then what export_model writes.
_CACHE_HEADER_END = b"/>\n"
# What to do when int8 quantization runs out of memory (a calibrated recipe's activations grow with the image).
_IN_BF16 = "this component in bf16 (--precision bf16, or a precision per component)"
INT8_MEMORY_REMEDY = f"Build {_IN_BF16}"
CALIBRATED_MEMORY_REMEDY = f"Build the int8 engine for smaller images (--height/--width), or {_IN_BF16}"
_HINTS = {Precision.FP32: "f32", Precision.FP16: "f16", Precision.BF16: "bf16"}
# OpenVINO's CPU plugin quantizes the activations of a linear layer with int8 weights as it runs it, per group of
# this many input channels, and multiplies in its int8 kernels: its default group (32) leaves much of the int8
# rate unused. benchmarks/int8_linear_groups.py on the Zen 5 of docs/BENCHMARKS.md (VNNI): two linear layers of
# Flux.2's width over 1536 tokens took 183 ms with groups of 32, 128 ms with 128 (122-141 ms with 192 or 256, 161 ms
# with 512) and 216 ms in bf16, at 1.52% and 1.66% relative RMS error against float64 (int8 weights alone 1.25%);
# Qwen3's and Sana's widths were fastest with 128 too. Set where the CPU multiplies int8 natively (VNNI, AMX).
DYNAMIC_QUANTIZATION_GROUP = 128
NO_BF16 = ("this CPU has no native bf16 (neither AVX512-BF16 nor AMX, OpenVINO's BF16 capability): OpenVINO "
           "would emulate it slowly or run fp32")


@functools.cache
def native_bf16() -> bool:
    """Whether OpenVINO's CPU plugin has native bf16 here (AVX512-BF16 or AMX)."""
    import openvino as ov

    return "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


def inference_hint(precision: Precision) -> str:
    """The CPU plugin's inference precision: int8 models compute what is not quantized in bf16
    where the CPU has it natively, else in fp32."""
    precision = Precision(precision)
    if precision == Precision.INT8:
        return "bf16" if native_bf16() else "f32"
    return _HINTS[precision]


def openvino_config(precision: Precision, threads: int | None) -> dict[str, Any]:
    """compile_model / import_model properties: explicit inference precision (an imported blob takes
    the importer's, so it is given again at load), latency mode, optional thread count, and for int8 engines the
    group their activations are quantized by on the fly (an imported blob takes the importer's too)."""
    config: dict[str, Any] = {
        "INFERENCE_PRECISION_HINT": inference_hint(precision),
        "PERFORMANCE_HINT": "LATENCY",
    }
    if Precision(precision) == Precision.INT8 and has_int8_dot_product():
        config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = DYNAMIC_QUANTIZATION_GROUP
    if threads:
        config["INFERENCE_NUM_THREADS"] = int(threads)
    return config


def bounded_shapes(spec: ComponentSpec) -> dict[str, list[tuple[int, int]]]:
    """Per input, (min, max) of every dimension over the profile (min == max: a static dimension)."""
    out = {}
    for name, (low, _opt, high) in spec.profile_shapes().items():
        out[name] = list(zip(low, high))
    return out


def _applied_precision(compiled) -> str:
    value = str(compiled.get_property("INFERENCE_PRECISION_HINT"))
    return {"<Type: 'float32'>": "f32", "<Type: 'bfloat16'>": "bf16", "<Type: 'float16'>": "f16"}.get(value, value)


class OpenVinoEngine(Engine):
    backend = "openvino"

    def __init__(self, spec: ComponentSpec, precision: Precision, compiled, blob=None):
        super().__init__(spec, precision)
        self.compiled = compiled
        self.request = compiled.create_infer_request()
        self._blob = blob  # the mapped blob (or the bound weights) the compiled model may read: it lives as long

    def _run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        outputs = self.output_buffers(feeds)
        for name, tensor in (*feeds.items(), *outputs.items()):
            self.request.set_tensor(name, ov_tensor(tensor))
        self.request.infer()
        return outputs

    def _on_bind(self, initial: bool) -> None:
        """Run-time weights are set on the request once; each inference reads them from there."""
        for name, tensor in self._bound.items():
            self.request.set_tensor(name, ov_tensor(tensor))


def _take_cached_blob(blob_dir: Path, path: Path) -> bool:
    """Move the one blob OpenVINO's model cache wrote into `blob_dir` to `path` (its header line stays: see
    `_blob_start`); False when there is none in the expected form."""
    blobs = list(blob_dir.glob("*.blob")) if blob_dir.is_dir() else []
    if len(blobs) != 1 or not _blob_start(blobs[0]):
        return False
    os.replace(blobs[0], path)
    return True


def _blob_start(path: Path) -> int:
    """Where what `export_model` writes starts in a blob file: after the header line of OpenVINO's model cache, or
    at 0 (an entry built through `export_model`)."""
    with open(path, "rb") as blob:
        head = blob.read(4096)
    end = head.find(_CACHE_HEADER_END)
    return end + len(_CACHE_HEADER_END) if head.startswith(b"<?xml") and end >= 0 else 0


def _int8_step(spec: ComponentSpec, calibrated: bool) -> tuple[str, str]:
    """What the memory guard calls `spec`'s int8 quantization, and the remedy it names."""
    if not calibrated:
        return f"int8 quantization of {spec.name} ({spec.int8} recipe)", INT8_MEMORY_REMEDY
    largest = spec.profile.max
    return (f"int8 quantization of {spec.name} ({spec.int8} recipe, calibrated at {largest.height}x{largest.width})",
            CALIBRATED_MEMORY_REMEDY)


def ov_tensor(tensor: torch.Tensor):
    """An OpenVINO tensor sharing a contiguous CPU tensor's memory; bfloat16 (a pipeline loaded in bf16: its graph
    takes and gives bf16) crosses as its bits, since numpy has no bfloat16."""
    import openvino as ov

    if tensor.dtype == torch.bfloat16:
        return ov.Tensor(tensor.view(torch.int16).numpy(), ov.Shape(list(tensor.shape)), ov.Type.bf16)
    return ov.Tensor(as_numpy(tensor), shared_memory=True)


def bind_constants(model, constants: dict[str, torch.Tensor]):
    """`model` (read from an architecture graph) with each weight parameter in `constants` replaced by a
    Constant sharing the tensor's memory."""
    import openvino as ov

    for parameter in list(model.get_parameters()):
        name = parameter.get_friendly_name()
        if name in constants:
            constant = ov.op.Constant(ov_tensor(constants[name]), shared_memory=True)
            constant.set_friendly_name(name)
            parameter.output(0).replace(constant.output(0))
            model.remove_parameter(parameter)
    model.validate_nodes_and_infer_types()
    return model


class OpenVinoBackend(Backend):
    name = "openvino"
    extra = "openvino"
    precisions = (Precision.FP32, Precision.FP16, Precision.BF16, Precision.INT8)
    # 1: IR plus OpenVINO's blob cache; 2: the compiled blob alone (export_model's bytes, or its model cache's file:
    # the same after a header line)
    entry_format = 2

    @classmethod
    def availability(cls) -> Availability:
        try:
            import openvino as ov
        except ImportError:
            return Availability(cls.name, False, reason="the openvino package is not installed")
        core = ov.Core()
        if "CPU" not in core.available_devices:
            return Availability(cls.name, False, ov.__version__, reason="OpenVINO sees no CPU device")
        return Availability(cls.name, True, ov.__version__, f"CPU: {core.get_property('CPU', 'FULL_DEVICE_NAME')}")

    def check_precision(self, precision: Precision | str) -> None:
        super().check_precision(precision)
        if Precision(precision) == Precision.BF16 and not native_bf16():
            raise UnsupportedPrecision(f"the {self.name} backend cannot build bf16 here: {NO_BF16}. Choose "
                                       "--precision fp32 or int8.")

    def optimization_passes(self, precision: Precision) -> list[str]:
        return list(self.passes)  # precision is an inference hint (or NNCF's rewrite), not an ONNX pass

    def key(self, precision: Precision) -> dict[str, Any]:
        """An int8 engine's key names the recipes' version (an engine quantized by older recipes is built again) and
        NNCF's overflow fix where it is on (a CPU without VNNI decides it; CPU names do not tell)."""
        key = super().key(precision)
        if Precision(precision) == Precision.INT8:
            from .int8 import RECIPES_VERSION, overflow_fix

            key["int8_recipes"] = RECIPES_VERSION
            if overflow_fix() == "enable":
                key["int8_overflow_fix"] = "enable"
        return key

    def needs_calibration(self, spec: ComponentSpec, precision: Precision) -> bool:
        from .int8 import CALIBRATED

        return Precision(precision) == Precision.INT8 and spec.int8 in CALIBRATED

    def calibration_recording(self) -> dict[str, str]:
        """Recorded on OpenVINO engines in bf16 where the CPU has it natively, else fp32."""
        return {"backend": self.name, "precision": (Precision.BF16 if native_bf16() else Precision.FP32).value}

    def check_run_time_weights(self, precision: Precision) -> None:
        if Precision(precision) == Precision.INT8:
            raise UnsupportedPrecision("int8 engines quantize their weights, so none can stay a run-time input: "
                                       "compile LoRA targets in fp32 or bf16.")

    def _compiled(self, spec: ComponentSpec, onnx_path: Path, precision: Precision,
                  constants: dict[str, torch.Tensor] | None, calibration: Callable[[], list] | None = None,
                  blob_dir: Path | None = None):
        """(compiled model, build metadata): the graph read, its constants bound, reshaped to the profile,
        int8-quantized when asked, compiled (its blob written into `blob_dir` by OpenVINO's model cache, if given)."""
        import openvino as ov

        core = ov.Core()
        model = core.read_model(str(onnx_path))
        if constants:
            model = bind_constants(model, constants)
        model.reshape({
            name: ov.PartialShape([ov.Dimension(lo, hi) for lo, hi in dims])
            for name, dims in bounded_shapes(spec).items()
        })
        meta: dict[str, Any] = {"static": not model.is_dynamic()}
        if Precision(precision) == Precision.INT8:
            from .int8 import quantize

            samples = calibration() if self.needs_calibration(spec, precision) and calibration is not None else None
            with limited_to_free_memory(*_int8_step(spec, calibrated=samples is not None)):
                model = quantize(model, spec.int8, samples)
            meta["int8"] = {"recipe": spec.int8, "calibration_samples": len(samples or [])}
        config = openvino_config(precision, self.options.threads)
        caching = {} if blob_dir is None else {"CACHE_DIR": str(blob_dir)}
        compiled = core.compile_model(model, "CPU", {**config, **caching})
        self._check_applied(compiled, precision)
        return compiled, {**meta, "config": config}

    def build(self, spec: ComponentSpec, onnx_path: Path, out_dir: Path, precision: Precision, *,
              calibration: Callable[[], list] | None = None, weights: dict[str, torch.Tensor] | None = None,
              run_time: frozenset[str] = frozenset()) -> dict[str, Any]:
        self.require()
        constants = None if weights is None else {n: t for n, t in weights.items() if n not in run_time}
        blob_dir = out_dir / ".openvino-cache"
        compiled, meta = self._compiled(spec, onnx_path, precision, constants, calibration, blob_dir)
        if not _take_cached_blob(blob_dir, out_dir / BLOB_FILE):
            (out_dir / BLOB_FILE).write_bytes(compiled.export_model().getbuffer())
        del compiled
        shutil.rmtree(blob_dir, ignore_errors=True)
        if weights is not None:
            save_bound(out_dir, weights, run_time)
        return {**meta, "run_time_weights": len(run_time)}

    def bind_weights(self, spec: ComponentSpec, graph: Path, precision: Precision, weights: dict[str, torch.Tensor],
                     run_time: frozenset[str] = frozenset()) -> Engine:
        self.require()
        if Precision(precision) == Precision.INT8:
            raise UnsupportedPrecision(f"new weights for the int8 {spec.name} engine would need quantizing (and "
                                       "calibrating) it again; compile fp32 or bf16 engines for LoRA adapters.")
        constants = {n: t for n, t in weights.items() if n not in run_time}
        compiled, _ = self._compiled(spec, graph, precision, constants)
        engine = OpenVinoEngine(spec, precision, compiled, blob=constants)
        if run_time:
            engine.bind({name: weights[name] for name in run_time})
        return engine

    def _check_applied(self, compiled, precision: Precision) -> None:
        wanted = inference_hint(precision)
        applied = _applied_precision(compiled)
        if applied != wanted:
            raise BackendUnavailable(f"OpenVINO compiled this engine in {applied} where {wanted} was asked for "
                                     f"({Precision(precision).value}); this CPU cannot run it as asked.")

    def load(self, spec: ComponentSpec, entry_dir: Path, precision: Precision) -> Engine:
        self.require()
        import openvino as ov

        # Mapped copy-on-write (OpenVINO wants a writable array; nothing writes it): read, not copied, here.
        path = entry_dir / BLOB_FILE
        blob = np.memmap(path, dtype=np.uint8, mode="c", offset=_blob_start(path))
        compiled = ov.Core().import_model(ov.Tensor(blob, shared_memory=True), "CPU",
                                          openvino_config(precision, self.options.threads))
        self._check_applied(compiled, precision)
        return load_bound(OpenVinoEngine(spec, precision, compiled, blob), entry_dir)
