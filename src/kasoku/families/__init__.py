"""Model families: which diffusers pipelines kasoku compiles, and how to tell them apart.

Each family is one object (see :mod:`kasoku.families.base`); this module is the registry and
the detection. The family is read from a folder's model_index.json and component configs before
any weight is loaded, so an unsupported model fails fast with the list of what is supported.

The families layer. May import: the core and architectures.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..core.choices import COMPONENT_NAMES, FAMILY_TITLES, is_component_name
from ..core.errors import NotADiffusersPipeline
from .base import CONTROLNET_COMPONENT, TASKS, Family, TransformerFamily, UNetFamily
from .flux import Flux
from .generic import GenericFamily, generic_family, is_diffusers_pipeline
from .sd import StableDiffusion1, StableDiffusion2
from .sd3 import StableDiffusion3
from .sdxl import StableDiffusionXL

# The registry: adding a family is a module beside these and one entry here.
FAMILIES: dict[str, Family] = {f.name: f for f in (StableDiffusion1(), StableDiffusion2(), StableDiffusionXL(),
                                                     StableDiffusion3(), Flux())}
SUPPORTED_PIPELINES = tuple(dict.fromkeys(c for f in FAMILIES.values() for c in f.class_names()))

__all__ = ["FAMILIES", "SUPPORTED_PIPELINES", "TASKS", "Family", "GenericFamily", "NotADiffusersPipeline",
           "TransformerFamily", "UNetFamily", "classify", "component_names", "detect_family", "family_of",
           "family_only_arguments", "generic_family", "is_component_name", "read_model_index"]


def component_names() -> tuple[str, ...]:
    """Every component name any family has, with ControlNet pipelines' (`controlnet_<i>` stands for each
    ControlNet's): what `--components` accepts."""
    plain = (n for f in FAMILIES.values() for n in f.component_names())
    controlled = (f.controlled_denoiser for f in FAMILIES.values() if f.controlled_denoiser)
    return tuple(dict.fromkeys((*plain, *controlled, CONTROLNET_COMPONENT.format("<i>"))))


if {name: f.title for name, f in FAMILIES.items()} != FAMILY_TITLES or component_names() != COMPONENT_NAMES:
    raise RuntimeError("kasoku.core.choices.FAMILY_TITLES and COMPONENT_NAMES must name the registry's families and "
                       "their components: add a new family there too (the commands offer them from there).")


def family_only_arguments() -> dict[str, tuple[Family, ...]]:
    """Call argument -> the families whose pipelines take it (only those some family alone takes)."""
    owners: dict[str, list[Family]] = {}
    for family in FAMILIES.values():
        for name in family.call_arguments:
            owners.setdefault(name, []).append(family)
    return {name: tuple(found) for name, found in owners.items()}


def _unsupported(where: str, pipeline_class: Any) -> NotADiffusersPipeline:
    import diffusers

    return NotADiffusersPipeline(
        f"{where} is a {pipeline_class!r}, which is not a pipeline class of the installed diffusers "
        f"({diffusers.__version__}). kasoku compiles {', '.join(SUPPORTED_PIPELINES)} by hand, and any other "
        "diffusers pipeline from the calls it makes to its components."
    )


def classify(
    pipeline_class: str,
    components: Mapping[str, Any],
    configs: Mapping[str, Mapping[str, Any]],
    *,
    where: str = "the model",
) -> Family:
    """The family from the pipeline class name, its component names and their configs (name -> config)."""
    for family in FAMILIES.values():
        if family.matches(pipeline_class, components, configs):
            family.check_layout(components, where)
            return family
    if isinstance(pipeline_class, str) and is_diffusers_pipeline(pipeline_class):
        family = generic_family(pipeline_class)  # any other diffusers pipeline: compiled from its recorded calls
        family.check_layout(components, where)
        return family
    raise _unsupported(where, pipeline_class)


def _config(module: Any) -> dict[str, Any]:
    config = getattr(module, "config", None)
    if config is None:
        return {}
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def family_of(pipe) -> Family:
    """The family of a live diffusers pipeline."""
    from diffusers import DiffusionPipeline

    if not isinstance(pipe, DiffusionPipeline):
        import torch

        what = "a model, one component of a pipeline" if isinstance(pipe, torch.nn.Module) else "not a pipeline"
        raise NotADiffusersPipeline(f"kasoku compiles diffusers pipelines, and this is a {type(pipe).__name__} "
                                    f"({what}). Give the whole pipeline (`kasoku.compile(pipe)`, not `pipe.unet`), "
                                    "load one with diffusers (`StableDiffusionPipeline.from_pretrained(DIR)`), or "
                                    "give its folder to kasoku.KasokuPipeline.from_pretrained.")
    components = pipe.components
    return classify(type(pipe).__name__, components, {name: _config(module) for name, module in components.items()},
                    where=type(pipe).__name__)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as error:
        raise NotADiffusersPipeline(f"{path} is not valid JSON ({error}).") from None


def read_model_index(folder: Path) -> dict[str, Any]:
    index = Path(folder) / "model_index.json"
    if not index.is_file():
        raise NotADiffusersPipeline(
            f"{folder} is not a diffusers pipeline folder: it has no model_index.json. "
            "Save one with `pipe.save_pretrained(DIR)`, or write a built-in tiny pipeline "
            f"with `kasoku tiny DIR [--family {'|'.join(FAMILIES)}]`."
        )
    return _read_json(index)


def detect_family(folder: str | Path) -> Family:
    """The family of a diffusers folder, from model_index.json and the components' configs (no weights read)."""
    folder = Path(folder)
    index = read_model_index(folder)
    # model_index.json lists a component as [library, class], or [null, null] when absent.
    components = {k: v for k, v in index.items() if isinstance(v, list) and v and v[0] is not None}
    configs = {name: _read_json(folder / name / "config.json") for name in components}
    return classify(index.get("_class_name"), components, configs, where=str(folder))
