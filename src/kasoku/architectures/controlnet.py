"""diffusers' ControlNetModel: a copy of a U-Net's encoder that adds scaled residuals to the U-Net's features.

One engine per ControlNet (``controlnet_<i>``), and one graph per ControlNet architecture (two SD 1.5
ControlNets, canny and depth, export once): the latents, timestep, text embeddings, the
control image at the image's size and one scale per residual (plus the U-Net's added conditioning) in; its
scaled residuals out. One engine serves every scale and guess mode: the scale is an input (diffusers'
scale, or in guess mode its logspace(-1, 0) ramp, per residual). The stand-ins look like a ControlNetModel
to diffusers, one alone or several in diffusers' own MultiControlNetModel (which sums their residuals).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import torch

from ..core.components import ComponentSpec, ShapeProfile, TensorSpec
from ..core.errors import NotADiffusersPipeline
from ..core.standins import EngineModule, InvalidInput, call_state, timesteps_for
from .base import Axes, ModuleRef
from .unet import controlnet_residuals, denoiser_inputs, residual_specs

# What a ControlNet must share with the U-Net it steers (their residuals are added to its features).
FITS = ("cross_attention_dim", "addition_embed_type", "addition_time_embed_dim",
        "projection_class_embeddings_input_dim")


class UnfitControlNet(NotADiffusersPipeline):
    """A ControlNet kasoku cannot run with this pipeline."""


def check_fits(controlnet_config: Mapping[str, Any], unet_config: Mapping[str, Any], latent_channels: int,
               where: str, model: str) -> None:
    """Raise :class:`UnfitControlNet` for a ControlNet that cannot steer a U-Net of `unet_config` on engines."""
    config, unet = controlnet_config, unet_config
    if config.get("global_pool_conditions"):
        raise UnfitControlNet(f"{where} pools its residuals to 1x1 (global_pool_conditions, the shuffle "
                              "ControlNet); kasoku compiles ControlNets whose residuals have the U-Net's sizes.")
    differ = [key for key in FITS if config.get(key) != unet.get(key)]
    if controlnet_residuals(config) != controlnet_residuals(unet):
        differ.append("residuals (block_out_channels, layers_per_block)")
    if config.get("in_channels") != latent_channels:
        differ.append("in_channels (the latent channels)")
    refuse_differences(differ, where, model, "U-Net")


def refuse_differences(differ: list[str], where: str, model: str, denoiser: str) -> None:
    """Raise :class:`UnfitControlNet` naming what a ControlNet does not share with the `denoiser` it would steer."""
    if differ:
        raise UnfitControlNet(f"{where} does not fit this {model} model's {denoiser}: its {', '.join(differ)} "
                              "differ; give a ControlNet trained for this model.")


def check_together(configs: list[Mapping[str, Any]]) -> None:
    """ControlNets that each fit the U-Net fit it together (their residuals are the U-Net's sizes)."""


class ControlNetModule(torch.nn.Module):
    """A diffusers ControlNetModel on (sample, timestep, encoder_hidden_states, controlnet_cond,
    conditioning_scale, *added conditioning) returning each residual times its scale.

    `conditioning_scale` holds one scale per residual, so one engine serves every scale and guess
    mode alike: diffusers multiplies every residual by the scale, or in guess mode by
    logspace(-1, 0) times it (ControlNetModel.forward, step 6); the stand-in computes that vector."""

    def __init__(self, controlnet: torch.nn.Module, added: tuple[str, ...] = ()):
        super().__init__()
        self.controlnet = controlnet
        self.added = added

    def forward(self, sample, timestep, encoder_hidden_states, controlnet_cond, conditioning_scale, *added):
        added_cond_kwargs = dict(zip(self.added, added)) or None
        down, mid = self.controlnet(sample, timestep, encoder_hidden_states, controlnet_cond, conditioning_scale=1.0,
                                    added_cond_kwargs=added_cond_kwargs, return_dict=False)
        return (*(residual * conditioning_scale[i] for i, residual in enumerate(down)),
                mid * conditioning_scale[len(down)])


def controlnet_profile(profile: ShapeProfile) -> ShapeProfile:
    """The ControlNet's profile: in guess mode with guidance, diffusers runs it on the conditional half
    of the batch only, so a profile for calls with guidance serves both batch sizes."""
    return dataclasses.replace(profile, guidance=None) if profile.guidance else profile


def controlnet_spec(name: str, ref: ModuleRef, profile: ShapeProfile, axes: Axes, *, text_length: int,
                    added: tuple[TensorSpec, ...] = ()) -> ComponentSpec:
    """The ControlNet at `ref`: see the module docstring; `added` the U-Net's added conditioning inputs."""
    config = ref.config
    residuals = residual_specs(config, axes)
    added_names = tuple(t.name for t in added)
    return ComponentSpec(
        name=name,
        inputs=(
            *denoiser_inputs(config, axes, text_length),
            TensorSpec("controlnet_cond", (axes.guided, config.conditioning_channels, axes.pixel_h, axes.pixel_w)),
            TensorSpec("conditioning_scale", (len(residuals),)),
            *added,
        ),
        outputs=residuals,
        profile=controlnet_profile(profile),
        load_module=lambda: ControlNetModule(ref.load(), added_names),
        weights=ref.digest,
        config=dict(config),
        graph_kind="unet",
        modules=(ref.path,),
        graph_name="controlnet",
    )


def residual_scales(count: int, conditioning_scale: float, guess_mode: bool, device) -> torch.Tensor:
    """The scale of each of a ControlNet's `count` residuals, as diffusers' ControlNetModel.forward applies
    them (step 6): `conditioning_scale` for all; in guess mode logspace(-1, 0) times it, from 0.1 for the
    first residual to 1 for the mid block's."""
    if guess_mode:
        return torch.logspace(-1, 0, count, device=device) * conditioning_scale
    return torch.full((count,), float(conditioning_scale), dtype=torch.float32, device=device)


class ControlNetStandIn(EngineModule):
    """An engine-backed ControlNet as diffusers' pipelines call one (alone, or each net of a multi-ControlNet).
    diffusers branches on `isinstance(controlnet, <its ControlNet class>)`, so a family's stand-in is made a
    subclass of that class as well (:func:`stand_in_class`); it builds no layers of its own."""

    def __init__(self, original: torch.nn.Module, engines, times, component: str):
        torch.nn.Module.__init__(self)  # not the diffusers class's __init__, which builds the network
        self._internal_dict = original.config  # where diffusers' ConfigMixin keeps `config`
        self._engines = engines
        self._times = times
        self._component = component
        self._step_cache = None

    def step_cache(self, run):
        """Step caching for one pipeline call (None: none): a step whose denoiser call the run skips or forecasts
        needs no ControlNet outputs, so the ControlNet is not run for it."""
        return call_state(self, "_step_cache", run)

    def _outputs(self, feeds: Mapping[str, torch.Tensor], conditioning_scale) -> dict[str, torch.Tensor]:
        """The engine's outputs on `feeds`; zeros, without the call, where diffusers' scale is 0 (outside the
        control-guidance window diffusers multiplies every output by 0) or the denoiser reads none (a step the
        step cache does not compute in full)."""
        run = self._step_cache
        if float(conditioning_scale) == 0.0 or (run is not None and run.skips_next(self._cache_branch)):
            device = next(iter(feeds.values())).device
            shapes = self.engine.spec.output_shapes({name: tuple(value.shape) for name, value in feeds.items()})
            return {name: torch.zeros(shape, dtype=self.dtype, device=device) for name, shape in shapes.items()}
        return self._run(self._component, **feeds)


class EngineControlNet(ControlNetStandIn):
    """A ControlNetModel's engine, as diffusers' pipelines call it (see :class:`ControlNetStandIn`)."""

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
        feeds = dict(sample=sample, timestep=timesteps_for(timestep, sample.shape[0]),
                     encoder_hidden_states=encoder_hidden_states, controlnet_cond=controlnet_cond,
                     conditioning_scale=residual_scales(len(spec.outputs), conditioning_scale, guess_mode,
                                                        sample.device),
                     **{name: added_cond_kwargs[name].to(torch.float32) for name in added_names})
        out = self._outputs(feeds, conditioning_scale)
        down = [out[name] for name in spec.output_names[:-1]]
        mid = out[spec.output_names[-1]]
        if not return_dict:
            return down, mid
        from diffusers.models.controlnets.controlnet import ControlNetOutput

        return ControlNetOutput(down_block_res_samples=down, mid_block_res_sample=mid)


@functools.cache
def stand_in_class(stand_in: type, model_class: type) -> type:
    """`stand_in` as a subclass of diffusers' `model_class` too (diffusers' pipelines branch on it)."""
    return type(f"Engine{model_class.__name__}", (stand_in, model_class), {"__module__": stand_in.__module__})


@functools.cache
def multi_stand_in_class(multi_class: type) -> type:
    """diffusers' own multi-ControlNet class (`multi_class`: it runs each net and sums their outputs), for
    ControlNet stand-ins: its dtype and device are theirs."""
    return type(f"Engine{multi_class.__name__}", (multi_class,), {
        "__module__": __name__,
        "dtype": property(lambda self: self.nets[0].dtype),
        "device": property(lambda self: self.nets[0].device),
    })


# The diffusers classes of these ControlNets (the stand-ins subclass them; loading reads folders of them).
MODEL_CLASS = "ControlNetModel"
MULTI_CLASS = "MultiControlNetModel"
STAND_IN = EngineControlNet  # its engine, made a MODEL_CLASS too (see stand_in_class)
