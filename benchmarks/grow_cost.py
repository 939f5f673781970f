"""What engines that grow cost: the first call at a shape outside the compiled profile, and every later one.

    python benchmarks/grow_cost.py [--models tiny,sd15] [--threads 2] [--repeats 3] [--steps 2]

Per model (the tiny SD 1.x pipeline; SD 1.5 at full size with random weights, benchmarks/full_sd15.py's folder), in
its own process, into a fresh cache:

- compile: `kasoku.compile(pipe, "onnxruntime", components=txt2img)` with default shape options (the profile of half
  to double the native size, 1 to 4 images): the user's first compile;
- native: a call at the native size (inside the profile): the steady cost of a call;
- first call at a new shape: a call at a quarter of the native size (outside the profile). It builds the grown
  engines (every size the model serves, 4x native at most) and then runs: the build (the compile report's added
  seconds) and the whole call are reported;
- later calls at that shape: `--repeats` calls (median, min, max), which build nothing (asserted);
- the same call on diffusers' torch pipeline, and the image's PSNR against it.

Results: benchmarks/results/<date>-<host>-grow_cost.json and .md, with the CPU's model and flags.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SD15_DIR = HERE / ".models" / "sd15-random"
TXT2IMG = ("text_encoder", "unet", "vae_decoder")


def model_folder(name: str) -> Path:
    if name == "sd15":
        if not (SD15_DIR / "model_index.json").exists():
            sys.path.insert(0, str(HERE))
            from full_sd15 import build_sd15

            build_sd15(SD15_DIR)
        return SD15_DIR
    from kasoku.tools.tiny import write_tiny_pipeline

    folder = HERE / ".models" / "tiny-sd"
    if not (folder / "model_index.json").exists():
        write_tiny_pipeline(folder)
    return folder


def measure(name: str, threads: int, repeats: int, steps: int) -> dict:
    import torch

    import kasoku
    from kasoku.core.parity import psnr
    from kasoku.model.loading import load_pipeline
    from kasoku.pipeline.kasoku_pipeline import EnginesGrow

    torch.set_num_threads(threads)
    pipe = load_pipeline(model_folder(name))
    pipe.set_progress_bar_config(disable=True)
    with tempfile.TemporaryDirectory(prefix="kasoku-grow-") as cache:
        start = time.perf_counter()
        fast = kasoku.compile(pipe, "onnxruntime", components=TXT2IMG, cache_dir=cache, threads=threads)
        compile_seconds = time.perf_counter() - start
        fast.set_progress_bar_config(disable=True)
        native = fast.model.native_size
        small = native // 4 // fast.profile.multiple * fast.profile.multiple or fast.profile.multiple

        def call(p, size: int):
            return p("a photo of a cat", height=size, width=size, num_inference_steps=steps, output_type="np",
                     generator=torch.Generator().manual_seed(0)).images

        timed = []
        for _ in range(repeats):
            begin = time.perf_counter()
            call(fast, native)
            timed.append(time.perf_counter() - begin)
        before = fast.compile_report.seconds
        profile_before = str(fast.profile)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            begin = time.perf_counter()
            image = call(fast, small)
            first = time.perf_counter() - begin
        grown = [str(w.message) for w in caught if issubclass(w.category, EnginesGrow)]
        build = fast.compile_report.seconds - before
        stages = len(fast.compile_report.stages)
        later = []
        for _ in range(repeats):
            begin = time.perf_counter()
            call(fast, small)
            later.append(time.perf_counter() - begin)
        assert len(fast.compile_report.stages) == stages, "a later call built engines again"
        begin = time.perf_counter()
        expected = call(pipe, small)
        torch_seconds = time.perf_counter() - begin
    return {"model": name, "native": native, "new_size": small, "steps": steps, "compile_s": compile_seconds,
            "native_call_s": _summary(timed), "first_call_s": first, "grow_build_s": build,
            "later_calls_s": _summary(later), "torch_call_s": torch_seconds, "psnr_db": psnr(expected, image),
            "profile_before": profile_before, "profile_after": str(fast.profile), "said": grown,
            "peak_rss_gb": _peak_rss_gb()}


def _peak_rss_gb() -> float:
    """This process's peak resident memory (VmHWM): the live pipeline, its engines and each build."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024**2
    return float("nan")


def _gib(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.1f} GiB"


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def machine(threads: int) -> dict:
    import torch

    from kasoku.backends.base import cpu_name
    from kasoku.tools.benchmark import cpu_flags

    return {"host": socket.gethostname(), "cpu": cpu_name(), "flags": cpu_flags(), "threads": threads,
            "torch": torch.__version__, "date": datetime.date.today().isoformat()}


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"# Engines that grow: the cost of a new shape ({m['date']})", "",
             f"{m['cpu']} ({', '.join(m['flags']) or 'no AVX-512/AMX'}), {m['threads']} threads, torch {m['torch']}; "
             "ONNX Runtime engines, txt2img components, `python benchmarks/grow_cost.py`.", "",
             "| model | compile (default profile) | call at native | first call at new size (build) | later calls "
             "at new size (median, min-max) | torch at new size | PSNR vs torch | peak RSS |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["models"]:
        n, later = r["native_call_s"], r["later_calls_s"]
        lines.append(f"| {r['model']} ({r['native']} px → {r['new_size']} px, {r['steps']} steps) | "
                     f"{r['compile_s']:.1f} s | {n['median']:.3f} s | {r['first_call_s']:.1f} s "
                     f"({r['grow_build_s']:.1f} s) | {later['median']:.3f} s ({later['min']:.3f}-{later['max']:.3f}) "
                     f"| {r['torch_call_s']:.3f} s | {r['psnr_db']:.1f} dB | "
                     f"{_gib(r.get('peak_rss_gb'))} |")
    said = [f"- {r['model']}: {line}" for r in report["models"] for line in r["said"]]
    lines += ["", "What the first call said:", "", *said]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,sd15", help="comma-separated: tiny, sd15 (default both)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # one model, in this process: its result as JSON
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args.threads, args.repeats, args.steps)))
        return 0
    models = []
    for name in args.models.split(","):
        done = subprocess.run([sys.executable, __file__, "--one", name, "--threads", str(args.threads),
                               "--repeats", str(args.repeats), "--steps", str(args.steps)],
                              capture_output=True, text=True)
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
            return done.returncode
        models.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(models[-1], indent=2))
    report = {"machine": machine(args.threads), "models": models}
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"{report['machine']['date']}-{socket.gethostname()}-grow_cost"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(report) + "\n")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
