"""kasoku (加速): compile diffusers Stable Diffusion pipelines into fast engines, and prove them.

Public names (see docs/DESIGN.md): ``exportable_attention``, ``memory_efficient_attention``,
``compile``, ``KasokuPipeline``, ``CompileOptions``, ``verify``, ``bench``. They are imported on first
use so that ``import kasoku`` and ``kasoku --help`` stay fast.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "exportable_attention": "kasoku.core.attention",
    "memory_efficient_attention": "kasoku.core.attention",
    "KasokuError": "kasoku.core.errors",
    "ShapeProfile": "kasoku.core.components",
    "ImageShape": "kasoku.core.components",
    "Precision": "kasoku.core.components",
    "export_pipeline": "kasoku.build.export",
    "compile": "kasoku.pipeline.kasoku_pipeline",
    "KasokuPipeline": "kasoku.pipeline.kasoku_pipeline",
    "compile_components": "kasoku.pipeline.compiling",
    "CompileOptions": "kasoku.core.options",
    "verify": "kasoku.tools.verification",
    "bench": "kasoku.tools.benchmark",
    "FAMILIES": "kasoku.families",
    "Cache": "kasoku.core.cache",
    "write_tiny_pipeline": "kasoku.tools.tiny",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'kasoku' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
