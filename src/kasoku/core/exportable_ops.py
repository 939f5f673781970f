"""Operations diffusers' newer models use that an exporter cannot trace or converts wrongly, made exportable.

Beside attention (kasoku.core.attention), two kinds, inside :func:`exportable_ops`:

- ``torch.einsum`` of operands of different dtypes (HiDream's rotary embedding multiplies float32 positions by a
  float64 frequency table): torch promotes them, the ONNX converter does not, and the graph is refused by ONNX
  Runtime ("Type parameter (T) of Optype (Einsum) bound to different types"). Each operand is cast to the
  promoted dtype first, as torch computes it.
- Mixture-of-experts layers, below.

MoE layers:

diffusers' MoE transformers route tokens to experts on the host: HiDream's `MOEFeedForwardSwiGLU.moe_infer` counts
the tokens per expert with `.numpy()` of a bincount, NucleusMoE's `SwiGLUExperts` splits its tokens by
`.tolist()` of the counts. Neither is a graph. Inside :func:`exportable_experts` both compute the same numbers
without reading a tensor on the host:

- HiDream: every expert runs on every token, weighted by its gate weight where the gate chose it and by zero
  elsewhere (the routed sum, term by term). The routed experts then cost their number over the chosen number
  (4 over 2 in HiDream-I1) of their routed compute: the price of a graph.
- NucleusMoE routes by expert choice, the same number of tokens to every expert (its layer passes
  `torch.full(...)` as the counts), so its experts are one batched matmul over a (experts, tokens, width) view.

The torch modules themselves are left as they are outside the block; the export's parity check compares the
graph with them.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from .attention import _Patches

__all__ = ["exportable_ops"]

_HIDREAM = "diffusers.models.transformers.transformer_hidream_image"
_NUCLEUS = "diffusers.models.transformers.transformer_nucleusmoe_image"


def _every_expert_weighted(self, x: torch.Tensor, flat_expert_indices: torch.Tensor,
                           flat_expert_weights: torch.Tensor) -> torch.Tensor:
    """HiDream's `moe_infer`: the sum over each token's chosen experts of gate weight x expert output."""
    chosen = flat_expert_indices.view(x.shape[0], -1)
    weights = flat_expert_weights.view(x.shape[0], -1)
    out = torch.zeros_like(x)
    for index, expert in enumerate(self.experts):
        weight = (weights * (chosen == index).to(weights.dtype)).sum(dim=-1, keepdim=True)
        out = out + expert(x) * weight.to(x.dtype)
    return out


def _experts_of_equal_load(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """NucleusMoE's experts on tokens sorted by expert, as many for each (expert-choice routing)."""
    per_expert = x.reshape(self.num_experts, -1, x.shape[-1])
    gate, up = torch.bmm(per_expert, self.gate_up_proj).chunk(2, dim=-1)
    return torch.bmm(F.silu(gate) * up, self.down_proj).reshape(x.shape)


_EINSUM = torch.einsum


def _einsum_promoted(equation: str, *operands: Any) -> torch.Tensor:
    """torch.einsum with its operands cast to their promoted dtype (what torch computes in), so that the exported
    graph's Einsum takes one type."""
    tensors = operands[0] if len(operands) == 1 and isinstance(operands[0], (list, tuple)) else operands
    if len(tensors) > 1 and len({t.dtype for t in tensors}) > 1:
        dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
        tensors = [t.to(dtype) for t in tensors]
    return _EINSUM(equation, *tensors)


@contextmanager
def exportable_ops() -> Iterator[None]:
    """Inside the block, einsum promotes its operands and the MoE layers of the loaded diffusers modules route
    without the host (see the module's docstring); restored on exit, also when the block raises."""
    patches = _Patches()
    try:
        patches.set_attr(torch, "einsum", _einsum_promoted)
        hidream, nucleus = sys.modules.get(_HIDREAM), sys.modules.get(_NUCLEUS)
        if hidream is not None:
            patches.set_attr(hidream.MOEFeedForwardSwiGLU, "moe_infer", _every_expert_weighted)
        if nucleus is not None:
            patches.set_attr(nucleus.SwiGLUExperts, "_run_experts_for_loop", _experts_of_equal_load)
        yield
    finally:
        patches.restore()
