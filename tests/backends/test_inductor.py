"""The inductor backend (AOTInductor): images as diffusers', a warm load without compiling, bf16, input checks.

The tiny txt2img components are compiled once per module (an AOTInductor compile is tens of seconds per
component on two cores) and shared by the tests that need engines; the rest are unit tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kasoku
from kasoku.backends import UnsupportedPrecision, cpu_candidates, get_backend, gpu_candidates
from kasoku.backends import inductor as inductor_backend
from kasoku.backends.base import Availability
from kasoku.build.compiler import Compiler
from kasoku.core.cache import MANIFEST, Cache, digest_key
from kasoku.core.components import ImageShape, Precision, ShapeOutOfProfile
from kasoku.core.errors import KasokuError
from kasoku.core.options import CompileOptions
from kasoku.core.parity import TOLERANCES, compare_output, compare_outputs, psnr, ssim
from kasoku.pipeline.compiling import compile_components
from tests.pipeline.test_pipeline import MIN_PSNR, generate, reference

TXT2IMG = ("text_encoder", "unet", "vae_decoder")
SHAPES = [ImageShape(1, 64, 64), ImageShape(2, 96, 48)]
needs_bf16 = pytest.mark.skipif(not inductor_backend.native_bf16(),
                                reason="this CPU has no native bf16 (AVX512-BF16 or AMX)")


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("inductor-cache")


@pytest.fixture(scope="module")
def inductor_pipe(tiny_dir, inductor_cache):
    """The tiny pipeline's txt2img components compiled once by inductor, fp32 (from the folder, as `kasoku
    compile` in a new process does: a live text encoder's config differs from its saved one, so its key does)."""
    return kasoku.KasokuPipeline.from_pretrained(tiny_dir, "inductor", components=TXT2IMG, cache_dir=inductor_cache)


# ---- engines (integration: they compile) ---------------------------------------------------------


@pytest.mark.integration
@pytest.mark.slow  # AOTInductor compiles: minutes of C++ on two cores for the first test
@pytest.mark.parametrize("guidance", [1.0, 7.5], ids=["no-cfg", "cfg"])
def test_images_match_diffusers_in_fp32(tiny_pipe, inductor_pipe, guidance):
    expected = generate(reference(tiny_pipe, "txt2img"), "txt2img", "ddim", guidance)
    actual = generate(inductor_pipe, "txt2img", "ddim", guidance)
    assert actual.shape == expected.shape == (4, 64, 64, 3)
    assert psnr(expected, actual) >= MIN_PSNR


@pytest.mark.integration
@pytest.mark.slow  # AOTInductor compiles: minutes of C++ on two cores for the first test
def test_engines_are_built_from_the_module_and_match_torch(inductor_pipe, tiny_specs):
    report = inductor_pipe.compile_report
    assert report.backends == {name: "inductor" for name in TXT2IMG}
    # no ONNX export: one engine entry per component, proven against torch when built
    assert [(s.component, s.stage, s.status) for s in report.stages] == [(n, "engine", "built") for n in TXT2IMG]
    assert all(s.detail["parity"] and s.detail["inductor_configs"]["freezing"] for s in report.stages)
    unet = next(s for s in report.stages if s.component == "unet")
    assert unet.detail["dynamic_axes"] == ["batch", "latent_height", "latent_width"]
    for name in TXT2IMG:
        engine, spec = inductor_pipe.engines[name], tiny_specs[name]
        assert engine.backend == "inductor" and engine.device.type == "cpu"
        for shape in SHAPES:
            inputs = spec.sample_inputs(shape, seed=7)
            outputs = engine.run(inputs)
            assert all(out.dtype == torch.float32 for out in outputs.values())
            results = compare_outputs(name, str(shape), spec.run_torch(inputs), outputs)
            assert all(r.passed for r in results), [r.line() for r in results]


@pytest.mark.integration
@pytest.mark.slow  # AOTInductor compiles: minutes of C++ on two cores for the first test
def test_a_second_compile_in_a_new_process_loads_without_compiling(tiny_dir, inductor_pipe, inductor_cache,
                                                                  tmp_path):
    report_file = tmp_path / "report.json"
    command = [sys.executable, "-m", "kasoku.cli", "compile", str(tiny_dir), "--backend", "inductor",
               "--components", *TXT2IMG, "--cache-dir", str(inductor_cache), "--json", str(report_file)]
    done = subprocess.run(command, env=os.environ.copy(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(report_file.read_text())
    assert [(s["component"], s["stage"], s["status"]) for s in report["stages"]] == [
        (name, "engine", "reused") for name in TXT2IMG]
    for stage in report["stages"]:
        manifest = json.loads((inductor_cache / "entries" / stage["key"] / MANIFEST).read_text())
        load = report["load_seconds"][stage["component"]]
        assert load <= 0.1 * manifest["build_seconds"], (stage["component"], load, manifest["build_seconds"])


@pytest.mark.integration
@pytest.mark.slow  # AOTInductor compiles: minutes of C++ on two cores for the first test
def test_inputs_outside_the_profile_fail_with_kasokus_error(inductor_pipe, tiny_specs):
    engine, spec = inductor_pipe.engines["unet"], tiny_specs["unet"]
    with pytest.raises(ShapeOutOfProfile, match=r"latent_height\) is 32, outside the engine's profile: 4\.\.16"):
        engine.run(spec.sample_inputs(ImageShape(1, 256, 64)))  # the profile's height is 32..128
    inputs = spec.sample_inputs(ImageShape(1, 64, 64))
    inputs["timestep"] = inputs["timestep"][:1]  # one timestep for two latents: the package would read past it
    with pytest.raises(KasokuError, match=r"'sample' and 'timestep' must agree on batch but have 2 and 1"):
        engine.run(inputs)
    with pytest.raises(ShapeOutOfProfile, match=r"\(batch\) is 5.*1\.\.4"):
        inductor_pipe.engines["vae_decoder"].run(tiny_specs["vae_decoder"].sample_inputs(ImageShape(5, 64, 64)))


@pytest.mark.integration
@pytest.mark.slow  # AOTInductor compiles: minutes of C++ on two cores for the first test
def test_the_public_loader_opens_the_same_package(inductor_pipe, inductor_cache, tiny_specs):
    """The fallback for a torch whose loader class differs runs the package as the direct load does."""
    key = next(s.key for s in inductor_pipe.compile_report.stages if s.component == "unet")
    loader = inductor_backend.public_loader(inductor_cache / "entries" / key / inductor_backend.PACKAGE_FILE, -1)
    engine = inductor_backend.InductorEngine(tiny_specs["unet"], Precision.FP32, loader, torch.device("cpu"))
    inputs = tiny_specs["unet"].sample_inputs(ImageShape(2, 32, 48), seed=1)
    torch.testing.assert_close(engine.run(inputs), inductor_pipe.engines["unet"].run(inputs), rtol=0, atol=0)


@pytest.mark.integration
@pytest.mark.slow  # AOTInductor compiles: minutes of C++ on two cores for the first test
@needs_bf16
def test_bf16_keeps_its_contract(tiny_dir, tiny_pipe, tiny_specs, inductor_pipe, inductor_cache):
    """The U-Net in bf16 (where the drift is made: it runs every step), the text encoder and VAE decoder
    the fp32 engines already in the cache: one more compile, not three."""
    precisions = {"text_encoder": "fp32", "unet": "bf16", "vae_decoder": "fp32"}
    fast = kasoku.KasokuPipeline.from_pretrained(tiny_dir, "inductor", precision=precisions, components=TXT2IMG,
                                                 cache_dir=inductor_cache)
    assert fast.compile_report.precisions == precisions
    assert {s.component: s.status for s in fast.compile_report.stages} == {
        "text_encoder": "reused", "unet": "built", "vae_decoder": "reused"}
    spec = tiny_specs["unet"]
    for shape in SHAPES:
        inputs = spec.sample_inputs(shape, seed=5)
        value = fast.engines["unet"].run(inputs)["out_sample"]
        assert value.dtype == torch.float32  # bf16 inside, fp32 at the engine's edges
        result = compare_output("unet", "out_sample", str(shape), spec.run_torch(inputs)["out_sample"], value,
                                Precision.BF16)
        assert result.passed, result.line()
        assert result.max_abs > 0  # it really computes in bf16
    contract = TOLERANCES[Precision.BF16]
    for pipe in (inductor_pipe, fast):  # the model's own scheduler for both (the image tests swap inductor_pipe's)
        pipe.scheduler = type(tiny_pipe.scheduler).from_config(tiny_pipe.scheduler.config)
    images = [pipe("a photo of a cat", num_inference_steps=contract.image_steps, output_type="np",
                   generator=torch.Generator().manual_seed(0)).images for pipe in (inductor_pipe, fast)]
    assert psnr(*images) >= contract.image_psnr_db and ssim(*images) >= contract.image_ssim


# ---- decisions without a compile (unit) ---------------------------------------------------------------


def test_the_engine_key_chains_to_the_module_weights_not_an_export(tiny_specs, tmp_path):
    compiler = Compiler(Cache(tmp_path), CompileOptions(backend="inductor"))
    spec = tiny_specs["unet"]
    chain = compiler.chain(spec, get_backend("inductor"))
    assert chain.export is None and chain.optimized is None
    assert chain.engine["source"] == digest_key(compiler.module_parts(spec))
    assert compiler.module_parts(spec)["weights"] == spec.fingerprint
    engine = chain.engine
    assert engine["backend"] == "inductor" and engine["version"] == torch.__version__
    assert engine["device"].startswith("cpu: ") and engine["precision"] == "fp32"
    assert engine["profile"] == spec.profile.to_dict() and engine["inductor_configs"]["freezing"] is True
    bf16 = Compiler(Cache(tmp_path), CompileOptions(backend="inductor", precision="bf16"))
    assert bf16.chain(spec, get_backend("inductor")).engine != engine


def test_precisions_refused_with_a_reason(monkeypatch):
    backend = get_backend("inductor")
    with pytest.raises(UnsupportedPrecision, match="int8 is NNCF's, on OpenVINO"):
        backend.check_precision("int8")
    with pytest.raises(UnsupportedPrecision, match="fp16 is a GPU precision for inductor"):
        backend.check_precision("fp16")
    monkeypatch.setattr(inductor_backend, "cpu_flags", lambda: ["avx2", "avx512f"])
    with pytest.raises(UnsupportedPrecision, match="no native bf16"):
        backend.check_precision("bf16")
    monkeypatch.setattr(inductor_backend, "cpu_flags", lambda: ["avx2", "avx512f", "amx_tile", "amx_bf16"])
    backend.check_precision("bf16")
    monkeypatch.setattr(inductor_backend, "target_device", lambda: torch.device("cuda", 0))
    for precision in ("fp32", "bf16", "fp16"):  # a GPU builds all three
        backend.check_precision(precision)


def test_a_missing_compiler_makes_the_backend_unavailable(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-x")
    info = inductor_backend.InductorBackend.availability()
    assert not info.available and "no C++ compiler (no-such-compiler-x" in info.reason


def test_auto_takes_inductor_on_a_gpu_and_only_when_asked_on_a_cpu(monkeypatch):
    assert "inductor" not in cpu_candidates()
    monkeypatch.setenv("KASOKU_AUTO_INDUCTOR", "1")
    assert cpu_candidates()[-1] == "inductor"
    monkeypatch.setattr("kasoku.backends.target_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(inductor_backend.InductorBackend, "availability",
                        classmethod(lambda cls: Availability("inductor", True, torch.__version__, "cuda: GPU (sm_90)")))
    assert gpu_candidates()[-1] == "inductor"


def test_the_loader_falls_back_to_the_public_api_where_its_signature_differs(monkeypatch, tmp_path):
    """Loading takes torch's package loader directly (2.8 to 2.13 share its signature); a torch whose
    loader takes other arguments is loaded through aoti_load_package, without its ISA probe."""
    import torch._inductor

    class OtherLoader:
        def __init__(self, *args):
            raise TypeError("incompatible constructor arguments")

    calls = []

    def public_load(path, device_index=-1):
        from torch._inductor import config

        calls.append((path, device_index, config.cpp.vec_isa_ok))
        return type("Compiled", (), {"loader": "the loader"})()

    monkeypatch.setattr(torch._C._aoti, "AOTIModelPackageLoader", OtherLoader)
    monkeypatch.setattr(torch._inductor, "aoti_load_package", public_load)
    assert inductor_backend.load_package(tmp_path / "model.pt2", torch.device("cpu")) == "the loader"
    assert calls == [(str(tmp_path / "model.pt2"), -1, True)]


def test_the_declared_torch_range_holds_the_gpu_machines_and_this_pin():
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    declared = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch"))
    allowed = SpecifierSet(declared.removeprefix("torch"))
    assert Version("2.11.0") in allowed and Version("2.13.0") in allowed  # the GPU machines' torch, the CPU pin
    assert Version(torch.__version__.split("+")[0]) in allowed
    assert Version("2.10.0") not in allowed


# ---- a GPU (skipped without one) ----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.integration
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU is visible to torch")
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_gpu_engines_keep_their_contract(tiny_dir, tiny_specs, tmp_path, precision):
    engines, report = compile_components(tiny_dir, backend="inductor", precision=precision, components=["unet"],
                                         cache=tmp_path)
    engine, spec = engines["unet"], tiny_specs["unet"]
    assert engine.device.type == "cuda" and report.stages[0].detail["device"] == "cuda:0"
    for shape in SHAPES:
        inputs = spec.sample_inputs(shape, seed=5)
        outputs = engine.run(inputs)
        assert outputs["out_sample"].device.type == "cuda"
        results = compare_outputs("unet", str(shape), spec.run_torch(inputs), outputs, Precision(precision))
        assert all(r.passed for r in results), [r.line() for r in results]
    _, again = compile_components(tiny_dir, backend="inductor", precision=precision, components=["unet"],
                                  cache=tmp_path)
    assert [s.status for s in again.stages] == ["reused"]
    manifest = json.loads((tmp_path / "entries" / again.stages[0].key / MANIFEST).read_text())
    assert again.load_seconds["unet"] <= 0.1 * manifest["build_seconds"]
