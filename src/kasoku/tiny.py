"""The built-in tiny Stable Diffusion pipelines: SD 1.x, SD 2.x and SDXL.

Each family's real architecture at a size that exports and runs in seconds on two CPU cores:
SD 1.x (cross-attention U-Net, CLIP text encoder, PNDM), SD 2.x (OpenCLIP-style gelu text
encoder, per-block head counts, linear projections, DDIM with epsilon or v-prediction) and
SDXL (two text encoders, the second with a projection; a U-Net with added size/crop
conditioning; Euler), all with an AutoencoderKL with an 8x latent. Weights are deterministic
from a seed and the CLIP BPE tokenizer is built from a small generated vocabulary. Nothing
is downloaded: this is what the tests, the demo and the examples run on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

TINY_IMAGE_SIZE = 64
TINY_TEXT_LENGTH = 77

# Prompt words the tokenizer knows as whole tokens; anything else falls back to byte pieces.
_WORDS = """
a an the of on in at with and or by for to from under over above near
photo photograph painting drawing picture portrait landscape render illustration sketch
astronaut horse cat dog bird fish tree flower mountain river lake sea ocean sky cloud
city street house castle forest garden beach desert snow rain sun moon star night day
red green blue yellow white black orange purple pink golden silver dark bright
beautiful detailed high quality realistic cinematic lighting sharp focus soft blurry
riding sitting standing running flying blossom cherry fuji mt mars space robot car
man woman child people face eyes hair hat dress style art oil watercolor digital
low bad ugly deformed noisy
""".split()


def _bytes_to_unicode() -> dict[int, str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


def _apply_merges(pieces: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Byte-pair encoding of one word: merge the lowest-ranked adjacent pair until none applies."""
    while len(pieces) > 1:
        pairs = [(ranks.get(pair, len(ranks)), i) for i, pair in enumerate(zip(pieces, pieces[1:]))]
        rank, i = min(pairs)
        if rank == len(ranks):
            break
        pieces = pieces[:i] + [pieces[i] + pieces[i + 1]] + pieces[i + 2 :]
    return pieces


def tiny_tokenizer_files() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP-style BPE vocabulary and merges: every byte, then merges that make each known word
    one token. Each word is first encoded with the merges so far, so later merges never change
    how an earlier word encodes."""
    byte_chars = list(_bytes_to_unicode().values())
    tokens = byte_chars + [c + "</w>" for c in byte_chars]
    ranks: dict[tuple[str, str], int] = {}
    for word in _WORDS:
        pieces = _apply_merges(list(word[:-1]) + [word[-1] + "</w>"], ranks)
        while len(pieces) > 1:
            ranks[(pieces[0], pieces[1])] = len(ranks)
            tokens.append(pieces[0] + pieces[1])
            pieces = _apply_merges(pieces, ranks)
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab: dict[str, int] = {}
    for token in tokens:
        vocab.setdefault(token, len(vocab))
    return vocab, list(ranks)


def tiny_tokenizer(pad_token: str = "<|endoftext|>"):
    """SD 1.x pads with the end token; SD 2's and SDXL's second (OpenCLIP) tokenizer pad with "!"."""
    from transformers import CLIPTokenizer

    vocab, merges = tiny_tokenizer_files()
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=TINY_TEXT_LENGTH, pad_token=pad_token)


@dataclass(frozen=True)
class TinySizes:
    """The one place the tiny models' dimensions are stated."""

    text_hidden: int = 32
    text_layers: int = 2
    text_heads: int = 4
    unet_channels: tuple[int, ...] = (32, 64)
    vae_channels: tuple[int, ...] = (16, 32, 32, 32)  # four levels: the 8x latent of SD
    head_dim: int = 8  # SD 1.x: one head size everywhere
    heads_per_block: tuple[int, ...] = (2, 4)  # SD 2 and SDXL: a head count per block
    groups: int = 8
    # SDXL: a wider second text encoder with a projection, and the size/crop ids' embedding width.
    text_hidden_2: int = 48
    text_projection_2: int = 40
    time_ids_embed_dim: int = 8


FAMILY_NAMES = ("sd1", "sd2", "sdxl")
PREDICTION_TYPES = ("epsilon", "v_prediction")
SDXL_TIME_IDS = 6  # original size, crop top-left, target size


def tiny_text_encoder(tokenizer, sizes: TinySizes = TinySizes(), *, family: str = "sd1", second: bool = False):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    hidden = sizes.text_hidden_2 if second else sizes.text_hidden
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=sizes.text_layers,
        num_attention_heads=sizes.text_heads,
        max_position_embeddings=TINY_TEXT_LENGTH,
        projection_dim=sizes.text_projection_2 if second else hidden,
        # OpenAI CLIP (SD 1.x, SDXL's first encoder) uses quick_gelu; OpenCLIP (SD 2, SDXL's second) gelu.
        hidden_act="gelu" if family == "sd2" or second else "quick_gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModelWithProjection(config) if second else CLIPTextModel(config)


def tiny_unet(in_channels: int = 4, sizes: TinySizes = TinySizes(), *, family: str = "sd1"):
    from diffusers import UNet2DConditionModel

    common = dict(
        sample_size=TINY_IMAGE_SIZE // 8,
        in_channels=in_channels,
        out_channels=4,
        block_out_channels=sizes.unet_channels,
        layers_per_block=1,
        norm_num_groups=sizes.groups,
    )
    if family == "sd1":
        return UNet2DConditionModel(
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=sizes.text_hidden,
            attention_head_dim=sizes.head_dim,
            **common,
        )
    if family == "sd2":
        return UNet2DConditionModel(
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=sizes.text_hidden,
            attention_head_dim=sizes.heads_per_block,  # diffusers' historical name for SD 2's head counts
            use_linear_projection=True,
            **common,
        )
    # SDXL: attention only in the deeper blocks, several transformer layers there, and the
    # pooled text embedding plus the six size/crop ids added to the time embedding.
    return UNet2DConditionModel(
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=sizes.text_hidden + sizes.text_hidden_2,
        attention_head_dim=sizes.heads_per_block,
        transformer_layers_per_block=(1, 2),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=sizes.time_ids_embed_dim,
        projection_class_embeddings_input_dim=sizes.time_ids_embed_dim * SDXL_TIME_IDS + sizes.text_projection_2,
        **common,
    )


def tiny_vae(sizes: TinySizes = TinySizes(), *, family: str = "sd1"):
    from diffusers import AutoencoderKL

    levels = len(sizes.vae_channels)
    xl = dict(scaling_factor=0.13025, force_upcast=True) if family == "sdxl" else {}  # SDXL's VAE config
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=sizes.vae_channels,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=sizes.groups,
        sample_size=TINY_IMAGE_SIZE,
        **xl,
    )


def tiny_scheduler(family: str = "sd1", prediction: str = "epsilon"):
    """Each family's released scheduler configuration."""
    from diffusers import DDIMScheduler, EulerDiscreteScheduler, PNDMScheduler

    common = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
                  steps_offset=1, prediction_type=prediction)
    if family == "sd1":
        return PNDMScheduler(set_alpha_to_one=False, skip_prk_steps=True, **common)
    if family == "sd2":
        return DDIMScheduler(set_alpha_to_one=False, clip_sample=False, **common)
    return EulerDiscreteScheduler(timestep_spacing="leading", interpolation_type="linear", **common)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; choose from {', '.join(choices)}.")


def tiny_pipeline(*, family: str = "sd1", inpainting: bool = False, prediction: str = "epsilon", seed: int = 0):
    """A live diffusers pipeline of `family` (txt2img, or inpainting) with deterministic weights."""
    _check_choice("family", family, FAMILY_NAMES)
    _check_choice("prediction type", prediction, PREDICTION_TYPES)
    from .families import FAMILIES

    def seeded(offset: int, build):
        # One seed per component: changing one component's size leaves the others' weights alone.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1000 + offset)
            return build()

    tokenizer = tiny_tokenizer("!" if family == "sd2" else "<|endoftext|>")
    components = dict(
        vae=seeded(1, lambda: tiny_vae(family=family)),
        text_encoder=seeded(2, lambda: tiny_text_encoder(tokenizer, family=family)),
        tokenizer=tokenizer,
        unet=seeded(3, lambda: tiny_unet(in_channels=9 if inpainting else 4, family=family)),
        scheduler=tiny_scheduler(family, prediction),
    )
    if family == "sdxl":
        tokenizer_2 = tiny_tokenizer("!")
        components.update(
            text_encoder_2=seeded(4, lambda: tiny_text_encoder(tokenizer_2, family=family, second=True)),
            tokenizer_2=tokenizer_2,
            add_watermarker=False,
        )
    else:
        components.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    cls = FAMILIES[family].pipeline_class("inpaint" if inpainting else "txt2img")
    pipe = cls(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def write_tiny_pipeline(directory: str | Path, *, family: str = "sd1", inpainting: bool = False,
                        prediction: str = "epsilon", seed: int = 0) -> Path:
    """Write a tiny pipeline as a diffusers folder (safetensors weights, no safety checker)."""
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        raise FileExistsError(
            f"{directory} is not empty; choose a new folder for the tiny pipeline."
        )
    pipe = tiny_pipeline(family=family, inpainting=inpainting, prediction=prediction, seed=seed)
    pipe.save_pretrained(directory, safe_serialization=True)
    return directory
