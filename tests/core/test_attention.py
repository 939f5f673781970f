"""kasoku.memory_efficient_attention against an independent float64 reference, and the
routing done by kasoku.exportable_attention()."""

from __future__ import annotations

import importlib.util
import logging
import sys

import numpy as np
import pytest
import torch
import xformers.ops as xops
from xformers.ops import fmha
from xformers.ops.fmha import attn_bias as ab

import kasoku
from kasoku.core.attention import DropoutNotExportable, UnsupportedAttentionBias, supported_bias_kinds

ORIGINAL = xops.memory_efficient_attention
B, MQ, MKV, H, G, K, KV = 2, 5, 7, 3, 2, 8, 6


def reference(q, k, v, keep=None, bias=None, scale=None):
    """Float64 attention with the sequence next to the embedding; keep/bias in score layout."""
    q, k, v = (x.double() for x in (q, k, v))
    if q.ndim > 3:
        q, k, v = (x.movedim(1, -2) for x in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if bias is not None:
        scores = scores + bias.double()
    if keep is not None:
        scores = scores.masked_fill(~torch.as_tensor(keep), float("-inf"))
    out = scores.softmax(-1) @ v
    return out if out.ndim == 3 else out.movedim(-2, 1)


def qkv(ndim, dtype=torch.float32, batch=B, mq=MQ, mkv=MKV, seed=0):
    g = torch.Generator().manual_seed(seed)
    mid = {3: (), 4: (H,), 5: (G, H)}[ndim]
    q = torch.randn(batch, mq, *mid, K, generator=g)
    k = torch.randn(batch, mkv, *mid, K, generator=g)
    v = torch.randn(batch, mkv, *mid, KV, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def score_shape(ndim, batch=B, mq=MQ, mkv=MKV):
    return {3: (batch, mq, mkv), 4: (batch, H, mq, mkv), 5: (batch, G, H, mq, mkv)}[ndim]


def keep_loops(mq, mkv, rule):
    return np.array([[rule(i, j) for j in range(mkv)] for i in range(mq)])


def block_keep(q_lens, k_lens, rule):
    keep = np.zeros((sum(q_lens), sum(k_lens)), dtype=bool)
    qs, ks = 0, 0
    for lq, lk in zip(q_lens, k_lens):
        keep[qs : qs + lq, ks : ks + lk] = keep_loops(lq, lk, lambda i, j, lq=lq, lk=lk: rule(i, j, lq, lk))
        qs, ks = qs + lq, ks + lk
    return keep


SHIFT = MKV - MQ
CAUSAL_KINDS = {
    "LowerTriangularMask": (lambda: ab.LowerTriangularMask(), lambda i, j: j <= i),
    "LowerTriangularFromBottomRightMask": (
        lambda: ab.LowerTriangularFromBottomRightMask(), lambda i, j: j <= i + SHIFT
    ),
    "LowerTriangularFromBottomRightLocalAttentionMask": (
        lambda: ab.LowerTriangularFromBottomRightLocalAttentionMask(3),
        lambda i, j: i + SHIFT - 2 <= j <= i + SHIFT,
    ),
    "LocalAttentionFromBottomRightMask": (
        lambda: ab.LocalAttentionFromBottomRightMask(window_left=1, window_right=2),
        lambda i, j: i + SHIFT - 1 <= j <= i + SHIFT + 2,
    ),
}

Q_LENS, K_LENS = [2, 3], [3, 4]
BLOCK_KINDS = {
    "BlockDiagonalMask": (lambda: ab.BlockDiagonalMask.from_seqlens(Q_LENS, K_LENS), lambda i, j, lq, lk: True),
    "BlockDiagonalCausalMask": (
        lambda: ab.BlockDiagonalCausalMask.from_seqlens(Q_LENS, K_LENS), lambda i, j, lq, lk: j <= i
    ),
    "BlockDiagonalCausalFromBottomRightMask": (
        lambda: ab.BlockDiagonalCausalFromBottomRightMask.from_seqlens(Q_LENS, K_LENS),
        lambda i, j, lq, lk: j <= i + lk - lq,
    ),
    "BlockDiagonalCausalLocalAttentionMask": (
        lambda: ab.BlockDiagonalMask.from_seqlens(Q_LENS, K_LENS).make_local_attention(2),
        lambda i, j, lq, lk: i - 2 < j <= i,
    ),
    "BlockDiagonalCausalLocalAttentionFromBottomRightMask": (
        lambda: ab.BlockDiagonalMask.from_seqlens(Q_LENS, K_LENS).make_local_attention_from_bottomright(2),
        lambda i, j, lq, lk: i + lk - lq - 2 < j <= i + lk - lq,
    ),
}

DTYPES = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ndim", [3, 4, 5], ids=["BMK", "BMHK", "BMGHK"])
class TestSemantics:
    def test_no_bias_shape_dtype_and_default_scale(self, ndim, dtype):
        q, k, v = qkv(ndim, dtype)
        out = kasoku.memory_efficient_attention(q, k, v)
        assert out.shape == q.shape[:-1] + (v.shape[-1],)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), reference(q, k, v), atol=DTYPES[dtype], rtol=0)

    def test_explicit_scale(self, ndim, dtype):
        q, k, v = qkv(ndim, dtype)
        out = kasoku.memory_efficient_attention(q, k, v, scale=0.05)
        torch.testing.assert_close(out.double(), reference(q, k, v, scale=0.05), atol=DTYPES[dtype], rtol=0)

    def test_tensor_bias(self, ndim, dtype):
        q, k, v = qkv(ndim, dtype)
        bias = torch.randn(score_shape(ndim), generator=torch.Generator().manual_seed(3)).to(dtype)
        out = kasoku.memory_efficient_attention(q, k, v, attn_bias=bias)
        torch.testing.assert_close(out.double(), reference(q, k, v, bias=bias), atol=DTYPES[dtype], rtol=0)

    @pytest.mark.parametrize("kind", CAUSAL_KINDS)
    def test_causal_kinds(self, ndim, dtype, kind):
        make, rule = CAUSAL_KINDS[kind]
        q, k, v = qkv(ndim, dtype)
        out = kasoku.memory_efficient_attention(q, k, v, attn_bias=make())
        keep = keep_loops(MQ, MKV, rule)
        torch.testing.assert_close(out.double(), reference(q, k, v, keep=keep), atol=DTYPES[dtype], rtol=0)

    def test_causal_with_tensor_bias(self, ndim, dtype):
        q, k, v = qkv(ndim, dtype)
        bias = torch.randn(score_shape(ndim), generator=torch.Generator().manual_seed(4)).to(dtype)
        out = kasoku.memory_efficient_attention(q, k, v, attn_bias=ab.LowerTriangularMaskWithTensorBias(bias))
        keep = keep_loops(MQ, MKV, lambda i, j: j <= i)
        expected = reference(q, k, v, keep=keep, bias=bias)
        torch.testing.assert_close(out.double(), expected, atol=DTYPES[dtype], rtol=0)

    @pytest.mark.parametrize("kind", BLOCK_KINDS)
    def test_block_diagonal_kinds(self, ndim, dtype, kind):
        make, rule = BLOCK_KINDS[kind]
        q, k, v = qkv(ndim, dtype, batch=1, mq=sum(Q_LENS), mkv=sum(K_LENS))
        out = kasoku.memory_efficient_attention(q, k, v, attn_bias=make())
        keep = block_keep(Q_LENS, K_LENS, rule)
        torch.testing.assert_close(out.double(), reference(q, k, v, keep=keep), atol=DTYPES[dtype], rtol=0)


def test_every_supported_kind_is_tested():
    tested = set(CAUSAL_KINDS) | set(BLOCK_KINDS) | {"LowerTriangularMaskWithTensorBias"}
    assert set(supported_bias_kinds()) == tested


def test_unsupported_bias_kind_is_named():
    q, k, v = qkv(4, batch=1, mq=4, mkv=8)
    bias = ab.BlockDiagonalPaddedKeysMask.from_seqlens(q_seqlen=[2, 2], kv_padding=4, kv_seqlen=[3, 4])
    with pytest.raises(UnsupportedAttentionBias, match="BlockDiagonalPaddedKeysMask"):
        kasoku.memory_efficient_attention(q, k, v, attn_bias=bias)


def test_bad_layout_is_explained():
    q, k, v = qkv(4)
    with pytest.raises(ValueError, match="BMK .3-D., BMHK .4-D. or BMGHK"):
        kasoku.memory_efficient_attention(q[0, 0], k, v)


def test_dropout_applies_outside_export_and_refuses_inside():
    q, k, v = qkv(4)
    torch.manual_seed(0)
    dropped = kasoku.memory_efficient_attention(q, k, v, p=0.5)
    assert not torch.allclose(dropped, kasoku.memory_efficient_attention(q, k, v))

    class WithDropout(torch.nn.Module):
        def forward(self, q, k, v):
            return kasoku.memory_efficient_attention(q, k, v, p=0.1)

    with pytest.raises(DropoutNotExportable, match="dropout p=0.1 during ONNX export"):
        torch.onnx.export(WithDropout(), (q, k, v), None, dynamo=False)


# ---- exportable_attention() routing -----------------------------------------------------------


def test_routes_are_patched_inside_and_restored_after():
    with kasoku.exportable_attention():
        assert xops.memory_efficient_attention is kasoku.memory_efficient_attention
        assert fmha.memory_efficient_attention is kasoku.memory_efficient_attention
    assert xops.memory_efficient_attention is ORIGINAL
    assert fmha.memory_efficient_attention is ORIGINAL


def test_restored_when_the_body_raises():
    with pytest.raises(RuntimeError, match="boom"):
        with kasoku.exportable_attention():
            raise RuntimeError("boom")
    assert xops.memory_efficient_attention is ORIGINAL


def test_nested_contexts_restore_once():
    with kasoku.exportable_attention():
        with kasoku.exportable_attention():
            assert xops.memory_efficient_attention is kasoku.memory_efficient_attention
        assert xops.memory_efficient_attention is kasoku.memory_efficient_attention
    assert xops.memory_efficient_attention is ORIGINAL


def test_diffusers_xformers_backend_routes_to_native():
    from diffusers.models import attention_dispatch as dispatch

    registry, name = dispatch._AttentionBackendRegistry, dispatch.AttentionBackendName
    original = registry._backends[name.XFORMERS]
    q, k, v = qkv(4)  # dispatch layout is [B, S, H, D]
    with kasoku.exportable_attention():
        assert registry._backends[name.XFORMERS] is registry._backends[name.NATIVE]
        out = dispatch.dispatch_attention_fn(q, k, v, backend=name.XFORMERS)
    assert registry._backends[name.XFORMERS] is original
    torch.testing.assert_close(out.double(), reference(q, k, v), atol=2e-6, rtol=0)


def test_no_op_without_xformers(monkeypatch, caplog):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "xformers" else real_find_spec(name, *a)
    )
    caplog.set_level(logging.DEBUG, logger="kasoku.core.attention")
    with kasoku.exportable_attention():
        assert xops.memory_efficient_attention is ORIGINAL
    assert "xFormers is not installed" in caplog.text
    assert "xformers" in sys.modules  # this test only hides it from the context manager


class _SingleHead(torch.nn.Module):
    def forward(self, query, key, value):
        return torch.nn.functional.scaled_dot_product_attention(query, key, value)


def test_torch_attention_on_three_dimensional_inputs_exports_to_onnx(tmp_path):
    import onnxruntime as ort

    query, key, value = (torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with kasoku.exportable_attention(), torch.no_grad():
        program = torch.onnx.export(_SingleHead(), (query, key, value), dynamo=True, verbose=False,
                                    input_names=["query", "key", "value"])
    program.save(str(tmp_path / "attention.onnx"))
    from kasoku.core.attention import _SDPA

    assert torch.nn.functional.scaled_dot_product_attention is _SDPA  # restored on exit
    session = ort.InferenceSession(str(tmp_path / "attention.onnx"), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {"query": query.numpy(), "key": key.numpy(), "value": value.numpy()})
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value).numpy()
    np.testing.assert_allclose(out, expected, atol=1e-5)
