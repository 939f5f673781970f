"""diffusers' UNet2DConditionModel: the denoiser of SD 1.x, 2.x and XL.

Graphs:

- ``unet``: (sample, timestep, encoder_hidden_states, [timestep_cond,] *added conditioning) -> out_sample.
  ``timestep_cond`` is an LCM-distilled U-Net's guidance embedding (its config's ``time_cond_proj_dim``: the
  pipeline embeds the guidance scale and the U-Net adds it to the time embedding). The added conditioning is
  what the U-Net's config embeds besides the time: SDXL's ``text_time`` (the pooled text embedding and the
  size/crop ids), named by :func:`text_time_inputs`;
- ``unet_controlnet``: the same with a ControlNet's residuals as more inputs (:func:`residual_unet_spec`).

The step-cache graphs of the same weights are in :mod:`.deepcache`. Both the residuals a U-Net takes and
those a ControlNet makes follow :func:`controlnet_residuals`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch

from ..core.components import ComponentSpec, ShapeProfile, TensorSpec
from ..core.standins import EngineModule, InvalidInput, call_state, timesteps_for
from . import ip_adapter
from .base import Axes, ModuleRef

BASE_INPUTS = ("sample", "timestep", "encoder_hidden_states")
TIMESTEP_COND = "timestep_cond"
# A ControlNet's outputs and the residual-taking U-Net's extra inputs: one name per down-block residual
# (in diffusers' order), then the mid-block residual.
DOWN_RESIDUAL = "down_block_res_{}"
MID_RESIDUAL = "mid_block_res"


def levels(config: Mapping[str, Any]) -> int:
    """How many times the U-Net halves the latent (one fewer than its blocks)."""
    return len(config["block_out_channels"]) - 1


def residual_names(down: int) -> tuple[str, ...]:
    """The names of `down` down-block residuals and the mid-block residual."""
    return (*(DOWN_RESIDUAL.format(i) for i in range(down)), MID_RESIDUAL)


def controlnet_residuals(config: Mapping[str, Any]) -> tuple[tuple[int, int], ...]:
    """(channels, downsamplings) of each residual a ControlNet adds to a U-Net of this config, in
    diffusers' order (ControlNetModel.forward, step 3): the input convolution's output, each down
    block's resnet outputs and its downsampler's (all but the last block), then the mid block's.
    A U-Net's config gives the residuals it takes, a ControlNet's those it makes."""
    channels = tuple(config["block_out_channels"])
    layers = config["layers_per_block"]
    per_block = [layers] * len(channels) if isinstance(layers, int) else list(layers)
    residuals = [(channels[0], 0)]
    for level, (width, count) in enumerate(zip(channels, per_block)):
        residuals += [(width, level)] * count
        if level < len(channels) - 1:
            residuals.append((width, level + 1))
    return (*residuals, (channels[-1], len(channels) - 1))


def residual_specs(config: Mapping[str, Any], axes: Axes) -> tuple[TensorSpec, ...]:
    """The residuals a ControlNet makes and the U-Net takes, one per down-block output and the mid block's."""
    residuals = controlnet_residuals(config)
    return tuple(TensorSpec(name, (axes.guided, channels, *axes.latent_at(level)))
                 for name, (channels, level) in zip(residual_names(len(residuals) - 1), residuals))


def denoiser_inputs(config, axes: Axes, text_length: int, *, fp32_timestep: bool = False) -> tuple[TensorSpec, ...]:
    """The inputs every U-Net-shaped denoiser takes first (a U-Net, a ControlNet): the latent sample, the
    timestep and the text embeddings, shaped by its config."""
    return (
        TensorSpec("sample", (axes.guided, config.in_channels, axes.latent_h, axes.latent_w)),
        TensorSpec("timestep", (axes.guided,), always_fp32=fp32_timestep),
        TensorSpec("encoder_hidden_states", (axes.guided, text_length, config.cross_attention_dim)),
    )


def text_time_inputs(config, pooled: int, axes: Axes) -> tuple[TensorSpec, ...]:
    """SDXL's added conditioning (``addition_embed_type="text_time"``): the pooled text embedding (`pooled`
    wide) and the size/crop ids, as many as the rest of the embedding's input holds."""
    time_ids = (config.projection_class_embeddings_input_dim - pooled) // config.addition_time_embed_dim
    return (TensorSpec("text_embeds", (axes.guided, pooled)), TensorSpec("time_ids", (axes.guided, time_ids)))


def guidance_embedding_inputs(config, axes: Axes) -> tuple[TensorSpec, ...]:
    """An LCM-distilled U-Net's `timestep_cond` (the embedded guidance scale), where its config has one."""
    width = config.get("time_cond_proj_dim")
    return (TensorSpec(TIMESTEP_COND, (axes.guided, width)),) if width else ()


def out_sample(config, axes: Axes) -> TensorSpec:
    return TensorSpec("out_sample", (axes.guided, config.out_channels, axes.latent_h, axes.latent_w))


class UNetModule(torch.nn.Module):
    """The U-Net on (sample, timestep, encoder_hidden_states, [timestep_cond,] *added conditioning named
    `added`, [*IP-Adapter encodings, IP scales]) (the IP inputs where IP-Adapters are loaded)."""

    def __init__(self, unet: torch.nn.Module, added: tuple[str, ...] = ()):
        super().__init__()
        self.unet = unet
        self.added = added
        self.guidance_embedded = bool(unet.config.get("time_cond_proj_dim"))
        self.adapters = len(ip_adapter.projection_layers(unet))

    def forward(self, sample, timestep, encoder_hidden_states, *rest):
        return (self._denoise(sample, timestep, encoder_hidden_states, rest),)

    def _denoise(self, sample, timestep, encoder_hidden_states, rest, residuals=None):
        rest, image_embeds, scale = ip_adapter.split_inputs(rest, self.adapters)
        timestep_cond, rest = (rest[0], rest[1:]) if self.guidance_embedded else (None, rest)
        added_cond_kwargs = dict(zip(self.added, rest))
        residuals = {} if residuals is None else dict(down_block_additional_residuals=residuals[:-1],
                                                      mid_block_additional_residual=residuals[-1])
        if image_embeds is None:
            return self.unet(sample, timestep, encoder_hidden_states, timestep_cond=timestep_cond,
                             added_cond_kwargs=added_cond_kwargs or None, return_dict=False, **residuals)[0]
        with ip_adapter.run_time_scales(self.unet, scale):
            return self.unet(sample, timestep, encoder_hidden_states, timestep_cond=timestep_cond,
                             added_cond_kwargs={**added_cond_kwargs, "image_embeds": image_embeds},
                             return_dict=False, **residuals)[0]


class ResidualUNetModule(UNetModule):
    """The U-Net with a ControlNet's residuals as inputs: (sample, timestep, encoder_hidden_states,
    *added conditioning, *down-block residuals, mid-block residual, [*IP-Adapter encodings, IP scales])."""

    def __init__(self, unet: torch.nn.Module, added: tuple[str, ...] = ()):
        super().__init__(unet, added)
        self.residuals = len(controlnet_residuals(unet.config))

    def forward(self, sample, timestep, encoder_hidden_states, *rest):
        count = len(ip_adapter.split_inputs(rest, self.adapters)[0]) - self.residuals
        ip = rest[count + self.residuals:]
        return (self._denoise(sample, timestep, encoder_hidden_states, (*rest[:count], *ip),
                              residuals=rest[count:count + self.residuals]),)


def unet_spec(ref: ModuleRef, profile: ShapeProfile, axes: Axes, *, text_length: int,
              added: tuple[TensorSpec, ...] = (), ip: tuple[TensorSpec, ...] = (), name: str = "unet"
              ) -> ComponentSpec:
    """The U-Net at `ref`; `added` its added conditioning inputs (see :func:`text_time_inputs`), `ip` its
    IP-Adapters' (see :func:`kasoku.architectures.ip_adapter.embeds_inputs`). int8 quantizes an IP-Adapter
    U-Net's weights only: the calibration recipe records plain text-to-image runs."""
    config = ref.config
    added_names = tuple(t.name for t in added)
    return ComponentSpec(
        name=name,
        inputs=(*denoiser_inputs(config, axes, text_length, fp32_timestep=True),
                *guidance_embedding_inputs(config, axes), *added, *ip),
        outputs=(out_sample(config, axes),),
        profile=profile,
        load_module=lambda: UNetModule(ref.load(), added_names),
        **ip_adapter.weights_and_config(ref, ip),
        graph_kind="unet",
        modules=(ref.path,),
        **({} if ip else {"int8": "full"}),
        takes_lora=True,
    )


def residual_unet_spec(ref: ModuleRef, profile: ShapeProfile, axes: Axes, *, text_length: int,
                       added: tuple[TensorSpec, ...] = (), ip: tuple[TensorSpec, ...] = (),
                       name: str = "unet_controlnet") -> ComponentSpec:
    """The U-Net that takes a ControlNet's residuals as inputs (after its own and its added conditioning).
    int8 quantizes its weights only: the calibration recipe records plain text-to-image runs."""
    config = ref.config
    added_names = tuple(t.name for t in added)
    return ComponentSpec(
        name=name,
        inputs=(*denoiser_inputs(config, axes, text_length), *guidance_embedding_inputs(config, axes), *added,
                *residual_specs(config, axes), *ip),
        outputs=(out_sample(config, axes),),
        profile=profile,
        load_module=lambda: ResidualUNetModule(ref.load(), added_names),
        **ip_adapter.weights_and_config(ref, ip),
        graph_kind="unet",
        modules=(ref.path,),
        takes_lora=True,
    )


class EngineUNet(EngineModule):
    """The U-Net; inputs after sample, timestep and encoder_hidden_states come from added_cond_kwargs,
    and, for the U-Net of a ControlNet pipeline (unet_controlnet), the ControlNet's residuals.

    Within :meth:`step_cache` (one pipeline call with step caching) each call is one denoising step, and
    the call's `run` (a :class:`kasoku.core.step_cache.StepCacheRun`) says which engine runs it and
    keeps what it caches; outside it, every call runs the plain U-Net engine."""

    def __init__(self, original: torch.nn.Module, engines, times, component: str = "unet"):
        super().__init__(original, engines, times, component)
        names = self.engine.spec.input_names
        residuals = set(residual_names(len(names)))
        self._residuals = tuple(name for name in names if name in residuals)  # down blocks' in order, then the mid's
        self._added = [name for name in names if name not in (*BASE_INPUTS, TIMESTEP_COND) and
                       name not in self._residuals and not ip_adapter.is_ip_input(name)]
        self._original = original  # its IP processors hold the scales diffusers' set_ip_adapter_scale sets
        self._takes_guidance_embedding = TIMESTEP_COND in names
        self._step_cache = None
        if getattr(original, "add_embedding", None) is not None:
            # SDXL pipelines check the ids' width against the embedding's input size.
            self.add_embedding = SimpleNamespace(linear_1=SimpleNamespace(
                in_features=original.add_embedding.linear_1.in_features))

    def forward(self, sample, timestep, encoder_hidden_states, timestep_cond=None, cross_attention_kwargs=None,
                added_cond_kwargs=None, down_block_additional_residuals=None, mid_block_additional_residual=None,
                down_intrablock_additional_residuals=None, return_dict=True, **kwargs):
        added_cond_kwargs = dict(added_cond_kwargs or {})
        ip = self._ip_feeds(added_cond_kwargs.pop("image_embeds", None))
        extra = sorted(set(added_cond_kwargs) - set(self._added))
        if cross_attention_kwargs or extra or down_intrablock_additional_residuals:
            raise InvalidInput("the compiled U-Net takes sample, timestep, encoder_hidden_states"
                               + (", timestep_cond" if self._takes_guidance_embedding else "")
                               + (f" and {', '.join(self._added)}" if self._added else "")
                               + " only (no IP-Adapter, T2I-Adapter or LoRA scale).")
        if (timestep_cond is not None) != self._takes_guidance_embedding:
            raise InvalidInput("this U-Net embeds the guidance scale (an LCM-distilled U-Net): its pipeline passes "
                               "`timestep_cond`." if self._takes_guidance_embedding else
                               "this U-Net has no guidance embedding (`timestep_cond`): it is not LCM-distilled.")
        missing = [name for name in self._added if name not in added_cond_kwargs]
        if missing:
            raise InvalidInput(f"the compiled U-Net needs {', '.join(missing)} in added_cond_kwargs.")
        residuals = self._residual_feeds(down_block_additional_residuals, mid_block_additional_residual)
        added = {name: added_cond_kwargs[name].to(torch.float32) for name in self._added}
        cond = {TIMESTEP_COND: timestep_cond.to(torch.float32)} if timestep_cond is not None else {}
        inputs = dict(sample=sample, timestep=timesteps_for(timestep, sample.shape[0]),
                      encoder_hidden_states=encoder_hidden_states, **cond, **added, **residuals, **ip)
        run = self._step_cache
        out = self._run(self._component, **inputs)["out_sample"] if run is None else run.denoise(self, inputs)
        if not return_dict:
            return (out,)
        from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

        return UNet2DConditionOutput(sample=out)

    @property
    def encoder_hid_proj(self):
        """diffusers' pipelines read the adapters' projection layers (how many, which kind) from here."""
        return getattr(self._original, "encoder_hid_proj", None)

    def _ip_feeds(self, image_embeds) -> dict[str, torch.Tensor]:
        return ip_adapter.engine_feeds(self._original, self.engine.spec.input_names, image_embeds, what="U-Net")

    def step_cache(self, run):
        """Step caching for one pipeline call (None: none); its state goes with the call."""
        return call_state(self, "_step_cache", run)

    def _residual_feeds(self, down, mid) -> dict[str, torch.Tensor]:
        """A ControlNet's residuals as the engine's inputs (its U-Net must take them; a plain one must not)."""
        if not self._residuals:
            if down is not None or mid is not None:
                raise InvalidInput("this U-Net engine takes no ControlNet residuals; compile the pipeline with its "
                                   "ControlNet (`controlnet=`) so that kasoku builds the unet_controlnet engine.")
            return {}
        given = [*(down or ()), *([mid] if mid is not None else [])]
        if down is None or mid is None or len(given) != len(self._residuals):
            raise InvalidInput(f"the {self._component} engine takes {len(self._residuals) - 1} down-block residuals "
                               f"and a mid-block residual from the ControlNet but got {len(down or ())} and "
                               f"{'one' if mid is not None else 'none'}.")
        return dict(zip(self._residuals, given))
