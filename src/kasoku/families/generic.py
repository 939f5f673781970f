"""Any diffusers image pipeline kasoku has no hand-written family for: its components compiled from its calls.

A :class:`GenericFamily` is made for a pipeline class (``QwenImagePipeline``, ``SanaPipeline``, ...) the day
diffusers ships it. It knows no model: it runs the pipeline's own ``__call__`` a few times at small probe shapes
(:func:`probes`: one and two images, two sizes whose height, width and area change by ratios of their own, two
text lengths, with and without guidance; for each task diffusers has a class for), with every torch component
recorded (:mod:`kasoku.core.recording`). What the pipeline called becomes the components: each module's
`forward` (its attribute's name: ``transformer``, ``text_encoder``), a VAE's ``decode`` and ``encode``
(``vae_decoder``, ``vae_encoder``), one component per call pattern (:mod:`kasoku.architectures.recorded`).

Recording needs the modules' weights (a folder loaded lazily loads them for it, then drops them again); it is kept
per model and in the cache (:class:`~kasoku.core.recording.RecordingStore`). A module
whose calls cannot become a graph (a constant that changes from call to call), or whose graph does not export
or build, stays in torch: one line says which and why, and the rest of the pipeline runs on engines.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import inspect
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch

from ..architectures import recorded
from ..architectures.base import config_dict
from ..architectures.recorded import EngineRecorded, Probe, Recording, Signature, UncompilableCall
from ..core.components import ComponentSpec, InvalidProfile, ShapeProfile, architecture_config, default_profile
from ..core.errors import KasokuError, NotADiffusersPipeline
from ..core.memory import return_freed_memory
from ..core.recording import recording
from ..core.standins import EngineTimes
from ..core.step_cache import DEFAULT_BRANCH, FIRST_BLOCK, TAYLORSEER
from ..core.weights import floating_dtype
from .base import TASKS, Family, ModelView, TextEncoderSlot

__all__ = ["GenericFamily", "NotCompilable", "generic_family", "is_diffusers_pipeline", "pipeline_classes", "probes"]

# what a recording's pipeline calls are given (the class takes only what its __call__ names)
PROMPTS = ("a red fox in the snow", "an old lighthouse on a rocky coast at dusk, oil painting")
PROBE_STEPS = 2
# max_sequence_length of the two probes: a ratio (7/3) no image dimension has, multiples of 16 (tokenizers pad so)
PROBE_TOKENS = (48, 112)
DEFAULT_MAX_TOKENS = 512  # the text-token axes' bound where the pipeline names no max_sequence_length
CALIBRATION_STEPS = 8  # the most steps an int8 denoiser's calibration runs per prompt (CalibrationPlan's default)
TASK_CLASS_SUFFIXES = {"img2img": ("Img2Img", "I2I"), "inpaint": ("Inpaint", "Inpainting")}


class NotCompilable(KasokuError, ValueError):
    """A pipeline kasoku cannot compile any component of, or whose recording failed."""


def _architecture_config(module: Any) -> Any:
    """A module's configuration without its metadata (`_name_or_path` is the folder it was read from once loaded,
    and empty on a lazily loaded module; transformers writes the dtype it read into a loaded module's config, not
    into the meta stand-in's): a warm start must find the recording a cold one kept. The read dtype is keyed by
    itself (`dtypes`)."""
    if getattr(module, "config", None) is None:
        return type(module).__name__
    return architecture_config(config_dict(module.config))


def _identity_of(component: Any) -> Any:
    """What a pipeline's non-torch component (a tokenizer, a scheduler, an image processor) does to a call, as plain
    data: a tokenizer's digest (its whole fast tokenizer, else its vocabulary) and settings, a scheduler's or
    processor's configuration."""
    if component is None or isinstance(component, (bool, int, float, str)):
        return component
    if hasattr(component, "get_vocab"):  # a tokenizer (or a processor holding one)
        backend = getattr(component, "backend_tokenizer", None)
        if backend is not None:  # without the truncation and padding the last call set on it
            text = json.dumps({k: v for k, v in json.loads(backend.to_str()).items()
                               if k not in ("truncation", "padding")}, sort_keys=True)
        else:
            text = json.dumps(sorted(component.get_vocab().items()), default=str)
        settings = {name: str(getattr(component, name, None)) for name in
                    ("padding_side", "model_max_length", "chat_template", "all_special_tokens")}
        return {"class": type(component).__name__, "tokenizer": hashlib.sha256(text.encode()).hexdigest(),
                **settings}
    if isinstance(getattr(component, "config", None), Mapping):
        return {"class": type(component).__name__, **dict(component.config)}
    if hasattr(component, "to_dict"):
        return {"class": type(component).__name__, **component.to_dict()}
    return type(component).__name__


@functools.cache
def pipeline_classes() -> dict[str, type]:
    """Every pipeline class the installed diffusers exports, by name (a name whose lazy import fails, such as a
    legacy ONNX class, is left out)."""
    import diffusers

    found = {}
    for name in dir(diffusers):
        if not name.endswith("Pipeline"):
            continue
        try:
            cls = getattr(diffusers, name)
        except (AttributeError, ImportError, RuntimeError):
            continue
        if isinstance(cls, type):
            found[name] = cls
    return found


def _task_of_class(cls: type) -> str:
    """A diffusers pipeline class's task, from its call: a mask means inpainting, an image and a strength img2img."""
    parameters = inspect.signature(cls.__call__).parameters
    if "mask_image" in parameters:
        return "inpaint"
    if "image" in parameters and "strength" in parameters:
        return "img2img"
    return "txt2img"


def _siblings(cls: type) -> dict[str, str]:
    """Task -> class name of the pipelines of `cls`'s family: diffusers' AutoPipeline tables, else its naming
    (``ChromaPipeline``, ``ChromaImg2ImgPipeline``, ``ChromaInpaintPipeline``)."""
    from diffusers.pipelines import auto_pipeline

    own = _task_of_class(cls)
    found = {own: cls.__name__}
    tables = {"txt2img": auto_pipeline.AUTO_TEXT2IMAGE_PIPELINES_MAPPING,
              "img2img": auto_pipeline.AUTO_IMAGE2IMAGE_PIPELINES_MAPPING,
              "inpaint": auto_pipeline.AUTO_INPAINT_PIPELINES_MAPPING}
    keys = [key for key, value in tables[own].items() if value is cls]
    classes = pipeline_classes()
    stem = cls.__name__.removesuffix("Pipeline")
    for suffix in (*TASK_CLASS_SUFFIXES["img2img"], *TASK_CLASS_SUFFIXES["inpaint"]):
        stem = stem.removesuffix(suffix)
    for task in TASKS:
        if task in found:
            continue
        named = [table_class for key in keys if (table_class := tables[task].get(key)) is not None]
        named += [classes[f"{stem}{suffix}Pipeline"] for suffix in TASK_CLASS_SUFFIXES.get(task, ())
                  if f"{stem}{suffix}Pipeline" in classes]
        named += [classes[f"{stem}Pipeline"]] if task == "txt2img" and f"{stem}Pipeline" in classes else []
        fitting = [c for c in named if _task_of_class(c) == task]
        if fitting:
            found[task] = fitting[0].__name__
    return {task: found[task] for task in TASKS if task in found}


def is_diffusers_pipeline(pipeline_class: str) -> bool:
    return pipeline_class in pipeline_classes()


@functools.cache
def generic_family(pipeline_class: str) -> GenericFamily:
    """The generic family of a diffusers pipeline class (one object per class)."""
    classes = pipeline_classes()
    if pipeline_class not in classes:
        raise NotADiffusersPipeline(f"{pipeline_class!r} is not a pipeline class of the installed diffusers.")
    return GenericFamily(classes[pipeline_class])


def probes(multiple: int, tokens: bool, guided: bool | None, *, tasks: bool = False) -> tuple[Probe, ...]:
    """The recorded calls' shapes, in pixels of `multiple`: the optimum (one image of 4x3), two images of 3x5
    (batch x2, height x3/4, width x5/3, area x5/4: every product of them changes by its own ratio), one image of
    3x5 with the other prompt (a call pattern that follows the images, a list per image, still sees two sizes and
    two prompts), with `PROBE_TOKENS` text tokens where the pipeline takes them; `guided` says whether they run
    with guidance, and where the pipeline has a choice (not None), a last call is the optimum the other way
    (text-to-image only: not for `tasks`)."""
    one, two = PROBE_TOKENS if tokens else (None, None)
    first = Probe(1, 4 * multiple, 3 * multiple, one, bool(guided))
    found = (first, Probe(2, 3 * multiple, 5 * multiple, two, bool(guided)),
             Probe(1, 3 * multiple, 5 * multiple, two, bool(guided), prompt=1))
    if guided is not None and not tasks:
        found += (Probe(1, first.height, first.width, one, not guided),)
    return found


class GenericFamily(Family):
    """The family of one diffusers pipeline class, compiled from its recorded calls."""

    generic: ClassVar[bool] = True
    default_steps = 28
    default_guidance = 4.0

    def __init__(self, cls: type):
        self.cls = cls
        self.name = cls.__name__
        self.title = cls.__name__.removesuffix("Pipeline")
        self.pipelines = _siblings(cls)
        parameters = inspect.signature(cls.__call__).parameters
        self.parameters = parameters
        self.call_arguments = ()

    # ---- recognising it --------------------------------------------------------------------------

    def class_names(self) -> tuple[str, ...]:
        return tuple(self.pipelines.values())

    def check_layout(self, components: Mapping[str, Any], where: str) -> None:
        modules = [name for name, module in components.items() if module is not None]
        if not modules:
            raise NotCompilable(f"{where} has no torch components to compile.")

    # ---- the recordings ------------------------------------------------------------------------------

    def modules(self, model: ModelView) -> dict[str, torch.nn.Module]:
        """The pipeline's torch components by attribute (as they are now: maybe on the meta device)."""
        return {name: module for name, module in model.pipe.components.items()
                if isinstance(module, torch.nn.Module)}

    def guided(self, model: ModelView) -> bool | None:
        """Whether the probes run with guidance by default (True), without (False), and whether a third probe
        runs the other way (None: the pipeline has no guidance argument)."""
        if "true_cfg_scale" in self.parameters:
            return True
        if "guidance_scale" in self.parameters:
            return True
        return None

    def probe_arguments(self, probe: Probe, task: str, *, pipeline) -> dict[str, Any]:
        """The call of `pipeline` (the class for `task`) at `probe`, with the arguments its call takes."""
        from PIL import Image

        parameters = inspect.signature(type(pipeline).__call__).parameters
        chosen = [PROMPTS[(probe.prompt + i) % len(PROMPTS)] for i in range(probe.batch)]
        prompts = chosen if probe.batch > 1 else chosen[0]
        arguments: dict[str, Any] = {"prompt": prompts, "height": probe.height, "width": probe.width,
                                     "num_inference_steps": PROBE_STEPS,
                                     "generator": torch.Generator().manual_seed(0), "output_type": "pil",
                                     "use_resolution_binning": False, "clean_caption": False,
                                     # an LLM's generate loop that rewrites the prompt (LongCat's) is not compiled
                                     "enable_prompt_rewrite": False}
        if probe.tokens is not None:
            arguments["max_sequence_length"] = probe.tokens
        if "true_cfg_scale" in parameters:
            arguments["true_cfg_scale"] = 4.0 if probe.guidance else 1.0
            arguments["negative_prompt"] = ["blurry"] * probe.batch if probe.guidance else None
        elif "guidance_scale" in parameters:
            arguments["guidance_scale"] = 4.5 if probe.guidance else 1.0
        # a guidance value per step (Ideogram 4's) is as long as the default steps: the probes' one scale instead
        arguments["guidance_schedule"] = None
        if task != "txt2img":
            ramp = torch.linspace(0, 255, probe.width).expand(probe.height, probe.width)
            pixels = torch.stack([ramp, ramp.flip(1), torch.full_like(ramp, 128)], -1).to(torch.uint8).numpy()
            arguments["image"] = Image.fromarray(pixels)
            arguments["strength"] = 1.0
        if task == "inpaint":
            mask = torch.zeros(probe.height, probe.width, dtype=torch.uint8)
            mask[probe.height // 4: 3 * probe.height // 4, probe.width // 4: 3 * probe.width // 4] = 255
            arguments["mask_image"] = Image.fromarray(mask.numpy())
        return {name: value for name, value in arguments.items() if name in parameters}

    def record(self, model: ModelView) -> list[Recording]:
        """Run the pipeline at the probes, for every task it has a class for, with its components recorded (kept
        on the model: recording runs once)."""
        memo = model.memo
        if "recordings" not in memo:
            takes_tokens = "max_sequence_length" in self.parameters
            memo["recordings"] = self._recordings(model, lambda task: probes(
                self.pixel_multiple(model), takes_tokens, self.guided(model), tasks=task != "txt2img"))
        return memo["recordings"]

    def _recordings(self, model: ModelView, probes_of: Callable[[str], Iterable[Probe]], *,
                    blocks: bool = False) -> list[Recording]:
        """The pipeline's calls at `probes_of(task)`, for every task it has a class for: of its components, or
        (`blocks`) of the blocks of the components kept in torch (:meth:`block_paths`)."""
        names = self.block_paths(model) if blocks else list(self.modules(model))
        # (before the key: a cold digest reads the weights)
        lazy = [] if blocks else [name for name in names if not model.is_loaded(name)]
        plan = {task: found for task in self.pipelines if (found := tuple(probes_of(task)))}
        parts = self._recording_key(model, names, plan) if model.recordings is not None else None
        kept = model.recordings.get(parts) if parts is not None else None
        if kept is not None:
            recordings, one_image = kept
            if one_image:
                model.memo.setdefault("one_image", one_image)
            return recordings
        modules = {name: model.ref(name).load() for name in names}
        found: list[Recording] = []
        for task, task_probes in plan.items():
            pipeline = self.task_pipeline(model.pipe, task)
            for probe in task_probes:
                try:
                    found.append(Recording(probe, task, self._recorded_call(pipeline, task, probe, modules)))
                except NotCompilable as error:
                    if probe.batch == 1:
                        raise
                    # diffusers' own pipeline cannot make several images per call (PRX with guidance): kasoku
                    # compiles it for the one image per call it makes
                    model.memo.setdefault("one_image", f"its pipeline fails in diffusers for {probe.batch} images "
                                                       f"per call ({_cause(error)})")
        if parts is not None:
            model.recordings.put(parts, (found, model.memo.get("one_image")))
        # weights read for the recording only are dropped again: each is read once more when its engine is built,
        # one component at a time, so a whole pipeline never sits in memory beside an engine build
        del modules
        for name in lazy:
            model.release(name)
        return_freed_memory()
        return found

    def _recording_key(self, model: ModelView, names: list[str], plan: Mapping[str, tuple[Probe, ...]]
                       ) -> dict[str, Any]:
        """What the calls recorded at `plan` depend on: the pipeline classes, the recorded modules, every torch
        component's configuration, dtype and weights, the other components (tokenizers, scheduler, processors), the
        probes and the libraries that run them."""
        import diffusers
        import transformers

        modules = self.modules(model)
        return {"pipelines": dict(self.pipelines), "recorded": names,
                "probes": {task: [dataclasses.asdict(p) for p in probes] for task, probes in plan.items()},
                "weights": {name: model.ref(name).digest() for name in modules},
                "configs": {name: _architecture_config(module) for name, module in modules.items()},
                "dtypes": {name: str(floating_dtype(module)) for name, module in modules.items()},
                "others": {name: _identity_of(value) for name, value in model.pipe.components.items()
                           if name not in modules},
                "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__,
                             "transformers": transformers.__version__}}

    def _recorded_call(self, pipeline, task: str, probe: Probe, modules: Mapping[str, torch.nn.Module]) -> list:
        first_error = None
        for arguments in self._probe_calls(probe, task, pipeline):
            with recording(modules) as calls:
                try:
                    with torch.no_grad():
                        pipeline(**arguments)
                except Exception as error:  # the pipeline's own failure, whatever it is: the next form of the call
                    first_error = first_error or error
                    continue
            return list(calls)
        raise NotCompilable(
            f"{self.title}: its {task} pipeline ({self.pipelines[task]}) failed when kasoku ran it to record its "
            f"calls ({probe.batch} image(s) of {probe.height}x{probe.width}): {_cause(first_error)}") from first_error

    def _probe_calls(self, probe: Probe, task: str, pipeline) -> Iterator[dict[str, Any]]:
        """The call at `probe`, then for several images the other forms diffusers pipelines take them in: an image
        (and mask) per prompt (DeepFloyd IF's img2img), or one prompt and `num_images_per_prompt` (DreamLite takes
        one prompt only)."""
        arguments = self.probe_arguments(probe, task, pipeline=pipeline)
        yield arguments
        if probe.batch == 1:
            return
        if "image" in arguments:
            yield {**arguments, **{name: [arguments[name]] * probe.batch for name in ("image", "mask_image")
                                   if name in arguments}}
        if "num_images_per_prompt" in inspect.signature(type(pipeline).__call__).parameters:
            one = {name: value[0] for name, value in arguments.items()
                   if name in ("prompt", "negative_prompt") and isinstance(value, list)}
            yield {**arguments, **one, "num_images_per_prompt": probe.batch}

    def pixel_multiple(self, model: ModelView) -> int:
        """The step of the image sizes: the VAE's scale times two (diffusion transformers patch or pack 2x2 latent
        cells per token), doubled while the pipeline refuses the first probe's size before calling any component
        (Sana's sizes are multiples of 32 whatever its VAE)."""
        memo = model.memo
        if "pixel_multiple" not in memo:
            multiple = self.vae_scale(model) * 2
            pipeline = self.task_pipeline(model.pipe, "txt2img" if "txt2img" in self.pipelines else
                                          next(iter(self.pipelines)))
            while multiple < 128 and self._refuses_size(pipeline, multiple):
                multiple *= 2
            memo["pixel_multiple"] = multiple
        return memo["pixel_multiple"]

    def _refuses_size(self, pipeline, multiple: int) -> bool:
        """Whether the pipeline refuses a call at the first probe's size before it calls any component (its own
        input checks come first: this costs no compute)."""
        check = getattr(pipeline, "check_inputs", None)
        if check is None:
            return False
        probe = probes(multiple, False, None)[0]
        parameters = inspect.signature(check).parameters
        arguments = {"prompt": PROMPTS[0], "height": probe.height, "width": probe.width}
        try:
            check(**{name: value for name, value in arguments.items() if name in parameters},
                  **{name: None for name, p in parameters.items() if name not in arguments and
                     p.default is inspect.Parameter.empty and name != "self"})
        except ValueError as error:
            return "divisible" in str(error) or "multiple" in str(error)
        except Exception:  # a check that needs what we did not give: not a size refusal
            return False
        return False

    def text_tokens(self, profile: ShapeProfile) -> int | None:
        """None: recorded graphs take the text tokens asked for as an axis, and no call is given a default (the
        profile's only choose the optimum a graph of one shape is recorded at)."""
        return None

    def max_tokens(self) -> int:
        default = self.parameters.get("max_sequence_length")
        value = default.default if default is not None else None
        return value if isinstance(value, int) else DEFAULT_MAX_TOKENS

    def signatures(self, model: ModelView) -> dict[str, list[Signature]]:
        """Attribute -> the signatures of its calls that can become graphs (see :meth:`in_torch` for the rest)."""
        memo = model.memo
        if "signatures" not in memo:
            found, kept = {}, {}
            recordings = self.record(model)
            for attribute in self._called(recordings):
                try:
                    every = recorded.signatures(recordings, attribute, max_tokens=self.max_tokens())
                except UncompilableCall as error:
                    kept[attribute] = str(error)
                    continue
                found[attribute] = every
            memo["signatures"], memo["in_torch"] = found, kept
        return memo["signatures"]

    def in_torch(self, model: ModelView) -> dict[str, str]:
        """Component (or module) -> why its calls stay in torch: known from the recordings, or from a build."""
        self.signatures(model)
        return dict(model.memo["in_torch"])

    def keep_in_torch(self, model: ModelView, reasons: Mapping[str, str]) -> None:
        self.signatures(model)
        model.memo["in_torch"].update(reasons)

    def at_one_shape(self, model: ModelView, reasons: Mapping[str, str]) -> None:
        """Remember the components whose engine takes one shape since their dynamic graph failed (`reasons`)."""
        model.memo.setdefault("one_shape", {}).update(reasons)

    def one_shape(self, model: ModelView) -> dict[str, str]:
        """Component -> why its engine takes one shape (the call recorded at the profile's optimum)."""
        return dict(model.memo.get("one_shape", {}))

    def grows_by_shape(self, model: ModelView) -> tuple[str, ...]:
        return tuple(model.memo.get("grown_specs", {}))

    # ---- graphs of one shape -------------------------------------------------------------------------

    def optimum_probe(self, profile: ShapeProfile) -> Probe:
        """The call at the profile's optimum: its images and size, the text tokens asked for (the profile's, else the
        pipeline's default) and guidance (the profile's, else what a call with the pipeline's defaults does)."""
        opt, tokens = profile.opt, None
        if "max_sequence_length" in self.parameters:
            tokens = profile.text_tokens or self.max_tokens()
        guided = profile.guidance if profile.guidance is not None else self._guided_by_default()
        return Probe(opt.batch, opt.height, opt.width, tokens, guided)

    def _guided_by_default(self) -> bool:
        # true CFG (Qwen-Image's) needs a negative prompt, which a call with the defaults does not give
        default = self.parameters.get("guidance_scale")
        value = default.default if default is not None and "true_cfg_scale" not in self.parameters else None
        return isinstance(value, (int, float)) and value > 1

    def recordings_at(self, model: ModelView, probe: Probe, tasks: tuple[str, ...], *, blocks: bool = False
                      ) -> list[Recording]:
        """The pipeline's calls at one probe, for `tasks`, with two prompts of their own: what differs between them
        follows the prompt, not the shape (kept on the model per probe and tasks); of the blocks with `blocks`."""
        memo = model.memo.setdefault("block_recordings_at" if blocks else "recordings_at", {})
        if (probe, tasks) not in memo:
            memo[probe, tasks] = self._recordings(
                model, lambda task: (probe, dataclasses.replace(probe, prompt=1)) if task in tasks else (),
                blocks=blocks)
        return memo[probe, tasks]

    def _task_groups(self) -> list[tuple[str, ...]]:
        """The tasks a graph of one shape is looked for in, in turn: text-to-image first, whose calls most compiles
        ask for, then the others (at full size each task recorded is whole pipeline runs: Flux.2 klein 4B's img2img
        and inpaint at 512x512 add minutes to a text-to-image compile)."""
        first = tuple(task for task in self.pipelines if task == "txt2img")
        rest = tuple(task for task in self.pipelines if task != "txt2img")
        return [group for group in (first, rest) if group]

    def signature_at(self, model: ModelView, signature: Signature, profile: ShapeProfile) -> Signature:
        """`signature`'s graph of one shape: its call pattern as recorded at the profile's optimum (twice, with two
        prompts: a dimension that follows the prompt's own length is a free axis, fixed per engine)."""
        probe = self.optimum_probe(profile)
        blocks = signature.attribute in self.block_paths(model)
        # the optimum as the profile calls it, then the other way where guidance is a choice (a call pattern of
        # calls without guidance: Lumina-Next passes other attention arguments then)
        shown = [probe] + ([dataclasses.replace(probe, guidance=not probe.guidance)]
                           if self.guided(model) is not None and profile.guidance is None else [])
        for at in shown:
            for tasks in self._task_groups():
                recordings = self.recordings_at(model, at, tasks, blocks=blocks)
                for found in recorded.signatures(recordings, signature.attribute, max_tokens=self.max_tokens()):
                    if found.pattern == signature.pattern:
                        found = found.following_the_size_as(signature)
                        model.memo.setdefault("signatures_at", {})[signature.component] = found
                        return found
        raise UncompilableCall(f"the pipeline does not call {signature.component} as it did at the probes when it "
                               f"makes {recorded.described_probe(probe)}: no graph of that one shape.")

    # ---- the blocks of a component kept in torch ------------------------------------------------------

    def kept_denoisers(self, model: ModelView) -> tuple[str, ...]:
        """The denoisers (the modules the pipeline calls each step) kept in torch whose blocks are compiled instead:
        set by :meth:`part_specs` once the compile knows which stayed in torch."""
        return tuple(model.memo.get("blocks_of", ()))

    def block_paths(self, model: ModelView) -> list[str]:
        """The blocks of :meth:`kept_denoisers`: every module of each of their block lists ("transformer.layers.0")."""
        modules = {attribute: model.ref(attribute).module for attribute in self.kept_denoisers(model)}
        return [f"{attribute}.{name}.{i}" for attribute, module in modules.items() for name in block_lists(module)
                for i in range(len(getattr(module, name)))]

    def part_specs(self, model: ModelView, profile: ShapeProfile, kept: Iterable[str],
                   step_cache: bool = False) -> dict[str, ComponentSpec]:
        """Where every call of the denoiser stays in torch (`kept`), its blocks' specs (cache-dit's pattern: a
        ModuleList of one class): its glue (the embeddings, masks, routing the whole graph failed on) stays in
        torch, the blocks it loops over run on engines. With `step_cache`, the blocks the first-block cache runs
        are built too (otherwise its first cached call builds them)."""
        kept = set(kept)
        attribute = self.denoiser_attribute(model)
        graphs = [s.component for s in self.signatures(model).get(attribute, ())]
        every_call_kept = attribute in kept or (graphs and all(name in kept for name in graphs))
        module = model.ref(attribute).module
        cached = step_cache and recorded.loop_size(module) >= 2
        if not (every_call_kept or cached) or not block_lists(module):
            return {}
        model.memo["blocks_of"] = (attribute,)
        return self.block_specs(model, profile)

    def block_signatures(self, model: ModelView) -> dict[str, list[Signature]]:
        """Block path -> the signatures of its calls, from the pipeline recorded at the probes with the blocks
        wrapped; a block whose calls cannot become a graph stays in torch (`in_torch` says why)."""
        memo = model.memo
        if "block_signatures" not in memo:
            takes_tokens = "max_sequence_length" in self.parameters
            recordings = self._recordings(model, lambda task: probes(
                self.pixel_multiple(model), takes_tokens, self.guided(model), tasks=task != "txt2img"), blocks=True)
            found = {}
            for path in self._called(recordings):
                try:
                    found[path] = recorded.signatures(recordings, path, max_tokens=self.max_tokens())
                except UncompilableCall as error:
                    self.keep_in_torch(model, {path: str(error)})
            memo["block_signatures"] = found
        return memo["block_signatures"]

    def block_specs(self, model: ModelView, profile: ShapeProfile) -> dict[str, ComponentSpec]:
        """The spec of every block call of :meth:`kept_denoisers` (as :meth:`specs` gives the components')."""
        found = {}
        for signatures in self.block_signatures(model).values():
            for signature in signatures:
                try:
                    found[signature.component] = self._spec(model, signature, profile)
                except UncompilableCall as error:
                    self.keep_in_torch(model, {signature.component: str(error)})
        return found

    @staticmethod
    def _called(recordings: Iterable[Recording]) -> list[str]:
        return list(dict.fromkeys(call.component for r in recordings for call in r.calls))

    # ---- components and specs ------------------------------------------------------------------------

    def component_names(self, model: ModelView | None = None) -> tuple[str, ...]:
        if model is None:
            return ()
        return tuple(s.component for signatures in self.signatures(model).values() for s in signatures)

    def denoiser_attribute(self, model: ModelView) -> str:
        """The module the denoising loop calls: the one called most often in the first recording, and of those
        the last to be called first (text encoders, called once per prompt, come before the loop)."""
        counts: dict[str, int] = {}
        first: dict[str, int] = {}
        for index, call in enumerate(self.record(model)[0].calls):
            counts[call.component] = counts.get(call.component, 0) + 1
            first.setdefault(call.component, index)
        return max(counts, key=lambda name: (counts[name], first[name]))

    @property
    def denoiser(self) -> str:  # type: ignore[override]
        return "transformer"

    def present_text_encoders(self, model: ModelView | None = None) -> tuple[TextEncoderSlot, ...]:
        if model is None:
            return ()
        return tuple(TextEncoderSlot(name, kind="recorded") for name in self.signatures(model)
                     if name.startswith("text_encoder"))

    @property
    def text_encoder_slots(self) -> tuple[TextEncoderSlot, ...]:  # type: ignore[override]
        return ()

    def tasks(self, model: ModelView) -> tuple[str, ...]:
        return tuple(self.pipelines)

    def task_components(self, task: str, model: ModelView | None = None) -> tuple[str, ...]:
        if model is None:
            return ()
        called = {(call.component, call.method) for r in self.record(model) if r.task == task for call in r.calls}
        kept = self.in_torch(model)
        return tuple(s.component for signatures in self.signatures(model).values() for s in signatures
                     if (s.attribute, s.method) in called and s.component not in kept)

    def specs(self, model: ModelView, profile: ShapeProfile, names: Iterable[str] | None,
              cache_branch: int = DEFAULT_BRANCH) -> dict[str, ComponentSpec]:
        if self.one_image(model):
            if profile.max.batch > 1:
                raise InvalidProfile(f"{self.title} makes one image per call: {self.one_image(model)}. Compile for "
                                     "one image (a profile's batch of 1, `--batch 1`).")
            note = f"{self.title} makes one image per call: {self.one_image(model)}"
            if note not in model.notes:
                model.notes.append(note)
        builders = self.spec_builders(model, profile, cache_branch)
        names = list(builders if names is None else names)
        absent = [n for n in names if n not in builders]
        if absent:
            raise KasokuError(f"this {self.title} model has no {', '.join(absent)}; "
                              f"its components are {', '.join(builders)}.")
        found = {}
        for name in names:
            try:
                found[name] = builders[name]()
            except UncompilableCall as error:  # a graph of one shape it needs and cannot have: it stays in torch
                self.keep_in_torch(model, {name: str(error)})
        return found

    def spec_builders(self, model: ModelView, profile: ShapeProfile,
                      cache_branch: int = DEFAULT_BRANCH) -> dict[str, Callable[[], ComponentSpec]]:
        builders = {}
        # what a compile learns of graphs of one shape is learnt anew by each
        model.memo["signatures_at"], model.memo["one_shape"] = {}, {}
        for signatures in self.signatures(model).values():
            for signature in signatures:
                builders[signature.component] = functools.partial(self._spec, model, signature, profile)
        return builders

    def _spec(self, model: ModelView, signature: Signature, profile: ShapeProfile) -> ComponentSpec:
        """A dynamic graph, which falls back to one of the profile's optimum; a graph of that one shape straight away
        where the profile has one shape, or where the call takes values that follow the image size as numbers."""
        ref = model.ref(signature.attribute)
        if signature.grows:  # seen at one shape only (Kandinsky 3's calls without guidance): one shape already
            return self._grown_spec(model, signature, profile)(signature.at_call())
        one_shape = functools.partial(self._spec_at_optimum, model, signature, profile)
        if signature.exact:
            self.at_one_shape(model, {signature.component: (
                "it takes values that follow the image size as Python numbers "
                f"({', '.join(signature.paths[i] for i, _ in signature.keyed)})")})
        if signature.exact or profile.is_static:
            return one_shape()
        return recorded.recorded_spec(signature, ref, profile, takes_lora=self._takes_lora(signature),
                                      one_shape=one_shape, calibration=self._calibration(model, signature))

    def _spec_at_optimum(self, model: ModelView, signature: Signature, profile: ShapeProfile) -> ComponentSpec:
        found = self.signature_at(model, signature, profile)
        return self._grown_spec(model, signature, profile)(found.at_call())

    def _grown_spec(self, model: ModelView, signature: Signature, profile: ShapeProfile
                    ) -> Callable[[Signature], ComponentSpec]:
        """The spec of `signature`'s graph of one shape at any call's shape (the compiled one: the recorded call's),
        kept on the model for the engines built later."""
        spec_of = functools.partial(recorded.recorded_spec, ref=model.ref(signature.attribute), profile=profile,
                                    takes_lora=self._takes_lora(signature),
                                    calibration=self._calibration(model, signature))
        model.memo.setdefault("grown_specs", {})[signature.component] = spec_of
        return spec_of

    def _calibration(self, model: ModelView, signature: Signature) -> dict[str, Any] | None:
        """For the denoiser's forward (its int8 engine's activations are calibrated, as a hand-written denoiser's):
        the calls of its pipeline it is calibrated on, at most CALIBRATION_STEPS steps (fewer where the pipeline's
        default is: Sana Sprint takes 2) and, where guidance does not double its batch (an embedded guidance
        scale), the pipeline's default scale. None for every other graph (their int8 is weights only)."""
        if signature.method != "forward" or signature.attribute != self.denoiser_attribute(model):
            return None
        found: dict[str, Any] = {}
        steps = self.parameters.get("num_inference_steps")
        if steps is not None and isinstance(steps.default, int) and steps.default > 0:
            found["steps"] = min(CALIBRATION_STEPS, steps.default)
        guidance = self.parameters.get("guidance_scale")
        if guidance is not None and isinstance(guidance.default, (int, float)) and \
                not self.doubles_batch({"guidance_scale": guidance.default}, model):
            found["guidance"] = float(guidance.default)
        return found

    def _takes_lora(self, signature: Signature) -> bool:
        """Whether diffusers' LoRA loader of the class changes the module this graph calls forward on."""
        return signature.method == "forward" and signature.attribute in self.lora_modules

    # ---- sizes ----------------------------------------------------------------------------------------

    def vae_scale(self, model: ModelView) -> int:
        value = getattr(model.pipe, "vae_scale_factor", None)
        return int(value) if isinstance(value, (int, float)) and value > 0 else 8

    def native_size(self, model: ModelView) -> int:
        default = self.parameters.get("height")
        if default is not None and isinstance(default.default, int):
            return default.default
        # diffusers' own default: the pipeline's default_sample_size, else its denoiser's sample_size (PixArt's),
        # in latent cells
        sample = getattr(model.pipe, "default_sample_size", None)
        if not isinstance(sample, int):
            config = getattr(getattr(model.pipe, "transformer", None) or getattr(model.pipe, "unet", None),
                             "config", None)
            sample = getattr(config, "sample_size", None)
        if isinstance(sample, int) and sample > 0:
            return sample * self.vae_scale(model)
        return 1024

    def default_profile(self, model: ModelView, max_batch: int = 4) -> ShapeProfile:
        """The native size's range, for 1..`max_batch` images, or one where the pipeline makes one per call."""
        if self.one_image(model):
            max_batch = 1
        return default_profile(self.native_size(model), self.pixel_multiple(model), max_batch)

    def one_image(self, model: ModelView) -> str | None:
        """Why the pipeline makes one image per call (its recording failed in diffusers for several), or None."""
        self.record(model)
        return model.memo.get("one_image")

    # ---- pipelines on engines ------------------------------------------------------------------------

    def pipelines_for(self, source: str | None = None, *, controlnet: bool = False) -> Mapping[str, str]:
        return self.pipelines

    def doubles_batch(self, kwargs: Mapping[str, Any], model: ModelView | None = None) -> bool:
        """Whether the denoiser sees twice the images: the recorded denoiser input has a guided axis and the call
        asks for guidance (diffusers' rule: a scale above 1)."""
        if model is None or "guidance_scale" not in self.parameters:
            return False
        guided = any(axis.min_scale is not None for s in self.signatures(model).get(
            self.denoiser_attribute(model), ()) for slot in s.inputs for axis in slot.tensor.dynamic_axes.values())
        return guided and super().doubles_batch(kwargs, model)

    def stand_ins(self, model: ModelView, engines: Mapping[str, Any], times: EngineTimes) -> dict[str, Any]:
        """Each module with an engine for any of its calls, as an :class:`EngineRecorded` (its other calls run the
        torch module, loaded with its weights); the others stay the torch modules."""
        replaced: dict[str, Any] = {}
        for attribute in self.modules(model):
            every = self.signatures(model).get(attribute, ())
            at_one_shape = model.memo.get("signatures_at", {})
            compiled = [at_one_shape.get(s.component, s) for s in every if s.component in engines]
            if compiled:
                torch_module = model.ref(attribute).load() if len(compiled) < len(every) or \
                    self._has_uncompiled_calls(model, attribute) else None
                replaced[attribute] = EngineRecorded(getattr(model.pipe, attribute), engines, times, compiled,
                                                     torch_module=torch_module, grow=self._grower(model))
            elif attribute in self.kept_denoisers(model):
                replaced[attribute] = self._with_engine_blocks(model, attribute, engines, times)
            elif attribute in self._called(self.record(model)):
                replaced[attribute] = model.ref(attribute).load()
        denoiser = self.denoiser_attribute(model)
        if denoiser in replaced:  # the user's own module (kept in torch) is left as it is: a copy runs the cache
            running = replaced[denoiser]
            replaced[denoiser] = recorded.with_step_cache(
                copy.copy(running) if running is getattr(model.pipe, denoiser) else running,
                blocks=self._first_block_loop(model, denoiser, engines, times))
        return replaced

    def _first_block_loop(self, model: ModelView, attribute: str, engines: Mapping[str, Any],
                          times: EngineTimes) -> Callable[[], recorded.FirstBlockLoop]:
        """What builds the first-block cache's loop over the denoiser's blocks, on the engines its blocks have by
        then (:meth:`step_cache_specs` builds them; a denoiser without two blocks to loop over was refused first)."""

        def build() -> recorded.FirstBlockLoop:
            running = self._with_engine_blocks(model, attribute, engines, times)
            return recorded.FirstBlockLoop(running, type(running).forward.__get__(running))

        return build

    def step_cache_graphs(self, model: ModelView, caching) -> tuple[str, ...]:
        """The first-block cache runs the denoiser's blocks on engines: their graphs (TaylorSeer needs none). A
        denoiser that is one engine has its blocks recorded for this only."""
        if caching.method != FIRST_BLOCK:
            return ()
        recorded.check_loop(model.ref(self.denoiser_attribute(model)).module)  # before any engine runs
        model.memo.setdefault("blocks_of", (self.denoiser_attribute(model),))
        kept = self.in_torch(model)
        return tuple(s.component for signatures in self.block_signatures(model).values() for s in signatures
                     if s.component not in kept)

    def step_cache_specs(self, model: ModelView, profile: ShapeProfile | None,
                         names: Iterable[str]) -> dict[str, ComponentSpec] | None:
        specs = self.block_specs(model, profile or model.default_profile())
        return {name: specs[name] for name in names if name in specs}

    def _with_engine_blocks(self, model: ModelView, attribute: str, engines: Mapping[str, Any],
                            times: EngineTimes) -> torch.nn.Module:
        """The torch module at `attribute` (a copy: the pipeline's own is left as it is) whose blocks with engines
        are :class:`EngineRecorded` stand-ins; its other modules, and its glue, run in torch."""
        module = model.ref(attribute).load()
        running = copy.copy(module)
        running._modules = dict(module._modules)  # its own children: its block lists are replaced below
        at_one_shape = model.memo.get("signatures_at", {})
        for name in block_lists(module):
            blocks = []
            for i, block in enumerate(getattr(module, name)):
                every = self.block_signatures(model).get(f"{attribute}.{name}.{i}", ())
                compiled = [at_one_shape.get(s.component, s) for s in every if s.component in engines]
                blocks.append(EngineRecorded(block, engines, times, compiled, grow=self._grower(model),
                                             torch_module=block if len(compiled) < len(every) else None)
                              if compiled else block)
            running._modules[name] = torch.nn.ModuleList(blocks)
        return running

    @staticmethod
    def _grower(model: ModelView) -> Callable[[Signature, list[Any]], Any] | None:
        """What builds the engine of a graph of one shape at a call's other shape: its spec at the call, built through
        the compile that built the rest (its backend and precision, the cache); None where no compile is at hand."""
        build, specs = model.memo.get("engine_builder"), model.memo.get("grown_specs", {})
        if build is None:
            return None

        def grow(signature: Signature, leaves: list[Any]):
            fixed = signature.at_call(leaves)
            module = recorded.RecordedCallModule(model.ref(signature.attribute).load(), fixed)
            with torch.no_grad():  # the outputs' shapes at this call: the module run once on its inputs
                outputs = module(*(slot.fed(leaves[slot.index]) for slot in fixed.inputs))
            return build(specs[signature.component](fixed.with_output_shapes([out.shape for out in outputs])))

        return grow

    def _has_uncompiled_calls(self, model: ModelView, attribute: str) -> bool:
        """Whether some recorded call of the module has no graph (a signature kept in torch)."""
        kept = self.in_torch(model)
        return attribute in kept or any(name.startswith(recorded.component_name(attribute, method))
                                        for name in kept for method in ("forward", "decode", "encode"))

    def denoiser_stand_ins(self, model: ModelView, engines: Mapping[str, Any], times: EngineTimes) -> dict[str, Any]:
        return {}

    # every denoiser forecasts its output (TaylorSeer); one with a block list also runs the first-block cache on its
    # blocks' engines
    cache_methods = (TAYLORSEER, FIRST_BLOCK)

    def step_cache_target(self, stand_ins: Mapping[str, Any], model: ModelView):
        """The denoiser's step-cached forward (see :func:`recorded.with_step_cache`), on an engine or on its blocks'."""
        denoiser = stand_ins.get(self.denoiser_attribute(model))
        forward = getattr(denoiser, "forward", None)
        return forward if isinstance(forward, recorded.StepCachedForward) else None

    @property
    def lora_modules(self) -> tuple[str, ...]:
        """The modules diffusers' LoRA loader of the class changes (its `_lora_loadable_modules`)."""
        return tuple(getattr(self.cls, "_lora_loadable_modules", ()))

    def lora_state_dict(self, source, model: ModelView, **kwargs):
        """diffusers' own reading of the file for this class; a module compiled as several graphs (one per call
        pattern) would take an adapter in one of them only, and is refused."""
        if not self.lora_modules or not hasattr(self.cls, "lora_state_dict"):
            raise KasokuError(f"{self.cls.__name__} has no LoRA loader in diffusers: no adapter can be loaded into it.")
        for attribute in self.lora_modules:
            graphs = [s.component for s in self.signatures(model).get(attribute, ()) if s.method == "forward"]
            if len(graphs) > 1:
                raise KasokuError(f"the {attribute} of this {self.title} pipeline runs as {len(graphs)} graphs (one "
                                f"per call pattern: {', '.join(graphs)}); kasoku loads LoRA into a module of one "
                                "graph only so far.")
        return super().lora_state_dict(source, model, **kwargs)

    def __repr__(self) -> str:
        return f"<generic family {self.title}>"


def _cause(error: BaseException | None) -> str:
    """An error as one line: its class and the first line of its message."""
    cause = error.__cause__ if isinstance(error, NotCompilable) and error.__cause__ is not None else error
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    return f"{type(cause).__name__}: {text}"


def block_lists(module: torch.nn.Module) -> list[str]:
    """The names of `module`'s block lists: its ModuleList children of modules of one class that attend (a
    transformer's `transformer_blocks`, `single_transformer_blocks`, `layers`; not a list of projections)."""
    return [name for name, child in module.named_children() if isinstance(child, torch.nn.ModuleList)
            and len(child) and len({type(block) for block in child}) == 1 and _attends(child[0])]


def _attends(block: torch.nn.Module) -> bool:
    return any("Attention" in type(part).__name__ for part in block.modules())
