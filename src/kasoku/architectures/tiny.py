"""The building blocks of the built-in tiny models: one place for their sizes, a CLIP BPE tokenizer built from
a small generated vocabulary, the text encoder, the AutoencoderKL with an 8x latent, the U-Net's common
settings, a ControlNet with live residuals, and seeded construction. Each family composes its own tiny
pipeline from these (``Family.tiny_pipeline``); nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from ..core.choices import PREDICTION_TYPES  # noqa: F401 - read here by the tiny builders

T = TypeVar("T")

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
    guidance_embedding: int = 32  # an LCM U-Net's time_cond_proj_dim
    vae_channels: tuple[int, ...] = (16, 32, 32, 32)  # four levels: the 8x latent of SD
    head_dim: int = 8  # SD 1.x: one head size everywhere
    heads_per_block: tuple[int, ...] = (2, 4)  # SD 2 and SDXL: a head count per block
    groups: int = 8
    # SDXL: a wider second text encoder with a projection, and the size/crop ids' embedding width.
    text_hidden_2: int = 48
    text_projection_2: int = 40
    time_ids_embed_dim: int = 8
    # ControlNet: the conditioning image's embedding, one level per halving down to the 8x latent.
    controlnet_embedding: tuple[int, ...] = (8, 8, 16, 16)
    # T5 (SD3, Flux): its width, heads and vocabulary's words; the diffusion transformers' heads and layers.
    t5_hidden: int = 32
    t5_heads: int = 4
    transformer_heads: int = 2
    transformer_head_dim: int = 8


TINY_SIZES = TinySizes()
SCHEDULER_COMMON = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
                        steps_offset=1)


def seeded(seed: int, offset: int, build: Callable[[], T]) -> T:
    """`build()` under its own seed: changing one component's size leaves the others' weights alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1000 + offset)
        return build()


def tiny_text_encoder(tokenizer, sizes: TinySizes = TINY_SIZES, *, openclip: bool = False, second: bool = False,
                      projected: bool = False):
    """A CLIP text encoder; `openclip` gives OpenCLIP's gelu (SD 2, SDXL's second), else quick_gelu;
    `second` the wider SDXL second encoder with a projection; `projected` the first one with a projection of
    its own width (SD3's CLIP-L)."""
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
        hidden_act="gelu" if openclip else "quick_gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModelWithProjection(config) if second or projected else CLIPTextModel(config)


def tiny_unet_common(in_channels: int, sizes: TinySizes = TINY_SIZES) -> dict:
    """What every family's tiny U-Net shares."""
    return dict(
        sample_size=TINY_IMAGE_SIZE // 8,
        in_channels=in_channels,
        out_channels=4,
        block_out_channels=sizes.unet_channels,
        layers_per_block=1,
        norm_num_groups=sizes.groups,
    )


def tiny_vae(sizes: TinySizes = TINY_SIZES, *, latent_channels: int = 4, **config):
    """An AutoencoderKL with four levels (SD's 8x latent) and `latent_channels` (16 for SD3 and Flux); `config`
    adds family settings (SDXL's, SD3's shift factor)."""
    from diffusers import AutoencoderKL

    levels = len(sizes.vae_channels)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=sizes.vae_channels,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=sizes.groups,
        sample_size=TINY_IMAGE_SIZE,
        **config,
    )


def tiny_autoencoder_tiny(sizes: TinySizes = TINY_SIZES, *, latent_channels: int = 4):
    """An AutoencoderTiny (TAESD's layout: four levels, the 8x latent) of `latent_channels` (16: TAESD3, TAEF1),
    one block per level."""
    from diffusers import AutoencoderTiny

    levels = len(sizes.vae_channels)
    return AutoencoderTiny(encoder_block_out_channels=(sizes.vae_channels[0],) * levels,
                           decoder_block_out_channels=(sizes.vae_channels[0],) * levels,
                           num_encoder_blocks=(1,) * levels, num_decoder_blocks=(1,) * levels,
                           latent_channels=latent_channels)


def random_controlnet(unet, conditioning_channels: tuple[int, ...] = (16, 32, 96, 256)):
    """A ControlNet for `unet` (diffusers' ControlNetModel.from_unet layout; its default conditioning
    embedding is SD 1.5's ControlNets') with random weights everywhere.

    A trained ControlNet starts with its output convolutions at zero (diffusers' zero_module), which makes
    every residual zero; here they get the usual random initialisation, so that the control image changes
    the image and a test of it can fail."""
    from diffusers import ControlNetModel

    controlnet = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=conditioning_channels,
                                           load_weights_from_unet=False)
    for layer in (controlnet.controlnet_cond_embedding.conv_out, *controlnet.controlnet_down_blocks,
                  controlnet.controlnet_mid_block):
        layer.reset_parameters()
    return controlnet.eval()


def tiny_controlnet(unet, sizes: TinySizes = TINY_SIZES):
    """A tiny ControlNet for a tiny U-Net (see :func:`random_controlnet`)."""
    return random_controlnet(unet, sizes.controlnet_embedding)


# The width of the text states the tiny diffusion transformers attend to: SD3's two CLIP encoders side by side,
# and T5 (SD3's and Flux's) as wide.
TINY_JOINT_WIDTH = TINY_SIZES.text_hidden + TINY_SIZES.text_hidden_2


def tiny_flow_vae():
    """The tiny SD3 and Flux VAE: 16 latent channels, a shift factor (SD3's values), no quant convolutions."""
    return tiny_vae(latent_channels=16, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
                    use_post_quant_conv=False)


def tiny_t5_tokenizer(max_length: int = 512):
    """A T5 tokenizer (SentencePiece Unigram, as T5's is) over the tiny vocabulary: each known word is one
    piece, anything else spells out in letters; eos "</s>", pad "<pad>", no sentinel tokens."""
    from transformers import T5Tokenizer

    letters = sorted(set("".join(_WORDS)) | set("abcdefghijklmnopqrstuvwxyz0123456789"))
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [("\u2581" + word, -1.0 - index * 0.01) for index, word in enumerate(dict.fromkeys(_WORDS))]
    vocab += [("\u2581", -3.0)] + [(letter, -5.0) for letter in letters]
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=0)
    tokenizer.model_max_length = max_length
    return tokenizer


def tiny_t5_encoder(tokenizer, hidden: int | None = None, sizes: TinySizes = TINY_SIZES):
    """A T5 encoder (T5 v1.1's gated GELU) `hidden` wide (default: TINY_SIZES.t5_hidden)."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=len(tokenizer), d_model=hidden or sizes.t5_hidden, d_kv=8,
                                   d_ff=2 * (hidden or sizes.t5_hidden), num_layers=2, num_heads=sizes.t5_heads,
                                   relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", dropout_rate=0.0,
                                   is_encoder_decoder=False, use_cache=False, pad_token_id=tokenizer.pad_token_id,
                                   eos_token_id=tokenizer.eos_token_id))


def flow_match_scheduler(**config):
    """diffusers' FlowMatchEulerDiscreteScheduler (SD3's and Flux's), with `config` (shift, dynamic shifting)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**config)


def tiny_image_encoder(sizes: TinySizes = TINY_SIZES):
    """A CLIPVisionModelWithProjection at CLIP's 224x224 input (so diffusers' default CLIPImageProcessor feeds it)
    with 32x32 patches: 50 tokens."""
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    hidden = sizes.text_hidden
    return CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=sizes.text_layers,
        num_attention_heads=sizes.text_heads, image_size=224, patch_size=32, projection_dim=sizes.text_projection_2))


def tiny_siglip_encoder(sizes: TinySizes = TINY_SIZES):
    """A SiglipVisionModel (SD3's IP-Adapter image encoder) on 64x64 images with 16x16 patches: 16 tokens."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    hidden = sizes.text_hidden
    return SiglipVisionModel(SiglipVisionConfig(
        hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=sizes.text_layers,
        num_attention_heads=sizes.text_heads, image_size=64, patch_size=16))
