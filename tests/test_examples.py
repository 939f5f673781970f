"""The examples run in the test suite so that they cannot rot."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # exports or builds engines

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_xformers_to_onnx_reproduces_the_seed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["xformers_to_onnx.py", "--out", str(tmp_path), "--repeats", "3"])
    namespace = runpy.run_path(str(EXAMPLES / "xformers_to_onnx.py"))
    result = namespace["main"]()
    assert all(result["plain_export_errors"].values()), "plain export of xFormers attention must fail"
    assert result["max_abs_vs_float64"] < 1e-5
    assert (tmp_path / "attention.onnx").is_file()
    for name in ("torch_cpu_exportable", "onnxruntime_cpu"):
        timing = result[name]
        assert timing["min_ms"] <= timing["median_ms"] <= timing["max_ms"]
    out = capsys.readouterr().out
    assert "fails, as in the seed" in out and "median" in out


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="xFormers' own kernels need a CUDA GPU")
def test_xformers_to_onnx_against_xformers_on_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["xformers_to_onnx.py", "--out", str(tmp_path), "--repeats", "3"])
    result = runpy.run_path(str(EXAMPLES / "xformers_to_onnx.py"))["main"]()
    assert result["max_abs_vs_xformers"] < 1e-5
