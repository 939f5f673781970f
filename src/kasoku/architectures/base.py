"""What every architecture module shares: the dynamic axes of a pipeline's tensors, and how a module is
handed to an architecture without its pipeline."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch

from ..core.components import Axis


class Axes:
    """The dynamic axes of a pipeline's tensors, derived from the image shape: images, rows (what an encoder
    sees: a prompt or an input image, 1 up to the images), guided
    (prompt + negative rows under classifier-free guidance), the latent's and the pixels' height and width.
    `vae_scale` is how many pixels one latent cell covers per side (8 for SD's VAE)."""

    def __init__(self, vae_scale: int):
        self.vae_scale = Fraction(1, vae_scale)
        self.images = Axis("batch", "batch")
        self.rows = Axis("batch", "batch", from_one=True)  # an encoder's: one row per prompt or input image
        self.guided = Axis("batch", "batch", Fraction(2), min_scale=Fraction(1))  # prompt + negative
        self.latent_h = Axis("latent_height", "height", self.vae_scale)
        self.latent_w = Axis("latent_width", "width", self.vae_scale)
        self.pixel_h = Axis("height", "height")
        self.pixel_w = Axis("width", "width")

    def latent_at(self, level: int) -> tuple[Axis, Axis]:
        """(height, width) of a denoiser's features after `level` halvings (level 0: the latent)."""
        if level == 0:
            return self.latent_h, self.latent_w
        scale = self.vae_scale / 2**level
        return Axis(f"latent_height_down{level}", "height", scale), Axis(f"latent_width_down{level}", "width", scale)


@dataclass(frozen=True)
class ModuleRef:
    """One torch module as an architecture sees it, never its pipeline: where it sits (`path`, the name the
    cache and reports give its weights: "unet", "controlnet.nets.1"), the module as it is now (maybe a
    meta-device stand-in whose weights are not read yet: its class and config), how to get it with its
    weights (`load`), and the digest of those weights (`digest`)."""

    path: str
    module: torch.nn.Module = field(repr=False, compare=False)
    load: Callable[[], torch.nn.Module] = field(repr=False, compare=False)
    digest: Callable[[], str] = field(repr=False, compare=False)
    # the digest of the weights without an adapter's loaded into the module (IP-Adapters: see ip_adapter)
    base_digest: Callable[[], str] | None = field(default=None, repr=False, compare=False)

    @property
    def config(self) -> Mapping[str, Any]:
        return self.module.config


def attention_width(config: Mapping[str, Any]) -> int:
    """A diffusion transformer's (or its ControlNet's) token width: its attention heads x their width."""
    return config["num_attention_heads"] * config["attention_head_dim"]


def config_dict(config) -> dict[str, Any]:
    """A diffusers FrozenDict or a transformers PretrainedConfig as a plain dict (what a spec's config keys)."""
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def module_at(owner: Any, path: str) -> Any:
    """The module at a dotted attribute path of `owner` (a pipeline): "unet", or "controlnet.nets.1" (the second
    ControlNet of a MultiControlNetModel); None where there is none."""
    module = owner
    for part in path.split("."):
        module = getattr(module, part, None)
    return module
