"""Engine-backed stand-ins for a pipeline's torch modules.

diffusers' own pipelines run unchanged on top of these: each looks like the torch component to
diffusers (its config, dtype, device and call signature) and runs a compiled engine instead. The
stand-ins report the engine's real device and dtype, so diffusers creates latents where the
engines read them (on a GPU engine, no tensor crosses to the CPU between steps).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from .errors import KasokuError
from .step_cache import FEATURE, FULL, SHALLOW, StepCacheRun

if TYPE_CHECKING:
    from .backends import Engine


class InvalidInput(KasokuError, ValueError):
    """A pipeline argument that cannot be served; raised before any engine runs."""


@dataclass
class EngineTimes:
    """Seconds spent in each engine (and how many calls) since the last reset."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


class EngineModule(torch.nn.Module):
    """Looks like the torch component to diffusers (config, dtype, device); runs engines."""

    def __init__(self, original: torch.nn.Module, engines: dict[str, Engine], times: EngineTimes, component: str):
        super().__init__()
        self.config = original.config
        self._engines = engines
        self._times = times
        self._component = component

    @property
    def engine(self) -> Engine:
        """This stand-in's engine (for its dtype and device: another of the pipeline's engines when its
        own was not compiled, e.g. the VAE in a run that keeps the latents)."""
        return self._engines.get(self._component) or next(iter(self._engines.values()))

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.dtype

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def _run(self, component: str, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        start = time.perf_counter()
        outputs = self._engines[component].run(inputs)
        self._times.seconds[component] += time.perf_counter() - start
        self._times.calls[component] += 1
        return outputs


class EngineTextEncoder(EngineModule):
    """SD 1.x/2.x: diffusers reads out[0], the last hidden state."""

    def forward(self, input_ids, attention_mask=None, output_hidden_states=None, return_dict=None, **kwargs):
        if output_hidden_states:
            raise InvalidInput("`clip_skip` needs the text encoder's hidden states, which compiled engines do not "
                               "return; call without clip_skip.")
        out = self._run(self._component, input_ids=input_ids.to(torch.int64))
        return tuple(out[name] for name in self.engine.spec.output_names)


class EngineUNet(EngineModule):
    """The U-Net; inputs after sample, timestep and encoder_hidden_states come from added_cond_kwargs.

    Within :meth:`step_cache` (one pipeline call with step caching, kasoku.step_cache) each call is one
    denoising step: a full step runs the unet_full engine and keeps its deep feature, the others run
    the unet_shallow engine on it. Outside it, every call runs the plain U-Net engine."""

    BASE_INPUTS = ("sample", "timestep", "encoder_hidden_states")

    def __init__(self, original: torch.nn.Module, engines: dict[str, Engine], times: EngineTimes,
                 component: str = "unet"):
        super().__init__(original, engines, times, component)
        self._added = [name for name in self.engine.spec.input_names if name not in self.BASE_INPUTS]
        self._step_cache: StepCacheRun | None = None
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
                               + (f" and {', '.join(self._added)}" if self._added else "")
                               + " only (no IP-Adapter, LoRA scale or guidance embedding).")
        missing = [name for name in self._added if name not in added_cond_kwargs]
        if missing:
            raise InvalidInput(f"the compiled U-Net needs {', '.join(missing)} in added_cond_kwargs.")
        timesteps = torch.as_tensor(timestep, dtype=torch.float32).reshape(-1).expand(sample.shape[0])
        added = {name: added_cond_kwargs[name].to(torch.float32) for name in self._added}
        out = self._denoise(dict(sample=sample, timestep=timesteps.contiguous(),
                                 encoder_hidden_states=encoder_hidden_states, **added))
        if not return_dict:
            return (out,)
        from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

        return UNet2DConditionOutput(sample=out)

    def _denoise(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        run = self._step_cache
        if run is None:
            return self._run(self._component, **inputs)["out_sample"]
        if run.next_is_full():
            outputs = self._run(FULL, **inputs)
            run.feature = outputs[FEATURE]
            return outputs["out_sample"]
        return self._run(SHALLOW, **inputs, **{FEATURE: run.feature})["out_sample"]

    @contextlib.contextmanager
    def step_cache(self, run: StepCacheRun | None) -> Iterator[None]:
        """Step caching for one pipeline call (None: none); its state goes with the call."""
        self._step_cache = run
        try:
            yield
        finally:
            self._step_cache = None


class EngineVAE(EngineModule):
    def __init__(self, original: torch.nn.Module, engines: dict[str, Engine], times: EngineTimes,
                 component: str = "vae_decoder"):
        super().__init__(original, engines, times, component)

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
