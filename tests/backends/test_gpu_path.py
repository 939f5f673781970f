"""The GPU path without a GPU: provider fallback detection on real ONNX Runtime sessions, the key parts of
GPU entries, and the CUDA-graph argument checks. tests/backends/test_gpu.py runs the same engines on a GPU."""

from __future__ import annotations

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from kasoku.backends import get_backend
from kasoku.backends.base import GpuIdentity, cpu_name, driver_from_proc
from kasoku.backends.onnxruntime import (
    OnnxRuntimeBackend,
    OnnxRuntimeEngine,
    ProviderFallback,
    check_provider,
    native_stderr,
)
from kasoku.core.components import ImageShape, Precision, ShapeProfile
from kasoku.core.options import CompileOptions, InvalidOptions

FAKE_GPU = GpuIdentity("NVIDIA Test GPU", (9, 0), "580.159.03")
STATIC = ShapeProfile.exact(ImageShape(1, 64, 64), guidance=True, multiple=8)


@pytest.fixture
def add_model(tmp_path):
    """y = x + 1 as an ONNX file."""
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    graph = helper.make_graph([helper.make_node("Add", ["x", "one"], ["y"])], "add",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], [one])
    path = tmp_path / "add.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path


# ---- provider fallback -----------------------------------------------------------------------------


def test_a_session_that_fell_back_is_an_error_naming_the_provider_and_the_reason(add_model):
    """ONNX Runtime asked for CUDA on a machine without it creates a CPU session, with a warning only: the
    check turns that into an error that names the provider and carries ONNX Runtime's reason."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu with CUDA is installed here: this session would not fall back")
    with native_stderr() as log:
        session = ort.InferenceSession(str(add_model), providers=[("CUDAExecutionProvider", {}),
                                                                  "CPUExecutionProvider"])
    assert session.get_providers() == ["CPUExecutionProvider"]  # the silent fallback
    with pytest.raises(ProviderFallback, match=r"without the CUDAExecutionProvider .*runs on CPUExecutionProvider"
                                               r".*CUDAExecutionProvider.* not in available provider names"):
        check_provider("CUDAExecutionProvider", session.get_providers(), "".join(log))


def test_the_fallback_check_is_a_function_of_the_asked_and_the_given_providers(add_model):
    import onnxruntime as ort

    session = ort.InferenceSession(str(add_model), providers=["CPUExecutionProvider"])
    check_provider("CPUExecutionProvider", session.get_providers())  # got what was asked: no error
    check_provider("TensorrtExecutionProvider", ["TensorrtExecutionProvider", "CUDAExecutionProvider",
                                                 "CPUExecutionProvider"])
    for asked in ("TensorrtExecutionProvider", "CUDAExecutionProvider"):
        with pytest.raises(ProviderFallback, match=f"without the {asked} .*usually its CUDA, cuDNN or TensorRT"):
            check_provider(asked, session.get_providers())
    with pytest.raises(ProviderFallback, match="runs on CUDAExecutionProvider, CPUExecutionProvider"):
        check_provider("TensorrtExecutionProvider", ["CUDAExecutionProvider", "CPUExecutionProvider"])


def test_native_stderr_captures_and_restores(capfd):
    import os

    with native_stderr() as log:
        os.write(2, b"from native code\n")
    os.write(2, b"after\n")
    assert log[0] == "from native code\n"
    assert capfd.readouterr().err == "after\n"


@pytest.mark.integration  # exports the tiny text encoder
def test_a_fallen_back_gpu_engine_is_never_cached(tiny_dir, tmp_path, monkeypatch):
    """onnxruntime-gpu whose CUDA provider cannot start lists it as available; the session falls back to
    the CPU. The build fails with the reason, and no engine entry is left under onnxruntime-cuda."""
    import onnxruntime as ort

    import kasoku.backends.onnxruntime as ort_backend
    from kasoku.core.cache import Cache
    from kasoku.pipeline.compiling import compile_components

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu with CUDA is installed here: this session would not fall back")
    available = ort.get_available_providers()
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", *available])
    monkeypatch.setattr(ort_backend, "gpu_identity", lambda index=0: FAKE_GPU)
    with pytest.raises(ProviderFallback, match="CUDAExecutionProvider"):
        compile_components(tiny_dir, backend="onnxruntime-cuda", components=["text_encoder"], cache=tmp_path,
                           check_parity=False)
    kinds = [entry.kind for entry in Cache(tmp_path).list(include_unreadable=True)]
    assert kinds == ["graph"], kinds  # the graph is kept; no engine, no half-built folder


# ---- key parts -------------------------------------------------------------------------------------


def test_gpu_entries_record_the_gpu_not_the_cpu(monkeypatch):
    import kasoku.backends.onnxruntime as ort_backend

    monkeypatch.setattr(ort_backend, "gpu_identity", lambda index=0: FAKE_GPU)
    monkeypatch.setattr(ort_backend, "installed_trt_version", lambda: "11.4.0.106")
    cuda = OnnxRuntimeBackend(provider="cuda").key(Precision.FP16)
    trt = OnnxRuntimeBackend(provider="tensorrt").key(Precision.FP16)
    for key in (cuda, trt):
        assert key["device"] == "NVIDIA Test GPU (sm_90, driver 580.159.03)"
        assert not any(cpu_name() in str(value) for value in key.values()), key
        assert key["version"]  # onnxruntime's
    assert cuda["provider"] == "cuda" and trt["provider"] == "tensorrt" and trt["tensorrt"] == "11.4.0.106"
    assert cpu_name() in OnnxRuntimeBackend().key(Precision.FP32)["device"]  # CPU entries as they were


def test_a_gpu_key_without_a_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    from kasoku.backends import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="onnxruntime-cuda backend needs an NVIDIA GPU"):
        OnnxRuntimeBackend(provider="cuda").key(Precision.FP16)


def test_driver_version_from_the_drivers_proc_file():
    text = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.03  Thu Oct  2 19:54:06 UTC 2025\n"
            "GCC version:  gcc version 12.3.0 (GCC)\n")
    assert driver_from_proc(text) == "580.159.03"
    assert driver_from_proc("") is None


# ---- CUDA graphs: argument checks --------------------------------------------------------------------


def test_cuda_graph_needs_a_static_profile():
    with pytest.raises(InvalidOptions, match=r"static shape profile.*none was given"):
        CompileOptions(backend="tensorrt", cuda_graph=True)
    dynamic = ShapeProfile.from_ranges((1, 1, 4), (256, 512, 768), (256, 512, 768), 8, guidance=True)
    with pytest.raises(InvalidOptions, match=r"images 1\.\.4, height 256\.\.768, width 256\.\.768, with guidance"):
        CompileOptions(backend="tensorrt", cuda_graph=True, profile=dynamic)
    one_shape_either_guidance = ShapeProfile.exact(ImageShape(1, 512, 512), guidance=True, multiple=8)
    one_shape_either_guidance = ShapeProfile(one_shape_either_guidance.min, one_shape_either_guidance.opt,
                                             one_shape_either_guidance.max, 8, None)
    with pytest.raises(InvalidOptions, match="guidance either way"):  # the U-Net's batch would still vary
        CompileOptions(backend="tensorrt", cuda_graph=True, profile=one_shape_either_guidance)
    assert CompileOptions(backend="tensorrt", cuda_graph=True, profile=STATIC).cuda_graph


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino", "torch", "onnxruntime-tensorrt"])
def test_cuda_graph_is_refused_by_backends_that_do_not_replay_them(backend):
    options = CompileOptions(backend=backend, cuda_graph=True, profile=STATIC)
    with pytest.raises(InvalidOptions, match=f"which the {backend} backend does not do"):
        get_backend(backend, options).check_cuda_graph()


def test_cuda_graph_is_accepted_by_tensorrt_and_onnxruntime_cuda():
    options = CompileOptions(cuda_graph=True, profile=STATIC)
    for backend in ("tensorrt", "onnxruntime-cuda"):
        get_backend(backend, options).check_cuda_graph()


def test_an_engine_of_a_dynamic_spec_is_refused_before_its_build(tiny_specs):
    """Specs handed over directly keep their own profile: the backend checks it too."""
    backend = get_backend("tensorrt", CompileOptions(backend="tensorrt", cuda_graph=True, profile=STATIC))
    with pytest.raises(InvalidOptions, match="static shape profile"):
        backend.check_engine_profile(tiny_specs["unet"])


@pytest.mark.integration  # uses the tiny compiled engines
def test_ort_static_buffer_replay_matches_plain_runs(tiny_compiled):
    """The CUDA-graph engine's IO binding (inputs copied into buffers bound once, outputs copied out) on the
    CPU provider, where ONNX Runtime captures nothing: every call returns its own inputs' result."""
    engine = tiny_compiled["onnxruntime"][0]["vae_decoder"]
    replay = OnnxRuntimeEngine(engine.spec, engine.precision, engine.session, torch.device("cpu"), cuda_graph=True)
    first = engine.spec.sample_inputs(ImageShape(1, 64, 64), seed=1)
    second = engine.spec.sample_inputs(ImageShape(1, 64, 64), seed=2)
    a, b = replay.run(first), replay.run(second)
    expected_a, expected_b = engine.run(first), engine.run(second)
    for name in engine.spec.output_names:
        assert torch.equal(a[name], expected_a[name]) and torch.equal(b[name], expected_b[name])
        assert not torch.equal(a[name], b[name])  # the first result is not overwritten by the second call
