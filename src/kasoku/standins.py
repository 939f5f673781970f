"""Engine-backed stand-ins for a pipeline's torch modules.

diffusers' own pipelines run unchanged on top of these: each looks like the torch component to
diffusers (its config, dtype, device and call signature) and runs a compiled engine instead. The
stand-ins report the engine's real device and dtype, so diffusers creates latents where the
engines read them (on a GPU engine, no tensor crosses to the CPU between steps).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from .components import residual_names
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
    """The U-Net; inputs after sample, timestep and encoder_hidden_states come from added_cond_kwargs,
    and, for the U-Net of a ControlNet pipeline (unet_controlnet), the ControlNet's residuals.

    Within :meth:`step_cache` (one pipeline call with step caching, kasoku.step_cache) each call is one
    denoising step: a full step runs the unet_full engine and keeps its deep feature, the others run
    the unet_shallow engine on it. Outside it, every call runs the plain U-Net engine."""

    BASE_INPUTS = ("sample", "timestep", "encoder_hidden_states")

    def __init__(self, original: torch.nn.Module, engines: dict[str, Engine], times: EngineTimes,
                 component: str = "unet"):
        super().__init__(original, engines, times, component)
        names = self.engine.spec.input_names
        residuals = set(residual_names(len(names)))
        self._residuals = tuple(name for name in names if name in residuals)  # down blocks' in order, then the mid's
        self._added = [name for name in names if name not in self.BASE_INPUTS and name not in self._residuals]
        self._step_cache: StepCacheRun | None = None
        if getattr(original, "add_embedding", None) is not None:
            # SDXL pipelines check the ids' width against the embedding's input size.
            self.add_embedding = SimpleNamespace(linear_1=SimpleNamespace(
                in_features=original.add_embedding.linear_1.in_features))

    def forward(self, sample, timestep, encoder_hidden_states, timestep_cond=None, cross_attention_kwargs=None,
                added_cond_kwargs=None, down_block_additional_residuals=None, mid_block_additional_residual=None,
                down_intrablock_additional_residuals=None, return_dict=True, **kwargs):
        added_cond_kwargs = dict(added_cond_kwargs or {})
        extra = sorted(set(added_cond_kwargs) - set(self._added))
        if timestep_cond is not None or cross_attention_kwargs or extra or down_intrablock_additional_residuals:
            raise InvalidInput("the compiled U-Net takes sample, timestep, encoder_hidden_states"
                               + (f" and {', '.join(self._added)}" if self._added else "")
                               + " only (no IP-Adapter, T2I-Adapter, LoRA scale or guidance embedding).")
        missing = [name for name in self._added if name not in added_cond_kwargs]
        if missing:
            raise InvalidInput(f"the compiled U-Net needs {', '.join(missing)} in added_cond_kwargs.")
        residuals = self._residual_feeds(down_block_additional_residuals, mid_block_additional_residual)
        timesteps = torch.as_tensor(timestep, dtype=torch.float32).reshape(-1).expand(sample.shape[0])
        added = {name: added_cond_kwargs[name].to(torch.float32) for name in self._added}
        out = self._denoise(dict(sample=sample, timestep=timesteps.contiguous(),
                                 encoder_hidden_states=encoder_hidden_states, **added, **residuals))
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

    def _residual_feeds(self, down, mid) -> dict[str, torch.Tensor]:
        """A ControlNet's residuals as the engine's inputs (its U-Net must take them; a plain one must not)."""
        if not self._residuals:
            if down is not None or mid is not None:
                raise InvalidInput("this U-Net engine takes no ControlNet residuals; compile the pipeline with its "
                                   "ControlNet (`controlnet=`) so that kasoku builds the unet_controlnet engine.")
            return {}
        given = [*(down or ()), *([mid] if mid is not None else [])]
        if down is None or mid is None or len(given) != len(self._residuals):
            raise InvalidInput(f"the {self._component} engine takes {len(self._residuals) - 1} down-block residuals "
                               f"and a mid-block residual from the ControlNet but got {len(down or ())} and "
                               f"{'one' if mid is not None else 'none'}.")
        return dict(zip(self._residuals, given))


class EngineControlNet(EngineModule):
    """A ControlNet engine as diffusers' pipelines call a ControlNetModel (one of them, or each net of a
    MultiControlNetModel). diffusers branches on `isinstance(controlnet, ControlNetModel)`, so the stand-in
    is made a subclass of it by :func:`engine_controlnet`; it builds no layers of its own."""

    def __init__(self, original: torch.nn.Module, engines: dict[str, Engine], times: EngineTimes, component: str):
        torch.nn.Module.__init__(self)  # not ControlNetModel's __init__, which builds the network
        self._internal_dict = original.config  # where diffusers' ConfigMixin keeps `config`
        self._engines = engines
        self._times = times
        self._component = component

    def forward(self, sample, timestep, encoder_hidden_states, controlnet_cond, conditioning_scale=1.0,
                class_labels=None, timestep_cond=None, attention_mask=None, added_cond_kwargs=None,
                cross_attention_kwargs=None, guess_mode=False, return_dict=True):
        if class_labels is not None or timestep_cond is not None or attention_mask is not None or \
                cross_attention_kwargs:
            raise InvalidInput("the compiled ControlNet takes sample, timestep, encoder_hidden_states, the control "
                               "image and its scale only (no class labels, timestep conditioning, attention mask or "
                               "attention kwargs).")
        spec = self.engine.spec
        added_names = spec.input_names[spec.input_names.index("conditioning_scale") + 1:]
        missing = [name for name in added_names if name not in (added_cond_kwargs or {})]
        if missing:
            raise InvalidInput(f"the compiled ControlNet needs {', '.join(missing)} in added_cond_kwargs.")
        feeds = dict(sample=sample, timestep=torch.as_tensor(timestep, dtype=torch.float32).reshape(-1)
                     .expand(sample.shape[0]).contiguous(), encoder_hidden_states=encoder_hidden_states,
                     controlnet_cond=controlnet_cond,
                     conditioning_scale=residual_scales(len(spec.outputs), conditioning_scale, guess_mode,
                                                        sample.device),
                     **{name: added_cond_kwargs[name].to(torch.float32) for name in added_names})
        if float(conditioning_scale) == 0.0:
            # Outside the control-guidance window diffusers multiplies every residual by 0: zeros, without the call.
            shapes = spec.output_shapes({name: tuple(value.shape) for name, value in feeds.items()})
            out = {name: torch.zeros(shape, dtype=self.dtype, device=sample.device) for name, shape in shapes.items()}
        else:
            out = self._run(self._component, **feeds)
        down = [out[name] for name in spec.output_names[:-1]]
        mid = out[spec.output_names[-1]]
        if not return_dict:
            return down, mid
        from diffusers.models.controlnets.controlnet import ControlNetOutput

        return ControlNetOutput(down_block_res_samples=down, mid_block_res_sample=mid)


def residual_scales(count: int, conditioning_scale: float, guess_mode: bool, device) -> torch.Tensor:
    """The scale of each of a ControlNet's `count` residuals, as diffusers' ControlNetModel.forward applies
    them (step 6): `conditioning_scale` for all; in guess mode logspace(-1, 0) times it, from 0.1 for the
    first residual to 1 for the mid block's."""
    if guess_mode:
        return torch.logspace(-1, 0, count, device=device) * conditioning_scale
    return torch.full((count,), float(conditioning_scale), dtype=torch.float32, device=device)


@functools.cache
def _controlnet_classes() -> tuple[type, type]:
    """The stand-ins as subclasses of diffusers' ControlNetModel and MultiControlNetModel (made on first
    use, so that importing kasoku does not import diffusers)."""
    from diffusers import ControlNetModel, MultiControlNetModel

    class EngineMultiControlNet(MultiControlNetModel):
        """diffusers' own MultiControlNetModel (it sums the residuals) over ControlNet stand-ins; dtype and
        device are the engines'."""

        @property
        def dtype(self) -> torch.dtype:
            return self.nets[0].dtype

        @property
        def device(self) -> torch.device:
            return self.nets[0].device

    single = type("EngineControlNetModel", (EngineControlNet, ControlNetModel), {"__module__": __name__})
    return single, EngineMultiControlNet


def engine_controlnet(original: torch.nn.Module, engines: dict[str, Engine], times: EngineTimes,
                      component: str) -> torch.nn.Module:
    """An engine-backed stand-in that diffusers takes for a ControlNetModel."""
    return _controlnet_classes()[0](original, engines, times, component)


def engine_multi_controlnet(nets: list[torch.nn.Module]) -> torch.nn.Module:
    """diffusers' MultiControlNetModel over ControlNet stand-ins."""
    return _controlnet_classes()[1](nets)


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
