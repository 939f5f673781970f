"""The pipeline object diffusers code expects, around compiled engines.

Code written for a diffusers pipeline reads and calls more than `__call__`: `components`, `config`, `dtype`,
`device`, its component attributes (`pipe.unet.config`, `pipe.tokenizer`), `to(...)`, `progress_bar`, the
memory-saving switches and `save_pretrained`; diffusers' own `from_pipe` reads the object to make another task's
pipeline. :class:`PipelineSurface` gives each from the diffusers pipeline of the model's own class that runs on the
engines' stand-ins (:mod:`kasoku.runtime.engine_pipelines`): the stand-ins carry their modules' configs, dtype and
device, so `StableDiffusionXLImg2ImgPipeline.from_pipe(fast)` is diffusers' img2img pipeline on the same engines.

An engine is not a torch module: its weights, device and kernels were fixed when it was built. The memory-saving
switches change how torch runs a module, so on engines they are accepted and a note (:class:`EngineNote`, once per
pipeline and switch) says what they mean there; a switch that changes the computation (FreeU) is refused, and so is a
device or dtype the engines were not built for.
"""

from __future__ import annotations

import inspect
import json
import warnings
from pathlib import Path
from typing import Any

import torch

from ..core.standins import InvalidInput
from ..model.loading import lazy_source, real_module, release_module

__all__ = ["EngineNote", "PipelineSurface", "ENGINES_NOTE_FILE", "progress_bars_on"]


class EngineNote(UserWarning):
    """What a diffusers switch of a torch pipeline means for compiled engines (it changes nothing in them)."""


# What each memory-saving switch of diffusers means for engines; said once per pipeline when it is called.
_OFFLOAD = ("the engines hold their weights in their runtime's memory, not in torch modules: nothing moves between "
            "devices, and the memory they take is the engines' (kasoku bench reports it)")
MEMORY_SWITCHES = {
    "enable_attention_slicing": "attention runs inside the engines as their backend plans it: there is nothing to "
                                "slice",
    "enable_vae_slicing": "the VAE engine decodes the whole batch in one call, within the compiled profile",
    "enable_vae_tiling": "the VAE engine decodes the whole latent in one call, at every size the profile serves",
    "enable_xformers_memory_efficient_attention": "the engines run their backend's own attention kernels (xFormers "
                                                  "attention is exported as plain attention)",
    "enable_model_cpu_offload": _OFFLOAD,
    "enable_sequential_cpu_offload": _OFFLOAD,
    "enable_group_offload": _OFFLOAD,
    "fuse_qkv_projections": "the engines' graph optimizer fuses the projections it can; the compiled weights stay "
                            "as they are",
}

# diffusers' methods that read or compute around the modules without changing them: they run on the stand-ins.
DIFFUSERS_METHODS = frozenset({"encode_prompt", "progress_bar", "numpy_to_pil", "prepare_latents", "get_timesteps",
                               "run_safety_checker", "decode_latents", "get_guidance_scale_embedding",
                               "prepare_extra_step_kwargs", "encode_image", "upcast_vae"})

# What `save_pretrained` writes beside diffusers' files: where the engines of these weights live.
ENGINES_NOTE_FILE = "kasoku.json"


def progress_bars_on() -> bool:
    """diffusers' global progress-bar switch (`diffusers.utils.logging.disable_progress_bar()` silences kasoku's
    builds too)."""
    from diffusers.utils import logging as diffusers_logging

    return diffusers_logging.is_progress_bar_enabled()


class PipelineSurface:
    """diffusers' pipeline surface for :class:`kasoku.KasokuPipeline` (see the module docstring). It reads `model`,
    `engines`, `profile`, `compile_report`, `_pipes` (task -> diffusers pipeline on stand-ins), `_loras` and
    `_cache_root`."""

    # ---- what diffusers code reads ------------------------------------------------------------------

    @property
    def _main_pipe(self):
        """The diffusers pipeline on the engines of the class the model was compiled from (its own task's)."""
        pipes = self.__dict__["_pipes"]
        cls = type(self.model.pipe)
        return next((pipe for pipe in pipes.values() if type(pipe) is cls), None) or \
            pipes.get(self.model.task) or next(iter(pipes.values()))

    @property
    def components(self) -> dict[str, Any]:
        """diffusers' `components`: the stand-ins of the compiled modules, the tokenizers, the scheduler."""
        return self._main_pipe.components

    @property
    def config(self):
        return self._main_pipe.config

    @property
    def dtype(self) -> torch.dtype:
        return self._main_pipe.dtype

    @property
    def device(self) -> torch.device:
        return self._main_pipe.device

    @property
    def _optional_components(self) -> list[str]:
        return list(self._main_pipe._optional_components)

    def __getattr__(self, name: str) -> Any:
        """Component attributes (`unet`, `text_encoder`, `tokenizer`, ...) and diffusers' reading methods
        (`encode_prompt`, `progress_bar`, ...) of the main pipeline; a method that would change its torch modules is
        not offered."""
        if name.startswith("_") or "_pipes" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        main = self._main_pipe
        try:
            value = getattr(main, name)
        except AttributeError:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r} (nor has diffusers' "
                                 f"{type(main).__name__})") from None
        if inspect.ismethod(value) and name not in DIFFUSERS_METHODS:
            raise AttributeError(f"`{name}` is diffusers' {type(main).__name__} method on torch modules, which this "
                                 "KasokuPipeline runs as compiled engines; call it on the diffusers pipeline before "
                                 "kasoku.compile.")
        return value

    # ---- devices and dtypes: the engines' own -----------------------------------------------------------

    def to(self, *args: Any, **kwargs: Any):
        """diffusers' `to(device, dtype)`: the engines' device and dtype are accepted (returns the pipeline); another
        is one clear error, since engines are built for a device and a precision."""
        device, dtype = kwargs.pop("device", None), kwargs.pop("dtype", kwargs.pop("torch_dtype", None))
        kwargs.pop("silence_dtype_warnings", None)
        if kwargs:
            raise InvalidInput(f"`to` takes a device and a dtype (diffusers' arguments) but was given "
                               f"{', '.join(kwargs)}.")
        for value in args:
            if isinstance(value, torch.dtype):
                dtype = value
            elif isinstance(value, (str, torch.device, int)):
                device = value
            else:
                raise InvalidInput(f"`to` takes a device and a dtype but was given a {type(value).__name__}.")
        if device is not None:
            asked = torch.device(device)
            if asked.type != self.device.type:
                raise InvalidInput(f"these engines run on {self.device.type}: `to({str(device)!r})` needs engines "
                                   f"built for {asked.type}; compile with a backend that runs there "
                                   "(kasoku.compile(pipe, backend='tensorrt') or 'onnxruntime-cuda' for cuda; "
                                   "`kasoku info` lists them).")
        if dtype is not None and dtype != self.dtype:
            raise InvalidInput(f"these engines take and give {self.dtype} tensors: `to({dtype})` needs other engines; "
                               "compile in the precision you want (kasoku.compile(pipe, precision='bf16'), 'fp16' "
                               "on a GPU): their inputs and outputs stay float32 where the backend keeps them so.")
        return self

    # ---- memory-saving switches: accepted, with what they mean for engines ---------------------------------

    def enable_attention_slicing(self, slice_size: str | int | None = "auto") -> None:
        self._engine_note("enable_attention_slicing")

    def disable_attention_slicing(self) -> None:
        pass  # nothing was sliced

    def enable_vae_slicing(self) -> None:
        self._engine_note("enable_vae_slicing")

    def disable_vae_slicing(self) -> None:
        pass

    def enable_vae_tiling(self, *args: Any, **kwargs: Any) -> None:
        self._engine_note("enable_vae_tiling")

    def disable_vae_tiling(self) -> None:
        pass

    def enable_xformers_memory_efficient_attention(self, attention_op=None) -> None:
        self._engine_note("enable_xformers_memory_efficient_attention")

    def disable_xformers_memory_efficient_attention(self) -> None:
        pass

    def enable_model_cpu_offload(self, *args: Any, **kwargs: Any) -> None:
        self._engine_note("enable_model_cpu_offload")

    def enable_sequential_cpu_offload(self, *args: Any, **kwargs: Any) -> None:
        self._engine_note("enable_sequential_cpu_offload")

    def enable_group_offload(self, *args: Any, **kwargs: Any) -> None:
        self._engine_note("enable_group_offload")

    def maybe_free_model_hooks(self) -> None:
        pass  # no offload hooks: see enable_model_cpu_offload

    def fuse_qkv_projections(self, unet: bool = True, vae: bool = True) -> None:
        self._engine_note("fuse_qkv_projections")

    def unfuse_qkv_projections(self, unet: bool = True, vae: bool = True) -> None:
        pass

    def enable_freeu(self, s1: float, s2: float, b1: float, b2: float) -> None:
        raise InvalidInput("FreeU changes what the U-Net computes (it rescales its skip and backbone features), and "
                           "the engines were compiled without it; kasoku does not compile FreeU. Call without it.")

    def disable_freeu(self) -> None:
        pass  # FreeU is never on (enable_freeu refuses)

    def _engine_note(self, switch: str) -> None:
        said = self.__dict__.setdefault("_notes_said", set())
        if switch not in said:
            said.add(switch)
            warnings.warn(f"{switch}: {MEMORY_SWITCHES[switch]}.", EngineNote, stacklevel=3)

    # ---- progress bars ----------------------------------------------------------------------------------

    def set_progress_bar_config(self, **kwargs: Any) -> None:
        """diffusers' own: for every task's pipeline, and for the engine builds of a call of a new shape."""
        self.__dict__.setdefault("_progress_bar_config", {}).update(kwargs)
        for pipe in self.__dict__["_pipes"].values():
            pipe.set_progress_bar_config(**kwargs)

    @property
    def shows_progress(self) -> bool:
        """Whether builds and loops show progress: diffusers' global switch and this pipeline's configuration."""
        return progress_bars_on() and not self.__dict__.get("_progress_bar_config", {}).get("disable", False)

    # ---- saving -------------------------------------------------------------------------------------------

    def save_pretrained(self, save_directory: str | Path, **kwargs: Any) -> None:
        """diffusers' `save_pretrained` of the model's weights (modules kasoku has not loaded are read for it and
        dropped again), with ENGINES_NOTE_FILE: the cache that holds the engines of these weights and what they
        were built for. `KasokuPipeline.from_pretrained(save_directory, cache_dir=...)` finds them there (the cache
        is keyed by the weights). LoRA adapters loaded into the engines are not part of the weights: save their
        files apart, as diffusers' `save_lora_weights` does."""
        pipe = self.model.pipe
        loaded = [name for name, module in pipe.components.items()
                  if isinstance(module, torch.nn.Module) and lazy_source(module) is not None]
        try:
            for name in loaded:
                real_module(pipe, name)
            pipe.save_pretrained(save_directory, **kwargs)
        finally:
            for name in loaded:
                release_module(pipe, name)
        report = self.compile_report
        note = {
            "engines": str(self._cache_root) if self._cache_root is not None else None,
            "load": "kasoku.KasokuPipeline.from_pretrained(THIS_FOLDER, cache_dir=ENGINES) loads these weights and "
                    "their engines from that cache (built again where it misses them).",
            "backends": dict(report.backends) if report else {n: e.backend for n, e in self.engines.items()},
            "precisions": dict(report.precisions) if report else
            {n: e.precision.value for n, e in self.engines.items()},
            "profile": self.profile.to_dict(),
            "lora_adapters_not_saved": sorted(self._loras.adapters),
        }
        (Path(save_directory) / ENGINES_NOTE_FILE).write_text(json.dumps(note, indent=2) + "\n")
