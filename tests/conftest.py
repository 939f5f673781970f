"""Shared, session-scoped artefacts: the tiny pipeline is built once and exported once.

Two tiers, selected by markers: `integration` (a test that exports, builds engines or runs Ray:
marked so, or using one of ENGINE_FIXTURES) and `unit` (everything else; `make test-fast`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# xFormers, installed apart for the tests of its attention's export (the Makefile's XFORMERS says why)
XFORMERS_DIR = Path(__file__).resolve().parents[1] / ".xformers"
if XFORMERS_DIR.is_dir() and str(XFORMERS_DIR) not in sys.path:
    sys.path.append(str(XFORMERS_DIR))

import onnx  # noqa: E402
import pytest  # noqa: E402

from kasoku.core.components import ImageShape  # noqa: E402
from kasoku.core.console import quiet_third_party_logs  # noqa: E402

quiet_third_party_logs()

# Fixtures that export or build engines: a test that uses one (directly or through another) is integration.
ENGINE_FIXTURES = {"tiny_onnx", "tiny_compiled", "tiny_kasoku", "tiny_inpaint_kasoku", "family_kasoku"}


# Tests marked `slow` take minutes each on two cores (AOTInductor's C++ compiles, families `make test` covers with
# others): `make test` skips them with their marker's reason, `make test-slow` (KASOKU_RUN_SLOW=1) runs them.
RUN_SLOW = os.environ.get("KASOKU_RUN_SLOW") == "1"


# The files that take longest (seconds of one worker, measured 2026-12-03 on 2 cores), run first: `make test` hands
# whole files to two workers in collection order (--no-loadscope-reorder), so the long ones must not come last
# and leave one worker idle at the end.
SLOWEST_FILES = ("test_transformers.py", "test_generic.py", "test_controlnet.py", "test_families.py",
                 "test_transformer_cache.py", "test_realtime.py", "test_ip_adapter.py", "test_pipeline.py",
                 "test_footprint.py")


# Files whose module fixtures build the same tiny SD3 and Flux.1 engines: `make test` hands them to one worker as one
# unit of work (:func:`pytest_xdist_make_scheduler`), one file after the other, so its session cache holds those
# engines once (measured 2026-12-07: about 60 s of exports were done by both workers when the files went to
# different ones).
SHARED_BUILDS = {"test_transformers.py": "transformers", "test_transformer_cache.py": "transformers",
                 "test_transformer_controlnets.py": "transformers"}


def _file_rank(item) -> int:
    name = item.path.name
    return SLOWEST_FILES.index(name) if name in SLOWEST_FILES else len(SLOWEST_FILES)


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's `--dist loadfile`, whose unit of work is a test file, with the files of SHARED_BUILDS as one
    unit. (Its `loadgroup` marks cannot do this under pytest 9, whose test ids no longer take the group's suffix.)"""
    from xdist.scheduler import LoadFileScheduling

    if config.getvalue("dist") != "loadfile":
        return None

    class SharedBuildsScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return SHARED_BUILDS.get(path.rsplit("/", 1)[-1], path)

    return SharedBuildsScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_file_rank)  # stable: each file's own order is kept
    for item in items:
        slow = item.get_closest_marker("slow")
        if slow is not None and not RUN_SLOW:
            why = slow.kwargs.get("reason", "minutes of compile on 2 cores")
            item.add_marker(pytest.mark.skip(reason=f"slow ({why}); `make test-slow` runs it"))
        fixtures = set(getattr(item, "fixturenames", ()))
        if item.get_closest_marker("integration") is None and fixtures & ENGINE_FIXTURES:
            item.add_marker(pytest.mark.integration)
        if item.get_closest_marker("integration") is None:
            item.add_marker(pytest.mark.unit)

# The components of an SD 1.x / 2.x pipeline (SDXL adds text_encoder_2).
SD_COMPONENTS = ("text_encoder", "unet", "vae_decoder", "vae_encoder")

# The image sizes (min, opt, max) of the tiny pipelines' default profile. Flux's default is diffusers' 1024 px: its
# tests give these (`tiny_profile`), so that its graphs, and the VAE it shares with SD3, are traced alike everywhere.
TINY_SIZES = (32, 64, 128)
TINY_SIZES_FLAG = ":".join(map(str, TINY_SIZES))  # the CLI's --height / --width for them


def layer_precisions(engine, layer_type: str = "") -> list[str]:
    """What OpenVINO's CPU plugin runs each layer of `engine` whose type starts with `layer_type` in (int8 layers run
    in u8/i8)."""
    layers = [op.get_rt_info() for op in engine.compiled.get_runtime_model().get_ordered_ops()]
    kinds = [info["layerType"].astype(str) if "layerType" in info else "" for info in layers]
    return [info["runtimePrecision"].astype(str) for info, kind in zip(layers, kinds)
            if "runtimePrecision" in info and kind.startswith(layer_type)]


def linear_layer_precisions(engine) -> list[str]:
    """The runtime precision of each linear layer (FullyConnected node) of `engine`."""
    return layer_precisions(engine, "FullyConnected")


def quantized_linear_layers(engine) -> list[tuple[str, bool]]:
    """Each linear layer of `engine` as (its runtime precision, whether NNCF quantized it: OpenVINO fused its
    dequantization into it)."""
    found = []
    for op in engine.compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        if "layerType" in info and info["layerType"].astype(str).startswith("FullyConnected"):
            names = info["originalLayersNames"].astype(str) if "originalLayersNames" in info else ""
            found.append((info["runtimePrecision"].astype(str), "Dequantization" in names))
    return found


def save_transformer_adapter(pipe, folder, seed, targets):
    """A LoRA adapter (rank 4, random) on `targets` of `pipe`'s transformer, saved with the class's own
    `save_lora_weights` into `folder`."""
    import torch
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    transformer = type(pipe.transformer).from_config(pipe.transformer.config)
    transformer.load_state_dict(pipe.transformer.state_dict())
    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    transformer.add_adapter(config)
    type(pipe).save_lora_weights(folder, transformer_lora_layers=get_peft_model_state_dict(transformer),
                                 transformer_lora_adapter_metadata=config.to_dict())
    return folder


def tiny_profile(pipe):
    """`pipe`'s default profile at the tiny pipelines' sizes (TINY_SIZES)."""
    from kasoku.core.components import profile_with_ranges
    from kasoku.model.pipeline_model import Model

    return profile_with_ranges(Model.of(pipe).default_profile(), None, TINY_SIZES, TINY_SIZES)


# Two resolutions and two batch sizes inside the tiny profile (32..128 px, 1..4 images).
TINY_CHECK_SHAPES = [ImageShape(1, 64, 64), ImageShape(2, 32, 48)]


@pytest.fixture(scope="session")
def tiny_pipe():
    from kasoku.tools.tiny import tiny_pipeline

    return tiny_pipeline()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from kasoku.tools.tiny import write_tiny_pipeline

    return write_tiny_pipeline(tmp_path_factory.mktemp("models") / "tiny-sd")


@pytest.fixture(scope="session")
def tiny_specs(tiny_pipe):
    from kasoku.model.pipeline_model import component_specs

    return component_specs(tiny_pipe)


@pytest.fixture(scope="session")
def tiny_onnx(tiny_specs, tiny_cache, tmp_path_factory):
    """Every tiny component as a self-contained ONNX file (what `export_component` writes: the architecture graph
    the session's first compile exported, with the weights written in), parity checked at two shapes.
    tests/build/test_export.py exports through `export_component` itself."""
    from kasoku.build.compiler import ONNX_FILE, Compiler
    from kasoku.build.export import ExportedComponent, check_onnx_parity, module_weights
    from kasoku.core.options import CompileOptions
    from kasoku.core.weights import materialize, onnx_files

    root = tmp_path_factory.mktemp("onnx")
    compiler = Compiler(tiny_cache, CompileOptions(backend="onnxruntime"))
    exported = {}
    for name, spec in tiny_specs.items():
        graph = tiny_cache.lookup(compiler.export_parts(spec)).file(ONNX_FILE)
        path = materialize(graph, module_weights(spec, onnx.load(str(graph))), root / name / ONNX_FILE)
        exported[name] = ExportedComponent(
            name=name, path=path, exporter="dynamo", opset=18,
            inputs={t.name: [d if isinstance(d, int) else d.name for d in t.dims] for t in spec.inputs},
            outputs=list(spec.output_names), external_data=False,
            size_bytes=sum(f.stat().st_size for f in onnx_files(path)), seconds=0.0,
            parity=check_onnx_parity(spec, path, TINY_CHECK_SHAPES))
    return exported


@pytest.fixture(scope="session")
def _session_cache(tmp_path_factory):
    from kasoku.core.cache import Cache

    return Cache(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def tiny_compiled(tiny_dir, _session_cache):
    """The tiny pipeline compiled once per CPU backend into the empty session cache: {backend: (engines,
    report)}; its reports show every stage built (export, engine)."""
    from kasoku.pipeline.compiling import compile_components

    return {
        backend: compile_components(tiny_dir, backend=backend, cache=_session_cache)
        for backend in ("onnxruntime", "openvino")
    }


@pytest.fixture(scope="session")
def tiny_cache(_session_cache, tiny_compiled):
    """The session cache, always after `tiny_compiled`: whichever test (and test worker) comes first,
    the tiny pipeline's first compile is the one that exported its graphs."""
    return _session_cache


@pytest.fixture(scope="session")
def tiny_graphs(tiny_specs, tiny_cache):
    """The tiny pipeline's architecture graph entries (weightless) in the session cache: {component: folder}."""
    from kasoku.build.compiler import Compiler
    from kasoku.core.options import CompileOptions

    compiler = Compiler(tiny_cache, CompileOptions(backend="onnxruntime"))
    return {name: tiny_cache.lookup(compiler.export_parts(spec)).path for name, spec in tiny_specs.items()}


def cache_with_graphs(root, graphs):
    """A new cache at `root` holding copies of these graph entries (kilobytes: no weights), for a test whose cache
    must start without engines: it builds them without exporting the session's graphs again."""
    import shutil
    from pathlib import Path

    from kasoku.core.cache import Cache

    cache = Cache(root)
    for entry in graphs:
        shutil.copytree(entry, cache.entries / Path(entry).name)
    return Path(root)


@pytest.fixture(scope="session")
def tiny_kasoku(tiny_pipe, tiny_cache, tiny_compiled):
    """KasokuPipeline over ONNX Runtime engines of the tiny pipeline (engines from the cache)."""
    import kasoku

    return kasoku.compile(tiny_pipe, backend="onnxruntime", cache_dir=tiny_cache.root)


@pytest.fixture(scope="session")
def tiny_inpaint_pipe():
    from kasoku.tools.tiny import tiny_pipeline

    return tiny_pipeline(inpainting=True)


@pytest.fixture(scope="session")
def tiny_inpaint_kasoku(tiny_inpaint_pipe, tiny_cache, tiny_compiled):
    import kasoku

    return kasoku.compile(tiny_inpaint_pipe, backend="onnxruntime", cache_dir=tiny_cache.root)
