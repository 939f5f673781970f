"""diffusers' SD3ControlNetModel: joint transformer blocks whose outputs steer an SD3 transformer.

One engine per ControlNet (``controlnet_<i>``), one graph per architecture: the latents, timestep, text embeddings,
pooled projections, the control image as the VAE encodes it (the pipeline does, with the 16-channel VAE) and one
scale per block in; each block's sample times its scale out, as a (rows, height / 2, width / 2, width) grid of
tokens (see :func:`.sd3.token_grid`). ``transformer_controlnet`` (:mod:`.sd3`) takes them, and diffusers adds
each to the output of the transformer blocks it steers. Several ControlNets run as diffusers'
SD3MultiControlNetModel over the stand-ins (it sums their samples).

kasoku compiles the ControlNets that embed their own inputs (InstantX's SD3 ControlNets: a positional embedding
and a context embedder of their own). SD3.5's own ControlNets take the transformer's positional embedding at
pipeline set-up (`use_pos_embed=False`) and are refused with the reason, as are the inpainting ControlNets (extra
conditioning channels: diffusers' StableDiffusion3ControlNetInpaintingPipeline).
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
from .sd3 import CONTROLNET_BLOCK, as_grid, denoiser_inputs, token_grid

MODEL_CLASS = "SD3ControlNetModel"
MULTI_CLASS = "SD3MultiControlNetModel"
# What a ControlNet must share with the transformer it steers (its samples are added to the transformer's tokens).
FITS = ("patch_size", "pooled_projection_dim", "joint_attention_dim")


def check_fits(controlnet_config: Mapping[str, Any], transformer_config: Mapping[str, Any], latent_channels: int,
               where: str, model: str) -> None:
    """Raise :class:`UnfitControlNet` for a ControlNet that cannot steer an SD3 transformer of
    `transformer_config` on engines."""
    config = controlnet_config
    if not config.get("use_pos_embed", True):
        raise UnfitControlNet(f"{where} is one of SD3.5's own ControlNets (it borrows the transformer's positional "
                              "embedding, use_pos_embed=False); kasoku compiles the SD3 ControlNets that embed their "
                              "own inputs (InstantX's kind).")
    if config.get("extra_conditioning_channels"):
        raise UnfitControlNet(f"{where} is an inpainting ControlNet (extra_conditioning_channels: diffusers' "
                              "StableDiffusion3ControlNetInpaintingPipeline), which kasoku does not compile; give a "
                              "ControlNet for StableDiffusion3ControlNetPipeline.")
    differ = [key for key in FITS if config.get(key) != transformer_config.get(key)]
    if attention_width(config) != attention_width(transformer_config):
        differ.append("width (num_attention_heads x attention_head_dim)")
    if config.get("in_channels") != latent_channels:
        differ.append("in_channels (the latent channels)")
    refuse_differences(differ, where, model, "transformer")


def check_together(configs: list[Mapping[str, Any]]) -> None:
    """Several ControlNets' samples are summed block by block: they must have as many blocks."""
    blocks = [config["num_layers"] for config in configs]
    if len(set(blocks)) > 1:
        raise UnfitControlNet(f"the ControlNets have {', '.join(map(str, blocks))} blocks; diffusers sums their "
                              "samples block by block, so give ControlNets with as many blocks.")


def control_blocks(config: Mapping[str, Any]) -> int:
    """The block samples a ControlNet of `config` gives the transformer (transformer_spec's `control_blocks`)."""
    return config["num_layers"]


def randomize_zeroed(controlnet: torch.nn.Module) -> torch.nn.Module:
    """`controlnet` with the layers diffusers initialises to zero (an untrained ControlNet adds nothing) made random:
    a ControlNet with random weights that steers, for the tiny model and the benchmarks."""
    for layer in (*controlnet.controlnet_blocks, controlnet.pos_embed_input.proj):
        layer.reset_parameters()
    return controlnet


class SD3ControlNetModule(torch.nn.Module):
    """An SD3ControlNetModel on (hidden_states, timestep, encoder_hidden_states, pooled_projections,
    controlnet_cond, conditioning_scale) returning each block's sample times its scale, as a token grid."""

    def __init__(self, controlnet: torch.nn.Module):
        super().__init__()
        self.controlnet = controlnet

    def forward(self, hidden_states, timestep, encoder_hidden_states, pooled_projections, controlnet_cond,
                conditioning_scale):
        (samples,) = self.controlnet(hidden_states=hidden_states, controlnet_cond=controlnet_cond,
                                     conditioning_scale=1.0, encoder_hidden_states=encoder_hidden_states,
                                     pooled_projections=pooled_projections, timestep=timestep, return_dict=False)
        patch = self.controlnet.config.patch_size
        return tuple(as_grid(sample * conditioning_scale[i], hidden_states, patch) for i, sample in enumerate(samples))


def controlnet_spec(name: str, ref: ModuleRef, profile: ShapeProfile, axes: Axes, *,
                    text_length: int) -> ComponentSpec:
    """The ControlNet at `ref` (see the module docstring), reading `text_length` text tokens as the transformer."""
    config = ref.config
    blocks = config.num_layers
    own = denoiser_inputs(config, axes, text_length)
    return ComponentSpec(
        name=name,
        inputs=(
            *own,
            TensorSpec("controlnet_cond", own[0].dims),  # the control image's latents, as the latents
            TensorSpec("conditioning_scale", (blocks,)),
        ),
        outputs=tuple(token_grid(CONTROLNET_BLOCK.format(i), config, axes) for i in range(blocks)),
        profile=profile,
        load_module=lambda: SD3ControlNetModule(ref.load()),
        weights=ref.digest,
        config=dict(config),
        graph_kind="mmdit",
        modules=(ref.path,),
        graph_name="sd3_controlnet",
    )


class EngineSD3ControlNet(ControlNetStandIn):
    """An SD3ControlNetModel's engine, as diffusers' SD3 ControlNet pipeline calls it."""

    def forward(self, hidden_states, controlnet_cond, conditioning_scale=1.0, encoder_hidden_states=None,
                pooled_projections=None, timestep=None, joint_attention_kwargs=None, return_dict=True):
        # joint_attention_kwargs: diffusers' SD3ControlNetModel hands them to none of its blocks (an image prompt's
        # embeddings are the transformer's), so they change nothing here either
        if encoder_hidden_states is None or pooled_projections is None:
            raise InvalidInput("the compiled SD3 ControlNet needs encoder_hidden_states and pooled_projections.")
        spec = self.engine.spec
        feeds = dict(hidden_states=hidden_states, timestep=timesteps_for(timestep, hidden_states.shape[0]),
                     encoder_hidden_states=encoder_hidden_states,
                     pooled_projections=pooled_projections.to(torch.float32), controlnet_cond=controlnet_cond,
                     conditioning_scale=residual_scales(len(spec.outputs), conditioning_scale, False,
                                                        hidden_states.device))
        out = self._outputs(feeds, conditioning_scale)
        samples = [out[name].flatten(1, 2) for name in spec.output_names]
        if not return_dict:
            return (samples,)
        from diffusers.models.controlnets.controlnet_sd3 import SD3ControlNetOutput

        return SD3ControlNetOutput(controlnet_block_samples=samples)


STAND_IN = EngineSD3ControlNet  # its engine, made a MODEL_CLASS too (see .controlnet.stand_in_class)
