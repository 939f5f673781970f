"""TensorRT, ONNX Runtime CUDA and ONNX Runtime's TensorRT provider on a real GPU: build, run at the
profile's min, opt and max shapes, parity with torch, the cache hit, CUDA graphs. Each test is skipped,
with its reason, where its backend cannot run (no GPU, or the package missing)."""

from __future__ import annotations

import pytest
import torch

from kasoku.backends import get_backend
from kasoku.core.components import ImageShape, ShapeProfile
from kasoku.core.parity import compare_outputs

pytestmark = [pytest.mark.gpu, pytest.mark.integration]


def _unavailable(backend: str) -> str | None:
    """Why `backend` cannot run here (None: it can)."""
    from kasoku.core.errors import KasokuError

    try:
        get_backend(backend).require()
    except KasokuError as error:
        return str(error)
    return None


def _skip_unless(backend: str):
    reason = _unavailable(backend)
    return pytest.mark.skipif(reason is not None, reason=f"{backend} unavailable: {reason}")


def _bf16_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (8, 0)


GPU_ENGINES = [
    pytest.param("tensorrt", "fp32", marks=_skip_unless("tensorrt")),
    pytest.param("tensorrt", "fp16", marks=_skip_unless("tensorrt")),
    pytest.param("tensorrt", "bf16", marks=[_skip_unless("tensorrt"), pytest.mark.skipif(
        not _bf16_gpu(), reason="bf16 needs a GPU of compute capability 8.0 or newer")]),
    pytest.param("onnxruntime-cuda", "fp32", marks=_skip_unless("onnxruntime-cuda")),
    pytest.param("onnxruntime-cuda", "fp16", marks=_skip_unless("onnxruntime-cuda")),
    pytest.param("onnxruntime-tensorrt", "fp32", marks=_skip_unless("onnxruntime-tensorrt")),
    pytest.param("onnxruntime-tensorrt", "fp16", marks=_skip_unless("onnxruntime-tensorrt")),
]
PROVIDER = {"onnxruntime-cuda": "CUDAExecutionProvider", "onnxruntime-tensorrt": "TensorrtExecutionProvider"}


def inputs_at(spec, which: str, seed: int = 5) -> dict[str, torch.Tensor]:
    """Inputs at the engine profile's "min", "opt" or "max" shape of every input (the U-Net's batch at its
    minimum is one row: no guidance)."""
    generator = torch.Generator().manual_seed(seed)
    index = ("min", "opt", "max").index(which)
    return {t.name: spec.sample_input(t, spec.profile_shapes()[t.name][index], generator) for t in spec.inputs}


def _check(name, spec, engine, inputs, precision, label):
    results = compare_outputs(name, label, spec.run_torch(inputs), engine.run(inputs), precision)
    assert all(r.passed for r in results), [r.line() for r in results]


@pytest.mark.parametrize("backend, precision", GPU_ENGINES)
def test_gpu_engines_build_run_and_match_at_the_profiles_min_opt_and_max(tiny_dir, tmp_path, backend, precision):
    from kasoku.pipeline.compiling import compile_components

    engines, report = compile_components(tiny_dir, backend=backend, precision=precision, cache=tmp_path)
    assert set(report.backends.values()) == {backend}
    for name, engine in engines.items():
        spec = engine.spec
        assert engine.device.type == "cuda"
        if backend in PROVIDER:  # the session got the provider it was built for (no silent fallback)
            assert engine.describe()["providers"].split(",")[0] == PROVIDER[backend]
        for which in ("min", "opt", "max"):
            _check(name, spec, engine, inputs_at(spec, which), precision, which)
        shape = ImageShape(2, 32, 96)  # inside the profile, off its corners
        _check(name, spec, engine, spec.sample_inputs(shape, seed=5), precision, str(shape))
    _, again = compile_components(tiny_dir, backend=backend, precision=precision, cache=tmp_path)
    assert {s.status for s in again.stages} == {"reused"}


@pytest.mark.parametrize("backend", [pytest.param("tensorrt", marks=_skip_unless("tensorrt")),
                                     pytest.param("onnxruntime-cuda", marks=_skip_unless("onnxruntime-cuda"))])
def test_cuda_graph_engines_replay_new_inputs(tiny_dir, tmp_path, backend):
    """Static-profile engines with cuda_graph: the captured graph replays each call's own inputs."""
    from kasoku.pipeline.compiling import compile_components

    shape = ImageShape(1, 64, 64)
    profile = ShapeProfile.exact(shape, guidance=True, multiple=8)
    engines, _ = compile_components(tiny_dir, backend=backend, precision="fp32", cache=tmp_path, profile=profile,
                                    cuda_graph=True)
    for name, engine in engines.items():
        for seed in (1, 2, 3):  # the first call captures, the next two replay
            _check(name, engine.spec, engine, engine.spec.sample_inputs(shape, seed=seed), "fp32", f"seed {seed}")
