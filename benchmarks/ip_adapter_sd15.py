"""IP-Adapter on compiled engines: SD 1.5 at full size with an IP-Adapter Plus and a ViT-H image encoder.

    python benchmarks/ip_adapter_sd15.py [--precisions bf16] [--repeats 5] [--threads 2]

Builds once into benchmarks/.models/ (no weights can be downloaded here), with random weights: SD 1.5's
architecture (full_sd15.py's builder) and an adapter folder as the published ones are laid out: a ViT-H/14
CLIPVisionModelWithProjection (632M parameters, 1024-wide projection) in image_encoder/, and two IP-Adapter Plus
files for SD 1.5 (a resampler of 16 queries, 768 wide, four layers; key/value projections in each of the U-Net's
16 cross-attentions) in diffusers' weight format. Stages, each in its own process (peak memory is per stage):

- torch: diffusers eager fp32: the image encoder on one 224x224 image, the U-Net step at 512x512 with guidance
  (batch 2) plain and with the adapter's image embeddings; its inputs and outputs are saved to check the others.
- kasoku:<precision>: OpenVINO engines (the fastest CPU backend here): `kasoku.compile` of the U-Net, then
  `load_ip_adapter` (cold: the image encoder's engine and the U-Net's with image-prompt inputs, built), the same
  calls timed, max|diff| against torch; the cost of `set_ip_adapter_scale` (median of 200) and of a switch to a
  second adapter of the same kind (`load_ip_adapter`: diffusers' loader, then its weights bound to the same
  engine, median of repeats).

Targets (the issue): the U-Net step with image embeddings within 10% of the plain step; a scale change under
10 ms; an adapter switch under 3 s. Results: benchmarks/results/<date>-<host>-ip_adapter_sd15.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from full_sd15 import MODEL_DIR, _repeat, build_sd15, machine_description, peak_mb  # noqa: E402

ADAPTERS_DIR = HERE / ".models" / "ip-adapter-sd15-random"
WORK = HERE / ".models" / "ip-adapter-work"
RESULTS = HERE / "results"
ADAPTER_FILES = ("ip-adapter-plus_sd15.safetensors", "ip-adapter-plus_sd15-second.safetensors")
PROMPT_SIZE = 512
TARGETS = {"step_overhead": 0.10, "scale_change_s": 0.010, "switch_s": 3.0}


def vit_h():
    """CLIP ViT-H/14 as IP-Adapter's SD 1.5 models use it (laion/CLIP-ViT-H-14's vision tower)."""
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    return CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16, image_size=224,
        patch_size=14, projection_dim=1024, hidden_act="gelu")).eval()


def build_adapters(unet_config_dir: Path = MODEL_DIR) -> None:
    from diffusers import UNet2DConditionModel
    from safetensors.torch import save_file

    from kasoku.architectures.ip_adapter import random_adapter_state_dict

    if (ADAPTERS_DIR / ADAPTER_FILES[-1]).exists():
        return
    torch.manual_seed(0)
    encoder = vit_h()
    encoder.save_pretrained(ADAPTERS_DIR / "image_encoder", safe_serialization=True)
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(unet_config_dir / "unet"))
    for seed, file in enumerate(ADAPTER_FILES):
        torch.manual_seed(seed + 1)
        state = random_adapter_state_dict(unet, encoder.config, "plus", tokens=16, hidden=768)
        save_file({k: v.contiguous() for k, v in state.items()}, str(ADAPTERS_DIR / file))


def prepare() -> None:
    if not (MODEL_DIR / "model_index.json").exists():
        print(f"building SD 1.5 with random weights into {MODEL_DIR}", flush=True)
        build_sd15(MODEL_DIR)
    if not (ADAPTERS_DIR / ADAPTER_FILES[-1]).exists():
        print(f"building the ViT-H image encoder and two IP-Adapter Plus files into {ADAPTERS_DIR}", flush=True)
        build_adapters()


def step_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    latent = PROMPT_SIZE // 8
    return {"sample": torch.randn(2, 4, latent, latent, generator=generator),
            "timestep": torch.tensor([500.0, 500.0]),
            "encoder_hidden_states": torch.randn(2, 77, 768, generator=generator)}


def pixel_values(seed: int = 0) -> torch.Tensor:
    return torch.rand(1, 3, 224, 224, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def load_pipeline():
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline.from_pretrained(MODEL_DIR, safety_checker=None, torch_dtype=torch.float32)


def stage_torch(args) -> dict:
    torch.set_num_threads(args.threads)
    pipe = load_pipeline()
    inputs, pixels = step_inputs(), pixel_values()
    with torch.inference_mode():
        plain_s, plain = _repeat(lambda: pipe.unet(**inputs, return_dict=False)[0], args.repeats)
        pipe.load_ip_adapter(str(ADAPTERS_DIR), subfolder="", weight_name=ADAPTER_FILES[0])
        pipe.set_ip_adapter_scale(0.6)
        encoder_s, hidden = _repeat(lambda: pipe.image_encoder(pixels, output_hidden_states=True).hidden_states[-2],
                                    args.repeats)
        embeds = torch.cat([torch.zeros_like(hidden), hidden])[:, None]  # negative, positive: one image each
        ip_s, ip = _repeat(lambda: pipe.unet(**inputs, added_cond_kwargs={"image_embeds": [embeds]},
                                             return_dict=False)[0], args.repeats)
    WORK.mkdir(parents=True, exist_ok=True)
    torch.save({"plain": plain, "ip": ip, "hidden": hidden}, WORK / "torch-outputs.pt")
    return {"image_encoder_s": statistics.median(encoder_s), "unet_step_s": statistics.median(plain_s),
            "unet_ip_step_s": statistics.median(ip_s), "peak_mb": peak_mb()}


def stage_kasoku(precision: str, args) -> dict:
    import kasoku
    from kasoku.core.cache import Cache

    torch.set_num_threads(args.threads)
    expected = torch.load(WORK / "torch-outputs.pt")
    cache = Cache(WORK / f"cache-{precision}")
    start = time.perf_counter()
    pipe = kasoku.compile(load_pipeline(), "openvino", precision=precision, components=("unet",),
                          cache=cache, threads=args.threads)
    compile_s = time.perf_counter() - start
    inputs, pixels = step_inputs(), pixel_values()
    start = time.perf_counter()
    pipe.load_ip_adapter(str(ADAPTERS_DIR), subfolder="", weight_name=ADAPTER_FILES[0])
    load_cold_s = time.perf_counter() - start
    pipe.set_ip_adapter_scale(0.6)
    from kasoku.architectures.ip_adapter import scales_of

    encoder = lambda: pipe.engines["image_encoder"].run({"pixel_values": pixels})  # noqa: E731
    encoder_s, encoded = _repeat(encoder, args.repeats + 1)
    hidden = encoded["penultimate_hidden_states"]
    embeds = torch.cat([torch.zeros_like(hidden), hidden])[:, None]
    ip_inputs = {**inputs, "ip_embeds_0": embeds, "ip_scale": scales_of(pipe.model.pipe.unet)}
    plain_engine, ip_engine = pipe._base_engines["unet"], pipe.engines["unet"]
    samples: dict[str, list[float]] = {"plain": [], "ip": []}
    outputs: dict[str, torch.Tensor] = {}
    for _ in range(args.repeats + 1):  # alternately, so that the machine's drift falls on both alike
        for name, engine, feeds in (("plain", plain_engine, inputs), ("ip", ip_engine, ip_inputs)):
            start = time.perf_counter()
            outputs[name] = engine.run(feeds)["out_sample"]
            samples[name].append(time.perf_counter() - start)
    (plain_s, plain), (ip_s, ip) = (samples["plain"], outputs["plain"]), (samples["ip"], outputs["ip"])
    scale_s, _ = _repeat(lambda: (pipe.set_ip_adapter_scale(0.5), scales_of(pipe.model.pipe.unet)), 200)
    switch_s = []
    diffusers_s = []  # of which diffusers' own load_ip_adapter (the file read, the processors made)
    torch_pipe = pipe.model.pipe
    loader = type(torch_pipe).load_ip_adapter

    def timed_loader(*given, **kwargs):
        start = time.perf_counter()
        loader(torch_pipe, *given, **kwargs)
        diffusers_s.append(time.perf_counter() - start)

    torch_pipe.load_ip_adapter = timed_loader
    for index in range(args.repeats):
        start = time.perf_counter()
        pipe.load_ip_adapter(str(ADAPTERS_DIR), subfolder="", weight_name=ADAPTER_FILES[(index + 1) % 2])
        switch_s.append(time.perf_counter() - start)
    entries = len(list(cache.list()))

    def max_diff(a, b) -> float:
        return float((a.float() - b.float()).abs().max())

    plain_median, ip_median = statistics.median(plain_s[1:]), statistics.median(ip_s[1:])
    return {"compile_s": compile_s, "load_ip_adapter_cold_s": load_cold_s,
            "image_encoder_s": statistics.median(encoder_s[1:]), "unet_step_s": plain_median,
            "unet_ip_step_s": ip_median, "ip_step_overhead": ip_median / plain_median - 1,
            "scale_change_s": statistics.median(scale_s), "switch_s": statistics.median(switch_s),
            "switch_samples_s": switch_s, "diffusers_load_ip_adapter_s": statistics.median(diffusers_s),
            "cache_entries_after_switches": entries,
            "max_diff": {"unet": max_diff(plain, expected["plain"]), "unet_ip": max_diff(ip, expected["ip"]),
                         "image_encoder": max_diff(hidden, expected["hidden"])},
            "peak_mb": peak_mb()}


def run_stage(stage: str, args) -> dict:
    """A stage in its own process (no two copies of the weights share the memory)."""
    command = [sys.executable, __file__, "--stage", stage, "--repeats", str(args.repeats), "--threads",
               str(args.threads)]
    out = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_results(results: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"{results['machine']['date']}-{results['machine']['host']}-ip_adapter_sd15"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    torch_row = results["stages"]["torch"]
    lines = [f"# IP-Adapter on SD 1.5 ({results['machine']['date']})", "",
             f"CPU: {results['machine']['cpu']} ({results['machine']['threads']} threads), flags: "
             f"{' '.join(results['machine']['flags'])}; torch {results['machine']['torch']}.", "",
             "SD 1.5 (860M U-Net) at 512x512 with guidance (batch 2), IP-Adapter Plus (16 tokens) with a ViT-H/14 "
             "image encoder on one 224x224 image; random weights. Seconds are medians.", "",
             "| contender | image encoder s | U-Net step s | U-Net step + image prompt s | overhead | "
             "scale change ms | adapter switch s | max abs diff (U-Net + image prompt) | peak MB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
             f"| torch eager fp32 | {torch_row['image_encoder_s']:.3f} | {torch_row['unet_step_s']:.3f} | "
             f"{torch_row['unet_ip_step_s']:.3f} | "
             f"{torch_row['unet_ip_step_s'] / torch_row['unet_step_s'] - 1:+.1%} | "
             f"| | | {torch_row['peak_mb']:.0f} |"]
    for name, row in results["stages"].items():
        if name == "torch":
            continue
        lines.append(f"| {name} (OpenVINO) | {row['image_encoder_s']:.3f} | {row['unet_step_s']:.3f} | "
                     f"{row['unet_ip_step_s']:.3f} | {row['ip_step_overhead']:+.1%} | "
                     f"{row['scale_change_s'] * 1e3:.2f} | "
                     f"{row['switch_s']:.2f} | {row['max_diff']['unet_ip']:.2e} | {row['peak_mb']:.0f} |")
    lines += ["", "Targets: overhead <= +10%, scale change < 10 ms, adapter switch < 3 s. The first `kasoku.compile` "
              "of the U-Net and `load_ip_adapter` (the image encoder's and the U-Net's engines built, or loaded where "
              "the benchmark's cache holds them): " + ", ".join(
                  f"{n} {r['compile_s']:.0f} s and {r['load_ip_adapter_cold_s']:.0f} s"
                  for n, r in results["stages"].items() if n != "torch"),
              "", "Command: `python benchmarks/ip_adapter_sd15.py " + " ".join(results["argv"]) + "`"]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return stem.with_suffix(".md")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", default="bf16", help="kasoku's OpenVINO precisions (default bf16)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stage == "prepare":
        prepare()
        print(json.dumps({}))
        return 0
    if args.stage is not None:
        result = stage_torch(args) if args.stage == "torch" else stage_kasoku(args.stage.split(":")[1], args)
        print(json.dumps(result))
        return 0
    run_stage("prepare", args)  # in its own process: the built weights do not stay in this one's memory
    results = {"machine": machine_description(args.threads), "argv": list(argv or sys.argv[1:]), "stages": {}}
    for stage in ["torch", *(f"kasoku:{p}" for p in args.precisions.split(","))]:
        print(f"stage {stage}", flush=True)
        results["stages"][stage.replace("kasoku:", "kasoku ")] = run_stage(stage, args)
        print(json.dumps(results["stages"][stage.replace("kasoku:", "kasoku ")]), flush=True)
    print(f"wrote {write_results(results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
