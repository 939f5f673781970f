"""The request fields: the OpenAI Images API's and kasoku's own, each checked with a message that
names it, states the rule and shows the value; a request becomes one job per image.

JSON bodies (generations) carry typed values; multipart forms (edits) carry text, so numbers there
are read from their text. Nothing here needs the engines: what only the compiled pipeline can say
(the profile, the components it has) is checked by `ImageService.check`, also before queueing."""

from __future__ import annotations

import io
import json
import math
import secrets
from dataclasses import dataclass, field
from typing import Any

from ..batch.jobs import MAX_SEED, caching_arguments, call_key
from ..core.step_cache import DEFAULT_SCHEDULE, METHODS, SCHEDULES, InvalidStepCache, StepCaching
from .config import ServeConfig, Size
from .errors import InvalidRequest

MAX_IMAGES_PER_REQUEST = 10  # OpenAI's own limit on `n`
MAX_PROMPT_CHARS = 32_000  # OpenAI's own limit on `prompt`
MAX_INPUT_PIXELS = 4096 * 4096  # an uploaded image larger than this is refused before it is decoded
DEFAULT_STRENGTH = 0.8  # as `kasoku generate --strength`
RANDOM_SEEDS = 2**32  # a request without `seed` gets one drawn below this (and told which)

GENERATION_FIELDS = ("prompt", "n", "size", "response_format", "model", "user", "quality", "style",
                     "negative_prompt", "steps", "guidance", "seed", "cache_interval", "cache_schedule", "loras",
                     "ip_image", "ip_scale", "cache_method", "cache_threshold")
EDIT_FIELDS = ("image", "mask", "strength") + GENERATION_FIELDS
# Fields other kasoku issues add; until they land a request that sets them is refused, not ignored.
NOT_YET: dict[str, str] = {}
# OpenAI's `quality` as a share of the model's steps (a request's own `steps` wins); `style` (vivid, natural) has
# no counterpart in these models: it is taken and ignored.
QUALITY_STEPS = {"low": 0.5, "medium": 1.0, "standard": 1.0, "auto": 1.0, "high": 1.5, "hd": 1.5}
STYLES = ("vivid", "natural")


@dataclass(frozen=True, eq=False)
class ImagePrompt:
    """A request's image prompt for the server's IP-Adapter (`kasoku serve --ip-adapter`): the image, its scale,
    and a digest of its bytes (requests with the same prompt and scale can share a call)."""

    image: Any = field(repr=False)
    scale: float
    digest: str

    @property
    def key(self) -> tuple:
        return (self.digest, self.scale)


@dataclass(frozen=True, eq=False)
class ServeJob:
    """One image of one request: what `plan_batches` groups (by `call_key`) and one engine call runs."""

    prompt: str
    negative_prompt: str | None
    seed: int
    steps: int
    guidance: float
    height: int
    width: int
    task: str = "txt2img"  # txt2img | img2img | inpaint
    strength: float | None = None
    image: Any = field(default=None, repr=False)  # PIL images at the output size (img2img, inpaint)
    mask: Any = field(default=None, repr=False)
    cache_interval: int = 1  # step caching (kasoku.core.step_cache): 1, none
    cache_schedule: str = DEFAULT_SCHEDULE
    loras: tuple[tuple[str, float], ...] = ()  # (file, scale) of the adapters the image runs
    image_prompt: ImagePrompt | None = None  # with the server's IP-Adapter: the image prompt and its scale
    cache_method: str | None = None
    cache_threshold: float | None = None

    @property
    def call_key(self) -> tuple:
        return call_key(self.height, self.width, self.steps, self.guidance, self.negative_prompt is not None,
                        task=self.task, strength=self.strength, caching=caching_arguments(self), loras=self.loras,
                        image_prompt=self.image_prompt.key if self.image_prompt else ())


@dataclass(frozen=True, eq=False)
class ImageRequest:
    """One checked request: `n` images, image i seeded with `seed + i`."""

    prompt: str
    n: int
    size: Size
    seed: int
    steps: int
    guidance: float
    negative_prompt: str | None = None
    task: str = "txt2img"
    strength: float | None = None
    image: Any = field(default=None, repr=False)
    mask: Any = field(default=None, repr=False)
    cache_interval: int = 1
    cache_schedule: str = DEFAULT_SCHEDULE
    loras: tuple[tuple[str, float], ...] = ()
    image_prompt: ImagePrompt | None = None
    cache_method: str | None = None
    cache_threshold: float | None = None

    @property
    def seeds(self) -> list[int]:
        return [self.seed + i for i in range(self.n)]

    def jobs(self) -> list[ServeJob]:
        return [ServeJob(self.prompt, self.negative_prompt, seed, self.steps, self.guidance, self.size.height,
                         self.size.width, self.task, self.strength, self.image, self.mask, self.cache_interval,
                         self.cache_schedule, self.loras, self.image_prompt, self.cache_method, self.cache_threshold)
                for seed in self.seeds]

    def call_arguments(self, images: int) -> dict[str, Any]:
        """The arguments of a call of `images` of these images, for the pipeline's own checks."""
        kwargs: dict[str, Any] = dict(prompt=[self.prompt] * images, num_inference_steps=self.steps,
                                      guidance_scale=self.guidance, **caching_arguments(self))
        if self.negative_prompt is not None:
            kwargs["negative_prompt"] = [self.negative_prompt] * images
        return kwargs | task_arguments(self.jobs()[:images])


def task_arguments(jobs: list[ServeJob]) -> dict[str, Any]:
    """What a call of these jobs takes beside `call_arguments`: the size (img2img keeps its image's),
    the images and masks, the strength, and the image prompt."""
    first = jobs[0]
    prompt = {"ip_adapter_image": first.image_prompt.image} if first.image_prompt else {}
    if first.task == "txt2img":
        return dict(height=first.height, width=first.width, **prompt)
    kwargs: dict[str, Any] = dict(image=[job.image for job in jobs], strength=first.strength, **prompt)
    if first.task == "inpaint":
        kwargs.update(mask_image=[job.mask for job in jobs], height=first.height, width=first.width)
    return kwargs


# ---- values ------------------------------------------------------------------------------------


def _show(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bad(name: str, rule: str, value: Any) -> InvalidRequest:
    return InvalidRequest(f"`{name}` must be {rule} but is {_show(value)}.", param=name)


def _integer(name: str, value: Any, low: int, high: int, form: bool) -> int:
    rule = f"an integer in {low}..{high}"
    if form and isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise _bad(name, rule, value) from None
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise _bad(name, rule, value)
    return value


def _number(name: str, value: Any, rule: str, ok, form: bool) -> float:
    if form and isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise _bad(name, rule, value) from None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or not ok(value):
        raise _bad(name, rule, value)
    return float(value)


def _text(name: str, value: Any, *, required: bool = False) -> str | None:
    if value is None and not required:
        return None
    if not isinstance(value, str):  # an empty prompt is a prompt, as in diffusers, the CLI and the Python API
        raise _bad(name, "a string", value)
    if len(value) > MAX_PROMPT_CHARS:
        raise InvalidRequest(f"`{name}` must be at most {MAX_PROMPT_CHARS} characters but has {len(value)}.",
                             param=name)
    return value


def _size(value: Any, config: ServeConfig) -> Size:
    if value is None or value == "auto":
        return config.default_size
    try:
        size = Size.parse(value) if isinstance(value, str) else None
    except ValueError:
        size = None
    if size not in config.sizes:
        multiple = config.options.profile.multiple if config.options.profile is not None else 8
        servable = size is not None and not (size.width % multiple or size.height % multiple)
        advice = f"Start `kasoku serve` with --size {value if servable else 'WxH'} to serve another" + \
            ("" if servable else f" (width and height multiples of {multiple} for this model)")
        raise InvalidRequest(f"`size` must be one of the sizes this server's engines serve ({config.sizes_text}, "
                             f"written WIDTHxHEIGHT; or \"auto\") but is {_show(value)}. {advice}.", param="size")
    return size


def _check_fields(body: dict, allowed: tuple[str, ...], endpoint: str) -> None:
    for name in body:
        if name in NOT_YET:
            raise InvalidRequest(f"`{name}` ({NOT_YET[name]}) is not available yet in this kasoku; leave it out.",
                                 param=name)
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        names = ", ".join(f"`{name}`" for name in unknown)
        raise InvalidRequest(f"unknown field{'s' if len(unknown) > 1 else ''} {names} for {endpoint}; its fields are "
                             f"{', '.join(allowed)}.", param=unknown[0])


def _common(body: dict, config: ServeConfig, form: bool) -> dict[str, Any]:
    """The fields generations and edits share."""
    model = body.get("model")
    if model is not None and model != config.model_name:
        raise InvalidRequest(f"`model` must be {config.model_name!r} (the model this server serves) or left out, but "
                             f"is {_show(model)}.", param="model")
    response_format = body.get("response_format")
    if response_format not in (None, "b64_json"):
        raise InvalidRequest(f"`response_format` must be \"b64_json\" (kasoku serve keeps no files to link to) but is "
                             f"{_show(response_format)}.", param="response_format")
    _text("user", body.get("user"))
    most = min(MAX_IMAGES_PER_REQUEST, config.max_queue)
    n = _integer("n", body.get("n", 1), 1, most, form)
    seed = body.get("seed")
    seed = secrets.randbelow(RANDOM_SEEDS) if seed is None else _integer("seed", seed, 0, MAX_SEED - (n - 1), form)
    quality = _choice("quality", body.get("quality", "auto"), tuple(QUALITY_STEPS))
    _choice("style", body.get("style", "vivid"), STYLES)  # taken, and ignored: see STYLES
    steps = min(config.max_steps, max(1, round(config.default_steps * QUALITY_STEPS[quality])))
    cache_interval = _integer("cache_interval", body.get("cache_interval", 1), 1, config.max_steps, form)
    cache_schedule = _choice("cache_schedule", body.get("cache_schedule", DEFAULT_SCHEDULE), SCHEDULES)
    cache_method = body.get("cache_method")
    if cache_method is not None:
        _choice("cache_method", cache_method, METHODS)
    cache_threshold = body.get("cache_threshold")
    if cache_threshold is not None:
        cache_threshold = _number("cache_threshold", cache_threshold, "a number >= 0", lambda v: v >= 0, form)
    try:
        caching = StepCaching.of(config.cache_methods, cache_interval=cache_interval, cache_schedule=cache_schedule,
                                 cache_method=cache_method, cache_threshold=cache_threshold)
    except InvalidStepCache as error:
        raise InvalidRequest(str(error), param="cache_method" if cache_method else "cache_interval") from None
    if caching.graphs and not config.options.step_cache:
        param = "cache_threshold" if cache_threshold is not None else "cache_interval"
        raise InvalidRequest(f"`{param}` ({caching}) needs the step-cache engines, which this server did not build; "
                             "start it with `kasoku serve ... --step-cache`.", param=param)
    return dict(
        prompt=_text("prompt", body.get("prompt"), required=True),
        negative_prompt=_text("negative_prompt", body.get("negative_prompt")),
        n=n, size=_size(body.get("size"), config), seed=seed,
        steps=_integer("steps", body.get("steps", steps), 1, config.max_steps, form),
        guidance=_number("guidance", body.get("guidance", config.default_guidance), "a finite number", lambda v: True,
                         form),
        cache_interval=cache_interval, cache_schedule=cache_schedule, cache_method=cache_method,
        cache_threshold=cache_threshold,
        loras=_loras(body.get("loras"), config, form),
    )


def image_prompt(data: bytes | str | None, scale: Any, config: ServeConfig, form: bool) -> ImagePrompt | None:
    """`ip_image` (an upload in edits; base64 in a generation's JSON) and `ip_scale` (default 1): the image prompt
    for the IP-Adapter the server was started with. A server with one runs requests without it at scale 0."""
    if data is None:
        if scale is not None:
            raise InvalidRequest("`ip_scale` needs `ip_image` (the image prompt it scales).", param="ip_scale")
        return None
    if config.ip_adapter is None:
        raise InvalidRequest("`ip_image`: this server was started without an IP-Adapter; start it with `kasoku serve "
                             "... --ip-adapter FILE` to take image prompts.", param="ip_image")
    if isinstance(data, str):
        import base64
        import binascii

        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest("`ip_image` must be a base64-encoded image file (PNG, JPEG, ...) in JSON, or an "
                                 "uploaded file in /v1/images/edits.", param="ip_image") from None
    elif not isinstance(data, bytes):
        raise _bad("ip_image", "a base64-encoded image file", data)
    import hashlib

    value = _number("ip_scale", 1.0 if scale is None else scale, "a finite number", lambda v: True, form)
    return ImagePrompt(decode_image(data, "ip_image").convert("RGB"), value, hashlib.sha256(data).hexdigest()[:16])


def _loras(value: Any, config: ServeConfig, form: bool) -> tuple[tuple[str, float], ...]:
    """`loras`: adapters the server was started with (`kasoku serve --lora NAME=PATH`), by name, each at a scale
    (default 1): a list of "NAME[:SCALE]" strings or {"name": ..., "scale": ...} objects; in a form, the
    strings comma-separated. The images run (file, scale) of each."""
    if value is None:
        return ()
    rule = 'a list of "NAME[:SCALE]" strings or {"name": ..., "scale": ...} objects'
    if form and isinstance(value, str):
        value = [item.strip() for item in value.split(",") if item.strip()]
    if not isinstance(value, list):
        raise _bad("loras", rule, value)
    if value and not config.loras:
        raise InvalidRequest("`loras`: this server was started without LoRA adapters; start it with `kasoku serve "
                             "... --lora NAME=PATH` to serve one.", param="loras")
    files = dict(config.loras)
    chosen: dict[str, float] = {}
    for item in value:
        if isinstance(item, str):
            name, _, scale_text = item.partition(":")
            try:
                scale: Any = float(scale_text) if scale_text else 1.0
            except ValueError:
                raise _bad("loras", rule, item) from None
        elif isinstance(item, dict) and set(item) <= {"name", "scale"} and isinstance(item.get("name"), str):
            name, scale = item["name"], item.get("scale", 1.0)
        else:
            raise _bad("loras", rule, item)
        if name not in files:
            raise InvalidRequest(f"`loras`: no adapter named {_show(name)} on this server; it serves "
                                 f"{', '.join(config.lora_names)}.", param="loras")
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
            raise _bad("loras", "scales that are finite numbers", item)
        if name in chosen:
            raise InvalidRequest(f"`loras` names {name} twice; give each adapter once, with its scale.",
                                 param="loras")
        chosen[name] = float(scale)
    return tuple((files[name], scale) for name, scale in chosen.items())


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise _bad(name, "one of " + ", ".join(choices), value)
    return value


def parse_generation(body: Any, config: ServeConfig) -> ImageRequest:
    """A JSON body of POST /v1/images/generations → an ImageRequest (text to image)."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"the body must be a JSON object but is {type(body).__name__}.")
    if "strength" in body or "image" in body:
        name = "strength" if "strength" in body else "image"
        raise InvalidRequest(f"`{name}` belongs to /v1/images/edits (img2img and inpaint), not to generations.",
                             param=name)
    _check_fields(body, GENERATION_FIELDS, "/v1/images/generations")
    return ImageRequest(**_common(body, config, form=False),
                        image_prompt=image_prompt(body.get("ip_image"), body.get("ip_scale"), config, form=False))


def parse_edit(form: dict[str, Any], image: bytes | None, mask: bytes | None, config: ServeConfig,
               ip_image: bytes | None = None) -> ImageRequest:
    """The text fields and uploaded files of POST /v1/images/edits → an ImageRequest: inpaint with a
    mask, img2img without. `image` is resized to the output size (`size`), and so is `mask`; `ip_image` is the
    image prompt (for the server's IP-Adapter)."""
    uploaded = {name: 1 for name, data in (("image", image), ("ip_image", ip_image)) if data is not None}
    if "ip_image" in form:
        raise InvalidRequest("`ip_image` must be an uploaded file, not a text field.", param="ip_image")
    _check_fields({**form, **uploaded}, EDIT_FIELDS, "/v1/images/edits")
    if image is None:
        raise InvalidRequest("`image` is missing: upload the picture to edit as a file field.", param="image")
    fields = _common(form, config, form=True)
    strength = _number("strength", form.get("strength", DEFAULT_STRENGTH), "a number in [0, 1]",
                       lambda v: 0.0 <= v <= 1.0, form=True)
    size: Size = fields["size"]
    picture = decode_image(image, "image").convert("RGB")
    if mask is not None:
        painted = mask_from(decode_image(mask, "mask"))
        if painted.size != picture.size:
            raise InvalidRequest(f"`mask` must be the size of `image` ({picture.size[0]}x{picture.size[1]}) but is "
                                 f"{painted.size[0]}x{painted.size[1]}.", param="mask")
        painted = resized(painted, size, nearest=True)
    else:
        painted = None
    return ImageRequest(**fields, task="inpaint" if mask is not None else "img2img", strength=strength,
                        image=resized(picture, size), mask=painted,
                        image_prompt=image_prompt(ip_image, form.get("ip_scale"), config, form=True))


def decode_image(data: bytes, name: str):
    """An uploaded file as a PIL image; refused before decoding when it is not an image or too large."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError):
        raise InvalidRequest(f"`{name}` is not an image kasoku can read (PNG, JPEG, WebP, ...); got {len(data)} bytes "
                             "that are not.", param=name) from None
    width, height = image.size
    if width * height > MAX_INPUT_PIXELS:
        raise InvalidRequest(f"`{name}` must have at most {MAX_INPUT_PIXELS} pixels but is {width}x{height}.",
                             param=name)
    try:
        image.load()
    except (OSError, ValueError, SyntaxError):
        raise InvalidRequest(f"`{name}` is a damaged or truncated image.", param=name) from None
    return image


def mask_from(image):
    """White where to paint. A mask with transparency follows OpenAI's rule (paint where it is fully
    transparent); one without follows diffusers' (paint where it is white)."""
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        alpha = image.convert("RGBA").getchannel("A")
        return alpha.point(lambda a: 255 if a == 0 else 0)
    return image.convert("L")


def resized(image, size: Size, nearest: bool = False):
    from PIL import Image

    if image.size == (size.width, size.height):
        return image
    return image.resize((size.width, size.height), Image.Resampling.NEAREST if nearest else Image.Resampling.LANCZOS)


__all__ = ["DEFAULT_STRENGTH", "EDIT_FIELDS", "GENERATION_FIELDS", "ImageRequest", "MAX_IMAGES_PER_REQUEST", "NOT_YET",
           "ServeJob", "decode_image", "mask_from", "parse_edit", "parse_generation", "task_arguments"]
