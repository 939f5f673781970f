"""Peak memory of building an OpenVINO engine: kasoku's build against OpenVINO's own compile of the same ONNX file.

The model is SD3.5-medium's transformer at its full width with fewer layers (default 4, two of them dual-attention;
random weights), at 512x512 with guidance, fp32. Each contender runs in its own process:
- `openvino`: OpenVINO's read_model, reshape to the static shape, compile_model (what a build cannot do with less);
- `kasoku`: kasoku's OpenVINO build of the same file (compile_components with onnx_dir), which also writes the
  compiled blob into the cache entry, then loads it;
- `kasoku-export_model`: the same build writing the blob through `export_model` (kasoku before 2026-12-03).
Reported per contender: the peak of anonymous memory (sampled every 20 ms: what the kernel cannot drop) and the peak
resident set (VmHWM: also counts the pages of mapped weight files, which the kernel can drop), and the seconds.

    .venv/bin/python benchmarks/openvino_build_memory.py [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
WORK = HERE / ".models" / "openvino-build-memory"
CONTENDERS = ("openvino", "kasoku", "kasoku-export_model")


class AnonymousPeak:
    """The peak of this process's anonymous resident memory (RssAnon), sampled in a thread."""

    def __init__(self, every_s: float = 0.02):
        self.peak_kb, self._every, self._stop = 0, every_s, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def now_kb() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("RssAnon"))

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_kb = max(self.peak_kb, self.now_kb())
            time.sleep(self._every)

    def __enter__(self) -> AnonymousPeak:
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_kb = max(self.peak_kb, self.now_kb())


def _benchmark_model(layers: int):
    """full_sd35 (the SD3.5-medium configs) with `layers` transformer layers, the first two dual-attention."""
    import full_sd35

    full_sd35.TRANSFORMER = {**full_sd35.TRANSFORMER, "num_layers": layers,
                             "dual_attention_layers": tuple(range(min(2, layers)))}
    return full_sd35


def stage_export(layers: int) -> dict:
    from kasoku.build.export import export_component

    spec = _benchmark_model(layers)._component_spec("transformer", 512, real=True)
    exported = export_component(spec, WORK / f"onnx-{layers}" / spec.name / "model.onnx", check_shapes=[])
    return {"onnx_bytes": exported.size_bytes, "export_s": exported.seconds}


def stage_build(contender: str, layers: int) -> dict:
    full_sd35 = _benchmark_model(layers)
    spec = full_sd35._component_spec("transformer", 512, real=False)
    onnx_dir = WORK / f"onnx-{layers}"
    if contender == "kasoku-export_model":  # the blob through export_model: no model cache while compiling
        import kasoku.backends.openvino as openvino_backend

        openvino_backend._take_cached_blob = lambda blob_dir, path: False
    start = time.perf_counter()
    with AnonymousPeak() as anonymous:
        if contender == "openvino":
            import openvino as ov

            core = ov.Core()
            model = core.read_model(str(onnx_dir / spec.name / "model.onnx"))
            model.reshape({n: ov.PartialShape(list(s[0])) for n, s in spec.profile_shapes().items()})
            core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 2})
        else:
            from kasoku.pipeline.compiling import compile_components

            cache = WORK / f"cache-{contender}"
            shutil.rmtree(cache, ignore_errors=True)
            compile_components(full_sd35.sd35_pipeline(), backend="openvino", precision="fp32",
                               specs={spec.name: spec}, cache=cache, onnx_dir=onnx_dir, check_parity=False,
                               threads=2, label="build-memory")
            shutil.rmtree(cache, ignore_errors=True)
    seconds = time.perf_counter() - start
    return {"contender": contender, "seconds": round(seconds, 1), "peak_anonymous_gb": anonymous.peak_kb / 2**20,
            "peak_rss_gb": full_sd35._peak_mb() / 1024}


def _run_stage(*args: str) -> dict:
    result = subprocess.run([sys.executable, __file__, "--stage", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"stage {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="transformer layers at SD3.5-medium's width (24 in all)")
    parser.add_argument("--stage", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage:
        name, *rest = args.stage
        print(json.dumps(stage_export(args.layers) if name == "export" else stage_build(name, args.layers)))
        return
    from kasoku.backends.base import cpu_flags, cpu_name

    print(f"CPU: {cpu_name()} ({', '.join(cpu_flags()) or 'no AVX-512/AMX'}); {args.layers}-layer SD3.5-medium-width "
          "transformer, 512x512 with guidance, fp32")
    exported = _run_stage("export", "--layers", str(args.layers))
    print(f"ONNX file: {exported['onnx_bytes'] / 2**30:.2f} GiB")
    print(f"{'contender':22s} {'peak anonymous GiB':>18s} {'peak RSS GiB':>13s} {'seconds':>8s}")
    for contender in CONTENDERS:
        row = _run_stage(contender, "--layers", str(args.layers))
        print(f"{contender:22s} {row['peak_anonymous_gb']:18.2f} {row['peak_rss_gb']:13.2f} {row['seconds']:8.1f}")


if __name__ == "__main__":
    main()
