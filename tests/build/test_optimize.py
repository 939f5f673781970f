"""Graph passes: fewer nodes, same numbers."""

from __future__ import annotations

import onnx
import pytest

from kasoku.build.export import check_onnx_parity, default_check_shapes
from kasoku.build.optimize import PASSES, optimize
from kasoku.core.components import Precision
from tests.conftest import SD_COMPONENTS

pytestmark = pytest.mark.integration  # exports or builds engines


def test_tensorrts_passes_make_smaller_graphs_that_still_match(tiny_onnx, tiny_specs, tmp_path):
    """The seed's GraphSurgeon flow, which kasoku runs before TensorRT (ONNX Runtime and OpenVINO
    optimize the graph themselves when they build)."""
    from kasoku.backends import get_backend

    passes = get_backend("tensorrt").optimization_passes(Precision.FP32)
    assert passes == ["cleanup", "fold_constants", "infer_shapes"]
    assert get_backend("onnxruntime").optimization_passes(Precision.FP32) == []
    assert get_backend("onnxruntime").optimization_passes(Precision.FP16) == ["fp16"]
    for name in SD_COMPONENTS:
        target = tmp_path / f"{name}.onnx"
        report = optimize(tiny_onnx[name].path, target, passes, spec=tiny_specs[name])
        assert report.passes[-1].nodes_after < report.passes[0].nodes_before, name
        spec = tiny_specs[name]
        assert all(r.passed for r in check_onnx_parity(spec, target, default_check_shapes(spec.profile)))


def test_each_pass_reports_node_counts(tiny_onnx, tiny_specs, tmp_path):
    source = tiny_onnx["unet"].path
    report = optimize(source, tmp_path / "unet.onnx", ["cleanup", "fold_constants", "infer_shapes"],
                      spec=tiny_specs["unet"])
    assert [p.name for p in report.passes] == ["cleanup", "fold_constants", "infer_shapes"]
    assert report.nodes_after == len(onnx.load(str(tmp_path / "unet.onnx")).graph.node)
    assert all(p.seconds >= 0 for p in report.passes)
    # shape inference annotated intermediate tensors
    assert len(onnx.load(str(tmp_path / "unet.onnx")).graph.value_info) > 0


@pytest.mark.parametrize("component", ["text_encoder", "unet"])
def test_ort_transformer_fusions_keep_parity(tiny_onnx, tiny_specs, tmp_path, component):
    target = tmp_path / f"{component}.onnx"
    report = optimize(tiny_onnx[component].path, target, ["cleanup", "fold_constants", "ort_fusions"],
                      spec=tiny_specs[component])
    assert report.passes[-1].nodes_after < report.passes[-1].nodes_before
    spec = tiny_specs[component]
    assert all(r.passed for r in check_onnx_parity(spec, target, default_check_shapes(spec.profile)))


def test_fp16_keeps_io_fp32_and_reports_drift(tiny_onnx, tiny_specs, tmp_path):
    target = tmp_path / "vae_decoder.onnx"
    optimize(tiny_onnx["vae_decoder"].path, target, ["cleanup", "fp16"], spec=tiny_specs["vae_decoder"],
             precision=Precision.FP16)
    model = onnx.load(str(target))
    assert {i.type.tensor_type.elem_type for i in model.graph.input} == {onnx.TensorProto.FLOAT}
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in model.graph.initializer)
    # the keep-list: VAE normalization stays fp32
    spec = tiny_specs["vae_decoder"]
    results = check_onnx_parity(spec, target, default_check_shapes(spec.profile), precision=Precision.FP16)
    assert all(r.nan == 0 and r.inf == 0 for r in results)
    assert all(r.max_abs > 0 for r in results)  # drift exists and is reported, not hidden


def test_unknown_pass_is_named(tiny_onnx, tiny_specs, tmp_path):
    with pytest.raises(ValueError, match=r"unknown pass\(es\) \['magic'\]"):
        optimize(tiny_onnx["unet"].path, tmp_path / "x.onnx", ["magic"], spec=tiny_specs["unet"])
    assert "fold_constants" in PASSES


def test_models_over_the_protobuf_limit_are_optimized_graph_only(tiny_specs, tmp_path, monkeypatch):
    """Over 2 GB (here: a limit of 0 bytes), the passes run on the graph while the weights stay in
    their file, and the result carries its own weights file (the source can go away)."""
    import shutil

    import kasoku.build.optimize
    from kasoku.build.export import export_component

    spec = tiny_specs["unet"]
    source = export_component(spec, tmp_path / "src" / "model.onnx", check_shapes=[], external_data_threshold=0).path
    monkeypatch.setattr(kasoku.build.optimize, "PROTO_LIMIT", 0)
    graph = kasoku.build.optimize.load_graph(source)
    in_memory = sum(len(t.raw_data) for t in graph.graph.initializer)  # small constants only
    assert in_memory < 0.1 * (source.parent / "model.onnx.data").stat().st_size
    target = tmp_path / "dst" / "model.onnx"
    report = optimize(source, target, ["cleanup", "fold_constants", "infer_shapes"], spec=tiny_specs["unet"])
    assert report.nodes_after < report.nodes_before  # folding still read the values it needed
    locations = {e.value for t in onnx.load(str(target), load_external_data=False).graph.initializer
                 for e in t.external_data if e.key == "location"}
    assert locations == {"model.onnx.data"}  # relative, next to the target
    shutil.rmtree(source.parent)
    results = check_onnx_parity(spec, target, default_check_shapes(spec.profile), stage="optimization")
    assert all(r.passed for r in results)
