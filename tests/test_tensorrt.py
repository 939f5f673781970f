"""TensorRT without a GPU: the profile, the builder-config mapping, provider options, keys and
the error when tensorrt or a GPU is missing. tests/test_gpu.py builds and runs real engines."""

from __future__ import annotations

import importlib.util

import pytest

from kasoku.backends import BackendUnavailable, get_backend
from kasoku.backends.onnxruntime import provider_options
from kasoku.backends.tensorrt import TensorRTBackend, trt_build_options, trt_profile
from kasoku.components import Precision
from kasoku.options import CompileOptions


def test_profile_comes_from_the_spec(tiny_specs):
    profile = trt_profile(tiny_specs["unet"])
    # tiny profile: 1..4 images of 32..128 px; the U-Net sees 2x images (guidance), latents at 1/8
    assert profile["sample"] == ((1, 4, 4, 4), (2, 4, 8, 8), (8, 4, 16, 16))
    assert profile["timestep"] == ((1,), (2,), (8,))
    assert profile["encoder_hidden_states"] == ((1, 77, 32), (2, 77, 32), (8, 77, 32))
    assert trt_profile(tiny_specs["vae_decoder"])["latent_sample"] == ((1, 4, 4, 4), (1, 4, 8, 8), (4, 4, 16, 16))
    assert trt_profile(tiny_specs["vae_encoder"])["sample"] == ((1, 3, 32, 32), (1, 3, 64, 64), (4, 3, 128, 128))
    # the prompts and the negative prompts are encoded in separate calls: one row per image
    assert trt_profile(tiny_specs["text_encoder"])["input_ids"] == ((1, 77), (1, 77), (4, 77))


def test_builder_options_mapping(tiny_specs, tmp_path):
    fp16 = trt_build_options(tiny_specs["unet"], Precision.FP16, 5, tmp_path / "timing.cache")
    assert fp16.fp16 and not fp16.tf32
    assert fp16.builder_optimization_level == 5 and fp16.timing_cache.endswith("timing.cache")
    fp32 = trt_build_options(tiny_specs["unet"], Precision.FP32, 3, None)
    assert not fp32.fp16 and not fp32.tf32 and fp32.timing_cache is None
    with pytest.raises(ValueError, match="0..5"):
        trt_build_options(tiny_specs["unet"], Precision.FP32, 9, None)
    assert fp32.refittable == ()  # plain engines: no weight is refittable (no speed cost)
    run_time = frozenset({"unet.b.to_q.weight", "unet.a.to_q.weight"})
    assert trt_build_options(tiny_specs["unet"], Precision.FP32, 3, None, run_time).refittable == (
        "unet.a.to_q.weight", "unet.b.to_q.weight")


@pytest.mark.skipif(importlib.util.find_spec("polygraphy") is None,
                    reason="polygraphy (kasoku[tensorrt]) not installed")
def test_polygraphy_config_carries_the_options(tiny_specs):
    from kasoku.backends.tensorrt import polygraphy_config

    config = polygraphy_config(trt_build_options(tiny_specs["unet"], Precision.FP16, 4, None))
    assert config.fp16 and config.builder_optimization_level == 4
    assert set(config.profiles[0].keys()) == {"sample", "timestep", "encoder_hidden_states"}


def test_engine_key_includes_device_version_precision_and_level(monkeypatch):
    from kasoku.backends.base import Availability

    monkeypatch.setattr(TensorRTBackend, "availability",
                        classmethod(lambda cls: Availability("tensorrt", True, "10.9", "NVIDIA H200 (sm_90)")))
    key = TensorRTBackend(CompileOptions(trt_opt_level=5)).key(Precision.FP16)
    assert key["backend"] == "tensorrt" and key["version"] == "10.9" and key["device"] == "NVIDIA H200 (sm_90)"
    assert key["precision"] == "fp16" and key["builder_optimization_level"] == 5
    assert key != TensorRTBackend(CompileOptions(trt_opt_level=3)).key(Precision.FP16)


def test_ort_tensorrt_execution_provider_options(tiny_specs, tmp_path):
    providers = provider_options(tiny_specs["vae_decoder"], "tensorrt", Precision.FP16, tmp_path)
    name, options = providers[0]
    assert name == "TensorrtExecutionProvider"
    assert options["trt_fp16_enable"] is True
    assert options["trt_profile_min_shapes"] == "latent_sample:1x4x4x4"
    assert options["trt_profile_opt_shapes"] == "latent_sample:1x4x8x8"
    assert options["trt_profile_max_shapes"] == "latent_sample:4x4x16x16"
    assert options["trt_engine_cache_enable"] and options["trt_engine_cache_path"].startswith(str(tmp_path))
    assert providers[-1] == "CPUExecutionProvider"
    assert provider_options(tiny_specs["unet"], "cpu", Precision.FP32, None) == ["CPUExecutionProvider"]
    with pytest.raises(ValueError, match="must be one of"):
        provider_options(tiny_specs["unet"], "tpu", Precision.FP32, None)


@pytest.mark.skipif(TensorRTBackend.availability().available, reason="TensorRT and a GPU are present here")
def test_missing_tensorrt_or_gpu_is_a_clear_error():
    reason = TensorRTBackend.availability().reason
    assert reason in ("the tensorrt package is not installed", "the polygraphy package is not installed",
                      "no CUDA GPU is visible to torch")
    with pytest.raises(BackendUnavailable, match=r"tensorrt backend is unavailable: .*pip install kasoku\[tensorrt\]"):
        get_backend("tensorrt").require()


def test_ort_cuda_without_the_provider_is_a_clear_error(tiny_specs, tmp_path):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu with CUDA is installed here")
    backend = get_backend("onnxruntime-cuda")
    with pytest.raises(BackendUnavailable, match=r"no CUDAExecutionProvider.*kasoku\[gpu\]"):
        backend._session(tmp_path / "missing.onnx", tiny_specs["unet"], Precision.FP32, None)
