"""Graph passes: fewer nodes, same numbers."""

from __future__ import annotations

import onnx
import pytest

from kasoku.components import Precision
from kasoku.export import check_onnx_parity, default_check_shapes
from kasoku.optimize import PASSES, optimize
from tests.conftest import SD_COMPONENTS


def test_optimized_components_are_smaller_and_still_match(tiny_compiled):
    _, report = tiny_compiled["onnxruntime"]
    optimized = {s.component: s for s in report.stages if s.stage == "optimize"}
    assert set(optimized) == set(SD_COMPONENTS)
    for name, record in optimized.items():
        passes = record.detail["passes"]
        assert [p["name"] for p in passes] == ["cleanup", "fold_constants", "infer_shapes"]
        assert passes[-1]["nodes_after"] < passes[0]["nodes_before"], name
        assert record.detail["parity"] and all(p["passed"] for p in record.detail["parity"])


def test_each_pass_reports_node_counts(tiny_onnx, tmp_path):
    source = tiny_onnx["unet"].path
    report = optimize(source, tmp_path / "unet.onnx", ["cleanup", "fold_constants", "infer_shapes"], component="unet")
    assert [p.name for p in report.passes] == ["cleanup", "fold_constants", "infer_shapes"]
    assert report.nodes_after == len(onnx.load(str(tmp_path / "unet.onnx")).graph.node)
    assert all(p.seconds >= 0 for p in report.passes)
    # shape inference annotated intermediate tensors
    assert len(onnx.load(str(tmp_path / "unet.onnx")).graph.value_info) > 0


@pytest.mark.parametrize("component", ["text_encoder", "unet"])
def test_ort_transformer_fusions_keep_parity(tiny_onnx, tiny_specs, tmp_path, component):
    target = tmp_path / f"{component}.onnx"
    report = optimize(tiny_onnx[component].path, target, ["cleanup", "fold_constants", "ort_fusions"],
                      component=component)
    assert report.passes[-1].nodes_after < report.passes[-1].nodes_before
    spec = tiny_specs[component]
    assert all(r.passed for r in check_onnx_parity(spec, target, default_check_shapes(spec.profile)))


def test_fp16_keeps_io_fp32_and_reports_drift(tiny_onnx, tiny_specs, tmp_path):
    target = tmp_path / "vae_decoder.onnx"
    optimize(tiny_onnx["vae_decoder"].path, target, ["cleanup", "fp16"], component="vae_decoder",
             precision=Precision.FP16)
    model = onnx.load(str(target))
    assert {i.type.tensor_type.elem_type for i in model.graph.input} == {onnx.TensorProto.FLOAT}
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in model.graph.initializer)
    # the keep-list: VAE normalization stays fp32
    spec = tiny_specs["vae_decoder"]
    results = check_onnx_parity(spec, target, default_check_shapes(spec.profile), precision=Precision.FP16)
    assert all(r.nan == 0 and r.inf == 0 for r in results)
    assert all(r.max_abs > 0 for r in results)  # drift exists and is reported, not hidden


def test_unknown_pass_is_named(tiny_onnx, tmp_path):
    with pytest.raises(ValueError, match=r"unknown pass\(es\) \['magic'\]"):
        optimize(tiny_onnx["unet"].path, tmp_path / "x.onnx", ["magic"], component="unet")
    assert "fold_constants" in PASSES
