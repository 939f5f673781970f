"""`kasoku verify`: passes on good engines, fails (exit 1, component named) on an altered one."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from kasoku.cli import main
from kasoku.tools.verification import verify

pytestmark = pytest.mark.integration  # exports or builds engines


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_verify_passes_on_the_tiny_pipeline(tiny_dir, tiny_cache, tiny_compiled, tmp_path, backend, capsys):
    out = tmp_path / "verify.json"
    assert main(["verify", str(tiny_dir), "--backend", backend, "--cache-dir", str(tiny_cache.root),
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["passed"] and report["failed_components"] == []
    shapes = {(c["component"], c["shape"]) for c in report["components"]}
    assert {s for _, s in shapes} == {"1x32x32", "1x64x64", "4x128x128"}  # smallest, typical, largest
    assert {c for c, _ in shapes} == {"text_encoder", "unet", "vae_decoder", "vae_encoder"}
    for c in report["components"]:
        assert c["max_abs"] <= c["limit"] and c["cosine"] > 0.9999 and c["nan"] == c["inf"] == 0
    assert report["image"]["psnr_db"] >= 40 and report["image"]["passed"]
    assert "PASSED" in capsys.readouterr().out


def test_verify_fails_on_an_altered_onnx_file(tiny_dir, tiny_onnx, tmp_path, capsys):
    source = tiny_onnx["unet"].path.parent.parent  # <root>/<component>/model.onnx
    onnx_dir = tmp_path / "onnx"
    shutil.copytree(source, onnx_dir)
    unet_path = onnx_dir / "unet" / "model.onnx"
    model = onnx.load(str(unet_path))
    biggest = max(model.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    weights = numpy_helper.to_array(biggest).copy()
    weights.flat[0] += 5.0  # one weight changed
    biggest.CopyFrom(numpy_helper.from_array(weights, biggest.name))
    onnx.save(model, str(unet_path))

    code = main(["verify", str(tiny_dir), "--backend", "onnxruntime", "--onnx", str(onnx_dir), "--no-image",
                 "--cache-dir", str(tmp_path / "cache"), "--json", str(tmp_path / "v.json")])
    assert code == 1
    out = capsys.readouterr().out
    assert "verify FAILED for unet" in out and "FAILED | unet.out_sample" in out
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["failed_components"] == ["unet"]
    assert all(c["passed"] for c in report["components"] if c["component"] != "unet")


def test_verify_python_api_returns_data(tiny_pipe, tiny_cache, tiny_compiled):
    report = verify(tiny_pipe, "onnxruntime", cache_dir=tiny_cache.root, image=False)
    assert report.passed and report.image is None and len(report.components) == 15
