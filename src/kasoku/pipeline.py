"""KasokuPipeline: diffusers' own recipes, with engines in place of torch, every input checked first.

The engines run under diffusers' own txt2img / img2img / inpaint pipelines of the model's family
(:mod:`kasoku.runtime`): call signature, schedulers, image processing, callbacks and outputs are
diffusers' own, and the same seed gives the same image. kasoku adds what an engine needs first: every
input is checked against the compiled profile before anything runs. :func:`compile` makes one: the
policies, then the build (:func:`kasoku.compiling.compile_components`), then this object.

LoRA adapters keep diffusers' names (`load_lora_weights`, `set_adapters`, `disable_lora`,
`unload_lora_weights`, `fuse_lora`, ...) and rebind the engines' weights without re-export
(:mod:`kasoku.lora`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .backends import Engine
from .build import Compiler, CompileReport
from .cache import Cache, default_cache_dir
from .compiling import compile_components
from .components import ImageShape, Precision, ShapeProfile
from .errors import KasokuError
from .families import family_only_arguments
from .lora import AdapterWeight, LoraError, LoraState, read_adapter, weight_binding
from .model import Model
from .options import CompileOptions
from .runtime import EnginePipelines
from .schedulers import SCHEDULERS, most_steps, schedulers_for
from .standins import EngineTimes, InvalidInput
from .step_cache import DEFAULT_SCHEDULE, InvalidStepCache, check_interval, check_schedule

__all__ = ["KasokuPipeline", "compile", "InvalidInput", "EngineTimes"]


def _image_size(image) -> tuple[int, int]:
    """(height, width) of a PIL image, array or tensor (or the first of a list)."""
    if isinstance(image, (list, tuple)):
        image = image[0]
    if hasattr(image, "size") and not callable(image.size):
        width, height = image.size
        return height, width
    shape = tuple(image.shape)
    if len(shape) == 4:
        shape = shape[1:]
    # CHW tensors or HWC arrays
    return (shape[1], shape[2]) if shape[0] in (1, 3, 4) and len(shape) == 3 else (shape[0], shape[1])


def check_size(height: int | None, width: int | None) -> None:
    """diffusers' rule for every Stable Diffusion pipeline (the VAE's 8x latent)."""
    if (height or 0) % 8 or (width or 0) % 8:
        raise InvalidInput(f"`height` and `width` have to be divisible by 8 but are {height} and {width}.")


def _is_count(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _image_count(image) -> int:
    """How many images: a list's length, a 4-D array's or tensor's first dimension, else one."""
    if isinstance(image, (list, tuple)):
        return len(image)
    shape = getattr(image, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) == 4 else 1


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _is_finite(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_control_images(per_net: list, prompts: int, height: int, width: int) -> None:
    """Each ControlNet's control images: one, or one per prompt, each of the generated image's size
    (diffusers would resize them, distorting a pose or an edge map drawn for another size)."""
    for index, images in enumerate(per_net):
        which = f" of ControlNet {index + 1}" if len(per_net) > 1 else ""
        count = _image_count(images)
        if count not in (1, prompts):
            raise InvalidInput(f"`control_image`{which} must be one image or one per prompt ({prompts}) but is "
                               f"{count} images.")
        for one in (_as_list(images) if isinstance(images, (list, tuple)) else [images]):
            if _image_size(one) != (height, width):
                got = "x".join(map(str, _image_size(one)))
                raise InvalidInput(f"`control_image`{which} is {got} (height x width) but the image is "
                                   f"{height}x{width}; give control images of the generated image's size.")


# diffusers' ControlNet call arguments (a pipeline without ControlNet refuses them).
CONTROL_ARGUMENTS = ("controlnet_conditioning_scale", "guess_mode", "control_guidance_start", "control_guidance_end")


class KasokuPipeline:
    """Stable Diffusion 1.x / 2.x / XL txt2img, img2img and inpaint on compiled engines.

    ``pipe(prompt)`` runs text-to-image; ``pipe(prompt, image=..., strength=...)`` image-to-image;
    ``pipe(prompt, image=..., mask_image=...)`` inpainting (9-channel inpainting U-Nets, and
    4-channel ones through diffusers' latent mask blending). Every other argument is diffusers'
    (for SDXL: prompt_2, negative_prompt_2, original_size, target_size, crops_coords_top_left, ...).

    Compiled with ControlNets (`controlnet=`), every task runs the family's ControlNet pipeline and takes
    ``control_image=`` (one image, or one per ControlNet) whatever the task, with diffusers'
    controlnet_conditioning_scale (a number, or one per ControlNet), guess_mode and
    control_guidance_start / control_guidance_end.

    Step caching (DeepCache, see kasoku.step_cache) is kasoku's own argument: ``cache_interval=N``
    runs the whole U-Net on one step in N (``cache_schedule="uniform"``, or the paper's
    ``"nonuniform"`` spacing) and only its outer layers on the others. It is off by default
    (``cache_interval=1``: every step runs the plain U-Net engine, exactly as without it); the first
    call that asks builds the step-cache engines (or loads them from the cache), unless the pipeline
    was compiled with ``step_cache=True``.
    """

    def __init__(self, model, engines: dict[str, Engine], profile: ShapeProfile,
                 report: CompileReport | None = None, *, options: CompileOptions | None = None,
                 cache_root: Path | None = None, label: str | None = None, cache=None):
        self.model = Model.of(model, label=label)  # a live diffusers pipeline, or a Model
        self.family = self.model.family
        self.controlnets = self.model.controlnets  # how many ControlNets steer it
        self.profile = profile
        self.engines = engines  # the stand-ins read this dict on every call: rebinding weights swaps entries
        self.compile_report = report
        self.times = EngineTimes()
        self._options = options  # what compiled the engines (LoRA rebinds weights to the same graphs)
        self._cache_root = cache_root
        self._loras = LoraState()
        self._bindings: dict | None = None
        self._label, self._cache = label, cache  # to build the step-cache engines later
        self._runtime = EnginePipelines(self.model, engines, self.times)
        self._pipes = self._runtime.pipes

    # ---- construction --------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path_or_id, backend: str | None = None, *, controlnet=None,
                        options: CompileOptions | None = None, on_stage=None, **fields) -> KasokuPipeline:
        """Load a diffusers folder (or hub id when online) and compile it (from the cache when built).

        `controlnet`: ControlNet folders or models (one, or a list for several), run with the family's
        ControlNet pipelines. The torch weights are read only for components whose engines are not in the
        cache yet."""
        model = Model.load(path_or_id, lazy=True, controlnet=controlnet, label=str(path_or_id))
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
        import diffusers

        fitting = schedulers_for(self.scheduler)
        if name not in SCHEDULERS:
            raise InvalidInput(f"unknown scheduler {name!r}; choose from {', '.join(fitting)}.")
        if name not in fitting:
            raise InvalidInput(f"scheduler {name!r} does not fit a model trained for {type(self.scheduler).__name__}'s "
                               f"kind of noise; choose from {', '.join(fitting)}.")
        self.scheduler = getattr(diffusers, SCHEDULERS[name]).from_config(self.scheduler.config)

    @property
    def tokenizer(self):
        return self.model.pipe.tokenizer

    @property
    def vae_scale_factor(self) -> int:
        return self._pipes["txt2img"].vae_scale_factor

    @property
    def device(self):
        return self._pipes["txt2img"].device

    def set_progress_bar_config(self, **kwargs) -> None:
        for pipe in self._pipes.values():
            pipe.set_progress_bar_config(**kwargs)

    def task(self, image=None, mask_image=None) -> str:
        if mask_image is not None:
            return "inpaint"
        return "img2img" if image is not None else "txt2img"

    def __call__(self, prompt=None, image=None, mask_image=None, control_image=None, *, cache_interval: int = 1,
                 cache_schedule: str = DEFAULT_SCHEDULE, **kwargs):
        """diffusers' call: txt2img, or img2img with `image`, or inpaint with `image` and `mask_image`;
        with ControlNets, `control_image` in every task; with step caching where `cache_interval` > 1 (see
        the class docstring)."""
        task = self.task(image, mask_image)
        self.check_inputs(task, prompt, image, mask_image, control_image=control_image, cache_interval=cache_interval,
                          cache_schedule=cache_schedule, **kwargs)
        if task != "txt2img":
            kwargs["image"] = image
        if task == "inpaint":
            kwargs["mask_image"] = mask_image
        if self.controlnets:
            kwargs.update(self.family.control_arguments(task, control_image))
            kwargs.update(self._control_scales(kwargs))
        kwargs.update(self._family_defaults(kwargs))
        run = None
        if cache_interval > 1:
            self.enable_step_cache()
            run = self._runtime.step_cache_run(task, cache_interval, cache_schedule)
        return self._runtime(task, step_cache=run, prompt=prompt, **kwargs)

    def _control_scales(self, kwargs) -> dict[str, Any]:
        """controlnet_conditioning_scale as diffusers takes it: a float for one ControlNet (not an int, nor a
        list of one), a float or a list of floats for several. Not given, it stays the pipeline's default
        (1.0 for text-to-image, 0.8 for diffusers' ControlNet image-to-image)."""
        scale = kwargs.get("controlnet_conditioning_scale")
        if scale is None:
            return {}
        if self.controlnets == 1:
            return {"controlnet_conditioning_scale": float(_as_list(scale)[0])}
        return {"controlnet_conditioning_scale": [float(s) for s in scale] if isinstance(scale, (list, tuple))
                else float(scale)}

    def enable_step_cache(self, on_stage=None) -> None:
        """Load the step-cache engines (unet_full, unet_shallow) of this pipeline's denoiser, on its
        backend and in its precision; built first when the cache does not hold them."""
        names = self.family.step_cache_components
        missing = [name for name in names if name not in self.engines]
        if not missing:
            return
        if self._options is None:
            raise InvalidInput(f"step caching needs the {' and '.join(names)} engines; compile with "
                               "step_cache=True (kasoku.compile(..., step_cache=True)).")
        denoiser = self.engines[self.family.denoiser]
        options = self._options.replace(components=tuple(missing), step_cache=False, backend=denoiser.backend,
                                        precision=denoiser.precision)
        engines, report = compile_components(self.model, options, cache=self._cache, label=self._label,
                                             **({"on_stage": on_stage} if on_stage else {}))
        self.engines.update(engines)
        if self.compile_report is not None:
            self.compile_report.merge(report)

    # ---- checks first --------------------------------------------------------------------------

    def check_inputs(self, task: str, prompt, image, mask_image, control_image=None, cache_interval: int = 1,
                     cache_schedule: str = DEFAULT_SCHEDULE, **kwargs) -> None:
        """Everything an engine cannot serve, as one clear error before anything runs."""
        if isinstance(prompt, list) and not prompt:
            raise InvalidInput("`prompt` is an empty list; give at least one prompt.")
        if prompt is None and kwargs.get("prompt_embeds") is None:
            raise InvalidInput("give a `prompt` (str or list of str).")
        self._check_steps(task, kwargs)
        self._check_step_cache(cache_interval, cache_schedule)
        if task == "inpaint":
            if image is None:
                raise InvalidInput("inpainting needs `image` as well as `mask_image`.")
            if _image_size(image) != _image_size(mask_image):
                raise InvalidInput(
                    f"`image` and `mask_image` must have the same size but are {_image_size(image)} and "
                    f"{_image_size(mask_image)} (height, width)."
                )
        per_net = self._control_images_per_net(control_image, kwargs)
        sized_by = image if task != "txt2img" else (per_net[0] if per_net else None)  # as diffusers derives it
        height, width = self._output_size(task, sized_by, kwargs.get("height"), kwargs.get("width"))
        prompts = 1 if isinstance(prompt, str) or prompt is None else len(prompt)
        self._check_control(per_net, prompts, height, width, kwargs)
        for name in ("prompt_2", "negative_prompt_2", "prompt_3", "negative_prompt_3"):
            second = kwargs.get(name)
            count = 1 if isinstance(second, str) else len(second or ())
            if second is not None and count != prompts:
                raise InvalidInput(f"`{name}` must give one text per prompt: {prompts} prompt(s) but {count} "
                                   f"{name}(s); pass a list of {prompts}.")
        per_prompt = kwargs.get("num_images_per_prompt")
        if per_prompt is not None and (not _is_count(per_prompt) or per_prompt < 1):
            raise InvalidInput(f"`num_images_per_prompt` must be a positive int but is {per_prompt!r}.")
        self.profile.check(ImageShape(batch=prompts * (per_prompt or 1), height=height, width=width))
        guided = self.family.doubles_batch(kwargs)  # classifier-free guidance: the family's rule
        if self.profile.guidance is not None and self.profile.guidance != guided:
            compiled = "with" if self.profile.guidance else "without"
            given = kwargs.get("guidance_scale", self.family.call_default("guidance_scale"))
            raise InvalidInput(f"these engines were compiled for calls {compiled} classifier-free guidance "
                               f"(exact-shape engines) but `guidance_scale` is {given}; "
                               "compile for this call (kasoku generate does) or a profile with guidance=None.")
        self._check_family_arguments(kwargs)
        self._check_text_tokens(kwargs)
        missing = [name for name in self.model.task_components(task) if name not in self.engines]
        if missing:
            raise InvalidInput(f"{task} needs the {', '.join(missing)} engine{'s' if len(missing) > 1 else ''}; "
                               f"compile with the {', '.join(missing)} component{'s' if len(missing) > 1 else ''}.")
        if task not in self.model.tasks:
            raise InvalidInput("this is an inpainting model (its U-Net also reads the mask): give `image` and "
                               "`mask_image`.")

    def _control_images_per_net(self, control_image, kwargs) -> list:
        """The control images of each ControlNet, as diffusers reads `control_image`: for one ControlNet, an
        image or a list of images (one, or one per prompt); for several, a list with one entry per ControlNet,
        or a list of such lists per prompt (diffusers' nested form). Empty without ControlNets."""
        n = self.controlnets
        if not n:
            given = [name for name in ("control_image", *CONTROL_ARGUMENTS)
                     if (control_image if name == "control_image" else kwargs.get(name)) is not None]
            if given:
                raise InvalidInput(f"`{given[0]}`: this pipeline has no ControlNet; compile one with `controlnet=` "
                                   "(kasoku.compile, KasokuPipeline.from_pretrained) or --controlnet.")
            return []
        wanted = "an image" if n == 1 else f"a list of {n} images, one per ControlNet"
        if control_image is None:
            raise InvalidInput(f"this pipeline runs {n} ControlNet{'s' if n > 1 else ''}: give `control_image` "
                               f"({wanted}).")
        if n == 1:
            return [control_image]
        if not isinstance(control_image, (list, tuple)):
            raise InvalidInput(f"`control_image` must be {wanted} for the {n} ControlNets but is one image.")
        if any(isinstance(entry, (list, tuple)) for entry in control_image):
            counts = sorted({len(_as_list(entry)) for entry in control_image})
            if counts != [n]:
                raise InvalidInput(f"`control_image` as a list per prompt must give {n} images in each (one per "
                                   f"ControlNet) but gives {', '.join(map(str, counts))}.")
            return [list(per_net) for per_net in zip(*control_image)]
        if len(control_image) != n:
            raise InvalidInput(f"`control_image` must be {wanted} but has {len(control_image)}.")
        return list(control_image)

    def _check_control(self, per_net: list, prompts: int, height: int, width: int, kwargs) -> None:
        """Control images as :func:`check_control_images` says; a scale and a guidance window per ControlNet,
        or one for all."""
        n = self.controlnets
        if not n:
            return
        check_control_images(per_net, prompts, height, width)
        for name, default in (("controlnet_conditioning_scale", 1.0), ("control_guidance_start", 0.0),
                              ("control_guidance_end", 1.0)):
            value = kwargs.get(name, default)
            values = _as_list(value)
            if isinstance(value, (list, tuple)) and len(values) != n:
                raise InvalidInput(f"`{name}` gives {len(values)} values for {n} ControlNet{'s' if n > 1 else ''}; "
                                   f"give one number for all, or a list of {n}.")
            if not all(_is_finite(v) for v in values):
                raise InvalidInput(f"`{name}` must be a finite number or a list of them but is {value!r}.")
        starts = _as_list(kwargs.get("control_guidance_start", 0.0))
        ends = _as_list(kwargs.get("control_guidance_end", 1.0))
        for start, end in zip(starts * (n if len(starts) == 1 else 1), ends * (n if len(ends) == 1 else 1)):
            if not 0.0 <= start < end <= 1.0:
                raise InvalidInput(f"`control_guidance_start` and `control_guidance_end` must satisfy 0 <= start < "
                                   f"end <= 1 but are {start} and {end}.")
        guess_mode = kwargs.get("guess_mode", False)
        if not isinstance(guess_mode, bool):
            raise InvalidInput(f"`guess_mode` must be True or False but is {guess_mode!r}.")

    def _check_steps(self, task: str, kwargs) -> None:
        steps = kwargs.get("num_inference_steps", 50)
        if not _is_count(steps) or steps < 1:
            raise InvalidInput(f"`num_inference_steps` must be a positive int but is {steps!r}.")
        limit = most_steps(self.scheduler)
        if steps > limit:
            trained = self.scheduler.config.num_train_timesteps
            raise InvalidInput(f"`num_inference_steps` must be at most {limit} for this scheduler "
                               f"({type(self.scheduler).__name__}, {trained} training steps) but is {steps}.")
        guidance = kwargs.get("guidance_scale")
        if guidance is not None and not (isinstance(guidance, numbers.Real) and math.isfinite(guidance)):
            raise InvalidInput(f"`guidance_scale` must be a finite number but is {guidance!r}.")
        strength = kwargs.get("strength")
        if strength is None:
            return
        if not isinstance(strength, numbers.Real) or not 0.0 <= float(strength) <= 1.0:
            raise InvalidInput(f"`strength` must be in [0, 1] but is {strength}.")
        if task != "txt2img" and int(steps * float(strength)) < 1:
            raise InvalidInput(f"`num_inference_steps` x `strength` must be at least 1 step of denoising but is "
                               f"{steps} x {strength}; raise either.")

    def _check_step_cache(self, interval, schedule) -> None:
        try:
            check_interval(interval)
            check_schedule(schedule)
        except InvalidStepCache as error:
            raise InvalidInput(str(error)) from None
        names = self.family.step_cache_components
        if interval > 1 and not names:
            raise InvalidInput(f"`cache_interval` {interval}: {self.family.title} pipelines have no step caching; "
                               "call with cache_interval=1.")
        if interval > 1 and self.controlnets:
            raise InvalidInput(f"`cache_interval` {interval}: step caching does not run with ControlNets (the "
                               "step-cache U-Net graphs take no ControlNet residuals); call with cache_interval=1.")
        if interval > 1 and self._options is None and not all(n in self.engines for n in names):
            raise InvalidInput(f"`cache_interval` {interval} needs the {' and '.join(names)} engines, which "
                               "this pipeline has not and cannot build; compile with step_cache=True.")

    def _output_size(self, task: str, image, height, width) -> tuple[int, int]:
        """The size the call generates, as diffusers derives it; checked to be positive and divisible by 8."""
        for name, value in (("height", height), ("width", width)):
            if value is not None and (not _is_count(value) or value <= 0):
                raise InvalidInput(f"`{name}` must be a positive int but is {value!r}.")
        if image is not None and (height is None or width is None):
            image_height, image_width = _image_size(image)
            if task != "inpaint":  # img2img's image, txt2img's control image: diffusers keeps its size rounded
                # down to multiples of 8
                height = height or image_height // 8 * 8
                width = width or image_width // 8 * 8
            else:
                height, width = height or image_height, width or image_width
        native = self.model.native_size
        height, width = height or native, width or native
        check_size(height, width)
        return int(height), int(width)

    def _check_text_tokens(self, kwargs) -> None:
        """A long-prompt encoder's engines read the profile's text tokens: `max_sequence_length` must be that."""
        compiled = self.family.text_tokens(self.profile)
        given = kwargs.get("max_sequence_length")
        if compiled is None or given is None or given == compiled:
            return
        raise InvalidInput(f"`max_sequence_length` is {given!r} but the engines were compiled for {compiled} T5 "
                           f"tokens; compile with that many (`ShapeProfile(..., text_tokens={given})`, "
                           f"`kasoku compile --text-tokens {given}`) or call without it.")

    @property
    def fixed_arguments(self) -> dict[str, Any]:
        """The call arguments the engines fix, with their values: the T5 tokens they were compiled for
        (`max_sequence_length`; diffusers' default may be another). A diffusers pipeline compared with this one
        takes them too."""
        compiled = self.family.text_tokens(self.profile)
        return {} if compiled is None else {"max_sequence_length": compiled}

    def _family_defaults(self, kwargs) -> dict[str, Any]:
        """What a call omits that the engines fix (see :attr:`fixed_arguments`)."""
        return {name: value for name, value in self.fixed_arguments.items() if name not in kwargs}

    def _check_family_arguments(self, kwargs) -> None:
        for name, owners in family_only_arguments().items():
            if kwargs.get(name) is not None and self.family not in owners:
                titles = ", ".join(f.title for f in owners[:-1]) + (" and " if len(owners) > 1 else "") + \
                    owners[-1].title
                raise InvalidInput(f"`{name}`: only {titles} pipelines take this argument; "
                                   f"this is a {self.family.title} model.")
        self.family.check_arguments(kwargs)

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
            if self._options is None or self.compile_report is None:
                raise KasokuError("this KasokuPipeline was made from engines directly; LoRA adapters need one made "
                                  "by kasoku.compile or KasokuPipeline.from_pretrained.")
            report = self.compile_report
            options = self._options.replace(backend=dict(report.backends),
                                            precision={c: Precision(p) for c, p in report.precisions.items()})
            compiler = Compiler(Cache(self._cache_root), options, label=report.model)
            self._bindings = {name: weight_binding(compiler, self.engines[name].spec, report.backends[name],
                                                   self.engines[name]) for name in self.lora_components}
        return self._bindings

    def __repr__(self) -> str:
        backends = {name: engine.backend for name, engine in self.engines.items()}
        return f"KasokuPipeline({self.family.title}, backends={backends}, profile={self.profile})"


def compile(
    pipe,
    backend: str | dict | None = None,
    *,
    controlnet=None,
    options: CompileOptions | None = None,
    on_stage=None,
    label: str | None = None,
    cache=None,
    **fields: Any,
) -> KasokuPipeline:
    """A live diffusers Stable Diffusion 1.x / 2.x / XL pipeline in (txt2img, img2img or inpaint, with or
    without ControlNets, also one with xFormers attention processors), an accelerated KasokuPipeline out.

    `controlnet` (ControlNet folders or models, one or a list) adds ControlNets to a pipeline without them.
    `options` is a :class:`CompileOptions`; its fields may also be given as keywords (backend,
    precision, profile, components, cache_dir, threads, step_cache, cache_branch, ...). `pipe` may also be a
    :class:`kasoku.model.Model` (what `KasokuPipeline.from_pretrained` hands it)."""
    model = _compiled_model(pipe, controlnet, label)
    options = CompileOptions.of(options, backend=backend, **fields)
    if options.profile is None:
        options = options.replace(profile=model.default_profile())
    kwargs: dict[str, Any] = {"on_stage": on_stage} if on_stage else {}
    engines, report = compile_components(model, options, cache=cache, label=label, **kwargs)
    root = cache.root if isinstance(cache, Cache) else Path(cache or options.cache_dir or default_cache_dir())
    return KasokuPipeline(model, engines, options.profile, report, options=options, cache_root=root, label=label,
                          cache=cache)


def _compiled_model(pipe, controlnet, label: str | None) -> Model:
    """The model `compile` takes: a live diffusers pipeline or a Model (a path is refused with what to call)."""
    if isinstance(pipe, (str, Path)):
        raise InvalidInput(f"kasoku.compile takes a live diffusers pipeline; for the folder or hub id {str(pipe)!r} "
                           "use kasoku.KasokuPipeline.from_pretrained(PATH), which loads and compiles it.")
    model = Model.of(pipe, label=label)  # an unsupported pipeline fails here, naming the supported ones
    return Model.load(model, controlnet=controlnet) if controlnet is not None else model
