"""`kasoku compile`: every stage through the cache; reuse, new keys, corruption, concurrency."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kasoku.build.compiler import Compiler
from kasoku.cli import main
from kasoku.core.cache import Cache, CorruptEntryWarning, digest_key
from kasoku.core.components import ShapeProfile
from kasoku.core.options import CompileOptions
from kasoku.model.pipeline_model import Model
from kasoku.pipeline.compiling import compile_components
from tests.conftest import SD_COMPONENTS

pytestmark = pytest.mark.integration  # exports or builds engines


def test_second_compile_opens_only_the_engine_entries(tiny_dir, tiny_cache, tiny_compiled, monkeypatch):
    _, first = tiny_compiled["onnxruntime"]
    assert {s.stage for s in first.stages} == {"export", "engine"}  # ONNX Runtime optimizes the graph itself
    hashed = []
    monkeypatch.setattr("kasoku.core.cache.file_sha256", lambda path: hashed.append(path) or "x")
    _, again = compile_components(tiny_dir, backend="onnxruntime", cache=tiny_cache)
    # keys are computed, not walked: one cheap hit per component, on the engine entry itself
    assert [(s.component, s.stage, s.status) for s in again.stages] == [
        (name, "engine", "reused") for name in SD_COMPONENTS]
    assert [s.key for s in again.stages] == [s.key for s in first.stages if s.stage == "engine"]
    assert hashed == []  # no file of any entry is checksummed on a hit
    assert set(again.load_seconds) == set(SD_COMPONENTS)


def test_a_warm_start_from_a_folder_reads_no_weights(tiny_dir, tiny_cache, tiny_compiled, monkeypatch):
    from kasoku.model import loading

    monkeypatch.setattr(loading, "real_module", lambda pipe, attr: pytest.fail(f"loaded the {attr} weights"))
    engines, report = compile_components(tiny_dir, backend="onnxruntime", cache=tiny_cache)
    assert report.built == 0 and set(engines) == set(SD_COMPONENTS)


def test_backends_share_the_export_but_not_engines(tiny_compiled):
    ort = {(s.component, s.stage): s.key for s in tiny_compiled["onnxruntime"][1].stages}
    ov = {(s.component, s.stage): s.key for s in tiny_compiled["openvino"][1].stages}
    for name in SD_COMPONENTS:
        assert ort[(name, "export")] == ov[(name, "export")]
        assert ort[(name, "engine")] != ov[(name, "engine")]
    assert not any(stage == "optimize" for _, stage in [*ort, *ov])  # both optimize the graph themselves


def test_only_the_engine_is_proven_and_a_failure_names_the_stage(tiny_dir, tmp_path, monkeypatch):
    """Parity is checked once, on the engine (at two shapes); when it fails, the chain's ONNX files are
    checked to say which stage broke it."""
    import kasoku.build.compiler
    from kasoku.core.parity import ParityError

    _, report = compile_components(tiny_dir, backend="onnxruntime", cache=tmp_path, components=["text_encoder"])
    engine = next(s for s in report.stages if s.stage == "engine")
    assert len({p["shape"] for p in engine.detail["parity"]}) == 2
    assert "parity" not in next(s for s in report.stages if s.stage == "export").detail

    def export_then_break(spec, path, **kwargs):  # a broken exporter: its graph computes something else
        import numpy as np
        import onnx
        from onnx import helper, numpy_helper

        result = real_export(spec, path, **kwargs)
        model = onnx.load(str(path))
        output = model.graph.output[0].name
        for node in model.graph.node:
            for i, name in enumerate(node.output):
                if name == output:
                    node.output[i] = f"{output}.unbroken"
        model.graph.node.append(helper.make_node("Mul", [f"{output}.unbroken", "minus_two"], [output]))
        model.graph.initializer.append(numpy_helper.from_array(np.array(-2.0, np.float32), "minus_two"))
        onnx.save(model, str(path))
        return result

    real_export = kasoku.build.compiler.export_graph
    monkeypatch.setattr(kasoku.build.compiler, "export_graph", export_then_break)
    with pytest.raises(ParityError, match="export of text_encoder"):
        compile_components(tiny_dir, backend="onnxruntime", cache=tmp_path / "other", components=["text_encoder"])


def test_precision_and_profile_make_new_entries(tiny_dir, tiny_cache, tiny_compiled):
    base = {(s.component, s.stage): s.key for s in tiny_compiled["onnxruntime"][1].stages}
    _, fp16 = compile_components(tiny_dir, backend="onnxruntime", precision="fp16", cache=tiny_cache,
                                 components=["text_encoder"])
    statuses = fp16.statuses()
    assert statuses[("text_encoder", "export")] == "reused"  # the architecture graph (no weights) stays
    assert statuses[("text_encoder", "optimize")] == "built"  # the fp16 pass
    assert statuses[("text_encoder", "engine")] == "built"
    wider = ShapeProfile.from_ranges((1, 1, 2), (32, 64, 160), (32, 64, 160), 16)
    _, other = compile_components(tiny_dir, backend="onnxruntime", profile=wider, cache=tiny_cache,
                                  components=["text_encoder"])
    keys = {s.stage: s.key for s in other.stages}
    assert keys["engine"] != base[("text_encoder", "engine")]
    assert other.statuses()[("text_encoder", "engine")] == "built"
    # the graph is keyed by how it is traced: other image sizes change the VAE's, not the text encoder's
    narrower = ShapeProfile.from_ranges((1, 1, 2), (32, 64, 96), (32, 64, 96), 16)
    _, again = compile_components(tiny_dir, backend="onnxruntime", profile=narrower, cache=tiny_cache,
                                  components=["text_encoder"])
    assert again.statuses()[("text_encoder", "export")] == "reused"
    assert again.statuses()[("text_encoder", "engine")] == "built"
    model = Model.load(tiny_dir, lazy=True)
    compiler = Compiler(tiny_cache, CompileOptions(backend="onnxruntime"))
    graph_keys = {profile: {name: digest_key(compiler.export_parts(spec)) for name, spec in model.specs(
        profile, ["text_encoder", "vae_decoder"]).items()} for profile in (wider, narrower)}
    assert graph_keys[wider]["text_encoder"] == graph_keys[narrower]["text_encoder"]
    assert graph_keys[wider]["vae_decoder"] != graph_keys[narrower]["vae_decoder"]


def test_corrupt_engine_entry_is_rebuilt(tiny_dir, tiny_cache, tiny_compiled):
    record = next(s for s in tiny_compiled["onnxruntime"][1].stages if s.component == "vae_encoder"
                  and s.stage == "engine")
    model_file = tiny_cache.entries / record.key / "model.onnx"
    model_file.write_bytes(model_file.read_bytes()[:100])  # truncated
    with pytest.warns(CorruptEntryWarning, match="model.onnx has 100 bytes"):
        engines, report = compile_components(tiny_dir, backend="onnxruntime", cache=tiny_cache,
                                             components=["vae_encoder"])
    assert report.statuses()[("vae_encoder", "engine")] == "rebuilt"
    assert tiny_cache.verify(tiny_cache.entries / record.key) is None


def test_two_processes_compile_the_same_model_once(tiny_dir, tmp_path):
    env = {**os.environ, "KASOKU_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "kasoku.cli", "compile", str(tiny_dir), "--backend", "onnxruntime",
               "--components", "text_encoder", "vae_encoder"]
    procs = [subprocess.Popen([*command, "--json", str(tmp_path / f"r{i}.json")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out
    reports = [json.loads((tmp_path / f"r{i}.json").read_text()) for i in range(2)]
    records = [(s["component"], s["stage"], s["status"]) for r in reports for s in r["stages"]]
    built = [(component, stage) for component, stage, status in records if status == "built"]
    # each engine is built by one process; the other waited on its lock and reused it
    assert sorted(b for b in built if b[1] == "engine") == [("text_encoder", "engine"), ("vae_encoder", "engine")]
    for report in reports:
        assert {s["component"] for s in report["stages"] if s["stage"] == "engine"} == {"text_encoder", "vae_encoder"}
    # the weightless graphs stay for the next checkpoint
    assert sorted(e.kind for e in Cache(tmp_path / "cache").list()) == ["engine", "engine", "graph", "graph"]


def test_compile_cli_reports_stages(tiny_dir, tiny_cache, tiny_compiled, capsys):
    assert main(["compile", str(tiny_dir), "--backend", "openvino", "--cache-dir", str(tiny_cache.root),
                 "--components", "unet"]) == 0
    out = capsys.readouterr().out
    assert "0 built, 1 reused from the cache" in out and "unet=openvino" in out


def test_compile_cli_profile_flags(tiny_dir, tmp_path, capsys):
    assert main(["compile", str(tiny_dir), "--backend", "onnxruntime", "--cache-dir", str(tmp_path),
                 "--components", "text_encoder", "--batch", "1:2", "--height", "32:64", "--width", "32:64",
                 "--json", str(tmp_path / "r.json")]) == 0
    profile = json.loads((tmp_path / "r.json").read_text())["profile"]
    assert profile["max"] == {"batch": 2, "height": 64, "width": 64}
    assert main(["compile", str(tiny_dir), "--height", "64:48"]) == 1
    assert "1 <= min <= opt <= max" in capsys.readouterr().out
