"""diffusers' SD3Transformer2DModel: the MMDiT denoiser of Stable Diffusion 3 and 3.5.

One graph, ``transformer``: (hidden_states, timestep, encoder_hidden_states, pooled_projections) ->
out_sample. The latents go in as the VAE makes them (16 channels at 1/8 of the image); the transformer
patches them itself (2x2) and crops its positional embedding to their size, so height and width stay
dynamic. The text embeddings are the CLIP encoders' penultimate states beside T5's, `77 + text tokens` long,
and the pooled projection is both CLIP encoders' projected embeddings side by side. SD3.5's dual-attention
layers and QK RMS norm are part of the config and export as they run. With an IP-Adapter loaded (InstantX's
kind: a timestep-aware resampler over SigLIP's hidden states, an image key/value in every attention) it takes
the image encoding and one scale per attention layer after those (see :mod:`.ip_adapter`).

``transformer_controlnet`` is the same transformer taking an SD3 ControlNet's block samples (see
:mod:`.sd3_controlnet`) after its own inputs: one ``controlnet_block_<i>`` per ControlNet block, each a
(rows, height / 2, width / 2, width) grid of tokens, which diffusers adds after the transformer's blocks.
"""

from __future__ import annotations

import torch

from ..core.components import Axis, ComponentSpec, ShapeProfile, TensorSpec
from ..core.standins import EngineModule, InvalidInput, call_state, timesteps_for
from . import blockcache, ip_adapter
from .base import Axes, ModuleRef, attention_width

INPUTS = ("hidden_states", "timestep", "encoder_hidden_states", "pooled_projections")
CONTROLLED = "transformer_controlnet"  # the transformer of a ControlNet pipeline: it takes the block samples
CONTROLNET_BLOCK = "controlnet_block_{}"


def token_grid(name: str, config, axes: Axes) -> TensorSpec:
    """A (rows, height / patch, width / patch, width) grid of image tokens of a transformer of `config`: what
    crosses between graphs (tokens in diffusers' row-major order)."""
    scale = axes.vae_scale / config["patch_size"]
    return TensorSpec(name, (axes.guided, Axis("token_height", "height", scale), Axis("token_width", "width", scale),
                             attention_width(config)))


def denoiser_inputs(config, axes: Axes, text_length: int) -> tuple[TensorSpec, ...]:
    """(hidden_states, timestep, encoder_hidden_states, pooled_projections) as a transformer of `config` (or its
    ControlNet) takes them."""
    return (
        TensorSpec("hidden_states", (axes.guided, config.in_channels, axes.latent_h, axes.latent_w)),
        TensorSpec("timestep", (axes.guided,), always_fp32=True),
        TensorSpec("encoder_hidden_states", (axes.guided, text_length, config.joint_attention_dim)),
        TensorSpec("pooled_projections", (axes.guided, config.pooled_projection_dim)),
    )


def as_grid(tokens: torch.Tensor, latents: torch.Tensor, patch: int) -> torch.Tensor:
    """(rows, tokens, width) image tokens as the grid of the latents' patches (see :func:`token_grid`)."""
    return tokens.reshape(tokens.shape[0], latents.shape[-2] // patch, latents.shape[-1] // patch, tokens.shape[-1])


class SD3TransformerModule(torch.nn.Module):
    """The transformer on (hidden_states, timestep, encoder_hidden_states, pooled_projections, *the ControlNet's
    block samples as token grids, *the IP-Adapter's inputs)."""

    def __init__(self, transformer: torch.nn.Module, adapters: int = 0, control_blocks: int = 0):
        super().__init__()
        self.transformer = transformer
        self.adapters = adapters
        self.control_blocks = control_blocks

    def forward(self, hidden_states, timestep, encoder_hidden_states, pooled_projections, *rest):
        control, ip = rest[:self.control_blocks], rest[self.control_blocks:]
        arguments = dict(hidden_states=hidden_states, timestep=timestep, encoder_hidden_states=encoder_hidden_states,
                         pooled_projections=pooled_projections, return_dict=False,
                         block_controlnet_hidden_states=[grid.flatten(1, 2) for grid in control] or None)
        if not self.adapters:
            return (self.transformer(**arguments)[0],)
        _, (ip_embeds,), ip_scale = ip_adapter.split_inputs(ip, self.adapters)
        with ip_adapter.run_time_scales(self.transformer, ip_scale):
            return (self.transformer(**arguments, joint_attention_kwargs={"ip_adapter_image_embeds": ip_embeds})[0],)


def transformer_spec(ref: ModuleRef, profile: ShapeProfile, axes: Axes, *, text_length: int,
                     ip: tuple[TensorSpec, ...] = (), control_blocks: int = 0,
                     name: str = "transformer") -> ComponentSpec:
    """The transformer at `ref` on `text_length` text tokens (CLIP's and T5's together); `control_blocks` the
    ControlNet block samples it takes (0: none); `ip` its IP-Adapter's inputs (see
    :func:`kasoku.architectures.ip_adapter.embeds_inputs`)."""
    config = ref.config
    adapters = sum(1 for t in ip if t.name != ip_adapter.IP_SCALE)
    return ComponentSpec(
        name=name,
        inputs=(
            *denoiser_inputs(config, axes, text_length),
            *(token_grid(CONTROLNET_BLOCK.format(i), config, axes) for i in range(control_blocks)),
            *ip,
        ),
        outputs=(TensorSpec("out_sample", (axes.guided, config.out_channels, axes.latent_h, axes.latent_w)),),
        profile=profile,
        load_module=lambda: SD3TransformerModule(ref.load(), adapters, control_blocks),
        **ip_adapter.weights_and_config(ref, ip),
        graph_kind="mmdit",
        modules=(ref.path,),
        int8="weights" if ip else "full",  # as the U-Net's: calibration records no image prompts
        takes_lora=True,
    )


# ---- the first-block cache's graphs (kasoku.core.step_cache) ------------------------------------------------------


class SD3Layers:
    """SD3Transformer2DModel block by block (diffusers 0.42's forward: patch and position embedding, time and
    pooled text embedding, context embedding, the joint blocks, final norm, projection, unpatchify), without
    ControlNet residuals, skipped layers or image prompts. Image tokens cross graphs as a (rows, height / 2,
    width / 2, width) grid."""

    def __init__(self, transformer: torch.nn.Module):
        self.transformer = transformer
        self.blocks = len(transformer.transformer_blocks)

    def context(self, inputs):
        return {"temb": self.transformer.time_text_embed(inputs["timestep"], inputs["pooled_projections"])}

    def embed(self, inputs):
        latents = inputs["hidden_states"]
        patch = self.transformer.config.patch_size
        grid = (latents.shape[-2] // patch, latents.shape[-1] // patch)
        hidden = self.transformer.pos_embed(latents).contiguous()
        return hidden, self.transformer.context_embedder(inputs["encoder_hidden_states"]), grid

    def block(self, index, hidden, encoder, context):
        return self.transformer.transformer_blocks[index](hidden_states=hidden, encoder_hidden_states=encoder,
                                                          temb=context["temb"], joint_attention_kwargs=None)

    def output(self, hidden, context, grid):
        t = self.transformer
        hidden = t.proj_out(t.norm_out(hidden, context["temb"]))
        patch, channels = t.config.patch_size, t.out_channels
        height, width = grid
        hidden = hidden.reshape(hidden.shape[0], height, width, patch, patch, channels)
        hidden = torch.einsum("nhwpqc->nchpwq", hidden)
        return hidden.reshape(hidden.shape[0], channels, height * patch, width * patch)

    def to_graph(self, hidden, grid):
        return hidden.reshape(hidden.shape[0], grid[0], grid[1], hidden.shape[-1])

    def from_graph(self, hidden):
        return hidden.flatten(1, 2), (hidden.shape[1], hidden.shape[2])


def block_cache_specs(plain: ComponentSpec, ref: ModuleRef, axes: Axes) -> dict[str, ComponentSpec]:
    """transformer_first and transformer_rest of the transformer whose plain spec is `plain`."""
    hidden = token_grid("tokens", ref.config, axes)
    encoder = TensorSpec("text_tokens", (axes.guided, plain.inputs[2].dims[1], hidden.dims[-1]))
    return {blockcache.FIRST: blockcache.first_block_spec(plain, hidden, encoder, SD3Layers, ref.load),
            blockcache.REST: blockcache.rest_blocks_spec(plain, hidden, encoder, SD3Layers, ref.load)}


class EngineSD3Transformer(EngineModule):
    """The transformer as diffusers' SD3 pipelines call it."""

    def __init__(self, original: torch.nn.Module, engines, times, component: str = "transformer"):
        super().__init__(original, engines, times, component)
        self._original = original  # its IP processors hold the scale diffusers' set_ip_adapter_scale sets
        self._step_cache = None

    @property
    def attn_processors(self):
        """diffusers' SD3 pipelines read the IP scale here (is_ip_adapter_active)."""
        return self._original.attn_processors

    def forward(self, hidden_states, encoder_hidden_states=None, pooled_projections=None, timestep=None,
                block_controlnet_hidden_states=None, joint_attention_kwargs=None, return_dict=True, skip_layers=None):
        attention = dict(joint_attention_kwargs or {})
        ip_embeds = attention.pop("ip_adapter_image_embeds", None)
        if skip_layers is not None or attention:
            raise InvalidInput("the compiled SD3 transformer takes the latents, timestep, text embeddings, pooled "
                               "projections, a ControlNet's block samples and an image prompt only (no skip-layer "
                               "guidance or LoRA scale).")
        feeds = dict(hidden_states=hidden_states, timestep=timesteps_for(timestep, hidden_states.shape[0]),
                     encoder_hidden_states=encoder_hidden_states,
                     pooled_projections=pooled_projections.to(torch.float32),
                     **self._control_feeds(block_controlnet_hidden_states, hidden_states),
                     **self._ip_feeds(ip_embeds, hidden_states.shape[0]))
        run = self._step_cache
        out = self._run(self._component, **feeds)["out_sample"] if run is None else run.denoise(self, feeds)
        if not return_dict:
            return (out,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=out)

    def step_cache(self, run):
        """Step caching for one pipeline call (None: none; see kasoku.core.step_cache); its state goes with the call."""
        return call_state(self, "_step_cache", run)

    def _control_feeds(self, samples, latents) -> dict[str, torch.Tensor]:
        """A ControlNet's block samples as the engine's token grids."""
        names = [name for name in self.engine.spec.input_names if name.startswith(CONTROLNET_BLOCK.format(""))]
        if samples is None:
            return {}
        if not names:
            raise InvalidInput("this SD3 transformer was compiled without a ControlNet; compile the ControlNet "
                               "pipeline (`controlnet=`) so that kasoku builds the transformer_controlnet engine.")
        if len(samples) != len(names):
            raise InvalidInput(f"the compiled SD3 transformer takes {len(names)} ControlNet block samples but was "
                               f"given {len(samples)}.")
        patch = self.config.patch_size
        return {name: as_grid(sample, latents, patch) for name, sample in zip(names, samples)}

    def _ip_feeds(self, ip_embeds, rows: int) -> dict[str, torch.Tensor]:
        """The image prompt's encoding and scales; diffusers passes none while every scale is 0 (its processors
        then skip the image attention), which an engine with IP inputs computes from zeros at scale 0."""
        names = self.engine.spec.input_names
        if ip_embeds is not None or ip_adapter.IP_SCALE not in names:
            return ip_adapter.engine_feeds(self._original, names, None if ip_embeds is None else [ip_embeds],
                                           what="transformer")
        spec = next(t for t in self.engine.spec.inputs if t.name == ip_adapter.IP_EMBEDS.format(0))
        feeds = ip_adapter.engine_feeds(self._original, names, [torch.zeros((rows, *spec.dims[1:]))],
                                        what="transformer")
        feeds[ip_adapter.IP_SCALE].zero_()
        return feeds
