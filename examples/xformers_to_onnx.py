"""Seed 000 reproduced: a model that calls xFormers cannot be exported to ONNX; under
`kasoku.exportable_attention()` it can, and the ONNX model computes the same thing.

    python examples/xformers_to_onnx.py [--out DIR] [--repeats N]

1. A module that does `from xformers.ops import memory_efficient_attention` (as the seed's
   does) fails plain `torch.onnx.export`: the error is printed.
2. Under `kasoku.exportable_attention()` the same module exports (dynamo exporter).
3. Parity: ONNX Runtime against a float64 reference of the attention, and against xFormers
   itself when a CUDA GPU is present.
4. Timing, unlike the seed's single cold call: warm-up first, then min / median / max of
   repeats for torch (the exportable attention) and ONNX Runtime on the CPU, and xFormers
   on the GPU when there is one.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

import kasoku

SHAPE = (1, 128, 8, 64)  # the seed's [B, M, H, K]


def load_seed_model() -> torch.nn.Module:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from seed_xformers_attention import XformersAttentionModel

    return XformersAttentionModel().eval()


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> np.ndarray:
    """Float64 attention in BMHK, the formula of xFormers' docstring."""
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    attn = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    return (attn.softmax(-1) @ v).transpose(1, 2).numpy()


def timed(fn, repeats: int, warmup: int = 3, sync=lambda: None) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return {"min_ms": min(samples), "median_ms": statistics.median(samples), "max_ms": max(samples)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for the ONNX file (default: temporary)")
    parser.add_argument("--repeats", type=int, default=20, help="timed repeats after warm-up (default 20)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    logging.getLogger("xformers").setLevel(logging.ERROR)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    out = args.out or Path(tempfile.mkdtemp(prefix="kasoku-xformers-"))
    out.mkdir(parents=True, exist_ok=True)
    onnx_path = out / "attention.onnx"

    model = load_seed_model()
    torch.manual_seed(42)
    q, k, v = (torch.rand(SHAPE) for _ in range(3))
    export_kwargs = dict(input_names=["query", "key", "value"], output_names=["output"], opset_version=18)
    result: dict = {}

    print("1. plain torch.onnx.export of a model calling xFormers:")
    result["plain_export_errors"] = {}
    for exporter in ("torchscript", "dynamo"):
        try:
            torch.onnx.export(
                model, (q, k, v), str(out / "plain.onnx"), dynamo=exporter == "dynamo", verbose=False, **export_kwargs
            )
            message = None
            print(f"   {exporter}: exported (unexpected: this xFormers build traced)")
        except Exception as error:  # the seed's failure; its type depends on the exporter and build
            message = f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
            print(f"   {exporter}: fails, as in the seed: {message}")
        result["plain_export_errors"][exporter] = message

    print("2. under kasoku.exportable_attention():")
    with kasoku.exportable_attention():
        torch.onnx.export(model, (q, k, v), str(onnx_path), dynamo=True, verbose=False, **export_kwargs)
    print(f"   exported to {onnx_path}")

    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    feeds = {"query": q.numpy(), "key": k.numpy(), "value": v.numpy()}
    onnx_out = session.run(None, feeds)[0]
    result["max_abs_vs_float64"] = float(np.abs(onnx_out - reference_attention(q, k, v)).max())
    print(f"3. ONNX Runtime vs float64 reference: max|Δ| = {result['max_abs_vs_float64']:.2e}")
    if torch.cuda.is_available():
        xq, xk, xv = (x.cuda() for x in (q, k, v))
        xformers_out = model.cuda()(xq, xk, xv).cpu().numpy()
        result["max_abs_vs_xformers"] = float(np.abs(onnx_out - xformers_out).max())
        print(f"   ONNX Runtime vs xFormers (GPU): max|Δ| = {result['max_abs_vs_xformers']:.2e}")

    print(f"4. timing, {args.repeats} repeats after warm-up (ms):")
    with kasoku.exportable_attention(), torch.no_grad():
        result["torch_cpu_exportable"] = timed(lambda: model.cpu()(q, k, v), args.repeats)
    result["onnxruntime_cpu"] = timed(lambda: session.run(None, feeds), args.repeats)
    if torch.cuda.is_available():
        result["xformers_gpu"] = timed(lambda: model.cuda()(xq, xk, xv), args.repeats, sync=torch.cuda.synchronize)
    for name in ("torch_cpu_exportable", "onnxruntime_cpu", "xformers_gpu"):
        if name in result:
            t = result[name]
            print(f"   {name:22s} median {t['median_ms']:8.3f}  min {t['min_ms']:8.3f}  max {t['max_ms']:8.3f}")
    return result


if __name__ == "__main__":
    main()
