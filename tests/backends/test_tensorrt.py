"""TensorRT without a GPU: the precision plan per TensorRT version and GPU, the profile, the
builder-config mapping, provider options, keys and the error when tensorrt or a GPU is missing.
tests/backends/test_gpu.py builds and runs real engines."""

from __future__ import annotations

import importlib.util

import pytest

from kasoku.backends import BackendUnavailable, UnsupportedPrecision, get_backend
from kasoku.backends.base import Availability, GpuIdentity
from kasoku.backends.onnxruntime import provider_options
from kasoku.backends.tensorrt import (
    TensorRTBackend,
    TrtPrecisionPlan,
    trt_build_options,
    trt_major,
    trt_precision_plan,
    trt_profile,
)
from kasoku.core.components import Precision
from kasoku.core.options import CompileOptions

H200 = (9, 0)
TURING = (7, 5)


@pytest.mark.parametrize("version, precision, capability, plan", [
    # TensorRT 10 (the FP16/BF16 builder flags exist; deprecated from 10.12): the flag on the fp32 graph
    ("10.0.1", "fp16", TURING, TrtPrecisionPlan("FP16", False, None)),
    ("10.13.3.9", "fp16", H200, TrtPrecisionPlan("FP16", False, None)),
    ("10.16.1.11", "bf16", H200, TrtPrecisionPlan("BF16", False, None)),
    # TensorRT 11 removed them: a strongly typed network from the graph converted to that type
    ("11.0.0.114", "fp16", TURING, TrtPrecisionPlan(None, True, "fp16")),
    ("11.4.0.106", "fp16", H200, TrtPrecisionPlan(None, True, "fp16")),
    ("11.4.0.106", "bf16", (8, 0), TrtPrecisionPlan(None, True, "bf16")),
    # fp32 is the graph as it is on every version
    ("10.9.0.34", "fp32", TURING, TrtPrecisionPlan(None, False, None)),
    ("11.4.0.106", "fp32", None, TrtPrecisionPlan(None, False, None)),
])
def test_precision_plan_follows_the_installed_tensorrt(version, precision, capability, plan):
    assert trt_precision_plan(precision, version, capability) == plan


def test_bf16_needs_an_ampere_or_newer_gpu():
    for version in ("10.13.0.35", "11.4.0.106"):
        with pytest.raises(UnsupportedPrecision, match=r"compute capability 8\.0 .*sm_75.*--precision fp16"):
            trt_precision_plan("bf16", version, TURING)
        with pytest.raises(UnsupportedPrecision, match="no GPU is visible"):
            trt_precision_plan("bf16", version, None)
    with pytest.raises(UnsupportedPrecision, match="int8"):
        trt_precision_plan("int8", "10.13.0.35", H200)


def test_trt_major_reads_version_strings():
    assert [trt_major(v) for v in ("10.13.3.9", "11.0.0.114", "10.14.1.48.post1")] == [10, 11, 10]
    with pytest.raises(ValueError, match="not a TensorRT version"):
        trt_major("unknown")


def _fake_tensorrt(monkeypatch, version: str, capability=H200):
    """TensorRT `version` on a GPU of `capability`, as package metadata and torch would report them."""
    import kasoku.backends.tensorrt as trt_module

    identity = GpuIdentity("NVIDIA Test GPU", capability, "580.159.03")
    monkeypatch.setattr(trt_module, "installed_trt_version", lambda: version)
    monkeypatch.setattr(trt_module, "gpu_identity", lambda index=0: identity)
    monkeypatch.setattr(TensorRTBackend, "availability",
                        classmethod(lambda cls: Availability("tensorrt", True, version, str(identity))))
    return identity


@pytest.mark.parametrize("version, fp16_passes", [
    ("10.13.3.9", ["cleanup", "fold_constants", "infer_shapes"]),
    ("11.4.0.106", ["cleanup", "fold_constants", "infer_shapes", "fp16"]),
])
def test_the_backend_asks_for_the_fp16_graph_only_where_the_network_is_strongly_typed(monkeypatch, version,
                                                                                      fp16_passes):
    _fake_tensorrt(monkeypatch, version)
    backend = TensorRTBackend()
    assert backend.optimization_passes(Precision.FP16) == fp16_passes
    assert backend.optimization_passes(Precision.FP32) == ["cleanup", "fold_constants", "infer_shapes"]
    assert backend.optimization_passes(Precision.BF16)[-1:] == (["bf16"] if version.startswith("11") else
                                                                ["infer_shapes"])


def test_bf16_is_refused_on_an_old_gpu_before_any_work(monkeypatch):
    _fake_tensorrt(monkeypatch, "10.13.3.9", TURING)
    with pytest.raises(UnsupportedPrecision, match="sm_75"):
        TensorRTBackend().check_precision("bf16")
    TensorRTBackend().check_precision("fp16")


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
    flag = trt_build_options(tiny_specs["unet"], trt_precision_plan("fp16", "10.13.3.9", H200), 5,
                             tmp_path / "timing.cache")
    assert flag.fp16 and not flag.bf16 and not flag.strongly_typed and not flag.tf32
    assert flag.builder_optimization_level == 5 and flag.timing_cache.endswith("timing.cache")
    typed = trt_build_options(tiny_specs["unet"], trt_precision_plan("fp16", "11.4.0.106", H200), 3, None)
    assert typed.strongly_typed and not typed.fp16 and not typed.bf16 and not typed.tf32
    bf16 = trt_build_options(tiny_specs["unet"], trt_precision_plan("bf16", "10.16.1.11", H200), 3, None)
    assert bf16.bf16 and not bf16.fp16
    fp32 = trt_build_options(tiny_specs["unet"], trt_precision_plan("fp32", "11.4.0.106", H200), 3, None)
    assert not (fp32.fp16 or fp32.bf16 or fp32.strongly_typed or fp32.tf32) and fp32.timing_cache is None
    with pytest.raises(ValueError, match="0..5"):
        trt_build_options(tiny_specs["unet"], trt_precision_plan("fp32", "10.9", H200), 9, None)
    assert fp32.refittable == ()  # plain engines: no weight is refittable (no speed cost)
    run_time = frozenset({"unet.b.to_q.weight", "unet.a.to_q.weight"})
    assert trt_build_options(tiny_specs["unet"], trt_precision_plan("fp32", "10.9", H200), 3, None,
                             run_time).refittable == ("unet.a.to_q.weight", "unet.b.to_q.weight")


@pytest.mark.skipif(importlib.util.find_spec("polygraphy") is None,
                    reason="polygraphy (kasoku[tensorrt]) not installed")
def test_polygraphy_config_carries_the_options(tiny_specs):
    from kasoku.backends.tensorrt import polygraphy_config

    config = polygraphy_config(trt_build_options(tiny_specs["unet"], trt_precision_plan("fp16", "10.9", H200), 4,
                                                 None))
    assert config.fp16 and not config.bf16 and not config.tf32 and config.builder_optimization_level == 4
    assert set(config.profiles[0].keys()) == {"sample", "timestep", "encoder_hidden_states"}
    # TensorRT 11 has no precision flags: the config asks for none
    typed = polygraphy_config(trt_build_options(tiny_specs["unet"], trt_precision_plan("fp16", "11.4", H200), 3,
                                                None))
    assert not typed.fp16 and not typed.bf16 and not typed.tf32


def test_engine_key_includes_gpu_identity_version_precision_and_level(monkeypatch):
    identity = _fake_tensorrt(monkeypatch, "10.9.0.34")
    key = TensorRTBackend(CompileOptions(trt_opt_level=5)).key(Precision.FP16)
    assert key["backend"] == "tensorrt" and key["version"] == "10.9.0.34"
    assert key["device"] == str(identity) == "NVIDIA Test GPU (sm_90, driver 580.159.03)"
    assert key["precision"] == "fp16" and key["builder_optimization_level"] == 5
    assert key != TensorRTBackend(CompileOptions(trt_opt_level=3)).key(Precision.FP16)


def test_one_timing_cache_per_tensorrt_version_and_gpu(monkeypatch, tmp_path):
    folders = set()
    for version, capability in (("10.13.3.9", H200), ("11.4.0.106", H200), ("10.13.3.9", (8, 0))):
        _fake_tensorrt(monkeypatch, version, capability)
        path = TensorRTBackend(shared_dir=tmp_path).timing_cache(tmp_path / "entry")
        assert path.parent.parent == tmp_path and version in path.parent.name and "580.159.03" in path.parent.name
        folders.add(path.parent)
    assert len(folders) == 3


def test_ort_tensorrt_execution_provider_options(tiny_specs, tmp_path):
    providers = provider_options(tiny_specs["vae_decoder"], "tensorrt", Precision.FP16, tmp_path)
    name, options = providers[0]
    assert name == "TensorrtExecutionProvider"
    assert options["trt_fp16_enable"] is True  # no tensorrt package here: TensorRT 10, as onnxruntime-gpu's
    assert "trt_load_user_initializer" not in options
    assert options["trt_profile_min_shapes"] == "latent_sample:1x4x4x4"
    assert options["trt_profile_opt_shapes"] == "latent_sample:1x4x8x8"
    assert options["trt_profile_max_shapes"] == "latent_sample:4x4x16x16"
    assert options["trt_engine_cache_enable"] and options["trt_engine_cache_path"].startswith(str(tmp_path))
    assert providers[-1] == "CPUExecutionProvider"
    assert provider_options(tiny_specs["unet"], "cpu", Precision.FP32, None) == ["CPUExecutionProvider"]
    with pytest.raises(ValueError, match="must be one of"):
        provider_options(tiny_specs["unet"], "tpu", Precision.FP32, None)


def test_ort_tensorrt_provider_options_follow_tensorrt_11_and_big_models(tiny_specs):
    spec = tiny_specs["unet"]
    _, typed = provider_options(spec, "tensorrt", Precision.FP16, None, trt_version="11.4.0.106")[0]
    assert typed["trt_fp16_enable"] is False  # the flag is gone: the fp16 graph (fp16 pass) says it
    _, big = provider_options(spec, "tensorrt", Precision.FP32, None, external_data=True)[0]
    assert big["trt_load_user_initializer"] is True  # weights over 2 GB handed over from memory
    assert provider_options(spec, "cuda", Precision.FP16, None, cuda_graph=True)[0] == (
        "CUDAExecutionProvider", {"enable_cuda_graph": True})
    assert provider_options(spec, "cuda", Precision.FP16, None)[0] == ("CUDAExecutionProvider", {})


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
