"""Flux.1 (schnell and dev): diffusers' Flux* pipelines on a rectified-flow transformer.

Two text encoders: CLIP-L, read for its pooled embedding only, and T5 for the prompt itself (the profile's
text tokens). The transformer (FluxTransformer2DModel) takes the latents packed in 2x2 patches, the image
and text position ids, and in dev the guidance scale as an embedding (schnell has none). That guidance is
no classifier-free guidance: the transformer sees one row per image; `true_cfg_scale` with a negative prompt
runs it twice. The VAE has 16 latent channels and a shift factor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..architectures import clip, flux, flux_controlnet
from ..architectures.base import Axes
from ..architectures.tiny import (
    TINY_JOINT_WIDTH,
    TINY_SIZES,
    flow_match_scheduler,
    seeded,
    tiny_flow_vae,
    tiny_t5_encoder,
    tiny_t5_tokenizer,
    tiny_text_encoder,
    tiny_tokenizer,
)
from ..core.components import ShapeProfile, TensorSpec
from .base import ModelView, TextEncoderSlot, TransformerFamily


class Flux(TransformerFamily):
    name = "flux"
    title = "Flux.1"
    pipelines = {
        "txt2img": "FluxPipeline",
        "img2img": "FluxImg2ImgPipeline",
        "inpaint": "FluxInpaintPipeline",
    }
    text_encoder_slots = (TextEncoderSlot("text_encoder", "tokenizer", clip.POOLED),
                          TextEncoderSlot("text_encoder_2", "tokenizer_2", kind="t5"))
    controlnet_pipelines = {
        "txt2img": "FluxControlNetPipeline",
        "img2img": "FluxControlNetImg2ImgPipeline",
        "inpaint": "FluxControlNetInpaintPipeline",
    }
    controlnet_architecture = flux_controlnet
    controlled_denoiser = flux.CONTROLLED
    transformer_architecture = flux
    transformer_stand_in = flux.EngineFluxTransformer
    call_arguments = ("prompt_2", "negative_prompt_2", "true_cfg_scale", "pooled_prompt_embeds",
                      "negative_pooled_prompt_embeds", "max_sequence_length", "sigmas")
    default_steps = 28
    default_guidance = 3.5
    default_text_tokens = 512
    runs_ip_adapters = True  # XLabs' kind: the plain projection, key/value projections in the double-stream blocks
    ip_encoder_argument = "image_encoder_pretrained_model_name_or_path"
    ip_scale_per_block_list = True

    def doubles_batch(self, kwargs: Mapping[str, Any], model: ModelView | None = None) -> bool:
        return False  # embedded guidance; true CFG runs the transformer twice on the same batch

    def denoiser_text_length(self, model: ModelView, profile: ShapeProfile) -> int:
        return self.text_tokens(profile)  # T5's states alone; CLIP gives only the pooled vector

    def transformer_ip_inputs(self, model: ModelView, axes: Axes) -> tuple[TensorSpec, ...]:
        return self.denoiser_ip_inputs(model, axes, axes.images)  # one row per image, as its other inputs

    # ---- the built-in tiny model -----------------------------------------------------------

    def tiny_transformer(self, guidance: bool = True):
        from diffusers import FluxTransformer2DModel

        sizes = TINY_SIZES
        return FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
            attention_head_dim=sizes.transformer_head_dim, num_attention_heads=sizes.transformer_heads,
            joint_attention_dim=TINY_JOINT_WIDTH, pooled_projection_dim=sizes.text_hidden,
            guidance_embeds=guidance, axes_dims_rope=(2, 2, 4),
        )

    def tiny_controlnet(self, *, seed: int = 0):
        """A tiny Flux ControlNet (InstantX's kind: a VAE-encoded control image) for the tiny dev transformer, with
        deterministic weights from `seed` (the layers diffusers zeroes are random here)."""
        from diffusers import FluxControlNetModel

        def build():
            transformer = self.tiny_transformer()
            config = {key: transformer.config[key] for key in (
                "patch_size", "in_channels", "num_layers", "num_single_layers", "attention_head_dim",
                "num_attention_heads", "joint_attention_dim", "pooled_projection_dim", "guidance_embeds",
                "axes_dims_rope")}
            return flux_controlnet.randomize_zeroed(FluxControlNetModel(**config)).eval()

        return seeded(seed, 9, build)

    def tiny_pipeline(self, *, inpainting: bool = False, prediction: str = "epsilon", seed: int = 0,
                      guidance: bool = True):
        """A tiny Flux.1 pipeline: dev's layout (embedded guidance), or schnell's with `guidance` False."""
        tokenizer, tokenizer_2 = tiny_tokenizer(), tiny_t5_tokenizer()
        components = dict(
            # the tiny SD3's VAE and T5 (the same configs and weights: their graphs and engines are shared)
            vae=seeded(seed, 1, tiny_flow_vae),
            text_encoder=seeded(seed, 2, lambda: tiny_text_encoder(tokenizer)),
            tokenizer=tokenizer,
            text_encoder_2=seeded(seed, 6, lambda: tiny_t5_encoder(tokenizer_2, TINY_JOINT_WIDTH)),
            tokenizer_2=tokenizer_2,
            transformer=seeded(seed, 3, lambda: self.tiny_transformer(guidance)),
            scheduler=flow_match_scheduler(shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256,
                                           max_image_seq_len=4096, base_shift=0.5, max_shift=1.15),
        )
        return self.pipeline_class("inpaint" if inpainting else "txt2img")(**components)
