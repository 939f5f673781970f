"""ONNX Runtime: CPU by default; CUDA and TensorRT execution providers when present.

Engines run through IO binding on torch tensors: inputs are read where they lie and outputs are
written into torch tensors on the engine's device (CPU or CUDA), with no copy through numpy. The
same code path runs on the CPU here, so it is tested on every machine.

Weights are bound at session creation: the architecture graph's weight inputs become initializers
that `SessionOptions.add_external_initializers` supplies from the checkpoint's tensors (never read
from a file), and the CPU build saves ONNX Runtime's optimized model with them, so a warm load is one
session creation. Run-time weights (LoRA targets) stay graph inputs and are bound through IO binding
like any input.

ONNX Runtime falls back silently from a provider it cannot initialise to the next one in the list:
every GPU session is checked (:func:`check_provider`) when it is created, so an engine that did not
get the provider it was built for is an error at build time and is never cached under that name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from ..core.components import ComponentSpec, Precision
from ..core.extras import ORT_CHOICE, MissingOnnxRuntime, import_onnxruntime, installed_ort_distributions, ort_conflict
from ..core.weights import PROTO_LIMIT, as_numpy, onnx_files, save_with_weights, with_initializers
from .base import (
    Availability,
    Backend,
    BackendUnavailable,
    Engine,
    UnsupportedPrecision,
    cpu_name,
    gpu_identity,
    load_bound,
    save_bound,
)
from .tensorrt import installed_trt_version, trt_precision_plan

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
MODEL_FILE = "model.onnx"
NUMPY_TYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.int32: np.int32,
               torch.bool: np.bool_}
# The TensorRT major ONNX Runtime's TensorRT provider is assumed to load when no tensorrt package says
# which (onnxruntime-gpu's wheels are built against TensorRT 10).
DEFAULT_ORT_TRT_VERSION = "10"


class ProviderFallback(BackendUnavailable):
    """An ONNX Runtime session that did not get the execution provider it was asked for."""


def check_provider(asked: str, got: Sequence[str], log: str = "") -> None:
    """Raise :class:`ProviderFallback` when a session created for the provider `asked` does not have it.

    `got` is the session's ``get_providers()``: ONNX Runtime does not fail when it cannot initialise a
    provider, it creates the session on the next one in the list. `log` is what ONNX Runtime printed while
    creating the session (its reason, when it gave one)."""
    if asked in got:
        return
    reasons = [line.strip() for line in log.splitlines()
               if line.strip() and any(word in line for word in (asked, "Failed", "failed", "Error", "error"))]
    conflict = ort_conflict(installed_ort_distributions())
    if conflict:
        reasons.insert(0, conflict)
    reason = "; ".join(reasons[:4]) or (
        "ONNX Runtime could not initialise it and gave no reason; usually its CUDA, cuDNN or TensorRT libraries "
        "are missing or of other versions than this onnxruntime-gpu was built for")
    raise ProviderFallback(
        f"ONNX Runtime created the session without the {asked} it was asked for (it runs on "
        f"{', '.join(got) or 'no provider'}): {reason}. The engine is not used or cached; install the CUDA, cuDNN "
        f"and TensorRT versions this onnxruntime-gpu needs (ONNX Runtime's execution-provider docs list them), or "
        f"choose another --backend."
    )


@contextlib.contextmanager
def native_stderr() -> Iterator[list[str]]:
    """Capture what native code (ONNX Runtime's C++ logger) and Python warnings write to stderr inside the
    block; yields a list that holds the text afterwards."""
    captured: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured.append(sink.read().decode(errors="replace"))
            captured.extend(str(w.message) for w in caught)


def _shape_list(shapes: dict[str, tuple[int, ...]]) -> str:
    """TensorRT EP's profile syntax: `name:1x4x64x64,other:2`."""
    return ",".join(f"{name}:{'x'.join(str(d) for d in shape)}" for name, shape in shapes.items())


def has_external_data(path: Path) -> bool:
    """Whether the ONNX file keeps weights in side files (what models over 2 GB must do)."""
    return len(onnx_files(path)) > 1


def provider_options(spec: ComponentSpec, device: str, precision: Precision, cache_dir: Path | None, *,
                     external_data: bool = False, cuda_graph: bool = False, trt_version: str | None = None) -> list:
    """The providers list for InferenceSession: the asked-for one first, then ONNX Runtime's own fallbacks
    (which :func:`check_provider` keeps from standing in for it).

    The TensorRT EP gets the component's min/opt/max profile, fp16 where the TensorRT it loads
    (`trt_version`) still has the FP16 flag (on TensorRT 11 the fp16 graph alone says it), engine and timing
    caches inside `cache_dir` (the kasoku cache entry), so it builds once, and, for a model with
    `external_data` (over 2 GB), its weights handed to TensorRT from memory (`trt_load_user_initializer`).
    The CUDA EP captures a CUDA graph with `cuda_graph`."""
    if device not in PROVIDERS:
        raise ValueError(f"onnxruntime device must be one of {list(PROVIDERS)} but is {device!r}.")
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if device == "cuda":
        return [("CUDAExecutionProvider", {"enable_cuda_graph": True} if cuda_graph else {}), "CPUExecutionProvider"]
    plan = trt_precision_plan(precision, trt_version or DEFAULT_ORT_TRT_VERSION, None)
    profile = spec.profile_shapes()
    options: dict[str, Any] = {
        "trt_fp16_enable": plan.builder_flag == "FP16",
        "trt_profile_min_shapes": _shape_list({n: s[0] for n, s in profile.items()}),
        "trt_profile_opt_shapes": _shape_list({n: s[1] for n, s in profile.items()}),
        "trt_profile_max_shapes": _shape_list({n: s[2] for n, s in profile.items()}),
    }
    if external_data:
        options["trt_load_user_initializer"] = True
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
    """An ONNX Runtime session run through IO binding on torch tensors. With `cuda_graph` (CUDA provider,
    static profile) ONNX Runtime captures the session's GPU work once and replays it: its IO binding must
    then point at the same buffers every call, so inputs are copied into static buffers bound once and
    outputs are copied out of theirs."""

    backend = "onnxruntime"
    # its CPU attention holds every score; OpenVINO's fused one ran the same 512x512 decode of the tiny Flux.2 klein in
    # 1 GiB (not every attention fuses: the tiny Ideogram 4's transformer at 512x512 ran out on both)
    memory_remedy = ', or try OpenVINO (backend="openvino"), whose fused attention does not hold every score'

    def __init__(self, spec: ComponentSpec, precision: Precision, session, device: torch.device,
                 cuda_graph: bool = False, keep_alive=None):
        super().__init__(spec, precision, device)
        self.session = session
        self._device_type = "cuda" if self.device.type == "cuda" else "cpu"
        self._device_id = self.device.index or 0
        self._keep_alive = keep_alive  # weights supplied at session creation: ONNX Runtime reads their memory
        self.cuda_graph = cuda_graph
        self._static: dict[str, torch.Tensor] = {}  # the buffers the captured graph reads and writes
        self._static_binding = None

    def _bind(self, feeds: dict[str, torch.Tensor]):
        """An IO binding of `feeds` where they lie and of new output tensors; returns (binding, outputs)."""
        binding = self.session.io_binding()
        for name, tensor in (*feeds.items(), *self._bound.items()):
            binding.bind_input(name, self._device_type, self._device_id, NUMPY_TYPES[tensor.dtype],
                               tuple(tensor.shape), tensor.data_ptr())
        outputs = self.output_buffers(feeds)
        for name, tensor in outputs.items():
            binding.bind_output(name, self._device_type, self._device_id, NUMPY_TYPES[tensor.dtype],
                                tuple(tensor.shape), tensor.data_ptr())
        return binding, outputs

    def _run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.cuda_graph:
            return self._replay(feeds)
        binding, outputs = self._bind(feeds)
        self._launch(binding)
        return outputs

    def _launch(self, binding) -> None:
        if self._device_type == "cuda":  # ORT's CUDA stream must see what the caller's stream wrote
            torch.cuda.current_stream(self.device).synchronize()
        self.session.run_with_iobinding(binding)

    def _replay(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._static_binding is None:
            inputs = {name: tensor.clone() for name, tensor in feeds.items()}
            self._static_binding, outputs = self._bind(inputs)
            self._static = {**inputs, **outputs, **self._bound}
        else:
            for name, tensor in feeds.items():
                self._static[name].copy_(tensor)
        self._launch(self._static_binding)
        return {name: self._static[name].clone() for name in self.spec.output_names}

    def _on_bind(self, initial: bool) -> None:
        """A captured CUDA graph reads the run-time weights from the addresses bound when it was captured:
        new values are copied there."""
        if self._static_binding is not None and not initial:
            new = self._bound
            self._bound = {name: self._static[name] for name in new}
            for name, tensor in new.items():
                self._bound[name].copy_(tensor)

    def describe(self) -> dict[str, str]:
        return {**super().describe(), "providers": ",".join(self.session.get_providers())}


NO_BF16 = ("ONNX Runtime's CPU execution provider has no bfloat16 kernels (bf16 Conv and MatMul fail with "
           "NOT_IMPLEMENTED; its only bf16 GEMM mode is ARM64-only)")


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    reads = ("threads", "cuda_graph")
    extra = "cpu"  # or `gpu` (onnxruntime-gpu) for the CUDA and TensorRT providers; never both
    precisions = (Precision.FP32, Precision.FP16)
    refused = {Precision.BF16: NO_BF16,
               Precision.INT8: "kasoku's int8 is NNCF's (the OpenVINO toolkit's quantizer), built on OpenVINO; "
                               "ONNX Runtime's own QDQ quantization is not driven by kasoku; use --backend openvino"}

    def check_precision(self, precision: Precision | str) -> None:
        if Precision(precision) == Precision.BF16:  # the advice depends on what this CPU runs
            from .openvino import native_bf16

            where = "use --backend openvino for bf16 (this CPU has native bf16)" if native_bf16() else \
                "this CPU has no native bf16 either (AVX512-BF16 or AMX): choose --precision fp32 or int8"
            raise UnsupportedPrecision(f"the {self.name} backend cannot build bf16: {NO_BF16}; {where}.")
        super().check_precision(precision)

    def __init__(self, options=None, shared_dir=None, provider: str = "cpu"):
        super().__init__(options, shared_dir)
        if provider not in PROVIDERS:
            raise ValueError(f"onnxruntime provider must be one of {list(PROVIDERS)} but is {provider!r}.")
        self.provider = provider

    @classmethod
    def availability(cls) -> Availability:
        try:
            ort = import_onnxruntime()
        except MissingOnnxRuntime:
            return Availability(cls.name, False, reason="onnxruntime is not installed")
        providers = [p for p in ort.get_available_providers() if p in PROVIDERS.values()]
        return Availability(cls.name, True, ort.__version__, f"{cpu_name()}; providers: {', '.join(providers)}")

    def require(self) -> Availability:
        """Also, for a GPU provider: onnxruntime-gpu with that provider, and a GPU (before any work)."""
        info = super().require()
        if self.provider != "cpu":
            self._require_provider(import_onnxruntime())
            if gpu_identity(0) is None:
                raise BackendUnavailable(f"the {self.label} backend needs an NVIDIA GPU, and torch sees none.")
        return info

    def _require_provider(self, ort) -> None:
        provider = PROVIDERS[self.provider]
        if provider not in ort.get_available_providers():
            conflict = ort_conflict(installed_ort_distributions())
            raise BackendUnavailable(
                f"onnxruntime has no {provider} here (available: {ort.get_available_providers()}). "
                + (f"{conflict}." if conflict else
                   "Install `kasoku[gpu]` (onnxruntime-gpu) on a machine with a CUDA GPU, or use the CPU provider.")
            )

    def install_hint(self) -> str:
        if self.provider == "cpu":
            return f" Install one of its extras: {ORT_CHOICE}."
        return " Install `pip install 'kasoku[gpu]'` (onnxruntime-gpu) on a machine with an NVIDIA GPU."

    @property
    def label(self) -> str:
        return self.name if self.provider == "cpu" else f"{self.name}-{self.provider}"

    @property
    def runs_cuda_graphs(self) -> bool:
        return self.provider == "cuda"

    def device_key(self, info: Availability) -> str | None:
        if self.provider == "cpu":
            return info.devices
        identity = gpu_identity(0)
        if identity is None:
            raise BackendUnavailable(f"the {self.label} backend needs an NVIDIA GPU, and torch sees none.")
        return str(identity)  # the GPU, not the CPU: the GPU's engines are what the entry holds

    def option_key(self) -> dict[str, Any]:
        key: dict[str, Any] = {"provider": self.provider}
        if self.provider == "tensorrt":  # its engine caches are TensorRT plans
            key["tensorrt"] = installed_trt_version()
        return key

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.provider == "cpu" else torch.device("cuda", 0)

    def _providers(self, path: Path, spec: ComponentSpec, precision: Precision, cache_dir: Path | None) -> list:
        return provider_options(spec, self.provider, precision, cache_dir, external_data=has_external_data(path),
                                cuda_graph=self.options.cuda_graph, trt_version=installed_trt_version())

    def _session(self, path: Path, spec: ComponentSpec, precision: Precision, cache_dir: Path | None,
                 *, save_optimized: Path | None = None, constants: dict[str, torch.Tensor] | None = None):
        """A session of the ONNX file at `path`; of an architecture graph with `constants` bound as its
        initializers. Returns (session, what must outlive it)."""
        ort = import_onnxruntime()
        provider = PROVIDERS[self.provider]
        self._require_provider(ort)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if spec.interleaved:  # spinning threads would take the cores from the torch work between its calls
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
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
        providers = self._providers(path, spec, precision, cache_dir)
        keep_alive = (constants, values)
        if self.provider == "cpu":
            return ort.InferenceSession(model, options, providers=providers), keep_alive
        with native_stderr() as log:
            session = ort.InferenceSession(model, options, providers=providers)
        check_provider(provider, session.get_providers(), "".join(log))
        sys.stderr.write(log[0])  # what ONNX Runtime printed, as it would have without the capture
        return session, keep_alive

    def build(self, spec: ComponentSpec, onnx_path: Path, out_dir: Path, precision: Precision, *,
              calibration=None, weights: dict[str, torch.Tensor] | None = None,
              run_time: frozenset[str] = frozenset()) -> dict[str, Any]:
        self.require()
        self.check_engine_profile(spec)
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
        return {"providers": self._providers(target, spec, precision, None)[0], "run_time_weights": len(run_time)}

    def load(self, spec: ComponentSpec, entry_dir: Path, precision: Precision) -> Engine:
        self.require()
        self.check_engine_profile(spec)
        cache_dir = entry_dir if self.provider == "tensorrt" else None
        session, _ = self._session(entry_dir / MODEL_FILE, spec, precision, cache_dir)
        engine = OnnxRuntimeEngine(spec, precision, session, self.device,
                                   cuda_graph=self.options.cuda_graph and self.provider == "cuda")
        return load_bound(engine, entry_dir)

    def bind_weights(self, spec: ComponentSpec, graph: Path, precision: Precision, weights: dict[str, torch.Tensor],
                     run_time: frozenset[str] = frozenset()) -> Engine:
        if self.provider != "cpu":  # the GPU providers build from files
            return super().bind_weights(spec, graph, precision, weights, run_time)
        self.require()
        constants = {n: t for n, t in weights.items() if n not in run_time}
        session, keep_alive = self._session(graph, spec, precision, None, constants=constants)
        engine = OnnxRuntimeEngine(spec, precision, session, self.device, keep_alive=keep_alive)
        if run_time:
            engine.bind({name: weights[name] for name in run_time})
        return engine
