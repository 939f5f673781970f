"""Tiny random pipelines of the diffusers families kasoku compiles from their recorded calls.

One builder per family, at the sizes of diffusers' own tests (tests/pipelines/<family>/): a transformer of one
or two blocks, a VAE of one to four levels, a text encoder of one or two layers of the architecture the family
ships with (T5, UMT5, Gemma 2, Qwen3, Qwen2.5-VL, GLM, Mistral 3, CLIP, Llama). Nothing is downloaded: the
tokenizers are built here from a small vocabulary, and the Qwen one is a byte-level BPE trained on the prompt
templates these pipelines prepend, so that the fixed count of template tokens they drop (34 for Qwen-Image) is the
real one. `kasoku tiny DIR --family NAME` writes one; the tests run each against diffusers' own pipeline.
"""

from __future__ import annotations

import functools
import string
from collections.abc import Callable
from typing import Any

import torch

from ..architectures.tiny import (
    SCHEDULER_COMMON,
    TINY_SIZES,
    seeded,
    tiny_t5_encoder,
    tiny_text_encoder,
    tiny_tokenizer,
    tiny_unet_common,
    tiny_vae,
)
from ..core.choices import RECORDED_TINY_FAMILIES

__all__ = ["TINY_FAMILIES", "tiny_family_pipeline"]

_WORDS = ("a the of and to in is on with dog cat fox red snow old lighthouse rocky coast dusk oil painting blurry "
          "monkey dance squirrel eating burger photo square bad quality ugly").split()
_CHARS = list(string.ascii_letters + string.digits + string.punctuation)
_QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
_QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
# the prompt templates the Qwen-family pipelines prepend: the BPE learns them, so they drop the tokens they expect
_TEMPLATES = (
    "system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships "
    "of the objects and background:\nuser\nassistant\n",
    "system\nYou are a prompt engineer. Describe the image by detailing the color, shape, size, texture, quantity, "
    "text, spatial relationships of the objects and background:",
    "Describe the image by detailing the color, quantity, text, shape, size, texture, spatial relationships of the "
    "objects and background: ",
    "<think>\n\n</think>\n\n", " ".join(_WORDS))


@functools.cache
def _qwen_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, min_frequency=1, special_tokens=_QWEN_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(list(_TEMPLATES) * 50, trainer)
    return tokenizer.to_str()


def qwen_tokenizer():
    from tokenizers import Tokenizer
    from transformers import Qwen2Tokenizer

    tokenizer = Qwen2Tokenizer(tokenizer_object=Tokenizer.from_str(_qwen_bpe()), eos_token="<|endoftext|>",
                               pad_token="<|endoftext|>", unk_token=None)
    tokenizer.add_special_tokens({"additional_special_tokens": _QWEN_SPECIALS[1:]})
    tokenizer.chat_template = _QWEN_CHAT_TEMPLATE
    tokenizer.model_max_length = 32768
    return tokenizer


def t5_tokenizer(max_length: int = 512):
    from transformers import T5Tokenizer

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [("▁" + w, -5.0) for w in _WORDS] + [("▁", -8.0)]
    vocab += [(c, -10.0) for c in _CHARS] + [("▁" + c, -9.0) for c in _CHARS]
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=0)
    tokenizer.model_max_length = max_length
    return tokenizer


def bert_tokenizer(max_length: int = 77):
    """A WordPiece BertTokenizer (HunyuanDiT's and CompVis' LDM's are bert-base's) over a small vocabulary: known words
    are one token, anything else falls back to letters ("##x" pieces); their pipelines pad to a fixed 77."""
    from transformers import BertTokenizer

    letters = list(string.ascii_lowercase + string.digits + string.punctuation)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_WORDS, *letters, *("##" + c for c in letters)]
    tokenizer = BertTokenizer(vocab={t: i for i, t in enumerate(dict.fromkeys(vocab))}, do_lower_case=True)
    tokenizer.model_max_length = max_length
    return tokenizer


def _piece_vocab(specials: list[str]) -> dict[str, int]:
    vocab = {s: i for i, s in enumerate(specials)}
    for piece in ["▁", "\n", *_CHARS, *(f"<0x{i:02X}>" for i in range(256))]:
        vocab.setdefault(piece, len(vocab))
    return vocab


def gemma_tokenizer(max_length: int = 512):
    from transformers import GemmaTokenizer

    vocab = _piece_vocab(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"])
    tokenizer = GemmaTokenizer(vocab=vocab, merges=[], add_bos_token=True)
    tokenizer.model_max_length = max_length
    return tokenizer


def llama_tokenizer(max_length: int = 512):
    from transformers import LlamaTokenizer

    tokenizer = LlamaTokenizer(vocab=_piece_vocab(["<unk>", "<s>", "</s>"]), merges=[], add_bos_token=True)
    tokenizer.pad_token = "</s>"
    tokenizer.model_max_length = max_length
    return tokenizer


def _t5(tokenizer, umt5: bool = False):
    import transformers as tr

    config_class, model_class = (tr.UMT5Config, tr.UMT5EncoderModel) if umt5 else (tr.T5Config, tr.T5EncoderModel)
    return model_class(config_class(d_model=32, d_ff=37, d_kv=8, num_heads=4, num_layers=2, dropout_rate=0.0,
                                    relative_attention_num_buckets=8, vocab_size=len(tokenizer),
                                    is_encoder_decoder=False))


def _qwen3(tokenizer, model: str = "Qwen3Model", hidden: int = 16, layers: int = 2):
    import transformers as tr

    return getattr(tr, model)(tr.Qwen3Config(hidden_size=hidden, intermediate_size=2 * hidden, head_dim=8,
                                             num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                                             vocab_size=len(tokenizer), max_position_embeddings=1024))


def _qwen25_vl(tokenizer, hidden: int = 16):
    import transformers as tr

    ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    config = tr.Qwen2_5_VLConfig(
        text_config=dict(hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, rope_theta=1e6, vocab_size=len(tokenizer),
                         rope_scaling={"mrope_section": [1, 1, 2] if hidden == 16 else [2, 2, 4],
                                       "rope_type": "default", "type": "default"}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=hidden),
        vocab_size=len(tokenizer), vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2],
        video_token_id=ids[3])
    return tr.Qwen2_5_VLForConditionalGeneration(config)


def _gemma2(tokenizer, head_dim: int = 16, hidden: int = 8, layers: int = 1):
    import transformers as tr

    return tr.Gemma2Model(tr.Gemma2Config(head_dim=head_dim, hidden_size=hidden, intermediate_size=64,
                                          num_attention_heads=2, num_hidden_layers=layers, num_key_value_heads=2,
                                          vocab_size=len(tokenizer), pad_token_id=0, bos_token_id=2, eos_token_id=1))


def _kl_vae(latent_channels: int = 4, levels: int = 2, width: int = 8, **config):
    """An AutoencoderKL of `levels` levels: a VAE scale of 2 ** (levels - 1)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * levels,
                         up_block_types=["UpDecoderBlock2D"] * levels, block_out_channels=[width] * levels,
                         layers_per_block=1, latent_channels=latent_channels, norm_num_groups=min(width, 8),
                         sample_size=32, **config)


def _flux2_vae(latent_channels: int = 1, **config):
    from diffusers import AutoencoderKLFlux2

    return AutoencoderKLFlux2(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(8, 8),
                              down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                              layers_per_block=1, latent_channels=latent_channels, norm_num_groups=8,
                              use_quant_conv=False, use_post_quant_conv=False, **config)


def _qwen_vae():
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                  temperal_downsample=[False, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)


def _built(seed: int, parts: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Each part built from its own seed (the same weights whatever else the pipeline holds), in eval mode."""
    built = {}
    for offset, (name, build) in enumerate(parts.items()):
        part = seeded(seed, offset, build)
        built[name] = part.eval() if isinstance(part, torch.nn.Module) else part
    return built


def pixart_sigma(seed: int):
    import diffusers as d

    tokenizer = t5_tokenizer(300)
    return d.PixArtSigmaPipeline(tokenizer=tokenizer, scheduler=d.DPMSolverMultistepScheduler(), **_built(seed, dict(
        text_encoder=lambda: _t5(tokenizer), vae=lambda: _kl_vae(levels=4), transformer=_pixart_transformer)))


def _pixart_transformer():
    from diffusers import PixArtTransformer2DModel

    return PixArtTransformer2DModel(
        sample_size=32, num_layers=2, patch_size=2, attention_head_dim=8, num_attention_heads=3, caption_channels=32,
        in_channels=4, cross_attention_dim=24, out_channels=8, attention_bias=True, activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6)


def auraflow(seed: int):
    import diffusers as d

    tokenizer = t5_tokenizer()
    return d.AuraFlowPipeline(tokenizer=tokenizer, scheduler=d.FlowMatchEulerDiscreteScheduler(), **_built(seed, dict(
        text_encoder=lambda: _t5(tokenizer, umt5=True), vae=lambda: _kl_vae(levels=4),
        transformer=lambda: d.AuraFlowTransformer2DModel(
            sample_size=32, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
            attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
            out_channels=4, pos_embed_max_size=256))))


def chroma(seed: int):
    import diffusers as d

    tokenizer = t5_tokenizer()
    pipe = d.ChromaPipeline(tokenizer=tokenizer, scheduler=d.FlowMatchEulerDiscreteScheduler(), image_encoder=None,
                            feature_extractor=None, **_built(seed, dict(
                                text_encoder=lambda: _t5(tokenizer),
                                vae=lambda: _kl_vae(levels=4, shift_factor=0.0609, scaling_factor=1.5035),
                                transformer=lambda: d.ChromaTransformer2DModel(
                                    patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                    axes_dims_rope=[4, 4, 8], approximator_hidden_dim=32, approximator_layers=1,
                                    approximator_num_channels=16))))
    # diffusers' ChromaInpaintPipeline reads a config entry Chroma's transformer does not have; its value
    pipe.transformer.register_to_config(guidance_embeds=False)
    return pipe


def sana(seed: int):
    import diffusers as d

    tokenizer = gemma_tokenizer()
    return d.SanaPipeline(tokenizer=tokenizer, scheduler=d.FlowMatchEulerDiscreteScheduler(shift=7.0), **_built(
        seed, dict(text_encoder=lambda: _gemma2(tokenizer), vae=lambda: _dc_ae(),
                   transformer=lambda: d.SanaTransformer2DModel(**_SANA_TRANSFORMER))))


_SANA_TRANSFORMER = dict(patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_attention_heads=2,
                         attention_head_dim=4, num_cross_attention_heads=2, cross_attention_head_dim=4,
                         cross_attention_dim=8, caption_channels=8, sample_size=32)


def _dc_ae():
    from diffusers import AutoencoderDC

    return AutoencoderDC(in_channels=3, latent_channels=4, attention_head_dim=2,
                         encoder_block_types=("ResBlock", "EfficientViTBlock"),
                         decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(8, 8),
                         decoder_block_out_channels=(8, 8), encoder_qkv_multiscales=((), (5,)),
                         decoder_qkv_multiscales=((), (5,)), encoder_layers_per_block=(1, 1),
                         decoder_layers_per_block=[1, 1], downsample_block_type="conv",
                         upsample_block_type="interpolate", decoder_norm_types="rms_norm", decoder_act_fns="silu",
                         scaling_factor=0.41407)


def sana_sprint(seed: int):
    import diffusers as d

    tokenizer = gemma_tokenizer()
    return d.SanaSprintPipeline(tokenizer=tokenizer, scheduler=d.SCMScheduler(), **_built(seed, dict(
        text_encoder=lambda: _gemma2(tokenizer), vae=lambda: _dc_ae(),
        transformer=lambda: d.SanaTransformer2DModel(**_SANA_TRANSFORMER, qk_norm="rms_norm_across_heads",
                                                     guidance_embeds=True))))


def lumina2(seed: int):
    import diffusers as d

    tokenizer = gemma_tokenizer()
    return d.Lumina2Pipeline(tokenizer=tokenizer, scheduler=d.FlowMatchEulerDiscreteScheduler(), **_built(seed, dict(
        text_encoder=lambda: _gemma2(tokenizer, head_dim=4, layers=2),
        vae=lambda: _kl_vae(levels=4, shift_factor=0.0609, scaling_factor=1.5035),
        transformer=lambda: d.Lumina2Transformer2DModel(
            sample_size=4, patch_size=2, in_channels=4, hidden_size=8, num_layers=2, num_attention_heads=1,
            num_kv_heads=1, multiple_of=16, ffn_dim_multiplier=None, norm_eps=1e-5, scaling_factor=1.0,
            axes_dim_rope=[4, 2, 2], cap_feat_dim=8))))


def cogview4(seed: int):
    import diffusers as d
    import transformers as tr

    tokenizer = llama_tokenizer()  # GLM's adds its prefix tokens to every prompt, an empty one too
    tokenizer.padding_side = "left"
    scheduler = d.FlowMatchEulerDiscreteScheduler(base_shift=0.25, max_shift=0.75, base_image_seq_len=256,
                                                  use_dynamic_shifting=True, time_shift_type="linear")
    return d.CogView4Pipeline(tokenizer=tokenizer, scheduler=scheduler, **_built(seed, dict(
        text_encoder=lambda: tr.GlmModel(tr.GlmConfig(hidden_size=32, intermediate_size=8, num_hidden_layers=2,
                                                      num_attention_heads=4, head_dim=8, vocab_size=len(tokenizer),
                                                      pad_token_id=tokenizer.pad_token_id)),
        vae=lambda: _kl_vae(levels=4),
        transformer=lambda: d.CogView4Transformer2DModel(
            patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4, num_attention_heads=4, out_channels=4,
            text_embed_dim=32, time_embed_dim=8, condition_dim=4))))


def z_image(seed: int):
    import diffusers as d

    tokenizer = qwen_tokenizer()

    def transformer():
        model = d.ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1,
            n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=16, rope_theta=256.0, t_scale=1000.0,
            axes_dims=[8, 4, 4], axes_lens=[256, 32, 32])
        with torch.no_grad():  # created with torch.empty: random values would differ from run to run
            model.x_pad_token.normal_()
            model.cap_pad_token.normal_()
        return model

    return d.ZImagePipeline(tokenizer=tokenizer, scheduler=d.FlowMatchEulerDiscreteScheduler(), **_built(seed, dict(
        text_encoder=lambda: _qwen3(tokenizer), vae=lambda: _kl_vae(latent_channels=16, levels=4,
                                                                    scaling_factor=0.3611, shift_factor=0.1159),
        transformer=transformer)))


def flux2_klein(seed: int):
    import diffusers as d

    tokenizer = qwen_tokenizer()
    return d.Flux2KleinPipeline(tokenizer=tokenizer, scheduler=d.FlowMatchEulerDiscreteScheduler(), **_built(
        seed, dict(text_encoder=lambda: _qwen3(tokenizer, "Qwen3ForCausalLM", layers=28), vae=_flux2_vae,
                   transformer=lambda: d.Flux2Transformer2DModel(
                       patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                       num_attention_heads=2, joint_attention_dim=48, timestep_guidance_channels=256,
                       axes_dims_rope=[4, 4, 4, 4], guidance_embeds=False))))


def qwen_image(seed: int):
    import diffusers as d

    tokenizer = qwen_tokenizer()
    return d.QwenImagePipeline(tokenizer=tokenizer, scheduler=d.FlowMatchEulerDiscreteScheduler(), **_built(
        seed, dict(text_encoder=lambda: _qwen25_vl(tokenizer), vae=_qwen_vae,
                   transformer=lambda: d.QwenImageTransformer2DModel(
                       patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                       num_attention_heads=3, joint_attention_dim=16, guidance_embeds=False,
                       axes_dims_rope=(8, 4, 4)))))


def ovis_image(seed: int):
    import diffusers as d

    tokenizer = qwen_tokenizer()
    return d.OvisImagePipeline(tokenizer=tokenizer, scheduler=d.FlowMatchEulerDiscreteScheduler(), **_built(
        seed, dict(text_encoder=lambda: _qwen3(tokenizer, hidden=32),
                   vae=lambda: _kl_vae(levels=4, shift_factor=0.0609, scaling_factor=1.5035),
                   transformer=lambda: d.OvisImageTransformer2DModel(
                       patch_size=1, in_channels=16, out_channels=None, num_layers=1, num_single_layers=1,
                       attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                       axes_dims_rope=(4, 4, 8)))))


def bria(seed: int):
    import diffusers as d

    tokenizer = t5_tokenizer()
    return d.BriaPipeline(tokenizer=tokenizer, scheduler=d.FlowMatchEulerDiscreteScheduler(), image_encoder=None,
                          feature_extractor=None, **_built(seed, dict(
                              text_encoder=lambda: _t5(tokenizer),
                              vae=lambda: _kl_vae(levels=4, shift_factor=0.0, scaling_factor=0.13025),
                              transformer=lambda: d.BriaTransformer2DModel(
                                  patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                  attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=None, axes_dims_rope=[0, 4, 4]))))


def flux2(seed: int):
    import diffusers as d
    import transformers as tr

    tokenizer = qwen_tokenizer()  # any tokenizer with a chat template: Mistral's processor needs torchvision
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")

    def text_encoder():
        text = dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=16, intermediate_size=37,
                    max_position_embeddings=1024, num_attention_heads=4, num_hidden_layers=31, num_key_value_heads=2,
                    rms_norm_eps=1e-5, rope_theta=1e9, sliding_window=None, pad_token_id=tokenizer.pad_token_id,
                    bos_token_id=None, eos_token_id=tokenizer.eos_token_id)
        vision = dict(model_type="pixtral", hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                      intermediate_size=37, image_size=30, patch_size=6, num_channels=3)
        return tr.Mistral3ForConditionalGeneration(tr.Mistral3Config(
            text_config=text, vision_config=vision, image_token_index=image_token, image_seq_length=4,
            vision_feature_layer=-1))

    return d.Flux2Pipeline(tokenizer=tokenizer, scheduler=d.FlowMatchEulerDiscreteScheduler(), **_built(seed, dict(
        text_encoder=text_encoder, vae=_flux2_vae,
        transformer=lambda: d.Flux2Transformer2DModel(
            patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=48, timestep_guidance_channels=256,
            axes_dims_rope=[4, 4, 4, 4]))))


def hunyuan_image(seed: int):
    import diffusers as d
    import transformers as tr

    tokenizer = qwen_tokenizer()
    t5 = tr.T5Config(d_model=32, d_kv=4, d_ff=16, num_layers=2, num_heads=2, relative_attention_num_buckets=8,
                     relative_attention_max_distance=32, vocab_size=384, feed_forward_proj="gated-gelu",
                     dense_act_fn="gelu_new", is_encoder_decoder=False, use_cache=False, tie_word_embeddings=False)
    return d.HunyuanImagePipeline(
        tokenizer=tokenizer, tokenizer_2=tr.ByT5Tokenizer(), scheduler=d.FlowMatchEulerDiscreteScheduler(shift=7.0),
        guider=None, ocr_guider=None, **_built(seed, dict(
            text_encoder=lambda: _qwen25_vl(tokenizer, hidden=32), text_encoder_2=lambda: tr.T5EncoderModel(t5),
            vae=lambda: d.AutoencoderKLHunyuanImage(
                in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 64, 64, 64),
                layers_per_block=1, scaling_factor=0.476986, spatial_compression_ratio=8, sample_size=128),
            transformer=lambda: d.HunyuanImageTransformer2DModel(
                in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=8, num_layers=1,
                num_single_layers=1, num_refiner_layers=1, patch_size=(1, 1), guidance_embeds=False,
                text_embed_dim=32, text_embed_2_dim=32, rope_axes_dim=(4, 4)))))


def krea2(seed: int):
    import diffusers as d
    import transformers as tr

    tokenizer = qwen_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])

    def text_encoder():
        return tr.Qwen3VLModel(tr.Qwen3VLConfig(
            text_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=3, num_attention_heads=2,
                             num_key_value_heads=2, head_dim=8, vocab_size=len(tokenizer)),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16),
            vocab_size=len(tokenizer), image_token_id=ids[0], video_token_id=ids[1], vision_start_token_id=ids[2],
            vision_end_token_id=ids[3]))

    scheduler = d.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                  base_image_seq_len=256, max_image_seq_len=6400)
    return d.Krea2Pipeline(tokenizer=tokenizer, scheduler=scheduler, text_encoder_select_layers=(0, 1, 2),
                           **_built(seed, dict(
                               text_encoder=text_encoder, vae=_qwen_vae,
                               transformer=lambda: d.Krea2Transformer2DModel(
                                   in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=32, timestep_embed_dim=8,
                                   text_hidden_dim=16, num_text_layers=3, text_num_attention_heads=2,
                                   text_num_key_value_heads=1, text_intermediate_size=16,
                                   num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(4, 2, 2),
                                   rope_theta=1000.0))))


def longcat_image(seed: int):
    import diffusers as d

    tokenizer = qwen_tokenizer()
    return d.LongCatImagePipeline(tokenizer=tokenizer, text_processor=None,
                                  scheduler=d.FlowMatchEulerDiscreteScheduler(), **_built(seed, dict(
                                      text_encoder=lambda: _qwen25_vl(tokenizer, hidden=32),
                                      vae=lambda: _kl_vae(latent_channels=16, levels=4, shift_factor=0.0609,
                                                          scaling_factor=1.5035),
                                      transformer=lambda: d.LongCatImageTransformer2DModel(
                                          patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                          pooled_projection_dim=32, axes_dims_rope=[4, 4, 8]))))


def ernie_image(seed: int):
    import diffusers as d
    import transformers as tr

    tokenizer = llama_tokenizer()

    def text_encoder():
        text = dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=16, intermediate_size=37,
                    max_position_embeddings=1024, num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2,
                    sliding_window=None, pad_token_id=2, bos_token_id=1, eos_token_id=2)
        vision = dict(model_type="pixtral", hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                      intermediate_size=37, image_size=30, patch_size=6, num_channels=3)
        return tr.Mistral3Model(tr.Mistral3Config(text_config=text, vision_config=vision, image_token_index=3))

    def vae():
        from diffusers import AutoencoderKLFlux2

        return AutoencoderKLFlux2(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(8, 8),
                                  down_block_types=("DownEncoderBlock2D",) * 2,
                                  up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4,
                                  norm_num_groups=8, use_quant_conv=False, use_post_quant_conv=False)

    return d.ErnieImagePipeline(tokenizer=tokenizer, scheduler=d.FlowMatchEulerDiscreteScheduler(), **_built(
        seed, dict(text_encoder=text_encoder, vae=vae,
                   transformer=lambda: d.ErnieImageTransformer2DModel(
                       hidden_size=16, num_attention_heads=1, num_layers=1, ffn_hidden_size=16, in_channels=16,
                       out_channels=16, patch_size=1, text_in_dim=16, rope_theta=256, rope_axes_dim=(8, 4, 4),
                       eps=1e-6, qk_layernorm=True))))


def cogview3_plus(seed: int):
    import diffusers as d

    tokenizer = t5_tokenizer()
    return d.CogView3PlusPipeline(tokenizer=tokenizer, scheduler=d.CogVideoXDDIMScheduler(), **_built(seed, dict(
        text_encoder=lambda: _t5(tokenizer), vae=lambda: _kl_vae(levels=4),
        transformer=lambda: d.CogView3PlusTransformer2DModel(
            patch_size=2, in_channels=4, num_layers=1, attention_head_dim=4, num_attention_heads=2, out_channels=4,
            text_embed_dim=32, time_embed_dim=8, condition_dim=2, pos_embed_max_size=16, sample_size=8))))


def hunyuan_dit(seed: int):
    import diffusers as d
    import transformers as tr

    tokenizer = bert_tokenizer()
    tokenizer_2 = t5_tokenizer()
    return d.HunyuanDiTPipeline(
        tokenizer=tokenizer, tokenizer_2=tokenizer_2, scheduler=d.DDPMScheduler(), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False, **_built(seed, dict(
            text_encoder=lambda: tr.BertModel(tr.BertConfig(
                hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                vocab_size=len(tokenizer), max_position_embeddings=512)),
            text_encoder_2=lambda: _t5(tokenizer_2), vae=lambda: _kl_vae(levels=4),
            transformer=lambda: d.HunyuanDiT2DModel(
                sample_size=16, num_layers=2, patch_size=2, attention_head_dim=8, num_attention_heads=3,
                in_channels=4, cross_attention_dim=32, cross_attention_dim_t5=32, pooled_projection_dim=16,
                hidden_size=24, activation_fn="gelu-approximate"))))


def kandinsky3(seed: int):
    import diffusers as d

    tokenizer = t5_tokenizer()
    scheduler = d.DDPMScheduler(beta_start=0.00085, beta_end=0.012, steps_offset=1, beta_schedule="squaredcos_cap_v2",
                                clip_sample=True, thresholding=False)
    return d.Kandinsky3Pipeline(tokenizer=tokenizer, scheduler=scheduler, **_built(seed, dict(
        text_encoder=lambda: _t5(tokenizer),
        unet=lambda: d.Kandinsky3UNet(in_channels=4, time_embedding_dim=4, groups=2, attention_head_dim=4,
                                      layers_per_block=3, block_out_channels=(32, 64), cross_attention_dim=4,
                                      encoder_hid_dim=32),
        # four levels, a scale of 8 as the real MoVQ's: the txt2img pipeline sizes its latents for that scale
        movq=lambda: d.VQModel(block_out_channels=[32, 32, 32, 64],
                               down_block_types=["DownEncoderBlock2D"] * 3 + ["AttnDownEncoderBlock2D"],
                               in_channels=3, latent_channels=4, layers_per_block=1, norm_num_groups=8,
                               norm_type="spatial", num_vq_embeddings=12, out_channels=3,
                               up_block_types=["AttnUpDecoderBlock2D"] + ["UpDecoderBlock2D"] * 3, vq_embed_dim=4))))


def pixart_alpha(seed: int):
    import diffusers as d

    tokenizer = t5_tokenizer(120)  # PixArt-alpha's prompts: 120 tokens (Sigma's: 300)
    return d.PixArtAlphaPipeline(tokenizer=tokenizer, scheduler=d.DPMSolverMultistepScheduler(), **_built(seed, dict(
        text_encoder=lambda: _t5(tokenizer), vae=lambda: _kl_vae(levels=4), transformer=_pixart_transformer)))


def lcm(seed: int):
    import diffusers as d

    tokenizer = tiny_tokenizer()
    return d.LatentConsistencyModelPipeline(
        tokenizer=tokenizer, scheduler=d.LCMScheduler(**SCHEDULER_COMMON), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False, **_built(seed, dict(
            text_encoder=lambda: tiny_text_encoder(tokenizer), vae=tiny_vae,
            # the SD 1.x tiny U-Net (kasoku's sd1 family) with the LCM guidance embedding
            unet=lambda: d.UNet2DConditionModel(
                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=TINY_SIZES.text_hidden,
                attention_head_dim=TINY_SIZES.head_dim, time_cond_proj_dim=TINY_SIZES.guidance_embedding,
                **tiny_unet_common(4)))))


def lumina(seed: int):
    import diffusers as d
    import transformers as tr

    tokenizer = gemma_tokenizer()

    def transformer():
        model = d.LuminaNextDiT2DModel(
            sample_size=4, patch_size=2, in_channels=4, hidden_size=16, num_layers=2, num_attention_heads=2,
            num_kv_heads=1, multiple_of=16, ffn_dim_multiplier=None, norm_eps=1e-5, learn_sigma=True, qk_norm=True,
            cross_attention_dim=8, scaling_factor=1.0)
        with torch.no_grad():
            model.pad_token.normal_()  # created with torch.empty: random values would differ from run to run
            for block in model.layers:  # the cross-attention's tanh gates start at zero: the prompt would not count
                block.gate.normal_()
        return model

    # Lumina-Next reads the text encoder's second-to-last hidden states (output_hidden_states=True); the pipeline
    # hard-codes an 8x VAE (vae_scale_factor = 8), so the VAE has four levels
    return d.LuminaPipeline(tokenizer=tokenizer, scheduler=d.FlowMatchEulerDiscreteScheduler(), **_built(seed, dict(
        text_encoder=lambda: tr.GemmaModel(tr.GemmaConfig(
            head_dim=4, hidden_size=8, intermediate_size=37, num_attention_heads=2, num_hidden_layers=2,
            num_key_value_heads=2, vocab_size=len(tokenizer), pad_token_id=0, eos_token_id=1, bos_token_id=2)),
        vae=lambda: _kl_vae(levels=4, scaling_factor=0.13025), transformer=transformer)))


def kandinsky5(seed: int):
    import diffusers as d
    from diffusers.models.transformers.transformer_kandinsky import Kandinsky5Modulation

    tokenizer = qwen_tokenizer()  # a plain Qwen2 tokenizer in the Qwen2VLProcessor's place (called with images=None)
    clip_tokenizer = tiny_tokenizer()

    def transformer():
        model = d.Kandinsky5Transformer3DModel(
            in_visual_dim=16, in_text_dim=32, in_text_dim2=32, time_dim=16, out_visual_dim=16, patch_size=(1, 2, 2),
            model_dim=16, ff_dim=32, num_text_blocks=1, num_visual_blocks=2, axes_dims=(4, 2, 2),
            visual_cond=False, attention_type="regular")
        with torch.no_grad():  # the modulations start at zero (adaLN-zero): every block would be the identity
            for module in model.modules():
                if isinstance(module, Kandinsky5Modulation):
                    module.out_layer.reset_parameters()
        return model

    # the pipeline hard-codes an 8x VAE (vae_scale_factor_spatial = 8): four levels
    pipe = d.Kandinsky5T2IPipeline(
        tokenizer=tokenizer, tokenizer_2=clip_tokenizer, scheduler=d.FlowMatchEulerDiscreteScheduler(shift=7.0),
        **_built(seed, dict(
            text_encoder=lambda: _qwen25_vl(tokenizer, hidden=32),
            text_encoder_2=lambda: tiny_text_encoder(clip_tokenizer),
            vae=lambda: _kl_vae(latent_channels=16, levels=4, scaling_factor=0.3611, shift_factor=0.1159,
                                use_quant_conv=False, use_post_quant_conv=False),
            transformer=transformer)))
    # the pipeline snaps (width, height) to one of its `resolutions` (1024x1024 and six others at the same area):
    # the tiny sizes too, first. An attribute of the instance only: a pipeline saved and loaded again has lost it
    pipe.resolutions = [(32, 32), (64, 64), (64, 32), (32, 64), *pipe.resolutions]
    return pipe


def hidream(seed: int):
    import diffusers as d
    import transformers as tr

    clip_length = 218  # the most the pipeline pads its CLIP prompts to (min(max_sequence_length, 218))

    def clip_tokenizer():
        tokenizer = tiny_tokenizer()
        tokenizer.model_max_length = clip_length
        return tokenizer

    def clip(tokenizer):  # CLIP-L and -G with projections: the pipeline reads their pooled, projected embeddings
        return tr.CLIPTextModelWithProjection(tr.CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=clip_length, projection_dim=32, hidden_act="gelu",
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id))

    tokenizer, tokenizer_2, tokenizer_3, tokenizer_4 = clip_tokenizer(), clip_tokenizer(), t5_tokenizer(), \
        llama_tokenizer()
    # the Llama encoder is called with output_hidden_states=True (and output_attentions=True); the transformer
    # reads the hidden states of its `llama_layers` (here both layers')
    return d.HiDreamImagePipeline(
        tokenizer=tokenizer, tokenizer_2=tokenizer_2, tokenizer_3=tokenizer_3, tokenizer_4=tokenizer_4,
        scheduler=d.FlowMatchEulerDiscreteScheduler(), **_built(seed, dict(
            text_encoder=lambda: clip(tokenizer), text_encoder_2=lambda: clip(tokenizer_2),
            text_encoder_3=lambda: _t5(tokenizer_3),
            text_encoder_4=lambda: tr.LlamaForCausalLM(tr.LlamaConfig(
                hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=len(tokenizer_4), max_position_embeddings=1024,
                bos_token_id=tokenizer_4.bos_token_id, eos_token_id=tokenizer_4.eos_token_id,
                pad_token_id=tokenizer_4.eos_token_id)),
            # the pipeline rescales every size to the area of (128 * VAE scale) ** 2, 4096 latent patches: a
            # one-level VAE (scale 1) gives 128x128 images
            vae=lambda: _kl_vae(latent_channels=16, levels=1, scaling_factor=0.3611, shift_factor=0.1159),
            transformer=lambda: d.HiDreamImageTransformer2DModel(
                patch_size=2, in_channels=16, out_channels=16, num_layers=1, num_single_layers=1,
                attention_head_dim=8, num_attention_heads=4, caption_channels=[32, 16], text_emb_dim=64,
                num_routed_experts=4, num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=(128, 128),
                llama_layers=(0, 1)))))


def bria_fibo(seed: int):
    import diffusers as d
    import transformers as tr

    tokenizer = t5_tokenizer()
    return d.BriaFiboPipeline(tokenizer=tokenizer, scheduler=d.FlowMatchEulerDiscreteScheduler(), **_built(seed, dict(
        # the vocabulary keeps SmolLM3's 128256: an empty (negative) prompt is encoded as the id 128000
        text_encoder=lambda: tr.SmolLM3ForCausalLM(tr.SmolLM3Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1)),
        # Wan 2.2's VAE (patch 2, three downsamples): the 16 the pipeline hard-codes as its VAE scale
        vae=lambda: d.AutoencoderKLWan(
            base_dim=8, decoder_base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, is_residual=True,
            in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
            temperal_downsample=[False, True, True], latents_mean=[0.0] * 16, latents_std=[1.0] * 16),
        transformer=lambda: d.BriaFiboTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=64, text_encoder_dim=32, pooled_projection_dim=None,
            axes_dims_rope=[0, 4, 4]))))


def _qwen3_vl_processor(tokenizer):
    """A Qwen3VLProcessor over `tokenizer`, without its video processor: Qwen3VLVideoProcessor needs torchvision."""
    from unittest import mock

    import transformers as tr

    # ProcessorMixin checks each part's class against transformers' VideoProcessorMixin, which transformers only
    # exports with torchvision installed ("type object 'VIDEO_PROCESSOR_MAPPING' has no attribute '_extra_content'"):
    # the check is skipped while the processor is made. The pipelines only run it on text.
    with mock.patch.object(tr.Qwen3VLProcessor, "check_argument_for_proper_class", lambda self, name, arg: None):
        return tr.Qwen3VLProcessor(image_processor=tr.Qwen2VLImageProcessorPil(patch_size=16), tokenizer=tokenizer,
                                   video_processor=None, chat_template=_QWEN_CHAT_TEMPLATE)


def _qwen3_vl(tokenizer, layers: int, hidden: int = 16, model: str = "Qwen3VLForConditionalGeneration"):
    import transformers as tr

    ids = tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
    return getattr(tr, model)(tr.Qwen3VLConfig(
        text_config=dict(hidden_size=hidden, intermediate_size=16, num_hidden_layers=layers, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=8, vocab_size=len(tokenizer), rope_theta=1e6,
                         rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default"}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=hidden),
        vocab_size=len(tokenizer), image_token_id=ids[0], video_token_id=ids[1], vision_start_token_id=ids[2],
        vision_end_token_id=ids[3]))


def bria_fibo2(seed: int):
    import diffusers as d

    tokenizer = qwen_tokenizer()

    def transformer():
        model = d.BriaFibo2Transformer2DModel(
            in_channels=1, patch_size=2, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2,
            cap_feat_dim=48,  # three text encoder layers of width 16 side by side
            injection_layer_ids=(1,), perceiver_num_layers=1, min_num_gist_tokens=4, max_num_gist_tokens=8,
            gist_step=4, gist_min_text_len=4, gist_max_text_len=16, axes_dims=(4, 6, 6), axes_lens=(16, 16, 16))
        with torch.no_grad():  # the text injection's gate starts at zero (tanh(0)): it would add nothing
            for block in model.layers:
                if hasattr(block, "cross_attn_gate"):
                    block.cross_attn_gate.normal_()
        return model

    return d.BriaFibo2Pipeline(
        processor=_qwen3_vl_processor(tokenizer), scheduler=d.FlowMatchEulerDiscreteScheduler(), **_built(seed, dict(
            # the pipeline reads the hidden states of layers 5 to 35 (TEXT_ENCODER_OUT_LAYERS): 36 layers
            text_encoder=lambda: _qwen3_vl(tokenizer, layers=36), vae=_flux2_vae, transformer=transformer)))


def nucleus_moe_image(seed: int):
    import diffusers as d
    from diffusers.models.transformers.transformer_nucleusmoe_image import SwiGLUExperts

    tokenizer = qwen_tokenizer()

    def transformer():
        model = d.NucleusMoEImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=4,
            joint_attention_dim=16, axes_dims_rope=(8, 4, 4),
            # width 64: a dense block's MLP is int(width * 4 * 2 / 3) // 128 * 128 wide, 128 here, empty under 48
            # block 0 dense, block 1 a mixture of 4 experts (the real model keeps its first 3 and last block dense)
            moe_enabled=True, dense_moe_strategy="leave_first_block_dense", num_experts=4, moe_intermediate_dim=16,
            capacity_factors=[1.0, 1.0])  # each expert takes a quarter of the tokens (the real 8 of 128 a 16th)
        with torch.no_grad():  # the experts' packed weights are created with torch.empty: scaled as nn.Linear's
            for experts in (m for m in model.modules() if isinstance(m, SwiGLUExperts)):
                experts.gate_up_proj.normal_(std=experts.hidden_size ** -0.5)
                experts.down_proj.normal_(std=experts.moe_intermediate_dim ** -0.5)
        return model

    return d.NucleusMoEImagePipeline(
        processor=_qwen3_vl_processor(tokenizer), scheduler=d.FlowMatchEulerDiscreteScheduler(), **_built(seed, dict(
            # the pipeline takes the hidden states of layer -8 (`return_index`): 8 layers, so that one is layer 1
            text_encoder=lambda: _qwen3_vl(tokenizer, layers=8), vae=_qwen_vae, transformer=transformer)))


def ideogram4(seed: int):
    import diffusers as d

    tokenizer = qwen_tokenizer()
    # the pipeline concatenates the hidden states of the 13 layers 0, 3, ..., 33, 35 (QWEN3_VL_ACTIVATION_LAYERS),
    # running the text encoder's decoder layers itself: 36 layers of width 8
    transformer = dict(in_channels=16, num_layers=1, attention_head_dim=8, num_attention_heads=4, intermediate_size=32,
                       adaln_dim=16, llm_features_dim=13 * 8, rope_theta=10_000, mrope_section=(2, 1, 1),
                       norm_eps=1e-5)

    return d.Ideogram4Pipeline(tokenizer=tokenizer, scheduler=d.FlowMatchEulerDiscreteScheduler(), **_built(seed, dict(
        text_encoder=lambda: _qwen3_vl(tokenizer, layers=36, hidden=8, model="Qwen3VLModel"),
        vae=lambda: _flux2_vae(latent_channels=4, patch_size=(2, 2)),  # patchified by 2 into the transformer's 16
        transformer=lambda: d.Ideogram4Transformer2DModel(**transformer),
        unconditional_transformer=lambda: d.Ideogram4Transformer2DModel(**transformer),
        # optional: only `prompt_upsampling=True` uses it, to write a longer prompt with the text encoder
        prompt_enhancer_head=lambda: d.Ideogram4PromptEnhancerHead(hidden_size=8, vocab_size=len(tokenizer)))))


def prx(seed: int):
    # PRXPipeline cleans every prompt with ftfy (a dev dependency of kasoku for it): without ftfy diffusers fails
    # with "NameError: name 'ftfy' is not defined"
    import diffusers as d
    import transformers as tr
    from transformers.models.t5gemma.modeling_t5gemma import T5GemmaEncoder  # not exported at the top level

    tokenizer = gemma_tokenizer(48)  # the pipeline pads every prompt to `tokenizer.model_max_length`

    def text_encoder():
        config = dict(vocab_size=len(tokenizer), hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4, max_position_embeddings=64,
                      layer_types=["full_attention"] * 2, query_pre_attn_scalar=4, sliding_window=4096,
                      rms_norm_eps=1e-6, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                      pad_token_id=0, eos_token_id=1, bos_token_id=2)
        # the encoder half of a T5Gemma: T5GemmaConfig sets its encoder config's `is_decoder` and dropout rates
        config = tr.T5GemmaConfig(encoder=tr.T5GemmaModuleConfig(**config), is_encoder_decoder=False)
        return T5GemmaEncoder(config.encoder)

    def transformer():
        from diffusers.models.transformers.transformer_prx import Modulation

        model = d.PRXTransformer2DModel(patch_size=1, in_channels=4, context_in_dim=8, hidden_size=8, mlp_ratio=2.0,
                                        num_heads=2, depth=2, axes_dim=[2, 2])
        # each block's modulation starts at zero (a trained model's does not): its gates would make every block
        # the identity, and the image independent of the prompt; initialised as any nn.Linear instead
        for modulation in (m for m in model.modules() if isinstance(m, Modulation)):
            modulation.lin.reset_parameters()
        return model

    return d.PRXPipeline(tokenizer=tokenizer, scheduler=d.FlowMatchEulerDiscreteScheduler(), **_built(seed, dict(
        text_encoder=text_encoder, vae=lambda: _kl_vae(levels=4, shift_factor=0.0, scaling_factor=1.0),
        transformer=transformer)))


def _dreamlite_parts(tokenizer):
    import diffusers as d

    return dict(
        text_encoder=lambda: _qwen3_vl(tokenizer, layers=2),  # its last hidden state
        vae=lambda: d.AutoencoderTiny(in_channels=3, out_channels=3, encoder_block_out_channels=(32, 32),
                                      decoder_block_out_channels=(32, 32), num_encoder_blocks=(1, 1),
                                      num_decoder_blocks=(1, 1), latent_channels=4),
        unet=lambda: d.DreamLiteUNetModel(
            sample_size=8, in_channels=4, out_channels=4,
            down_block_types=("DreamLiteCrossAttnNoSelfAttnDownBlock2D", "DreamLiteCrossAttnDownBlock2D"),
            up_block_types=("DreamLiteCrossAttnUpBlock2D", "DreamLiteUpBlock2D"), block_out_channels=(32, 64),
            cross_attention_dim=16, attention_head_dim=8, layers_per_block=1, norm_num_groups=8,
            transformer_layers_per_block=1))


def dreamlite(seed: int):
    import diffusers as d

    # the text-to-image path reads only the tokenizer; the Qwen3-VL processor (edit mode only) needs torchvision
    tokenizer = qwen_tokenizer()
    return d.DreamLitePipeline(tokenizer=tokenizer, processor=None, scheduler=d.FlowMatchEulerDiscreteScheduler(),
                               **_built(seed, _dreamlite_parts(tokenizer)))


def dreamlite_mobile(seed: int):
    import diffusers as d

    # distilled, no CFG: guidance_scale is accepted (default None) and ignored; the Qwen3-VL processor (edit mode
    # only) needs torchvision, so None
    tokenizer = qwen_tokenizer()
    return d.DreamLiteMobilePipeline(tokenizer=tokenizer, processor=None,
                                     scheduler=d.FlowMatchEulerDiscreteScheduler(),
                                     **_built(seed, _dreamlite_parts(tokenizer)))


def ldm(seed: int):
    import diffusers as d
    from diffusers.pipelines.latent_diffusion.pipeline_latent_diffusion import LDMBertConfig, LDMBertModel

    tokenizer = bert_tokenizer()
    # the pipeline makes latents of height // 8 whatever the VAE: a four-level (8x) one
    scheduler = d.DDIMScheduler(**{**SCHEDULER_COMMON, "steps_offset": 0}, clip_sample=False, set_alpha_to_one=False)
    return d.LDMTextToImagePipeline(tokenizer=tokenizer, scheduler=scheduler, **_built(seed, dict(
        bert=lambda: LDMBertModel(LDMBertConfig(
            vocab_size=len(tokenizer), max_position_embeddings=77, encoder_layers=2, encoder_ffn_dim=37,
            encoder_attention_heads=4, head_dim=8, d_model=32, dropout=0.0, pad_token_id=tokenizer.pad_token_id)),
        vqvae=lambda: _kl_vae(levels=4),
        unet=lambda: d.UNet2DConditionModel(
            **tiny_unet_common(4), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32, attention_head_dim=8))))


def deepfloyd_if(seed: int):
    """DeepFloyd IF stage I: a pixel-space U-Net (3 channels in, 6 out: noise and the learned variance range) on
    T5 (v1.1's gated GELU) states of a fixed 77 tokens; no safety checker, feature extractor or watermarker."""
    import diffusers as d

    tokenizer = t5_tokenizer()
    scheduler = d.DDPMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2", beta_start=0.0001,
                                beta_end=0.02, thresholding=True, dynamic_thresholding_ratio=0.95,
                                sample_max_value=1.0, prediction_type="epsilon", variance_type="learned_range")
    return d.IFPipeline(tokenizer=tokenizer, scheduler=scheduler, safety_checker=None, feature_extractor=None,
                        watermarker=None, requires_safety_checker=False, **_built(seed, dict(
                            text_encoder=lambda: tiny_t5_encoder(tokenizer),
                            unet=lambda: d.UNet2DConditionModel(
                                sample_size=32, layers_per_block=1, block_out_channels=[32, 64],
                                down_block_types=["ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"],
                                mid_block_type="UNetMidBlock2DSimpleCrossAttn",
                                up_block_types=["SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"], in_channels=3,
                                out_channels=6, cross_attention_dim=32, encoder_hid_dim=32, attention_head_dim=8,
                                addition_embed_type="text", addition_embed_type_num_heads=2,
                                cross_attention_norm="group_norm", resnet_time_scale_shift="scale_shift",
                                act_fn="gelu"))))


def stable_unclip(seed: int):
    """Stable unCLIP (SD 2.1-unclip with the karlo prior): a CLIP-L text encoder with a projection feeds the
    PriorTransformer (its text_embeds and last_hidden_state), whose image embedding, noised by noise_level and
    normalised by the image normaliser, is the U-Net's class embedding (2 x 32 wide); an OpenCLIP-style text
    encoder (SD 2, pads with "!") feeds its cross-attention."""
    import diffusers as d
    from diffusers.pipelines.stable_diffusion.stable_unclip_image_normalizer import StableUnCLIPImageNormalizer

    prior_tokenizer, tokenizer = tiny_tokenizer(), tiny_tokenizer(pad_token="!")

    def prior():
        model = d.PriorTransformer(num_attention_heads=2, attention_head_dim=12, embedding_dim=32, num_layers=1)
        with torch.no_grad():  # created as zeros: give them live values (clip_mean/clip_std are unused here)
            model.positional_embedding.normal_(std=0.02)
            model.prd_embedding.normal_(std=0.02)
        return model

    return d.StableUnCLIPPipeline(
        prior_tokenizer=prior_tokenizer, tokenizer=tokenizer,
        prior_scheduler=d.DDPMScheduler(variance_type="fixed_small_log", prediction_type="sample",
                                        num_train_timesteps=1000, clip_sample=True, clip_sample_range=5.0,
                                        beta_schedule="squaredcos_cap_v2"),
        image_noising_scheduler=d.DDPMScheduler(beta_schedule="squaredcos_cap_v2"),
        scheduler=d.DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                  prediction_type="v_prediction", set_alpha_to_one=False, steps_offset=1),
        **_built(seed, dict(
            prior_text_encoder=lambda: tiny_text_encoder(prior_tokenizer, projected=True), prior=prior,
            image_normalizer=lambda: StableUnCLIPImageNormalizer(embedding_dim=32),
            text_encoder=lambda: tiny_text_encoder(tokenizer, openclip=True),
            unet=lambda: d.UNet2DConditionModel(
                sample_size=8, in_channels=4, out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), block_out_channels=(32, 64),
                attention_head_dim=(2, 4), class_embed_type="projection", projection_class_embeddings_input_dim=64,
                cross_attention_dim=32, layers_per_block=1, norm_num_groups=8, upcast_attention=True,
                use_linear_projection=True),
            vae=tiny_vae)))


# family name (as `kasoku tiny --family` takes it) -> builder(seed) of its text-to-image pipeline
TINY_FAMILIES: dict[str, Callable[[int], Any]] = {
    "pixart-sigma": pixart_sigma, "auraflow": auraflow, "chroma": chroma, "sana": sana, "sana-sprint": sana_sprint,
    "lumina2": lumina2, "cogview4": cogview4, "z-image": z_image, "flux2-klein": flux2_klein,
    "qwen-image": qwen_image, "ovis-image": ovis_image, "bria": bria, "flux2": flux2, "hunyuan-image": hunyuan_image,
    "krea2": krea2, "longcat-image": longcat_image, "ernie-image": ernie_image, "cogview3-plus": cogview3_plus,
    "hunyuan-dit": hunyuan_dit, "kandinsky3": kandinsky3, "pixart-alpha": pixart_alpha, "lcm": lcm, "lumina": lumina,
    "kandinsky5": kandinsky5, "hidream": hidream, "bria-fibo": bria_fibo, "bria-fibo2": bria_fibo2,
    "nucleus-moe-image": nucleus_moe_image, "ideogram4": ideogram4, "prx": prx, "dreamlite": dreamlite,
    "dreamlite-mobile": dreamlite_mobile, "ldm": ldm, "deepfloyd-if": deepfloyd_if, "stable-unclip": stable_unclip,
}


assert tuple(TINY_FAMILIES) == RECORDED_TINY_FAMILIES, "kasoku.core.choices lists the tiny families for the CLI"


def tiny_family_pipeline(family: str, seed: int = 0):
    """A live tiny pipeline of a family compiled from its recorded calls, with deterministic weights."""
    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(TINY_FAMILIES)}.")
    pipe = TINY_FAMILIES[family](seed)
    pipe.set_progress_bar_config(disable=True)
    return pipe
