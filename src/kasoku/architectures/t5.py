"""T5's encoder (transformers' T5EncoderModel): the long-prompt text encoder of SD3 and Flux.

One graph: token ids in (as many as the pipeline's `max_sequence_length`, fixed by the profile's text tokens),
the last hidden state out. The pipelines read out[0].
"""

from __future__ import annotations

import torch

from ..core.components import ComponentSpec, ShapeProfile, TensorSpec
from ..core.standins import EngineModule
from .base import Axes, ModuleRef


class T5EncoderModule(torch.nn.Module):
    """A T5 encoder returning its last hidden state."""

    def __init__(self, encoder: torch.nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor):
        return (self.encoder(input_ids, return_dict=True).last_hidden_state,)


def t5_spec(name: str, ref: ModuleRef, profile: ShapeProfile, axes: Axes, *, length: int) -> ComponentSpec:
    """The encoder at `ref` on `length` token ids."""
    config = ref.config
    return ComponentSpec(
        name=name,
        inputs=(TensorSpec("input_ids", (axes.rows, length), torch.int64, high=config.vocab_size),),
        outputs=(TensorSpec("last_hidden_state", (axes.rows, length, config.d_model)),),
        profile=profile,
        load_module=lambda: T5EncoderModule(ref.load()),
        weights=ref.digest,
        config={**config.to_dict(), "kasoku_outputs": ("last_hidden_state",)},
        graph_kind="t5",
        modules=(ref.path,),
        takes_lora=False,
    )


class EngineT5Encoder(EngineModule):
    """diffusers reads out[0], the last hidden state."""

    def forward(self, input_ids, attention_mask=None, output_hidden_states=None, return_dict=None, **kwargs):
        out = self._run(self._component, input_ids=input_ids.to(torch.int64))
        return (out["last_hidden_state"],)
