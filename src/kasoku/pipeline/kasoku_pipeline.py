"""KasokuPipeline: diffusers' own recipes, with engines in place of torch, every input checked first.

The engines run under diffusers' own txt2img / img2img / inpaint pipelines of the model's family
(:mod:`kasoku.runtime.engine_pipelines`): call signature, schedulers, image processing, callbacks and outputs are
diffusers' own, and the same seed gives the same image. kasoku adds what an engine needs first: every
input is checked against the compiled profile before anything runs. :func:`compile` makes one: the
policies, then the build (:func:`kasoku.pipeline.compiling.compile_components`), then this object.

LoRA adapters keep diffusers' names (`load_lora_weights`, `set_adapters`, `disable_lora`,
`unload_lora_weights`, `fuse_lora`, ...) and rebind the engines' weights without re-export
(:mod:`kasoku.runtime.lora`).
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..architectures.ip_adapter import ADAPTER_PARTS, IMAGE_ENCODER, is_ip_input
from ..backends import Engine
from ..build.compiler import Compiler, CompileReport
from ..core.cache import Cache, default_cache_dir
from ..core.components import Precision, ShapeProfile
from ..core.errors import KasokuError
from ..core.options import FASTEST, CompileOptions, InvalidOptions
from ..core.schedulers import scheduler_named
from ..core.standins import EngineTimes, InvalidInput
from ..core.step_cache import StepCaching
from ..core.weights import bind_named_parts, named_parts
from ..model.pipeline_model import Model
from ..policies.recipes import with_recipe
from ..runtime.engine_pipelines import EnginePipelines
from ..runtime.image_prompts import IPAdapterError, load_into, set_scale, unload_from
from ..runtime.lora import AdapterWeight, LoraError, LoraState, read_adapter, weight_binding
from .checks import CallChecks, PromptTruncated, as_list, task_of
from .compiling import compile_components
from .signature import IgnoredArgument, applicable, ignored_arguments
from .surface import EngineNote, PipelineSurface, progress_bars_on

__all__ = ["KasokuPipeline", "compile", "InvalidInput", "EngineTimes", "EngineNote", "IgnoredArgument",
           "EnginesGrow"]


class EnginesGrow(UserWarning):
    """A call outside the engines' profile: engines for a profile that serves it too are built (or loaded)."""


# The per-call LoRA scale diffusers' pipelines read (`{"scale": s}`), by the name each family's call gives it.
ATTENTION_KWARGS = ("cross_attention_kwargs", "joint_attention_kwargs", "attention_kwargs")


class KasokuPipeline(PipelineSurface):
    """Stable Diffusion 1.x / 2.x / XL txt2img, img2img and inpaint on compiled engines.

    ``pipe(prompt)`` runs text-to-image; ``pipe(prompt, image=..., strength=...)`` image-to-image;
    ``pipe(prompt, image=..., mask_image=...)`` inpainting (9-channel inpainting U-Nets, and
    4-channel ones through diffusers' latent mask blending). Every other argument is diffusers'
    (for SDXL: prompt_2, negative_prompt_2, original_size, target_size, crops_coords_top_left, ...).

    Compiled with ControlNets (`controlnet=`), every task runs the family's ControlNet pipeline and takes
    ``control_image=`` (one image, or one per ControlNet) whatever the task, with diffusers'
    controlnet_conditioning_scale (a number, or one per ControlNet), guess_mode and
    control_guidance_start / control_guidance_end.

    Step caching (see kasoku.core.step_cache) is kasoku's own arguments, per call, off by default:
    - ``cache_interval=N`` on a U-Net runs DeepCache: the whole U-Net on one step in N (``cache_schedule=
      "uniform"``, or the paper's ``"nonuniform"`` spacing) and only its outer layers on the others;
    - ``cache_interval=N`` on a transformer (or ``cache_method="taylorseer"`` on any denoiser) runs TaylorSeer:
      after ``cache_warmup`` computed steps (3), one step in N is computed and the others forecast from them by
      a Taylor series up to ``cache_order`` (1), as diffusers' TaylorSeerCacheConfig;
    - ``cache_threshold=T`` on a transformer runs the first-block cache: the other blocks are skipped on a step
      whose first-block residual changed by at most T (relative) since the last step that ran them, as
      diffusers' FirstBlockCacheConfig (0: every step runs them).
    Engines grow with the calls: compiled without `profile=` (and without ``strict_shapes=True``), a call outside the
    profile (more images, another size, guidance or T5 tokens) first builds engines for a profile that serves the old
    range and the call (or loads them from the cache), says so in one line (:class:`EnginesGrow`), then runs.

    The object is diffusers' too (:class:`kasoku.pipeline.surface.PipelineSurface`): `components`, `config`, `dtype`,
    `device`, the component attributes, `to`, `progress_bar`, the memory-saving switches, `save_pretrained`, and
    diffusers' `from_pipe` of another task on the same engines. ``cross_attention_kwargs={"scale": s}`` (or
    `joint_attention_kwargs`) scales the active LoRA adapters for the call, as in diffusers.

    ``cache_interval=1`` without a threshold runs the plain denoiser engine, exactly as without it; on a pipeline
    compiled with ``recipe="fastest"`` such a call runs the recipe's step caching instead. The first
    call that needs step-cache graphs builds them (or loads them from the cache), unless the pipeline was
    compiled with ``step_cache=True``; ``last_step_cache`` is the last call's run (its skipped and forecast
    steps).
    """

    def __init__(self, model, engines: dict[str, Engine], profile: ShapeProfile,
                 report: CompileReport | None = None, *, options: CompileOptions | None = None,
                 cache_root: Path | None = None, label: str | None = None, cache=None, recipe=None,
                 grows: bool = False):
        self.model = Model.of(model, label=label)  # a live diffusers pipeline, or a Model
        # a call outside the profile builds engines that serve it (compiled with the default profile, not strict)
        self._grows = grows and options is not None and report is not None
        # a tuned recipe's exact-shape engines: its shape runs on them again after the engines grew for other shapes
        self._exact_profile = profile if self._grows and profile.is_static else None
        self.family = self.model.family
        self.controlnets = self.model.controlnets  # how many ControlNets steer it
        self.profile = profile
        self.last_step_cache = None  # the last call's step-cache run (kasoku.core.step_cache), None without one
        self.recipe = recipe  # the tuned recipe it runs (kasoku.policies.recipes.ChosenRecipe), None without one
        self.engines = engines  # the stand-ins read this dict on every call: rebinding weights swaps entries
        self.compile_report = report
        self.times = EngineTimes()
        self._options = options  # what compiled the engines (LoRA rebinds weights to the same graphs)
        self._cache_root = cache_root
        self._loras = LoraState()
        self._base_engines: dict[str, Engine] = {}  # the denoiser's engines without IP-Adapters
        self._bindings: dict | None = None
        self._label, self._cache = label, cache  # to build the step-cache engines later
        self._start_runtime()
        # `image` is the control image in diffusers' ControlNet text-to-image pipelines (as the class compiled says)
        self._image_is_control = bool(self.controlnets) and type(self.model.pipe) is \
            self.family.pipeline_class("txt2img", controlnet=True)
        self.__signature__ = self.checks.signature  # diffusers' own (inspect.signature(pipe) shows it)

    # ---- construction --------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path_or_id, backend: str | None = None, *, controlnet=None, tiny_vae=None,
                        options: CompileOptions | None = None, on_stage=None, torch_dtype=None, dtype=None,
                        **fields) -> KasokuPipeline:
        """Load a diffusers folder (or hub id when online) and compile it (from the cache when built).

        `controlnet`: ControlNet folders or models (one, or a list for several), run with the family's
        ControlNet pipelines. `tiny_vae`: an AutoencoderTiny (TAESD) or its folder in place of the VAE. The
        torch weights are read only for components whose engines are not in the cache yet. `torch_dtype` (or
        diffusers' newer `dtype`): the dtype the weights are read in, float32 (the default) or bfloat16: a
        pipeline compiled from recorded calls then builds bf16 graphs at half the memory (the newest families at
        full size); the hand-written families compile from float32 whatever it is."""
        model = Model.load(path_or_id, lazy=True, controlnet=controlnet, tiny_vae=tiny_vae, label=str(path_or_id),
                           torch_dtype=loading_dtype(torch_dtype, dtype))
        return compile(model, backend, options=options, on_stage=on_stage, label=str(path_or_id), **fields)

    # ---- the diffusers surface -----------------------------------------------------------------

    @property
    def scheduler(self):
        return self._pipes["txt2img"].scheduler

    @scheduler.setter
    def scheduler(self, scheduler) -> None:
        for pipe in self._pipes.values():
            pipe.scheduler = scheduler

    def set_scheduler(self, name: str) -> None:
        """Swap the scheduler by short name (see SCHEDULERS), keeping the model's config."""
        self.scheduler = scheduler_named(name, self.scheduler)

    @property
    def tokenizer(self):
        return self.model.pipe.tokenizer

    @property
    def vae_scale_factor(self) -> int:
        return self._pipes["txt2img"].vae_scale_factor

    def task(self, image=None, mask_image=None) -> str:
        return task_of(image, mask_image)

    def __call__(self, *args, **kwargs):
        """diffusers' call, in the signature of the class it was compiled from (`inspect.signature(pipe)`,
        positional arguments in its order): txt2img, or img2img with `image`, or inpaint with `image` and
        `mask_image`; with ControlNets, `control_image` in every task (`image` in diffusers' ControlNet
        text-to-image classes); with step caching where `cache_interval` > 1 (see the class docstring)."""
        kwargs = self._by_name(args, kwargs)
        prompt = kwargs.pop("prompt", None)
        image, mask_image, control_image = (kwargs.pop(name, None) for name in ("image", "mask_image",
                                                                                 "control_image"))
        caching_arguments = {name: kwargs.pop(name) for name in StepCaching.ARGUMENTS if name in kwargs}
        if self._image_is_control and control_image is None and mask_image is None:
            image, control_image = None, image  # diffusers' meaning in this class
        task = self.task(image, mask_image)
        self._check_task(task, image)
        owner = self.model.pipeline_class(task)
        for name in ignored_arguments(task, owner, kwargs):
            warnings.warn(f"`{name}` is ignored in {task}: {owner.__name__} takes the size of `image`, as diffusers "
                          "does.", IgnoredArgument, stacklevel=2)
            kwargs.pop(name)
        self._scale_loras(kwargs)
        wanted = self.check_inputs(task, prompt, image, mask_image, control_image=control_image, **caching_arguments,
                                   **kwargs)
        if wanted is not None:
            self._grow(wanted)
            self.check_inputs(task, prompt, image, mask_image, control_image=control_image, **caching_arguments,
                              **kwargs)
        for note in self.checks.truncation_notes(prompt, kwargs):
            warnings.warn(note, PromptTruncated, stacklevel=2)
        if task != "txt2img":
            kwargs["image"] = image
        if task == "inpaint":
            kwargs["mask_image"] = mask_image
        if self.controlnets:
            kwargs.update(self.family.control_arguments(task, control_image))
            kwargs.update(self._control_scales(kwargs))
        kwargs.update(self.checks.defaults(kwargs))
        kwargs = applicable(self.model.pipeline_class(task), kwargs)
        caching = self.checks.step_caching(caching_arguments)
        if self.recipe is not None and not caching.active:  # the recipe's, unless the call turns on its own
            caching = self.checks.step_caching(self.recipe.call_arguments)
        run = None
        if caching.active:
            self.enable_step_cache(self.family.step_cache_graphs(self.model, caching))
            run = self._runtime.step_cache_run(task, caching)
        self.last_step_cache = run
        return self._runtime(task, step_cache=run, prompt=prompt, **kwargs)

    def _check_task(self, task: str, image) -> None:
        """A call whose images make it a task the model has no diffusers class for (Flux.2 klein's own `image`, its
        reference images, is not img2img) is refused in one line."""
        if task in self.model.pipeline_tasks:
            return
        hint = (f"; a text given by position is `image` here ({type(self.model.pipe).__name__}'s first parameter): "
                "give it as prompt=..." if isinstance(image, str) else "")
        raise InvalidInput(f"{self.family.title} has no {task} pipeline in diffusers, and kasoku does not run its "
                           f"class's own `image` input: call it without `image`{hint}.")

    def _by_name(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Positional arguments named as the signature orders them (diffusers' class's own order)."""
        positional = [p.name for p in self.__signature__.parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(args) > len(positional):
            raise InvalidInput(f"this pipeline takes at most {len(positional)} positional arguments "
                               f"({', '.join(positional)}) but {len(args)} were given; name the others.")
        for name, value in zip(positional, args):
            if name in kwargs:
                raise InvalidInput(f"`{name}` is given twice: by position and by name.")
            kwargs[name] = value
        return kwargs

    def _control_scales(self, kwargs) -> dict[str, Any]:
        """controlnet_conditioning_scale as diffusers takes it: a float for one ControlNet (not an int, nor a
        list of one), a float or a list of floats for several. Not given, it stays the pipeline's default
        (1.0 for text-to-image, 0.8 for diffusers' ControlNet image-to-image)."""
        scale = kwargs.get("controlnet_conditioning_scale")
        if scale is None:
            return {}
        if self.controlnets == 1:
            return {"controlnet_conditioning_scale": float(as_list(scale)[0])}
        return {"controlnet_conditioning_scale": [float(s) for s in scale] if isinstance(scale, (list, tuple))
                else float(scale)}

    def enable_step_cache(self, names: tuple[str, ...] | None = None, on_stage=None) -> None:
        """Load step-cache engines of this pipeline's denoiser (`names`; default: every graph of its family's
        methods, as U-Nets' unet_full and unet_shallow, transformers' transformer_first and transformer_rest), on
        its backend and in its precision; built first when the cache does not hold them."""
        names = self.family.step_cache_components if names is None else names
        missing = [name for name in names if name not in self.engines]
        if not missing:
            return
        if self._options is None:
            raise InvalidInput(f"step caching needs the {' and '.join(names)} engines; compile with "
                               "step_cache=True (kasoku.compile(..., step_cache=True)).")
        denoiser = self._denoiser_engine()
        options = self._options.replace(components=tuple(missing), step_cache=False, backend=denoiser.backend,
                                        precision=denoiser.precision)
        specs = self.family.step_cache_specs(self.model, self._options.profile, missing)  # a recorded family's blocks
        engines, report = compile_components(self.model, options, cache=self._cache, label=self._label, specs=specs,
                                             **({"on_stage": on_stage} if on_stage else {}))
        self.engines.update(engines)
        if self.compile_report is not None:
            self.compile_report.merge(report)

    def _denoiser_engine(self):
        """An engine of the denoiser (its backend and precision are the step-cache graphs'): the family's denoiser
        component, or for a recorded family any graph of its denoiser's module (a call pattern, a block)."""
        name = self.family.denoiser
        if name in self.engines or not self.family.generic:
            return self.engines[name]
        attribute = self.family.denoiser_attribute(self.model)
        return next(engine for component, engine in self.engines.items()
                    if component == attribute or component.startswith((f"{attribute}.", f"{attribute}_")))

    # ---- checks first --------------------------------------------------------------------------

    def check_inputs(self, task: str, prompt, image, mask_image, control_image=None, **kwargs) -> ShapeProfile | None:
        """Everything an engine cannot serve, as one clear error before anything runs (kasoku.pipeline.checks); step
        caching's arguments are among `kwargs`. Where the engines grow, a call outside the profile passes, and the
        profile that serves it is returned (None: these engines serve it)."""
        return self.checks.check(task, prompt, image, mask_image, control_image=control_image, **kwargs)

    # ---- engines that grow with the calls ----------------------------------------------------------------

    def _grow(self, profile: ShapeProfile) -> None:
        """Engines for `profile` in place of these: the same components, backends and precisions, built (or loaded)
        through the cache as the first ones were; LoRA adapters, IP-Adapters and the scheduler kept. Step-cache
        engines are built again at their next cached call."""
        report = self.compile_report
        if profile == self._exact_profile:
            warnings.warn(f"this call is the tuned shape ({_ranges(profile)}): its exact-shape engines again, from the "
                          f"cache, in place of the engines for {_ranges(self.profile)}.", EnginesGrow, stacklevel=3)
        else:
            seconds = _build_seconds(report)
            took = f"about {seconds:.0f} s, as the first build took" if seconds >= 1 else \
                "the first engines came from the cache: how long a build takes is not known here"
            warnings.warn(f"this call is outside the engines' profile ({_ranges(self.profile)}): building engines for "
                          f"{_ranges(profile)} ({took}; the cache keeps them for later calls).", EnginesGrow,
                          stacklevel=3)
        options = self._options.replace(profile=profile)
        if options.backend == "auto":  # what auto chose, so that growing does not measure the backends again
            options = options.replace(backend={n: b for n, b in report.backends.items() if n not in report.in_torch})
        if options.precision == FASTEST:
            options = options.replace(precision={c: Precision(p) for c, p in report.precisions.items()})
        hook = {"on_stage": python_stages} if self.shows_progress else {}
        # the old engines go first: a full-size model cannot hold two engine sets and a build at once
        self.engines.clear()
        self._base_engines.clear()
        self._bindings = None
        gc.collect()
        try:
            engines, grown = compile_components(self.model, options, cache=self._cache, label=self._label, **hook)
        except BaseException:  # the engines of the old profile again, from the cache, before the error goes on
            self.engines.update(compile_components(self.model, self._options, cache=self._cache, label=self._label,
                                                   backend=options.backend, precision=options.precision)[0])
            self._after_new_engines()
            raise
        self.engines.update(engines)
        if profile != self._exact_profile and self.profile == self._exact_profile:
            report.notes.append(f"engines grown for calls outside the tuned shape ({_ranges(self.profile)}): "
                                f"{_ranges(profile)}; the tuned shape runs on its exact-shape engines")
        elif profile != self._exact_profile:
            report.notes.append(f"engines grown for a call outside {_ranges(self.profile)}: {_ranges(profile)}")
        report.merge(grown)
        report.profile = profile.to_dict()
        self.profile, self._options = profile, self._options.replace(profile=profile)
        self._after_new_engines()

    def _scale_loras(self, kwargs: dict[str, Any]) -> None:
        """diffusers' per-call LoRA scale, `{"scale": s}` in the call's attention kwargs: the active adapters at their
        weights x s for this call (taken out of the kwargs the engines see)."""
        scale = 1.0
        for name in ATTENTION_KWARGS:
            given = kwargs.get(name)
            if isinstance(given, Mapping) and "scale" in given:
                given = dict(given)
                value = given.pop("scale")
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise InvalidInput(f"`{name}['scale']` (the LoRA scale) must be a number but is {value!r}.")
                scale = float(value)
                kwargs[name] = given or None
        if scale != self._loras.call_scale:
            self._loras.call_scale = scale
            if self._loras.adapters:
                self._apply_loras()

    @property
    def fixed_arguments(self) -> dict[str, Any]:
        """The call arguments the engines fix, with their values: the T5 tokens they were compiled for
        (`max_sequence_length`; diffusers' default may be another). A diffusers pipeline compared with this one
        takes them too."""
        return self.checks.fixed_arguments

    # ---- LoRA adapters: diffusers' names, weights rebound without re-export ------------------------

    def load_lora_weights(self, pretrained_model_name_or_path_or_dict, adapter_name: str | None = None,
                          **kwargs) -> None:
        """Load a LoRA adapter (a diffusers, kohya or PEFT file, its folder, or a state dict) and make it the
        active one, as diffusers does; `kwargs` go to diffusers' `lora_state_dict` (weight_name, ...)."""
        bindings = self._weight_bindings()
        name = adapter_name or self._loras.next_name()
        self._loras.check_new(name)  # before reading the file
        adapter = read_adapter(pretrained_model_name_or_path_or_dict, name, self.model,
                               {c: b.graph_weights for c, b in bindings.items()}, **kwargs)
        self._loras.add(adapter)
        self._apply_loras()

    def set_adapters(self, adapter_names: str | Sequence[str],
                     adapter_weights: AdapterWeight | Sequence[AdapterWeight | None] | None = None) -> None:
        """Activate these adapters, each at its weight (a number, or one per component such as
        {"unet": 0.5, "text_encoder": 1.0}; default 1.0)."""
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        if adapter_weights is None or isinstance(adapter_weights, (int, float, Mapping)):
            weights = [adapter_weights] * len(names)
        else:
            weights = list(adapter_weights)
            if len(weights) != len(names):
                raise LoraError(f"`adapter_weights` must give one weight per adapter: {len(names)} adapter(s) but "
                                f"{len(weights)} weight(s).")
        self._loras.set_active(names, weights)
        self._apply_loras()

    def disable_lora(self) -> None:
        """Run without the active adapters (fused ones stay part of the weights); `enable_lora` turns them on."""
        self._loras.enabled = False
        self._apply_loras()

    def enable_lora(self) -> None:
        self._loras.enabled = True
        self._apply_loras()

    def unload_lora_weights(self) -> None:
        """Forget every adapter: the engines run exactly their base weights again (fused adapters stay part of
        the weights, as in diffusers; `unfuse_lora` removes them)."""
        self._loras.delete(list(self._loras.adapters))
        self._apply_loras()

    def delete_adapters(self, adapter_names: str | Sequence[str]) -> None:
        self._loras.delete([adapter_names] if isinstance(adapter_names, str) else list(adapter_names))
        self._apply_loras()

    def fuse_lora(self, components: Sequence[str] | None = None, lora_scale: float = 1.0,
                  adapter_names: Sequence[str] | None = None, **kwargs) -> None:
        """Make the active adapters (or `adapter_names`) part of the weights of `components` (default: every
        component adapters change) at `lora_scale`; they stay so after `unload_lora_weights`."""
        components = list(components or self.lora_components)
        self._check_lora_components(components)
        self._loras.fuse(components, float(lora_scale), adapter_names)
        self._apply_loras()

    def unfuse_lora(self, components: Sequence[str] | None = None, **kwargs) -> None:
        """Remove fused adapters from `components`: their base weights exactly, as kept (no subtraction)."""
        components = list(components or self.lora_components)
        self._check_lora_components(components)
        self._loras.unfuse(components)
        self._apply_loras()

    def get_active_adapters(self) -> list[str]:
        return list(self._loras.active) if self._loras.enabled else []

    def get_list_adapters(self) -> dict[str, list[str]]:
        """Per component, the adapters that change it."""
        return {c: [n for n, a in self._loras.adapters.items() if c in a.layers] for c in self.lora_components}

    @property
    def lora_components(self) -> tuple[str, ...]:
        """The compiled components LoRA adapters change (the U-Net and the text encoders)."""
        return tuple(name for name, engine in self.engines.items() if engine.spec.takes_lora)

    def _check_lora_components(self, components: Sequence[str]) -> None:
        unknown = [c for c in components if c not in self.lora_components]
        if unknown:
            raise LoraError(f"`components` must be among {', '.join(self.lora_components)} but include "
                            f"{', '.join(unknown)}.")

    def _apply_loras(self) -> None:
        for component, binding in self._weight_bindings().items():
            self.engines[component] = binding.apply(self._loras.contributions(component))

    def _weight_bindings(self) -> dict:
        """Per LoRA component, its weight binding (created on first use: graphs from the cache)."""
        if self._bindings is None:
            self._needs_options("LoRA adapters")
            report = self.compile_report
            options = self._options.replace(backend=dict(report.backends),
                                            precision={c: Precision(p) for c, p in report.precisions.items()})
            compiler = Compiler(Cache(self._cache_root), options, label=report.model)
            self._bindings = {name: weight_binding(compiler, self.engines[name].spec, report.backends[name],
                                                   self.engines[name]) for name in self.lora_components}
        return self._bindings

    # ---- IP-Adapters: diffusers' names, image prompts as engine inputs ------------------------------

    def load_ip_adapter(self, *args, **kwargs) -> None:
        """diffusers' `load_ip_adapter` with the arguments the model's diffusers pipeline takes (the U-Net
        pipelines': source, subfolder, weight_name, image_encoder_folder; Flux's: source, weight_name, subfolder,
        image_encoder_pretrained_model_name_or_path; one adapter, or lists for several): the plain and Plus kinds,
        with their image encoder; then the image encoder's engine and the denoiser's with image-prompt inputs
        (from the cache when built: a second adapter of the same kind and size builds no new graph). Calls then
        take `ip_adapter_image` (one image per adapter) or `ip_adapter_image_embeds`."""
        self._needs_options("IP-Adapters")
        load_into(self.model, *args, **kwargs)
        try:
            self._rebuild_for_image_prompts()
        except Exception:
            unload_from(self.model)
            self._rebuild_for_image_prompts()
            raise

    def set_ip_adapter_scale(self, scale) -> None:
        """diffusers' `set_ip_adapter_scale`: a number, one per adapter, or per block ({"down": {"block_2":
        [0.0, 1.0]}, "up": ...}); an input of the engines, so nothing is rebuilt."""
        set_scale(self.model, scale)

    def unload_ip_adapter(self) -> None:
        """diffusers' `unload_ip_adapter`: the base U-Net engine again (exactly its images) and no image encoder."""
        unload_from(self.model)
        self._rebuild_for_image_prompts()

    def prepare_ip_adapter_image_embeds(self, *args, **kwargs):
        """diffusers' own (with its family's arguments: the U-Net pipelines' take do_classifier_free_guidance,
        Flux's not), on the image encoder's engine: the `ip_adapter_image_embeds` a later call can take. The embeds,
        device and images per prompt default to none, the pipeline's device and one."""
        import inspect

        if not self.family.ip_adapters(self.model):
            raise IPAdapterError("no IP-Adapter is loaded; call load_ip_adapter(...) first.")
        method = self._pipes["txt2img"].prepare_ip_adapter_image_embeds
        try:
            bound = inspect.signature(method).bind_partial(*args, **kwargs)
        except TypeError as error:
            raise IPAdapterError(f"prepare_ip_adapter_image_embeds: {error}") from None
        arguments = {"ip_adapter_image_embeds": None, "num_images_per_prompt": 1, **bound.arguments}
        arguments["device"] = arguments.get("device") or self.device
        return method(**arguments)

    def _rebuild_for_image_prompts(self) -> None:
        """The engines the model's IP-Adapters (or their absence) need, then diffusers' pipelines over them. The
        base U-Net's engine is kept: unloading puts it back."""
        names = self.family.ip_adapter_components(self.model)
        denoiser = names[-1]
        if self._rebind_adapters(denoiser):
            return
        if self._bindings is not None and denoiser in self._bindings:
            # the engine set aside (or replaced) goes back to its base weights: a later binding takes the weights it
            # finds as the base
            self.engines[denoiser] = self._bindings[denoiser].apply([])
        current = self.engines[denoiser]
        adapters = self.family.ip_adapters(self.model)
        if not self._has_image_prompts(current):
            self._base_engines.setdefault(denoiser, current)
        self.engines.pop(IMAGE_ENCODER, None)
        if not adapters and denoiser in self._base_engines:
            self.engines[denoiser] = self._base_engines[denoiser]
        else:
            options = self._options.replace(components=names, step_cache=False,
                                            backend={name: current.backend for name in names},
                                            precision={name: current.precision for name in names})
            engines, report = compile_components(self.model, options, cache=self._cache, label=self._label)
            self.engines.update(engines)
            if self.compile_report is not None:
                self.compile_report.merge(report)
        self._restart_runtime()

    def _restart_runtime(self) -> None:
        """diffusers' pipelines again over engines that were replaced: LoRA adapters bound to the new engines'
        weights, the scheduler kept."""
        self._bindings = None  # LoRA binds the new engines' weights
        if self._loras.adapters:
            self._apply_loras()
        scheduler = self.scheduler
        self._start_runtime()
        self.scheduler = scheduler

    def _after_new_engines(self) -> None:
        """The runtime over a new engine set: IP-Adapters' engines built for it where adapters are loaded (which
        restarts the runtime too), else the runtime restarted."""
        if self.family.ip_adapters(self.model):
            self._rebuild_for_image_prompts()
        else:
            self._restart_runtime()

    def _start_runtime(self) -> None:
        """diffusers' pipelines on stand-ins over the engines, and the checks of their calls (again when IP-Adapters
        change which engines and diffusers components a call runs)."""
        self._runtime = EnginePipelines(self.model, self.engines, self.times)
        self._pipes = self._runtime.pipes
        for pipe in self._pipes.values():
            pipe.set_progress_bar_config(**self.__dict__.get("_progress_bar_config", {}))
        self.checks = CallChecks(self.model, self.profile, self.engines, scheduler=lambda: self.scheduler,
                                 can_build_step_cache=self._options is not None, grows=self._grows, python=True,
                                 exact=self._exact_profile)
        # the image encoder module the image_encoder engine was built from (a rebind keeps that engine)
        self._encoder_of_engines = getattr(self.model.pipe, IMAGE_ENCODER, None) if IMAGE_ENCODER in self.engines \
            else None

    def _rebind_adapters(self, denoiser: str) -> bool:
        """Adapters of the kinds and sizes the engines take, with the same image encoder: their weights bound into
        the current engine (it keeps them as inputs), nothing loaded or built. Not under LoRA, whose binding keeps
        the engine's weights as it found them."""
        current = self.engines.get(denoiser)
        encoder = getattr(self.model.pipe, IMAGE_ENCODER, None)
        if current is None or self._loras.adapters or encoder is None or encoder is not self._encoder_of_engines \
                or IMAGE_ENCODER not in self.engines:
            return False
        if not named_parts(current.bound, ADAPTER_PARTS) or not self.family.ip_adapters(self.model):
            return False
        spec = self.model.specs(self.profile, [denoiser])[denoiser]
        if spec.architecture != current.spec.architecture:
            return False
        bind_named_parts(current, spec.module, ADAPTER_PARTS)
        return True

    @staticmethod
    def _has_image_prompts(engine: Engine) -> bool:
        return any(is_ip_input(name) for name in engine.spec.input_names)

    def _needs_options(self, what: str) -> None:
        if self._options is None or self.compile_report is None:
            raise KasokuError(f"this KasokuPipeline was made from engines directly; {what} need one made by "
                              "kasoku.compile or KasokuPipeline.from_pretrained.")

    def __repr__(self) -> str:
        backends = {name: engine.backend for name, engine in self.engines.items()}
        return f"KasokuPipeline({self.family.title}, backends={backends}, profile={self.profile})"


def compile(
    pipe,
    backend: str | dict | None = None,
    *,
    controlnet=None,
    tiny_vae=None,
    options: CompileOptions | None = None,
    on_stage=None,
    label: str | None = None,
    cache=None,
    **fields: Any,
) -> KasokuPipeline:
    """A live diffusers Stable Diffusion 1.x / 2.x / XL pipeline in (txt2img, img2img or inpaint, with or
    without ControlNets, also one with xFormers attention processors), an accelerated KasokuPipeline out.

    `controlnet` (ControlNet folders or models, one or a list) adds ControlNets to a pipeline without them;
    `tiny_vae` (an AutoencoderTiny, TAESD, or its folder) runs in place of its VAE (`pipe` is left as it is).
    `options` is a :class:`CompileOptions`; its fields may also be given as keywords (backend,
    precision, profile, components, cache_dir, threads, step_cache, cache_branch, ...). ``recipe="fastest"``
    runs what `kasoku tune` recorded as fastest for this model and machine with images at least ``min_psnr`` dB
    from the fp32 engines' (its precision, step caching, VAE and shape). `pipe` may also be a
    :class:`kasoku.model.pipeline_model.Model` (what `KasokuPipeline.from_pretrained` hands it)."""
    model = _compiled_model(pipe, controlnet, tiny_vae, label)
    options = CompileOptions.of(options, backend=backend, **fields)
    grows = options.profile is None and not options.strict_shapes  # an explicit profile is a promise: strict
    root = cache.root if isinstance(cache, Cache) else Path(cache or options.cache_dir or default_cache_dir())
    model.remember_digests_under(root)  # before the first question that records a generic pipeline
    recipe = None
    if options.recipe is not None:
        if fields.get("precision") is not None:
            raise InvalidOptions(f"`recipe` ({options.recipe}) sets the precision; leave `precision` out, or compile "
                                 "without a recipe.")
        model, options, recipe = with_recipe(model, options, root)
    if options.profile is None:
        options = options.replace(profile=model.default_profile())
    on_stage = on_stage or (python_stages if progress_bars_on() else None)
    kwargs: dict[str, Any] = {"on_stage": on_stage} if on_stage else {}
    engines, report = compile_components(model, options, cache=cache, label=label, **kwargs)
    if recipe is not None:
        report.notes.insert(0, recipe.note)
    return KasokuPipeline(model, engines, options.profile, report, options=options, cache_root=root, label=label,
                          cache=cache, recipe=recipe, grows=grows)


def loading_dtype(torch_dtype=None, dtype=None):
    """The dtype `from_pretrained` reads weights in, from diffusers' two names for it; None: float32."""
    import torch

    if torch_dtype is not None and dtype is not None and torch_dtype != dtype:
        raise InvalidOptions(f"`torch_dtype` ({torch_dtype}) and `dtype` ({dtype}) disagree; give one.")
    chosen = dtype if dtype is not None else torch_dtype
    if isinstance(chosen, str):
        chosen = getattr(torch, chosen.removeprefix("torch."), chosen)
    if chosen is not None and chosen not in (torch.float32, torch.bfloat16):
        raise InvalidOptions(f"kasoku reads weights in torch.float32 or torch.bfloat16, not {chosen}; for fp16 "
                             "engines read them in float32 and compile with precision='fp16'.")
    return chosen


def python_stages(component: str, stage: str):
    """A compile's progress in Python: each stage that works (a cache hit shows none), as the CLI shows it."""
    from ..core.console import stage as console_stage

    return console_stage(f"kasoku: {component}: {stage}")


def _build_seconds(report: CompileReport) -> float:
    """What building these engines again takes: each component's export and engine build as first done (a stage
    reused from the cache keeps the seconds of its build; an engine reused kept none, and counts its load)."""
    seconds: dict[tuple[str, str], float] = {}
    for record in report.stages:
        if record.stage in ("export", "engine"):
            seconds[record.component, record.stage] = float(record.detail.get("export_seconds", record.seconds))
    return sum(seconds.values())


def _ranges(profile: ShapeProfile) -> str:
    """A profile in one phrase: `batch 1..4, height 32..256, width 32..128` (and its guidance and T5 tokens)."""
    text = ", ".join(f"{dim} {profile.range_text(dim)}" for dim in ("batch", "height", "width"))
    if profile.guidance is not None:
        text += ", with" + ("" if profile.guidance else "out") + " guidance"
    return text + (f", {profile.text_tokens} T5 tokens" if profile.text_tokens else "")


def _compiled_model(pipe, controlnet, tiny_vae, label: str | None) -> Model:
    """The model `compile` takes: a live diffusers pipeline or a Model (a path is refused with what to call)."""
    if isinstance(pipe, (str, Path)):
        raise InvalidInput(f"kasoku.compile takes a live diffusers pipeline; for the folder or hub id {str(pipe)!r} "
                           "use kasoku.KasokuPipeline.from_pretrained(PATH), which loads and compiles it.")
    model = Model.of(pipe, label=label)  # an unsupported pipeline fails here, naming the supported ones
    if controlnet is None and tiny_vae is None:
        return model
    return Model.load(model, controlnet=controlnet, tiny_vae=tiny_vae, label=model.label)
