"""`kasoku bench`: side-by-side timings that follow docs/BENCHMARKS.md.

In one process run: the machine's fp32 matmul rate (median of 5 torch 4096^3 matmuls), then per
component torch eager (the pipeline's module as a user calls it: inference mode, diffusers' own attention; the
export-only attention swap is not in the timed call) and every requested contender on the same inputs, warm-up first,
then
min / median / max of the repeats, max|Δ| against torch beside each time, the FLOP floor
(FLOPs ÷ matmul rate) and time ÷ floor, cold compile and warm load times, memory; then the
whole pipeline (seconds per image, steps per second) against diffusers' torch pipeline.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..backends import BACKEND_CHOICES
from ..backends.base import cpu_flags, cpu_name
from ..build.compiler import ONNX_FILE, Compiler
from ..build.export import module_weights
from ..core.attention import exportable_attention
from ..core.cache import Cache
from ..core.components import ComponentSpec, ImageShape, ShapeProfile
from ..core.errors import KasokuError
from ..core.extras import import_onnxruntime
from ..core.memory import process_memory
from ..core.options import CompileOptions
from ..core.weights import materialize
from ..model.pipeline_model import Model
from ..pipeline.compiling import compile_components
from ..pipeline.kasoku_pipeline import KasokuPipeline
from ..policies.fidelity import diffusers_inputs, seeded_call, task_inputs

# Peers that are not kasoku backends: the runtime's own defaults on kasoku's exported ONNX file.
PEERS = ("torch.compile", "onnxruntime-defaults", "openvino-defaults")
MATMUL_SIZE = 4096


def check_contenders(names: list[str]) -> list[str]:
    """kasoku backends and peers by name; an unknown one is an error listing the choices."""
    known = [b for b in BACKEND_CHOICES if b != "auto"] + list(PEERS)
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise KasokuError(f"unknown contender(s) {', '.join(unknown) or '(none given)'}; choose from "
                          f"{', '.join(known)}.")
    return names


@dataclass
class Stats:
    min: float
    median: float
    max: float

    @classmethod
    def of(cls, samples: list[float]) -> Stats:
        return cls(min(samples), statistics.median(samples), max(samples))


@dataclass
class ContenderResult:
    seconds: Stats
    max_abs_vs_torch: float | None
    speedup_vs_torch: float | None = None
    time_over_floor: float | None = None
    cold_compile_s: float | None = None
    warm_load_s: float | None = None
    first_call_s: float | None = None  # the untimed warm-up call: torch.compile compiles here
    rss_mb: float | None = None


@dataclass
class ComponentBench:
    component: str
    shape: str
    gflop: float
    floor_s: float
    results: dict[str, ContenderResult] = field(default_factory=dict)


@dataclass
class EndToEndBench:
    shape: str
    steps: int
    guidance: float
    results: dict[str, dict] = field(default_factory=dict)  # contender -> seconds/image stats, steps/s


@dataclass
class BenchReport:
    model: str
    date: str
    machine: dict
    threads: int
    repeats: int
    matmul_gflops: float
    kasoku_backends: list[str] = field(default_factory=list)
    components: list[ComponentBench] = field(default_factory=list)
    end_to_end: EndToEndBench | None = None
    peak_rss_mb: float = 0.0
    family: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


# ---- measurement helpers -------------------------------------------------------------------

SPREAD = 1.5  # max ÷ min of the timed calls above which a timing is said to be unsteady


def spread_warnings(ranges: dict[str, tuple[float, float]]) -> list[str]:
    """One line per timing whose calls spread wider than SPREAD x (another process shared the CPU, most often)."""
    return [f"{name}'s calls took {low:.3g}–{high:.3g} s ({high / low:.1f}x apart): the machine was busy, so its "
            "ratios are unsteady; time again on a quiet machine." for name, (low, high) in ranges.items()
            if low > 0 and high / low > SPREAD]



def rss_mb(field_name: str = "VmRSS") -> float:
    """Resident memory of this process (VmRSS now, VmHWM: its peak), in MB."""
    value = process_memory(field_name)
    return float("nan") if value is None else value / 2**20


def repeat(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of `repeats` calls after `warmup` calls (first calls allocate and compile)."""
    return timed_runs(fn, repeats, warmup)[1]


def timed_runs(fn: Callable[[], object], repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
    """(seconds of the warm-up calls, seconds of each of the `repeats` calls after them)."""
    start = time.perf_counter()
    for _ in range(warmup):
        fn()
    first = time.perf_counter() - start
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return first, samples


def matmul_gflops(size: int = MATMUL_SIZE, repeats: int = 5) -> float:
    """This machine's fp32 matmul rate: median of `repeats` torch size^3 matmuls."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    samples = repeat(lambda: a @ b, repeats)
    return 2 * size**3 / statistics.median(samples) / 1e9


def count_flops(spec: ComponentSpec, inputs: dict[str, torch.Tensor]) -> float:
    """FLOPs of one call, counted by torch's FlopCounterMode. It runs the call for real, so it
    doubles as the torch warm-up (a meta-device run would need a second copy of the weights)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        spec.run_torch(inputs)
    return float(counter.get_total_flops())


def count_flops_meta(module: torch.nn.Module, inputs: dict[str, torch.Tensor], names: tuple[str, ...]) -> float:
    """FLOPs of one call of `module` (built on the meta device: no weights, nothing computed) on
    `inputs` (moved to the meta device) in the order of `names`."""
    from torch.utils.flop_counter import FlopCounterMode

    args = [inputs[name].to("meta") for name in names]
    with FlopCounterMode(display=False) as counter, torch.no_grad(), exportable_attention():
        module(*args)
    return float(counter.get_total_flops())


def _as_a_user_runs_it(spec: ComponentSpec, inputs: dict) -> Callable[[], Any]:
    """torch eager as a user runs the component: its module in inference mode, with diffusers' own attention (the
    export-only attention swap of `run_torch`, the parity reference, costs more than a tiny module's call), the inputs
    made tensors once, outside the timed call."""
    args = [torch.as_tensor(np.asarray(inputs[name])) for name in spec.input_names]

    def run():
        with torch.inference_mode():
            return spec.module(*args)

    try:
        run()
    except Exception:  # noqa: BLE001 - attention a CPU cannot run (xFormers' processors): the exportable one
        def run():
            with torch.inference_mode(), exportable_attention():
                return spec.module(*args)
    return run


def _max_abs(reference: dict[str, np.ndarray], actual: dict[str, np.ndarray]) -> float:
    return max(float(np.abs(np.asarray(actual[k], np.float64) - reference[k]).max()) for k in reference)


# ---- peers ---------------------------------------------------------------------------------


def _peer_runner(peer: str, spec: ComponentSpec, onnx_path: Path | None, threads: int):
    """(run(inputs) -> outputs dict, load seconds) for a non-kasoku contender."""
    start = time.perf_counter()
    if peer == "torch.compile":
        compiled = torch.compile(spec.module)

        def run(inputs):
            with torch.no_grad():
                out = compiled(*(torch.as_tensor(inputs[n]) for n in spec.input_names))
            return {n: o.numpy() for n, o in zip(spec.output_names, out)}
    elif peer == "onnxruntime-defaults":
        ort = import_onnxruntime()

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])

        def run(inputs):
            feeds = {k: np.asarray(v) for k, v in inputs.items()}
            return dict(zip(spec.output_names, session.run(list(spec.output_names), feeds)))
    elif peer == "openvino-defaults":
        import openvino as ov

        compiled = ov.Core().compile_model(str(onnx_path), "CPU", {"INFERENCE_NUM_THREADS": threads})
        request = compiled.create_infer_request()

        def run(inputs):
            request.infer({k: np.asarray(v) for k, v in inputs.items()})
            return {n: request.get_tensor(n).data.copy() for n in spec.output_names}
    else:
        raise ValueError(f"unknown peer {peer!r}; peers are {PEERS}")
    return run, time.perf_counter() - start


# ---- the benchmark -------------------------------------------------------------------------


def bench(
    model,
    backends: list[str] = ("onnxruntime", "openvino"),
    *,
    controlnet=None,
    steps: int = 4,
    repeats: int = 3,
    guidance: float = 7.5,
    shape: ImageShape | None = None,
    profile: ShapeProfile | None = None,
    components: list[str] | None = None,
    cache_dir: str | Path | None = None,
    threads: int | None = None,
    end_to_end: bool = True,
    log: Callable[[str], None] = lambda message: None,
    ip_adapter=None,
) -> BenchReport:
    """Time torch eager and each contender side by side; see the module docstring. `controlnet`
    (ControlNet folders or models) times the ControlNet pipeline: its ControlNet and U-Net engines;
    `ip_adapter` (IP-Adapter weights files) its image encoder and the U-Net with image prompts."""
    if repeats < 3:
        raise KasokuError(f"--repeats must be at least 3 (a median of repeats) but is {repeats}.")
    check_contenders(list(backends))
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    pipe = Model.load(model, controlnet=controlnet)
    if ip_adapter:
        from ..runtime.image_prompts import load_files

        load_files(pipe, ip_adapter)
    label = pipe.label
    specs = pipe.specs(profile, components)
    profile = next(iter(specs.values())).profile
    shape = shape or ImageShape(1, profile.opt.height, profile.opt.width)
    profile.check(shape)
    kasoku_backends = [b for b in backends if b not in PEERS]
    peers = [b for b in backends if b in PEERS]
    tmp_cache = None
    if cache_dir is None:  # an empty cache, so that the compile times are cold ones
        tmp_cache = tempfile.TemporaryDirectory(prefix="kasoku-bench-cache-")
        cache_dir = tmp_cache.name
    cache = Cache(cache_dir)
    log("measuring the fp32 matmul rate")
    rate = matmul_gflops()
    report = BenchReport(model=label, date=datetime.date.today().isoformat(),
                         machine={"cpu": cpu_name(), "flags": cpu_flags(), "python": platform.python_version(),
                                  "torch": torch.__version__},
                         threads=threads, repeats=repeats, matmul_gflops=rate, kasoku_backends=kasoku_backends,
                         family=pipe.family.title)
    options = CompileOptions(threads=threads)  # the peers run the exported graph with the weights bound
    compile_seconds: dict[str, dict[str, float]] = {}
    for backend in kasoku_backends:
        log(f"compiling with {backend} (cold)")
        _, compiled = compile_components(pipe, options.replace(backend=backend), specs=specs, cache=cache,
                                         label=label)
        compile_seconds[backend] = {}
        for record in compiled.stages:
            if record.status != "reused":
                compile_seconds[backend][record.component] = (
                    compile_seconds[backend].get(record.component, 0.0) + record.seconds)
    for name, spec in specs.items():
        inputs = spec.sample_inputs(shape, seed=3)
        log(f"{name}: counting FLOPs (torch warm-up)")
        flops = count_flops(spec, inputs)
        floor = flops / (rate * 1e9)
        entry = ComponentBench(name, str({k: tuple(v.shape) for k, v in inputs.items()}), flops / 1e9, floor)
        log(f"{name}: torch eager")
        reference = spec.run_torch(inputs)
        torch_samples = repeat(_as_a_user_runs_it(spec, inputs), repeats, warmup=1)
        entry.results["torch"] = ContenderResult(Stats.of(torch_samples), 0.0, 1.0,
                                                 statistics.median(torch_samples) / floor, rss_mb=rss_mb())
        base = statistics.median(torch_samples)
        for backend in kasoku_backends:
            log(f"{name}: {backend}")
            start = time.perf_counter()
            warm, _ = compile_components(pipe, options.replace(backend=backend), specs={name: spec}, cache=cache,
                                         label=label)
            warm_load = time.perf_counter() - start
            engine = warm[name]
            first, samples = timed_runs(lambda: engine.run(inputs), repeats)  # noqa: B023
            median = statistics.median(samples)
            entry.results[backend] = ContenderResult(
                Stats.of(samples), _max_abs(reference, engine.run(inputs)), base / median, median / floor,
                cold_compile_s=compile_seconds[backend].get(name), warm_load_s=warm_load, first_call_s=first,
                rss_mb=rss_mb())
        for peer in peers:
            log(f"{name}: {peer}")
            with tempfile.TemporaryDirectory(prefix="kasoku-bench-onnx-") as folder:
                onnx_path = _exported_onnx(cache, options, spec, Path(folder))
                run, load = _peer_runner(peer, spec, onnx_path, threads)
                first, samples = timed_runs(lambda: run(inputs), repeats)  # noqa: B023
                median = statistics.median(samples)
                entry.results[peer] = ContenderResult(Stats.of(samples), _max_abs(reference, run(inputs)),
                                                      base / median, median / floor, warm_load_s=load,
                                                      first_call_s=first, rss_mb=rss_mb())
        report.components.append(entry)
    if end_to_end and kasoku_backends:
        report.end_to_end = _bench_end_to_end(pipe, report, specs, cache, profile, shape, steps, guidance, repeats,
                                              options, label, log)
    report.peak_rss_mb = rss_mb("VmHWM")
    if tmp_cache is not None:
        tmp_cache.cleanup()
    return report


def _exported_onnx(cache, options: CompileOptions, spec: ComponentSpec, folder: Path) -> Path | None:
    """The component's exported graph from the cache (the one its engines were built from) with its weights
    bound, as a self-contained ONNX file in `folder` (what the peers run)."""
    import onnx

    compiler = Compiler(cache, options)
    entry = cache.lookup(compiler.export_parts(spec)) if compiler.binds_weights() else None
    if entry is None:
        return None
    graph = entry.file(ONNX_FILE)
    return materialize(graph, module_weights(spec, onnx.load(str(graph))), folder / ONNX_FILE)


def _bench_end_to_end(pipe, report, specs, cache, profile, shape, steps, guidance, repeats, options, label, log):
    """diffusers' torch pipeline against kasoku with, per component, the backend that was fastest
    in this run (what `auto` does on a CPU), and every backend alone when there are several."""
    result = EndToEndBench(shape=str(shape), steps=steps, guidance=guidance)
    prompt = "a beautiful photograph of mt fuji during cherry blossom"
    extra = task_inputs(pipe, "txt2img", shape)  # control images where the pipeline has ControlNets

    def runner(p, outputs: list):
        # diffusers' pipeline also gets what kasoku's engines fix (T5's tokens)
        inputs = extra if isinstance(p, KasokuPipeline) else {**diffusers_inputs(pipe, "txt2img", extra),
                                                              **fast.fixed_arguments}

        def run():
            outputs[:] = [seeded_call(p, prompt, 0, num_inference_steps=steps, guidance_scale=guidance,
                                      height=shape.height, width=shape.width, num_images_per_prompt=shape.batch,
                                      output_type="np", **inputs).images]
        return run

    torch_pipe = pipe.task_pipeline("txt2img")
    fastest = {c.component: min((n for n in c.results if n in report.kasoku_backends),
                                key=lambda n, c=c: c.results[n].seconds.median) for c in report.components}
    needed = pipe.task_components("txt2img")
    engines = {}
    for name in needed:
        backend = fastest.get(name, report.kasoku_backends[0])
        spec = specs[name] if name in specs else pipe.specs(profile, [name])[name]
        loaded, _ = compile_components(pipe, options.replace(backend=backend), specs={name: spec}, cache=cache,
                                       label=label)
        engines[name] = loaded[name]
    choice = ", ".join(f"{n}={e.backend}" for n, e in engines.items())
    fast = KasokuPipeline(pipe, engines, profile)
    contenders = {"diffusers (torch eager)": torch_pipe, f"kasoku ({choice})": fast}
    base, reference = None, None
    for name, contender in contenders.items():
        log(f"end to end: {name}")
        outputs: list = []
        samples = repeat(runner(contender, outputs), repeats)
        median = statistics.median(samples)
        base = base or median
        reference = outputs[0] if reference is None else reference
        result.results[name] = {
            "seconds_per_image": asdict(Stats.of([s / shape.batch for s in samples])),
            "steps_per_s": steps / median,
            "speedup_vs_diffusers": base / median,
            "max_abs_vs_diffusers": float(np.abs(outputs[0] - reference).max()),
        }
    return result


# ---- reporting -----------------------------------------------------------------------------


def markdown(report: BenchReport) -> str:
    lines = [
        f"# kasoku bench: {report.model}" + (f" ({report.family})" if report.family else ""),
        "",
        f"{report.date} · {report.machine['cpu']} ({', '.join(report.machine.get('flags', [])) or 'no AVX-512/AMX'})"
        f" · {report.threads} threads · torch {report.machine['torch']} · "
        f"fp32 matmul {report.matmul_gflops:.0f} GFLOP/s · median of {report.repeats} after warm-up",
        "",
        "| component | contender | median s | min–max s | speed-up vs torch | FLOP floor s | time ÷ floor "
        "| max abs vs torch | cold compile s | warm load s | first call s | RSS MB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def fmt(value, spec=".2f"):
        return "-" if value is None else format(value, spec)

    for c in report.components:
        for name, r in c.results.items():
            lines.append(
                f"| {c.component} ({c.gflop:.4g} GFLOP) | {name} | {r.seconds.median:.4g} | "
                f"{r.seconds.min:.4g}–{r.seconds.max:.4g} | {fmt(r.speedup_vs_torch)}x | {c.floor_s:.3g} | "
                f"{fmt(r.time_over_floor)} | {fmt(r.max_abs_vs_torch, '.1e')} | {fmt(r.cold_compile_s, '.1f')} | "
                f"{fmt(r.warm_load_s, '.2f')} | {fmt(r.first_call_s, '.2f')} | {fmt(r.rss_mb, '.0f')} |"
            )
    if report.end_to_end:
        e = report.end_to_end
        lines += ["", f"End to end: {e.shape}, {e.steps} steps, guidance {e.guidance}", "",
                  "| pipeline | s / image (median) | min–max | steps/s | speed-up | max abs vs diffusers |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for name, r in e.results.items():
            s = r["seconds_per_image"]
            lines.append(f"| {name} | {s['median']:.4g} | {s['min']:.4g}–{s['max']:.4g} | {r['steps_per_s']:.3g} | "
                         f"{r['speedup_vs_diffusers']:.2f}x | {r['max_abs_vs_diffusers']:.1e} |")
    lines += ["", f"Peak resident memory of the run: {report.peak_rss_mb:.0f} MB", "", COLUMNS]
    ranges = {f"{c.component} on {name}": (r.seconds.min, r.seconds.max)
              for c in report.components for name, r in c.results.items()}
    if report.end_to_end:
        ranges.update({f"the {name} pipeline": (r["seconds_per_image"]["min"], r["seconds_per_image"]["max"])
                       for name, r in report.end_to_end.results.items()})
    lines += [f"\n**Note:** {line}" for line in spread_warnings(ranges)]
    return "\n".join(lines)


COLUMNS = ("Columns: *median s* is the middle of the timed calls after a warm-up call, *min–max s* their range; "
           "*speed-up* is torch's median ÷ this one's; the *FLOP floor* is the component's FLOPs ÷ this machine's "
           "fp32 matmul rate (no run at fp32 can beat it by much), *time ÷ floor* how far above it a run is; *max abs "
           "vs torch* the largest difference of any output from torch's on the same inputs; *cold compile* the "
           "export and build from an empty cache, *warm load* loading the built engine from the cache, *first call* "
           "the untimed warm-up call; *RSS* the process's resident memory after the run.")


def plot(report: BenchReport, path: str | Path) -> Path:
    """A PNG bar chart: median seconds per component and contender, with the FLOP floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [*report.components, *([report.end_to_end] if report.end_to_end else [])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if isinstance(panel, ComponentBench):
            names = list(panel.results)
            values = [panel.results[n].seconds.median for n in names]
            ax.axhline(panel.floor_s, color="black", linestyle="--", label="FLOP floor")
            ax.set_title(panel.component)
        else:
            names = list(panel.results)
            values = [panel.results[n]["seconds_per_image"]["median"] for n in names]
            ax.set_title(f"end to end, {panel.steps} steps")
        ax.bar(range(len(names)), values, color="tab:blue")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("seconds (median)")
        if isinstance(panel, ComponentBench):
            ax.legend(fontsize=8)
    fig.suptitle(f"kasoku bench · {report.machine['cpu']} · {report.threads} threads")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
