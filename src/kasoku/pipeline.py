"""KasokuPipeline: diffusers' own Stable Diffusion recipes, with engines in place of torch.

The seed needed a custom pipeline per task (stable_diffusion_tensorrt_txt2img, ...). kasoku
does not re-write the recipe: the text encoder(s), U-Net and VAE of a diffusers pipeline are
replaced by small modules that call compiled engines, and diffusers' own StableDiffusion(XL)
txt2img / Img2Img / Inpaint pipelines run unchanged on top of them. Call signature, schedulers, image
processing, callbacks and outputs are therefore diffusers' own, and the same seed gives the
same image. kasoku adds what an engine needs first: every input is checked against the
compiled profile before anything runs.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from .backends import Engine, EngineOptions
from .build import CompileReport, compile_components
from .components import ImageShape, Precision, ShapeProfile, default_profile, native_size
from .errors import KasokuError
from .families import TASKS, family_of
from .schedulers import SCHEDULERS


class InvalidInput(KasokuError, ValueError):
    """A pipeline argument that cannot be served; raised before any engine runs."""


# SDXL's size/crop conditioning: (height, width) or (top, left) pairs in pixels.
SDXL_SIZE_IDS = ("original_size", "target_size", "crops_coords_top_left", "negative_original_size",
                 "negative_target_size", "negative_crops_coords_top_left")
SDXL_ARGUMENTS = ("prompt_2", "negative_prompt_2", "pooled_prompt_embeds", "negative_pooled_prompt_embeds",
                  *SDXL_SIZE_IDS, "aesthetic_score", "negative_aesthetic_score")


@dataclass
class EngineTimes:
    """Seconds spent in each engine (and how many calls) since the last reset."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


# ---- engine-backed stand-ins for the torch components ---------------------------------------


class _EngineModule(torch.nn.Module):
    """Looks like the torch component to diffusers (config, dtype, device); runs an engine."""

    def __init__(self, original: torch.nn.Module, engines: dict[str, Engine], times: EngineTimes):
        super().__init__()
        self.config = original.config
        self._engines = engines
        self._times = times

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32  # engines take and return fp32 (fp16 engines keep fp32 I/O)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def _run(self, component: str, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        start = time.perf_counter()
        outputs = self._engines[component].run(inputs)
        self._times.seconds[component] += time.perf_counter() - start
        self._times.calls[component] += 1
        return {name: torch.from_numpy(np.asarray(value)) for name, value in outputs.items()}


class _PenultimateOnly(tuple):
    """The hidden states an SDXL pipeline reads: only the penultimate layer (index -2) is there."""

    def __getitem__(self, index):
        if index != -2:
            raise InvalidInput("`clip_skip` needs more hidden states than the compiled text encoders return "
                               "(the penultimate layer only); call without clip_skip.")
        return tuple.__getitem__(self, 0)


class _TextEncoderOutput(tuple):
    """What diffusers indexes: out[0] (last state, or SDXL's projected pooled embedding) and .hidden_states."""

    hidden_states = None


class EngineTextEncoder(_EngineModule):
    def __init__(self, original: torch.nn.Module, engines: dict[str, Engine], times: EngineTimes, component: str):
        super().__init__(original, engines, times)
        self._component = component

    def forward(self, input_ids, attention_mask=None, output_hidden_states=None, return_dict=None, **kwargs):
        out = self._run(self._component, input_ids=input_ids.to(torch.int64))
        if "penultimate_hidden_state" in out:  # SDXL: both encoders, always with output_hidden_states
            first = out["text_embeds"] if "text_embeds" in out else out["penultimate_hidden_state"]
            result = _TextEncoderOutput((first,))
            result.hidden_states = _PenultimateOnly((out["penultimate_hidden_state"],))
            return result
        if output_hidden_states:
            raise InvalidInput("`clip_skip` needs the text encoder's hidden states, which compiled engines do not "
                               "return; call without clip_skip.")
        return (out["last_hidden_state"], out["pooler_output"])


class EngineUNet(_EngineModule):
    def __init__(self, original: torch.nn.Module, engines: dict[str, Engine], times: EngineTimes):
        super().__init__(original, engines, times)
        self._added = [t.name for t in engines["unet"].spec.inputs if t.name in ("text_embeds", "time_ids")]
        if getattr(original, "add_embedding", None) is not None:
            # SDXL pipelines check the ids' width against the embedding's input size.
            self.add_embedding = SimpleNamespace(linear_1=SimpleNamespace(
                in_features=original.add_embedding.linear_1.in_features))

    def forward(self, sample, timestep, encoder_hidden_states, timestep_cond=None, cross_attention_kwargs=None,
                added_cond_kwargs=None, return_dict=True, **kwargs):
        added_cond_kwargs = dict(added_cond_kwargs or {})
        extra = sorted(set(added_cond_kwargs) - set(self._added))
        if timestep_cond is not None or cross_attention_kwargs or extra:
            raise InvalidInput("the compiled U-Net takes sample, timestep, encoder_hidden_states"
                               + (" and SDXL's text_embeds and time_ids" if self._added else "")
                               + " only (no IP-Adapter, LoRA scale or guidance embedding).")
        missing = [name for name in self._added if name not in added_cond_kwargs]
        if missing:
            raise InvalidInput(f"the compiled SDXL U-Net needs {', '.join(missing)} in added_cond_kwargs.")
        timesteps = torch.as_tensor(timestep, dtype=torch.float32).reshape(-1).expand(sample.shape[0])
        added = {name: added_cond_kwargs[name].to(torch.float32) for name in self._added}
        out = self._run("unet", sample=sample, timestep=timesteps.contiguous(),
                        encoder_hidden_states=encoder_hidden_states, **added)["out_sample"]
        if not return_dict:
            return (out,)
        from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

        return UNet2DConditionOutput(sample=out)


class EngineVAE(_EngineModule):
    def decode(self, z, return_dict=True, generator=None, **kwargs):
        image = self._run("vae_decoder", latent_sample=z)["sample"]
        if not return_dict:
            return (image,)
        from diffusers.models.autoencoders.vae import DecoderOutput

        return DecoderOutput(sample=image)

    def encode(self, x, return_dict=True):
        from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKLOutput
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        if "vae_encoder" not in self._engines:
            raise InvalidInput("img2img and inpaint need the vae_encoder engine; compile it "
                               "(`components` including 'vae_encoder').")
        moments = self._run("vae_encoder", sample=x)["latent_parameters"]
        distribution = DiagonalGaussianDistribution(moments)  # sampled with the caller's generator
        return AutoencoderKLOutput(latent_dist=distribution) if return_dict else (distribution,)


# ---- the pipeline ----------------------------------------------------------------------------


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
        stand_ins = dict(
            vae=EngineVAE(diffusers_pipe.vae, engines, self.times),
            unet=EngineUNet(diffusers_pipe.unet, engines, self.times),
        )
        for name in self.family.text_encoders:
            stand_ins[name] = EngineTextEncoder(getattr(diffusers_pipe, name), engines, self.times, name)
        if self.family.name != "sdxl":  # engines replace torch; so does the check that ran on torch images
            stand_ins.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
        self._pipes = {task: self.family.task_pipeline(diffusers_pipe, task, **stand_ins) for task in TASKS}

    # ---- construction --------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path_or_id, backend: str = "auto", *, precision: Precision | str = Precision.FP32,
                        cache_dir: str | Path | None = None, profile: ShapeProfile | None = None,
                        options: EngineOptions | None = None, on_stage=None) -> KasokuPipeline:
        """Load a diffusers folder (or hub id when online) and compile it (from the cache when built)."""
        from .loading import load_pipeline

        return compile(load_pipeline(path_or_id), backend, precision=precision, cache_dir=cache_dir,
                       profile=profile, options=options, on_stage=on_stage, label=str(path_or_id))

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
        strength = kwargs.get("strength")
        if strength is not None and not 0.0 <= float(strength) <= 1.0:
            raise InvalidInput(f"`strength` must be in [0, 1] but is {strength}.")
        if task == "inpaint":
            if image is None:
                raise InvalidInput("inpainting needs `image` as well as `mask_image`.")
            if _image_size(image) != _image_size(mask_image):
                raise InvalidInput(
                    f"`image` and `mask_image` must have the same size but are {_image_size(image)} and "
                    f"{_image_size(mask_image)} (height, width)."
                )
        height, width = kwargs.get("height"), kwargs.get("width")
        if image is not None and (height is None or width is None):
            image_height, image_width = _image_size(image)
            if task == "img2img":  # diffusers keeps the image's size (rounded down to multiples of 8)
                height = height or image_height // 8 * 8
                width = width or image_width // 8 * 8
            else:
                height, width = height or image_height, width or image_width
        native = native_size(self._source)
        height, width = height or native, width or native
        if height % 8 or width % 8:
            raise InvalidInput(f"`height` and `width` have to be divisible by 8 but are {height} and {width}.")
        prompts = 1 if isinstance(prompt, str) or prompt is None else len(prompt)
        for name in ("prompt_2", "negative_prompt_2"):
            second = kwargs.get(name)
            count = 1 if isinstance(second, str) else len(second or ())
            if second is not None and count != prompts:
                raise InvalidInput(f"`{name}` must give one text per prompt: {prompts} prompt(s) but {count} "
                                   f"{name}(s); pass a list of {prompts}.")
        batch = prompts * int(kwargs.get("num_images_per_prompt") or 1)
        self.profile.check(ImageShape(batch=batch, height=int(height), width=int(width)))
        self._check_family_arguments(kwargs)
        if task != "txt2img" and "vae_encoder" not in self.engines:
            raise InvalidInput(f"{task} needs the vae_encoder engine; compile with the vae_encoder component.")
        if self._source.unet.config.in_channels == 9 and task != "inpaint":
            raise InvalidInput("this is an inpainting model (9-channel U-Net): give `image` and `mask_image`.")

    def _check_family_arguments(self, kwargs) -> None:
        given = [name for name in SDXL_ARGUMENTS if kwargs.get(name) is not None]
        if given and self.family.name != "sdxl":
            raise InvalidInput(f"{', '.join(given)}: only SDXL pipelines take "
                               f"{'this argument' if len(given) == 1 else 'these arguments'}; "
                               f"this is a {self.family.title} model.")
        for name in SDXL_SIZE_IDS:
            value = kwargs.get(name)
            if value is not None and (len(tuple(value)) != 2 or any(int(v) < 0 for v in value)):
                raise InvalidInput(f"`{name}` must be a pair of non-negative ints (height, width) or "
                                   f"(top, left) but is {value!r}.")

    def __repr__(self) -> str:
        backends = {name: engine.backend for name, engine in self.engines.items()}
        return f"KasokuPipeline({self.family.title}, backends={backends}, profile={self.profile})"


def compile(
    pipe,
    backend: str = "auto",
    *,
    precision: Precision | str = Precision.FP32,
    cache_dir: str | Path | None = None,
    profile: ShapeProfile | None = None,
    components=None,
    options: EngineOptions | None = None,
    on_stage=None,
    label: str | None = None,
    check_parity: bool = True,
    onnx_dir: str | Path | None = None,
) -> KasokuPipeline:
    """A live diffusers Stable Diffusion 1.x / 2.x / XL pipeline in (txt2img, img2img or inpaint,
    also one with xFormers attention processors), an accelerated KasokuPipeline out."""
    family_of(pipe)  # an unsupported pipeline fails here, naming the supported ones
    profile = profile or default_profile(pipe)
    kwargs: dict[str, Any] = {"on_stage": on_stage} if on_stage else {}
    engines, report = compile_components(pipe, backend=backend, precision=precision, profile=profile,
                                         components=components, cache=cache_dir, options=options, label=label,
                                         check_parity=check_parity, onnx_dir=onnx_dir, **kwargs)
    return KasokuPipeline(pipe, engines, profile, report)
