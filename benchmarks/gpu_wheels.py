"""Wheels that must travel with kasoku to this workplace's lent GPU machine (no package index there).

    python benchmarks/gpu_wheels.py [--dest .whl] [--python-version 3.12]

kasoku itself travels as the working tree (run it with PYTHONPATH=src). The machine's image has torch,
transformers, accelerate, onnx, onnxscript, onnxruntime (CPU) and numpy, but not the packages below; this
downloads them (no dependencies: the image has those) for its Python into --dest, checks that they fit the
64 MiB a call may carry, and prints the `carry` entry and the line that installs them there. It runs pip
download only; add the folder to .git/info/exclude so that it is not committed.

TensorRT (its CUDA libraries are wheels of a gigabyte and more, on pypi.nvidia.com) and onnxruntime-gpu
(about 256 MB) cannot travel under that limit: on that machine gpu_check.py skips native TensorRT and the
ONNX Runtime GPU providers with that reason and checks what the image can run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

CARRY_LIMIT = 64 * 2**20  # bytes a device call may carry, the working tree included
# Not in the machine's image; pure-Python wheels, so any platform tag fits.
WHEELS = ("diffusers==0.42.1", "importlib-metadata", "onnx-graphsurgeon==0.6.1", "polygraphy==0.53.6")
CANNOT_TRAVEL = {"tensorrt": "its CUDA libraries are gigabyte wheels on pypi.nvidia.com",
                 "onnxruntime-gpu": "its wheel is about 256 MB"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def download_command(dest: Path, python_version: str) -> list[str]:
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
            python_version, "--implementation", "cp", *platforms, "-d", str(dest), *WHEELS]


def install_line(dest: Path) -> str:
    return (f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
            f"{dest}/*.whl && export PYTHONPATH=/tmp/site:$PWD/src || exit;")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=Path(".whl"))
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (3.12 in its image)")
    args = parser.parse_args(argv)
    args.dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(download_command(args.dest, args.python_version), check=True)
    size = sum(p.stat().st_size for p in args.dest.glob("*.whl"))
    print(f"{args.dest}: {size / 2**20:.1f} MiB of wheels (a call carries {CARRY_LIMIT / 2**20:.0f} MiB with the tree)")
    for name, why in CANNOT_TRAVEL.items():
        print(f"not carried: {name} ({why})")
    print(f"carry: [\"{args.dest}\"]\ncommand prefix: {install_line(args.dest)}")
    return 0 if size < CARRY_LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
