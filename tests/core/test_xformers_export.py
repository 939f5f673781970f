"""Seed 000: a module calling xFormers by name exports only under exportable_attention()."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
import xformers.ops as xops

import kasoku
from tests.core import xformers_attention_model as seed_module

pytestmark = pytest.mark.integration  # exports or builds engines

SHAPE = (1, 128, 8, 64)  # the seed's [B, M, H, K]


def inputs(batch=1, seq=128):
    g = torch.Generator().manual_seed(42)
    return tuple(torch.rand(batch, seq, 8, 64, generator=g) for _ in range(3))


def float64_attention(q, k, v):
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    return ((q @ k.transpose(-2, -1) / 8.0).softmax(-1) @ v).transpose(1, 2).numpy()


def export(path, exporter):
    q, k, v = inputs()
    kwargs = dict(input_names=["query", "key", "value"], output_names=["output"], opset_version=18)
    if exporter == "dynamo":
        batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("seq", min=2, max=512)
        dims = {"query": {0: batch, 1: seq}, "key": {0: batch, 1: seq}, "value": {0: batch, 1: seq}}
        torch.onnx.export(seed_module.XformersAttentionModel(), (q, k, v), str(path), dynamo=True,
                          dynamic_shapes=dims, verbose=False, **kwargs)
    else:
        axes = {name: {0: "batch", 1: "seq"} for name in ("query", "key", "value")}
        torch.onnx.export(seed_module.XformersAttentionModel(), (q, k, v), str(path), dynamo=False,
                          dynamic_axes=axes, **kwargs)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_exports_under_context_and_matches_float64(tmp_path, exporter):
    path = tmp_path / "attention.onnx"
    with kasoku.exportable_attention():
        assert seed_module.memory_efficient_attention is kasoku.memory_efficient_attention
        export(path, exporter)
    assert seed_module.memory_efficient_attention is xops.memory_efficient_attention
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch, seq in [(1, 128), (2, 77)]:
        q, k, v = inputs(batch, seq)
        out = session.run(None, {"query": q.numpy(), "key": k.numpy(), "value": v.numpy()})[0]
        np.testing.assert_allclose(out, float64_attention(q, k, v), atol=1e-5, rtol=0)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_export_fails_without_context(tmp_path, exporter):
    with pytest.raises(Exception):  # noqa: B017 - the exporters raise different kinds; failing is the point
        export(tmp_path / "attention.onnx", exporter)
    assert not (tmp_path / "attention.onnx").exists()
