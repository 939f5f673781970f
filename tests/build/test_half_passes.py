"""The fp16 and bf16 graph passes that TensorRT 11's strongly typed networks (and ONNX Runtime's GPU
providers) are built from, on small hand-made graphs: weights kept in a side file (graph-only models
over 2 GB) are converted too, and bf16 weights are rounded from fp32."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kasoku.build.optimize import PassContext, bf16_bits, save_model, to_bf16, to_fp16
from kasoku.core.components import Precision

RNG = np.random.default_rng(0)
WEIGHT = (RNG.standard_normal((64, 32)) * 0.1).astype(np.float32)
BIAS = RNG.standard_normal(32).astype(np.float32)


def _model() -> onnx.ModelProto:
    """y = softmax(x @ W + b) * 0.5, with the 0.5 a Constant node."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["z"]),
        helper.make_node("Softmax", ["z"], ["s"], axis=-1),
        helper.make_node("Constant", [], ["half"], value=numpy_helper.from_array(np.array(0.5, np.float32))),
        helper.make_node("Mul", ["s", "half"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 32])],
                              [numpy_helper.from_array(WEIGHT, "W"), numpy_helper.from_array(BIAS, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _graph_only(tmp_path) -> onnx.ModelProto:
    """The model as kasoku.build.optimize.load_graph hands a model over 2 GB to the passes: weights left in their
    file, referenced by absolute path."""
    path = tmp_path / "source.onnx"
    onnx.save_model(_model(), str(path), save_as_external_data=True, location="source.onnx.data", size_threshold=0)
    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = str(tmp_path / entry.value)
    return model


def _run(path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("graph_only", [False, True], ids=["in-memory", "graph-only"])
def test_fp16_pass_converts_weights_also_when_they_stay_in_their_file(tmp_path, graph_only):
    model = _graph_only(tmp_path) if graph_only else _model()
    converted = to_fp16(model, PassContext("c", Precision.FP16))
    weight = next(t for t in converted.graph.initializer if t.name == "W")
    assert weight.data_type == TensorProto.FLOAT16 and not weight.external_data
    assert np.array_equal(numpy_helper.to_array(weight), WEIGHT.astype(np.float16))  # fp16 values, not fp32 bytes
    target = tmp_path / "out" / "model.onnx"
    save_model(converted, target)
    x = RNG.standard_normal((4, 64)).astype(np.float32)
    reference = _run(_write(tmp_path / "ref.onnx", _model()), x)
    assert np.abs(_run(target, x) - reference).max() < 1e-3  # fp16 drift, not garbage


def _write(path, model):
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("graph_only", [False, True], ids=["in-memory", "graph-only"])
def test_bf16_pass_types_the_graph_bf16_with_fp32_io(tmp_path, graph_only):
    model = _graph_only(tmp_path) if graph_only else _model()
    converted = to_bf16(model, PassContext("c", Precision.BF16))
    graph = converted.graph
    assert [i.type.tensor_type.elem_type for i in graph.input] == [TensorProto.FLOAT]
    assert [o.type.tensor_type.elem_type for o in graph.output] == [TensorProto.FLOAT]
    types = {t.data_type for t in graph.initializer} | {
        v.type.tensor_type.elem_type for v in graph.value_info}
    assert TensorProto.FLOAT16 not in types
    assert not any(a.i == TensorProto.FLOAT16 for n in graph.node for a in n.attribute if a.name == "to")
    weight = next(t for t in graph.initializer if t.name == "W")
    assert weight.data_type == TensorProto.BFLOAT16 and not weight.external_data
    # rounded from the fp32 weights as torch rounds them to bfloat16 (not through fp16)
    expected = torch.from_numpy(WEIGHT).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).ravel()
    assert np.array_equal(np.frombuffer(weight.raw_data, dtype=np.uint16), expected)
    half = next(n for n in graph.node if n.op_type == "Constant")
    assert half.attribute[0].t.data_type == TensorProto.BFLOAT16
    # Softmax stays fp32 (the keep-list): cast from bf16 before it
    casts = {n.output[0]: n.attribute[0].i for n in graph.node if n.op_type == "Cast"}
    assert TensorProto.BFLOAT16 in casts.values() and TensorProto.FLOAT in casts.values()
    onnx.checker.check_model(converted)


def test_bf16_bits_round_to_nearest_even_like_torch():
    values = np.array([1.0, -2.5, 3.1415927, 1e-40, 65504.0, 1e30, np.inf, -np.inf, 1.00390625, 1.01171875],
                      dtype=np.float32)
    expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bf16_bits(values), expected)
    assert bf16_bits(np.array([np.nan], np.float32))[0] == 0x7FC0


def test_the_passes_leave_other_precisions_alone():
    model = _model()
    assert to_bf16(model, PassContext("c", Precision.FP16)) is model
    assert to_fp16(model, PassContext("c", Precision.BF16)) is model
