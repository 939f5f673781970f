"""Exportable xFormers attention.

xFormers' ``memory_efficient_attention`` dispatches to custom CUDA/Triton kernels that neither
ONNX exporter can trace (seed 000: ``Found an unsupported argument type c10::SymInt in the JIT
tracer``). :func:`memory_efficient_attention` reproduces its semantics with plain tensor ops
(the "equivalent pytorch code" of its docstring, generalised to every layout and to the
attention-bias kinds that can be expressed statically), and :func:`exportable_attention`
routes every path to xFormers through it while a model is exported.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from .errors import KasokuError

logger = logging.getLogger(__name__)

_LAYOUTS = {3: "BMK", 4: "BMHK", 5: "BMGHK"}


class UnsupportedAttentionBias(KasokuError, TypeError):
    """An xFormers attention-bias kind that has no static, exportable equivalent."""


class DropoutNotExportable(KasokuError, RuntimeError):
    """Dropout was requested inside an ONNX export."""


def _is_exporting() -> bool:
    return torch.onnx.is_in_onnx_export() or torch.compiler.is_exporting()


def _check_layout(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    if query.ndim not in _LAYOUTS or key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(
            "query, key and value must all be BMK (3-D), BMHK (4-D) or BMGHK (5-D) but have "
            f"shapes {tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}."
        )


# Explicit permutations: the TorchScript exporter writes negative `movedim` axes into
# Transpose's `perm`, which ONNX forbids.
_TO_HEADS_FIRST = {4: (0, 2, 1, 3), 5: (0, 2, 3, 1, 4)}
_FROM_HEADS_FIRST = {4: (0, 2, 1, 3), 5: (0, 3, 1, 2, 4)}


def _heads_before_sequence(x: torch.Tensor) -> torch.Tensor:
    """BMK stays; BMHK -> BHMK; BMGHK -> BGHMK (sequence next to the embedding)."""
    return x.permute(_TO_HEADS_FIRST[x.ndim]) if x.ndim in _TO_HEADS_FIRST else x


def _sequence_back_in_place(x: torch.Tensor) -> torch.Tensor:
    return x.permute(_FROM_HEADS_FIRST[x.ndim]) if x.ndim in _FROM_HEADS_FIRST else x


# ---- attention-bias kinds -------------------------------------------------------------------
# Causal kinds are built from index comparisons so that the sequence lengths stay dynamic in
# the exported graph; block-diagonal kinds carry static sequence lengths, so xFormers' own
# `materialize` is exact and becomes a constant.


def _keep_mask(
    num_queries: int,
    num_keys: int,
    device: torch.device,
    *,
    from_bottom_right: bool,
    window_left: int | None = None,
    window_right: int = 0,
) -> torch.Tensor:
    """True where query i may attend key j: ``i + shift - window_left <= j <= i + shift + window_right``."""
    rows = torch.arange(num_queries, device=device).unsqueeze(-1)
    cols = torch.arange(num_keys, device=device).unsqueeze(0)
    diagonal = rows + (num_keys - num_queries) if from_bottom_right else rows
    keep = cols <= diagonal + window_right
    if window_left is not None:
        keep = keep & (cols >= diagonal - window_left)
    return keep


def _xformers_bias_module() -> Any | None:
    if importlib.util.find_spec("xformers") is None:
        return None
    return importlib.import_module("xformers.ops.fmha.attn_bias")


def _bias_builders() -> dict[type, Callable[[Any, torch.Tensor], tuple[torch.Tensor | None, torch.Tensor | None]]]:
    """Map each supported bias class to a builder returning (keep_mask, additive_bias).

    `scores` is the attention-score tensor (``[..., Mq, Mkv]``) the bias applies to.
    """
    ab = _xformers_bias_module()
    if ab is None:
        return {}

    def causal(from_bottom_right: bool, window: Callable[[Any], dict] = lambda b: {}):
        def build(bias, scores):
            mq, mkv = scores.shape[-2], scores.shape[-1]
            keep = _keep_mask(mq, mkv, scores.device, from_bottom_right=from_bottom_right, **window(bias))
            return keep, None

        return build

    def causal_with_tensor(bias, scores):
        keep, _ = causal(False)(bias, scores)
        return keep, bias._bias

    def block_diagonal(bias, scores):
        if scores.shape[0] != 1:
            raise ValueError(
                f"{type(bias).__name__} needs batch size 1 (sequences concatenated along M, as "
                f"xFormers requires) but the batch size is {scores.shape[0]}."
            )
        shape = (int(scores.shape[-2]), int(scores.shape[-1]))
        return None, bias.materialize(shape, dtype=torch.float32, device=scores.device)

    return {
        ab.LowerTriangularMask: causal(False),
        ab.LowerTriangularFromBottomRightMask: causal(True),
        ab.LowerTriangularFromBottomRightLocalAttentionMask: causal(
            True, lambda b: {"window_left": b._window_size - 1}
        ),
        ab.LocalAttentionFromBottomRightMask: causal(
            True, lambda b: {"window_left": b.window_left, "window_right": b.window_right}
        ),
        ab.LowerTriangularMaskWithTensorBias: causal_with_tensor,
        ab.BlockDiagonalMask: block_diagonal,
        ab.BlockDiagonalCausalMask: block_diagonal,
        ab.BlockDiagonalCausalFromBottomRightMask: block_diagonal,
        ab.BlockDiagonalCausalLocalAttentionMask: block_diagonal,
        ab.BlockDiagonalCausalLocalAttentionFromBottomRightMask: block_diagonal,
    }


def supported_bias_kinds() -> list[str]:
    """Names of the xFormers attention-bias classes :func:`memory_efficient_attention` accepts."""
    return sorted(kind.__name__ for kind in _bias_builders())


def _apply_bias(scores: torch.Tensor, attn_bias: Any) -> torch.Tensor:
    if attn_bias is None:
        return scores
    if isinstance(attn_bias, torch.Tensor):
        return scores + attn_bias.to(scores.dtype)
    builder = _bias_builders().get(type(attn_bias))
    if builder is None:
        raise UnsupportedAttentionBias(
            f"attn_bias of kind {type(attn_bias).__name__} cannot be expressed with static tensor "
            f"ops, so it cannot be exported. Supported kinds: a torch.Tensor, "
            f"{', '.join(supported_bias_kinds())}."
        )
    keep, additive = builder(attn_bias, scores)
    if additive is not None:
        scores = scores + additive.to(scores.dtype)
    if keep is not None:
        scores = scores.masked_fill(~keep, -math.inf)
    return scores


def memory_efficient_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | Any | None = None,
    p: float = 0.0,
    scale: float | None = None,
    *,
    op: Any = None,
    output_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """xFormers' ``memory_efficient_attention`` in plain, exportable tensor ops.

    Same signature and semantics as ``xformers.ops.memory_efficient_attention`` (xFormers
    0.0.35, ``fmha/__init__.py`` and ``fmha/common.py``): inputs ``[B, M, K]``,
    ``[B, M, H, K]`` or ``[B, M, G, H, K]``; output ``query.shape[:-1] + (value.shape[-1],)``
    in query's dtype; scale defaults to ``query.shape[-1] ** -0.5``; ``attn_bias`` is an
    additive tensor broadcastable to the score shape (``[B, Mq, Mkv]``, ``[B, H, Mq, Mkv]``
    or ``[B, G, H, Mq, Mkv]``) or one of :func:`supported_bias_kinds`. ``op`` is accepted and
    ignored (it selects an xFormers kernel). Softmax runs in fp32 for fp16/bf16 inputs.
    """
    del op
    _check_layout(query, key, value)
    if p > 0.0 and _is_exporting():
        raise DropoutNotExportable(
            f"memory_efficient_attention was called with dropout p={p} during ONNX export; "
            "dropout is random at inference and cannot be exported faithfully. Export the "
            "model in eval mode with p=0."
        )
    compute_dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    q = _heads_before_sequence(query).to(compute_dtype)
    k = _heads_before_sequence(key).to(compute_dtype)
    v = _heads_before_sequence(value).to(compute_dtype)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = (q * scale) @ k.transpose(-2, -1)
    scores = _apply_bias(scores, attn_bias)
    probs = scores.softmax(dim=-1)
    if p > 0.0:
        probs = torch.nn.functional.dropout(probs, p=p, training=True)
    out = _sequence_back_in_place(probs @ v)
    return out.to(output_dtype or query.dtype).contiguous()


# ---- routing every path to xFormers through the exportable function ------------------------


@dataclass
class _Patches:
    """Attribute replacements that are undone in reverse order."""

    undo: list[tuple[Any, str, Any, bool]] = field(default_factory=list)

    def set_attr(self, owner: Any, name: str, value: Any) -> None:
        self.undo.append((owner, name, getattr(owner, name), False))
        setattr(owner, name, value)

    def set_item(self, owner: dict, name: str, value: Any) -> None:
        self.undo.append((owner, name, owner[name], True))
        owner[name] = value

    def restore(self) -> None:
        while self.undo:
            owner, name, value, is_item = self.undo.pop()
            if is_item:
                owner[name] = value
            else:
                setattr(owner, name, value)


def _patch_xformers_functions(patches: _Patches, xformers_ops: Any) -> int:
    """Replace xFormers' function on its modules and wherever it was imported by name."""
    originals = {
        id(xformers_ops.memory_efficient_attention): xformers_ops.memory_efficient_attention,
        id(xformers_ops.fmha.memory_efficient_attention): xformers_ops.fmha.memory_efficient_attention,
    }
    originals.pop(id(memory_efficient_attention), None)  # already patched by an outer context
    count = 0
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            if id(value) in originals and value is originals[id(value)]:
                patches.set_item(namespace, name, memory_efficient_attention)
                count += 1
    return count


def _patch_diffusers_dispatch(patches: _Patches) -> bool:
    """Point diffusers' "xformers" attention backend at its native (SDPA) backend.

    Newer diffusers models call ``dispatch_attention_fn``, which looks the backend up in one
    registry, whether it was set globally or per processor; swapping the registry entry covers
    both, and the native backend exports cleanly.
    """
    dispatch = sys.modules.get("diffusers.models.attention_dispatch")
    if dispatch is None:
        return False
    registry = dispatch._AttentionBackendRegistry
    xformers_name, native_name = dispatch.AttentionBackendName.XFORMERS, dispatch.AttentionBackendName.NATIVE
    if native_name not in registry._backends:
        return False
    for table in (registry._backends, registry._constraints, registry._supported_arg_names):
        if xformers_name in table:
            patches.set_item(table, xformers_name, table[native_name])
    return True


_SDPA = torch.nn.functional.scaled_dot_product_attention


def _sdpa_of_any_rank(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None, *args, **kwargs):
    """torch's SDPA as exported: torch.onnx converts 4-D query, key and value only, so a 3-D call (a VAE's
    single-head attention, HunyuanImage's) runs as one head of a 4-D one, the same numbers."""
    if query.ndim != 3:
        return _SDPA(query, key, value, attn_mask, *args, **kwargs)
    mask = attn_mask.unsqueeze(1) if isinstance(attn_mask, torch.Tensor) and attn_mask.ndim == 3 else attn_mask
    return _SDPA(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask, *args, **kwargs).squeeze(1)


@contextmanager
def exportable_attention() -> Iterator[None]:
    """Make every route to xFormers' memory-efficient attention exportable, then restore it.

    Inside the block, ``xformers.ops.memory_efficient_attention``,
    ``xformers.ops.fmha.memory_efficient_attention``, the same function bound into any
    loaded module by ``from xformers.ops import memory_efficient_attention`` (diffusers'
    xFormers attention processors call it through the module attribute, so they are covered
    with their weights and per-module mapping untouched), and diffusers' "xformers" attention
    backend all compute :func:`memory_efficient_attention`. Everything is restored on exit,
    also when the block raises. Without xFormers installed it only patches diffusers'
    backend registry (a no-op unless someone registered xformers there). torch's own SDPA called on 3-D
    tensors runs as 4-D (:func:`_sdpa_of_any_rank`), the only rank torch.onnx converts.
    """
    patches = _Patches()
    try:
        if importlib.util.find_spec("xformers") is None:
            logger.debug("xFormers is not installed: exportable_attention() has nothing to patch.")
        else:
            xformers_ops = importlib.import_module("xformers.ops")
            count = _patch_xformers_functions(patches, xformers_ops)
            logger.debug("exportable_attention: replaced %d references to xFormers attention.", count)
        _patch_diffusers_dispatch(patches)
        patches.set_attr(torch.nn.functional, "scaled_dot_product_attention", _sdpa_of_any_rank)
        yield
    finally:
        patches.restore()
