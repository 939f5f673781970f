"""The reference: the eager torch component behind the same engine interface."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..components import ComponentSpec, Precision
from .base import Availability, Backend, Engine


class TorchEngine(Engine):
    backend = "torch"

    def __init__(self, spec: ComponentSpec, precision: Precision, threads: int | None = None):
        super().__init__(spec, precision)
        self.threads = threads

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.threads:
            torch.set_num_threads(self.threads)
        return self.spec.run_torch(feeds)


class TorchBackend(Backend):
    name = "torch"
    needs_onnx = False
    passes = ()

    @classmethod
    def availability(cls) -> Availability:
        device = "cpu" + (f", cuda: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "")
        return Availability(cls.name, True, torch.__version__, device)

    def build(self, spec: ComponentSpec, onnx_path: Path, out_dir: Path, precision: Precision) -> dict[str, Any]:
        return {}

    def load(self, spec: ComponentSpec, entry_dir: Path | None, precision: Precision) -> Engine:
        if Precision(precision) != Precision.FP32:
            raise ValueError("the torch reference backend runs fp32 only.")
        return TorchEngine(spec, precision, self.options.threads)
