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

from ..architectures.tiny import seeded
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


def _flux2_vae():
    from diffusers import AutoencoderKLFlux2

    return AutoencoderKLFlux2(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(8, 8),
                              down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                              layers_per_block=1, latent_channels=1, norm_num_groups=8, use_quant_conv=False,
                              use_post_quant_conv=False)


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
        text_encoder=lambda: _t5(tokenizer), vae=lambda: _kl_vae(levels=4),
        transformer=lambda: d.PixArtTransformer2DModel(
            sample_size=32, num_layers=2, patch_size=2, attention_head_dim=8, num_attention_heads=3,
            caption_channels=32, in_channels=4, cross_attention_dim=24, out_channels=8, attention_bias=True,
            activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
            norm_elementwise_affine=False, norm_eps=1e-6))))


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

    bert_tokenizer = tr.BertTokenizer(vocab={t: i for i, t in enumerate(
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_WORDS, *_CHARS])})
    bert_tokenizer.model_max_length = 77
    tokenizer_2 = t5_tokenizer()
    return d.HunyuanDiTPipeline(
        tokenizer=bert_tokenizer, tokenizer_2=tokenizer_2, scheduler=d.DDPMScheduler(), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False, **_built(seed, dict(
            text_encoder=lambda: tr.BertModel(tr.BertConfig(
                hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                vocab_size=len(bert_tokenizer), max_position_embeddings=512)),
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
        movq=lambda: d.VQModel(block_out_channels=[32, 64], down_block_types=["DownEncoderBlock2D",
                                                                              "AttnDownEncoderBlock2D"],
                               in_channels=3, latent_channels=4, layers_per_block=1, norm_num_groups=8,
                               norm_type="spatial", num_vq_embeddings=12, out_channels=3,
                               up_block_types=["AttnUpDecoderBlock2D", "UpDecoderBlock2D"], vq_embed_dim=4))))


# family name (as `kasoku tiny --family` takes it) -> builder(seed) of its text-to-image pipeline
TINY_FAMILIES: dict[str, Callable[[int], Any]] = {
    "pixart-sigma": pixart_sigma, "auraflow": auraflow, "chroma": chroma, "sana": sana, "sana-sprint": sana_sprint,
    "lumina2": lumina2, "cogview4": cogview4, "z-image": z_image, "flux2-klein": flux2_klein,
    "qwen-image": qwen_image, "ovis-image": ovis_image, "bria": bria, "flux2": flux2, "hunyuan-image": hunyuan_image,
    "krea2": krea2, "longcat-image": longcat_image, "ernie-image": ernie_image, "cogview3-plus": cogview3_plus,
    "hunyuan-dit": hunyuan_dit, "kandinsky3": kandinsky3,
}


assert tuple(TINY_FAMILIES) == RECORDED_TINY_FAMILIES, "kasoku.core.choices lists the tiny families for the CLI"


def tiny_family_pipeline(family: str, seed: int = 0):
    """A live tiny pipeline of a family compiled from its recorded calls, with deterministic weights."""
    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(TINY_FAMILIES)}.")
    pipe = TINY_FAMILIES[family](seed)
    pipe.set_progress_bar_config(disable=True)
    return pipe
