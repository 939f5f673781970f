"""optimum-intel's and openvino.genai's pipelines on one of the newest families' folders, in their own virtual
environment (its pins conflict with kasoku's): run by benchmarks/full_modern_image.py with the peer venv's python,
never imported by kasoku.

    <venv>/bin/python benchmarks/peer_modern.py --model DIR --work DIR --latents FILE.npy --out FILE.json
        [--runner optimum-intel|openvino-genai] [--prompt TEXT] [--size 1024] [--steps 1] [--repeats 2] [--threads 2]

`optimum-cli export openvino --task text-to-image` (timed, with its peak memory; optimum-intel's defaults: the
weights of a model over 1B parameters in int8; stopped, with the reason, if the machine's memory runs low), then
`--runner optimum-intel`: OVDiffusionPipeline with its defaults (dynamic shapes), a warm-up and `--repeats` timed
calls (the result), then the same reshaped to the call's static shape where its reshape can run the call (under
"static"); the seconds of each stage (text encoder, transformer, VAE decode) are read by wrapping the pipeline parts'
methods. `--runner openvino-genai`: openvino.genai's Text2ImagePipeline on the same export (its own noise from a
seed; its stages from its performance metrics). The last image of each run is saved beside the JSON (FILE.npy, the
dynamic run's; FILE-static.npy).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_run import export_openvino, peak_mb  # noqa: E402 - the SD peers' export and memory reading

STAGES = {"text_encoder": ("text_encoder", "forward"), "transformer": ("transformer", "forward"),
          "vae_decoder": ("vae", "decode")}


def _clock(pipe) -> dict[str, float]:
    seconds: dict[str, float] = {}
    for stage, (attribute, method) in STAGES.items():
        owner = getattr(pipe, attribute)
        original = getattr(owner, method)

        def timed(*args, _stage=stage, _original=original, **kwargs):
            start = time.perf_counter()
            out = _original(*args, **kwargs)
            seconds[_stage] = seconds.get(_stage, 0.0) + time.perf_counter() - start
            return out

        setattr(owner, method, timed)
    return seconds


def timed_calls(generate, repeats: int) -> dict:
    """A warm-up call of `generate` (-> the image, the seconds of each stage), then `repeats` timed ones."""
    start = time.perf_counter()
    generate()
    first = time.perf_counter() - start
    seconds, stages, image = [], [], None
    for _ in range(repeats):
        start = time.perf_counter()
        image, stage = generate()
        seconds.append(time.perf_counter() - start)
        stages.append(stage)
    return {"first_call_s": first, "seconds": seconds, "stages": stages, "image": np.asarray(image, np.float32)}


def clocked_call(pipe, call: dict):
    """`pipe(**call)` as `timed_calls` takes it, each stage timed by wrapping the pipeline parts' methods."""
    seconds_of = _clock(pipe)

    def generate():
        seconds_of.clear()
        return pipe(**call).images[0], dict(seconds_of)

    return generate


def run_optimum(args, target: Path) -> dict:
    """optimum-intel's OVDiffusionPipeline with its defaults (dynamic shapes), then reshaped to the call's static
    shape where its reshape can run the call (under "static")."""
    import torch
    from optimum.intel import OVDiffusionPipeline

    start = time.perf_counter()
    pipe = OVDiffusionPipeline.from_pretrained(target, ov_config={"INFERENCE_NUM_THREADS": args.threads})
    load_s = time.perf_counter() - start
    pipe.set_progress_bar_config(disable=True)
    # Sana Sprint's one step runs without SCM's intermediate timestep (as in full_modern_image's call_arguments)
    sana = "intermediate_timesteps" in inspect.signature(type(pipe).__call__).parameters and args.steps != 2
    call = {"prompt": args.prompt, "height": args.size, "width": args.size, "num_inference_steps": args.steps,
            "latents": torch.from_numpy(np.load(args.latents)), "output_type": "np",
            **({"intermediate_timesteps": None} if sana else {})}
    generate = clocked_call(pipe, call)
    dynamic = timed_calls(generate, args.repeats)
    np.save(args.out.with_suffix(".npy"), dynamic.pop("image"))
    start = time.perf_counter()
    try:  # optimum-intel's static shapes: its reshape doubles the denoiser's batch for guidance a distilled model
        pipe.reshape(batch_size=1, height=args.size, width=args.size, num_images_per_prompt=1)  # may not run
        pipe.compile()
        static = {"reshape_s": time.perf_counter() - start, **timed_calls(generate, args.repeats)}
        np.save(args.out.with_name(args.out.stem + "-static.npy"), static.pop("image"))
    except (RuntimeError, ValueError, TypeError) as error:  # its reshape's refusals differ per pipeline class
        static = {"failed": f"{type(error).__name__}: {str(error).strip().splitlines()[-1]}"}
    return {"class": type(pipe).__name__, "load_s": load_s, **dynamic, "static": static}


def run_genai(args, target: Path) -> dict:
    """openvino.genai's Text2ImagePipeline on the same export, its defaults. It takes a seed, not latents: its image
    starts from its own noise (no PSNR). The stages' seconds are its own performance metrics."""
    import openvino_genai as ov_genai

    start = time.perf_counter()
    pipe = ov_genai.Text2ImagePipeline(str(target), "CPU", INFERENCE_NUM_THREADS=args.threads)
    load_s = time.perf_counter() - start

    def generate():
        image = pipe.generate(args.prompt, width=args.size, height=args.size, num_inference_steps=args.steps,
                              generator=ov_genai.TorchGenerator(0))
        metrics = pipe.get_performance_metrics()
        stages = {"text_encoder": sum(metrics.get_text_encoder_infer_duration().values()) / 1e3,
                  "transformer": metrics.get_transformer_infer_duration().mean * args.steps / 1e3,
                  "vae_decoder": metrics.get_vae_decoder_infer_duration() / 1e3}
        return np.asarray(image.data)[0].astype(np.float32) / 255.0, stages

    result = timed_calls(generate, args.repeats)
    np.save(args.out.with_suffix(".npy"), result.pop("image"))
    return {"class": "Text2ImagePipeline", "load_s": load_s, **result, "own_noise": True}


RUNNERS = {"optimum-intel": run_optimum, "openvino-genai": run_genai}


def add_call_arguments(parser: argparse.ArgumentParser, *, size: int, steps: int, model: str | None = None) -> None:
    """What full_modern_image.py hands every peer of the newest families: the folder (`model`: its help), the call,
    the result file."""
    parser.add_argument("--model", type=Path, required=True, help=model)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompt", default="a red fox in the snow")
    parser.add_argument("--size", type=int, default=size)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runner", choices=sorted(RUNNERS), default="optimum-intel")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--latents", type=Path, required=True)
    add_call_arguments(parser, size=1024, steps=1)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    import torch

    torch.set_num_threads(args.threads)
    fresh = not (args.work / "optimum-intel-export" / "model_index.json").exists()
    try:
        target, export_s = export_openvino(args.model, args.work)
    except SystemExit as stopped:  # the memory watchdog's reason, for the report
        args.out.write_text(json.dumps({"failed": True, "error": str(stopped)}))
        raise
    export_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024 if fresh else None
    result = RUNNERS[args.runner](args, target)
    versions = ("optimum-intel", "openvino", "diffusers", "transformers", "torch")
    if args.runner == "openvino-genai":
        versions = ("openvino-genai", "openvino", "optimum-intel")
    args.out.write_text(json.dumps({
        "versions": {name: importlib.metadata.version(name) for name in versions},
        "export_s": export_s, "export_peak_mb": export_peak, **result, "peak_mb": peak_mb()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
