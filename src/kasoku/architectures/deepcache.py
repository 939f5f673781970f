"""The U-Net's step-cache graphs: DeepCache (Ma, Fang and Wang, CVPR 2024) inside the engines.

Two more components of a U-Net's weights (see :mod:`kasoku.core.step_cache` for the schedules and one call's
state): ``unet_full`` (the whole U-Net, run layer by layer with diffusers' own operations in the same
order, also returning the *deep feature*: the input of the up layer at the chosen skip branch) and
``unet_shallow`` (conv_in, the down layers up to the branch, the up layers from it outwards, on the deep
feature as one more input). They take the plain U-Net's inputs, its added conditioning included.

Branches are the U-Net's skip connections counted from the outside in: branch 0 is conv_in's output,
which the last layer of the last up block reads; the deepest branch is the last down layer's output.
Branch 0 is the reference implementation's default (DeepCache's ``cache_branch_id``; for U-Nets with
two layers per block, as SD 1.x/2.x/XL have, branch b is its (block, layer) = (b // 3, b % 3)).

In a ControlNet pipeline ``unet_full`` also takes the ControlNets' residuals (as ``unet_controlnet`` does, added
where diffusers adds them), so the deep feature it caches carries their guidance; ``unet_shallow`` takes none: the
ControlNets run only on the steps that run the full graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..core.components import Axis, ComponentSpec, TensorSpec
from ..core.step_cache import FEATURE, FULL, SHALLOW, InvalidStepCache
from .base import Axes, ModuleRef
from .unet import residual_names

# The block types whose layers kasoku runs one by one (every SD 1.x, 2.x and XL U-Net's).
DOWN_BLOCKS = ("CrossAttnDownBlock2D", "DownBlock2D")
UP_BLOCKS = ("CrossAttnUpBlock2D", "UpBlock2D")
MID_BLOCKS = ("UNetMidBlock2DCrossAttn", "UNetMidBlock2D", None)


# ---- which layers a branch runs ------------------------------------------------------------------


def _layers_per_block(config: Mapping) -> list[int]:
    layers, levels = config["layers_per_block"], len(config["block_out_channels"])
    return [int(layers)] * levels if isinstance(layers, int) else [int(n) for n in layers]


def branch_count(config: Mapping) -> int:
    """How many skip branches the U-Net has (conv_in's output and every down layer's)."""
    return sum(n + 1 for n in _layers_per_block(config))


@dataclass(frozen=True)
class Branch:
    """The geometry of skip branch `index` in a U-Net, from its config alone (no weights).

    The shallow graph runs conv_in and the first `down_layers` down layers (whose outputs are skips
    1..index), then the up layers from `up_layer` (counted from the innermost; it reads skip `index`)
    to the last; the deep feature is that up layer's input: `channels` channels at 1 / 2**`level` of
    the latent's height and width."""

    index: int
    down_layers: int
    up_layer: int
    channels: int
    level: int

    @classmethod
    def of(cls, config: Mapping, index: int) -> Branch:
        _check_blocks(config)
        count = branch_count(config)
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
            raise InvalidStepCache(f"`cache_branch` must be a skip branch of this U-Net, 0..{count - 1} (0: the "
                                   f"outermost, the default) but is {index!r}.")
        channels = list(reversed(config["block_out_channels"]))
        up_layer = count - 1 - index  # up layers read the skips innermost first
        block, layer = 0, up_layer
        for size in (n + 1 for n in reversed(_layers_per_block(config))):
            if layer < size:
                break
            block, layer = block + 1, layer - size
        # the first layer of an up block reads the block below (the mid block below the first), later ones its own
        feature_channels = channels[max(block - 1, 0)] if layer == 0 else channels[block]
        return cls(index=index, down_layers=index, up_layer=up_layer, channels=int(feature_channels),
                   level=len(channels) - 1 - block)


def _check_blocks(config: Mapping) -> None:
    unknown = [t for t in config["down_block_types"] if t not in DOWN_BLOCKS]
    unknown += [t for t in config["up_block_types"] if t not in UP_BLOCKS]
    unknown += [t for t in (config.get("mid_block_type", "UNetMidBlock2DCrossAttn"),) if t not in MID_BLOCKS]
    if unknown or config.get("addition_embed_type") == "image_hint":
        raise InvalidStepCache(f"step caching runs U-Nets built from {', '.join(DOWN_BLOCKS + UP_BLOCKS)} blocks "
                               f"(SD 1.x, 2.x, XL); this one has {', '.join(map(str, unknown)) or 'an image hint'}.")


# ---- the U-Net, layer by layer -----------------------------------------------------------------------


class UNetLayers:
    """A diffusers UNet2DConditionModel run layer by layer, with the same operations in the same order
    as its own forward (diffusers 0.42: prologue, down blocks, mid block, up blocks, epilogue), for the
    inputs kasoku's engines take (no masks, no attention kwargs, no residuals). A plain object: the
    wrapping module registers the U-Net."""

    def __init__(self, unet: torch.nn.Module, branch: Branch):
        if any(getattr(block, "s1", None) for block in unet.up_blocks):
            raise InvalidStepCache("step caching does not run U-Nets with FreeU enabled; call "
                                   "`pipe.disable_freeu()` before compiling.")
        self.unet = unet
        self.branch = branch
        self.down = list(self._down_layers())
        self.up = list(self._up_layers())

    def _down_layers(self) -> Iterator[Callable]:
        for block in self.unet.down_blocks:
            attentions = getattr(block, "attentions", None) or [None] * len(block.resnets)
            for resnet, attention in zip(block.resnets, attentions):
                yield lambda h, emb, ehs, resnet=resnet, attention=attention: _layer(resnet, attention, h, emb, ehs)
            if block.downsamplers is not None:
                yield lambda h, emb, ehs, samplers=block.downsamplers: _sampled(samplers, h)

    def _up_layers(self) -> Iterator[tuple[torch.nn.Module, torch.nn.Module | None, Any]]:
        """(resnet, attention, the block's upsamplers after its last resnet else None) per up layer."""
        for block in self.unet.up_blocks:
            attentions = getattr(block, "attentions", None) or [None] * len(block.resnets)
            last = len(block.resnets) - 1
            for j, (resnet, attention) in enumerate(zip(block.resnets, attentions)):
                yield resnet, attention, block.upsamplers if j == last else None

    def prologue(self, sample, timestep, ehs, added: Mapping | None):
        """(time embedding, encoder hidden states, conv_in's output, upsample sizes forwarded?)"""
        unet, added = self.unet, dict(added or {})
        timestep_cond = added.pop("timestep_cond", None)  # an LCM-distilled U-Net's guidance embedding
        forward_sizes = any(d % 2**unet.num_upsamplers != 0 for d in sample.shape[-2:])
        if unet.config.center_input_sample:
            sample = 2 * sample - 1.0
        emb = unet.time_embedding(unet.get_time_embed(sample=sample, timestep=timestep), timestep_cond)
        class_emb = unet.get_class_embed(sample=sample, class_labels=None)
        if class_emb is not None:
            emb = torch.cat([emb, class_emb], dim=-1) if unet.config.class_embeddings_concat else emb + class_emb
        aug_emb = unet.get_aug_embed(emb=emb, encoder_hidden_states=ehs, added_cond_kwargs=added)
        emb = emb + aug_emb if aug_emb is not None else emb
        if unet.time_embed_act is not None:
            emb = unet.time_embed_act(emb)
        ehs = unet.process_encoder_hidden_states(encoder_hidden_states=ehs, added_cond_kwargs=added)
        return emb, ehs, unet.conv_in(sample), forward_sizes

    def down_path(self, h, emb, ehs, layers: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        skips = [h]
        for layer in self.down[:layers]:
            h = layer(h, emb, ehs)
            skips.append(h)
        return h, skips

    def mid(self, h, emb, ehs):
        mid = self.unet.mid_block
        if mid is None:
            return h
        if getattr(mid, "has_cross_attention", False):
            return mid(h, emb, encoder_hidden_states=ehs, attention_mask=None, cross_attention_kwargs=None,
                       encoder_attention_mask=None)
        return mid(h, emb)

    def up_path(self, h, emb, ehs, skips: list[torch.Tensor], layers: slice, forward_sizes: bool):
        """The up layers in `layers`; each pops the skip it reads."""
        for resnet, attention, upsamplers in self.up[layers]:
            h = _layer(resnet, attention, torch.cat([h, skips.pop()], dim=1), emb, ehs)
            if upsamplers is not None:
                # as diffusers: sizes are forwarded only for latents the upsamplers cannot halve evenly
                upsample_size = skips[-1].shape[2:] if forward_sizes else None
                for upsampler in upsamplers:
                    h = upsampler(h, upsample_size)
        return h

    def epilogue(self, h):
        unet = self.unet
        if unet.conv_norm_out:
            h = unet.conv_act(unet.conv_norm_out(h))
        return unet.conv_out(h)

    def full(self, sample, timestep, ehs, added=None, residuals=()) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole U-Net: (noise prediction, the deep feature at the branch); with a ControlNet's `residuals`
        (one per skip, then the mid block's) added where diffusers adds them: to the skips the up layers read, and
        to the mid block's output."""
        emb, ehs, h, sizes = self.prologue(sample, timestep, ehs, added)
        h, skips = self.down_path(h, emb, ehs, len(self.down))
        if residuals:
            skips = [skip + residual for skip, residual in zip(skips, residuals[:-1])]
        h = self.mid(h, emb, ehs)
        if residuals:
            h = h + residuals[-1]
        feature = self.up_path(h, emb, ehs, skips, slice(0, self.branch.up_layer), sizes)
        h = self.up_path(feature, emb, ehs, skips, slice(self.branch.up_layer, None), sizes)
        return self.epilogue(h), feature

    def shallow(self, sample, timestep, ehs, added, feature) -> torch.Tensor:
        """The outer layers on the deep feature of the last full step: the noise prediction."""
        emb, ehs, h, sizes = self.prologue(sample, timestep, ehs, added)
        _, skips = self.down_path(h, emb, ehs, self.branch.down_layers)
        return self.epilogue(self.up_path(feature, emb, ehs, skips, slice(self.branch.up_layer, None), sizes))


def _layer(resnet, attention, h, emb, ehs):
    h = resnet(h, emb)
    if attention is not None:
        h = attention(h, encoder_hidden_states=ehs, cross_attention_kwargs=None, attention_mask=None,
                      encoder_attention_mask=None, return_dict=False)[0]
    return h


def _sampled(samplers, h):
    for sampler in samplers:
        h = sampler(h)
    return h


# ---- the two components' torch modules and specs --------------------------------------------------------


class StepCacheFullModule(torch.nn.Module):
    """unet_full: the whole U-Net on (sample, timestep, encoder_hidden_states, *added conditioning, [*a ControlNet's
    residuals]), returning the noise prediction and the deep feature."""

    def __init__(self, unet: torch.nn.Module, branch: Branch, added: tuple[str, ...] = ()):
        super().__init__()
        self.unet = unet
        self.layers = UNetLayers(unet, branch)
        self.added = added

    def forward(self, sample, timestep, encoder_hidden_states, *rest):
        added, residuals = rest[:len(self.added)], rest[len(self.added):]
        return self.layers.full(sample, timestep, encoder_hidden_states, dict(zip(self.added, added)) or None,
                                residuals)


class StepCacheShallowModule(torch.nn.Module):
    """unet_shallow: the outer layers on (sample, timestep, encoder_hidden_states, *added conditioning,
    deep_feature)."""

    def __init__(self, unet: torch.nn.Module, branch: Branch, added: tuple[str, ...] = ()):
        super().__init__()
        self.unet = unet
        self.layers = UNetLayers(unet, branch)
        self.added = added

    def forward(self, sample, timestep, encoder_hidden_states, *rest):
        added, feature = rest[:-1], rest[-1]
        return (self.layers.shallow(sample, timestep, encoder_hidden_states, dict(zip(self.added, added)) or None,
                                    feature),)


def deep_feature(axes: Axes, branch: Branch) -> TensorSpec:
    """The input of the up layer at `branch`: its spatial size follows the latent's at the branch's depth."""
    below = 2**branch.level
    return TensorSpec(FEATURE, (axes.guided, branch.channels,
                                Axis("feature_height", "height", axes.latent_h.scale / below),
                                Axis("feature_width", "width", axes.latent_w.scale / below)))


def _step_cache_spec(plain: ComponentSpec, ref: ModuleRef, branch: int, name: str,
                     build_module: Callable[..., torch.nn.Module]) -> tuple[ComponentSpec, Branch]:
    """The plain U-Net's spec (the same inputs and weights) made into a step-cache graph: the branch is
    part of its architecture; int8 quantizes its weights only (calibration records the plain U-Net)."""
    geometry = Branch.of(ref.config, branch)
    residuals = set(residual_names(len(plain.input_names)))
    # after sample, timestep and encoder_hidden_states; a ControlNet's residuals, where taken, come last
    added = tuple(n for n in plain.input_names[3:] if n not in residuals)
    controlled = any(n in residuals for n in plain.input_names)
    spec = dataclasses.replace(plain, name=name, load_module=lambda: build_module(ref.load(), geometry, added),
                               config={**plain.config, "kasoku_step_cache": {"graph": name, "branch": branch,
                                                                             "controlnet_residuals": controlled}},
                               int8="weights")
    return spec, geometry


def unet_full_spec(plain: ComponentSpec, ref: ModuleRef, axes: Axes, branch: int) -> ComponentSpec:
    """unet_full of the U-Net whose plain spec is `plain` (unet_controlnet's in a ControlNet pipeline: it takes the
    residuals too)."""
    spec, geometry = _step_cache_spec(plain, ref, branch, FULL, StepCacheFullModule)
    return dataclasses.replace(spec, outputs=(*spec.outputs, deep_feature(axes, geometry)))


def unet_shallow_spec(plain: ComponentSpec, ref: ModuleRef, axes: Axes, branch: int) -> ComponentSpec:
    """unet_shallow of the U-Net whose plain spec is `plain`."""
    spec, geometry = _step_cache_spec(plain, ref, branch, SHALLOW, StepCacheShallowModule)
    return dataclasses.replace(spec, inputs=(*spec.inputs, deep_feature(axes, geometry)))
