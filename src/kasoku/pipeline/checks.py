"""Every check of a call, before anything runs: what diffusers' pipeline would refuse later (or silently take),
and what compiled engines cannot serve (a shape outside their profile, guidance they were not built for, an
argument of another family, T5 tokens they do not read).

:class:`CallChecks` needs the model, the profile and the names of the engines there are (or will be): `kasoku
generate` asks it before it compiles anything, a :class:`kasoku.KasokuPipeline` before every call.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Container, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.components import ImageShape, ShapeProfile
from ..core.schedulers import distilled_steps, most_steps
from ..core.standins import InvalidInput
from ..core.step_cache import FIRST_BLOCK, InvalidStepCache, StepCaching
from ..families import Family, family_only_arguments
from .signature import call_signature, check_names, check_task_names, pipeline_classes

if TYPE_CHECKING:
    from ..model.pipeline_model import Model
    from ..model.preview import ConfigPreview


def _image_size(image) -> tuple[int, int]:
    """(height, width) of a PIL image, array or tensor (or the first of a list)."""
    if isinstance(image, (list, tuple)):
        image = image[0]
    if isinstance(getattr(image, "size", None), tuple):  # PIL: (width, height)
        width, height = image.size
        return height, width
    shape = tuple(image.shape)
    if len(shape) == 4:
        shape = shape[1:]
    # diffusers' layouts: torch tensors are (N)CHW, numpy arrays (N)HWC
    channels_first = type(image).__module__.startswith("torch")
    return (shape[1], shape[2]) if channels_first and len(shape) == 3 else (shape[0], shape[1])


def check_image_type(name: str, value) -> None:
    """An image argument is what diffusers takes: a PIL image, a numpy array or a torch tensor, or a list of them."""
    if value is None:
        return
    import PIL.Image
    import torch

    kinds = (PIL.Image.Image, np.ndarray, torch.Tensor)
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        for one in (item if isinstance(item, (list, tuple)) else [item]):  # ControlNets' per-prompt lists
            if not isinstance(one, kinds):
                hint = " (a path: open it first, `PIL.Image.open(path)`)" if isinstance(one, (str, Path)) else ""
                raise InvalidInput(f"`{name}` must be a PIL image, a numpy array or a torch tensor (or a list of them) "
                                   f"but is a {type(one).__name__}{hint}.")
            finite = torch.isfinite(one).all() if isinstance(one, torch.Tensor) and one.is_floating_point() else \
                np.isfinite(one).all() if isinstance(one, np.ndarray) and one.dtype.kind == "f" else True
            if not finite:
                raise InvalidInput(f"`{name}` holds NaN or infinite values; give an image of finite values.")


def check_text(name: str, value) -> None:
    """A text argument is what the tokenizers take: a str or a list of str, of valid Unicode."""
    if value is None:
        return
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(item, (bytes, bytearray)):
            raise InvalidInput(f"`{name}` must be a str or a list of str but holds bytes; decode them first "
                               "(`text.decode('utf-8')`).")
        if not isinstance(item, str):
            raise InvalidInput(f"`{name}` must be a str or a list of str but holds {item!r} ({type(item).__name__}).")
        try:
            item.encode("utf-8")
        except UnicodeEncodeError as error:
            raise InvalidInput(f"`{name}` holds {item[error.start]!r} at {error.start}, which is not text (a lone "
                               "surrogate, as `errors='surrogateescape'` decoding leaves); give valid Unicode."
                               ) from None


# The largest image a model is asked for, per side, in units of its native size: beyond it a call would build
# exact-shape engines for minutes for an image the model was never trained near.
MAX_SIZE_FACTOR = 4


def check_bound(model: Model | ConfigPreview, height: int, width: int) -> None:
    """Refuse a size beyond MAX_SIZE_FACTOR x the model's native size per side."""
    bound = MAX_SIZE_FACTOR * model.native_size
    for name, value in (("height", height), ("width", width)):
        if value > bound:
            raise InvalidInput(f"`{name}` is {value}, more than this model serves: at most {MAX_SIZE_FACTOR} x its "
                               f"native {model.native_size} = {bound} pixels per side.")


def check_size(height: int | None, width: int | None, multiple: int = 8) -> None:
    """Sizes the engines serve: multiples of the model's pixel step (`multiple`: diffusers' 8 for the VAE's latent,
    more where the denoiser halves the latent, 2 x 8 x 2**levels for a U-Net, or packs patches)."""
    if (height or 0) % multiple or (width or 0) % multiple:
        more = "" if multiple == 8 else " for this model's engines (diffusers' pipeline takes multiples of 8; " \
            "its denoiser needs the larger step)"
        raise InvalidInput(f"`height` and `width` must be multiples of {multiple}{more} but are {height} and {width}.")


def check_family_arguments(family: Family, kwargs: Mapping[str, Any]) -> None:
    """Refuse an argument only other families' pipelines take (`prompt_3` on SD 1.x), and what the family itself
    refuses of its arguments."""
    for name, owners in family_only_arguments().items():
        # a generic family takes what its classes take (the signature's check saw to the names)
        if kwargs.get(name) is not None and family not in owners and not family.generic:
            titles = ", ".join(f.title for f in owners[:-1]) + (" and " if len(owners) > 1 else "") + \
                owners[-1].title
            raise InvalidInput(f"`{name}`: only {titles} pipelines take this argument; this is a {family.title} "
                               "model.")
    family.check_arguments(kwargs)


def _is_count(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _image_count(image) -> int:
    """How many images: a list's length, a 4-D array's or tensor's first dimension, else one."""
    if isinstance(image, (list, tuple)):
        return len(image)
    shape = getattr(image, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) == 4 else 1


def as_list(value) -> list:
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
        for one in (as_list(images) if isinstance(images, (list, tuple)) else [images]):
            if _image_size(one) != (height, width):
                got = "x".join(map(str, _image_size(one)))
                raise InvalidInput(f"`control_image`{which} is {got} (height x width) but the image is "
                                   f"{height}x{width}; give control images of the generated image's size.")


# diffusers' ControlNet call arguments (a pipeline without ControlNet refuses them).
CONTROL_ARGUMENTS = ("controlnet_conditioning_scale", "guess_mode", "control_guidance_start", "control_guidance_end")


class PromptTruncated(UserWarning):
    """A prompt longer than a text encoder reads: the rest is cut."""


def task_of(image=None, mask_image=None) -> str:
    """The task a call runs: inpaint with a mask, img2img with an image, else text-to-image."""
    if mask_image is not None:
        return "inpaint"
    return "img2img" if image is not None else "txt2img"


# diffusers' limit on `max_sequence_length` (T5's): engines are not grown past it.
MOST_TEXT_TOKENS = 512

# The texts a call may give besides `prompt`: any of them is encoded, so the text encoders' engines are needed.
PROMPT_TEXTS = ("prompt_2", "prompt_3", "negative_prompt", "negative_prompt_2", "negative_prompt_3")


class CallChecks:
    """The checks of one pipeline's calls. `components` is the engines it has (a live mapping: the step-cache
    engines join it later) or will have; `scheduler` gives the scheduler a call runs (it can be swapped);
    `can_build_step_cache` whether step-cache engines missing now can be built at the first cached call. With `grows`,
    a call the profile does not serve passes, and :meth:`check` returns the profile that serves it; `exact` (a tuned
    recipe's exact-shape profile) is returned for a call of its shape whatever engines are loaded. `python` says that
    the caller is Python code (advice names the Python option, not the CLI flag)."""

    def __init__(self, model: Model, profile: ShapeProfile, components: Container[str], *,
                 scheduler: Callable[[], Any] | None = None, can_build_step_cache: bool = True,
                 grows: bool = False, python: bool = False, exact: ShapeProfile | None = None):
        self.model = model
        self.grows, self.python, self.exact = grows, python, exact
        self.family = model.family
        self.profile = profile
        self.components = components
        self.controlnets = model.controlnets
        self._scheduler = scheduler or (lambda: model.scheduler)
        self.can_build_step_cache = can_build_step_cache
        self.signature = call_signature(model)
        self.classes = pipeline_classes(model)

    @property
    def scheduler(self):
        return self._scheduler()

    def check(self, task: str, prompt, image=None, mask_image=None, control_image=None, **kwargs
              ) -> ShapeProfile | None:
        """Everything an engine cannot serve, as one clear error before anything runs. Step caching's arguments
        (kasoku.core.step_cache.StepCaching.ARGUMENTS) are among `kwargs`. Where the engines grow, a call outside the
        profile passes: the profile that serves it too is returned (None: the compiled profile serves it)."""
        caching = self.step_caching({name: kwargs.pop(name) for name in StepCaching.ARGUMENTS if name in kwargs})
        # another family's argument, or ControlNet's on a plain pipeline: said so by the checks below
        others = {*family_only_arguments(), *([] if self.controlnets else CONTROL_ARGUMENTS)}
        check_names(self.signature, [name for name in kwargs if name not in others], self.classes)
        self._check_family_arguments(kwargs)
        for name, value in (("image", image), ("mask_image", mask_image), ("control_image", control_image)):
            check_image_type(name, value)
        for name in ("prompt", *PROMPT_TEXTS):
            check_text(name, prompt if name == "prompt" else kwargs.get(name))
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
        per_net = self._control_images_per_net(control_image, kwargs)
        check_task_names(task, self.model.pipeline_class(task), kwargs)
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
        guided = self.model.doubles_batch(kwargs)  # classifier-free guidance: the family's rule
        shape = ImageShape(batch=prompts * (per_prompt or 1), height=height, width=width)
        if task != "img2img":  # img2img makes its latents from the image
            self._check_latents(kwargs.get("latents"), shape)
        profile = self._serving_profile(shape, guided, kwargs)
        self._check_image_prompts(kwargs, guided, caching)
        encoded = self._prompts_encoded(prompt, kwargs, guided)
        # (a generic family's text encoder the pipeline never calls as a module, Ideogram 4's, runs in torch)
        if not encoded and not self.family.generic and not self.family.present_text_encoders(self.model):
            wanted = ", ".join(f"`{name}`" for name in self._embeddings(guided))
            raise InvalidInput(f"this {self.family.title} pipeline has no text encoders (loaded with "
                               f"text_encoder=None): give {wanted} as a pipeline with them encodes the prompts (its "
                               "`encode_prompt`), and no prompt text.")
        self._check_prompt_embeds(kwargs, profile)
        missing = [name for name in self.model.task_components(task) if name not in self.components
                   and not (encoded and name in self.family.text_encoders)]
        if missing:
            raise InvalidInput(f"{task} needs the {', '.join(missing)} engine{'s' if len(missing) > 1 else ''}; "
                               f"compile with the {', '.join(missing)} component{'s' if len(missing) > 1 else ''}.")
        if task not in self.model.tasks:
            raise InvalidInput("this is an inpainting model (its U-Net also reads the mask): give `image` and "
                               "`mask_image`.")
        return None if profile is self.profile else profile

    def _check_latents(self, latents, shape: ImageShape) -> None:
        """Given latents of an image-shaped layout (not a transformer's packed tokens, Flux's) must be the call's:
        (images, the VAE's latent channels, height / its factor, width / its factor); a generic pipeline's may also
        hold them patchified into channels (Flux.2's 2x2 patches: 4x the channels at half the height and width)."""
        dims = tuple(getattr(latents, "shape", ()))
        config = getattr(getattr(self.model.pipe, "vae", None), "config", None)
        factor = getattr(self.model.pipe, "vae_scale_factor", None)
        if len(dims) != 4 or config is None or not factor or "latent_channels" not in config:
            return
        expected = (shape.batch, config.latent_channels, shape.height // factor, shape.width // factor)
        patchified = self.family.generic and dims[0] == shape.batch and math.prod(dims) == math.prod(expected) and \
            dims[2] * expected[3] == dims[3] * expected[2]
        if dims != expected and not patchified:
            raise InvalidInput(f"`latents` has shape {dims} but this call ({shape.batch} image(s) of {shape.height}x"
                               f"{shape.width}) takes {expected}: images x the VAE's latent channels x height / "
                               f"{factor} x width / {factor}.")

    def _serving_profile(self, shape: ImageShape, guided: bool, kwargs) -> ShapeProfile:
        """The compiled profile where it serves the call (its images and size, guidance, text tokens); else, where
        the engines grow, the profile that serves the old range and this call; else the refusal, with the option
        that widens the profile."""
        tokens = self._text_tokens_asked(kwargs)
        if self.grows and self._runs_exact(shape, guided, kwargs):
            return self.exact  # the tuned shape on its exact-shape engines, not on the range engines grown since
        if self.profile.serves(shape, guided) and tokens is None:
            return self.profile
        if self.grows:
            return self._grown_profile(shape, guided, tokens)
        self.profile.check(shape, python=self.python)
        if self.profile.guidance is not None and self.profile.guidance != guided:
            compiled = "with" if self.profile.guidance else "without"
            given = kwargs.get("guidance_scale", self.family.call_default("guidance_scale",
                                                                           source=type(self.model.pipe).__name__))
            remedy = "compile a profile with guidance=None (`ShapeProfile.from_ranges(..., guidance=None)`), or " \
                "leave out `profile=` and `strict_shapes=True`: the engines then grow with the calls" if self.python \
                else "compile for this call (kasoku generate does) or a profile with guidance=None"
            raise InvalidInput(f"these engines were compiled for calls {compiled} classifier-free guidance "
                               f"(exact-shape engines) but `guidance_scale` is {given}; {remedy}.")
        compiled = self.family.text_tokens(self.profile)
        remedy = f"`ShapeProfile(..., text_tokens={tokens})`, or leave out `profile=` and `strict_shapes=True`: the " \
            "engines then grow with the calls" if self.python else f"`kasoku compile --text-tokens {tokens}`"
        raise InvalidInput(f"`max_sequence_length` is {tokens!r} but the engines were compiled for {compiled} T5 "
                           f"tokens; compile with that many ({remedy}) or call without it.")

    def _runs_exact(self, shape: ImageShape, guided: bool, kwargs) -> bool:
        """Whether the call is the exact-shape profile's shape (with its T5 tokens) while other engines are loaded."""
        exact = self.exact
        if exact is None or exact == self.profile or not exact.serves(shape, guided):
            return False
        tokens = self.family.text_tokens(exact)
        return tokens is None or kwargs.get("max_sequence_length") in (None, tokens)

    def _grown_profile(self, shape: ImageShape, guided: bool, tokens: int | None) -> ShapeProfile:
        """The profile engines grow to for a call of `shape`: every size the model serves (its pixel step to
        MAX_SIZE_FACTOR x native, per side), and twice the images where the call has more than the profile, so that
        one build serves the calls that follow too (a dynamic engine serves its whole range at the same speed; the
        optimum, which TensorRT tunes for, stays)."""
        profile, step = self.profile, self.profile.multiple
        bound = MAX_SIZE_FACTOR * self.model.native_size // step * step
        images = max(shape.batch, 2 * profile.max.batch) if shape.batch > profile.max.batch else shape.batch
        return profile.covering(ImageShape(1, step, step)).covering(ImageShape(images, bound, bound)) \
            .covering(shape, guided, tokens)

    def _text_tokens_asked(self, kwargs) -> int | None:
        """The long-prompt encoder's tokens a call asks for where they are not the profile's (None: they are, or the
        family has no such encoder). A call without `max_sequence_length` asks for diffusers' default where the
        engines grow, and for the engines' own under an explicit profile (:attr:`fixed_arguments`)."""
        compiled = self.family.text_tokens(self.profile)
        given = kwargs.get("max_sequence_length")
        if given is None and self.grows:  # diffusers' own default, as the call means it (not the engines' last)
            given = self.family.default_text_tokens
        if compiled is None or given is None or given == compiled:
            return None
        if not _is_count(given) or not 1 <= given <= MOST_TEXT_TOKENS:
            raise InvalidInput(f"`max_sequence_length` must be an int from 1 to {MOST_TEXT_TOKENS} (T5's limit in "
                               f"diffusers) but is {given!r}.")
        return given

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
            counts = sorted({len(as_list(entry)) for entry in control_image})
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
            values = as_list(value)
            if isinstance(value, (list, tuple)) and len(values) != n:
                raise InvalidInput(f"`{name}` gives {len(values)} values for {n} ControlNet{'s' if n > 1 else ''}; "
                                   f"give one number for all, or a list of {n}.")
            if not all(_is_finite(v) for v in values):
                raise InvalidInput(f"`{name}` must be a finite number or a list of them but is {value!r}.")
        starts = as_list(kwargs.get("control_guidance_start", 0.0))
        ends = as_list(kwargs.get("control_guidance_end", 1.0))
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
        distilled = distilled_steps(self.scheduler)
        if task != "txt2img" and distilled and int(distilled * float(strength)) < steps:
            raise InvalidInput(f"`num_inference_steps` must be at most {int(distilled * float(strength))} at "
                               f"`strength` {strength} for {type(self.scheduler).__name__} (a subset of its "
                               f"{distilled} distilled steps x the strength); lower the steps or raise the strength.")

    def step_caching(self, arguments: Mapping[str, Any]) -> StepCaching:
        """The step caching a call's arguments ask for (kasoku.core.step_cache), checked against this pipeline: its
        denoiser's methods, its ControlNets, the graphs it has or can build."""
        try:
            caching = StepCaching.of(self.family.cache_methods, **arguments)
        except InvalidStepCache as error:
            raise InvalidInput(str(error) if self.family.cache_methods else
                               f"{self.family.title} pipelines have no step caching; leave out "
                               f"{', '.join(f'`{n}`' for n in arguments)}.") from None
        if not caching.active:
            return caching
        if self.controlnets and caching.method == FIRST_BLOCK:
            raise InvalidInput(f"the {caching.method} cache does not run with ControlNets (its graphs take no "
                               "ControlNet residuals); call with cache_method='taylorseer' (it forecasts the "
                               "denoiser's output and runs with them) or without step caching.")
        names = caching.graphs
        if names and not self.can_build_step_cache and not all(n in self.components for n in names):
            raise InvalidInput(f"the {caching.method} cache needs the {' and '.join(names)} engines, which this "
                               "pipeline has not and cannot build; compile with step_cache=True.")
        return caching

    def _output_size(self, task: str, image, height, width) -> tuple[int, int]:
        """The size the call generates, as diffusers derives it; checked to be positive and multiples of the
        model's pixel step."""
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
        check_size(height, width, self.model.pixel_multiple)
        check_bound(self.model, int(height), int(width))
        return int(height), int(width)

    def truncation_notes(self, prompt, kwargs: dict) -> list[str]:
        """What the text encoders will not read: a prompt longer than a tokenizer's length is cut by diffusers (which
        says so in a log kasoku keeps quiet); one note per encoder that cuts."""
        prompts = {0: prompt, 1: kwargs.get("prompt_2") or prompt, 2: kwargs.get("prompt_3") or prompt}
        notes = []
        for index, slot in enumerate(self.family.present_text_encoders(self.model)):
            tokenizer = getattr(self.model.pipe, slot.tokenizer, None)
            texts = prompts.get(index, prompt)
            if tokenizer is None or texts is None:
                continue
            limit = self.family.text_tokens(self.profile) if slot.kind == "t5" else tokenizer.model_max_length
            longest = max(len(tokenizer(text, truncation=False).input_ids) for text in as_list(texts))
            if longest > limit:
                notes.append(f"the prompt is {longest} tokens for {slot.name}, which reads the first {limit}: the "
                             "rest is cut" + (" (SD3 and Flux read long prompts with T5: --prompt-3 / prompt_3, "
                                              "--text-tokens)" if slot.kind != "t5" and index == 0 and
                                              self.family.default_text_tokens else "."))
        return notes

    def _prompts_encoded(self, prompt, kwargs, guided: bool) -> bool:
        """Whether the call gives every prompt embedding diffusers would otherwise encode (the negative ones under
        guidance, the pooled ones where the pipeline takes them) and no text: then no text encoder runs, and none
        is needed."""
        if prompt is not None or any(kwargs.get(name) is not None for name in PROMPT_TEXTS):
            return False
        return all(kwargs.get(name) is not None for name in self._embeddings(guided))

    def _embeddings(self, guided: bool) -> list[str]:
        """The prompt embeddings a call gives in place of its texts."""
        wanted = ["prompt_embeds", *(["negative_prompt_embeds"] if guided else [])]
        if "pooled_prompt_embeds" in self.signature.parameters:
            wanted += [name.replace("prompt_embeds", "pooled_prompt_embeds") for name in wanted]
        return wanted

    def _check_prompt_embeds(self, kwargs, profile: ShapeProfile) -> None:
        """Given embeddings must be as long as the denoiser's engines read (the engine would refuse them at its
        first call, after the work before it)."""
        given = {name: kwargs[name].shape for name in ("prompt_embeds", "negative_prompt_embeds")
                 if len(getattr(kwargs.get(name), "shape", ())) == 3}
        if not given:  # most calls: nothing to read from the tokenizer
            return
        expected = self.family.denoiser_text_length(self.model, profile)
        for name, shape in given.items():
            if shape[1] != expected:
                raise InvalidInput(f"`{name}` holds {shape[1]} tokens but these engines read {expected}; encode "
                                   "the prompt as this pipeline does (`encode_prompt`, with the engines' "
                                   "max_sequence_length) or give `prompt`.")

    @property
    def fixed_arguments(self) -> dict[str, Any]:
        """The call arguments the engines fix, with their values: the T5 tokens they were compiled for
        (`max_sequence_length`; diffusers' default may be another). A diffusers pipeline compared with this one
        takes them too."""
        return self.model.fixed_arguments(self.profile)

    def defaults(self, kwargs) -> dict[str, Any]:
        """What a call omits that the engines fix (see :attr:`fixed_arguments`)."""
        return {name: value for name, value in self.fixed_arguments.items() if name not in kwargs}

    def _check_image_prompts(self, kwargs, guided: bool, caching: StepCaching) -> None:
        """IP-Adapter image prompts: only with adapters loaded, one image (or one encoding) per adapter, of the
        sizes the engines take; with adapters loaded, a call needs them (diffusers' U-Net would fail late)."""
        images, embeds = kwargs.get("ip_adapter_image"), kwargs.get("ip_adapter_image_embeds")
        kinds = self.family.ip_adapters(self.model)
        if not kinds:
            if images is not None or embeds is not None:
                given = "ip_adapter_image" if images is not None else "ip_adapter_image_embeds"
                raise InvalidInput(f"`{given}` is an image prompt, but no IP-Adapter is loaded; call "
                                   "pipe.load_ip_adapter(...) first.")
            return
        count = len(kinds)
        if images is None and embeds is None:
            raise InvalidInput(f"this pipeline has {count} IP-Adapter(s) loaded: give `ip_adapter_image` (one image "
                               "per adapter) or `ip_adapter_image_embeds`, or call pipe.unload_ip_adapter().")
        if caching.active:
            raise InvalidInput(f"step caching ({caching}) does not run with IP-Adapters yet; call without it "
                               "(cache_interval=1, no cache_threshold) or unload the IP-Adapter.")
        if images is not None:
            self._check_ip_images(images, count)
        else:
            self._check_ip_embeds(embeds, count, guided)

    def _check_ip_images(self, images, count: int) -> None:
        if self.family.image_prompt_components(self.model) == ():
            raise InvalidInput("the IP-Adapter was loaded without an image encoder (image_encoder_folder=None): give "
                               "`ip_adapter_image_embeds` instead of `ip_adapter_image`.")
        per_adapter = images if isinstance(images, (list, tuple)) else [images]
        if len(per_adapter) != count:
            raise InvalidInput(f"`ip_adapter_image` must give one image per IP-Adapter: {count} loaded but "
                               f"{len(per_adapter)} given.")
        for index, image in enumerate(per_adapter):
            if isinstance(image, (list, tuple)) and len(image) != 1:
                raise InvalidInput(f"`ip_adapter_image` gives {len(image)} images to IP-Adapter {index + 1}; the "
                                   "engines take one image per IP-Adapter.")
            check_image_type("ip_adapter_image", image)

    def _check_ip_embeds(self, embeds, count: int, guided: bool) -> None:
        import torch

        if isinstance(embeds, torch.Tensor) and self.family.ip_max_adapters == 1:
            embeds = [embeds]  # pipelines of one adapter (SD3's) take its encoding as a tensor, not a list
        if not isinstance(embeds, (list, tuple)) or len(embeds) != count or \
                not all(isinstance(e, torch.Tensor) for e in embeds):
            raise InvalidInput(f"`ip_adapter_image_embeds` must be a list of {count} tensor(s), one per IP-Adapter "
                               "(what pipe.prepare_ip_adapter_image_embeds returns).")
        denoiser = self.components.get(self.family.ip_adapter_components(self.model)[-1]) \
            if hasattr(self.components, "get") else None
        specs = [t for t in denoiser.spec.inputs if t.name.startswith("ip_embeds_")] if denoiser else []
        for index, (tensor, spec) in enumerate(zip(embeds, specs)):
            fixed = tuple(spec.dims[1:])
            rows = 2 if guided else 1
            if tensor.ndim != len(spec.dims) or tuple(tensor.shape[1:]) != fixed or tensor.shape[0] % rows:
                raise InvalidInput(
                    f"`ip_adapter_image_embeds`[{index}] has shape {tuple(tensor.shape)} but IP-Adapter {index + 1} "
                    f"takes ({'2 (negative, then positive)' if guided else 'images'}, {', '.join(map(str, fixed))}); "
                    "make it with pipe.prepare_ip_adapter_image_embeds.")

    def _check_family_arguments(self, kwargs) -> None:
        check_family_arguments(self.family, kwargs)
