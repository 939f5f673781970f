"""`kasoku demo`: the whole flow on the built-in tiny pipeline, offline, with a short report."""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .export import ExportManifest, export_pipeline
from .tiny import write_tiny_pipeline


@dataclass
class DemoReport:
    model_dir: Path
    onnx_dir: Path
    seconds: dict[str, float] = field(default_factory=dict)
    export: ExportManifest | None = None

    def to_dict(self) -> dict:
        data = asdict(self)
        data["model_dir"], data["onnx_dir"] = str(self.model_dir), str(self.onnx_dir)
        data["export"] = self.export.to_dict() if self.export else None
        return data


def run_demo(workdir: str | Path | None = None) -> DemoReport:
    """Write the tiny pipeline, export every component under exportable_attention() and
    check each against torch in ONNX Runtime at two shapes."""
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="kasoku-demo-"))
    report = DemoReport(model_dir=root / "tiny-sd", onnx_dir=root / "onnx")
    start = time.perf_counter()
    if not (report.model_dir / "model_index.json").exists():
        write_tiny_pipeline(report.model_dir)
    report.seconds["write tiny pipeline"] = time.perf_counter() - start
    start = time.perf_counter()
    report.export = export_pipeline(report.model_dir, report.onnx_dir)
    report.seconds["export + parity"] = time.perf_counter() - start
    return report


def print_demo_report(report: DemoReport, console) -> None:
    from .console import table

    rows = []
    for c in report.export.components:
        for p in c.parity:
            rows.append([c.name, p.output, p.shape, f"{p.max_abs:.2e}", f"{p.limit:.1e}",
                         "PASSED" if p.passed else "FAILED"])
    console.print(table("ONNX Runtime vs torch (fp32)", ["component", "output", "shape", "max|Δ|", "tol", ""], rows))
    console.print(table("time", ["stage", "seconds"], [[k, f"{v:.1f}"] for k, v in report.seconds.items()]))
    console.print(f"tiny pipeline: {report.model_dir}\nONNX files:    {report.onnx_dir}")
