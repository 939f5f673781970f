"""The built-in tiny Stable Diffusion pipeline.

The real SD 1.x architecture (cross-attention U-Net, CLIP text encoder, AutoencoderKL with an
8x latent, PNDM scheduler) at a size that exports and runs in seconds on two CPU cores, with
deterministic weights from a seed and a CLIP BPE tokenizer built from a small generated
vocabulary. Nothing is downloaded: this is what the tests, the demo and the examples run on.
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


def tiny_tokenizer():
    from transformers import CLIPTokenizer

    vocab, merges = tiny_tokenizer_files()
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=TINY_TEXT_LENGTH)


@dataclass(frozen=True)
class TinySizes:
    """The one place the tiny model's dimensions are stated."""

    text_hidden: int = 32
    text_layers: int = 2
    text_heads: int = 4
    unet_channels: tuple[int, ...] = (32, 64)
    vae_channels: tuple[int, ...] = (16, 32, 32, 32)  # four levels: the 8x latent of SD
    head_dim: int = 8
    groups: int = 8


def tiny_text_encoder(tokenizer, sizes: TinySizes = TinySizes()):
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=sizes.text_hidden,
        intermediate_size=sizes.text_hidden * 2,
        num_hidden_layers=sizes.text_layers,
        num_attention_heads=sizes.text_heads,
        max_position_embeddings=TINY_TEXT_LENGTH,
        projection_dim=sizes.text_hidden,
        hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModel(config)


def tiny_unet(in_channels: int = 4, sizes: TinySizes = TinySizes()):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=TINY_IMAGE_SIZE // 8,
        in_channels=in_channels,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=sizes.unet_channels,
        layers_per_block=1,
        cross_attention_dim=sizes.text_hidden,
        attention_head_dim=sizes.head_dim,
        norm_num_groups=sizes.groups,
    )


def tiny_vae(sizes: TinySizes = TinySizes()):
    from diffusers import AutoencoderKL

    levels = len(sizes.vae_channels)
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
    )


def tiny_scheduler():
    from diffusers import PNDMScheduler

    # Stable Diffusion 1.x's scheduler configuration.
    return PNDMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        num_train_timesteps=1000,
        set_alpha_to_one=False,
        skip_prk_steps=True,
        steps_offset=1,
    )


def tiny_pipeline(*, inpainting: bool = False, seed: int = 0):
    """A live diffusers Stable Diffusion (or inpainting) pipeline with deterministic weights."""
    from diffusers import StableDiffusionInpaintPipeline, StableDiffusionPipeline

    def seeded(offset: int, build):
        # One seed per component: changing one component's size leaves the others' weights alone.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1000 + offset)
            return build()

    tokenizer = tiny_tokenizer()
    components = dict(
        vae=seeded(1, tiny_vae),
        text_encoder=seeded(2, lambda: tiny_text_encoder(tokenizer)),
        tokenizer=tokenizer,
        unet=seeded(3, lambda: tiny_unet(in_channels=9 if inpainting else 4)),
        scheduler=tiny_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    cls = StableDiffusionInpaintPipeline if inpainting else StableDiffusionPipeline
    pipe = cls(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def write_tiny_pipeline(directory: str | Path, *, inpainting: bool = False, seed: int = 0) -> Path:
    """Write the tiny pipeline as a diffusers folder (safetensors weights, no safety checker)."""
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        raise FileExistsError(
            f"{directory} is not empty; choose a new folder for the tiny pipeline."
        )
    pipe = tiny_pipeline(inpainting=inpainting, seed=seed)
    pipe.save_pretrained(directory, safe_serialization=True)
    return directory
