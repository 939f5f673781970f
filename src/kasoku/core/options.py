"""CompileOptions: everything that says which engines to build and how, in one frozen object.

`kasoku.compile`, `KasokuPipeline.from_pretrained`, `compile_components`, `verify`, `bench` and
`kasoku batch` all take one of these (or its fields as keywords), so an option is declared once,
checked once, and travels unchanged to a Ray worker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import KasokuError
from .precision import Precision
from .step_cache import DEFAULT_BRANCH

if TYPE_CHECKING:
    from .components import ShapeProfile

FASTEST = "fastest"  # a precision request: per component, the fastest precision whose measured drift fits min_psnr
RECIPES = (None, FASTEST)  # `recipe`: none, or the tuned winner (kasoku.policies.recipes)
DEFAULT_MIN_PSNR = 35.0  # dB against the fp32 engines: bf16's floor in the fidelity contract
DEFAULT_EXPORTER = "dynamo"
EXPORTERS = ("dynamo", "torchscript")
DEFAULT_OPSET = 18
# Named sets of LoRA targets (module names, matched as suffixes): the attention projections diffusers'
# training scripts adapt by default, in the U-Net (to_*) and the CLIP text encoders (*_proj).
LORA_TARGET_PRESETS = {"attention": ("to_q", "to_k", "to_v", "to_out.0", "q_proj", "k_proj", "v_proj", "out_proj")}


class InvalidOptions(KasokuError, ValueError):
    """Compile options that cannot work together."""


@dataclass(frozen=True)
class CompileOptions:
    """Which engines to build, and how.

    `backend` is a backend name (see ``kasoku info``), ``"auto"``, or a mapping component -> backend
    (what ``auto`` resolved to; ``kasoku batch`` hands it to its workers so that every worker runs
    exactly the driver's engines).
    """

    backend: str | Mapping[str, str] = "auto"
    # a Precision, FASTEST (resolved per component when compiling), or a mapping component -> Precision
    precision: Precision | str | Mapping[str, Precision] = Precision.FP32
    min_psnr: float = DEFAULT_MIN_PSNR  # with FASTEST (precision or recipe): the image drift a choice must stay within
    profile: ShapeProfile | None = None  # None: the model's default (half to double its native size)
    # a KasokuPipeline compiled without `profile` builds engines for a call outside the profile (they grow with the
    # calls); True refuses such a call instead, as an explicit profile does (a promise kept: no build mid-serving)
    strict_shapes: bool = False
    components: tuple[str, ...] | None = None  # None: every component the model has
    cache_dir: Path | None = None  # None: $KASOKU_CACHE or ~/.cache/kasoku
    threads: int | None = None  # CPU threads per engine; None: the runtime's default
    exporter: str = DEFAULT_EXPORTER
    opset: int = DEFAULT_OPSET
    # backend settings: each is read, checked and keyed by the backends that use it (Backend.reads), never here
    trt_opt_level: int = 3  # TensorRT builder optimization level (0-5)
    cuda_graph: bool = False  # TensorRT, ONNX Runtime CUDA: replay CUDA graphs (static profiles only)
    check_parity: bool = True  # prove every built artefact against torch
    onnx_dir: Path | None = None  # build from these ONNX files (a `kasoku export` folder) instead of exporting
    calibration_samples: int = 32  # int8: denoiser calls recorded from the pipeline's own runs to calibrate on
    # int8: components besides the denoisers whose activations are quantized too, calibrated on their own calls in
    # the pipeline's runs (the VAE decoder: its convolutions in int8); their int8 is otherwise weights only
    int8_activations: tuple[str, ...] = ()
    # int8: components whose weights are int4 instead (by groups; an LLM text encoder), held to int8's contract
    int4_weights: tuple[str, ...] = ()
    keep_intermediate: bool = False  # keep what engines were only built through (calibration engines)
    # modules whose weights stay engine inputs, bound once per LoRA adapter set (a switch in seconds); a preset
    # name of LORA_TARGET_PRESETS or module names; empty: every weight is a constant of its engine
    lora_targets: tuple[str, ...] = ()
    # step caching (kasoku.core.step_cache): also build the U-Net's full and shallow graphs (a call with
    # cache_interval > 1 builds them when they are missing), for this skip branch of the U-Net
    step_cache: bool = False
    cache_branch: int = DEFAULT_BRANCH
    # "fastest": run the winner of `kasoku tune`'s record for this model and machine at min_psnr (its precision,
    # step caching, VAE and shape; kasoku.policies.recipes); resolved by kasoku.compile into the fields above
    recipe: str | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # normalise once, here, so every reader sees one form
        if isinstance(self.precision, Mapping):
            set_(self, "precision", {name: _precision(p) for name, p in self.precision.items()})
        elif self.precision != FASTEST:
            set_(self, "precision", _precision(self.precision))
        if isinstance(self.backend, Mapping):
            set_(self, "backend", dict(self.backend))
        if self.components is not None:
            set_(self, "components", tuple(self.components))
        for name in ("int8_activations", "int4_weights"):
            value = getattr(self, name)
            set_(self, name, (value,) if isinstance(value, str) else tuple(value))
        set_(self, "lora_targets", lora_targets(self.lora_targets))
        for name in ("cache_dir", "onnx_dir"):
            value = getattr(self, name)
            if value is not None:
                set_(self, name, Path(value).expanduser())
        if self.exporter not in EXPORTERS:
            raise InvalidOptions(f"`exporter` must be one of {', '.join(EXPORTERS)} but is {self.exporter!r}.")
        if self.threads is not None and int(self.threads) < 1:
            raise InvalidOptions(f"`threads` must be at least 1 but is {self.threads}.")
        if not isinstance(self.cache_branch, int) or isinstance(self.cache_branch, bool) or self.cache_branch < 0:
            raise InvalidOptions(f"`cache_branch` must be a skip branch of the U-Net, an int >= 0 (0: the outermost, "
                                 f"the default) but is {self.cache_branch!r}.")
        if self.cuda_graph:
            check_cuda_graph_profile(self.profile)
        if self.recipe not in RECIPES:
            raise InvalidOptions(f"`recipe` must be one of {', '.join(map(str, RECIPES[1:]))} (or None) but is "
                                 f"{self.recipe!r}.")
        if self.recipe is not None and self.precision == FASTEST:
            raise InvalidOptions("`recipe` and precision 'fastest' both choose the precision; give one: the recipe "
                                 "(precision, step caching and VAE, from `kasoku tune`) or precision 'fastest'.")

    def replace(self, **changes: Any) -> CompileOptions:
        return dataclasses.replace(self, **changes)

    def precision_of(self, component: str) -> Precision:
        """The precision asked for `component` (FASTEST must be resolved first)."""
        if isinstance(self.precision, dict):
            if component not in self.precision:
                raise InvalidOptions(f"no precision is given for {component}; the mapping names "
                                     f"{', '.join(self.precision)}.")
            return self.precision[component]
        if self.precision == FASTEST:
            raise InvalidOptions("precision 'fastest' is resolved per component when compiling; ask for one "
                                 "component's precision after that.")
        return self.precision

    @property
    def precision_label(self) -> str:
        """How reports name the asked precision."""
        if isinstance(self.precision, dict):
            return "mixed: " + ", ".join(f"{n}={p.value}" for n, p in self.precision.items())
        return self.precision if isinstance(self.precision, str) and self.precision == FASTEST else \
            self.precision.value

    def backend_for(self, component: str) -> str:
        """The backend asked for `component` (``"auto"`` until resolved)."""
        if isinstance(self.backend, dict):
            if component not in self.backend:
                raise InvalidOptions(f"no backend is given for {component}; the mapping names "
                                     f"{', '.join(self.backend)}.")
            return self.backend[component]
        return self.backend

    @classmethod
    def of(cls, options: CompileOptions | None = None, **fields: Any) -> CompileOptions:
        """`options` with the given fields replaced (fields left None keep their value)."""
        base = options or cls()
        given = {k: v for k, v in fields.items() if v is not None}
        unknown = sorted(set(given) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"unknown compile option(s) {unknown}")
        return dataclasses.replace(base, **given) if given else base


PRECISION_CHOICES = (*(p.value for p in Precision), FASTEST)


def lora_targets(value: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """LoRA targets as module names: a preset name or comma-separated names expanded, sorted, unique."""
    items = value.split(",") if isinstance(value, str) else list(value or ())
    names: set[str] = set()
    for item in (str(i).strip() for i in items):
        if not item:
            continue
        if item in LORA_TARGET_PRESETS:
            names.update(LORA_TARGET_PRESETS[item])
        elif any(c.isspace() for c in item) or item.startswith(".") or item.endswith("."):
            raise InvalidOptions(f"`lora_targets` are module names such as to_q or to_out.0 (or the preset "
                                 f"{', '.join(LORA_TARGET_PRESETS)}) but one is {item!r}.")
        else:
            names.add(item)
    return tuple(sorted(names))
def check_cuda_graph_profile(profile: ShapeProfile | None) -> None:
    """A CUDA graph replays the kernels it captured at one set of shapes, so `cuda_graph` needs a static
    profile: one image count, height, width and guidance (ShapeProfile.is_static)."""
    if profile is not None and profile.is_static:
        return
    if profile is None:
        given = "none was given (the model's default profile serves a range of shapes)"
    else:
        guidance = {True: "with guidance", False: "without guidance", None: "guidance either way"}[profile.guidance]
        given = (f"the profile serves images {profile.range_text('batch')}, height {profile.range_text('height')}, "
                 f"width {profile.range_text('width')}, {guidance}")
    raise InvalidOptions(
        f"`cuda_graph` (--cuda-graph) needs a static shape profile (one image count, height, width and guidance, "
        f"e.g. `ShapeProfile.exact(ImageShape(1, 512, 512), guidance=True, multiple=8)`), but {given}. Pass such a "
        "profile, use `kasoku generate --cuda-graph` (it builds exact-shape engines for its call), or drop cuda_graph."
    )


def _precision(value: Any) -> Precision:
    try:
        return Precision(value)
    except ValueError:
        raise InvalidOptions(f"`precision` must be one of {', '.join(PRECISION_CHOICES)} but is {value!r}.") from None


# ---- int8 calibration: what the recording runs (its digest is part of an int8 engine's key) ----------------

CALIBRATION_PROMPTS = (
    "a photograph of an astronaut riding a horse on mars",
    "a beautiful photograph of mt fuji during cherry blossom",
    "an oil painting of a castle on a hill at night, detailed",
    "a portrait of a woman with red hair, soft lighting, sharp focus",
    "a watercolor painting of a forest river in autumn",
    "a cinematic photo of a city street in the rain at night",
    "a drawing of a cat sitting on a sofa, high quality",
    "a digital illustration of a robot in a flower garden",
)


@dataclass(frozen=True)
class CalibrationPlan:
    """What the recording runs: prompts cycled until `samples` engine calls are recorded."""

    prompts: tuple[str, ...] = CALIBRATION_PROMPTS
    steps: int = 8
    samples: int = 32
    guidance: float = 7.5
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CalibrationPlan:
        return cls(**{k: tuple(v) if k == "prompts" else v for k, v in data.items()})
