"""The reference: the eager torch component behind the same engine interface.

Binding weights is trivial here: the module runs with them in place of its own
(`torch.func.functional_call`), which leaves the module itself untouched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..core.attention import exportable_attention
from ..core.components import ComponentSpec, Precision
from ..core.weights import base_layers
from .base import Availability, Backend, Engine, Source


class TorchEngine(Engine):
    backend = "torch"

    def __init__(self, spec: ComponentSpec, precision: Precision, threads: int | None = None):
        super().__init__(spec, precision)
        self.threads = threads

    @torch.no_grad()
    def _run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.threads:
            torch.set_num_threads(self.threads)
        args = tuple(feeds[name] for name in self.spec.input_names)
        with exportable_attention():
            if not self._bound:
                outputs = self.spec.module(*args)
            else:  # bound weights are named as the base architecture's
                with base_layers(self.spec.module) as module:
                    outputs = torch.func.functional_call(module, self._bound, args)
        return dict(zip(self.spec.output_names, outputs))


class TorchBackend(Backend):
    name = "torch"
    reads = ()
    builds_from = Source.NOTHING
    passes = ()
    precisions = (Precision.FP32,)
    refused = {Precision.FP16: "it is the fp32 reference"}

    @classmethod
    def availability(cls) -> Availability:
        device = "cpu" + (f", cuda: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "")
        return Availability(cls.name, True, torch.__version__, device)

    def build(self, spec: ComponentSpec, onnx_path: Path, out_dir: Path, precision: Precision, *,
              calibration=None) -> dict[str, Any]:
        return {}

    def load(self, spec: ComponentSpec, entry_dir: Path | None, precision: Precision) -> Engine:
        self.check_precision(precision)
        return TorchEngine(spec, precision, self.options.threads)

    def bind_weights(self, spec: ComponentSpec, graph: Path | None, precision: Precision,
                     weights: dict[str, torch.Tensor], run_time: frozenset[str] = frozenset()) -> Engine:
        engine = self.load(spec, None, precision)
        engine.bind(weights)  # every weight: the module runs with them in place of its own
        return engine
