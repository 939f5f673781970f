"""The `tiny` workload of BENCHMARK.md: kasoku against diffusers end to end on the built-in tiny
pipeline, where the pipeline's own overhead (tokenizer, scheduler, Python, copies) shows.

    python benchmarks/tiny_pipeline.py [--repeats 5] [--steps 20]

Writes benchmarks/results/<date>-<machine>-tiny.md and .json.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--backends", default="onnxruntime,openvino")
    args = parser.parse_args(argv)

    from kasoku.core.console import console, quiet_third_party_logs
    from kasoku.tools.benchmark import bench, markdown
    from kasoku.tools.tiny import write_tiny_pipeline

    quiet_third_party_logs()
    model = write_tiny_pipeline(Path(tempfile.mkdtemp(prefix="kasoku-tiny-")) / "tiny-sd")
    report = bench(model, args.backends.split(","), steps=args.steps, repeats=args.repeats,
                   log=lambda message: console.log(message, markup=False))
    report.model = "built-in tiny SD 1.x pipeline (kasoku tiny)"
    report.machine["host"] = socket.gethostname()
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"{report.date}-{report.machine['host']}-tiny"
    stem.with_suffix(".md").write_text(markdown(report) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(report.to_dict(), indent=2, default=str))
    console.print(markdown(report), markup=False)
    return stem


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
