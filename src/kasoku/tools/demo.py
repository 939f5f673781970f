"""`kasoku demo`: the whole job on the built-in tiny pipeline, offline, with a short report.

compile (every stage through the cache: the second run reuses it) → parity of each engine
against torch → the same image as diffusers' torch pipeline (PSNR) → a side-by-side timing
against diffusers → an image on disk.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..build.compiler import CompileReport, engine_parity
from ..core.components import Precision
from ..core.console import table
from ..core.parity import TOLERANCES, OutputParity, psnr
from ..model.pipeline_model import Model
from ..pipeline.kasoku_pipeline import compile
from .benchmark import spread_warnings
from .tiny import write_tiny_pipeline

DEMO_PROMPT = "a beautiful photograph of mt fuji during cherry blossom"  # the seed's prompt
DEMO_STEPS = 10
DEMO_GUIDANCE = 7.5
DEMO_SEED = 0
TIMING_REPEATS = 3


@dataclass
class DemoReport:
    model_dir: str
    image_path: str
    backends: dict[str, str] = field(default_factory=dict)
    compile: CompileReport | None = None
    component_parity: list[OutputParity] = field(default_factory=list)
    image_psnr_db: float = 0.0
    image_max_abs: float = 0.0
    timing: dict[str, dict[str, float]] = field(default_factory=dict)  # name -> min/median/max seconds
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.component_parity) and \
            self.image_psnr_db >= TOLERANCES[Precision.FP32].image_psnr_db

    def to_dict(self) -> dict:
        data = asdict(self)
        data["passed"] = self.passed
        return data


def _timed(fn, repeats: int) -> dict[str, float]:
    fn()  # warm-up: first calls allocate and load kernels
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples)}


def run_demo(workdir: str | Path | None = None, output: str | Path = "kasoku-demo.png",
             cache_dir: str | Path | None = None, backend: str = "auto", on_stage=None) -> DemoReport:
    start = time.perf_counter()
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="kasoku-demo-"))
    model_dir = root / "tiny-sd"
    if not (model_dir / "model_index.json").exists():
        write_tiny_pipeline(model_dir)
    reference = Model.load(model_dir)
    report = DemoReport(model_dir=str(model_dir), image_path=str(output))
    report.seconds["write and load the tiny model"] = time.perf_counter() - start

    start = time.perf_counter()
    kwargs = {"on_stage": on_stage} if on_stage else {}
    pipe = compile(reference, backend, cache_dir=cache_dir, label=str(model_dir), **kwargs)
    report.compile = pipe.compile_report
    report.backends = dict(pipe.compile_report.backends)
    report.seconds["compile (export, optimize, engines)"] = time.perf_counter() - start

    start = time.perf_counter()
    specs = reference.specs(pipe.profile)
    for name, engine in pipe.engines.items():
        report.component_parity += engine_parity(specs[name], engine, engine.precision)
    report.seconds["component parity"] = time.perf_counter() - start

    start = time.perf_counter()
    diffusers_pipe = reference.task_pipeline("txt2img")

    def run(p, output_type="np"):
        return p(DEMO_PROMPT, num_inference_steps=DEMO_STEPS, guidance_scale=DEMO_GUIDANCE,
                 generator=torch.Generator().manual_seed(DEMO_SEED), output_type=output_type).images

    expected, actual = run(diffusers_pipe), run(pipe)
    report.image_psnr_db = float(psnr(expected, actual))
    report.image_max_abs = float(abs(expected - actual).max())
    report.seconds["image parity"] = time.perf_counter() - start

    start = time.perf_counter()
    report.timing["diffusers (torch eager)"] = _timed(lambda: run(diffusers_pipe), TIMING_REPEATS)
    report.timing["kasoku"] = _timed(lambda: run(pipe), TIMING_REPEATS)
    report.seconds["timing"] = time.perf_counter() - start

    run(pipe, output_type="pil")[0].save(output)
    return report


def print_demo_report(report: DemoReport, console) -> None:
    if report.compile:
        rows = [[s.component, s.stage, s.status, f"{s.seconds:.2f} s"] for s in report.compile.stages]
        console.print(table("1. compile (cache: built or reused)", ["component", "stage", "cache", "time"], rows))
        console.print("backends: " + ", ".join(f"{c}={b}" for c, b in report.backends.items()))
    rows = [[p.component, p.output, p.shape, f"{p.max_abs:.2e}", f"{p.limit:.1e}", "PASSED" if p.passed else "FAILED"]
            for p in report.component_parity]
    console.print(table("2. engines vs torch (fp32)", ["component", "output", "shape", "max|Δ|", "tol", ""], rows))
    console.print(f"3. image vs diffusers, same seed ({DEMO_STEPS} steps, guidance {DEMO_GUIDANCE}): "
                  f"PSNR {report.image_psnr_db:.1f} dB, max pixel difference {report.image_max_abs:.1e}")
    base = report.timing.get("diffusers (torch eager)", {}).get("median")
    rows = [[name, f"{t['median'] * 1e3:.0f} ms", f"{t['min'] * 1e3:.0f}–{t['max'] * 1e3:.0f} ms",
             f"{base / t['median']:.2f}x" if base else "-"] for name, t in report.timing.items()]
    console.print(table(f"4. one 64x64 image, {DEMO_STEPS} steps, median of {TIMING_REPEATS} after warm-up",
                        ["pipeline", "median", "min–max", "speed-up"], rows))
    console.print("   median: the middle of the timed calls; min–max: their range; speed-up: diffusers' median ÷ "
                  "this pipeline's.")
    for line in spread_warnings({name: (t["min"], t["max"]) for name, t in report.timing.items()}):
        console.print(f"   [yellow]note:[/] {line}")
    console.print(table("time", ["stage", "seconds"], [[k, f"{v:.1f}"] for k, v in report.seconds.items()]))
    verdict = "[green]PASSED[/]" if report.passed else "[red]FAILED[/]"
    console.print(f"5. image written to {report.image_path}   parity: {verdict}")
