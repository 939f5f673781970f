"""The tiny families' images as digests: a refactoring's proof that kasoku still makes the same bytes.

    python benchmarks/image_digests.py --out before.json [--cache DIR] [--backends torch,onnxruntime,openvino]
    python benchmarks/image_digests.py --out after.json --against before.json

Every built-in tiny family (`kasoku tiny --family F`) is compiled once per backend at 32..128 px, then draws
one image per task (txt2img, img2img with an input image, inpaint with a mask) at 64x64, 4 steps, seed 7,
through the public CLI only (`python -m kasoku.cli`), so the same script runs on any revision. The JSON
holds the SHA-256 of each PNG file and of its decoded pixels, the seconds of each compile, and which
compiles reused every cache entry (`reused`: a second run on the first run's cache proves the cache keys
unchanged). With `--against`, every image is compared and any difference is listed; the exit status is
non-zero when one differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FAMILIES = ("sd1", "sd2", "sdxl", "sd3", "flux")
TASKS = ("txt2img", "img2img", "inpaint")
SIZE, STEPS, SEED = 64, 4, 7
SIZED_FAMILIES = ("flux",)  # their img2img and inpaint pipelines take `height` and `width` too


def kasoku(*args: str, env: dict[str, str]) -> str:
    result = subprocess.run([sys.executable, "-m", "kasoku.cli", *args], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"kasoku {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result.stdout


def write_inputs(folder: Path) -> tuple[Path, Path]:
    """A deterministic input image (a colour ramp) and an inpainting mask (the centre square)."""
    import numpy as np
    from PIL import Image

    ramp = np.linspace(0, 255, SIZE, dtype=np.float32)
    pixels = np.stack([ramp[None, :].repeat(SIZE, 0), ramp[:, None].repeat(SIZE, 1),
                       np.full((SIZE, SIZE), 128.0)], axis=-1).astype(np.uint8)
    mask = np.zeros((SIZE, SIZE), dtype=np.uint8)
    mask[SIZE // 4: 3 * SIZE // 4, SIZE // 4: 3 * SIZE // 4] = 255
    image, mask_file = folder / "input.png", folder / "mask.png"
    Image.fromarray(pixels).save(image)
    Image.fromarray(mask).save(mask_file)
    return image, mask_file


def task_arguments(task: str, image: Path, mask: Path) -> list[str]:
    return {"txt2img": [], "img2img": ["--image", str(image), "--strength", "0.6"],
            "inpaint": ["--image", str(image), "--mask", str(mask)]}[task]


def digests(path: Path) -> dict[str, str]:
    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(path).convert("RGB"))
    return {"png_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "pixels_sha256": hashlib.sha256(pixels.tobytes()).hexdigest()}


def run(families: list[str], backends: list[str], cache: Path, work: Path) -> dict:
    env = {**os.environ, "KASOKU_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    image, mask = write_inputs(work)
    results: dict = {"images": {}, "compiles": {}}
    for family in families:
        model = work / f"tiny-{family}"
        kasoku("tiny", str(model), "--family", family, env=env)
        for backend in backends:
            start = time.perf_counter()
            report = work / f"{family}-{backend}.json"
            kasoku("compile", str(model), "--backend", backend, "--height", "32:128", "--width", "32:128",
                   "--json", str(report), env=env)
            stages = json.loads(report.read_text()).get("stages", [])
            results["compiles"][f"{family}/{backend}"] = {
                "seconds": round(time.perf_counter() - start, 1),
                "reused": bool(stages) and all(stage.get("status") == "reused" for stage in stages)}
            for task in TASKS:
                out = work / f"{family}-{backend}-{task}.png"
                # SD's img2img and inpaint take the input image's size; Flux's take a size (diffusers' default 1024)
                sized = task == "txt2img" or family in SIZED_FAMILIES
                size = ["--height", str(SIZE), "--width", str(SIZE)] if sized else []
                kasoku("generate", str(model), "a red fox in the snow", "--backend", backend, *size,
                       "--steps", str(STEPS), "--seed", str(SEED), "-o", str(out),
                       *task_arguments(task, image, mask), env=env)
                key = f"{family}/{task}/{backend}"
                results["images"][key] = digests(out)
                print(f"{family:5} {task:8} {backend:12} {results['images'][key]['pixels_sha256'][:16]}", flush=True)
    return results


def differences(now: dict, before: dict) -> list[str]:
    found = [f"{key}: only in {where}" for where, a, b in (("the new run", now, before), ("the old run", before, now))
             for key in sorted(set(a["images"]) - set(b["images"]))]
    found += [f"{key}: {now['images'][key]['pixels_sha256'][:16]} != {before['images'][key]['pixels_sha256'][:16]}"
              for key in sorted(set(now["images"]) & set(before["images"]))
              if now["images"][key] != before["images"][key]]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--against", type=Path, help="an earlier run's JSON to compare with")
    parser.add_argument("--cache", type=Path, help="the kasoku cache to use (default: a new, empty one)")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--backends", default="torch,onnxruntime,openvino")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="kasoku-digests-"))
    cache = args.cache or work / "cache"
    results = run(args.families.split(","), args.backends.split(","), cache, work)
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    results["revision"] = revision
    results["settings"] = {"size": SIZE, "steps": STEPS, "seed": SEED, "cache": str(cache)}
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    if args.against is None:
        return 0
    found = differences(results, json.loads(args.against.read_text()))
    print("\n".join(found) if found else f"all {len(results['images'])} images byte-identical to {args.against}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
