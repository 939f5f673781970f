"""Complex-valued tensors the ONNX exporter cannot convert yet: rotary embeddings kept as complex numbers.

Several diffusion transformers (Qwen-Image, Z-Image, Lumina) keep their rotary position embeddings as complex
numbers (``torch.polar``) and split, index or pad the table before they multiply. torch.onnx carries a complex
tensor as a real one with a trailing pair (real, imaginary), and converts the ops torchlib has a complex form of;
it has none for ``split_with_sizes``, ``index``, ``select``, their scatters, ``pad``, ``unsqueeze``,
``expand``, ``alias`` or ``new_full``. Each of these addresses the complex tensor's own dimensions, which the real
form keeps in front of the pair: their complex forms are the real ones with the pair left out of what they address
(a negative dimension counts past it; it is not padded; it is expanded as it is). A complex ``new_full`` of a real
value is that value and an imaginary zero in each pair.

torch.onnx's own ``custom_translation_table`` cannot mark a function as complex (a TODO in torch.onnx), so
:func:`complex_ops_registered` adds these to the registry the exporter builds, for the duration of one export.
"""

# no `from __future__ import annotations`: the exporter reads these functions' annotations as objects
import contextlib
from collections.abc import Iterator, Sequence
from typing import Optional

import torch

__all__ = ["complex_ops_registered"]


def _leading(dim: int) -> int:
    """A dimension of a complex tensor in its real form: a negative one counts past the trailing pair."""
    return dim - 1 if dim < 0 else dim


def _complex_forms() -> dict:
    from onnxscript.function_libs.torch_lib.ops import core, nn
    from onnxscript.onnx_opset import opset18 as op

    def split_with_sizes_complex(self: core.TTensor, split_sizes: core.INT64, dim: int = 0) -> core.TTensor:
        # the real form's trailing pair is not one of the split dimensions: count a negative one past it
        return core.aten_split_with_sizes(self, split_sizes, _leading(dim))

    def index_complex(self: core.TensorType, indices: Sequence[Optional[core.INT64]]) -> core.TensorType:  # noqa: UP045
        # indices address leading dimensions only (the pair follows them); ONNX gathers with int64 indices only
        return core.aten_index(self, [_int64(i) for i in indices])

    def _int64(index):
        if index is None or index.dtype != core.INT32.dtype:
            return index
        wide = op.Cast(index, to=core.INT64.dtype)
        wide.shape, wide.dtype = index.shape, core.INT64.dtype  # what aten_index reads of its indices
        return wide

    def new_full_complex(self: core.TTensor, size: core.INT64, fill_value: core.TensorType, dtype: int = -1,
                         layout: str = "", device: str = "", pin_memory: bool = False) -> core.TTensor:
        real = op.Reshape(op.CastLike(fill_value, self), op.Constant(value_ints=[1]))
        pair = op.Concat(real, op.CastLike(op.Constant(value_floats=[0.0]), self), axis=0)
        return op.Expand(pair, op.Concat(op.Reshape(size, op.Constant(value_ints=[-1])),
                                         op.Constant(value_ints=[2]), axis=0))

    def constant_pad_nd_complex(self: core.TTensor, pad: Sequence[core.INT64], value: float = 0.0) -> core.TTensor:
        # pads pair up from the last dimension backwards: the trailing pair is not padded
        return core.aten_constant_pad_nd(self, [0, 0, *pad], value)

    def pad_complex(self: core.TensorType, pad: Sequence[core.INT64], mode: str = "constant",
                    value: Optional[float] = None) -> core.TensorType:  # noqa: UP045
        return nn.aten_pad(self, [0, 0, *pad], mode, value)

    def select_complex(self: core.TTensor, dim: int, index: int) -> core.TTensor:
        return core.aten_select(self, _leading(dim), index)

    def select_scatter_complex(self: core.TensorType, src: core.TensorType, dim: int,
                               index: int) -> core.TensorType:
        return core.aten_select_scatter(self, src, _leading(dim), index)

    def slice_scatter_complex(self: core.TTensor, src: core.TTensor, dim: int = 0,
                              start: Optional[core.INT64] = None, end: Optional[core.INT64] = None,  # noqa: UP045
                              step: core.INT64 = 1) -> core.TTensor:
        return core.aten_slice_scatter(self, src, _leading(dim), start, end, step)

    def alias_complex(self: core.TTensor) -> core.TTensor:
        return op.Identity(self)

    def unsqueeze_complex(self: core.TTensor, dim: int) -> core.TTensor:
        return core.aten_unsqueeze(self, _leading(dim))

    def expand_complex(self: core.TTensor, size: Sequence[core.INT64], implicit: bool = False) -> core.TTensor:
        return core.aten_expand(self, [*size, 2])

    return {torch.ops.aten.split_with_sizes.default: split_with_sizes_complex,
            torch.ops.aten.unsqueeze.default: unsqueeze_complex,
            torch.ops.aten.expand.default: expand_complex,
            torch.ops.aten.alias.default: alias_complex,
            torch.ops.aten.select.int: select_complex,
            torch.ops.aten.select_scatter.default: select_scatter_complex,
            torch.ops.aten.slice_scatter.default: slice_scatter_complex,
            torch.ops.aten.constant_pad_nd.default: constant_pad_nd_complex,
            torch.ops.aten.pad.default: pad_complex,
            torch.ops.aten.index.Tensor: index_complex,
            torch.ops.aten.new_full.default: new_full_complex}


@contextlib.contextmanager
def complex_ops_registered() -> Iterator[None]:
    """Within it, the ONNX registries torch.onnx builds also convert these ops on complex tensors."""
    from torch.onnx._internal.exporter import _registration

    registry_class = _registration.ONNXRegistry
    original = registry_class.__dict__["from_torchlib"]

    def from_torchlib(cls, *args, **kwargs):
        registry = original.__func__(cls, *args, **kwargs)
        for target, function in _complex_forms().items():
            registry.register_op(target, function, is_complex=True)
        return registry

    registry_class.from_torchlib = classmethod(from_torchlib)
    try:
        yield
    finally:
        registry_class.from_torchlib = original
