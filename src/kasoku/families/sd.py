"""Stable Diffusion 1.x and 2.x: diffusers' StableDiffusion* pipelines on one CLIP text encoder.

SD 2 swapped CLIP ViT-L for OpenCLIP ViT-H (gelu activations; diffusers ships it ending at
OpenCLIP's penultimate layer, so its last hidden state is what the pipeline reads) and gave the
U-Net linear projections and per-block head counts. Both run the same pipelines and components.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..architectures.tiny import (
    SCHEDULER_COMMON,
    TINY_SIZES,
    seeded,
    tiny_text_encoder,
    tiny_tokenizer,
    tiny_unet_common,
    tiny_vae,
)
from .base import UNetFamily

PIPELINES = {
    "txt2img": "StableDiffusionPipeline",
    "img2img": "StableDiffusionImg2ImgPipeline",
    "inpaint": "StableDiffusionInpaintPipeline",
}
# An LCM-distilled U-Net's own pipelines (diffusers' StableDiffusion* pipelines run it too: they embed the
# guidance scale when the U-Net's config has `time_cond_proj_dim`).
LCM_PIPELINES = {
    "txt2img": "LatentConsistencyModelPipeline",
    "img2img": "LatentConsistencyModelImg2ImgPipeline",
}
CONTROLNET_PIPELINES = {
    "txt2img": "StableDiffusionControlNetPipeline",
    "img2img": "StableDiffusionControlNetImg2ImgPipeline",
    "inpaint": "StableDiffusionControlNetInpaintPipeline",
}


def _is_sd2(unet_config: Mapping[str, Any], text_config: Mapping[str, Any]) -> bool:
    # OpenCLIP's text tower uses gelu where OpenAI CLIP uses quick_gelu; SD 2 U-Nets project linearly.
    return bool(unet_config.get("use_linear_projection")) or text_config.get("hidden_act") == "gelu"


class StableDiffusion1(UNetFamily):
    name = "sd1"
    title = "Stable Diffusion 1.x"
    pipelines = PIPELINES
    controlnet_pipelines = CONTROLNET_PIPELINES
    pipeline_sets = (LCM_PIPELINES,)
    lcm_pipeline = LCM_PIPELINES["txt2img"]
    # diffusers' safety checker runs a torch model on the images: the engines replace it too.
    replaced_attributes = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}

    def matches(self, pipeline_class, components, configs) -> bool:
        return pipeline_class in self.class_names() and not _is_sd2(configs.get("unet", {}),
                                                                     configs.get("text_encoder", {}))

    def tiny_unet(self, in_channels: int, **config):
        from diffusers import UNet2DConditionModel

        return UNet2DConditionModel(
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=TINY_SIZES.text_hidden,
            attention_head_dim=TINY_SIZES.head_dim,
            **tiny_unet_common(in_channels),
            **config,
        )

    def tiny_scheduler(self, prediction: str):
        from diffusers import PNDMScheduler

        return PNDMScheduler(set_alpha_to_one=False, skip_prk_steps=True, prediction_type=prediction,
                             **SCHEDULER_COMMON)

    def tiny_pipeline(self, *, inpainting: bool = False, prediction: str = "epsilon", seed: int = 0):
        tokenizer = tiny_tokenizer(self.tiny_pad_token)
        components = dict(
            vae=seeded(seed, 1, tiny_vae),
            text_encoder=seeded(seed, 2, lambda: tiny_text_encoder(tokenizer, openclip=self.tiny_openclip)),
            tokenizer=tokenizer,
            unet=seeded(seed, 3, lambda: self.tiny_unet(9 if inpainting else 4)),
            scheduler=self.tiny_scheduler(prediction),
            safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        )
        return self.pipeline_class("inpaint" if inpainting else "txt2img")(**components)

    tiny_pad_token = "<|endoftext|>"
    tiny_openclip = False


class StableDiffusion2(StableDiffusion1):
    name = "sd2"
    title = "Stable Diffusion 2.x"
    tiny_pad_token = "!"  # OpenCLIP's tokenizer pads with "!"
    tiny_openclip = True

    def matches(self, pipeline_class, components, configs) -> bool:
        return pipeline_class in self.class_names() and _is_sd2(configs.get("unet", {}),
                                                                 configs.get("text_encoder", {}))

    def tiny_unet(self, in_channels: int, **config):
        from diffusers import UNet2DConditionModel

        return UNet2DConditionModel(
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=TINY_SIZES.text_hidden,
            attention_head_dim=TINY_SIZES.heads_per_block,  # diffusers' historical name for SD 2's head counts
            use_linear_projection=True,
            **tiny_unet_common(in_channels),
            **config,
        )

    def tiny_scheduler(self, prediction: str):
        from diffusers import DDIMScheduler

        return DDIMScheduler(set_alpha_to_one=False, clip_sample=False, prediction_type=prediction,
                             **SCHEDULER_COMMON)
