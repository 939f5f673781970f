"""kasoku (加速): compile diffusers Stable Diffusion pipelines into fast engines, and prove them.

Public names (see docs/DESIGN.md): ``exportable_attention``, ``memory_efficient_attention``,
``compile``, ``KasokuPipeline``, ``CompileOptions``, ``verify``, ``bench``. They are imported on first
use so that ``import kasoku`` and ``kasoku --help`` stay fast.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "exportable_attention": "kasoku.attention",
    "memory_efficient_attention": "kasoku.attention",
    "KasokuError": "kasoku.errors",
    "ShapeProfile": "kasoku.components",
    "ImageShape": "kasoku.components",
    "Precision": "kasoku.components",
    "export_pipeline": "kasoku.export",
    "compile": "kasoku.pipeline",
    "KasokuPipeline": "kasoku.pipeline",
    "compile_components": "kasoku.compiling",
    "CompileOptions": "kasoku.options",
    "verify": "kasoku.verification",
    "bench": "kasoku.benchmark",
    "FAMILIES": "kasoku.families",
    "Cache": "kasoku.cache",
    "write_tiny_pipeline": "kasoku.tiny",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'kasoku' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
