"""Step caching on recorded families (tiny random pipelines): seconds per image and PSNR from the uncached image.

    python benchmarks/generic_step_cache.py [--families pixart-sigma,z-image] [--steps 28]

Each family is compiled on ONNX Runtime fp32 with its blocks' engines (`step_cache=True`) into a cache under
benchmarks/results/.cache-generic-step-cache, then called with guidance at its tests' size: plain, TaylorSeer at
intervals 2 and 3, and the first-block cache at thresholds 0.1 and 0.2, each warmed up once and timed best of 3.
Tiny models measure overhead (the glue in torch, one engine call per block), not the work a full-size model does.
Prints the CPU model and flags first; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALLS = ({}, {"cache_interval": 2}, {"cache_interval": 3}, {"cache_threshold": 0.1}, {"cache_threshold": 0.2})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="pixart-sigma,z-image")
    parser.add_argument("--steps", type=int, default=28)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(ROOT))
    import torch
    from tests.families.test_generic import _arguments, _images, _profile

    import kasoku
    from kasoku.backends.base import cpu_flags, cpu_name
    from kasoku.core.parity import psnr
    from kasoku.tools.tiny_families import tiny_family_pipeline

    print(f"cpu: {cpu_name()}; flags: {' '.join(f for f in cpu_flags() if f.startswith(('avx', 'amx')))}; "
          f"torch threads {torch.get_num_threads()}")
    for family in args.families.split(","):
        pipe = tiny_family_pipeline(family)
        fast = kasoku.compile(pipe, "onnxruntime", profile=_profile(pipe), step_cache=True,
                              cache_dir=ROOT / "benchmarks" / "results" / ".cache-generic-step-cache")
        call = _arguments(pipe, guided=True, num_inference_steps=args.steps)
        plain = None
        for extra in CALLS:
            _images(fast, **call, **extra)
            seconds = []
            for _ in range(3):
                start = time.perf_counter()
                image = _images(fast, **call, **extra)
                seconds.append(time.perf_counter() - start)
            best = min(seconds)
            if plain is None:
                plain, base = image, best
                print(f"{family} plain: {best:.3f} s")
                continue
            run = fast.last_step_cache
            done = f"{run.forecasts} forecast" if hasattr(run, "forecasts") else f"{run.skipped} skipped"
            print(f"{family} {extra}: {best:.3f} s ({base / best:.2f}x), {psnr(plain, image):.1f} dB, {done} "
                  f"of {len(getattr(run, 'changes', [])) or args.steps}")


if __name__ == "__main__":
    main()
