"""Operations of diffusers' newer models made exportable (kasoku.core.exportable_ops): the same numbers as the
torch module, a graph torch.export can trace, everything restored after."""

from __future__ import annotations

import pytest
import torch

from kasoku.core.exportable_ops import exportable_ops

hidream = pytest.importorskip("diffusers.models.transformers.transformer_hidream_image")
nucleus = pytest.importorskip("diffusers.models.transformers.transformer_nucleusmoe_image")


def _hidream_moe() -> torch.nn.Module:
    torch.manual_seed(0)
    return hidream.MOEFeedForwardSwiGLU(dim=16, hidden_dim=32, num_routed_experts=4, num_activated_experts=2).eval()


def _nucleus_moe() -> torch.nn.Module:
    torch.manual_seed(0)
    layer = nucleus.NucleusMoELayer(hidden_size=16, moe_intermediate_dim=24, num_experts=4, capacity_factor=1.0,
                                    use_sigmoid=False, route_scale=1.0).eval()
    for weight in (layer.experts.gate_up_proj, layer.experts.down_proj):
        torch.nn.init.normal_(weight, std=0.2)
    return layer


def test_hidreams_experts_weighted_densely_are_its_routed_experts():
    layer, x = _hidream_moe(), torch.randn(2, 10, 16)
    with torch.no_grad():
        routed = layer(x)
        with exportable_ops():
            dense = layer(x)
    assert torch.allclose(routed, dense, atol=1e-6)


def test_nucleus_experts_of_equal_load_are_its_looped_experts():
    layer, x, unmodulated, t = _nucleus_moe(), torch.randn(2, 12, 16), torch.randn(2, 12, 16), torch.randn(2, 16)
    with torch.no_grad():
        looped = layer(x, unmodulated, t)
        with exportable_ops():
            batched = layer(x, unmodulated, t)
    assert torch.allclose(looped, batched, atol=1e-6)


def test_hidreams_moe_traces_only_inside_the_block():
    layer = _hidream_moe()
    with pytest.raises(Exception, match="numpy|data-dependent|Could not guard"):  # its routing read on the host
        torch.export.export(layer, (torch.randn(2, 10, 16),))


@pytest.mark.parametrize("build,inputs", [
    (_hidream_moe, lambda: (torch.randn(2, 10, 16),)),
    # NucleusMoE's loop traces in torch.export (its counts are a torch.full), but its split by `.tolist()` sizes
    # fails the ONNX decomposition; the batched form is one matmul per projection
    (_nucleus_moe, lambda: (torch.randn(2, 12, 16), torch.randn(2, 12, 16), torch.randn(2, 16)))])
def test_moe_layers_trace_inside_the_block_and_compute_the_same(build, inputs):
    layer, args = build(), inputs()
    with exportable_ops():
        program = torch.export.export(layer, args)
    with torch.no_grad():
        assert torch.allclose(program.module()(*args), layer(*args), atol=1e-6)


def test_einsum_promotes_mixed_operands_and_everything_is_restored():
    positions, frequencies = torch.arange(6, dtype=torch.float32), torch.rand(4, dtype=torch.float64)
    before = (torch.einsum, hidream.MOEFeedForwardSwiGLU.moe_infer, nucleus.SwiGLUExperts._run_experts_for_loop)
    expected = torch.einsum("n,d->nd", positions, frequencies)
    with exportable_ops():
        promoted = torch.einsum("n,d->nd", positions, frequencies)
        assert torch.einsum is not before[0]
    assert promoted.dtype == torch.float64 and torch.equal(promoted, expected)
    assert (torch.einsum, hidream.MOEFeedForwardSwiGLU.moe_infer,
            nucleus.SwiGLUExperts._run_experts_for_loop) == before
