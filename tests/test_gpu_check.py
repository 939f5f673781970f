"""benchmarks/gpu_check.py on a machine without a GPU: it says what it would run, writes nothing, exits 0.
(It runs for real only on a GPU; its results are committed under benchmarks/results/.)"""

from __future__ import annotations

import importlib.util
import json
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
                  "sd15:onnxruntime-tensorrt:fp16", "sd15:inductor:fp16", "sdxl:reference", "sdxl:tensorrt:fp16",
                  "sd35:reference", "sd35:inductor:bf16", "flux:reference", "flux:inductor:bf16"):
        assert stage in done.stdout
    assert sorted(results.iterdir()) == before  # nothing written


def test_the_plan_runs_sd15_first_and_every_backend_per_model(gpu_check):
    stages = gpu_check.plan(["sd15", "sdxl"])
    names = [s.name for s in stages]
    assert names[0] == "sd15:reference" and names.index("sdxl:reference") > names.index("sd15:tensorrt:fp16")
    for model in ("sd15", "sdxl"):
        assert {f"{model}:{b}" for b in ("tensorrt:fp16", "tensorrt:fp32", "onnxruntime-cuda:fp16",
                                         "onnxruntime-tensorrt:fp16", "inductor:fp16")} <= set(names)


def test_the_transformer_families_run_in_bf16_on_inductor_first_and_on_prompt_embeddings(gpu_check):
    names = [s.name for s in gpu_check.plan(["sd35", "flux"])]
    assert names == ["sd35:reference", "sd35:inductor:bf16", "sd35:tensorrt:bf16",
                     "flux:reference", "flux:inductor:bf16", "flux:tensorrt:bf16"]
    sd35, flux = gpu_check.MODELS["sd35"], gpu_check.MODELS["flux"]
    assert sd35.profile().guidance and not flux.profile().guidance  # Flux's guidance is embedded: one row an image
    assert (sd35.profile().text_tokens, flux.profile().text_tokens) == (256, 512)
    assert sd35.profile().multiple == flux.profile().multiple == 16


@pytest.mark.slow  # torch.compile and two ONNX exports on the CPU: about a minute
def test_smoke_runs_every_stage_of_flux_on_the_cpu_and_reports_parity(gpu_check, tmp_path):
    """--smoke: the tiny Flux pipeline (no text encoders, called with prompt embeddings) through the reference
    and a kasoku stage, as a lent GPU runs the full-size one."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--models", "flux", "--steps", "2", "--repeats",
                           "1", "--work", str(tmp_path)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = max((gpu_check.SMOKE_DIR / "results").glob("*-gpu_check.json"), key=lambda p: p.stat().st_mtime)
    stages = json.loads(report.read_text())["stages"]
    assert stages["flux:reference"]["status"] == stages["flux:onnxruntime:fp32"]["status"] == "done", stages
    kasoku_stage = stages["flux:onnxruntime:fp32"]
    assert kasoku_stage["psnr_db"] >= 40
    assert all(shape["passed"] for shape in kasoku_stage["parity"]["transformer"].values())


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
