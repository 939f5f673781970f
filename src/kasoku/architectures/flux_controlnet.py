"""diffusers' FluxControlNetModel: double- and single-stream blocks whose outputs steer a Flux.1 transformer.

One engine per ControlNet (``controlnet_<i>``), one graph per architecture: the transformer's own inputs (packed
latents, timestep, text embeddings, pooled projections, ids, and guidance where the ControlNet embeds it), the
control image as the pipeline packs it after the VAE encodes it, and one scale per block in; each double-stream
block's sample, then each single-stream block's, times its scale out, packed tokens as the latents are.
``transformer_controlnet`` (:mod:`.flux`) takes them. Several ControlNets run as diffusers' FluxMultiControlNetModel
over the stand-ins (it sums their samples).

kasoku compiles InstantX's kind (the control image VAE-encoded, no mode embedding). XLabs' ControlNets (a pixel-space
`input_hint_block`, samples repeated over the blocks) and the union ControlNets (`num_mode`: a control mode per
image) are refused with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..core.components import ComponentSpec, ShapeProfile, TensorSpec
from ..core.standins import InvalidInput, timesteps_for
from .base import Axes, ModuleRef, attention_width
from .controlnet import (
    ControlNetStandIn,
    UnfitControlNet,
    refuse_differences,
    residual_scales,
)
from .flux import CONTROLNET_BLOCK, CONTROLNET_SINGLE_BLOCK, denoiser_inputs, sample_input, token_samples

MODEL_CLASS = "FluxControlNetModel"
MULTI_CLASS = "FluxMultiControlNetModel"
# What a ControlNet must share with the transformer it steers (its samples are added to the transformer's tokens).
FITS = ("in_channels", "joint_attention_dim", "pooled_projection_dim", "axes_dims_rope")


def check_fits(controlnet_config: Mapping[str, Any], transformer_config: Mapping[str, Any], latent_channels: int,
               where: str, model: str) -> None:
    """Raise :class:`UnfitControlNet` for a ControlNet that cannot steer a Flux transformer of
    `transformer_config` on engines."""
    config = controlnet_config
    if config.get("conditioning_embedding_channels") is not None:
        raise UnfitControlNet(f"{where} is one of XLabs' Flux ControlNets (a pixel-space input_hint_block, its samples "
                              "repeated over the blocks); kasoku compiles InstantX's kind (the control image "
                              "VAE-encoded).")
    if config.get("num_mode") is not None:
        raise UnfitControlNet(f"{where} is a union ControlNet (num_mode: a control mode per image), which kasoku "
                              "does not compile; give a ControlNet of one kind of control image.")
    differ = [key for key in FITS if tuple(_listed(config.get(key))) != tuple(_listed(transformer_config.get(key)))]
    if attention_width(config) != attention_width(transformer_config):
        differ.append("width (num_attention_heads x attention_head_dim)")
    refuse_differences(differ, where, model, "transformer")


def _listed(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def check_together(configs: list[Mapping[str, Any]]) -> None:
    """Several ControlNets' samples are summed block by block, and the pipeline reads the first one's guidance
    embedding for all: they must have as many blocks of each kind and embed guidance alike."""
    kinds = {(config["num_layers"], config["num_single_layers"], bool(config["guidance_embeds"])) for config in configs}
    if len(kinds) > 1:
        raise UnfitControlNet("the ControlNets differ in their double- or single-stream block counts or guidance "
                              "embedding; diffusers sums their samples block by block, so give ControlNets of one "
                              "layout.")


def control_blocks(config: Mapping[str, Any]) -> tuple[int, int]:
    """The double- and single-stream samples a ControlNet of `config` gives the transformer (transformer_spec's
    `control_blocks`)."""
    return config["num_layers"], config["num_single_layers"]


def randomize_zeroed(controlnet: torch.nn.Module) -> torch.nn.Module:
    """`controlnet` with the layers diffusers initialises to zero (an untrained ControlNet adds nothing) made random:
    a ControlNet with random weights that steers, for the tiny model and the benchmarks."""
    zeroed = (*controlnet.controlnet_blocks, *controlnet.controlnet_single_blocks, controlnet.controlnet_x_embedder)
    for layer in zeroed:
        layer.reset_parameters()
    return controlnet


class FluxControlNetModule(torch.nn.Module):
    """A FluxControlNetModel on (hidden_states, timestep, encoder_hidden_states, pooled_projections, img_ids,
    txt_ids[, guidance], controlnet_cond, conditioning_scale) returning each block's sample times its scale."""

    def __init__(self, controlnet: torch.nn.Module):
        super().__init__()
        self.controlnet = controlnet

    def forward(self, hidden_states, timestep, encoder_hidden_states, pooled_projections, img_ids, txt_ids, *rest):
        guidance, controlnet_cond, conditioning_scale = rest if len(rest) == 3 else (None, *rest)
        double, single = self.controlnet(hidden_states=hidden_states, controlnet_cond=controlnet_cond,
                                         conditioning_scale=1.0, timestep=timestep, guidance=guidance,
                                         encoder_hidden_states=encoder_hidden_states,
                                         pooled_projections=pooled_projections, img_ids=img_ids, txt_ids=txt_ids,
                                         return_dict=False)
        samples = [*(double or ()), *(single or ())]
        return tuple(sample * conditioning_scale[i] for i, sample in enumerate(samples))


def controlnet_spec(name: str, ref: ModuleRef, profile: ShapeProfile, axes: Axes, *,
                    text_length: int) -> ComponentSpec:
    """The ControlNet at `ref` (see the module docstring), reading `text_length` T5 tokens as the transformer."""
    config = ref.config
    width = attention_width(config)
    own = denoiser_inputs(config, axes, text_length)
    return ComponentSpec(
        name=name,
        inputs=(
            *own,
            TensorSpec("controlnet_cond", own[0].dims),  # the control image's packed latents, as the latents'
            TensorSpec("conditioning_scale", (config.num_layers + config.num_single_layers,)),
        ),
        outputs=(*token_samples(CONTROLNET_BLOCK, config.num_layers, width, axes),
                 *token_samples(CONTROLNET_SINGLE_BLOCK, config.num_single_layers, width, axes)),
        profile=profile,
        load_module=lambda: FluxControlNetModule(ref.load()),
        sample_input=sample_input,
        weights=ref.digest,
        config=dict(config),
        graph_kind="mmdit",
        modules=(ref.path,),
        graph_name="flux_controlnet",
    )


class EngineFluxControlNet(ControlNetStandIn):
    """A FluxControlNetModel's engine, as diffusers' Flux ControlNet pipelines call it."""

    input_hint_block = None  # the pipelines read it: None is InstantX's kind (a VAE-encoded control image)

    def forward(self, hidden_states, controlnet_cond, controlnet_mode=None, conditioning_scale=1.0,
                encoder_hidden_states=None, pooled_projections=None, timestep=None, img_ids=None, txt_ids=None,
                guidance=None, joint_attention_kwargs=None, return_dict=True):
        # joint_attention_kwargs: diffusers' FluxControlNetModel hands them to none of its blocks
        spec = self.engine.spec
        if controlnet_mode is not None and bool((controlnet_mode >= 0).any()):
            raise InvalidInput("this Flux ControlNet has no control modes (it is not a union ControlNet); leave out "
                               "`control_mode`.")
        if ("guidance" in spec.input_names) != (guidance is not None):
            raise InvalidInput("this Flux ControlNet " + ("embeds a guidance scale: diffusers must pass `guidance`"
                                                          if "guidance" in spec.input_names else
                                                          "has no guidance embedding") + ".")
        rows = hidden_states.shape[0]
        feeds = dict(hidden_states=hidden_states, controlnet_cond=controlnet_cond,
                     timestep=timesteps_for(timestep, rows), encoder_hidden_states=encoder_hidden_states,
                     pooled_projections=pooled_projections, img_ids=img_ids.to(torch.float32),
                     txt_ids=txt_ids.to(torch.float32),
                     **({"guidance": timesteps_for(guidance, rows)} if guidance is not None else {}),
                     conditioning_scale=residual_scales(len(spec.outputs), conditioning_scale, False,
                                                        hidden_states.device))
        out = self._outputs(feeds, conditioning_scale)
        double = [out[n] for n in spec.output_names if n.startswith(CONTROLNET_BLOCK.format(""))] or None
        single = [out[n] for n in spec.output_names if n.startswith(CONTROLNET_SINGLE_BLOCK.format(""))] or None
        if not return_dict:
            return double, single
        from diffusers.models.controlnets.controlnet_flux import FluxControlNetOutput

        return FluxControlNetOutput(controlnet_block_samples=double, controlnet_single_block_samples=single)


STAND_IN = EngineFluxControlNet  # its engine, made a MODEL_CLASS too (see .controlnet.stand_in_class)
