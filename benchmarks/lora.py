"""Checkpoints and LoRA adapters without re-export: what a second checkpoint and an adapter switch cost.

    python benchmarks/lora.py [--backends onnxruntime,openvino] [--rank-a 4 --rank-b 64] [--repeats 3]

runs every measurement on the built-in tiny pipeline (the proof before the full size);
`python benchmarks/full_sd15.py --stages lora` runs the same function on the full-size SD 1.5
architecture (stage `lora`, one process per backend). Per backend, in one process run:

- the cold compile of the base (an empty cache) and the compile of a second checkpoint of the same
  architecture (other random weights): seconds, ratio, and which entries the second one built;
- the compile of engines whose attention projections are run-time weights (`lora_targets="attention"`);
- the time to switch between two LoRA adapters on the U-Net's attention projections (ranks `rank_a` and
  `rank_b`, random A and B), on those engines and on engines with constant weights (rebuilt in memory);
- the U-Net's speed, interleaved, median of repeats after a warm-up: the engine with bound weights
  (kasoku's) against one built from the same graph with the weights written into the file as constants
  (initializers the runtime may fold), and against the engine with run-time weights.

It writes benchmarks/results/<date>-<host>-lora.json and .md (the tiny run); nothing is asserted.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TXT2IMG = ("text_encoder", "unet", "vae_decoder")
ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")


def write_adapter(model: Path, folder: Path, rank: int, seed: int) -> Path:
    """A LoRA file on the U-Net's attention projections, random A and B (scale alpha / rank = 1), written with
    diffusers' own save_lora_weights; built from the U-Net's config on the meta device (no weights read)."""
    from accelerate import init_empty_weights
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    with init_empty_weights():
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(model / "unet"))
    generator = torch.Generator().manual_seed(seed)
    layers = {}
    for name, module in unet.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(ATTENTION):
            std = 1.0 / module.in_features ** 0.5
            layers[f"{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=generator) * std
            layers[f"{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=generator) * std
    metadata = {"r": rank, "lora_alpha": rank, "target_modules": list(ATTENTION)}
    StableDiffusionPipeline.save_lora_weights(folder, unet_lora_layers=layers, unet_lora_adapter_metadata=metadata)
    return folder


def in_own_process(function, *args):
    """`function(*args)` in a fresh process: at full size an engine build holds several copies of the
    3.4 GB of U-Net weights for a while, and what a runtime frees stays in the process's heap."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def _process_settings(threads: int | None) -> None:
    """What a fresh process needs to measure as the stage does: the thread count, the runtimes' logs quiet."""
    from kasoku.core.console import quiet_third_party_logs

    quiet_third_party_logs()
    if threads:
        torch.set_num_threads(threads)


def _unet_spec(model: Path, threads: int | None):
    from kasoku.model.loading import load_pipeline
    from kasoku.model.pipeline_model import component_specs

    _process_settings(threads)
    pipe = load_pipeline(model, lazy=True)  # the U-Net's weights load only where needed
    return pipe, component_specs(pipe, None, ["unet"])["unet"]


def build_constants_engine(model: Path, backend: str, cache: Path, threads: int | None, folder: Path) -> float:
    """An engine in `folder` built from the graph kasoku's U-Net engine is built from (the optimized graph
    where the backend runs passes, else the architecture graph; built again if the compile dropped it) with
    the weights written into the file as initializers: kasoku's engine, except that its weights are
    constants the runtime may fold. Returns the seconds of the file and the build."""
    import contextlib

    from kasoku.build.compiler import ONNX_FILE, Compiler
    from kasoku.build.export import materialize
    from kasoku.core.cache import Cache
    from kasoku.core.components import Precision
    from kasoku.core.options import CompileOptions

    _, spec = _unet_spec(model, threads)
    start = time.perf_counter()
    compiler = Compiler(Cache(cache), CompileOptions(backend=backend, threads=threads), label="base")
    runtime = compiler.backend(backend)
    with contextlib.ExitStack() as held:
        graph = compiler.sources(spec, runtime, compiler.chain(spec, runtime), held)[-1].file(ONNX_FILE)
        if backend == "onnxruntime":
            # ONNX Runtime's engine is the ONNX file: a session optimizes it at load (its constants folded
            # there). Its build, which saves the optimized model, takes over 20 GB with 3.4 GB of constants.
            from kasoku.backends.onnxruntime import MODEL_FILE

            materialize(spec, graph, folder / MODEL_FILE)
            return time.perf_counter() - start
        path = materialize(spec, graph, folder / "constants.onnx")
    runtime.build(spec, path, folder, Precision.FP32)  # the file holds its weights: no binding
    return time.perf_counter() - start


def compare_speeds(model: Path, backend: str, cache: Path, threads: int | None, folder: Path, repeats: int) -> dict:
    """The U-Net engine with bound weights (kasoku's) against the constants engine in `folder`, then against
    the engine whose attention projections are run-time weights: interleaved, at the profile's optimum."""
    from kasoku.backends import get_backend
    from kasoku.core.components import Precision
    from kasoku.core.options import CompileOptions
    from kasoku.pipeline.compiling import compile_components

    pipe, spec = _unet_spec(model, threads)
    inputs = spec.sample_inputs(spec.profile.opt, seed=3)
    constants = get_backend(backend, CompileOptions(threads=threads)).load(spec, folder, Precision.FP32)
    bound = compile_components(pipe, backend=backend, specs={"unet": spec}, cache=cache, threads=threads)[0]["unet"]
    against_constants = interleaved({"bound": bound, "constants": constants}, inputs, repeats)
    difference = (bound.run(inputs)["out_sample"] - constants.run(inputs)["out_sample"]).abs().max().item()
    del constants
    gc.collect()
    run_time = compile_components(pipe, backend=backend, specs={"unet": spec}, cache=cache, threads=threads,
                                  lora_targets="attention")[0]["unet"]
    against_run_time = interleaved({"bound": bound, "run-time": run_time}, inputs, repeats)
    medians = [{n: statistics.median(v) for n, v in pair.items()} for pair in (against_constants, against_run_time)]
    return {"shape": str(spec.profile.opt), "bound_and_constants": against_constants,
            "bound_and_run_time": against_run_time, "medians": medians,
            "bound_vs_constants": medians[0]["bound"] / medians[0]["constants"] - 1,
            "run_time_vs_bound": medians[1]["run-time"] / medians[1]["bound"] - 1,
            "max_abs_bound_vs_constants": difference, "run_time_weights": len(run_time.bound)}


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def interleaved(engines: dict, inputs: dict, repeats: int) -> dict[str, list[float]]:
    """Each engine once as a warm-up, then `repeats` rounds with every engine once per round."""
    for engine in engines.values():
        engine.run(inputs)
    samples: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            samples[name].append(_timed(lambda engine=engine: engine.run(inputs))[0])
    return samples


def timed_compile(model: Path, label: str, options: dict) -> tuple[float, list[str]]:
    """`compile_components` of `model`: its seconds and the entries it built."""
    from kasoku.pipeline.compiling import compile_components

    _process_settings(options.get("threads"))
    seconds, (_, report) = _timed(lambda: compile_components(model, label=label, **options))
    return seconds, sorted({f"{s.component}:{s.stage}" for s in report.stages if s.status != "reused"})


def switch_times(model: Path, backend: str, cache: Path, threads: int | None, targets: str, adapters: dict,
                 repeats: int) -> dict:
    """Compile (engines with `targets` as run-time weights), load two adapters, switch between them."""
    import kasoku
    from kasoku.model.loading import load_pipeline

    _process_settings(threads)

    seconds, fast = _timed(lambda: kasoku.compile(load_pipeline(model, lazy=True), backend, components=TXT2IMG,
                                                  cache_dir=cache, threads=threads, lora_targets=targets))
    entry = {"compile_s": seconds}
    entry["load_a_s"], _ = _timed(lambda: fast.load_lora_weights(str(adapters["a"]), adapter_name="a"))
    entry["load_b_s"], _ = _timed(lambda: fast.load_lora_weights(str(adapters["b"]), adapter_name="b"))
    rounds = repeats if targets else 1  # constant weights rebuild per switch: a minute at full size
    entry["switch_s"] = [_timed(lambda n=n: fast.set_adapters(n))[0] for _ in range(rounds) for n in ("a", "b")]
    entry["unload_s"], _ = _timed(fast.unload_lora_weights)
    return entry


def measure(model: Path, second: Path, backend: str, work: Path, *, threads: int | None, repeats: int,
            rank_a: int, rank_b: int, log=print) -> dict:
    """Every measurement of the module docstring for one backend, each phase in a process of its own;
    `work` is emptied first."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cache = work / "cache"
    common = dict(backend=backend, components=TXT2IMG, cache=cache, threads=threads)
    result: dict = {"backend": backend, "threads": threads, "ranks": [rank_a, rank_b]}

    log(f"{backend}: cold compile of the base")
    result["cold_s"] = in_own_process(timed_compile, model, "base", common)[0]
    log(f"{backend}: compile of a second checkpoint")
    result["second_s"], result["second_built"] = in_own_process(timed_compile, second, "second", common)
    result["second_vs_cold"] = result["second_s"] / result["cold_s"]

    adapters = {"a": write_adapter(model, work / "lora-a", rank_a, 1), "b": write_adapter(model, work / "lora-b",
                                                                                        rank_b, 2)}
    switches = {}
    for way, targets in (("run-time weights", "attention"), ("constant weights", "")):
        log(f"{backend}: LoRA switches, {way}")
        switches[way] = in_own_process(switch_times, model, backend, cache, threads, targets, adapters, repeats)
    result["switch"] = switches

    log(f"{backend}: U-Net speed, bound against constant weights and against run-time weights")
    with tempfile.TemporaryDirectory(dir=work) as folder:
        result["constants_build_s"] = in_own_process(build_constants_engine, model, backend, cache, threads,
                                                     Path(folder))
        result["speed"] = in_own_process(compare_speeds, model, backend, cache, threads, Path(folder), repeats)
    shutil.rmtree(work, ignore_errors=True)
    return result


def markdown(results: dict[str, dict], title: str) -> str:
    lines = [f"# {title}", "",
             "| backend | cold compile s | second checkpoint s (ratio; built) | switch s, run-time weights (median; "
             "load a, load b) | switch s, constant weights | U-Net s: bound / constants / run-time | bound vs "
             "constants | run-time vs bound |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for backend, r in results.items():
        if r.get("failed"):
            lines.append(f"| {backend} | failed (exit {r.get('returncode')}) | | | | | | |")
            continue
        fast, slow = r["switch"]["run-time weights"], r["switch"]["constant weights"]
        (c, t) = r["speed"]["medians"]
        lines.append(
            f"| {backend} | {r['cold_s']:.1f} | {r['second_s']:.1f} ({r['second_vs_cold']:.0%}; "
            f"{', '.join(r['second_built'])}) | {statistics.median(fast['switch_s']):.3f} ({fast['load_a_s']:.2f}, "
            f"{fast['load_b_s']:.2f}) | {statistics.median(slow['switch_s']):.2f} | {c['bound']:.4f} / "
            f"{c['constants']:.4f} / {t['run-time']:.4f} (bound {t['bound']:.4f}) | "
            f"{r['speed']['bound_vs_constants']:+.1%} | "
            f"{r['speed']['run_time_vs_bound']:+.1%} |")
    ranks = next((r["ranks"] for r in results.values() if "ranks" in r), [])
    lines += ["", f"Adapters: ranks {ranks} on the U-Net's attention projections (to_q, to_k, to_v, to_out.0). "
              "Switch: `set_adapters` between the two; run-time weights: engines compiled with "
              "`lora_targets='attention'`; constant weights: engines rebuilt in memory from the architecture "
              "graph. Speed: U-Net at the profile's optimum, median of interleaved repeats after a warm-up."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="onnxruntime,openvino")
    parser.add_argument("--rank-a", type=int, default=4)
    parser.add_argument("--rank-b", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)

    from kasoku.core.console import console, quiet_third_party_logs
    from kasoku.tools.tiny import write_tiny_pipeline

    quiet_third_party_logs()
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="kasoku-lora-bench-"))
    model, second = write_tiny_pipeline(root / "base", seed=0), write_tiny_pipeline(root / "second", seed=1)
    results = {}
    for backend in args.backends.split(","):
        # the tiny U-Net's projections are 32 and 64 wide: ranks above 8 would not be low-rank
        results[backend] = measure(model, second, backend, root / "work", threads=args.threads, repeats=args.repeats,
                                   rank_a=min(args.rank_a, 8), rank_b=min(args.rank_b, 8),
                                   log=lambda message: console.log(message, markup=False))
    shutil.rmtree(root, ignore_errors=True)
    from kasoku.backends.base import cpu_name

    date = datetime.date.today().isoformat()
    stem = RESULTS / f"{date}-{socket.gethostname()}-lora"
    RESULTS.mkdir(exist_ok=True)
    report = {"date": date, "cpu": cpu_name(), "threads": args.threads, "model": "tiny", "results": results}
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    text = markdown(results, f"kasoku LoRA and checkpoints, tiny SD 1.x pipeline ({date}, {cpu_name()}, "
                             f"{args.threads} threads)")
    text += "\n\nCommand: `python benchmarks/lora.py " + " ".join(argv if argv is not None else sys.argv[1:]) + "`"
    stem.with_suffix(".md").write_text(text + "\n")
    console.print(text, markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
