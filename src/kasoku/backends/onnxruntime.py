"""ONNX Runtime: CPU by default; CUDA and TensorRT execution providers when present.

Engines run through IO binding on torch tensors: inputs are read where they lie and outputs are
written into torch tensors on the engine's device (CPU or CUDA), with no copy through numpy. The
same code path runs on the CPU here, so it is tested on every machine.

Weights are bound at session creation: the architecture graph's weight inputs become initializers
that `SessionOptions.add_external_initializers` supplies from the checkpoint's tensors (never read
from a file), and the CPU build saves ONNX Runtime's optimized model with them, so a warm load is one
session creation. Run-time weights (LoRA targets) stay graph inputs and are bound through IO binding
like any input.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from ..components import ComponentSpec, Precision
from ..export import onnx_files
from ..optimize import PROTO_LIMIT
from ..weights import as_numpy, save_with_weights, with_initializers
from .base import Availability, Backend, BackendUnavailable, Engine, cpu_name, load_bound, save_bound

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
MODEL_FILE = "model.onnx"
NUMPY_TYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.int32: np.int32}


def _shape_list(shapes: dict[str, tuple[int, ...]]) -> str:
    """TensorRT EP's profile syntax: `name:1x4x64x64,other:2`."""
    return ",".join(f"{name}:{'x'.join(str(d) for d in shape)}" for name, shape in shapes.items())


def provider_options(spec: ComponentSpec, device: str, precision: Precision, cache_dir: Path | None) -> list:
    """The providers list for InferenceSession: the asked-for one first, CPU as fallback.

    The TensorRT EP gets the component's min/opt/max profile, fp16 when asked, and engine and
    timing caches inside `cache_dir` (the kasoku cache entry), so it builds once.
    """
    if device not in PROVIDERS:
        raise ValueError(f"onnxruntime device must be one of {list(PROVIDERS)} but is {device!r}.")
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if device == "cuda":
        return [("CUDAExecutionProvider", {}), "CPUExecutionProvider"]
    profile = spec.profile_shapes()
    options: dict[str, Any] = {
        "trt_fp16_enable": Precision(precision) == Precision.FP16,
        "trt_profile_min_shapes": _shape_list({n: s[0] for n, s in profile.items()}),
        "trt_profile_opt_shapes": _shape_list({n: s[1] for n, s in profile.items()}),
        "trt_profile_max_shapes": _shape_list({n: s[2] for n, s in profile.items()}),
    }
    if cache_dir is not None:
        options.update(
            trt_engine_cache_enable=True,
            trt_engine_cache_path=str(cache_dir / "trt-engines"),
            trt_timing_cache_enable=True,
            trt_timing_cache_path=str(cache_dir / "trt-timing"),
        )
    return [("TensorrtExecutionProvider", options), ("CUDAExecutionProvider", {}), "CPUExecutionProvider"]


def _onnx_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in onnx_files(path))


class OnnxRuntimeEngine(Engine):
    backend = "onnxruntime"

    def __init__(self, spec: ComponentSpec, precision: Precision, session, device: torch.device, keep_alive=None):
        super().__init__(spec, precision, device)
        self.session = session
        self._device_type = "cuda" if self.device.type == "cuda" else "cpu"
        self._device_id = self.device.index or 0
        self._keep_alive = keep_alive  # weights supplied at session creation: ONNX Runtime reads their memory

    def _run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        binding = self.session.io_binding()
        for name, tensor in (*feeds.items(), *self._bound.items()):
            binding.bind_input(name, self._device_type, self._device_id, NUMPY_TYPES[tensor.dtype],
                               tuple(tensor.shape), tensor.data_ptr())
        outputs = self.output_buffers(feeds)
        for name, tensor in outputs.items():
            binding.bind_output(name, self._device_type, self._device_id, NUMPY_TYPES[tensor.dtype],
                                tuple(tensor.shape), tensor.data_ptr())
        if self._device_type == "cuda":  # ORT's CUDA stream must see what the caller's stream wrote
            torch.cuda.current_stream(self.device).synchronize()
        self.session.run_with_iobinding(binding)
        return outputs

    def describe(self) -> dict[str, str]:
        return {**super().describe(), "providers": ",".join(self.session.get_providers())}


NO_BF16 = ("ONNX Runtime's CPU execution provider has no bfloat16 kernels (bf16 Conv and MatMul fail with "
           "NOT_IMPLEMENTED; its only bf16 GEMM mode is ARM64-only); use --backend openvino for bf16")


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    extra = None  # a core dependency; `kasoku[gpu]` brings onnxruntime-gpu
    precisions = (Precision.FP32, Precision.FP16)
    refused = {Precision.BF16: NO_BF16,
               Precision.INT8: "kasoku's int8 is NNCF's, on OpenVINO (ONNX Runtime's own static QDQ quantization "
                               "measured slower on the SD 1.5 U-Net, see the README); use --backend openvino"}

    def __init__(self, options=None, shared_dir=None, provider: str = "cpu"):
        super().__init__(options, shared_dir)
        if provider not in PROVIDERS:
            raise ValueError(f"onnxruntime provider must be one of {list(PROVIDERS)} but is {provider!r}.")
        self.provider = provider

    @classmethod
    def availability(cls) -> Availability:
        try:
            import onnxruntime as ort
        except ImportError as error:
            return Availability(cls.name, False, reason=f"onnxruntime cannot be imported ({error})")
        providers = [p for p in ort.get_available_providers() if p in PROVIDERS.values()]
        return Availability(cls.name, True, ort.__version__, f"{cpu_name()}; providers: {', '.join(providers)}")

    def option_key(self) -> dict[str, Any]:
        return {"provider": self.provider}

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.provider == "cpu" else torch.device("cuda", 0)

    def _session(self, path: Path, spec: ComponentSpec, precision: Precision, cache_dir: Path | None,
                 *, save_optimized: Path | None = None, constants: dict[str, torch.Tensor] | None = None):
        """A session of the ONNX file at `path`; of an architecture graph with `constants` bound as its
        initializers. Returns (session, what must outlive it)."""
        import onnxruntime as ort

        provider = PROVIDERS[self.provider]
        if provider not in ort.get_available_providers():
            raise BackendUnavailable(
                f"onnxruntime has no {provider} here (available: {ort.get_available_providers()}). "
                "Install `kasoku[gpu]` on a machine with a CUDA GPU, or use the CPU provider."
            )
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if self.options.threads:
            options.intra_op_num_threads = self.options.threads
        model: str | bytes = str(path)
        values = []
        if constants:
            model = with_initializers(onnx.load(str(path)), constants).SerializeToString()
            values = [ort.OrtValue.ortvalue_from_numpy(as_numpy(t)) for t in constants.values()]
            options.add_external_initializers(list(constants), values)
        if save_optimized is not None:
            # Store ORT's own graph optimizations in the entry, so a warm load skips them.
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
            options.optimized_model_filepath = str(save_optimized)
            weight_bytes = sum(t.numel() * t.element_size() for t in (constants or {}).values())
            if _onnx_bytes(path) + weight_bytes > PROTO_LIMIT * 0.9:  # weights must leave the protobuf
                options.add_session_config_entry(
                    "session.optimized_model_external_initializers_file_name", save_optimized.name + ".data"
                )
                options.add_session_config_entry(
                    "session.optimized_model_external_initializers_min_size_in_bytes", "1024"
                )
        providers = provider_options(spec, self.provider, precision, cache_dir)
        return ort.InferenceSession(model, options, providers=providers), (constants, values)

    def build(self, spec: ComponentSpec, onnx_path: Path, out_dir: Path, precision: Precision, *,
              calibration=None, weights: dict[str, torch.Tensor] | None = None,
              run_time: frozenset[str] = frozenset()) -> dict[str, Any]:
        self.require()
        target = out_dir / MODEL_FILE
        constants = None if weights is None else {n: t for n, t in weights.items() if n not in run_time}
        if self.provider == "cpu":
            self._session(onnx_path, spec, precision, None, save_optimized=target, constants=constants)
        else:
            if constants is None:
                for file in onnx_files(onnx_path):
                    shutil.copy2(file, out_dir / file.name.replace(onnx_path.name, MODEL_FILE))
            else:  # the GPU providers build from a file that holds its constants
                external = sum(t.numel() * t.element_size() for t in constants.values()) > PROTO_LIMIT * 0.9
                save_with_weights(onnx.load(str(onnx_path)), constants, target, external=external)
            self._session(target, spec, precision, out_dir)  # builds the TensorRT EP engine caches
        if weights is not None:
            save_bound(out_dir, weights, run_time)
        return {"providers": provider_options(spec, self.provider, precision, None)[0],
                "run_time_weights": len(run_time)}

    def load(self, spec: ComponentSpec, entry_dir: Path, precision: Precision) -> Engine:
        self.require()
        cache_dir = entry_dir if self.provider == "tensorrt" else None
        session, _ = self._session(entry_dir / MODEL_FILE, spec, precision, cache_dir)
        return load_bound(OnnxRuntimeEngine(spec, precision, session, self.device), entry_dir)

    def bind_weights(self, spec: ComponentSpec, graph: Path, precision: Precision, weights: dict[str, torch.Tensor],
                     run_time: frozenset[str] = frozenset()) -> Engine:
        if self.provider != "cpu":  # the GPU providers build from files
            return super().bind_weights(spec, graph, precision, weights, run_time)
        self.require()
        constants = {n: t for n, t in weights.items() if n not in run_time}
        session, keep_alive = self._session(graph, spec, precision, None, constants=constants)
        engine = OnnxRuntimeEngine(spec, precision, session, self.device, keep_alive)
        if run_time:
            engine.bind({name: weights[name] for name in run_time})
        return engine
