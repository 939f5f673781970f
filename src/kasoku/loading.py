"""Load a diffusers pipeline from a folder, a hub id or a live object (safetensors only)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .errors import KasokuError
from .families import SUPPORTED_PIPELINES, NotADiffusersPipeline, detect_family, family_of, read_model_index

__all__ = ["ModelNotFound", "NotADiffusersPipeline", "SUPPORTED_PIPELINES", "load_pipeline", "read_model_index"]


class ModelNotFound(KasokuError, FileNotFoundError):
    """The model folder or hub id cannot be found."""


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "/", "~"))


def load_pipeline(model: Any, *, torch_dtype: torch.dtype = torch.float32):
    """A diffusers pipeline from a folder, a hub id (when online) or a live pipeline."""
    from diffusers import DiffusionPipeline

    if isinstance(model, DiffusionPipeline):
        family_of(model)  # an unsupported pipeline class fails here, naming the supported ones
        return model
    path = Path(str(model)).expanduser()
    if path.exists():
        if not path.is_dir():
            raise NotADiffusersPipeline(f"{path} is a file; give the folder of a diffusers pipeline.")
        detect_family(path)  # fails fast, before any weight is read, on an unsupported model
        source = str(path)
    elif _looks_like_hub_id(str(model)):
        if _hub_offline():
            raise ModelNotFound(
                f"{model!r} is not a local folder and HF_HUB_OFFLINE is set, so it cannot be "
                "downloaded. Give a local diffusers folder, or unset HF_HUB_OFFLINE."
            )
        source = str(model)
    else:
        raise ModelNotFound(
            f"model {str(model)!r} does not exist: give a diffusers pipeline folder or a hub id "
            "such as 'stable-diffusion-v1-5/stable-diffusion-v1-5'."
        )
    pipe = DiffusionPipeline.from_pretrained(
        source, dtype=torch_dtype, use_safetensors=True, safety_checker=None
    )
    family_of(pipe)
    pipe.set_progress_bar_config(disable=True)
    return pipe
