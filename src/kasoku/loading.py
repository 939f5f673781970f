"""Load a diffusers pipeline from a folder, a hub id or a live object (safetensors only).

``load_pipeline(folder, lazy=True)`` builds the torch models on the meta device from their configs
(no weights read) and loads each one for real only when something needs its weights: an export,
a parity check, a weight digest that is not remembered yet (:func:`real_module`). A warm start
that finds every engine in the cache therefore reads configs, tokenizers and the scheduler only.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import torch

from .errors import KasokuError
from .families import SUPPORTED_PIPELINES, NotADiffusersPipeline, detect_family, family_of, read_model_index

__all__ = ["ModelNotFound", "NotADiffusersPipeline", "SUPPORTED_PIPELINES", "load_pipeline", "read_model_index",
           "real_module", "lazy_source", "release_module", "model_label"]

_LAZY_SOURCE = "_kasoku_lazy_source"  # on a meta-device module: the folder its weights are in
_LOADED_LAZILY = "_kasoku_loaded_lazily"  # on a real module kasoku loaded in place of a meta one


class ModelNotFound(KasokuError, FileNotFoundError):
    """The model folder or hub id cannot be found."""


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "/", "~"))


def model_label(model: Any) -> str:
    """How a model is named in reports and the cache listing."""
    return str(model) if isinstance(model, (str, Path)) else type(model).__name__


def _source(model: Any) -> str:
    path = Path(str(model)).expanduser()
    if path.exists():
        if not path.is_dir():
            raise NotADiffusersPipeline(f"{path} is a file; give the folder of a diffusers pipeline.")
        detect_family(path)  # fails fast, before any weight is read, on an unsupported model
        return str(path)
    if _looks_like_hub_id(str(model)):
        if _hub_offline():
            raise ModelNotFound(
                f"{model!r} is not a local folder and HF_HUB_OFFLINE is set, so it cannot be "
                "downloaded. Give a local diffusers folder, or unset HF_HUB_OFFLINE."
            )
        return str(model)
    raise ModelNotFound(
        f"model {str(model)!r} does not exist: give a diffusers pipeline folder or a hub id "
        "such as 'stable-diffusion-v1-5/stable-diffusion-v1-5'."
    )


def load_pipeline(model: Any, *, torch_dtype: torch.dtype = torch.float32, lazy: bool = False):
    """A diffusers pipeline from a folder, a hub id (when online) or a live pipeline.

    With `lazy` (folders only), the torch models are built on the meta device; :func:`real_module`
    loads one when its weights are needed."""
    from diffusers import DiffusionPipeline

    if isinstance(model, DiffusionPipeline):
        family_of(model)  # an unsupported pipeline class fails here, naming the supported ones
        return model
    source = _source(model)
    empty = _meta_models(Path(source)) if lazy and Path(source).is_dir() else {}
    pipe = DiffusionPipeline.from_pretrained(
        source, dtype=torch_dtype, use_safetensors=True, safety_checker=None, **empty
    )
    family_of(pipe)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _model_classes(folder: Path) -> dict[str, type]:
    """The torch model classes of a folder's components (from model_index.json)."""
    from diffusers import ModelMixin
    from transformers import PreTrainedModel

    classes = {}
    for name, value in read_model_index(folder).items():
        if not (isinstance(value, list) and len(value) == 2 and value[0] in ("diffusers", "transformers")):
            continue
        cls = getattr(importlib.import_module(value[0]), value[1], None)
        if isinstance(cls, type) and issubclass(cls, (ModelMixin, PreTrainedModel)):
            classes[name] = cls
    return classes


def _meta_models(folder: Path) -> dict[str, torch.nn.Module]:
    """Each torch model of the folder built from its config on the meta device (no weights read)."""
    from accelerate import init_empty_weights
    from diffusers import ModelMixin

    models = {}
    for name, cls in _model_classes(folder).items():
        with init_empty_weights():
            if issubclass(cls, ModelMixin):
                module = cls.from_config(cls.load_config(folder / name))
            else:
                module = cls(cls.config_class.from_pretrained(folder / name))
        setattr(module, _LAZY_SOURCE, folder / name)
        models[name] = module.eval()
    return models


def lazy_source(module: Any) -> Path | None:
    """The folder a lazily loaded module's weights come from (None for a module given to kasoku)."""
    return getattr(module, _LAZY_SOURCE, None)


def real_module(pipe, attribute: str) -> torch.nn.Module:
    """`pipe.<attribute>` with its weights: loaded from its folder (and put on `pipe`) when it is
    still a meta-device stand-in."""
    module = getattr(pipe, attribute)
    source = lazy_source(module)
    if source is None:
        return module
    cls = type(module)
    dtype_argument = "torch_dtype" if cls.__module__.startswith("diffusers") else "dtype"
    real = cls.from_pretrained(source, use_safetensors=True, **{dtype_argument: torch.float32}).eval()
    setattr(real, _LOADED_LAZILY, source)
    pipe.register_modules(**{attribute: real})
    return real


def release_module(pipe, attribute: str) -> None:
    """Drop the weights of a module kasoku loaded lazily (once its engines are built), keeping a
    meta-device stand-in that can load them again. A module given to kasoku is left alone."""
    module = getattr(pipe, attribute, None)
    source = getattr(module, _LOADED_LAZILY, None)
    if source is None:
        return
    from accelerate import init_empty_weights
    from diffusers import ModelMixin

    with init_empty_weights():
        empty = type(module).from_config(module.config) if isinstance(module, ModelMixin) else \
            type(module)(module.config)
    setattr(empty, _LAZY_SOURCE, source)
    pipe.register_modules(**{attribute: empty.eval()})
