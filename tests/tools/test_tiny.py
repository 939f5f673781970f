"""The built-in tiny pipeline is a real diffusers SD 1.x pipeline that loads offline."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import StableDiffusionInpaintPipeline, StableDiffusionPipeline

from kasoku.cli import main
from kasoku.tools.tiny import write_tiny_pipeline


def test_folder_layout_and_offline_load(tiny_dir):
    for part in ("unet", "vae", "text_encoder"):
        assert list((tiny_dir / part).glob("*.safetensors")), part
    assert not list(tiny_dir.rglob("*.bin"))
    index = json.loads((tiny_dir / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline"
    assert index["safety_checker"] == [None, None]
    pipe = StableDiffusionPipeline.from_pretrained(tiny_dir)
    image = pipe("a photo of a cat", num_inference_steps=2, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 64, 64, 3)
    assert 0.0 < image.std()


def test_exercises_the_full_size_ops(tiny_pipe):
    unet = tiny_pipe.unet
    blocks = [type(b).__name__ for b in unet.down_blocks] + [type(b).__name__ for b in unet.up_blocks]
    assert "CrossAttnDownBlock2D" in blocks and "DownBlock2D" in blocks and "CrossAttnUpBlock2D" in blocks
    names = {type(m).__name__ for m in unet.modules()} | {type(m).__name__ for m in tiny_pipe.vae.modules()}
    assert {"GroupNorm", "Downsample2D", "Upsample2D", "TimestepEmbedding", "Attention"} <= names
    attn = [m for m in unet.modules() if type(m).__name__ == "Attention"]
    assert any(a.is_cross_attention for a in attn) and any(not a.is_cross_attention for a in attn)
    assert tiny_pipe.vae_scale_factor == 8


def test_tokenizer_knows_prompt_words(tiny_pipe):
    ids = tiny_pipe.tokenizer("a photo of an astronaut").input_ids
    assert len(ids) == 7  # bos, five words as whole tokens, eos
    assert tiny_pipe.tokenizer.model_max_length == 77


def test_seed_changes_weights_deterministically(tmp_path):
    a = write_tiny_pipeline(tmp_path / "a", seed=1)
    b = write_tiny_pipeline(tmp_path / "b", seed=1)
    c = write_tiny_pipeline(tmp_path / "c", seed=2)
    read = lambda d: (d / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()  # noqa: E731
    assert read(a) == read(b) != read(c)


def test_cli_inpainting_variant(tmp_path, capsys):
    assert main(["tiny", str(tmp_path / "inpaint"), "--inpainting", "--seed", "5"]) == 0
    assert "inpainting" in capsys.readouterr().out
    pipe = StableDiffusionInpaintPipeline.from_pretrained(tmp_path / "inpaint")
    assert pipe.unet.config.in_channels == 9


def test_refuses_a_non_empty_folder(tiny_dir):
    with pytest.raises(FileExistsError, match="not empty"):
        write_tiny_pipeline(tiny_dir)
