"""OpenVINO on the CPU, through its own API on the same optimized ONNX file.

The model is reshaped to the component's bounded dynamic profile, saved as IR in the cache
entry and compiled once at build time with OpenVINO's model cache pointed inside the entry,
so a warm load reads the compiled blob instead of compiling again. Engines read their inputs
from the torch tensors' memory and write their outputs into torch tensors (no copies).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..components import ComponentSpec, Precision
from .base import Availability, Backend, Engine

MODEL_FILE = "model.xml"
BLOB_DIR = "compiled"
_PRECISION_HINT = {Precision.FP32: "f32", Precision.FP16: "f16"}


def openvino_config(precision: Precision, threads: int | None, blob_dir: Path | None) -> dict[str, Any]:
    """compile_model properties: explicit inference precision (OpenVINO otherwise picks bf16 on
    CPUs that have it, which would break fp32 parity), latency mode, optional thread count."""
    config: dict[str, Any] = {
        "INFERENCE_PRECISION_HINT": _PRECISION_HINT[Precision(precision)],
        "PERFORMANCE_HINT": "LATENCY",
    }
    if threads:
        config["INFERENCE_NUM_THREADS"] = int(threads)
    if blob_dir is not None:
        config["CACHE_DIR"] = str(blob_dir)
    return config


def bounded_shapes(spec: ComponentSpec) -> dict[str, list[tuple[int, int]]]:
    """Per input, (min, max) of every dimension over the profile."""
    out = {}
    for name, (low, _opt, high) in spec.profile_shapes().items():
        out[name] = list(zip(low, high))
    return out


class OpenVinoEngine(Engine):
    backend = "openvino"

    def __init__(self, spec: ComponentSpec, precision: Precision, compiled):
        super().__init__(spec, precision)
        self.compiled = compiled
        self.request = compiled.create_infer_request()

    def _run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        import openvino as ov

        outputs = self.output_buffers(feeds)
        for name, tensor in (*feeds.items(), *outputs.items()):
            self.request.set_tensor(name, ov.Tensor(tensor.numpy(), shared_memory=True))
        self.request.infer()
        return outputs


class OpenVinoBackend(Backend):
    name = "openvino"
    extra = "openvino"

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

    def optimization_passes(self, precision: Precision) -> list[str]:
        return list(self.passes)  # precision is an inference hint, not a graph rewrite

    def build(self, spec: ComponentSpec, onnx_path: Path, out_dir: Path, precision: Precision) -> dict[str, Any]:
        self.require()
        import openvino as ov

        core = ov.Core()
        model = core.read_model(str(onnx_path))
        model.reshape({
            name: ov.PartialShape([ov.Dimension(lo, hi) for lo, hi in dims])
            for name, dims in bounded_shapes(spec).items()
        })
        ov.save_model(model, str(out_dir / MODEL_FILE), compress_to_fp16=False)
        core.compile_model(str(out_dir / MODEL_FILE), "CPU", openvino_config(precision, self.options.threads,
                                                                             out_dir / BLOB_DIR))
        return {"config": openvino_config(precision, self.options.threads, None)}

    def load(self, spec: ComponentSpec, entry_dir: Path, precision: Precision) -> Engine:
        self.require()
        import openvino as ov

        config = openvino_config(precision, self.options.threads, entry_dir / BLOB_DIR)
        compiled = ov.Core().compile_model(str(entry_dir / MODEL_FILE), "CPU", config)
        return OpenVinoEngine(spec, precision, compiled)
