"""Engines of every CPU backend against torch, the shared input checks, `auto`, `kasoku info`."""

from __future__ import annotations

import numpy as np
import pytest

from kasoku.backends import BACKENDS, BackendUnavailable, get_backend
from kasoku.backends.base import Availability
from kasoku.cli import main
from kasoku.core.components import ImageShape, ShapeOutOfProfile
from kasoku.core.errors import KasokuError
from kasoku.core.parity import compare_outputs
from tests.conftest import SD_COMPONENTS, cache_with_graphs

SHAPES = [ImageShape(1, 64, 64), ImageShape(2, 96, 48)]


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_engines_match_torch_at_two_shapes(tiny_compiled, tiny_specs, backend):
    engines, report = tiny_compiled[backend]
    assert report.backends == {name: backend for name in SD_COMPONENTS}
    for name in SD_COMPONENTS:
        spec, engine = tiny_specs[name], engines[name]
        assert engine.backend == backend
        for shape in SHAPES:
            inputs = spec.sample_inputs(shape, seed=7)
            results = compare_outputs(name, str(shape), spec.run_torch(inputs), engine.run(inputs))
            assert all(r.passed for r in results), [r.line() for r in results]


def test_engines_accept_torch_tensors_and_numpy(tiny_compiled, tiny_specs):
    engine = tiny_compiled["openvino"][0]["vae_decoder"]
    inputs = tiny_specs["vae_decoder"].sample_inputs(ImageShape(1, 64, 64))
    as_numpy = engine.run({k: v.numpy() for k, v in inputs.items()})
    as_torch = engine.run(inputs)
    np.testing.assert_array_equal(as_numpy["sample"], as_torch["sample"])


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_shape_outside_profile_names_the_range(tiny_compiled, tiny_specs, backend):
    engine = tiny_compiled[backend][0]["unet"]
    inputs = tiny_specs["unet"].sample_inputs(ImageShape(1, 256, 64))  # profile height is 32..128
    with pytest.raises(ShapeOutOfProfile, match=r"latent_height\) is 32, outside the engine's profile: 4\.\.16 "
                                                r".*image height 32\.\.128.*kasoku compile MODEL --height"):
        engine.run(inputs)
    too_many = tiny_specs["vae_decoder"].sample_inputs(ImageShape(5, 64, 64))  # batch is 1..4
    with pytest.raises(ShapeOutOfProfile, match=r"\(batch\) is 5.*1\.\.4"):
        tiny_compiled[backend][0]["vae_decoder"].run(too_many)


def test_input_names_and_ranks_are_checked(tiny_compiled, tiny_specs):
    engine = tiny_compiled["onnxruntime"][0]["vae_decoder"]
    with pytest.raises(KasokuError, match=r"missing \['latent_sample'\], unexpected \['latents'\]"):
        engine.run({"latents": np.zeros((1, 4, 8, 8), np.float32)})
    with pytest.raises(KasokuError, match="must have 4 dimensions"):
        engine.run({"latent_sample": np.zeros((4, 8, 8), np.float32)})
    with pytest.raises(KasokuError, match="dimension 1 must be 4 but is 3"):
        engine.run({"latent_sample": np.zeros((1, 3, 8, 8), np.float32)})


def test_torch_backend_is_the_reference(tiny_specs):
    engine = get_backend("torch").load(tiny_specs["text_encoder"], None, "fp32")
    inputs = tiny_specs["text_encoder"].sample_inputs(ImageShape(1, 64, 64))
    expected = tiny_specs["text_encoder"].run_torch(inputs)
    np.testing.assert_array_equal(engine.run(inputs)["last_hidden_state"], expected["last_hidden_state"])


def test_unknown_and_unavailable_backends_explain(monkeypatch):
    with pytest.raises(BackendUnavailable, match="unknown backend 'magic'; choose from auto, tensorrt"):
        get_backend("magic")
    missing = Availability("openvino", False, reason="the openvino package is not installed")
    monkeypatch.setattr(BACKENDS["openvino"], "availability", classmethod(lambda cls: missing))
    with pytest.raises(BackendUnavailable, match=r"not installed\. Install it with `pip install kasoku\[openvino\]`"):
        get_backend("openvino").require()


def test_auto_measures_once_and_remembers(tiny_dir, tiny_cache, tiny_compiled):
    from kasoku.pipeline.compiling import compile_components

    _, first = compile_components(tiny_dir, backend="auto", cache=tiny_cache, components=["vae_encoder"])
    choose = [s for s in first.stages if s.stage == "choose"]
    assert len(choose) == 1
    timings = choose[0].detail["seconds"]
    assert set(timings) == {"onnxruntime", "openvino"}
    assert first.backends["vae_encoder"] == min(timings, key=timings.get)
    _, second = compile_components(tiny_dir, backend="auto", cache=tiny_cache, components=["vae_encoder"])
    assert {s.status for s in second.stages} == {"reused"}
    assert second.backends == first.backends
    # the choice does not depend on the thread count, and passing it back builds the same engines
    _, third = compile_components(tiny_dir, backend="auto", cache=tiny_cache, components=["vae_encoder"], threads=1)
    assert third.backends == first.backends and third.built == 0
    _, resolved = compile_components(tiny_dir, backend=first.backends, cache=tiny_cache, components=["vae_encoder"])
    assert resolved.built == 0 and resolved.backends == first.backends


def test_auto_keeps_only_the_winners_engine(tiny_dir, tiny_graphs, tmp_path):
    from kasoku.core.cache import Cache
    from kasoku.pipeline.compiling import compile_components

    cache = cache_with_graphs(tmp_path / "cache", [tiny_graphs["vae_decoder"]])
    _, report = compile_components(tiny_dir, backend="auto", cache=cache, components=["vae_decoder"])
    engines = [e for e in Cache(cache).list() if e.kind == "engine"]
    assert [e.parts["backend"] for e in engines] == [report.backends["vae_decoder"]]
    built = [s for s in report.stages if s.stage == "engine" and s.status == "built"]
    assert len(built) == 1 and built[0].key == engines[0].key  # the loser's build left the report with its entry


def test_info_cli(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "onnxruntime" in out and "openvino" in out
    assert "tensorrt" in out and ("not installed" in out or "no CUDA GPU" in out or "yes" in out)


def test_openvino_entry_blob_is_the_model_caches_file_and_loads_past_its_header(tmp_path):
    """The build takes the blob OpenVINO's model cache wrote while compiling (no second in-memory copy of the
    compiled weights): after its header line it is byte for byte `export_model`'s, which is where loading starts;
    a blob written by `export_model` (older entries) loads from its first byte."""
    import openvino as ov
    from openvino import opset13 as ops

    from kasoku.backends.openvino import _blob_start, _take_cached_blob, openvino_config
    from kasoku.core.precision import Precision

    # Given again at import, as the engine's load does: an imported blob takes the importer's precision (bf16 by
    # default on a CPU with native bf16).
    fp32 = openvino_config(Precision.FP32, None)
    x = ops.parameter([-1, 32], np.float32, name="x")
    model = ov.Model([ops.matmul(x, ops.constant(np.arange(32 * 32, dtype=np.float32).reshape(32, 32)), False,
                                 False)], [x])
    assert not _take_cached_blob(tmp_path / "cache", tmp_path / "none.blob")  # nothing cached: export_model's way
    compiled = ov.Core().compile_model(model, "CPU", {**fp32, "CACHE_DIR": str(tmp_path / "cache")})
    assert _take_cached_blob(tmp_path / "cache", tmp_path / "model.blob")
    exported = compiled.export_model().getvalue()
    (tmp_path / "exported.blob").write_bytes(exported)
    taken = (tmp_path / "model.blob").read_bytes()
    assert _blob_start(tmp_path / "model.blob") > 0 and taken[_blob_start(tmp_path / "model.blob"):] == exported
    assert _blob_start(tmp_path / "exported.blob") == 0
    feed = np.ones((2, 32), np.float32)
    for name in ("model.blob", "exported.blob"):
        path = tmp_path / name
        blob = np.memmap(path, dtype=np.uint8, mode="c", offset=_blob_start(path))
        imported = ov.Core().import_model(ov.Tensor(blob, shared_memory=True), "CPU", fp32)
        np.testing.assert_array_equal(imported(feed)[0], compiled(feed)[0])
