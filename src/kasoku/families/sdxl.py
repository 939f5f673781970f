"""Stable Diffusion XL (base): StableDiffusionXL* pipelines on two text encoders.

The pipeline reads the penultimate hidden state of both encoders and the projected pooled
embedding of the second; the U-Net takes that pooled embedding and six size/crop ids as added
conditioning (``text_time``: two more engine inputs). SDXL's VAE overflows in fp16 unless it is a
fp16-safe one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..architectures import clip, unet
from ..architectures.base import Axes
from ..architectures.tiny import (
    SCHEDULER_COMMON,
    TINY_SIZES,
    seeded,
    tiny_text_encoder,
    tiny_tokenizer,
    tiny_unet_common,
    tiny_vae,
)
from ..core.components import Precision, TensorSpec
from ..core.errors import NotADiffusersPipeline
from ..core.standins import InvalidInput
from .base import ModelView, TextEncoderSlot, UNetFamily

# SDXL's size/crop conditioning: (height, width) or (top, left) pairs in pixels.
SIZE_IDS = ("original_size", "target_size", "crops_coords_top_left", "negative_original_size",
            "negative_target_size", "negative_crops_coords_top_left")
TIME_IDS = 6  # the base model's original size, crop top-left and target size, two numbers each
VAE_FP32 = (
    "SDXL's VAE overflows in fp16 (its config sets force_upcast), so it is built in fp32; give the pipeline "
    "a fp16-safe VAE (force_upcast false, such as madebyollin/sdxl-vae-fp16-fix) to build it in fp16"
)
TIME_IDS = 6  # original size, crop top-left, target size


class StableDiffusionXL(UNetFamily):
    name = "sdxl"
    title = "Stable Diffusion XL"
    pipelines = {
        "txt2img": "StableDiffusionXLPipeline",
        "img2img": "StableDiffusionXLImg2ImgPipeline",
        "inpaint": "StableDiffusionXLInpaintPipeline",
    }
    controlnet_pipelines = {
        "txt2img": "StableDiffusionXLControlNetPipeline",
        "img2img": "StableDiffusionXLControlNetImg2ImgPipeline",
        "inpaint": "StableDiffusionXLControlNetInpaintPipeline",
    }
    text_encoder_slots = (TextEncoderSlot("text_encoder", "tokenizer", clip.PENULTIMATE),
                          TextEncoderSlot("text_encoder_2", "tokenizer_2", clip.PROJECTED_PENULTIMATE))
    call_arguments = ("prompt_2", "negative_prompt_2", "pooled_prompt_embeds", "negative_pooled_prompt_embeds",
                      *SIZE_IDS, "aesthetic_score", "negative_aesthetic_score")

    def check_layout(self, components: Mapping[str, Any], where: str) -> None:
        missing = [name for name in self.text_encoders if components.get(name) is None]
        if missing and len(missing) < len(self.text_encoders):  # the refiner has only the second, and aesthetic ids
            raise NotADiffusersPipeline(
                f"{where} is an SDXL pipeline without {', '.join(missing)} (an SDXL refiner?); kasoku supports "
                "SDXL base pipelines with both text encoders."
            )
        super().check_layout(components, where)

    def unet_added_inputs(self, model: ModelView, axes: Axes) -> tuple[TensorSpec, ...]:
        # the pooled text embedding is the rest of the U-Net's added input beside the time ids (diffusers checks
        # that it is text_encoder_2's projection width), so a pipeline without text encoders has it too
        config = model.ref(self.denoiser).config
        pooled = config.projection_class_embeddings_input_dim - TIME_IDS * config.addition_time_embed_dim
        return unet.text_time_inputs(config, pooled, axes)

    def vae_fp32_for(self, model: ModelView) -> dict[Precision, str]:
        # fp16's range is what overflows; bf16 and int8 (which computes in bf16 or fp32) keep fp32's range.
        return {Precision.FP16: VAE_FP32} if model.ref(self.vae).config.get("force_upcast", True) else {}

    def check_arguments(self, kwargs: Mapping[str, Any]) -> None:
        for name in SIZE_IDS:
            value = kwargs.get(name)
            if value is not None and (len(tuple(value)) != 2 or any(int(v) < 0 for v in value)):
                raise InvalidInput(f"`{name}` must be a pair of non-negative ints (height, width) or "
                                   f"(top, left) but is {value!r}.")

    # ---- the built-in tiny model -----------------------------------------------------------

    def tiny_unet(self, in_channels: int, **config):
        # Attention only in the deeper blocks, several transformer layers there, and the pooled text
        # embedding plus the six size/crop ids added to the time embedding.
        from diffusers import UNet2DConditionModel

        sizes = TINY_SIZES
        return UNet2DConditionModel(
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=sizes.text_hidden + sizes.text_hidden_2,
            attention_head_dim=sizes.heads_per_block,
            transformer_layers_per_block=(1, 2),
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=sizes.time_ids_embed_dim,
            projection_class_embeddings_input_dim=sizes.time_ids_embed_dim * TIME_IDS + sizes.text_projection_2,
            **tiny_unet_common(in_channels),
            **config,
        )

    def tiny_scheduler(self, prediction: str):
        from diffusers import EulerDiscreteScheduler

        return EulerDiscreteScheduler(timestep_spacing="leading", interpolation_type="linear",
                                      prediction_type=prediction, **SCHEDULER_COMMON)

    def tiny_pipeline(self, *, inpainting: bool = False, prediction: str = "epsilon", seed: int = 0):
        tokenizer, tokenizer_2 = tiny_tokenizer("<|endoftext|>"), tiny_tokenizer("!")
        components = dict(
            vae=seeded(seed, 1, lambda: tiny_vae(scaling_factor=0.13025, force_upcast=True)),  # SDXL's VAE config
            text_encoder=seeded(seed, 2, lambda: tiny_text_encoder(tokenizer)),
            tokenizer=tokenizer,
            unet=seeded(seed, 3, lambda: self.tiny_unet(9 if inpainting else 4)),
            scheduler=self.tiny_scheduler(prediction),
            text_encoder_2=seeded(seed, 4, lambda: tiny_text_encoder(tokenizer_2, openclip=True, second=True)),
            tokenizer_2=tokenizer_2,
            add_watermarker=False,
        )
        return self.pipeline_class("inpaint" if inpainting else "txt2img")(**components)
