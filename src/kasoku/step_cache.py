"""Step caching inside the engines: DeepCache (Ma, Fang and Wang, "DeepCache: Accelerating Diffusion
Models for Free", CVPR 2024).

A U-Net's deep features change little from one denoising step to the next. On a *full* step the
whole U-Net runs and the input of the up layer at a chosen skip branch (the *deep feature*) is kept;
on the other steps only the outer layers run: the down layers up to that branch (so its skip feature
is computed fresh) and the up layers from that branch outwards, on the deep feature of the last full
step. kasoku builds this into the engines as two components from the same weights, exported,
optimized, built, cached and parity-checked like every other component:

- ``unet_full``: the whole U-Net, returning its noise prediction and the deep feature;
- ``unet_shallow``: the outer layers, taking the deep feature as one more input.

Branches are the U-Net's skip connections counted from the outside in: branch 0 is conv_in's output,
which the last layer of the last up block reads; the deepest branch is the last down layer's output.
Branch 0 is the reference implementation's default (DeepCache's ``cache_branch_id``; for U-Nets with
two layers per block, as SD 1.x/2.x/XL have, branch b is its (block, layer) = (b // 3, b % 3)).

A schedule says which steps of one call's denoising loop are full (the first always is):
``uniform`` (the paper's 1:N: every `interval`-th step) or ``nonuniform`` (the paper's non-uniform
1:N, Section 3.3: as many full steps, denser around a centre step; see :func:`full_steps`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import KasokuError

FULL = "unet_full"
SHALLOW = "unet_shallow"
COMPONENTS = (FULL, SHALLOW)
FEATURE = "deep_feature"
DEFAULT_BRANCH = 0  # the outermost skip branch: the reference implementation's default
SCHEDULES = ("uniform", "nonuniform")
DEFAULT_SCHEDULE = "uniform"
NONUNIFORM_POWER = 1.4  # the reference's p
NONUNIFORM_CENTER = 0.3  # c as a share of the loop: the reference's c = 15 of 50 steps

# The block types whose layers kasoku runs one by one (every SD 1.x, 2.x and XL U-Net's).
DOWN_BLOCKS = ("CrossAttnDownBlock2D", "DownBlock2D")
UP_BLOCKS = ("CrossAttnUpBlock2D", "UpBlock2D")
MID_BLOCKS = ("UNetMidBlock2DCrossAttn", "UNetMidBlock2D", None)


class InvalidStepCache(KasokuError, ValueError):
    """A step-caching setting that cannot be served (an interval, schedule or branch)."""


def check_interval(value: Any, name: str = "cache_interval") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidStepCache(f"`{name}` must be a positive int (1: every step runs the whole U-Net, no "
                               f"caching) but is {value!r}.")
    return value


def check_schedule(value: Any, name: str = "cache_schedule") -> str:
    if value not in SCHEDULES:
        raise InvalidStepCache(f"`{name}` must be one of {', '.join(SCHEDULES)} but is {value!r}.")
    return value


# ---- schedules ---------------------------------------------------------------------------------


def full_steps(length: int, interval: int, schedule: str = DEFAULT_SCHEDULE) -> tuple[int, ...]:
    """The steps (0-based) of a `length`-step denoising loop that run the whole U-Net.

    uniform: 0, N, 2N, ... (the paper's 1:N). nonuniform: the paper's non-uniform 1:N (Section 3.3),
    with as many full steps k = ceil(T / N) as the uniform schedule: i_k = l_k^p + c for l_k evenly
    spaced over [(-c)^(1/p), (T - c)^(1/p)) (signed powers), made integers and distinct, so full steps
    are densest around the centre step c = 0.3 T and sparser away from it; p starts at 1.4 and is
    lowered by 0.02 until the k integers are distinct, as the reference does (p = 1 always is: evenly
    spaced steps). The reference code raises negative numbers to fractional powers in complex numbers;
    kasoku computes the paper's formula with signed real powers."""
    check_interval(interval)
    check_schedule(schedule, "schedule")
    if interval == 1 or length <= 1:
        return tuple(range(length))
    if schedule == "uniform":
        return tuple(range(0, length, interval))
    return _nonuniform(length, math.ceil(length / interval))


def _signed_power(value: float, power: float) -> float:
    return math.copysign(abs(value) ** power, value)


def _nonuniform(length: int, count: int) -> tuple[int, ...]:
    center = round(NONUNIFORM_CENTER * length)
    for hundredths in range(round(NONUNIFORM_POWER * 100), 99, -2):
        power = hundredths / 100
        start, end = _signed_power(-center, 1 / power), _signed_power(length - center, 1 / power)
        points = (start + (end - start) * k / count for k in range(count))
        # the small epsilon keeps an integer that float rounding put just below itself
        steps = {0} | {min(length - 1, max(0, math.floor(_signed_power(x, power) + center + 1e-9))) for x in points}
        if len(steps) == count:
            return tuple(sorted(steps))
    raise AssertionError("unreachable: at p = 1 the steps are evenly spaced and distinct")


@dataclass
class StepCacheRun:
    """One pipeline call's step caching: the schedule, the step counter and the deep feature of the
    last full step. `loop_length` gives the number of U-Net calls of the call's denoising loop; it is
    read at the first step (a pipeline knows it only once its timesteps are set)."""

    interval: int
    schedule: str
    loop_length: Callable[[], int]
    step: int = 0
    feature: torch.Tensor | None = field(default=None, repr=False)
    full: frozenset[int] | None = None

    def next_is_full(self) -> bool:
        """Whether the next step runs the whole U-Net (and count it)."""
        if self.full is None:
            self.full = frozenset(full_steps(self.loop_length(), self.interval, self.schedule))
        full = self.feature is None or self.step in self.full
        self.step += 1
        return full


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
        forward_sizes = any(d % 2**unet.num_upsamplers != 0 for d in sample.shape[-2:])
        if unet.config.center_input_sample:
            sample = 2 * sample - 1.0
        emb = unet.time_embedding(unet.get_time_embed(sample=sample, timestep=timestep), None)
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

    def full(self, sample, timestep, ehs, added=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole U-Net: (noise prediction, the deep feature at the branch)."""
        emb, ehs, h, sizes = self.prologue(sample, timestep, ehs, added)
        h, skips = self.down_path(h, emb, ehs, len(self.down))
        h = self.mid(h, emb, ehs)
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


# ---- the two components' torch modules (a family with added conditioning subclasses them) ----------


class StepCacheFullModule(torch.nn.Module):
    """unet_full: the whole U-Net on (sample, timestep, encoder_hidden_states), returning the noise
    prediction and the deep feature."""

    def __init__(self, unet: torch.nn.Module, branch: Branch):
        super().__init__()
        self.unet = unet
        self.layers = UNetLayers(unet, branch)

    def forward(self, sample, timestep, encoder_hidden_states):
        return self.layers.full(sample, timestep, encoder_hidden_states)


class StepCacheShallowModule(torch.nn.Module):
    """unet_shallow: the outer layers on (sample, timestep, encoder_hidden_states, deep_feature)."""

    def __init__(self, unet: torch.nn.Module, branch: Branch):
        super().__init__()
        self.unet = unet
        self.layers = UNetLayers(unet, branch)

    def forward(self, sample, timestep, encoder_hidden_states, deep_feature):
        return (self.layers.shallow(sample, timestep, encoder_hidden_states, None, deep_feature),)
