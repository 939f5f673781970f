"""diffusers' SD3Transformer2DModel: the MMDiT denoiser of Stable Diffusion 3 and 3.5.

One graph, ``transformer``: (hidden_states, timestep, encoder_hidden_states, pooled_projections) ->
out_sample. The latents go in as the VAE makes them (16 channels at 1/8 of the image); the transformer
patches them itself (2x2) and crops its positional embedding to their size, so height and width stay
dynamic. The text embeddings are the CLIP encoders' penultimate states beside T5's, `77 + text tokens` long,
and the pooled projection is both CLIP encoders' projected embeddings side by side. SD3.5's dual-attention
layers and QK RMS norm are part of the config and export as they run.
"""

from __future__ import annotations

import torch

from ..components import ComponentSpec, ShapeProfile, TensorSpec
from ..standins import EngineModule, InvalidInput, timesteps_for
from .base import Axes, ModuleRef

INPUTS = ("hidden_states", "timestep", "encoder_hidden_states", "pooled_projections")


class SD3TransformerModule(torch.nn.Module):
    """The transformer on (hidden_states, timestep, encoder_hidden_states, pooled_projections)."""

    def __init__(self, transformer: torch.nn.Module):
        super().__init__()
        self.transformer = transformer

    def forward(self, hidden_states, timestep, encoder_hidden_states, pooled_projections):
        return (self.transformer(hidden_states=hidden_states, timestep=timestep,
                                 encoder_hidden_states=encoder_hidden_states, pooled_projections=pooled_projections,
                                 return_dict=False)[0],)


def transformer_spec(ref: ModuleRef, profile: ShapeProfile, axes: Axes, *, text_length: int,
                     name: str = "transformer") -> ComponentSpec:
    """The transformer at `ref` on `text_length` text tokens (CLIP's and T5's together)."""
    config = ref.config
    return ComponentSpec(
        name=name,
        inputs=(
            TensorSpec("hidden_states", (axes.guided, config.in_channels, axes.latent_h, axes.latent_w)),
            TensorSpec("timestep", (axes.guided,), always_fp32=True),
            TensorSpec("encoder_hidden_states", (axes.guided, text_length, config.joint_attention_dim)),
            TensorSpec("pooled_projections", (axes.guided, config.pooled_projection_dim)),
        ),
        outputs=(TensorSpec("out_sample", (axes.guided, config.out_channels, axes.latent_h, axes.latent_w)),),
        profile=profile,
        load_module=lambda: SD3TransformerModule(ref.load()),
        weights=ref.digest,
        config=dict(config),
        graph_kind="mmdit",
        modules=(ref.path,),
        int8="weights",
        takes_lora=True,
    )


class EngineSD3Transformer(EngineModule):
    """The transformer as diffusers' SD3 pipelines call it."""

    def forward(self, hidden_states, encoder_hidden_states=None, pooled_projections=None, timestep=None,
                block_controlnet_hidden_states=None, joint_attention_kwargs=None, return_dict=True, skip_layers=None):
        if block_controlnet_hidden_states is not None or skip_layers is not None or joint_attention_kwargs:
            raise InvalidInput("the compiled SD3 transformer takes the latents, timestep, text embeddings and pooled "
                               "projections only (no ControlNet, skip-layer guidance, IP-Adapter or LoRA scale).")
        out = self._run(self._component, hidden_states=hidden_states,
                        timestep=timesteps_for(timestep, hidden_states.shape[0]),
                        encoder_hidden_states=encoder_hidden_states,
                        pooled_projections=pooled_projections.to(torch.float32))["out_sample"]
        if not return_dict:
            return (out,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=out)
