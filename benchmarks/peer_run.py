"""One peer's image in its own virtual environment (their pins conflict with kasoku's): run by
benchmarks/full_sd15.py with the peer venv's python, never imported by kasoku.

    <venv>/bin/python benchmarks/peer_run.py PEER --model DIR --work DIR --latents FILE.npy --out FILE.json

PEER is one of: optimum-intel-f32-static (OVStableDiffusionPipeline with INFERENCE_PRECISION_HINT f32,
reshaped to the image's static shape), optimum-intel-default-dynamic / optimum-intel-default-static (its
defaults: bf16 on a CPU with AMX), openvino-genai (Text2ImagePipeline on optimum-intel's export, its
defaults; it takes a seed, not latents), optimum-onnx (ORTStableDiffusionPipeline, fp32), fastsd-recipe
(FastSD CPU's: optimum-intel's defaults, static, with the tiny autoencoder of `--taesd` decoding in
OpenVINO). The export is timed; then a warm-up call, then `--repeats` timed calls per step count; the last
image of each count is saved beside the JSON. `--guidance` is every call's guidance scale (7.5).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

MEMORY_FLOOR_GIB = 1.0  # what a peer's export may leave the machine before it is stopped


def peak_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def available_gib() -> float:
    """MemAvailable of /proc/meminfo, in GiB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


def run_within_memory(command: list[str]) -> None:
    """Run `command`; stop it (and this process, with the reason) when the machine's available memory falls under
    MEMORY_FLOOR_GIB. A peer that does not fit is reported as such, never left to the kernel's OOM killer, which may
    kill another process than the one that ran out."""
    process = subprocess.Popen(command, start_new_session=True)
    while process.poll() is None:
        available = available_gib()
        if available < MEMORY_FLOOR_GIB:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise SystemExit(f"{Path(command[0]).name} {command[1]} stopped by the benchmark's memory guard: "
                             f"{available:.2f} GiB of the machine's memory were left available (floor "
                             f"{MEMORY_FLOOR_GIB} GiB)")
        time.sleep(0.2)
    if process.returncode:
        raise subprocess.CalledProcessError(process.returncode, command)


def ensure_vocab_files(model: Path) -> None:
    """optimum and openvino-genai read the CLIP tokenizer's vocab.json and merges.txt, which transformers 5
    no longer writes beside tokenizer.json: write them from tokenizer.json's BPE model."""
    folder = model / "tokenizer"
    data = json.loads((folder / "tokenizer.json").read_text())["model"]
    if not (folder / "vocab.json").exists():
        (folder / "vocab.json").write_text(json.dumps(data["vocab"]))
    if not (folder / "merges.txt").exists():
        merges = [" ".join(m) if isinstance(m, list) else m for m in data["merges"]]
        (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")


def export_openvino(model: Path, work: Path) -> tuple[Path, float]:
    target = work / "optimum-intel-export"
    if (target / "model_index.json").exists():
        return target, json.loads((target / "kasoku-export-seconds.json").read_text())["seconds"]
    shutil.rmtree(target, ignore_errors=True)
    start = time.perf_counter()
    run_within_memory([str(Path(sys.executable).parent / "optimum-cli"), "export", "openvino", "--model", str(model),
                       "--task", "text-to-image", str(target)])
    seconds = time.perf_counter() - start
    (target / "kasoku-export-seconds.json").write_text(json.dumps({"seconds": seconds}))
    return target, seconds


def taesd_decoder(folder: Path, size: int, threads: int):
    """The tiny autoencoder's decoder compiled by OpenVINO (its defaults), latents -> image in [0, 1]."""
    import openvino as ov
    import torch
    from diffusers import AutoencoderTiny

    tiny = AutoencoderTiny.from_pretrained(folder).eval().requires_grad_(False)

    class Decode(torch.nn.Module):
        def forward(self, latents):
            return (tiny.decode(latents, return_dict=False)[0] / 2 + 0.5).clamp(0, 1)

    example = torch.zeros(1, tiny.config.latent_channels, size // 8, size // 8)
    compiled = ov.Core().compile_model(ov.convert_model(Decode(), example_input=example), "CPU",
                                       {"INFERENCE_NUM_THREADS": threads})
    return lambda latents: compiled(np.asarray(latents))[0]


def reshape_static(pipe, args, result: dict) -> None:
    """optimum-intel's static 1-image shapes. Its reshape doubles the U-Net's batch for classifier-free guidance
    unless the U-Net takes `timestep_cond`, so a guidance-free call (SD-Turbo's) cannot run static there: it
    keeps optimum-intel's dynamic shapes, and the result says so."""
    takes_cond = "timestep_cond" in {i.get_any_name() for i in pipe.unet.model.inputs}
    if args.guidance > 1 or takes_cond:
        pipe.reshape(batch_size=1, height=args.size, width=args.size, num_images_per_prompt=1)
        result["shapes"] = "static"
    else:
        result["shapes"] = "dynamic (optimum-intel's static reshape assumes guidance)"


def run(peer: str, args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    ensure_vocab_files(args.model)
    latents = torch.from_numpy(np.load(args.latents))
    result: dict = {"peer": peer}
    start = time.perf_counter()
    if peer.startswith("optimum-intel") or peer in ("openvino-genai", "fastsd-recipe"):
        exported, result["export_s"] = export_openvino(args.model, args.work)
        start = time.perf_counter()
    if peer == "fastsd-recipe":
        import openvino as ov
        from optimum.intel import OVStableDiffusionPipeline

        result["versions"] = {"openvino": ov.__version__}
        pipe = OVStableDiffusionPipeline.from_pretrained(
            exported, ov_config={"INFERENCE_NUM_THREADS": args.threads, "PERFORMANCE_HINT": "LATENCY"}, compile=False)
        reshape_static(pipe, args, result)
        pipe.compile()
        decode = taesd_decoder(args.taesd, args.size, args.threads)

        def generate(steps):
            denoised = pipe(args.prompt, num_inference_steps=steps, guidance_scale=args.guidance, height=args.size,
                            width=args.size, latents=latents, generator=torch.Generator().manual_seed(0),
                            output_type="latent").images
            return np.transpose(decode(denoised)[0], (1, 2, 0))
    elif peer.startswith("optimum-intel"):
        import openvino as ov
        from optimum.intel import OVStableDiffusionPipeline

        result["versions"] = {"openvino": ov.__version__}
        config = {"INFERENCE_NUM_THREADS": args.threads, "PERFORMANCE_HINT": "LATENCY"}
        if "f32" in peer:
            config["INFERENCE_PRECISION_HINT"] = "f32"
        pipe = OVStableDiffusionPipeline.from_pretrained(exported, ov_config=config, compile=False)
        if peer.endswith("static"):
            reshape_static(pipe, args, result)
        pipe.compile()

        def generate(steps):  # a seeded generator too: LCM's steps draw fresh noise
            return pipe(args.prompt, num_inference_steps=steps, guidance_scale=args.guidance, height=args.size,
                        width=args.size, latents=latents, generator=torch.Generator().manual_seed(0),
                        output_type="np").images[0]
    elif peer == "openvino-genai":
        import openvino_genai as ov_genai

        result["versions"] = {"openvino_genai": ov_genai.__version__}
        pipe = ov_genai.Text2ImagePipeline(str(exported), "CPU", INFERENCE_NUM_THREADS=args.threads)

        def generate(steps):
            image = pipe.generate(args.prompt, width=args.size, height=args.size, num_inference_steps=steps,
                                  guidance_scale=args.guidance, generator=ov_genai.TorchGenerator(0))
            return np.asarray(image.data)[0].astype(np.float32) / 255.0
    elif peer == "optimum-onnx":
        import onnxruntime
        from optimum.onnxruntime import ORTStableDiffusionPipeline

        result["versions"] = {"onnxruntime": onnxruntime.__version__}
        target = args.work / "optimum-onnx-export"
        if not (target / "model_index.json").exists():
            export_start = time.perf_counter()
            ORTStableDiffusionPipeline.from_pretrained(str(args.model), export=True).save_pretrained(target)
            seconds = time.perf_counter() - export_start
            (target / "kasoku-export-seconds.json").write_text(json.dumps({"seconds": seconds}))
        result["export_s"] = json.loads((target / "kasoku-export-seconds.json").read_text())["seconds"]
        start = time.perf_counter()
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = args.threads
        pipe = ORTStableDiffusionPipeline.from_pretrained(target, session_options=options)

        def generate(steps):
            return pipe(args.prompt, num_inference_steps=steps, guidance_scale=args.guidance, height=args.size,
                        width=args.size, latents=latents, output_type="np").images[0]
    else:
        raise SystemExit(f"unknown peer {peer!r}")
    result["load_s"] = time.perf_counter() - start
    start = time.perf_counter()
    generate(1)  # warm-up: first calls allocate and compile
    result["warmup_s"] = time.perf_counter() - start
    images = {}
    result["seconds"] = {}
    for steps in args.steps:
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            image = generate(steps)
            samples.append(time.perf_counter() - start)
        result["seconds"][str(steps)] = samples
        images[f"steps{steps}"] = np.asarray(image, np.float32)
    np.savez(args.out.with_suffix(".npz"), **images)
    result["peak_mb"] = peak_mb()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("peer")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--latents", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompt", default="a beautiful photograph of mt fuji during cherry blossom")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=lambda t: [int(s) for s in t.split(",")], default=[4, 20])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--guidance", type=float, default=7.5)
    parser.add_argument("--taesd", type=Path, default=None, help="fastsd-recipe: the AutoencoderTiny folder")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(run(args.peer, args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
