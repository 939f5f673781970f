"""CLIP text encoders (transformers' CLIPTextModel and CLIPTextModelWithProjection).

One graph per encoder, token ids in, the outputs its family's pipeline reads out:

- ``last_hidden_state`` and ``pooler_output``: what SD 1.x/2.x read (out[0]);
- ``penultimate_hidden_state``: the hidden states before the last layer, which SDXL (and SD3) read as
  ``hidden_states[-2]``;
- ``text_embeds``: the projected pooled embedding of a CLIPTextModelWithProjection.

The pipelines encode the prompts and the negative prompts in separate calls: one row per image.
"""

from __future__ import annotations

import torch

from ..core.components import ComponentSpec, ShapeProfile, TensorSpec
from ..core.standins import EngineModule, InvalidInput
from .base import Axes, ModuleRef

LAST_HIDDEN = ("last_hidden_state", "pooler_output")  # SD 1.x / 2.x
PENULTIMATE = ("penultimate_hidden_state",)  # SDXL's first encoder
PROJECTED_PENULTIMATE = ("text_embeds", "penultimate_hidden_state")  # SDXL's second encoder, SD3's both
POOLED = ("pooler_output",)  # Flux's CLIP: the pooled embedding only
TOKENS = 77  # what every CLIP text encoder of these pipelines reads (where a pipeline has no tokenizer to say so)


class TextEncoderModule(torch.nn.Module):
    """A CLIP text encoder returning the named outputs the family's pipeline reads."""

    def __init__(self, text_encoder: torch.nn.Module, outputs: tuple[str, ...]):
        super().__init__()
        self.text_encoder = text_encoder
        self.output_names = outputs

    def forward(self, input_ids: torch.Tensor):
        hidden_states = "penultimate_hidden_state" in self.output_names
        out = self.text_encoder(input_ids, output_hidden_states=hidden_states, return_dict=True)
        values = {"penultimate_hidden_state": lambda: out.hidden_states[-2]}
        return tuple(values[name]() if name in values else getattr(out, name) for name in self.output_names)


def output_specs(config, outputs: tuple[str, ...], length: int, axes: Axes) -> tuple[TensorSpec, ...]:
    """The tensors of the named outputs of an encoder of this config on `length` tokens."""
    shapes = {
        "last_hidden_state": (axes.rows, length, config.hidden_size),
        "penultimate_hidden_state": (axes.rows, length, config.hidden_size),
        "pooler_output": (axes.rows, config.hidden_size),
        "text_embeds": (axes.rows, getattr(config, "projection_dim", config.hidden_size)),
    }
    return tuple(TensorSpec(name, shapes[name]) for name in outputs)


def text_encoder_spec(name: str, ref: ModuleRef, profile: ShapeProfile, axes: Axes, *, length: int,
                      outputs: tuple[str, ...]) -> ComponentSpec:
    """The encoder at `ref` on `length` token ids (its tokenizer's model_max_length), with `outputs`."""
    config = ref.config
    return ComponentSpec(
        name=name,
        inputs=(TensorSpec("input_ids", (axes.rows, length), torch.int64, high=config.vocab_size),),
        outputs=output_specs(config, outputs, length, axes),
        profile=profile,
        load_module=lambda: TextEncoderModule(ref.load(), outputs),
        weights=ref.digest,
        config={**config.to_dict(), "kasoku_outputs": outputs},
        graph_kind="clip",
        modules=(ref.path,),
        takes_lora=True,
    )


class EngineTextEncoder(EngineModule):
    """SD 1.x/2.x: diffusers reads out[0], the last hidden state."""

    def forward(self, input_ids, attention_mask=None, output_hidden_states=None, return_dict=None, **kwargs):
        if output_hidden_states:
            raise InvalidInput("`clip_skip` needs the text encoder's hidden states, which compiled engines do not "
                               "return; call without clip_skip.")
        out = self._run(self._component, input_ids=input_ids.to(torch.int64))
        return tuple(out[name] for name in self.engine.spec.output_names)


class _PenultimateOnly(tuple):
    """The hidden states a pipeline that reads the penultimate layer gets: only that layer (index -2) is there."""

    def __getitem__(self, index):
        if index != -2:
            raise InvalidInput("`clip_skip` needs more hidden states than the compiled text encoders return "
                               "(the penultimate layer only); call without clip_skip.")
        return tuple.__getitem__(self, 0)


class _TextEncoderOutput(tuple):
    """What diffusers indexes: out[0] (the projected pooled embedding, where there is one) and .hidden_states."""

    hidden_states = None


class PenultimateTextEncoder(EngineTextEncoder):
    """SDXL calls its encoders with output_hidden_states and reads hidden_states[-2] (and out[0] of the one with
    a projection)."""

    def forward(self, input_ids, attention_mask=None, output_hidden_states=None, return_dict=None, **kwargs):
        out = self._run(self._component, input_ids=input_ids.to(torch.int64))
        first = out["text_embeds"] if "text_embeds" in out else out["penultimate_hidden_state"]
        result = _TextEncoderOutput((first,))
        result.hidden_states = _PenultimateOnly((out["penultimate_hidden_state"],))
        return result


class PooledTextEncoder(EngineTextEncoder):
    """Flux reads `.pooler_output` of its CLIP encoder's output."""

    def forward(self, input_ids, attention_mask=None, output_hidden_states=None, return_dict=None, **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        if output_hidden_states:
            raise InvalidInput("`clip_skip` needs the text encoder's hidden states, which compiled engines do not "
                               "return; call without clip_skip.")
        out = self._run(self._component, input_ids=input_ids.to(torch.int64))
        return BaseModelOutputWithPooling(pooler_output=out["pooler_output"])


def stand_in_for(outputs: tuple[str, ...]) -> type[EngineTextEncoder]:
    """The stand-in that returns `outputs` as the family's pipeline reads them."""
    if "penultimate_hidden_state" in outputs:
        return PenultimateTextEncoder
    return PooledTextEncoder if outputs == POOLED else EngineTextEncoder
