"""diffusers' FluxTransformer2DModel: the denoiser of Flux.1 (schnell and dev).

One graph, ``transformer``: (hidden_states, timestep, encoder_hidden_states, pooled_projections, img_ids,
txt_ids[, guidance]) -> out_sample. Flux packs the latents in 2x2 patches before the transformer sees
them: ``hidden_states`` is (images, height/16 x width/16 tokens, 64), its token count one axis of the
product of the image's height and width, as are the image position ids (tokens, 3). The text ids are
(text tokens, 3). dev embeds its guidance scale (``guidance``, one per image; ``guidance_embeds`` in its
config), schnell has none. Classifier-free guidance, where asked (``true_cfg_scale``), runs the transformer
twice, so every input has one row per image. With IP-Adapters loaded (the plain kind, in the double-stream
blocks) it takes their image encodings and per-layer scales after those (see :mod:`.ip_adapter`).

``transformer_controlnet`` is the same transformer taking a Flux ControlNet's samples (see
:mod:`.flux_controlnet`) after its own inputs: one ``controlnet_block_<i>`` per double-stream and one
``controlnet_single_block_<i>`` per single-stream ControlNet block, packed tokens as its latents are.
"""

from __future__ import annotations

import torch

from ..core.components import Axis, ComponentSpec, ShapeProfile, TensorSpec, default_sample_input
from ..core.standins import EngineModule, InvalidInput, call_state, timesteps_for
from . import blockcache, ip_adapter
from .base import Axes, ModuleRef, attention_width

PATCH = 2  # Flux packs 2x2 latent cells into one token
CONTROLLED = "transformer_controlnet"  # the transformer of a ControlNet pipeline: it takes the block samples
CONTROLNET_BLOCK = "controlnet_block_{}"
CONTROLNET_SINGLE_BLOCK = "controlnet_single_block_{}"


def image_tokens(axes: Axes) -> Axis:
    """The packed latents' token count: (height / (8 x 2)) x (width / (8 x 2))."""
    return Axis("image_tokens", ("height", "width"), axes.vae_scale * axes.vae_scale / PATCH**2)


class FluxTransformerModule(torch.nn.Module):
    """The transformer on (hidden_states, timestep, encoder_hidden_states, pooled_projections, img_ids, txt_ids
    [, guidance])."""

    def __init__(self, transformer: torch.nn.Module, adapters: int = 0, control_blocks: tuple[int, int] = (0, 0)):
        super().__init__()
        self.transformer = transformer
        self.adapters = adapters
        self.control_blocks = control_blocks  # the ControlNet's double- and single-stream samples it takes

    def forward(self, hidden_states, timestep, encoder_hidden_states, pooled_projections, img_ids, txt_ids, *rest):
        double, single = self.control_blocks
        guidance, rest = (rest[:1], rest[1:]) if self.transformer.config.guidance_embeds else ((), rest)
        control, single_control, rest = rest[:double], rest[double:double + single], rest[double + single:]
        _, ip_embeds, ip_scale = ip_adapter.split_inputs(rest, self.adapters)
        arguments = dict(hidden_states=hidden_states, timestep=timestep, guidance=guidance[0] if guidance else None,
                         encoder_hidden_states=encoder_hidden_states, pooled_projections=pooled_projections,
                         img_ids=img_ids, txt_ids=txt_ids, return_dict=False,
                         controlnet_block_samples=list(control) or None,
                         controlnet_single_block_samples=list(single_control) or None)
        if not self.adapters:
            return (self.transformer(**arguments)[0],)
        with ip_adapter.run_time_scales(self.transformer, ip_scale):
            return (self.transformer(**arguments, joint_attention_kwargs={"ip_adapter_image_embeds": ip_embeds})[0],)


def token_samples(name: str, count: int, width: int, axes: Axes) -> tuple[TensorSpec, ...]:
    """`count` ControlNet samples (images, image tokens, `width`), packed as the latents are."""
    return tuple(TensorSpec(name.format(i), (axes.images, image_tokens(axes), width)) for i in range(count))


def denoiser_inputs(config, axes: Axes, text_length: int) -> tuple[TensorSpec, ...]:
    """(hidden_states, timestep, encoder_hidden_states, pooled_projections, img_ids, txt_ids[, guidance]) as a
    transformer of `config` (or its ControlNet: guidance where it embeds one) takes them."""
    tokens = image_tokens(axes)
    guidance = (TensorSpec("guidance", (axes.images,), always_fp32=True),) if config.guidance_embeds else ()
    return (
        TensorSpec("hidden_states", (axes.images, tokens, config.in_channels)),
        TensorSpec("timestep", (axes.images,), always_fp32=True),
        TensorSpec("encoder_hidden_states", (axes.images, text_length, config.joint_attention_dim)),
        TensorSpec("pooled_projections", (axes.images, config.pooled_projection_dim)),
        TensorSpec("img_ids", (tokens, 3), always_fp32=True),
        TensorSpec("txt_ids", (text_length, 3), always_fp32=True),
        *guidance,
    )


def transformer_spec(ref: ModuleRef, profile: ShapeProfile, axes: Axes, *, text_length: int,
                     ip: tuple[TensorSpec, ...] = (), control_blocks: tuple[int, int] = (0, 0),
                     name: str = "transformer") -> ComponentSpec:
    """The transformer at `ref` on `text_length` T5 tokens; `control_blocks` the ControlNet's double- and
    single-stream samples it takes ((0, 0): none); `ip` its IP-Adapters' inputs (see
    :func:`kasoku.architectures.ip_adapter.embeds_inputs`)."""
    config = ref.config
    width = attention_width(config)
    adapters = sum(1 for t in ip if t.name != ip_adapter.IP_SCALE)
    return ComponentSpec(
        name=name,
        inputs=(
            *denoiser_inputs(config, axes, text_length),
            *token_samples(CONTROLNET_BLOCK, control_blocks[0], width, axes),
            *token_samples(CONTROLNET_SINGLE_BLOCK, control_blocks[1], width, axes),
            *ip,
        ),
        outputs=(TensorSpec("out_sample", (axes.images, image_tokens(axes),
                                           config.out_channels or config.in_channels)),),
        profile=profile,
        load_module=lambda: FluxTransformerModule(ref.load(), adapters, control_blocks),
        sample_input=sample_input,
        **ip_adapter.weights_and_config(ref, ip),
        graph_kind="mmdit",
        modules=(ref.path,),
        int8="weights" if ip else "full",  # as the U-Net's: calibration records no image prompts
        takes_lora=True,
    )


def sample_input(tensor: TensorSpec, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Flux's timesteps are fractions of the schedule (diffusers divides by 1000), its guidance a scale around
    3.5 and its position ids small integers."""
    if tensor.name == "timestep":
        return torch.rand(shape, generator=generator)
    if tensor.name == "guidance":
        return 1.0 + torch.rand(shape, generator=generator) * 4.0
    if tensor.name in ("img_ids", "txt_ids"):
        return torch.randint(0, 16, shape, generator=generator).to(torch.float32)
    return default_sample_input(tensor, shape, generator)


# ---- the first-block cache's graphs (kasoku.core.step_cache) ------------------------------------------------------


class FluxLayers:
    """FluxTransformer2DModel block by block (diffusers 0.42's forward: x and context embedders, time, guidance
    and pooled text embedding, rotary embedding of the text and image ids, the double-stream blocks, then the
    single-stream ones, final norm and projection), without ControlNet residuals or image prompts. Image tokens
    cross graphs packed, as its latents are."""

    def __init__(self, transformer: torch.nn.Module):
        self.transformer = transformer
        self.double = len(transformer.transformer_blocks)
        self.blocks = self.double + len(transformer.single_transformer_blocks)

    def context(self, inputs):
        t = self.transformer
        timestep = inputs["timestep"] * 1000  # as diffusers: the pipeline passes a fraction of the schedule
        guidance = inputs.get("guidance")
        temb = t.time_text_embed(timestep, inputs["pooled_projections"]) if guidance is None else \
            t.time_text_embed(timestep, guidance * 1000, inputs["pooled_projections"])
        rotary = t.pos_embed(torch.cat((inputs["txt_ids"], inputs["img_ids"]), dim=0))
        return {"temb": temb, "rotary": rotary}

    def embed(self, inputs):
        t = self.transformer
        return t.x_embedder(inputs["hidden_states"]), t.context_embedder(inputs["encoder_hidden_states"]), None

    def block(self, index, hidden, encoder, context):
        t = self.transformer
        block = t.transformer_blocks[index] if index < self.double else t.single_transformer_blocks[index - self.double]
        return block(hidden_states=hidden, encoder_hidden_states=encoder, temb=context["temb"],
                     image_rotary_emb=context["rotary"], joint_attention_kwargs=None)

    def output(self, hidden, context, layout):
        return self.transformer.proj_out(self.transformer.norm_out(hidden, context["temb"]))

    def to_graph(self, hidden, layout):
        return hidden

    def from_graph(self, hidden):
        return hidden, None


def block_cache_specs(plain: ComponentSpec, ref: ModuleRef, axes: Axes) -> dict[str, ComponentSpec]:
    """transformer_first and transformer_rest of the transformer whose plain spec is `plain`."""
    hidden = TensorSpec("tokens", (axes.images, image_tokens(axes), attention_width(ref.config)))
    encoder = TensorSpec("text_tokens", (axes.images, plain.inputs[2].dims[1], hidden.dims[-1]))
    return {blockcache.FIRST: blockcache.first_block_spec(plain, hidden, encoder, FluxLayers, ref.load),
            blockcache.REST: blockcache.rest_blocks_spec(plain, hidden, encoder, FluxLayers, ref.load)}


class EngineFluxTransformer(EngineModule):
    """The transformer as diffusers' Flux pipelines call it."""

    def __init__(self, original: torch.nn.Module, engines, times, component: str = "transformer"):
        super().__init__(original, engines, times, component)
        self._original = original  # its IP processors hold the scales diffusers' set_ip_adapter_scale sets
        self._step_cache = None

    def step_cache(self, run):
        """Step caching for one pipeline call (None: none; see kasoku.core.step_cache); its state goes with the call."""
        return call_state(self, "_step_cache", run)

    def _control_feeds(self, name: str, samples) -> dict[str, torch.Tensor]:
        """A ControlNet's double- or single-stream samples (`name` their inputs' pattern) as the engine's inputs."""
        names = [n for n in self.engine.spec.input_names if n.startswith(name.format(""))]
        given = list(samples or ())
        if given and not names:
            raise InvalidInput("this Flux transformer was compiled without a ControlNet; compile the ControlNet "
                               "pipeline (`controlnet=`) so that kasoku builds the transformer_controlnet engine.")
        if len(given) != len(names):
            raise InvalidInput(f"the compiled Flux transformer takes {len(names)} ControlNet samples "
                               f"({name.format('<i>')}) but was given {len(given)}.")
        return dict(zip(names, given))

    @property
    def encoder_hid_proj(self):
        """diffusers' Flux pipelines count the IP-Adapters in the projection layers here."""
        return getattr(self._original, "encoder_hid_proj", None)

    def forward(self, hidden_states, encoder_hidden_states=None, pooled_projections=None, timestep=None,
                img_ids=None, txt_ids=None, guidance=None, joint_attention_kwargs=None, controlnet_block_samples=None,
                controlnet_single_block_samples=None, return_dict=True, controlnet_blocks_repeat=False):
        attention = dict(joint_attention_kwargs or {})
        ip_embeds = attention.pop("ip_adapter_image_embeds", None)
        if attention or controlnet_blocks_repeat:
            raise InvalidInput("the compiled Flux transformer takes the latents, timestep, text embeddings, pooled "
                               "projections, ids, guidance, a ControlNet's samples (not repeated: XLabs' kind) and "
                               "image prompts only (no LoRA scale).")
        names = self.engine.spec.input_names
        if ("guidance" in names) != (guidance is not None):
            raise InvalidInput("this Flux transformer " + ("embeds a guidance scale (Flux.1 dev): diffusers must pass "
                                                           "`guidance`" if "guidance" in names else
                                                           "has no guidance embedding (Flux.1 schnell)") + ".")
        batch = hidden_states.shape[0]
        feeds = dict(hidden_states=hidden_states, timestep=timesteps_for(timestep, batch),
                     encoder_hidden_states=encoder_hidden_states, pooled_projections=pooled_projections,
                     img_ids=img_ids.to(torch.float32), txt_ids=txt_ids.to(torch.float32))
        if guidance is not None:
            feeds["guidance"] = timesteps_for(guidance, batch)
        for name, samples in ((CONTROLNET_BLOCK, controlnet_block_samples),
                              (CONTROLNET_SINGLE_BLOCK, controlnet_single_block_samples)):
            feeds.update(self._control_feeds(name, samples))
        feeds.update(ip_adapter.engine_feeds(self._original, names, ip_embeds))
        run = self._step_cache
        out = self._run(self._component, **feeds)["out_sample"] if run is None else run.denoise(self, feeds)
        if not return_dict:
            return (out,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=out)
