"""diffusers' autoencoders: AutoencoderKL's decoder (latents to pixels) and encoder (pixels to the latent
distribution), and AutoencoderTiny's (TAESD, TAESDXL, TAESD3, TAEF1: a few convolutions each way, about 2% of
the full decoder's FLOPs, deterministic latents).

AutoencoderKL's encoder graph returns the distribution's parameters (mean and log-variance, stacked on
channels), so that sampling with the caller's generator happens outside the engine, as in diffusers.
AutoencoderTiny's returns the latents themselves (it has no distribution). Either way the component names
are `vae_decoder` and `vae_encoder`: a pipeline has one VAE, and its class says which graphs they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..core.components import ComponentSpec, Precision, ShapeProfile, TensorSpec
from ..core.standins import EngineModule, InvalidInput
from .base import Axes, ModuleRef

# Ops that overflow fp16 in a VAE (kept fp32 by the fp16 pass).
FP16_KEEP = ("GroupNormalization", "InstanceNormalization", "ReduceMean", "Pow", "Sqrt", "Div", "Softmax")


TINY_CLASS = "AutoencoderTiny"


def scale_factor(config: Mapping[str, Any]) -> int:
    """How many pixels one latent cell covers per side (8 for SD's four-level VAE; AutoencoderTiny registers its
    decoder's levels as `block_out_channels` too)."""
    return 2 ** (len(config["block_out_channels"]) - 1)


def is_tiny(ref: ModuleRef) -> bool:
    """Whether the VAE at `ref` is an AutoencoderTiny (by class: a meta-device stand-in keeps it)."""
    return type(ref.module).__name__ == TINY_CLASS


class VaeDecoderModule(torch.nn.Module):
    def __init__(self, vae: torch.nn.Module):
        super().__init__()
        self.vae = vae

    def forward(self, latent_sample):
        return (self.vae.decode(latent_sample, return_dict=False)[0],)


class VaeEncoderModule(torch.nn.Module):
    """Returns the latent distribution's parameters (mean and log-variance, stacked on channels); an
    AutoencoderTiny's latents."""

    def __init__(self, vae: torch.nn.Module):
        super().__init__()
        self.vae = vae
        self.tiny = type(vae).__name__ == TINY_CLASS

    def forward(self, sample):
        encoded = self.vae.encode(sample, return_dict=False)[0]
        return (encoded if self.tiny else encoded.parameters,)


def decoder_spec(ref: ModuleRef, profile: ShapeProfile, axes: Axes, *,
                 fp32_for: Mapping[Precision, str] | None = None) -> ComponentSpec:
    """`fp32_for`: precision -> why the decoder is built in fp32 when that precision is asked for."""
    config = ref.config
    tiny = is_tiny(ref)
    return ComponentSpec(
        name="vae_decoder",
        inputs=(TensorSpec("latent_sample", (axes.images, config.latent_channels, axes.latent_h, axes.latent_w)),),
        outputs=(TensorSpec("sample", (axes.images, config.out_channels, axes.pixel_h, axes.pixel_w)),),
        profile=profile,
        load_module=lambda: VaeDecoderModule(ref.load()),
        weights=ref.digest,
        config=dict(config),
        fp32_for=dict(fp32_for or {}),
        graph_kind="" if tiny else "vae",  # ONNX Runtime's VAE fusions are AutoencoderKL's
        fp16_keep_ops=FP16_KEEP if tiny else (*FP16_KEEP, "Resize"),  # the KL decoder's upsampling too
        modules=(ref.path,),
    )


def encoder_spec(ref: ModuleRef, profile: ShapeProfile, axes: Axes, *,
                 fp32_for: Mapping[Precision, str] | None = None) -> ComponentSpec:
    config = ref.config
    tiny = is_tiny(ref)
    output = TensorSpec("latents", (axes.rows, config.latent_channels, axes.latent_h, axes.latent_w)) if tiny else \
        TensorSpec("latent_parameters", (axes.rows, 2 * config.latent_channels, axes.latent_h, axes.latent_w))
    return ComponentSpec(
        name="vae_encoder",
        inputs=(TensorSpec("sample", (axes.rows, config.in_channels, axes.pixel_h, axes.pixel_w)),),
        outputs=(output,),
        profile=profile,
        load_module=lambda: VaeEncoderModule(ref.load()),
        weights=ref.digest,
        config=dict(config),
        fp32_for=dict(fp32_for or {}),
        graph_kind="" if tiny else "vae",
        fp16_keep_ops=FP16_KEEP,
        modules=(ref.path,),
    )


class EngineVAE(EngineModule):
    def __init__(self, original: torch.nn.Module, engines, times, component: str = "vae_decoder"):
        super().__init__(original, engines, times, component)

    def decode(self, z, return_dict=True, generator=None, **kwargs):
        image = self._run("vae_decoder", latent_sample=z)["sample"]
        if not return_dict:
            return (image,)
        from diffusers.models.autoencoders.vae import DecoderOutput

        return DecoderOutput(sample=image)

    def encode(self, x, return_dict=True):
        from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKLOutput
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        if "vae_encoder" not in self._engines:
            raise InvalidInput("img2img and inpaint need the vae_encoder engine; compile it "
                               "(`components` including 'vae_encoder').")
        # diffusers' SD3 ControlNet pipeline encodes its control image after doubling it for classifier-free guidance:
        # the same rows twice. Encoding them once gives the same latents and keeps the engine in the images' batch.
        half = x.shape[0] // 2
        twice = x.shape[0] % 2 == 0 and half > 0 and torch.equal(x[:half], x[half:])
        outputs = self._run("vae_encoder", sample=x[:half] if twice else x)
        if twice:
            outputs = {name: torch.cat([value, value]) for name, value in outputs.items()}
        if "latents" in outputs:  # AutoencoderTiny: the latents themselves
            from diffusers.models.autoencoders.autoencoder_tiny import AutoencoderTinyOutput

            return AutoencoderTinyOutput(latents=outputs["latents"]) if return_dict else (outputs["latents"],)
        distribution = DiagonalGaussianDistribution(outputs["latent_parameters"])  # sampled with the caller's generator
        return AutoencoderKLOutput(latent_dist=distribution) if return_dict else (distribution,)
