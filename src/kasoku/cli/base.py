"""What every command shares: the Command base (its arguments beside its code, Polygraphy-style),
argument types that refuse bad values at parse time, and the argument groups several commands take."""

from __future__ import annotations

import argparse
import contextlib
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

from ..core.errors import KasokuError


class Command:
    """One `kasoku` subcommand: its docstring is its help, `add_arguments` its flags, `run` its work.

    `run` calls the library and prints what it returns; it returns the exit status. A user error is a
    :class:`KasokuError` (printed as one line by `main`), raised before anything is written."""

    name: ClassVar[str]

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Declare this command's arguments."""

    def run(self, args: argparse.Namespace) -> int:
        raise NotImplementedError

    @classmethod
    def summary(cls) -> str:
        return (cls.__doc__ or "").strip().splitlines()[0]


# ---- argument types: a bad value is a one-line parse error, never a traceback later ----------


def _number(kind: Callable, text: str, rule: str, ok: Callable) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {rule}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {rule}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _number(int, text, "a positive integer", lambda v: v >= 1)


def non_negative_int(text: str) -> int:
    return _number(int, text, "an integer >= 0", lambda v: v >= 0)


def non_negative_float(text: str) -> float:
    return _number(float, text, "a finite number >= 0", lambda v: math.isfinite(v) and v >= 0)


MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes up to 64 bits; batch jobs and the server take 0..2**63-1


def seed(text: str) -> int:
    return _number(int, text, f"a seed in 0..{MAX_SEED}", lambda v: 0 <= v <= MAX_SEED)


def repeats(text: str) -> int:
    return _number(int, text, "at least 3 repeats (a median of repeats)", lambda v: v >= 3)


def text(value: str) -> str:
    """Text from the command line: valid UTF-8 (a terminal in another encoding passes bytes Python cannot decode)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"expected UTF-8 text, got bytes that are not: {value!r}") from None
    return value


def fraction(text: str) -> float:
    return _number(float, text, "a number in [0, 1]", lambda v: 0.0 <= v <= 1.0)


def finite_float(text: str) -> float:
    return _number(float, text, "a finite number", math.isfinite)


def component_name(text: str) -> str:
    """A component some family's pipeline can have (controlnet_0, controlnet_1, ... for ControlNets)."""
    from ..core.choices import COMPONENT_NAMES, is_component_name

    if not is_component_name(text):
        raise argparse.ArgumentTypeError(f"unknown component {text!r}; choose from {', '.join(COMPONENT_NAMES)}")
    return text


def lora_spec(text: str) -> tuple[Path, float]:
    """PATH[:SCALE]: a LoRA file or folder and its weight (default 1)."""
    path, _, tail = text.rpartition(":")
    try:
        scale = float(tail) if path else 1.0
    except ValueError:
        path, scale = "", 1.0
    if not math.isfinite(scale):
        raise argparse.ArgumentTypeError(f"expected PATH[:SCALE] with a finite SCALE, got {text!r}")
    return Path(path or text).expanduser(), scale


def lora_targets(text: str) -> tuple[str, ...]:
    """A preset (attention) or comma-separated module names."""
    from ..core.options import InvalidOptions
    from ..core.options import lora_targets as parse

    try:
        return parse(text)
    except InvalidOptions as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_lora_targets(parser: argparse.ArgumentParser) -> None:
    from ..core.options import LORA_TARGET_PRESETS

    parser.add_argument("--lora-targets", type=lora_targets, default=None, metavar="NAMES",
                        help="modules whose weights stay engine inputs, so that switching LoRA adapters takes "
                             f"seconds: a preset ({', '.join(LORA_TARGET_PRESETS)}: the U-Net's and text encoders' "
                             "attention projections) or comma-separated module names such as to_q,to_k "
                             "(default: none; every weight is a constant, and an adapter rebuilds the engine)")


def image_size(text: str):
    """WIDTHxHEIGHT, as the OpenAI API writes a size (kasoku.core.choices.Size)."""
    from ..core.choices import Size

    try:
        return Size.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def size_range(text: str) -> tuple[int, ...]:
    """MIN:MAX or MIN:OPT:MAX, positive integers."""
    rule = "MIN:MAX or MIN:OPT:MAX (positive integers)"
    try:
        values = tuple(int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {rule}, got {text!r}") from None
    if len(values) not in (2, 3) or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected {rule}, got {text!r}")
    return values


# ---- argument groups several commands take -------------------------------------------------


def add_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a diffusers pipeline folder (or a hub id when online)")


def add_controlnet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--controlnet", action="append", type=Path, default=None, metavar="PATH",
                        help="a ControlNet folder (a diffusers ControlNetModel; `kasoku tiny DIR --controlnet` writes "
                             "one in DIR/controlnet); repeat for several ControlNets")


def add_tiny_vae(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny-vae", type=Path, default=None, metavar="PATH",
                        help="an AutoencoderTiny folder (TAESD for SD 1.x/2.x, TAESDXL, TAESD3, TAEF1) in place of "
                             "the model's VAE: at one to four steps the full decoder costs more than the denoiser; "
                             "images differ a little from the full VAE's (`kasoku tiny DIR --tiny-vae` writes one)")


def tiny_vae_from_args(args: argparse.Namespace) -> str | None:
    """The --tiny-vae folder, checked to be an AutoencoderTiny folder (None: the model's own VAE)."""
    if getattr(args, "tiny_vae", None) is None:
        return None
    from ..model.loading import load_tiny_vae

    load_tiny_vae(args.tiny_vae, lazy=True)  # reads its config only: a bad folder is said first
    return str(args.tiny_vae)


def add_ip_adapter_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("image prompts (IP-Adapter)")
    group.add_argument("--ip-adapter", type=Path, action="append", default=None, metavar="PATH",
                       help="an IP-Adapter weights file (plain or Plus, e.g. ip-adapter-plus_sd15.safetensors); its "
                            "image encoder is read from image_encoder/ beside it (or --ip-image-encoder); repeat "
                            "for several, each with its own --ip-image")
    group.add_argument("--ip-image", type=Path, action="append", default=None, metavar="IMG",
                       help="the image prompt, one per --ip-adapter")
    group.add_argument("--ip-scale", type=finite_float, action="append", default=None, metavar="S",
                       help="how strongly the image prompt steers (default 1.0): one for all or one per --ip-adapter")
    group.add_argument("--ip-image-encoder", type=Path, default=None, metavar="DIR",
                       help="the CLIPVisionModelWithProjection folder the adapters were trained with (default: "
                            "image_encoder/ beside the first --ip-adapter, or beside its folder)")


def add_ip_adapter_files(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ip-adapter", type=Path, action="append", default=None, metavar="PATH",
                        help="an IP-Adapter weights file (plain or Plus) loaded first, its image encoder from "
                             "image_encoder/ beside it; its engines are checked too, and the image gets a random image "
                             "prompt; repeat for several")


def ip_adapter_files(args: argparse.Namespace) -> list[Path] | None:
    """The --ip-adapter files of verify and bench, checked first (None: no IP-Adapter)."""
    if not args.ip_adapter:
        return None
    from ..runtime.image_prompts import check_adapter_files

    check_adapter_files(args.ip_adapter, getattr(args, "ip_image_encoder", None), "--ip-adapter")
    return list(args.ip_adapter)


def ip_adapters_from_args(args: argparse.Namespace) -> tuple[list[Path], list, list[float]]:
    """(the --ip-adapter files, their --ip-image images, a scale per adapter), checked before any work: files
    that are IP-Adapters, one readable image per adapter, one scale for all or one per adapter."""
    adapters, images, scales = args.ip_adapter or [], args.ip_image or [], args.ip_scale or []
    if not adapters:
        given = [flag for flag, value in (("--ip-image", images), ("--ip-scale", scales),
                                          ("--ip-image-encoder", args.ip_image_encoder)) if value]
        if given:
            raise KasokuError(f"{given[0]} needs --ip-adapter PATH (the IP-Adapter it is for).")
        return [], [], []
    ip_adapter_files(args)
    if len(images) != len(adapters):
        raise KasokuError(f"give one --ip-image per --ip-adapter: {len(adapters)} adapter(s) but {len(images)} "
                          "image(s).")
    if len(scales) not in (0, 1, len(adapters)):
        raise KasokuError(f"give one --ip-scale for every adapter or one per --ip-adapter ({len(adapters)}) but "
                          f"{len(scales)} are given.")
    scales = scales * len(adapters) if len(scales) == 1 else scales or [1.0] * len(adapters)
    return adapters, [open_image(path, "--ip-image") for path in images], scales


def load_ip_adapters(pipe, args: argparse.Namespace, adapters: list[Path], scales: list[float]) -> None:
    """The --ip-adapter files on a compiled pipeline, at their scales (diffusers' load_ip_adapter)."""
    if not adapters:
        return
    from ..runtime.image_prompts import file_arguments

    pipe.load_ip_adapter(**file_arguments(adapters, args.ip_image_encoder, pipe.family))
    pipe.set_ip_adapter_scale(scales if len(scales) > 1 else scales[0])


def controlnets_from_args(args: argparse.Namespace) -> list[str] | None:
    """The --controlnet folders, checked to be ControlNet folders (None: no ControlNet)."""
    if not getattr(args, "controlnet", None):
        return None
    from ..model.loading import load_controlnets

    folders = [str(path) for path in args.controlnet]
    load_controlnets(folders, lazy=True)  # reads configs only: a bad folder is the first thing said
    return folders


def add_cache_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: $KASOKU_CACHE or ~/.cache/kasoku")


def add_json(parser: argparse.ArgumentParser, what: str = "the report") -> None:
    parser.add_argument("--json", type=Path, metavar="PATH", help=f"also write {what} as JSON")


def add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    """--backend and --precision, with the choices the code accepts."""
    from ..core.choices import BACKEND_CHOICES
    from ..core.options import DEFAULT_MIN_PSNR, PRECISION_CHOICES

    parser.add_argument("--backend", choices=BACKEND_CHOICES, default="auto",
                        help="auto (default): TensorRT, then ONNX Runtime CUDA, then inductor on a GPU; on a CPU "
                             "the faster of onnxruntime and openvino (and inductor with KASOKU_AUTO_INDUCTOR=1) per "
                             "component, measured once per model and machine")
    parser.add_argument("--precision", choices=PRECISION_CHOICES, default="fp32",
                        help="fp32 (default: exact); fp16; bf16 (CPUs with AVX512-BF16 or AMX, on OpenVINO or "
                             "inductor; GPUs on inductor); int8 "
                             "(NNCF on OpenVINO: the U-Net calibrated on the pipeline's own runs); fastest: per "
                             "component the fastest precision whose image drift stays within --min-psnr. Each has "
                             "a fidelity contract (`kasoku verify --precision X` checks it)")
    parser.add_argument("--min-psnr", type=finite_float, default=DEFAULT_MIN_PSNR, metavar="DB",
                        help=f"with --precision fastest or --recipe fastest: the least image PSNR against the fp32 "
                             f"engines (default {DEFAULT_MIN_PSNR:g} dB)")
    parser.add_argument("--int8-activations", nargs="+", type=component_name, default=(), metavar="COMPONENT",
                        help="with --precision int8: components besides the denoiser whose activations are int8 too, "
                             "calibrated on their own calls in the pipeline's runs (vae_decoder: its convolutions "
                             "in int8; Sana's DC-AE-Lite at 1024x1024 took 6.5 s against 9.1 s in bf16 on a VNNI "
                             "CPU). The engine is checked against torch within int8's relative error, or refused; "
                             "`kasoku verify` holds the images to the contract (default: none; their int8 is "
                             "weights only)")
    parser.add_argument("--int4-weights", nargs="+", type=component_name, default=(), metavar="COMPONENT",
                        help="with --precision int8: components whose weights are int4 (asymmetric, by groups of 128 "
                             "input channels; the embeddings int8) instead of int8, half their bytes: an LLM text "
                             "encoder (text_encoder). Weight-only components only; the engine is held to int8's "
                             "contract against torch, or refused (default: none)")


def add_recipe(parser: argparse.ArgumentParser) -> None:
    """--recipe: run what `kasoku tune` recorded as fastest (at --min-psnr)."""
    parser.add_argument("--recipe", choices=["fastest"], default=None,
                        help="fastest: run the recipe `kasoku tune MODEL` recorded as the fastest on this machine with "
                             "images at least --min-psnr dB from the fp32 engines' (its precision, step caching, VAE "
                             "and exact-shape engines); a call's own --cache-interval/--cache-threshold replaces its "
                             "step caching. Without a tuning of the model here it says what to run")


def check_recipe_arguments(args: argparse.Namespace) -> None:
    """--recipe chooses the precision: a --precision beside it is refused (before any work)."""
    if getattr(args, "recipe", None) and args.precision != "fp32":
        raise KasokuError(f"--recipe {args.recipe} chooses the precision (the tuned one); leave out --precision "
                          f"{args.precision}, or drop --recipe.")


def add_engine_arguments(parser: argparse.ArgumentParser, *, profile_flags: bool = True) -> None:
    """The options that say which engines to build (compile, generate, verify, bench)."""
    from ..core.choices import COMPONENT_NAMES, TRT_OPT_LEVELS
    from ..core.options import DEFAULT_EXPORTER, DEFAULT_OPSET, EXPORTERS

    add_backend_arguments(parser)
    if profile_flags:
        parser.add_argument("--batch", type=size_range, metavar="MIN:MAX", help="images per call the engines serve")
        parser.add_argument("--height", type=size_range, metavar="MIN:MAX", help="image heights in pixels")
        parser.add_argument("--width", type=size_range, metavar="MIN:MAX", help="image widths in pixels")
    parser.add_argument("--text-tokens", type=positive_int, default=None, metavar="N",
                        help="SD3 and Flux: the T5 tokens the engines read, diffusers' max_sequence_length "
                             "(default: the family's, 256 for SD3, 512 for Flux)")
    parser.add_argument("--components", nargs="+", type=component_name, default=None, metavar="NAME",
                        help=f"which of {' '.join(COMPONENT_NAMES)} (default: all the model has)")
    parser.add_argument("--exporter", choices=EXPORTERS, default=DEFAULT_EXPORTER, help=argparse.SUPPRESS)
    parser.add_argument("--opset", type=positive_int, default=DEFAULT_OPSET, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="CPU threads per engine (default: the runtime's)")
    parser.add_argument("--trt-opt-level", type=int, choices=list(TRT_OPT_LEVELS), default=3,
                        help="TensorRT builder optimization level 0-5 (default 3)")
    parser.add_argument("--keep-intermediate", action="store_true",
                        help="keep what engines were only built through (int8 calibration engines) in the cache "
                             "(default: drop them; the architecture graphs are always kept: they hold no weights)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="tensorrt and onnxruntime-cuda: capture each engine's GPU work once and replay it as a "
                             "CUDA graph; needs exact-shape engines (`kasoku generate` builds them for its call)")
    add_lora_targets(parser)
    add_cache_dir(parser)


def add_step_cache_arguments(parser: argparse.ArgumentParser, *, per_call: bool) -> None:
    """Step caching (DeepCache, kasoku.core.step_cache): a call's interval and schedule (`per_call`), or
    `--step-cache` to build its engines ahead; and the U-Net's skip branch."""
    from ..core.step_cache import DEFAULT_ORDER, DEFAULT_SCHEDULE, DEFAULT_WARMUP, METHODS, SCHEDULES

    if per_call:
        parser.add_argument("--cache-interval", type=positive_int, default=1, metavar="N",
                            help="step caching: one denoising step in N computed in full (default 1: off, every step "
                                 "exact). U-Nets run DeepCache (the other steps run only the outer layers), "
                                 "transformers TaylorSeer (the other steps forecast). DeepCache builds its engines "
                                 "(unet_full, unet_shallow) when the cache does not hold them")
        parser.add_argument("--cache-schedule", choices=SCHEDULES, default=DEFAULT_SCHEDULE,
                            help="DeepCache: which steps run the whole U-Net with --cache-interval: uniform (every "
                                 "N-th, the default) or nonuniform (the paper's: as many, denser around 30%% of the "
                                 "loop)")
        parser.add_argument("--cache-method", choices=METHODS, default=None,
                            help="the step-caching method (default: deepcache for a U-Net's --cache-interval, "
                                 "taylorseer for a transformer's, first-block for --cache-threshold); taylorseer runs "
                                 "on every denoiser, U-Nets and ControlNet pipelines included")
        parser.add_argument("--cache-threshold", type=non_negative_float, default=None, metavar="T",
                            help="first-block cache (transformers): skip the other blocks on a step whose first-block "
                                 "residual changed by at most T (relative mean) since the last full step; 0 skips "
                                 "none (exact); diffusers suggests 0.05 to 0.12. Builds transformer_first and "
                                 "transformer_rest when the cache does not hold them")
        parser.add_argument("--cache-order", type=positive_int, default=None, metavar="K",
                            help=f"TaylorSeer: the forecast's highest Taylor order (default {DEFAULT_ORDER})")
        parser.add_argument("--cache-warmup", type=non_negative_int, default=None, metavar="S",
                            help=f"TaylorSeer: steps always computed before any forecast (default {DEFAULT_WARMUP})")
    else:
        parser.add_argument("--step-cache", action="store_true",
                            help="also build the step-cache engines that calls with step caching run (U-Nets' "
                                 "DeepCache: unet_full, unet_shallow; transformers' first-block cache: "
                                 "transformer_first, transformer_rest); without it the first such call builds them")
    add_cache_branch(parser)


def step_caching_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The step-caching call arguments of the flags add_step_cache_arguments(per_call=True) gave (those set)."""
    given = {"cache_interval": args.cache_interval, "cache_schedule": args.cache_schedule}
    given.update({name: value for name in ("cache_method", "cache_threshold", "cache_order", "cache_warmup")
                  if (value := getattr(args, name, None)) is not None})
    return given


def add_cache_branch(parser: argparse.ArgumentParser) -> None:
    from ..core.step_cache import DEFAULT_BRANCH

    parser.add_argument("--cache-branch", type=non_negative_int, default=DEFAULT_BRANCH, metavar="B",
                        help=f"step caching: the U-Net skip branch whose deep feature is cached, counted from the "
                             f"outside (default {DEFAULT_BRANCH}: the cheapest shallow steps)")


def options_from_args(args: argparse.Namespace, profile=None, *, cuda_graph: bool | None = None):
    """The CompileOptions of the engine arguments, checked before anything is loaded or written.
    `cuda_graph` overrides --cuda-graph (a command that chooses its profile later sets it with the profile)."""
    from ..core.options import CompileOptions

    options = CompileOptions(
        backend=args.backend, precision=args.precision, min_psnr=args.min_psnr, profile=profile,
        components=getattr(args, "components", None), cache_dir=args.cache_dir, threads=args.threads,
        exporter=getattr(args, "exporter", None) or CompileOptions.exporter,
        opset=getattr(args, "opset", None) or CompileOptions.opset,
        trt_opt_level=getattr(args, "trt_opt_level", CompileOptions.trt_opt_level),
        keep_intermediate=getattr(args, "keep_intermediate", False),
        lora_targets=getattr(args, "lora_targets", None) or (),
        int8_activations=getattr(args, "int8_activations", ()),
        int4_weights=getattr(args, "int4_weights", ()),
        step_cache=getattr(args, "step_cache", False),
        cache_branch=getattr(args, "cache_branch", CompileOptions.cache_branch),
        cuda_graph=getattr(args, "cuda_graph", False) if cuda_graph is None else cuda_graph,
        recipe=getattr(args, "recipe", None),
    )
    check_recipe_arguments(args)
    check_backend(options)
    return options


def check_backend(options, *, cuda_graph: bool = False) -> None:
    """An explicit backend must be installed and build the asked precision (and, with `cuda_graph`,
    replay CUDA graphs): say so before any work."""
    from ..core.options import FASTEST

    names = set(options.backend.values()) if isinstance(options.backend, dict) else {options.backend}
    precisions = set(options.precision.values()) if isinstance(options.precision, dict) else {options.precision}
    if not names - {"auto"}:
        return  # `auto` picks among the installed backends later (the runtimes are not imported for a check)
    from ..backends import get_backend

    for name in names - {"auto"}:
        backend = get_backend(name, options)
        backend.require()
        if cuda_graph:
            backend.check_cuda_graph(asked=True)
        for precision in precisions - {FASTEST}:
            backend.check_precision(precision)
            if options.lora_targets:
                backend.check_run_time_weights(precision)


def profile_from_args(args: argparse.Namespace, model=None):
    """A ShapeProfile from --batch/--height/--width, the model's defaults for the rest (None: defaults). `model` is
    the command's own Model where it has one: a recorded family's default profile records its pipeline, once."""
    text_tokens = getattr(args, "text_tokens", None)
    if not (getattr(args, "batch", None) or getattr(args, "height", None) or getattr(args, "width", None)
            or text_tokens):
        return None
    from dataclasses import replace

    from ..core.components import profile_with_ranges
    from ..model.pipeline_model import Model

    base = replace((model or Model.load(args.model, lazy=True)).default_profile(), text_tokens=text_tokens)
    return profile_with_ranges(base, getattr(args, "batch", None), getattr(args, "height", None),
                               getattr(args, "width", None))


# A Python argument -> the flag of `kasoku generate` (and `batch`) that sets it: CLI messages name the flags.
GENERATE_FLAGS = {"num_inference_steps": "--steps", "guidance_scale": "--guidance", "image": "--image",
                  "mask_image": "--mask", "strength": "--strength", "num_images_per_prompt": "--num-images",
                  "negative_prompt": "--negative", "negative_prompt_2": "--negative-2", "prompt_2": "--prompt-2",
                  "prompt_3": "--prompt-3", "height": "--height", "width": "--width",
                  "control_image": "--control-image",
                  "controlnet_conditioning_scale": "--control-scale", "guess_mode": "--guess-mode",
                  "cache_interval": "--cache-interval", "cache_schedule": "--cache-schedule",
                  "cache_method": "--cache-method", "cache_threshold": "--cache-threshold",
                  "cache_order": "--cache-order", "cache_warmup": "--cache-warmup",
                  "true_cfg_scale": "--true-cfg", "max_sequence_length": "--text-tokens"}


@contextlib.contextmanager
def flags_named(flags: dict[str, str] = GENERATE_FLAGS) -> Iterator[None]:
    """A library error about a call argument, said with the command's flag for it (`num_inference_steps` ->
    `--steps`)."""
    try:
        yield
    except KasokuError as error:
        text = re.sub(r"`([a-z_0-9]+)`", lambda m: f"`{flags.get(m[1], m[1])}`", str(error))
        if text == str(error):
            raise
        raise KasokuError(text) from None


def show_stage(component: str, name: str):
    """A spinner while one compile stage of one component runs."""
    from ..core.console import stage

    return stage(f"{component}: {name}")


def open_image(path: Path, flag: str):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert("RGB")  # reads the whole file: a truncated one fails here, before any work
    except FileNotFoundError:
        raise KasokuError(f"{flag} {path} does not exist.") from None
    except (UnidentifiedImageError, IsADirectoryError):
        raise KasokuError(f"{flag} {path} is not an image PIL can read.") from None
    except (OSError, SyntaxError, ValueError) as error:  # PIL's truncated or damaged files
        raise KasokuError(f"{flag} {path} is a damaged image ({error}); give a whole image file.") from None


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")


def check_output_file(path: Path, flag: str = "-o", suffixes: tuple[str, ...] | None = None) -> Path:
    """A file the command will write, checked before any work: its folder exists and is writable, the path is
    not a folder, and (with `suffixes`) its name says a format that can be written."""
    import os

    path = Path(path)
    if not path.parent.exists():
        raise KasokuError(f"cannot write {path}: the folder {path.parent} does not exist.")
    if not path.parent.is_dir():
        raise KasokuError(f"cannot write {path}: {path.parent} is a file, not a folder.")
    if path.is_dir():
        raise KasokuError(f"{flag} {path} is a folder; give a file name.")
    if not os.access(path.parent, os.W_OK):
        raise KasokuError(f"cannot write {path}: the folder {path.parent} is not writable.")
    if suffixes is not None and path.suffix.lower() not in suffixes:
        raise KasokuError(f"{flag} {path}: give a file name ending in an image format, one of "
                          f"{', '.join(suffixes)} (e.g. out.png).")
    return path
