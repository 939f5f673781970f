"""Rotary embeddings kept as complex numbers (Qwen-Image's, Z-Image's) export to ONNX and match torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kasoku.build.onnx_complex import complex_ops_registered

pytestmark = pytest.mark.unit


class ComplexRope(torch.nn.Module):
    """A complex rotary table indexed by positions, split, padded, unsqueezed, expanded and selected, as the
    families that keep their RoPE complex do, then applied to `x`."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = torch.arange(64, dtype=torch.float32).reshape(16, 4) / 7.0
        table = torch.polar(torch.ones(16, 4), angles)[positions]  # index
        first, second = table.split([1, 3], dim=-1)  # split_with_sizes
        table = torch.cat([second, first], dim=-1)
        table = torch.nn.functional.pad(table, (0, 0, 0, 1))  # constant_pad_nd: one more position, zero
        table = table.unsqueeze(0).expand(x.shape[0], -1, -1)  # unsqueeze, expand
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        rotated = pairs * table[:, : x.shape[1]] + table.select(1, 0).unsqueeze(1)  # select
        return torch.view_as_real(rotated).flatten(-2)


def _export(path) -> None:
    x, positions = torch.randn(2, 5, 8), torch.tensor([3, 1, 4, 1, 5], dtype=torch.int32)
    torch.onnx.export(ComplexRope().eval(), (x, positions), str(path), dynamo=True, input_names=["x", "positions"],
                      output_names=["out"], verbose=False)


def test_complex_rotary_tables_export_and_match_torch(tmp_path):
    import onnxruntime

    with complex_ops_registered():
        _export(tmp_path / "rope.onnx")
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([0, 7, 2, 15, 9], dtype=torch.int32)
    expected = ComplexRope()(x, positions).numpy()
    session = onnxruntime.InferenceSession(str(tmp_path / "rope.onnx"), providers=["CPUExecutionProvider"])
    (actual,) = session.run(None, {"x": x.numpy(), "positions": positions.numpy()})
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


def test_without_them_the_exporter_refuses_the_complex_ops(tmp_path):
    with pytest.raises(Exception, match="complex-valued input"):
        _export(tmp_path / "rope.onnx")


def test_the_registry_is_the_exporters_own_again_afterwards():
    from torch.onnx._internal.exporter import _registration

    before = _registration.ONNXRegistry.__dict__["from_torchlib"]
    with complex_ops_registered():
        assert _registration.ONNXRegistry.__dict__["from_torchlib"] is not before
    assert _registration.ONNXRegistry.__dict__["from_torchlib"] is before
