"""The transformers' first-block cache graphs (see :mod:`kasoku.core.step_cache` for the method and one call's state).

Two more components of a transformer's weights, exported, built, cached and parity-checked like every
component:

- ``transformer_first``: the transformer's inputs and the cached residual of the other blocks in; the
  embeddings and the first block run, then the output (final norm, projection, unpatchify) on the first
  block's image tokens plus the cached residual. Out: that output, the image and text tokens after the first
  block (for the rest graph) and the first block's residual (the cache's signal).
- ``transformer_rest``: the tokens after the first block and the conditioning inputs (timestep, pooled
  projections; Flux's ids and guidance) in; the other blocks and the output. Out: the output and the other
  blocks' residual (cached for the steps that skip them).

An architecture says how its transformer runs block by block with a :class:`BlockLayers` (SD3's in
:mod:`.sd3`, Flux's in :mod:`.flux`), each with diffusers' own operations in the same order as its forward.
Image tokens cross between the graphs in the architecture's layout (SD3's as a grid, so the rest graph knows
the image's height and width; Flux's packed, as its latents are).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from ..core.components import ComponentSpec, TensorSpec
from ..core.step_cache import (
    CACHED_RESIDUAL,
    FIRST,
    FIRST_ENCODER,
    FIRST_HIDDEN,
    FIRST_RESIDUAL,
    REST,
    REST_RESIDUAL,
    InvalidStepCache,
)

TOKEN_INPUTS = ("hidden_states", "encoder_hidden_states")  # what the rest graph takes after the first block


class BlockLayers(Protocol):
    """A transformer run block by block. `inputs` are a graph's inputs by name; `context` what every block
    reads (the time embedding; Flux's rotary embedding); `layout` what the output needs to know of the image
    (SD3's token grid)."""

    blocks: int

    def context(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, Any]: ...

    def embed(self, inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def block(self, index: int, hidden: torch.Tensor, encoder: torch.Tensor,
              context: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def output(self, hidden: torch.Tensor, context: Mapping[str, Any], layout: Any) -> torch.Tensor: ...

    def to_graph(self, hidden: torch.Tensor, layout: Any) -> torch.Tensor: ...

    def from_graph(self, hidden: torch.Tensor) -> tuple[torch.Tensor, Any]: ...


class FirstBlockModule(torch.nn.Module):
    """transformer_first on the transformer's inputs (`names`, in order) and the cached residual."""

    def __init__(self, transformer: torch.nn.Module, layers: BlockLayers, names: tuple[str, ...]):
        super().__init__()
        self.transformer = transformer
        self.layers = layers
        self.names = names

    def forward(self, *args):
        inputs = dict(zip(self.names, args[:-1]))
        layers, cached = self.layers, args[-1]
        context = layers.context(inputs)
        hidden, encoder, layout = layers.embed(inputs)
        after_encoder, after = layers.block(0, hidden, encoder, context)
        reused, _ = layers.from_graph(cached)
        out = layers.output(after + reused, context, layout)
        return (out, layers.to_graph(after, layout), after_encoder, layers.to_graph(after - hidden, layout))


class RestBlocksModule(torch.nn.Module):
    """transformer_rest on the tokens after the first block and the conditioning inputs (`names`, in order)."""

    def __init__(self, transformer: torch.nn.Module, layers: BlockLayers, names: tuple[str, ...]):
        super().__init__()
        self.transformer = transformer
        self.layers = layers
        self.names = names

    def forward(self, first_hidden, first_encoder, *args):
        layers = self.layers
        context = layers.context(dict(zip(self.names, args)))
        start, layout = layers.from_graph(first_hidden)
        hidden, encoder = start, first_encoder
        for index in range(1, layers.blocks):
            encoder, hidden = layers.block(index, hidden, encoder, context)
        return layers.output(hidden, context, layout), layers.to_graph(hidden - start, layout)


def _check_blocks(layers: BlockLayers) -> None:
    if layers.blocks < 2:
        raise InvalidStepCache("the first-block cache needs a transformer of two blocks or more; this one has "
                               f"{layers.blocks}.")


def first_block_spec(plain: ComponentSpec, hidden: TensorSpec, encoder: TensorSpec,
                     layers: Callable[[torch.nn.Module], BlockLayers], load: Callable[[], torch.nn.Module]
                     ) -> ComponentSpec:
    """transformer_first of the transformer whose plain spec is `plain`; `hidden` and `encoder` are the image and
    text tokens after a block (their layout and axes), `layers` runs a loaded transformer block by block."""
    names = plain.input_names

    def build() -> torch.nn.Module:
        transformer = load()
        blocks = layers(transformer)
        _check_blocks(blocks)
        return FirstBlockModule(transformer, blocks, names)

    out = plain.outputs[0]
    return dataclasses.replace(
        plain, name=FIRST, inputs=(*plain.inputs, dataclasses.replace(hidden, name=CACHED_RESIDUAL)),
        outputs=(out, dataclasses.replace(hidden, name=FIRST_HIDDEN), dataclasses.replace(encoder, name=FIRST_ENCODER),
                 dataclasses.replace(hidden, name=FIRST_RESIDUAL)),
        load_module=build, config={**plain.config, "kasoku_step_cache": {"graph": FIRST}}, int8="weights")


def rest_blocks_spec(plain: ComponentSpec, hidden: TensorSpec, encoder: TensorSpec,
                     layers: Callable[[torch.nn.Module], BlockLayers], load: Callable[[], torch.nn.Module]
                     ) -> ComponentSpec:
    """transformer_rest of the transformer whose plain spec is `plain` (see :func:`first_block_spec`)."""
    conditioning = tuple(t for t in plain.inputs if t.name not in TOKEN_INPUTS)
    names = tuple(t.name for t in conditioning)

    def build() -> torch.nn.Module:
        transformer = load()
        blocks = layers(transformer)
        _check_blocks(blocks)
        return RestBlocksModule(transformer, blocks, names)

    return dataclasses.replace(
        plain, name=REST,
        inputs=(dataclasses.replace(hidden, name=FIRST_HIDDEN), dataclasses.replace(encoder, name=FIRST_ENCODER),
                *conditioning),
        outputs=(plain.outputs[0], dataclasses.replace(hidden, name=REST_RESIDUAL)),
        load_module=build, config={**plain.config, "kasoku_step_cache": {"graph": REST}}, int8="weights")
