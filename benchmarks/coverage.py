"""Which diffusers text-to-image families kasoku compiles, written from the installed diffusers.

    python benchmarks/coverage.py [--backends onnxruntime,openvino] [--families pixart-sigma,sana] [--readme]

(`--families none` measures nothing: it writes the table again from this machine's latest JSON. `--size 512` calls
each family at up to 512x512 instead, its profile spanning that size: drop-in at large sizes, in a results file of
its own.)

Every text-to-image pipeline class of the installed diffusers (video, audio and 3D left out; ControlNet, PAG and
edit variants are listed with their family) gets a row. A family kasoku can build a tiny pipeline of (the five
hand-written ones, and kasoku.tools.tiny_families) is compiled on each backend and compared with diffusers' own
pipeline on the same generator (64-128 px, 2 steps, seed 1): the row gives the PSNR in dB per backend and where each
component runs (an engine, or torch with the reason). Any other class says why it has no row of numbers. Writes
benchmarks/results/<date>-<host>-coverage.{json,md}; with --readme, the table between the README's coverage
markers.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import json
import platform
import socket
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README_START, README_END = "<!-- coverage:start -->", "<!-- coverage:end -->"
MIN_PSNR = 40.0
NOT_MEASURED = "not measured in this run"
# the call-parameter names of video, audio and 3D pipelines
NOT_IMAGES = ("num_frames", "audio_length_in_s", "frame_rate", "fps", "video", "num_videos_per_prompt",
              "video_length")
# the variants a family's row names instead of a row of their own
VARIANT_WORDS = ("ControlNet", "PAG", "Control", "Adapter", "Combined", "Prior", "Decoder", "Upscale", "Refiner",
                 "Edit", "Layered", "Kontext", "Redux", "Fill", "Depth", "Instruct", "Img2Img", "Inpaint", "I2I", "KV",
                 "SuperResolution", "Onnx", "Paradigms", "SAG", "LDM3D", "Pixel", "Omni")
HAND_WRITTEN = {"StableDiffusionPipeline": "sd1", "StableDiffusionXLPipeline": "sdxl",
                "StableDiffusion3Pipeline": "sd3", "FluxPipeline": "flux"}
# classes this machine cannot run, and why (found when their tiny pipelines were built)
BLOCKED = {
    "OmniGenPipeline": "its processor needs torchvision, whose ops do not load with the CPU torch here "
                       "(`operator torchvision::nms does not exist`)",
    "QwenImage21Pipeline": "its Qwen3-VL processor needs torchvision, whose ops do not load with the CPU torch here",
    "Cosmos2TextToImagePipeline": "it runs only with its safety checker, which needs the cosmos_guardrail package "
                                  "(not installed here; diffusers refuses the call without it), and its transformer "
                                  "resizes its padding mask with torchvision",
}


def text_to_image_classes() -> dict[str, type]:
    from kasoku.families.generic import pipeline_classes

    found = {}
    for name, cls in sorted(pipeline_classes().items()):
        if name == "DiffusionPipeline":
            continue
        try:
            parameters = inspect.signature(cls.__call__).parameters
        except (TypeError, ValueError):
            continue
        if "prompt" not in parameters or "height" not in parameters or any(p in parameters for p in NOT_IMAGES):
            continue
        if any(word in name.removesuffix("Pipeline") for word in VARIANT_WORDS):
            continue
        found[name] = cls
    return found


def tiny_builders() -> dict[str, str]:
    """Pipeline class -> the `kasoku tiny --family` name that builds one."""
    from kasoku.tools.tiny_families import TINY_FAMILIES, tiny_family_pipeline

    return {**HAND_WRITTEN, **{type(tiny_family_pipeline(name)).__name__: name for name in TINY_FAMILIES}}


def measured(family: str, backend: str, cache: Path, size: int | None = None) -> dict:
    """Compile the tiny `family` on `backend` and compare one image with diffusers' (guidance as the class's
    default): at 4x its pixel step, or with `size` at up to `size` pixels (the profile spanning it; no larger than
    the family's default profile)."""
    import numpy as np
    import torch

    import kasoku
    from kasoku.core.components import ShapeProfile
    from kasoku.core.parity import psnr
    from kasoku.model.pipeline_model import Model
    from kasoku.tools.tiny import tiny_pipeline

    pipe = tiny_pipeline(family=family)
    model = Model.of(pipe)
    step = max(16, model.family.pixel_multiple(model)) if model.family.generic else 16
    largest, side = 8 * step, 4 * step
    if size:
        default = model.default_profile().max
        largest = side = max(2 * step, min(size, default.height, default.width) // step * step)
    sides = (2 * step, min(4 * step, largest), largest)
    profile = ShapeProfile.from_ranges((1, 1, 1), sides, sides, step)
    if model.family.generic:  # the text tokens the call asks for (a graph of one shape is compiled for them)
        profile = dataclasses.replace(profile, text_tokens=48)
    start = time.perf_counter()
    fast = kasoku.compile(pipe, backend, profile=profile, cache_dir=cache)
    seconds = time.perf_counter() - start
    parameters = inspect.signature(type(pipe).__call__).parameters
    call = {"prompt": "a red fox", "height": side, "width": side, "num_inference_steps": 2,
            "output_type": "np", "use_resolution_binning": False, "max_sequence_length": 48,
            "enable_prompt_rewrite": False}
    if "guidance_schedule" in parameters:  # a guidance per step (Ideogram 4's) as long as its default steps
        call.update(guidance_schedule=None, guidance_scale=4.0)
    if not model.family.generic:  # the hand-written families compile their text tokens for diffusers' default
        del call["max_sequence_length"]
    call = {name: value for name, value in call.items() if name in parameters}

    def images(p):
        output = p(generator=torch.Generator().manual_seed(1), **call)
        return np.asarray(output.images if hasattr(output, "images") else output.image)

    report = fast.compile_report
    return {"psnr": round(float(psnr(images(pipe), images(fast))), 1), "compile_seconds": round(seconds, 1),
            "components": dict(report.backends), "in_torch": dict(report.in_torch), "pixels": side}


def status(row: dict) -> str:
    runs = row.get("backends", {})
    if not runs:
        return "not built"
    components = next(iter(runs.values())).get("components", {})
    denoiser = next((name for name in ("transformer", "unet") if name in components), None)
    # the VAE's decode: "vae_decoder", or another attribute's ("vqvae_decode" of LDM, "movq_decode" of Kandinsky 3)
    decoders = [name for name in components if name.startswith("vae_decoder") or name.endswith("_decode")]
    # a pixel-space pipeline (DeepFloyd IF) has no VAE: its denoiser alone
    on_engines = denoiser and (components.get(denoiser) != "torch" or blocks_on_engines(components, denoiser)) \
        and all(components[name] != "torch" for name in decoders)
    matched = all(run.get("psnr", 0) >= MIN_PSNR for run in runs.values())
    return "compiled" if on_engines and matched else "partly compiled" if matched else "differs"


def blocks_on_engines(components: dict, module: str) -> bool:
    """Whether every block of `module` runs on an engine (its whole graph failed: its glue runs in torch)."""
    blocks = [backend for name, backend in components.items() if name.startswith(f"{module}.")]
    return bool(blocks) and "torch" not in blocks


def where_components_run(components: dict) -> str:
    """Each component and where it runs; a denoiser run by blocks as one entry: its blocks on engines (how many)
    and its glue in torch."""
    shown = []
    for name, backend in components.items():
        if "." in name:
            continue
        blocks = [b for n, b in components.items() if n.startswith(f"{name}.")]
        if blocks:
            on = sum(b != "torch" for b in blocks)
            shown.append(f"{name}: {on} of {len(blocks)} blocks on engines, its glue in torch")
        else:
            shown.append(f"{name}: {'torch' if backend == 'torch' else 'engine'}")
    return ", ".join(shown)


def run(backends: list[str], only: list[str] | None, cache: Path, size: int | None = None) -> dict:
    from kasoku.backends.base import cpu_name

    classes = text_to_image_classes()
    builders = tiny_builders()
    rows = []
    for name in classes:
        row: dict = {"class": name}
        family = builders.get(name)
        if ".deprecated." in classes[name].__module__:
            row["reason"] = "deprecated in diffusers (diffusers.pipelines.deprecated): not a target, not tried here"
            row["status"] = "deprecated"
            rows.append(row)
            continue
        if name in BLOCKED:
            row["reason"] = BLOCKED[name]
        elif family is None:
            row["reason"] = "kasoku has no tiny builder for it yet: not tried here"
        elif only and family not in only:
            row["reason"] = NOT_MEASURED
        else:
            row["family"] = family
            row["backends"] = {}
            for backend in backends:
                print(f"{name} on {backend} ...", flush=True)
                try:
                    row["backends"][backend] = measured(family, backend, cache, size)
                except Exception as error:  # the table says what failed; the run goes on
                    row["backends"][backend] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        row["status"] = status(row) if "backends" in row else "not built"
        rows.append(row)
    return {"date": datetime.date.today().isoformat(), "host": socket.gethostname(), "cpu": cpu_name(),
            "python": platform.python_version(), "versions": versions(), "backends": backends, "rows": rows}


def versions() -> dict[str, str]:
    import diffusers
    import torch
    import transformers

    return {"diffusers": diffusers.__version__, "transformers": transformers.__version__, "torch": torch.__version__}


def markdown(result: dict) -> str:
    backends = result["backends"]
    compiled = sum(row["status"] == "compiled" for row in result["rows"])
    by_blocks = sum(row["status"] == "compiled" and any(
        blocks_on_engines(run.get("components", {}), name) for run in row["backends"].values()
        for name in ("transformer", "unet")) for row in result["rows"])
    deprecated = sum(row["status"] == "deprecated" for row in result["rows"])
    dates = " and ".join(sorted({row.get("date", result["date"]) for row in result["rows"] if "backends" in row}))
    blocked = sum(row["class"] in BLOCKED for row in result["rows"])
    runnable = len(result["rows"]) - deprecated - blocked
    lines = [f"{compiled} of {len(result['rows']) - deprecated} text-to-image pipeline classes of diffusers "
             f"{result['versions']['diffusers']} compile with their denoiser and VAE on engines and match diffusers "
             f"(tiny random pipelines, 2 steps; `python benchmarks/coverage.py`, {dates}, {result['cpu']}); "
             f"{deprecated} more are deprecated in diffusers and listed without a run. That is {compiled} of the "
             f"{runnable} this machine can run ({100 * compiled / max(runnable, 1):.0f}%; {blocked} need packages "
             f"it cannot load, named below). Of the compiled, {by_blocks} "
             "run their denoiser's blocks on engines and its glue in torch (its whole graph does not export).",
             "", "| class | status | " + " | ".join(f"{b} dB" for b in backends) + " | where each component runs |",
             "|---|---|" + "---|" * len(backends) + "---|"]
    for row in result["rows"]:
        runs = row.get("backends", {})
        cells = []
        for backend in backends:
            run = runs.get(backend, {})
            cells.append(f"{run['psnr']:.1f}" if "psnr" in run else ("error" if "error" in run else ""))
        first = next(iter(runs.values()), {})
        if "components" in first:
            where = where_components_run(first["components"])
            kept = "; ".join(f"{c} in torch: {r}" for c, r in first.get("in_torch", {}).items())
            where += f" ({kept})" if kept else ""
        else:
            where = first.get("error", row.get("reason", ""))
        lines.append(f"| {row['class']} | {row['status']} | " + " | ".join(cells) + f" | {where.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def write_readme(table: str) -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    start, end = text.index(README_START) + len(README_START), text.index(README_END)
    readme.write_text(text[:start] + "\n" + table + text[end:])


def main() -> int:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="onnxruntime,openvino")
    parser.add_argument("--families", default="",
                        help="only these tiny families (default: every one); the other rows are kept from this "
                             "machine's latest run, with its date")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/kasoku-coverage-cache"))
    parser.add_argument("--readme", action="store_true", help="write the table into README.md too")
    parser.add_argument("--size", type=int, default=None, metavar="PIXELS",
                        help="call each family at up to PIXELS square (no larger than its default profile) instead "
                             "of 4x its pixel step: drop-in at large sizes; its own results file "
                             "(<date>-<host>-coverage-<PIXELS>px), never the README's table")
    args = parser.parse_args()
    if args.size and args.readme:
        parser.error("--readme writes the table at the tiny pipelines' own size: leave out --size")
    only = [f for f in args.families.split(",") if f]
    result = run(args.backends.split(","), only, args.cache, args.size)
    suffix = f"-{args.size}px" if args.size else ""
    result["size"] = args.size
    earlier_runs = sorted(RESULTS.glob(f"*-{result['host']}-coverage{suffix}.json"))
    if only and earlier_runs:  # the other rows as this machine's latest run measured them, with that run's date
        latest = json.loads(earlier_runs[-1].read_text())
        earlier = {row["class"]: {"date": latest["date"], **row} for row in latest["rows"]}
        result["rows"] = [earlier.get(row["class"], row) if row.get("reason") == NOT_MEASURED else row
                          for row in result["rows"]]
    return write_table(result, args.readme, suffix)


def write_table(result: dict, readme: bool, suffix: str = "") -> int:
    for row in result["rows"]:
        if "backends" in row:
            row["status"] = status(row)
    stem = RESULTS / f"{result['date']}-{result['host']}-coverage{suffix}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(result)
    size = f" at up to {result['size']} px (each family's default profile's largest where smaller)" \
        if result.get("size") else ""
    stem.with_suffix(".md").write_text(f"# Coverage of diffusers' text-to-image families{size}\n\n" + table)
    if readme:
        write_readme(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
