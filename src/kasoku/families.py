"""Model families: which diffusers pipelines kasoku compiles, and how to tell them apart.

Stable Diffusion 1.x and 2.x run diffusers' StableDiffusion* pipelines on one text encoder;
SD 2 swapped CLIP ViT-L for OpenCLIP ViT-H (gelu activations) and gave the U-Net linear
projections and per-block head counts. SDXL runs StableDiffusionXL* pipelines on two text
encoders and a U-Net with added conditioning (pooled text embeddings and size/crop ids). The
family is read from the folder's model_index.json and component configs before any weight is
loaded, so an unsupported model fails fast with the list of what is supported.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import KasokuError

TASKS = ("txt2img", "img2img", "inpaint")


class NotADiffusersPipeline(KasokuError, ValueError):
    """A folder or object that is not a diffusers pipeline kasoku supports."""


@dataclass(frozen=True)
class Family:
    name: str
    title: str
    pipelines: Mapping[str, str]  # task -> diffusers pipeline class name
    text_encoders: tuple[str, ...]

    def pipeline_class(self, task: str):
        import diffusers

        return getattr(diffusers, self.pipelines[task])

    def task_pipeline(self, pipe, task: str, **overrides):
        """A diffusers pipeline of this family for `task`, sharing `pipe`'s components."""
        cls = self.pipeline_class(task)
        new = cls.from_pipe(pipe, **overrides)
        new.set_progress_bar_config(disable=True)
        return new


_SD = {
    "txt2img": "StableDiffusionPipeline",
    "img2img": "StableDiffusionImg2ImgPipeline",
    "inpaint": "StableDiffusionInpaintPipeline",
}
_SDXL = {
    "txt2img": "StableDiffusionXLPipeline",
    "img2img": "StableDiffusionXLImg2ImgPipeline",
    "inpaint": "StableDiffusionXLInpaintPipeline",
}
FAMILIES: dict[str, Family] = {
    "sd1": Family("sd1", "Stable Diffusion 1.x", _SD, ("text_encoder",)),
    "sd2": Family("sd2", "Stable Diffusion 2.x", _SD, ("text_encoder",)),
    "sdxl": Family("sdxl", "Stable Diffusion XL", _SDXL, ("text_encoder", "text_encoder_2")),
}
SUPPORTED_PIPELINES = tuple(dict.fromkeys(c for f in FAMILIES.values() for c in f.pipelines.values()))


def _unsupported(where: str, pipeline_class: Any) -> NotADiffusersPipeline:
    return NotADiffusersPipeline(
        f"{where} is a {pipeline_class!r}; kasoku supports {', '.join(SUPPORTED_PIPELINES)}."
    )


def classify(
    pipeline_class: str,
    components: Mapping[str, Any],
    unet_config: Mapping[str, Any],
    text_config: Mapping[str, Any],
    *,
    where: str = "the model",
) -> Family:
    """The family from the pipeline class name, its component names and two configs."""
    if pipeline_class not in SUPPORTED_PIPELINES:
        raise _unsupported(where, pipeline_class)
    if pipeline_class.startswith("StableDiffusionXL"):
        missing = [name for name in FAMILIES["sdxl"].text_encoders if components.get(name) is None]
        if missing:  # the SDXL refiner has only the second text encoder and aesthetic-score ids
            raise NotADiffusersPipeline(
                f"{where} is an SDXL pipeline without {', '.join(missing)} (an SDXL refiner?); kasoku supports "
                "SDXL base pipelines with both text encoders."
            )
        return FAMILIES["sdxl"]
    # OpenCLIP's text tower uses gelu where OpenAI CLIP uses quick_gelu; SD 2 U-Nets project linearly.
    if unet_config.get("use_linear_projection") or text_config.get("hidden_act") == "gelu":
        return FAMILIES["sd2"]
    return FAMILIES["sd1"]


def family_of(pipe) -> Family:
    """The family of a live diffusers pipeline."""
    text_encoder = getattr(pipe, "text_encoder", None)
    return classify(
        type(pipe).__name__,
        pipe.components,
        dict(pipe.unet.config),
        text_encoder.config.to_dict() if text_encoder is not None else {},
        where=type(pipe).__name__,
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as error:
        raise NotADiffusersPipeline(f"{path} is not valid JSON ({error}).") from None


def read_model_index(folder: Path) -> dict[str, Any]:
    index = folder / "model_index.json"
    if not index.is_file():
        raise NotADiffusersPipeline(
            f"{folder} is not a diffusers pipeline folder: it has no model_index.json. "
            "Save one with `pipe.save_pretrained(DIR)`, or write a built-in tiny pipeline "
            "with `kasoku tiny DIR [--family sd1|sd2|sdxl]`."
        )
    return _read_json(index)


def detect_family(folder: str | Path) -> Family:
    """The family of a diffusers folder, from model_index.json and the configs (no weights read)."""
    folder = Path(folder)
    index = read_model_index(folder)
    # model_index.json lists a component as [library, class], or [null, null] when absent.
    components = {k: v for k, v in index.items() if isinstance(v, list) and v and v[0] is not None}
    return classify(
        index.get("_class_name"),
        components,
        _read_json(folder / "unet" / "config.json"),
        _read_json(folder / "text_encoder" / "config.json"),
        where=str(folder),
    )
