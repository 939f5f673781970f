"""KasokuPipeline: diffusers' own Stable Diffusion recipes, with engines in place of torch.

The seed needed a custom pipeline per task (stable_diffusion_tensorrt_txt2img, ...). kasoku
does not re-write the recipe: the torch modules of a diffusers pipeline are replaced by
engine-backed stand-ins (the model family says which, see :mod:`kasoku.standins`), and diffusers'
own txt2img / img2img / inpaint pipelines of that family run unchanged on top of them. Call
signature, schedulers, image processing, callbacks and outputs are therefore diffusers' own, and
the same seed gives the same image. kasoku adds what an engine needs first: every input is
checked against the compiled profile before anything runs.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from .backends import Engine
from .build import CompileReport, compile_components
from .components import ImageShape, ShapeProfile, default_profile, native_size
from .families import TASKS, family_of, family_only_arguments
from .options import CompileOptions
from .schedulers import SCHEDULERS, most_steps
from .standins import EngineTimes, InvalidInput

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


class KasokuPipeline:
    """Stable Diffusion 1.x / 2.x / XL txt2img, img2img and inpaint on compiled engines.

    ``pipe(prompt)`` runs text-to-image; ``pipe(prompt, image=..., strength=...)`` image-to-image;
    ``pipe(prompt, image=..., mask_image=...)`` inpainting (9-channel inpainting U-Nets, and
    4-channel ones through diffusers' latent mask blending). Every other argument is diffusers'
    (for SDXL: prompt_2, negative_prompt_2, original_size, target_size, crops_coords_top_left, ...).
    """

    def __init__(self, diffusers_pipe, engines: dict[str, Engine], profile: ShapeProfile,
                 report: CompileReport | None = None):
        self.family = family_of(diffusers_pipe)
        self.profile = profile
        self.engines = engines
        self.compile_report = report
        self.times = EngineTimes()
        self._source = diffusers_pipe
        stand_ins = self.family.stand_ins(diffusers_pipe, engines, self.times)
        self._pipes = {task: self.family.task_pipeline(diffusers_pipe, task, **stand_ins) for task in TASKS}

    # ---- construction --------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path_or_id, backend: str | None = None, *, options: CompileOptions | None = None,
                        on_stage=None, **fields) -> KasokuPipeline:
        """Load a diffusers folder (or hub id when online) and compile it (from the cache when built).

        The torch weights are read only for components whose engines are not in the cache yet."""
        from .loading import load_pipeline

        return compile(load_pipeline(path_or_id, lazy=True), backend, options=options, on_stage=on_stage,
                       label=str(path_or_id), **fields)

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

        if name not in SCHEDULERS:
            raise InvalidInput(f"unknown scheduler {name!r}; choose from {', '.join(SCHEDULERS)}.")
        self.scheduler = getattr(diffusers, SCHEDULERS[name]).from_config(self.scheduler.config)

    @property
    def tokenizer(self):
        return self._source.tokenizer

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

    def __call__(self, prompt=None, image=None, mask_image=None, **kwargs):
        """diffusers' call: txt2img, or img2img with `image`, or inpaint with `image` and `mask_image`."""
        task = self.task(image, mask_image)
        self.check_inputs(task, prompt, image, mask_image, **kwargs)
        if task == "txt2img":
            return self._pipes[task](prompt=prompt, **kwargs)
        if task == "img2img":
            return self._pipes[task](prompt=prompt, image=image, **kwargs)
        return self._pipes[task](prompt=prompt, image=image, mask_image=mask_image, **kwargs)

    # ---- checks first --------------------------------------------------------------------------

    def check_inputs(self, task: str, prompt, image, mask_image, **kwargs) -> None:
        """Everything an engine cannot serve, as one clear error before anything runs."""
        if isinstance(prompt, list) and not prompt:
            raise InvalidInput("`prompt` is an empty list; give at least one prompt.")
        if prompt is None and kwargs.get("prompt_embeds") is None:
            raise InvalidInput("give a `prompt` (str or list of str).")
        self._check_steps(task, kwargs)
        if task == "inpaint":
            if image is None:
                raise InvalidInput("inpainting needs `image` as well as `mask_image`.")
            if _image_size(image) != _image_size(mask_image):
                raise InvalidInput(
                    f"`image` and `mask_image` must have the same size but are {_image_size(image)} and "
                    f"{_image_size(mask_image)} (height, width)."
                )
        height, width = self._output_size(task, image, kwargs.get("height"), kwargs.get("width"))
        prompts = 1 if isinstance(prompt, str) or prompt is None else len(prompt)
        for name in ("prompt_2", "negative_prompt_2"):
            second = kwargs.get(name)
            count = 1 if isinstance(second, str) else len(second or ())
            if second is not None and count != prompts:
                raise InvalidInput(f"`{name}` must give one text per prompt: {prompts} prompt(s) but {count} "
                                   f"{name}(s); pass a list of {prompts}.")
        per_prompt = kwargs.get("num_images_per_prompt")
        if per_prompt is not None and (not _is_count(per_prompt) or per_prompt < 1):
            raise InvalidInput(f"`num_images_per_prompt` must be a positive int but is {per_prompt!r}.")
        self.profile.check(ImageShape(batch=prompts * (per_prompt or 1), height=height, width=width))
        guided = float(kwargs.get("guidance_scale", 7.5)) > 1  # diffusers' rule for classifier-free guidance
        if self.profile.guidance is not None and self.profile.guidance != guided:
            compiled = "with" if self.profile.guidance else "without"
            raise InvalidInput(f"these engines were compiled for calls {compiled} classifier-free guidance "
                               f"(exact-shape engines) but `guidance_scale` is {kwargs.get('guidance_scale', 7.5)}; "
                               "compile for this call (kasoku generate does) or a profile with guidance=None.")
        self._check_family_arguments(kwargs)
        missing = [name for name in self.family.task_components(task, self._source) if name not in self.engines]
        if missing:
            raise InvalidInput(f"{task} needs the {', '.join(missing)} engine{'s' if len(missing) > 1 else ''}; "
                               f"compile with the {', '.join(missing)} component{'s' if len(missing) > 1 else ''}.")
        if task not in self.family.tasks(self._source):
            raise InvalidInput("this is an inpainting model (its U-Net also reads the mask): give `image` and "
                               "`mask_image`.")

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

    def _output_size(self, task: str, image, height, width) -> tuple[int, int]:
        """The size the call generates, as diffusers derives it; checked to be positive and divisible by 8."""
        for name, value in (("height", height), ("width", width)):
            if value is not None and (not _is_count(value) or value <= 0):
                raise InvalidInput(f"`{name}` must be a positive int but is {value!r}.")
        if image is not None and (height is None or width is None):
            image_height, image_width = _image_size(image)
            if task == "img2img":  # diffusers keeps the image's size (rounded down to multiples of 8)
                height = height or image_height // 8 * 8
                width = width or image_width // 8 * 8
            else:
                height, width = height or image_height, width or image_width
        native = native_size(self._source)
        height, width = height or native, width or native
        check_size(height, width)
        return int(height), int(width)

    def _check_family_arguments(self, kwargs) -> None:
        for name, owners in family_only_arguments().items():
            if kwargs.get(name) is not None and self.family not in owners:
                titles = " and ".join(f.title for f in owners)
                raise InvalidInput(f"`{name}`: only {titles} pipelines take this argument; "
                                   f"this is a {self.family.title} model.")
        self.family.check_arguments(kwargs)

    def __repr__(self) -> str:
        backends = {name: engine.backend for name, engine in self.engines.items()}
        return f"KasokuPipeline({self.family.title}, backends={backends}, profile={self.profile})"


def compile(
    pipe,
    backend: str | dict | None = None,
    *,
    options: CompileOptions | None = None,
    on_stage=None,
    label: str | None = None,
    cache=None,
    **fields: Any,
) -> KasokuPipeline:
    """A live diffusers Stable Diffusion 1.x / 2.x / XL pipeline in (txt2img, img2img or inpaint,
    also one with xFormers attention processors), an accelerated KasokuPipeline out.

    `options` is a :class:`CompileOptions`; its fields may also be given as keywords (backend,
    precision, profile, components, cache_dir, threads, ...)."""
    family_of(pipe)  # an unsupported pipeline fails here, naming the supported ones
    options = CompileOptions.of(options, backend=backend, **fields)
    if options.profile is None:
        options = options.replace(profile=default_profile(pipe))
    kwargs: dict[str, Any] = {"on_stage": on_stage} if on_stage else {}
    engines, report = compile_components(pipe, options, cache=cache, label=label, **kwargs)
    return KasokuPipeline(pipe, engines, options.profile, report)
