"""Native TensorRT, the seed's path: ONNX → network → engine plan through Polygraphy.

Build: `network_from_onnx_path` → `CreateConfig` (one optimization profile from the component's
min/opt/max shapes, timing cache, builder optimization level, and the precision as the installed
TensorRT wants it: see :func:`trt_precision_plan`) → `engine_bytes_from_network`; the plan is a
file of the cache entry, the timing cache is shared per TensorRT version and GPU.
Run: TensorRT's runtime with named I/O tensors bound to torch CUDA buffers on a CUDA stream,
optionally replayed as a CUDA graph (static profiles only).

Weights: the architecture graph and the checkpoint's weights are materialized into one ONNX file
for the parser (weights named as in the torch state dict, so TensorRT's weights carry those names).
Run-time weights (LoRA targets) are marked refittable (REFIT_INDIVIDUAL: only they are) and bound by
refitting them by name (`trt.Refitter.set_named_weights`), the base values kept beside the plan so
that unloading refits exactly the base weights back (never a subtraction, TensorRT issue 3628).

The parts that need no GPU (the precision plan, profile, builder options, availability) are plain
functions so that they are tested on any machine.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from ..core.choices import TRT_OPT_LEVELS
from ..core.components import ComponentSpec, Precision
from ..core.options import InvalidOptions
from ..core.weights import materialize
from .base import (
    Availability,
    Backend,
    BackendUnavailable,
    Engine,
    UnsupportedPrecision,
    gpu_identity,
    load_bound,
    save_bound,
)

PLAN_FILE = "engine.plan"
TIMING_CACHE_FILE = "timing.cache"
# TensorRT 11 removed the precision builder flags (BuilderFlag.FP16, .BF16; deprecated since 10.12):
# reduced precision comes from the types of a strongly typed network's graph.
FIRST_MAJOR_WITHOUT_PRECISION_FLAGS = 11
BF16_MIN_CAPABILITY = (8, 0)  # Ampere: the first GPUs with bf16 tensor cores
# The TensorRT Python packages, by name: the meta package, then the CUDA-specific ones it installs.
TRT_DISTRIBUTIONS = ("tensorrt", "tensorrt-cu13", "tensorrt-cu12", "tensorrt-cu13-libs", "tensorrt-cu12-libs")


@dataclass(frozen=True)
class TrtPrecisionPlan:
    """How one precision is asked of one TensorRT version.

    `builder_flag` ("FP16", "BF16"): a weakly typed network from the fp32 graph, where TensorRT may pick
    kernels of that type per layer (TensorRT 10). `strongly_typed`: the network runs in the types of its
    graph, which `graph_pass` (kasoku.build.optimize's "fp16" / "bf16", fp32 inputs and outputs kept) writes
    before the build (TensorRT 11, where the flags are gone)."""

    builder_flag: str | None
    strongly_typed: bool
    graph_pass: str | None


def trt_major(version: str) -> int:
    """The major version of a TensorRT version string ("10.13.3.9" -> 10)."""
    match = re.match(r"\s*(\d+)", version or "")
    if not match:
        raise ValueError(f"not a TensorRT version: {version!r}")
    return int(match.group(1))


def trt_precision_plan(precision: Precision | str, trt_version: str,
                       capability: tuple[int, int] | None) -> TrtPrecisionPlan:
    """What building `precision` takes on TensorRT `trt_version` and a GPU of compute `capability`.

    fp32: the fp32 graph as it is (TF32 stays off). fp16 and bf16: the builder flag where the version has
    it, else a strongly typed network built from the graph converted to that type. bf16 needs compute
    capability 8.0 or newer. Raises :class:`UnsupportedPrecision` for anything else."""
    precision = Precision(precision)
    if precision == Precision.FP32:
        return TrtPrecisionPlan(None, False, None)
    if precision not in (Precision.FP16, Precision.BF16):
        raise UnsupportedPrecision(f"the tensorrt backend cannot build {precision.value}: it builds fp32, fp16 and "
                                   "bf16. Choose another --precision or --backend.")
    if precision == Precision.BF16:
        check_bf16_capability(capability)
    if trt_major(trt_version) < FIRST_MAJOR_WITHOUT_PRECISION_FLAGS:
        return TrtPrecisionPlan(precision.value.upper(), False, None)
    return TrtPrecisionPlan(None, True, precision.value)


def check_bf16_capability(capability: tuple[int, int] | None) -> None:
    """Raise :class:`UnsupportedPrecision` unless a GPU of this compute capability has bf16 tensor cores."""
    if capability is not None and tuple(capability) >= BF16_MIN_CAPABILITY:
        return
    seen = "no GPU is visible" if capability is None else f"this GPU is sm_{capability[0]}{capability[1]}"
    raise UnsupportedPrecision(
        f"the tensorrt backend cannot build bf16 here: bf16 needs an NVIDIA GPU of compute capability "
        f"{BF16_MIN_CAPABILITY[0]}.{BF16_MIN_CAPABILITY[1]} (Ampere) or newer, and {seen}. "
        "Choose --precision fp16 or fp32."
    )


def installed_trt_version() -> str | None:
    """The installed TensorRT's version from package metadata (imports nothing), or None."""
    for name in TRT_DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


@dataclass(frozen=True)
class TrtBuildOptions:
    """What the builder is asked for; one place maps it onto Polygraphy's loaders."""

    fp16: bool  # the FP16 builder flag (TensorRT 10)
    bf16: bool  # the BF16 builder flag (TensorRT 10)
    strongly_typed: bool  # the network runs in its graph's types (TensorRT 11; reduced precision on 10.x too)
    tf32: bool
    profile: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]
    builder_optimization_level: int
    timing_cache: str | None
    refittable: tuple[str, ...] = ()  # weights marked refittable (REFIT_INDIVIDUAL): the run-time weights


def trt_profile(spec: ComponentSpec) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """min/opt/max shape of every input, straight from the component's spec."""
    return spec.profile_shapes()


def trt_build_options(
    spec: ComponentSpec, plan: TrtPrecisionPlan, optimization_level: int, timing_cache: Path | None,
    refittable: frozenset[str] = frozenset(),
) -> TrtBuildOptions:
    if not 0 <= optimization_level <= 5:
        raise ValueError(f"builder_optimization_level must be 0..5 but is {optimization_level}.")
    return TrtBuildOptions(
        fp16=plan.builder_flag == "FP16",
        bf16=plan.builder_flag == "BF16",
        strongly_typed=plan.strongly_typed,
        tf32=False,  # TF32 matmuls would break fp32 parity with torch
        profile=trt_profile(spec),
        builder_optimization_level=optimization_level,
        timing_cache=str(timing_cache) if timing_cache else None,
        refittable=tuple(sorted(refittable)),
    )


def mark_refittable(network, names: tuple[str, ...]) -> None:
    """Mark the named weights refittable (needs TensorRT 10's REFIT_INDIVIDUAL); a name the parsed network
    does not have is an error naming it."""
    missing = [name for name in names if not network.mark_weights_refittable(name)]
    if missing:
        raise RuntimeError(f"TensorRT's network has no weights named {', '.join(missing[:3])}; they cannot be "
                           "refitted by name.")


def polygraphy_config(options: TrtBuildOptions):
    """Polygraphy's CreateConfig for the options (needs the tensorrt extra). The precision flags are
    passed only when set, so a TensorRT without them (11) is never asked for one."""
    from polygraphy.backend.trt import CreateConfig, Profile

    profile = Profile()
    for name, (low, opt, high) in options.profile.items():
        profile.add(name, min=low, opt=opt, max=high)
    flags = {name: True for name in ("fp16", "bf16") if getattr(options, name)}
    return CreateConfig(
        tf32=options.tf32,
        profiles=[profile],
        load_timing_cache=options.timing_cache,
        builder_optimization_level=options.builder_optimization_level,
        **flags,
    )


def polygraphy_network(onnx_path: Path, options: TrtBuildOptions):
    """Polygraphy's ONNX parser loader; strongly typed where the options say so. TensorRT 11 makes every
    network strongly typed (its creation flag, if present, changes nothing there)."""
    import tensorrt as trt
    from polygraphy.backend.trt import network_from_onnx_path

    flag_exists = hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED")
    return network_from_onnx_path(str(onnx_path), strongly_typed=options.strongly_typed and flag_exists)


def _gpu_description() -> tuple[str | None, str | None]:
    """(GPU 0's identity: name, compute capability, driver; the reason when there is none)."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, "no CUDA GPU is visible to torch"
    return str(gpu_identity(0)), None


class TensorRTEngine(Engine):
    """A TensorRT plan run on torch CUDA tensors: inputs are bound where they lie, outputs are
    new torch tensors, and the work is enqueued on the caller's current CUDA stream (no copy to
    the host, no synchronisation). With `cuda_graph`, the first call at a shape is captured and
    later calls at that shape replay it from static buffers."""

    backend = "tensorrt"

    def __init__(self, spec: ComponentSpec, precision: Precision, plan: bytes, cuda_graph: bool = False):
        super().__init__(spec, precision, device="cuda")
        import tensorrt as trt
        import torch

        self._torch = torch
        self._trt = trt
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise RuntimeError(f"TensorRT could not deserialize the {spec.name} plan (built by another version?)")
        self.context = self.engine.create_execution_context()
        self.cuda_graph = cuda_graph
        self._graph = None
        self._graph_shapes = None
        self._static: dict[str, Any] = {}  # the captured graph's buffers

    def _bound_device(self):
        import torch

        return torch.device("cpu")  # refitted from host memory, never read as inputs

    def _on_bind(self, initial: bool) -> None:
        """Refit the run-time weights by name (the plan was built with the initial values)."""
        if initial:
            return
        refitter = self._trt.Refitter(self.engine, self.logger)
        for name, tensor in self._bound.items():  # bfloat16 has no numpy type: its host memory, by pointer
            weights = (self._trt.Weights(self._trt.bfloat16, tensor.data_ptr(), tensor.numel())
                       if tensor.dtype == self._torch.bfloat16 else self._trt.Weights(tensor.numpy()))
            refitter.set_named_weights(name, weights)
        if not refitter.refit_cuda_engine():
            raise RuntimeError(f"TensorRT could not refit the {self.spec.name} engine.")
        self._graph = None  # a captured CUDA graph holds the old weights' kernels' arguments

    def _torch_dtype(self, name: str):
        return {
            self._trt.float32: self._torch.float32,
            self._trt.float16: self._torch.float16,
            self._trt.bfloat16: self._torch.bfloat16,
            self._trt.int32: self._torch.int32,
            self._trt.int64: self._torch.int64,
        }[self.engine.get_tensor_dtype(name)]

    def _bind(self, feeds: dict) -> dict:
        """Bind the inputs where they lie and new output tensors; returns the outputs."""
        for name, tensor in feeds.items():
            wanted = self._torch_dtype(name)
            if tensor.dtype != wanted:
                feeds[name] = tensor = tensor.to(wanted)
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        outputs = {}
        for name in self.spec.output_names:
            shape = tuple(self.context.get_tensor_shape(name))
            outputs[name] = self._torch.empty(shape, dtype=self._torch_dtype(name), device=self.device)
            self.context.set_tensor_address(name, outputs[name].data_ptr())
        return outputs

    def _execute(self, stream) -> None:
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError(f"TensorRT failed to run {self.spec.name}")

    def _run(self, feeds: dict) -> dict:
        stream = self._torch.cuda.current_stream(self.device)
        if not self.cuda_graph:
            outputs = self._bind(feeds)
            self._execute(stream)
            return outputs
        shapes = {name: tuple(t.shape) for name, t in feeds.items()}
        if self._graph is None or shapes != self._graph_shapes:
            self._capture(feeds, shapes, stream)
        for name, tensor in feeds.items():
            self._static[name].copy_(tensor, non_blocking=True)
        self._graph.replay()
        return {name: self._static[name].clone() for name in self.spec.output_names}

    def _capture(self, feeds: dict, shapes: dict, stream) -> None:
        torch = self._torch
        self._static = {name: tensor.clone() for name, tensor in feeds.items()}
        self._static.update(self._bind(self._static))
        self._execute(stream)  # TensorRT needs one enqueue after a shape change before a capture
        graph = torch.cuda.CUDAGraph()
        capture_stream = torch.cuda.Stream(self.device)
        capture_stream.wait_stream(stream)
        with torch.cuda.graph(graph, stream=capture_stream):
            self._execute(capture_stream)
        stream.wait_stream(capture_stream)
        self._graph, self._graph_shapes = graph, shapes


class TensorRTBackend(Backend):
    name = "tensorrt"
    extra = "tensorrt"
    precisions = (Precision.FP32, Precision.FP16, Precision.BF16)
    refused = {Precision.INT8: "kasoku's int8 is NNCF's, on OpenVINO; use --backend openvino"}
    # the seed's flow: onnx-graphsurgeon cleans and folds the graph before TensorRT's parser sees it
    passes = ("cleanup", "fold_constants", "infer_shapes")

    @classmethod
    def availability(cls) -> Availability:
        if importlib.util.find_spec("tensorrt") is None:
            return Availability(cls.name, False, reason="the tensorrt package is not installed")
        if importlib.util.find_spec("polygraphy") is None:
            return Availability(cls.name, False, reason="the polygraphy package is not installed")
        import tensorrt as trt

        gpu, reason = _gpu_description()
        if gpu is None:
            return Availability(cls.name, False, trt.__version__, reason=reason)
        return Availability(cls.name, True, trt.__version__, gpu)

    reads = ("trt_opt_level", "cuda_graph")

    @property
    def runs_cuda_graphs(self) -> bool:
        return True

    def check_options(self) -> None:
        super().check_options()
        if self.options.trt_opt_level not in TRT_OPT_LEVELS:
            raise InvalidOptions(f"`trt_opt_level` (--trt-opt-level) must be a TensorRT builder optimization level, "
                                 f"0..5, but is {self.options.trt_opt_level!r}.")

    def option_key(self) -> dict[str, Any]:
        return {"builder_optimization_level": self.options.trt_opt_level}

    def check_precision(self, precision: Precision | str) -> None:
        super().check_precision(precision)
        if Precision(precision) == Precision.BF16:
            identity = gpu_identity(0)
            if identity is not None:  # without a GPU, require() says so
                check_bf16_capability(identity.capability)

    def precision_plan(self, precision: Precision) -> TrtPrecisionPlan:
        """The plan for `precision` on the installed TensorRT and GPU 0."""
        version = installed_trt_version() or self.availability().version
        if version is None and Precision(precision) != Precision.FP32:
            raise BackendUnavailable(f"the tensorrt backend is unavailable: the tensorrt package is not "
                                     f"installed.{self.install_hint()}")
        identity = gpu_identity(0)
        return trt_precision_plan(precision, version or "", identity.capability if identity else None)

    def optimization_passes(self, precision: Precision) -> list[str]:
        # TensorRT 10 picks reduced-precision kernels itself from the fp32 graph (builder flag); a strongly
        # typed network (TensorRT 11) runs in the types of its graph, so the graph is converted first.
        plan = self.precision_plan(precision)
        return list(self.passes) + ([plan.graph_pass] if plan.graph_pass else [])

    def timing_cache(self, out_dir: Path) -> Path:
        """One timing cache per TensorRT version and GPU (name, compute capability, driver), shared by
        every build on them."""
        if self.shared_dir is None:
            return out_dir / TIMING_CACHE_FILE
        info = self.availability()
        identity = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{info.version}-{info.devices}").strip("-")
        folder = self.shared_dir / identity
        folder.mkdir(parents=True, exist_ok=True)
        return folder / TIMING_CACHE_FILE


    def build(self, spec: ComponentSpec, onnx_path: Path, out_dir: Path, precision: Precision, *,
              calibration=None, weights=None, run_time: frozenset[str] = frozenset()) -> dict[str, Any]:
        self.require()
        self.check_engine_profile(spec)
        import shutil
        import tempfile

        plan = self.precision_plan(precision)
        timing_cache = self.timing_cache(out_dir)
        options = trt_build_options(spec, plan, self.options.trt_opt_level,
                                    timing_cache if timing_cache.exists() else None, run_time)
        with tempfile.TemporaryDirectory(prefix="kasoku-trt-", dir=out_dir.parent) as folder:
            source = onnx_path
            if weights is not None:  # the parser reads weights from the file: the graph with them bound
                source = materialize(onnx_path, weights, Path(folder) / "model.onnx")
            engine = self._plan(source, options, timing_cache)
            shutil.rmtree(folder, ignore_errors=True)
        (out_dir / PLAN_FILE).write_bytes(engine)
        if weights is not None:
            save_bound(out_dir, weights, run_time)
        return {"precision_plan": asdict(plan), "builder_optimization_level": options.builder_optimization_level,
                "profile": {k: [list(s) for s in v] for k, v in options.profile.items()},
                "refittable_weights": len(options.refittable)}

    def _plan(self, onnx_path: Path, options: TrtBuildOptions, timing_cache: Path) -> bytes:
        import tensorrt as trt
        from polygraphy.backend.trt import engine_bytes_from_network

        builder, network, parser = polygraphy_network(onnx_path, options)()
        config = polygraphy_config(options)(builder, network)
        if options.refittable:
            config.set_flag(trt.BuilderFlag.REFIT_INDIVIDUAL)
            mark_refittable(network, options.refittable)
        return engine_bytes_from_network((builder, network, parser), config=config,
                                         save_timing_cache=str(timing_cache))

    def load(self, spec: ComponentSpec, entry_dir: Path, precision: Precision) -> Engine:
        self.require()
        self.check_engine_profile(spec)
        plan = (entry_dir / PLAN_FILE).read_bytes()
        return load_bound(TensorRTEngine(spec, precision, plan, cuda_graph=self.options.cuda_graph), entry_dir)
