"""The built-in tiny Stable Diffusion pipelines: one per model family, at a size that exports and
runs in seconds on two CPU cores.

Each family builds its own tiny model (``Family.tiny_pipeline`` in kasoku/families/) from the building
blocks in :mod:`kasoku.architectures.tiny`: SD 1.x (cross-attention U-Net, CLIP text encoder, PNDM), SD 2.x
(OpenCLIP-style gelu text encoder, per-block head counts, linear projections, DDIM with epsilon or
v-prediction) and SDXL (two text encoders, the second with a projection; a U-Net with added size/crop
conditioning; Euler). This module writes them to folders. Nothing is downloaded: this is what the tests,
the demo and the examples run on.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..architectures.tiny import PREDICTION_TYPES
from ..core.errors import KasokuError
from ..families import FAMILIES, UNetFamily
from .tiny_families import TINY_FAMILIES, tiny_family_pipeline


def family_names() -> tuple[str, ...]:
    """The hand-written families, then those compiled from their recorded calls."""
    return (*FAMILIES, *TINY_FAMILIES)


def check_variant(family: str, *, inpainting: bool = False, prediction: str = "epsilon",
                  controlnet: bool = False, lcm: bool = False, ip_adapter: bool = False) -> None:
    """The tiny variants are the U-Net families': an inpainting U-Net, v-prediction, an LCM U-Net (not with the
    others); a ControlNet is every family's that runs them, IP-Adapters too."""
    if family in TINY_FAMILIES:  # compiled from its recorded calls: no variants
        asked = [flag for flag, given in (("--inpainting", inpainting), ("--prediction v_prediction",
                                                                         prediction != "epsilon"),
                                          ("--controlnet", controlnet), ("--lcm", lcm), ("--ip-adapter", ip_adapter))
                 if given]
        if asked:
            raise KasokuError(f"{asked[0]}: the tiny {family} pipeline has no such variant; it runs the tasks its "
                              "diffusers family has classes for as it is.")
        return
    chosen = FAMILIES[family]
    if isinstance(chosen, UNetFamily):
        others = [flag for flag, given in (("--inpainting", inpainting), ("--prediction v_prediction",
                                                                          prediction != "epsilon")) if given]
        if lcm and others:
            raise KasokuError(f"--lcm with {others[0]}: the tiny LCM pipeline is a text-to-image one of epsilon "
                              "prediction (it runs img2img and inpainting as it is).")
        return
    asked = [flag for flag, given in (("--inpainting", inpainting), ("--prediction v_prediction",
                                                                     prediction != "epsilon"),
                                      ("--controlnet", controlnet and not chosen.controlnet_architecture),
                                      ("--lcm", lcm), ("--ip-adapter", ip_adapter and not chosen.runs_ip_adapters))
             if given]
    if asked:
        raise KasokuError(f"{asked[0]}: the tiny {chosen.title} pipeline has no such variant (the U-Net families' "
                          f"are: sd1, sd2, sdxl); every {chosen.title} pipeline inpaints and runs img2img as it is.")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; choose from {', '.join(choices)}.")


def tiny_pipeline(*, family: str = "sd1", inpainting: bool = False, prediction: str = "epsilon", seed: int = 0,
                  lcm: bool = False):
    """A live diffusers pipeline of `family` (txt2img, or inpainting; with `lcm`, an LCM-distilled U-Net and
    diffusers' LCMScheduler) with deterministic weights."""
    _check_choice("family", family, family_names())
    _check_choice("prediction type", prediction, PREDICTION_TYPES)
    check_variant(family, inpainting=inpainting, prediction=prediction, lcm=lcm)
    if family in TINY_FAMILIES:
        return tiny_family_pipeline(family, seed)
    pipe = FAMILIES[family].tiny_lcm_pipeline(seed=seed) if lcm else \
        FAMILIES[family].tiny_pipeline(inpainting=inpainting, prediction=prediction, seed=seed)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval()  # as from_pretrained leaves them: no dropout (T5 trains with it)
    pipe.set_progress_bar_config(disable=True)
    return pipe


class FolderNotEmpty(KasokuError, FileExistsError):
    """The tiny pipeline's folder already holds something."""


def check_tiny_folder(directory: str | Path) -> Path:
    """The folder to write into: new, or an existing empty folder."""
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        what = "is a file" if not directory.is_dir() else "is not empty"
        raise FolderNotEmpty(f"{directory} {what}; choose a new folder for the tiny pipeline.")
    return directory


CONTROLNET_FOLDER = "controlnet"  # where `kasoku tiny DIR --controlnet` writes the ControlNet, in DIR
TINY_VAE_FOLDER = "tiny_vae"  # where `kasoku tiny DIR --tiny-vae` writes the tiny autoencoder, in DIR
IP_ADAPTER_FOLDER = "ip_adapter"  # where `kasoku tiny DIR --ip-adapter` writes the IP-Adapters, in DIR
IP_ADAPTER_FILES = {"plain": "ip-adapter.safetensors", "plus": "ip-adapter-plus.safetensors"}


def write_tiny_pipeline(directory: str | Path, *, family: str = "sd1", inpainting: bool = False,
                        prediction: str = "epsilon", seed: int = 0, controlnet: bool = False,
                        tiny_vae: bool = False, lcm: bool = False, ip_adapter: bool = False) -> Path:
    """Write a tiny pipeline as a diffusers folder (safetensors weights, no safety checker); with
    `controlnet`, a tiny ControlNet for it in DIR/controlnet, with `tiny_vae` a tiny AutoencoderTiny (TAESD's
    layout) in DIR/tiny_vae (model folders the pipeline's own loading ignores: give them as `controlnet=` /
    `--controlnet` and `tiny_vae=` / `--tiny-vae`); with `ip_adapter`, a plain and a Plus IP-Adapter and their
    image encoder in DIR/ip_adapter (see :func:`write_tiny_ip_adapters`)."""
    directory = check_tiny_folder(directory)
    check_variant(family, inpainting=inpainting, prediction=prediction, controlnet=controlnet, lcm=lcm,
                  ip_adapter=ip_adapter)
    pipe = tiny_pipeline(family=family, inpainting=inpainting, prediction=prediction, seed=seed, lcm=lcm)
    pipe.save_pretrained(directory, safe_serialization=True)
    if controlnet:
        write_tiny_controlnet(directory / CONTROLNET_FOLDER, family=family, seed=seed)
    if tiny_vae:
        write_tiny_vae(directory / TINY_VAE_FOLDER, family=family, seed=seed)
    if ip_adapter:
        write_tiny_ip_adapters(directory / IP_ADAPTER_FOLDER, getattr(pipe, FAMILIES[family].denoiser), seed=seed)
    return directory


def write_tiny_ip_adapters(directory: str | Path, unet, *, seed: int = 0) -> Path:
    """IP-Adapters for `unet` with random weights, as the published ones are laid out: a folder holding
    ip-adapter.safetensors (plain), ip-adapter-plus.safetensors (Plus: a resampler) and image_encoder/ (a
    CLIPVisionModelWithProjection). `load_ip_adapter(DIR, subfolder="", weight_name=...)` reads them. For Flux's
    transformer only the plain one; for SD3's, ip-adapter.safetensors holds InstantX's kind (a timestep-aware
    resampler) and image_encoder/ a SiglipVisionModel with its image processor."""
    from safetensors.torch import save_file

    from ..architectures import ip_adapter
    from ..architectures.tiny import seeded, tiny_image_encoder, tiny_siglip_encoder

    kind_of_denoiser = type(unet).__name__
    flux, sd3 = kind_of_denoiser == "FluxTransformer2DModel", kind_of_denoiser == "SD3Transformer2DModel"
    if not hasattr(unet, "attn_processors") or not (flux or sd3 or hasattr(unet, "encoder_hid_proj")):
        raise KasokuError("tiny IP-Adapters are for the U-Net pipelines (sd1, sd2, sdxl), SD3 and Flux.")
    directory = Path(directory)
    encoder = seeded(seed, 40, tiny_siglip_encoder if sd3 else tiny_image_encoder).eval()
    encoder.save_pretrained(directory / "image_encoder", safe_serialization=True)
    if sd3:  # diffusers' SD3 loader reads SigLIP's image processor beside it
        from transformers import SiglipImageProcessor

        size = encoder.config.image_size
        SiglipImageProcessor(size={"height": size, "width": size}).save_pretrained(directory / "image_encoder")
    for offset, (kind, file) in enumerate(IP_ADAPTER_FILES.items()):
        if (flux or sd3) and kind != ip_adapter.PLAIN:
            continue  # one kind each: XLabs' plain one for Flux, InstantX's resampler for SD3 (in the plain file)
        state = seeded(seed, 41 + offset, lambda kind=kind: (
            ip_adapter.random_flux_adapter_state_dict(unet, encoder.config) if flux else
            ip_adapter.random_sd3_adapter_state_dict(unet, encoder.config) if sd3 else
            ip_adapter.random_adapter_state_dict(unet, encoder.config, kind)))
        save_file({k: v.contiguous() for k, v in state.items()}, str(directory / file))
    return directory


def write_tiny_vae(directory: str | Path, *, family: str = "sd1", seed: int = 0) -> Path:
    """Write a tiny AutoencoderTiny for the tiny `family` pipeline (its latent channels) as a diffusers folder."""
    _check_choice("family", family, family_names())
    FAMILIES[family].tiny_vae(seed=seed).save_pretrained(directory, safe_serialization=True)
    return Path(directory)


def write_tiny_controlnet(directory: str | Path, *, family: str = "sd1", seed: int = 0) -> Path:
    """Write a tiny ControlNet for the tiny `family` pipeline as a diffusers ControlNetModel folder."""
    _check_choice("family", family, family_names())
    FAMILIES[family].tiny_controlnet(seed=seed).save_pretrained(directory, safe_serialization=True)
    return Path(directory)
