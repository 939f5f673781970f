"""The memory guard: a step whose memory cannot be counted beforehand (NNCF's int8 calibration) runs under a data
limit at the machine's free memory, so that running out is a clear error and not the kernel's out-of-memory kill."""

from __future__ import annotations

import functools
import resource

import numpy as np
import pytest

from kasoku.core import memory
from kasoku.core.cache import Cache
from kasoku.core.memory import MEMORY_CHECK_ENV, NotEnoughMemory, limited_to_free_memory

MIB = 2**20
REMEDY = "Do it with less"
GIB_OF_FLOATS = 2**28


@pytest.fixture
def free_beyond_floor(monkeypatch):
    """Make the machine look as if it had `headroom` bytes free beyond the guard's floor."""

    def set_headroom(headroom: int) -> None:
        monkeypatch.setattr(memory, "available_memory", lambda: memory.memory_floor() + headroom)

    return set_headroom


def test_an_allocation_past_the_free_memory_is_a_clear_error_and_the_limit_is_restored(free_beyond_floor):
    before = resource.getrlimit(resource.RLIMIT_DATA)
    free_beyond_floor(256 * MIB)
    expected = (r"the test step needs more memory than this machine has free: it stopped when it reached the 0\.2 GiB "
                r".* Do it with less; or use a machine with more memory, or set KASOKU_MEMORY_CHECK=0 to try "
                r"anyway\.")
    with pytest.raises(NotEnoughMemory, match=expected):
        with limited_to_free_memory("the test step", REMEDY):
            np.ones(GIB_OF_FLOATS, np.float32)
    assert resource.getrlimit(resource.RLIMIT_DATA) == before
    assert np.ones(GIB_OF_FLOATS, np.float32).sum() == GIB_OF_FLOATS  # the process goes on, unlimited


def test_openvino_running_out_inside_the_guard_is_the_same_clear_error(free_beyond_floor):
    ov = pytest.importorskip("openvino")
    import openvino.opset13 as ops

    # intermediate buffers of 8 x 4096 x 4096 floats (512 MiB), which OpenVINO allocates when it compiles
    x = ops.parameter([4096, 4096], np.float32, name="x")
    product = ops.matmul(x, x, False, False)
    stacked = ops.concat([product] * 8, 0)
    model = ov.Model([ops.reduce_max(ops.softmax(stacked, 1), [0, 1], False)], [x])
    free_beyond_floor(256 * MIB)
    with pytest.raises(NotEnoughMemory, match="OpenVINO's step needs more memory"):
        with limited_to_free_memory("OpenVINO's step", REMEDY):
            ov.Core().compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": 2}).create_infer_request().infer(
                {"x": np.ones((4096, 4096), np.float32)})


def test_other_errors_pass_through_the_guard(free_beyond_floor):
    free_beyond_floor(256 * MIB)
    with pytest.raises(RuntimeError, match="not about memory"):
        with limited_to_free_memory("the test step", REMEDY):
            raise RuntimeError("not about memory")


def test_with_the_check_off_the_guard_limits_nothing(free_beyond_floor, monkeypatch):
    monkeypatch.setenv(MEMORY_CHECK_ENV, "0")
    free_beyond_floor(0)
    with limited_to_free_memory("the test step", REMEDY):
        assert np.ones(GIB_OF_FLOATS, np.float32).sum() == GIB_OF_FLOATS


@pytest.mark.integration
def test_an_int8_build_without_memory_to_spare_is_refused_before_nncf_starts(tiny_pipe, tiny_cache, monkeypatch):
    import kasoku

    pytest.importorskip("nncf")
    monkeypatch.setattr(memory, "available_memory", lambda: memory.memory_floor() - MIB)
    with pytest.raises(NotEnoughMemory, match=r"int8 quantization of text_encoder \(weights recipe\) needs more memory"
                                              r" than this machine has free: .* GiB free, "
                                              r"and kasoku keeps .* GiB .*--precision bf16"):
        kasoku.compile(tiny_pipe, "openvino", precision="int8", components=["text_encoder"],
                       cache_dir=tiny_cache.root)


@pytest.mark.slow(reason="two builds stopped by the guard (its unit tests stay)")
@pytest.mark.integration
def test_a_build_the_guard_stopped_is_refused_before_its_work_until_more_memory_is_free(tiny_pipe, tmp_path,
                                                                                       monkeypatch):
    import kasoku
    from kasoku.pipeline import compiling

    pytest.importorskip("nncf")
    compile_unet = functools.partial(kasoku.compile, tiny_pipe, "openvino", precision="int8", components=["unet"],
                                     cache_dir=tmp_path)
    stopped_at = memory.memory_floor() - MIB
    monkeypatch.setattr(memory, "available_memory", lambda: stopped_at)
    with pytest.raises(NotEnoughMemory, match=r"int8 quantization of unet \(full recipe, calibrated at \d+x\d+\)"):
        compile_unet()
    built = {entry.key for entry in Cache(tmp_path).list()}  # the export and the calibration samples stay
    assert (tmp_path / "memory-stops.json").exists()

    monkeypatch.setattr(compiling, "available_memory", lambda: stopped_at + compiling.RETRY_MARGIN - MIB)
    with pytest.raises(NotEnoughMemory, match=r"unet: this build ran out of memory here before, with .* GiB free "
                                              r"\(.* GiB are free now\), so it is refused before its export and "
                                              r"calibration\. What it said then: int8 quantization of unet"):
        compile_unet()
    assert {entry.key for entry in Cache(tmp_path).list()} == built

    monkeypatch.undo()  # enough memory free again: the build goes ahead
    stages = compile_unet().compile_report.statuses()
    assert stages[("unet", "calibrate")] == "reused" and stages[("unet", "engine")] == "built"
    Cache(tmp_path).clear()
    assert not (tmp_path / "memory-stops.json").exists()  # clearing the cache forgets the stop too


def _outer_product_sum_engine():
    """An onnxruntime engine of y = rowsum(x xᵀ): an n x n intermediate that onnxruntime allocates itself (as its
    attention holds every score), n the free axis of `x`."""
    import onnxruntime as ort
    import torch
    from onnx import TensorProto, helper

    from kasoku.backends.onnxruntime import OnnxRuntimeEngine
    from kasoku.core.components import Axis, ComponentSpec, ImageShape, ShapeProfile, TensorSpec

    graph = helper.make_graph(
        [helper.make_node("Transpose", ["x"], ["xt"]), helper.make_node("MatMul", ["x", "xt"], ["outer"]),
         helper.make_node("ReduceSum", ["outer", "axes"], ["y"], keepdims=0)], "outer",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor("axes", TensorProto.INT64, [1], [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    n = Axis.free("n", 16, 1, 1 << 15)
    profile = ShapeProfile.exact(ImageShape(1, 64, 64), guidance=False, multiple=8)  # x's axis is free of it
    spec = ComponentSpec("outer", (TensorSpec("x", (n, 1)),), (TensorSpec("y", (n,)),), profile,
                         load_module=lambda: None, weights=lambda: "")
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return OnnxRuntimeEngine(spec, "fp32", session, torch.device("cpu")), torch


def test_an_engine_call_that_runs_out_of_memory_is_a_clear_error_that_names_the_remedy(free_beyond_floor):
    """What a call holds grows with its shape (onnxruntime's attention holds every score): past the free memory it
    is refused in one line that names the call and what to do, where the kernel would have killed the process."""
    engine, torch = _outer_product_sum_engine()
    before = resource.getrlimit(resource.RLIMIT_DATA)
    free_beyond_floor(256 * MIB)
    big = torch.ones(1 << 14, 1)  # a 1 GiB intermediate
    with pytest.raises(NotEnoughMemory, match=r"^the outer engine \(onnxruntime\) on x \(16384, 1\) needs more memory "
                                              r"than this machine has free: .* Call it with a smaller image or fewer "
                                              r"images, or try OpenVINO \(backend=\"openvino\"\)"):
        engine.run({"x": big})
    assert resource.getrlimit(resource.RLIMIT_DATA) == before
    assert engine.run({"x": torch.ones(64, 1)})["y"].tolist() == [64.0] * 64  # the engine goes on


def test_guards_at_once_share_one_limit_and_the_last_to_leave_takes_it_off(free_beyond_floor):
    before = resource.getrlimit(resource.RLIMIT_DATA)
    free_beyond_floor(256 * MIB)
    with limited_to_free_memory("the outer step", REMEDY):
        limit = resource.getrlimit(resource.RLIMIT_DATA)
        with limited_to_free_memory("the inner step", REMEDY):
            assert resource.getrlimit(resource.RLIMIT_DATA) == limit
        assert resource.getrlimit(resource.RLIMIT_DATA) == limit  # the outer one still runs under it
    assert resource.getrlimit(resource.RLIMIT_DATA) == before
    with pytest.raises(NotEnoughMemory, match="^the inner step needs more memory"):  # named by the step that ran out
        with limited_to_free_memory("the outer step", REMEDY), limited_to_free_memory("the inner step", REMEDY):
            np.ones(GIB_OF_FLOATS, np.float32)
    assert resource.getrlimit(resource.RLIMIT_DATA) == before
