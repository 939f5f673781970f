"""The `full` workload of BENCHMARK.md: Stable Diffusion 1.5 at full size, random weights, fp32.

    python benchmarks/full_sd15.py [--repeats 3] [--steps 4] [--threads 2]

Builds the SD 1.5 architecture (CLIP ViT-L text encoder, the 860M-parameter U-Net, the VAE)
with random weights once into benchmarks/.models/ (no weights can be downloaded here), then
runs `kasoku.bench` on it: text encoder 2x77, U-Net batch 2 on a 64x64 latent, VAE decoder
1x4x64x64, each against torch eager, torch.compile, ONNX Runtime and OpenVINO with their own
defaults on the same ONNX file, and kasoku's onnxruntime and openvino engines; then one 512x512
image with 4 steps and guidance against diffusers. Writes benchmarks/results/<date>-<machine>.md
and .json. Minutes to an hour on 2 cores; not run by CI.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
MODEL_DIR = HERE / ".models" / "sd15-random"
RESULTS = HERE / "results"
CONTENDERS = ["onnxruntime", "openvino", "onnxruntime-defaults", "openvino-defaults", "torch.compile"]


def build_sd15(directory: Path, seed: int = 0) -> Path:
    """SD 1.5's architecture and scheduler at full size with random weights, as a diffusers folder."""
    from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from kasoku.tiny import tiny_scheduler, tiny_tokenizer

    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer()  # a real CLIP BPE tokenizer; ids fall inside the full vocabulary
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    ))
    unet = UNet2DConditionModel(
        sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768, attention_head_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    )
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, sample_size=512,
        block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
    )
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=tiny_scheduler(), safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.save_pretrained(directory, safe_serialization=True)
    return directory


def machine_description(threads: int) -> dict:
    from kasoku.backends.base import cpu_name

    return {"host": socket.gethostname(), "cpu": cpu_name(), "threads": threads, "python": platform.python_version(),
            "platform": platform.platform()}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    args = parser.parse_args(argv)

    from kasoku.bench import bench, markdown, plot
    from kasoku.components import ImageShape, ShapeProfile
    from kasoku.console import console, quiet_third_party_logs

    quiet_third_party_logs()
    if not (MODEL_DIR / "model_index.json").exists():
        console.log(f"building SD 1.5 with random weights into {MODEL_DIR}")
        build_sd15(MODEL_DIR)
    # One 512x512 image; the U-Net serves batch 1 (no guidance) to 2 (guidance).
    profile = ShapeProfile.from_ranges((1, 1, 1), (512, 512, 512), (512, 512, 512), 64)
    report = bench(MODEL_DIR, args.contenders.split(","), steps=args.steps, repeats=args.repeats,
                   shape=ImageShape(1, 512, 512), profile=profile,
                   components=["text_encoder", "unet", "vae_decoder"], threads=args.threads,
                   log=lambda message: console.log(message, markup=False))
    report.machine.update(machine_description(args.threads))
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"{report.date}-{report.machine['host']}-full_sd15"
    stem.with_suffix(".md").write_text(markdown(report) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(report.to_dict(), indent=2, default=str))
    plot(report, stem.with_suffix(".png"))
    console.print(markdown(report), markup=False)
    console.print(f"wrote {stem}.md, .json and .png")
    return stem


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
