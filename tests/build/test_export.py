"""Export of every tiny component with dynamic shapes, parity in ONNX Runtime, and bad input."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from kasoku.build.export import check_onnx_parity, export_component, export_pipeline, ort_session
from kasoku.cli import main
from kasoku.core.components import ImageShape, ShapeOutOfProfile
from kasoku.core.parity import ParityError
from kasoku.model.loading import ModelNotFound, NotADiffusersPipeline
from tests.conftest import SD_COMPONENTS, TINY_CHECK_SHAPES

pytestmark = pytest.mark.integration  # exports or builds engines


def test_all_components_export_with_dynamic_shapes(tiny_onnx, tiny_specs):
    assert set(tiny_onnx) == set(SD_COMPONENTS)
    for name, exported in tiny_onnx.items():
        model = onnx.load(str(exported.path))
        dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
        spec = tiny_specs[name]
        for tensor in spec.inputs:
            for axis in tensor.dynamic_axes:
                assert isinstance(dims[tensor.name][axis], str), f"{name}.{tensor.name} axis {axis} is static"
        shapes = {p.shape for p in exported.parity}
        assert shapes == {str(s) for s in TINY_CHECK_SHAPES}
        assert all(p.passed and p.max_abs <= 1e-4 * max(1.0, 1.0) * 10 for p in exported.parity)


def test_parity_at_a_third_shape(tiny_onnx, tiny_specs):
    """Sizes never seen at export time (max batch, non-square) still match torch."""
    for name, exported in tiny_onnx.items():
        results = check_onnx_parity(tiny_specs[name], exported.path, [ImageShape(4, 128, 96)])
        assert all(r.passed for r in results)


def test_mismatch_fails_naming_component_and_shape(tiny_onnx, tiny_specs, tiny_pipe):
    spec = tiny_specs["vae_decoder"]
    conv = tiny_pipe.vae.post_quant_conv
    original = conv.bias.detach().clone()
    try:
        with torch.no_grad():
            conv.bias.add_(0.5)  # torch now computes something else than the ONNX file
        with pytest.raises(ParityError, match=r"vae_decoder\.sample @ 1x64x64"):
            check_onnx_parity(spec, tiny_onnx["vae_decoder"].path, [ImageShape(1, 64, 64)])
    finally:
        with torch.no_grad():
            conv.bias.copy_(original)


def test_external_data_path(tiny_specs, tmp_path):
    """export_component end to end (the dynamo exporter, its weights written in beside the graph, parity at the
    profile's two default shapes); the session's other ONNX files come from the cache's graphs."""
    path = tmp_path / "text_encoder" / "model.onnx"
    exported = export_component(tiny_specs["text_encoder"], path, external_data_threshold=0)
    assert exported.external_data and len(exported.parity) == 2 * len(tiny_specs["text_encoder"].outputs)
    assert onnx.load(str(path), load_external_data=False).graph.input[0].type.tensor_type.shape.dim[0].dim_param
    side_files = list(path.parent.glob("model.onnx.data*"))
    assert side_files and side_files[0].stat().st_size > path.stat().st_size
    assert all(p.passed for p in exported.parity)


def test_torchscript_exporter(tiny_specs, tmp_path):
    exported = export_component(tiny_specs["unet"], tmp_path / "unet.onnx", exporter="torchscript",
                                check_shapes=TINY_CHECK_SHAPES)
    assert exported.exporter == "torchscript"
    assert all(p.passed for p in exported.parity)


def test_ort_rejects_nothing_inside_profile_but_profile_check_names_range(tiny_specs):
    profile = tiny_specs["unet"].profile
    with pytest.raises(ShapeOutOfProfile, match=r"height=256 is outside the compiled profile \(height 32\.\.128\)"):
        profile.check(ImageShape(1, 256, 64))
    with pytest.raises(ShapeOutOfProfile, match="multiple of 16"):
        profile.check(ImageShape(1, 72, 64))


def test_cli_export_writes_files_and_manifest(tiny_dir, tmp_path, capsys):
    out = tmp_path / "onnx"
    assert main(["export", str(tiny_dir), str(out), "--components", "text_encoder", "vae_decoder",
                 "--json", str(tmp_path / "m.json")]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert [c["name"] for c in manifest["components"]] == ["text_encoder", "vae_decoder"]
    assert manifest["versions"]["torch"] == torch.__version__
    assert all(p["passed"] for c in manifest["components"] for p in c["parity"])
    assert (out / "text_encoder" / "model.onnx").is_file() and not (out / "unet").exists()
    assert "ONNX export" in capsys.readouterr().out
    # the ONNX file runs on its own
    session = ort_session(out / "text_encoder" / "model.onnx")
    ids = np.zeros((2, 77), dtype=np.int64)
    assert session.run(None, {"input_ids": ids})[0].shape == (2, 77, 32)


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda tmp: tmp / "missing", ModelNotFound, "does not exist"),
        (lambda tmp: tmp, NotADiffusersPipeline, "no model_index.json"),
    ],
    ids=["missing-folder", "not-a-pipeline"],
)
def test_bad_model_folders(tmp_path, make, error, message, capsys):
    with pytest.raises(error, match=message):
        export_pipeline(make(tmp_path), tmp_path / "out")
    assert main(["export", str(make(tmp_path)), str(tmp_path / "out2")]) == 1
    assert message in capsys.readouterr().out
    assert not (tmp_path / "out2").exists()


def test_unsupported_pipeline_class(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "MadeUpPipeline"}))
    with pytest.raises(NotADiffusersPipeline, match="StableDiffusionPipeline"):
        export_pipeline(tmp_path, tmp_path / "out")


def test_a_supported_class_without_its_components_is_refused_first(tmp_path):
    """No text encoder at all is a layout diffusers serves (calls give prompt embeddings); no denoiser or VAE, or
    only some of the text encoders, is not."""
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(NotADiffusersPipeline, match=r"Flux.1 pipeline without transformer, vae; kasoku compiles "
                                                    r"whole pipelines"):
        export_pipeline(tmp_path, tmp_path / "out")
    (tmp_path / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusion3Pipeline", "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
        "transformer": ["diffusers", "SD3Transformer2DModel"], "vae": ["diffusers", "AutoencoderKL"]}))
    with pytest.raises(NotADiffusersPipeline, match=r"Stable Diffusion 3 pipeline without text_encoder;"):
        export_pipeline(tmp_path, tmp_path / "out")
