"""stable-diffusion.cpp (its Python bindings, stable-diffusion-cpp-python) on Flux.2 klein's folder, in its own
virtual environment (a C++ build of its source distribution: the registry has no wheel for it): run by
benchmarks/full_modern_image.py with that environment's python, never imported by kasoku.

    <venv>/bin/python benchmarks/peer_sdcpp.py --model DIR --work DIR --out FILE.json [--weights default|q8_0]
        [--prompt TEXT] [--size 512] [--steps 4] [--repeats 2] [--threads 2]

stable-diffusion.cpp reads single files, not a diffusers folder. Its Qwen3 text encoder and its VAE it reads as the
folder has them (transformers' names; diffusers' VAE names it converts itself), but it recognises Flux.2 only by
Black Forest Labs' tensor names and converts only Flux.1's diffusers names: the transformer is written once, under
`--work`, with BFL's names (q, k and v joined into one projection, the output modulation's halves swapped from
diffusers' (scale, shift) to BFL's (shift, scale)), byte for byte, in its own dtype. `--weights q8_0` has
stable-diffusion.cpp quantize the weights to its 8-bit blocks as it loads them (its `wtype`); `default` runs them as
the files hold them (bf16 here). It takes a seed, not latents: its image starts from its own noise. The seconds of each
stage are read from its log ("... completed, taking ..."). The last image is saved beside the JSON (FILE.npy).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import json
import re
import struct
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_modern import add_call_arguments, timed_calls  # noqa: E402 - the newest families' peers' arguments and timing loop
from peer_run import peak_mb  # noqa: E402

SDCPP_TRANSFORMER = "flux-2-klein-bfl.safetensors"
STAGE_OF_LOG = {"get_learned_condition": "text_encoder", "sampling": "transformer", "decode_first_stage": "vae_decoder"}


# ---- the transformer in Black Forest Labs' names ---------------------------------------------------------------


def _bfl_names(diffusers_names: set[str]) -> list[tuple[str, list[str], str]]:
    """(BFL name, the diffusers tensors it is made of, how: "copy", "join" along the first axis, or "swap" its
    halves), for Flux2Transformer2DModel's tensors."""
    plan = [("img_in.weight", ["x_embedder.weight"], "copy"), ("txt_in.weight", ["context_embedder.weight"], "copy"),
            ("time_in.in_layer.weight", ["time_guidance_embed.timestep_embedder.linear_1.weight"], "copy"),
            ("time_in.out_layer.weight", ["time_guidance_embed.timestep_embedder.linear_2.weight"], "copy"),
            ("guidance_in.in_layer.weight", ["time_guidance_embed.guidance_embedder.linear_1.weight"], "copy"),
            ("guidance_in.out_layer.weight", ["time_guidance_embed.guidance_embedder.linear_2.weight"], "copy"),
            ("final_layer.linear.weight", ["proj_out.weight"], "copy"),
            ("final_layer.adaLN_modulation.1.weight", ["norm_out.linear.weight"], "swap")]
    plan += [(f"{m}.lin.weight", [f"{m}.linear.weight"], "copy") for m in (
        "double_stream_modulation_img", "double_stream_modulation_txt", "single_stream_modulation")]
    doubles = {int(n.split(".")[1]) for n in diffusers_names if n.startswith("transformer_blocks.")}
    for i in sorted(doubles):
        s, d = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        plan += [(d + "img_attn.qkv.weight", [s + f"attn.to_{x}.weight" for x in "qkv"], "join"),
                 (d + "txt_attn.qkv.weight", [s + f"attn.add_{x}_proj.weight" for x in "qkv"], "join"),
                 (d + "img_attn.proj.weight", [s + "attn.to_out.0.weight"], "copy"),
                 (d + "txt_attn.proj.weight", [s + "attn.to_add_out.weight"], "copy"),
                 (d + "img_mlp.0.weight", [s + "ff.linear_in.weight"], "copy"),
                 (d + "img_mlp.2.weight", [s + "ff.linear_out.weight"], "copy"),
                 (d + "txt_mlp.0.weight", [s + "ff_context.linear_in.weight"], "copy"),
                 (d + "txt_mlp.2.weight", [s + "ff_context.linear_out.weight"], "copy"),
                 (d + "img_attn.norm.query_norm.scale", [s + "attn.norm_q.weight"], "copy"),
                 (d + "img_attn.norm.key_norm.scale", [s + "attn.norm_k.weight"], "copy"),
                 (d + "txt_attn.norm.query_norm.scale", [s + "attn.norm_added_q.weight"], "copy"),
                 (d + "txt_attn.norm.key_norm.scale", [s + "attn.norm_added_k.weight"], "copy")]
    singles = {int(n.split(".")[1]) for n in diffusers_names if n.startswith("single_transformer_blocks.")}
    for i in sorted(singles):
        s, d = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        plan += [(d + "linear1.weight", [s + "attn.to_qkv_mlp_proj.weight"], "copy"),
                 (d + "linear2.weight", [s + "attn.to_out.weight"], "copy"),
                 (d + "norm.query_norm.scale", [s + "attn.norm_q.weight"], "copy"),
                 (d + "norm.key_norm.scale", [s + "attn.norm_k.weight"], "copy")]
    plan = [(name, sources, how) for name, sources, how in plan if all(s in diffusers_names for s in sources)]
    used = {s for _, sources, _ in plan for s in sources}
    if used != diffusers_names:
        raise SystemExit(f"tensors with no BFL name: {sorted(diffusers_names - used)[:5]} (not a Flux.2 transformer?)")
    return plan


def _header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length)), 8 + length


def write_bfl_transformer(source: Path, target: Path) -> None:
    """The diffusers transformer file `source` as stable-diffusion.cpp's Flux.2 file `target` (streamed: one
    tensor's bytes at a time)."""
    header, base = _header(source)
    tensors = {name: info for name, info in header.items() if name != "__metadata__"}
    plan = _bfl_names(set(tensors))
    out_header, offset = {}, 0
    for name, sources, _ in plan:
        infos = [tensors[s] for s in sources]
        shape = [sum(i["shape"][0] for i in infos), *infos[0]["shape"][1:]]
        size = sum(i["data_offsets"][1] - i["data_offsets"][0] for i in infos)
        out_header[name] = {"dtype": infos[0]["dtype"], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(out_header).encode()
    encoded += b" " * (-len(encoded) % 8)
    partial = target.with_suffix(".partial")
    with open(source, "rb") as f, open(partial, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)) + encoded)
        for _, sources, how in plan:
            parts = []
            for s in sources:
                start, end = tensors[s]["data_offsets"]
                f.seek(base + start)
                parts.append(f.read(end - start))
            data = b"".join(parts)
            if how == "swap":  # diffusers' (scale, shift) rows -> BFL's (shift, scale)
                half = len(data) // 2
                data = data[half:] + data[:half]
            out.write(data)
    partial.rename(target)


# ---- the runs ------------------------------------------------------------------------------------------------


class StageLog:
    """stable-diffusion.cpp's log lines, read for each stage's seconds ("sampling completed, taking 41.2s")."""

    PATTERN = re.compile(r"(\w+) completed, taking ([0-9.]+) ?(ms|s)\b")

    def __init__(self, sdc):
        self.lines: list[str] = []

        @sdc.sd_log_callback
        def record(level, text, data):
            self.lines.append(text.decode("utf-8", "replace"))

        self._callback = record  # kept alive: C holds the pointer
        sdc.sd_set_log_callback(record, ctypes.c_void_p(0))

    def stages(self) -> dict[str, float]:
        seconds: dict[str, float] = {}
        for line in self.lines:
            for what, value, unit in self.PATTERN.findall(line):
                if what in STAGE_OF_LOG:
                    stage = STAGE_OF_LOG[what]
                    seconds[stage] = seconds.get(stage, 0.0) + float(value) / (1000.0 if unit == "ms" else 1.0)
        return seconds


def run(args, transformer: Path) -> dict:
    import stable_diffusion_cpp as sdc
    from stable_diffusion_cpp import StableDiffusion

    start = time.perf_counter()
    pipe = StableDiffusion(diffusion_model_path=str(transformer),
                           vae_path=str(args.model / "vae" / "diffusion_pytorch_model.safetensors"),
                           llm_path=str(args.model / "text_encoder" / "model.safetensors"),
                           n_threads=args.threads, vae_decode_only=True, wtype=args.weights, verbose=True)
    load_s = time.perf_counter() - start
    log = StageLog(sdc)

    def generate():
        log.lines.clear()
        (image,) = pipe.generate_image(prompt=args.prompt, width=args.size, height=args.size,
                                       sample_steps=args.steps, cfg_scale=1.0, sample_method="euler", seed=0)
        return np.asarray(image, np.float32) / 255.0, log.stages()

    result = timed_calls(generate, args.repeats)
    if not all(result["stages"]):
        raise SystemExit("stable-diffusion.cpp's log gave no stage's seconds: " + " | ".join(log.lines[-5:]))
    np.save(args.out.with_suffix(".npy"), result.pop("image"))
    return {"class": "StableDiffusion", "weights": args.weights, "load_s": load_s, **result, "own_noise": True}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="where the BFL-named transformer is written once")
    parser.add_argument("--weights", default="default", help="stable-diffusion.cpp's wtype: default or q8_0")
    add_call_arguments(parser, size=512, steps=4, model="the diffusers folder (Flux2KleinPipeline)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    transformer = args.work / SDCPP_TRANSFORMER
    convert_s = None
    if not transformer.exists():
        start = time.perf_counter()
        write_bfl_transformer(args.model / "transformer" / "diffusion_pytorch_model.safetensors", transformer)
        convert_s = time.perf_counter() - start
    result = run(args, transformer)
    args.out.write_text(json.dumps({
        "versions": {"stable-diffusion-cpp-python": importlib.metadata.version("stable-diffusion-cpp-python")},
        "export_s": convert_s, **result, "peak_mb": peak_mb()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
