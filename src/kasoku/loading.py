"""Load a diffusers pipeline from a folder, a hub id or a live object (safetensors only)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .errors import KasokuError

SUPPORTED_PIPELINES = (
    "StableDiffusionPipeline",
    "StableDiffusionImg2ImgPipeline",
    "StableDiffusionInpaintPipeline",
)


class ModelNotFound(KasokuError, FileNotFoundError):
    """The model folder or hub id cannot be found."""


class NotADiffusersPipeline(KasokuError, ValueError):
    """A folder that is not a diffusers pipeline kasoku supports."""


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "/", "~"))


def read_model_index(folder: Path) -> dict[str, Any]:
    index = folder / "model_index.json"
    if not index.is_file():
        raise NotADiffusersPipeline(
            f"{folder} is not a diffusers pipeline folder: it has no model_index.json. "
            "Save one with `pipe.save_pretrained(DIR)`, or write the built-in tiny pipeline "
            "with `kasoku tiny DIR`."
        )
    try:
        data = json.loads(index.read_text())
    except json.JSONDecodeError as error:
        raise NotADiffusersPipeline(f"{index} is not valid JSON ({error}).") from None
    pipeline_class = data.get("_class_name")
    if pipeline_class not in SUPPORTED_PIPELINES:
        raise NotADiffusersPipeline(
            f"{folder} holds a {pipeline_class!r}; kasoku supports {', '.join(SUPPORTED_PIPELINES)}."
        )
    return data


def load_pipeline(model: Any, *, torch_dtype: torch.dtype = torch.float32):
    """A diffusers pipeline from a folder, a hub id (when online) or a live pipeline."""
    from diffusers import DiffusionPipeline

    if isinstance(model, DiffusionPipeline):
        return model
    path = Path(str(model)).expanduser()
    if path.exists():
        if not path.is_dir():
            raise NotADiffusersPipeline(f"{path} is a file; give the folder of a diffusers pipeline.")
        read_model_index(path)
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
    pipeline_class = type(pipe).__name__
    if pipeline_class not in SUPPORTED_PIPELINES:
        raise NotADiffusersPipeline(
            f"{model} is a {pipeline_class}; kasoku supports {', '.join(SUPPORTED_PIPELINES)}."
        )
    pipe.set_progress_bar_config(disable=True)
    return pipe
