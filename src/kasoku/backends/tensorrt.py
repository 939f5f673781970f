"""Native TensorRT, the seed's path: ONNX → network → engine plan through Polygraphy.

Build: `network_from_onnx_path` → `CreateConfig` (fp16 when asked, one optimization profile
from the component's min/opt/max shapes, timing cache, builder optimization level) →
`engine_bytes_from_network`; the plan and the timing cache are files of the cache entry.
Run: TensorRT's runtime with named I/O tensors bound to torch CUDA buffers on a CUDA stream,
optionally replayed as a CUDA graph while the shapes stay the same.

The parts that need no GPU (profile, builder options, availability) are plain functions so
that they are tested on any machine.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..components import ComponentSpec, Precision
from .base import Availability, Backend, Engine

PLAN_FILE = "engine.plan"
TIMING_CACHE_FILE = "timing.cache"


@dataclass(frozen=True)
class TrtBuildOptions:
    """What the builder is asked for; one place maps it onto Polygraphy's CreateConfig."""

    fp16: bool
    tf32: bool
    profile: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]
    builder_optimization_level: int
    timing_cache: str | None


def trt_profile(spec: ComponentSpec) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """min/opt/max shape of every input, straight from the component's spec."""
    return spec.profile_shapes()


def trt_build_options(
    spec: ComponentSpec, precision: Precision, optimization_level: int, timing_cache: Path | None
) -> TrtBuildOptions:
    if not 0 <= optimization_level <= 5:
        raise ValueError(f"builder_optimization_level must be 0..5 but is {optimization_level}.")
    return TrtBuildOptions(
        fp16=Precision(precision) == Precision.FP16,
        tf32=False,  # TF32 matmuls would break fp32 parity with torch
        profile=trt_profile(spec),
        builder_optimization_level=optimization_level,
        timing_cache=str(timing_cache) if timing_cache else None,
    )


def polygraphy_config(options: TrtBuildOptions):
    """Polygraphy's CreateConfig for the options (needs the tensorrt extra)."""
    from polygraphy.backend.trt import CreateConfig, Profile

    profile = Profile()
    for name, (low, opt, high) in options.profile.items():
        profile.add(name, min=low, opt=opt, max=high)
    return CreateConfig(
        fp16=options.fp16,
        tf32=options.tf32,
        profiles=[profile],
        load_timing_cache=options.timing_cache,
        builder_optimization_level=options.builder_optimization_level,
    )


def _gpu_description() -> tuple[str | None, str | None]:
    """(name and compute capability of GPU 0, reason when there is none)."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, "no CUDA GPU is visible to torch"
    major, minor = torch.cuda.get_device_capability(0)
    return f"{torch.cuda.get_device_name(0)} (sm_{major}{minor})", None


class TensorRTEngine(Engine):
    backend = "tensorrt"

    def __init__(self, spec: ComponentSpec, precision: Precision, plan: bytes, cuda_graph: bool = False):
        super().__init__(spec, precision)
        import tensorrt as trt
        import torch

        self._torch = torch
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise RuntimeError(f"TensorRT could not deserialize the {spec.name} plan (built by another version?)")
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream()
        self.cuda_graph = cuda_graph
        self._graph = None
        self._graph_shapes = None
        self._buffers: dict[str, Any] = {}
        self._trt = trt

    def _torch_dtype(self, name: str):
        return {
            self._trt.float32: self._torch.float32,
            self._trt.float16: self._torch.float16,
            self._trt.int32: self._torch.int32,
            self._trt.int64: self._torch.int64,
        }[self.engine.get_tensor_dtype(name)]

    def _bind(self, feeds: dict[str, np.ndarray]) -> None:
        torch = self._torch
        for name, array in feeds.items():
            self.context.set_input_shape(name, array.shape)
            buffer = self._buffers.get(name)
            if buffer is None or tuple(buffer.shape) != array.shape:
                buffer = torch.empty(array.shape, dtype=self._torch_dtype(name), device="cuda")
                self._buffers[name] = buffer
            buffer.copy_(torch.from_numpy(array), non_blocking=True)
            self.context.set_tensor_address(name, buffer.data_ptr())
        for name in self.spec.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            buffer = self._buffers.get(name)
            if buffer is None or tuple(buffer.shape) != shape:
                buffer = torch.empty(shape, dtype=self._torch_dtype(name), device="cuda")
                self._buffers[name] = buffer
            self.context.set_tensor_address(name, buffer.data_ptr())

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self._torch
        shapes = {n: a.shape for n, a in feeds.items()}
        with torch.cuda.stream(self.stream):
            if self.cuda_graph and self._graph is not None and shapes == self._graph_shapes:
                for name, array in feeds.items():
                    self._buffers[name].copy_(torch.from_numpy(array), non_blocking=True)
                self._graph.replay()
            else:
                self._bind(feeds)
                if not self.context.execute_async_v3(self.stream.cuda_stream):
                    raise RuntimeError(f"TensorRT failed to run {self.spec.name}")
                if self.cuda_graph:
                    self._capture(shapes)
        self.stream.synchronize()
        return {name: self._buffers[name].float().cpu().numpy() for name in self.spec.outputs}

    def _capture(self, shapes) -> None:
        # TensorRT needs one enqueue after a shape change before it can be captured.
        torch = self._torch
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            self.context.execute_async_v3(self.stream.cuda_stream)
        self._graph, self._graph_shapes = graph, shapes


class TensorRTBackend(Backend):
    name = "tensorrt"
    extra = "tensorrt"

    @classmethod
    def availability(cls) -> Availability:
        if importlib.util.find_spec("tensorrt") is None:
            return Availability(cls.name, False, reason="the tensorrt package is not installed")
        if importlib.util.find_spec("polygraphy") is None:
            return Availability(cls.name, False, reason="the polygraphy package is not installed")
        import tensorrt as trt

        gpu, reason = _gpu_description()
        if gpu is None:
            return Availability(cls.name, False, trt.__version__, reason=reason)
        return Availability(cls.name, True, trt.__version__, gpu)

    def optimization_passes(self, precision: Precision) -> list[str]:
        return list(self.passes)  # TensorRT picks fp16 kernels itself from the fp32 graph

    def build(self, spec: ComponentSpec, onnx_path: Path, out_dir: Path, precision: Precision) -> dict[str, Any]:
        self.require()
        from polygraphy.backend.trt import engine_bytes_from_network, network_from_onnx_path

        shared = self.options.timing_cache_dir
        if shared is not None:
            shared.mkdir(parents=True, exist_ok=True)
        timing_cache = (shared / TIMING_CACHE_FILE) if shared else (out_dir / TIMING_CACHE_FILE)
        options = trt_build_options(spec, precision, self.options.builder_optimization_level,
                                    timing_cache if timing_cache.exists() else None)
        plan = engine_bytes_from_network(
            network_from_onnx_path(str(onnx_path)),
            config=polygraphy_config(options),
            save_timing_cache=str(timing_cache),
        )
        (out_dir / PLAN_FILE).write_bytes(plan)
        return {"fp16": options.fp16, "builder_optimization_level": options.builder_optimization_level,
                "profile": {k: [list(s) for s in v] for k, v in options.profile.items()}}

    def load(self, spec: ComponentSpec, entry_dir: Path, precision: Precision) -> Engine:
        self.require()
        plan = (entry_dir / PLAN_FILE).read_bytes()
        return TensorRTEngine(spec, precision, plan, cuda_graph=self.options.cuda_graph)
