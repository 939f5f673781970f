"""Stable Diffusion 3 and 3.5: diffusers' StableDiffusion3* pipelines on an MMDiT transformer.

Three text encoders: CLIP-L and CLIP-G (both read for their penultimate hidden states and projected pooled
embeddings) and T5 for long prompts, which a pipeline may leave out (`text_encoder_3=None`: diffusers then
feeds the transformer zeros in its place). The transformer (SD3Transformer2DModel; SD3.5's dual-attention
layers and QK norm included) reads the CLIP states beside T5's, 77 + the profile's text tokens long. The
VAE has 16 latent channels and a shift factor (the pipelines apply it around the decoder and encoder).

ControlNets (diffusers' StableDiffusion3ControlNetPipeline, text-to-image): one engine per SD3 ControlNet and
``transformer_controlnet``, the transformer taking their block samples (see
:mod:`kasoku.architectures.sd3_controlnet`); the pipeline encodes the control image with the VAE.
"""

from __future__ import annotations

from ..architectures import clip, sd3, sd3_controlnet
from ..architectures.tiny import (
    TINY_IMAGE_SIZE,
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
from ..core.components import ShapeProfile
from .base import ModelView, TextEncoderSlot, TransformerFamily


class StableDiffusion3(TransformerFamily):
    name = "sd3"
    title = "Stable Diffusion 3"
    pipelines = {
        "txt2img": "StableDiffusion3Pipeline",
        "img2img": "StableDiffusion3Img2ImgPipeline",
        "inpaint": "StableDiffusion3InpaintPipeline",
    }
    text_encoder_slots = (TextEncoderSlot("text_encoder", "tokenizer", clip.PROJECTED_PENULTIMATE),
                          TextEncoderSlot("text_encoder_2", "tokenizer_2", clip.PROJECTED_PENULTIMATE),
                          TextEncoderSlot("text_encoder_3", "tokenizer_3", kind="t5", optional=True))
    call_arguments = ("prompt_2", "prompt_3", "negative_prompt_2", "negative_prompt_3", "pooled_prompt_embeds",
                      "negative_pooled_prompt_embeds", "max_sequence_length", "skip_guidance_layers",
                      "skip_layer_guidance_scale", "skip_layer_guidance_start", "skip_layer_guidance_stop", "mu")
    controlnet_pipelines = {"txt2img": "StableDiffusion3ControlNetPipeline"}
    controlnet_architecture = sd3_controlnet
    controlled_denoiser = sd3.CONTROLLED
    transformer_architecture = sd3
    transformer_stand_in = sd3.EngineSD3Transformer
    default_steps = 28
    default_guidance = 7.0
    default_text_tokens = 256
    runs_ip_adapters = True  # InstantX's kind (SD3.5's published IP-Adapter) on a SigLIP image encoder
    ip_image_encoder = "SiglipVisionModel"
    ip_max_adapters = 1

    def denoiser_text_length(self, model: ModelView, profile: ShapeProfile) -> int:
        return self.text_length(model) + self.text_tokens(profile)  # the CLIP states (77 tokens) and T5's side by side

    # ---- the built-in tiny model -----------------------------------------------------------

    def tiny_transformer(self):
        from diffusers import SD3Transformer2DModel

        sizes = TINY_SIZES
        return SD3Transformer2DModel(
            sample_size=TINY_IMAGE_SIZE // 8, patch_size=self.patch, in_channels=16, out_channels=16, num_layers=2,
            attention_head_dim=sizes.transformer_head_dim, num_attention_heads=sizes.transformer_heads,
            joint_attention_dim=TINY_JOINT_WIDTH, caption_projection_dim=16,
            pooled_projection_dim=sizes.text_hidden + sizes.text_projection_2, pos_embed_max_size=32,
            dual_attention_layers=(0,), qk_norm="rms_norm",  # SD3.5's
        )

    def tiny_controlnet(self, *, seed: int = 0):
        """A tiny SD3 ControlNet (InstantX's kind: its own positional and context embedding) for the tiny
        transformer, with deterministic weights from `seed` (the layers diffusers zeroes are random here)."""
        from diffusers import SD3ControlNetModel

        def build():
            transformer = self.tiny_transformer()
            config = {key: transformer.config[key] for key in (
                "sample_size", "patch_size", "in_channels", "attention_head_dim", "num_attention_heads",
                "joint_attention_dim", "caption_projection_dim", "pooled_projection_dim", "out_channels",
                "pos_embed_max_size", "qk_norm")}
            return sd3_controlnet.randomize_zeroed(SD3ControlNetModel(**config, num_layers=1)).eval()

        return seeded(seed, 8, build)

    def tiny_pipeline(self, *, inpainting: bool = False, prediction: str = "epsilon", seed: int = 0):
        tokenizer, tokenizer_2, tokenizer_3 = tiny_tokenizer(), tiny_tokenizer("!"), tiny_t5_tokenizer()
        components = dict(
            vae=seeded(seed, 1, tiny_flow_vae),
            text_encoder=seeded(seed, 2, lambda: tiny_text_encoder(tokenizer, projected=True)),
            tokenizer=tokenizer,
            text_encoder_2=seeded(seed, 4, lambda: tiny_text_encoder(tokenizer_2, openclip=True, second=True)),
            tokenizer_2=tokenizer_2,
            # T5 as wide as the CLIP states beside it (the transformer's joint attention width)
            text_encoder_3=seeded(seed, 6, lambda: tiny_t5_encoder(tokenizer_3, TINY_JOINT_WIDTH)),
            tokenizer_3=tokenizer_3,
            transformer=seeded(seed, 3, self.tiny_transformer),
            scheduler=flow_match_scheduler(shift=3.0),
        )
        return self.pipeline_class("inpaint" if inpainting else "txt2img")(**components)
