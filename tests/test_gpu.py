"""TensorRT and ONNX Runtime CUDA on a real GPU: build, run, parity. Skipped without one."""

from __future__ import annotations

import pytest

from kasoku.backends.tensorrt import TensorRTBackend
from kasoku.components import ImageShape
from kasoku.parity import compare_outputs

availability = TensorRTBackend.availability()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(not availability.available, reason=f"TensorRT unavailable: {availability.reason}"),
]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_tensorrt_engines_build_run_and_match(tiny_dir, tmp_path, tiny_specs, precision):
    from kasoku.build import compile_components

    engines, report = compile_components(tiny_dir, backend="tensorrt", precision=precision, cache=tmp_path)
    assert set(report.backends.values()) == {"tensorrt"}
    for name, engine in engines.items():
        spec = tiny_specs[name]
        for shape in (ImageShape(1, 64, 64), ImageShape(2, 32, 96)):
            inputs = spec.sample_inputs(shape, seed=5)
            results = compare_outputs(name, str(shape), spec.run_torch(inputs), engine.run(inputs), precision)
            assert all(r.passed for r in results), [r.line() for r in results]
    _, again = compile_components(tiny_dir, backend="tensorrt", precision=precision, cache=tmp_path)
    assert {s.status for s in again.stages} == {"reused"}
