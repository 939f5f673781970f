"""The cache's footprint: architecture graphs without weights, one copy of the weights per engine, a size
budget with least-recently-used eviction that never pulls an entry from under a loader."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kasoku.cli import main
from kasoku.core.cache import Cache, parse_size
from tests.conftest import cache_with_graphs

pytestmark = pytest.mark.integration  # builds engines


def weights_bytes(folder) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.safetensors"))


# auto builds and measures both CPU backends, so its run holds each one's entries too; the single-backend runs
# repeat that work and are slow
@pytest.mark.parametrize("backend, bound", [pytest.param("onnxruntime", 2.0, marks=pytest.mark.slow),
                                            pytest.param("openvino", 2.0, marks=pytest.mark.slow), ("auto", 2.5)])
def test_a_compiled_unet_costs_at_most_twice_its_weights(tiny_dir, tiny_graphs, tmp_path, backend, bound):
    """The U-Net (most of a model's weights; the other components follow the same path). Its weightless graph is
    the session's; the engines are built here."""
    cache = cache_with_graphs(tmp_path / "cache", [tiny_graphs["unet"]])
    args = ["compile", str(tiny_dir), "--backend", backend, "--components", "unet", "--cache-dir", str(cache)]
    assert main(args) == 0
    graphs = [e for e in Cache(cache).list() if e.kind == "graph"]
    assert len(graphs) == 1 and _initializer_bytes(Cache(cache), graphs[0]) < 1024  # the graph holds no weights
    ratio = Cache(cache).total_bytes() / weights_bytes(tiny_dir / "unet")
    assert ratio <= bound, f"{backend}: the cache is {ratio:.2f}x the U-Net's weights"
    assert len([e for e in Cache(cache).list() if e.kind == "engine"]) == 1  # auto's loser is gone
    assert main([*args, "--json", str(tmp_path / "again.json")]) == 0
    again = json.loads((tmp_path / "again.json").read_text())
    assert {s["status"] for s in again["stages"]} == {"reused"}


def _initializer_bytes(cache, entry) -> int:
    import onnx

    model = onnx.load(str(cache.entries / entry.key / "model.onnx"))
    return sum(len(t.raw_data) for t in model.graph.initializer)


def test_the_graphs_stay_for_the_next_checkpoint(tiny_dir, tmp_path):
    """A graph holds no weights: it is kept once the engine exists, for any checkpoint of the architecture."""
    assert main(["compile", str(tiny_dir), "--backend", "onnxruntime", "--components", "text_encoder",
                 "--cache-dir", str(tmp_path)]) == 0
    assert sorted(e.kind for e in Cache(tmp_path).list()) == ["engine", "graph"]


def _compile(model, cache, env=None, components=("text_encoder",)):
    command = [sys.executable, "-m", "kasoku.cli", "compile", str(model), "--backend", "onnxruntime",
               "--components", *components, "--cache-dir", str(cache)]
    result = subprocess.run(command, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    from kasoku.tools.tiny import write_tiny_pipeline

    root = tmp_path_factory.mktemp("models")
    return write_tiny_pipeline(root / "one", seed=1), write_tiny_pipeline(root / "two", seed=2)


@pytest.fixture(scope="module")
def cache_with_one(two_models, tiny_graphs, tmp_path_factory):
    """A cache holding model one's text encoder and VAE decoder engines (each test copies it), built on the
    session's graphs of their architecture."""
    cache = cache_with_graphs(tmp_path_factory.mktemp("cache-one"),
                              [tiny_graphs["text_encoder"], tiny_graphs["vae_decoder"]])
    _compile(two_models[0], cache, components=("text_encoder", "vae_decoder"))
    return cache


def _copy(cache, tmp_path):
    import shutil

    return Path(shutil.copytree(cache, tmp_path / "cache", symlinks=True))


def test_a_budget_evicts_the_least_recently_used_model(two_models, cache_with_one, tmp_path):
    one, two = two_models
    cache = _copy(cache_with_one, tmp_path)
    size_one = Cache(cache).total_bytes()
    time.sleep(1.1)  # last use is a file time
    _compile(two, cache, env={"KASOKU_CACHE_MAX": str(int(size_one * 1.5))},  # room for one model
             components=("text_encoder", "vae_decoder"))
    models = {e.model for e in Cache(cache).list() if e.kind == "engine"}
    assert models == {str(two)}  # the older one went; the one in use stayed
    assert Cache(cache).total_bytes() <= size_one * 1.5


def test_prune_never_pulls_an_entry_from_under_a_loader(cache_with_one, tmp_path, capsys):
    cache = _copy(cache_with_one, tmp_path)
    entries = Cache(cache).list()
    held = next(e for e in entries if e.component == "text_encoder" and e.kind == "engine")
    # another process holds the entry the way a loader does (the shared lock), then loads it
    script = (
        "import sys, time; from kasoku.core.cache import Cache; from kasoku.backends import get_backend;"
        "from kasoku.tools.tiny import tiny_pipeline; from kasoku.model.pipeline_model import component_specs;"
        f"c = Cache({str(cache)!r}); spec = component_specs(tiny_pipeline(seed=1), names=['text_encoder'])"
        "['text_encoder'];"
        f"ctx = c.reading({held.key!r}); ctx.__enter__(); print('holding', flush=True); time.sleep(3);"
        f"engine = get_backend('onnxruntime').load(spec, c.entries / {held.key!r}, 'fp32');"
        "print('loaded', sorted(engine.run(spec.sample_inputs(spec.profile.opt)))); ctx.__exit__(None, None, None)"
    )
    loader = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    while (line := loader.stdout.readline()) and line.strip() != "holding":
        pass  # the libraries' import-time warnings
    assert line.strip() == "holding", "the loader process died before it held the entry"
    assert main(["cache", "prune", "--max-size", "0", "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "freed" in out and "in use by another process were kept" in out
    # every entry but the held one was evicted (the engines and their weightless graphs); the held one stayed whole
    assert sum(e.kind == "engine" for e in entries) == 2 and [e.key for e in Cache(cache).list()] == [held.key]
    rest, _ = loader.communicate(timeout=120)
    assert loader.returncode == 0 and "loaded ['last_hidden_state', 'pooler_output']" in rest, rest
    assert main(["cache", "prune", "--max-size", "0", "--cache-dir", str(cache)]) == 0  # now it can go
    assert Cache(cache).list() == []


def test_cache_ls_shows_size_last_use_and_total(cache_with_one, capsys):
    assert main(["cache", "ls", "--cache-dir", str(cache_with_one)]) == 0
    out = capsys.readouterr().out
    assert "last used" in out and "in all" in out and "engine" in out


def test_sizes_parse_with_units():
    assert parse_size("20G") == 20 * 1024**3 and parse_size("500M") == 500 * 1024**2
    assert parse_size("1.5k") == 1536 and parse_size("123") == 123 and parse_size("2GiB") == 2 * 1024**3
    with pytest.raises(Exception, match="a cache size must be a number"):
        parse_size("lots")
