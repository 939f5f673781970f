"""benchmarks/gpu_check.py on a machine without a GPU: it says what it would run, writes nothing, exits 0.
(It runs for real only on a GPU; its results are committed under benchmarks/results/.)"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_check", None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here: the check would run")
def test_without_a_gpu_it_prints_the_plan_and_exits_0():
    results = ROOT / "benchmarks" / "results"
    before = sorted(results.iterdir())
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "no NVIDIA GPU is visible" in done.stdout
    for stage in ("sd15:reference", "sd15:tensorrt:fp16", "sd15:tensorrt:fp32", "sd15:onnxruntime-cuda:fp16",
                  "sd15:onnxruntime-tensorrt:fp16", "sd15:inductor:fp16", "sdxl:reference", "sdxl:tensorrt:fp16"):
        assert stage in done.stdout
    assert sorted(results.iterdir()) == before  # nothing written


def test_the_plan_runs_sd15_first_and_every_backend_per_model(gpu_check):
    stages = gpu_check.plan(["sd15", "sdxl"])
    names = [s.name for s in stages]
    assert names[0] == "sd15:reference" and names.index("sdxl:reference") > names.index("sd15:tensorrt:fp16")
    for model in ("sd15", "sdxl"):
        assert {f"{model}:{b}" for b in ("tensorrt:fp16", "tensorrt:fp32", "onnxruntime-cuda:fp16",
                                         "onnxruntime-tensorrt:fp16", "inductor:fp16")} <= set(names)


def test_unavailable_backends_are_skipped_with_their_reason(gpu_check):
    from kasoku.backends import BACKENDS

    reasons = {s.name: gpu_check.why_not(s) for s in gpu_check.plan(["sd15"])}
    assert reasons["sd15:reference"] is None
    if "inductor" not in BACKENDS:
        assert "has no 'inductor' backend" in reasons["sd15:inductor:fp16"]
    if not torch.cuda.is_available():
        for name in ("sd15:tensorrt:fp16", "sd15:onnxruntime-cuda:fp16", "sd15:onnxruntime-tensorrt:fp16"):
            assert reasons[name], name  # a sentence naming what is missing


def test_inductor_runs_right_after_each_reference_and_has_its_own_target(gpu_check):
    names = [s.name for s in gpu_check.plan(["sd15", "sdxl"])]
    for model in ("sd15", "sdxl"):
        assert names[names.index(f"{model}:reference") + 1] == f"{model}:inductor:fp16"
    done = {"status": "done", "psnr_db": 35.0}
    report = {"stages": {"sd15:reference": {"status": "done", "diffusers eager fp16": {"seconds": [3.0, 3.2, 2.8]}},
                         "sd15:inductor:fp16": {**done, "seconds": [1.5, 1.4, 1.6]},
                         "sd15:tensorrt:fp16": {"status": "skipped", "reason": "no TensorRT"}}}
    lines = gpu_check._target_lines(report)
    assert any("inductor fp16 ≥ 1.8× diffusers eager fp16): 2.00×, met" in line for line in lines), lines
    assert any("tensorrt fp16 ≥ 2.5×" in line and "not measured in this run (skipped)" in line for line in lines)
