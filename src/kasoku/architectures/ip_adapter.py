"""IP-Adapter: image prompts for a U-Net, SD3's and Flux's transformers (diffusers' `load_ip_adapter`), and the
image encoder.

The transformers hold them as diffusers does: Flux's in `encoder_hid_proj` (the plain kind) and its double-stream
blocks' processors, SD3's in `image_proj` (IPAdapterTimeImageProjection, the kind `time`: it reads the timestep)
and every attention's SD3IPAdapterJointAttnProcessor2_0, over a SiglipVisionModel's penultimate hidden states.

diffusers loads an IP-Adapter into the U-Net: an image projection per adapter (`encoder_hid_proj`, a
`MultiIPAdapterImageProjection` over an `ImageProjection` for the plain kind or an
`IPAdapterPlusImageProjection`, Plus's resampler) and, in every cross-attention, an
`IPAdapterAttnProcessor2_0` with one more key/value projection per adapter. The pipeline encodes the image
prompt with a `CLIPVisionModelWithProjection` (its projected embedding for the plain kind, its penultimate
hidden states for Plus) and hands the U-Net the encodings as ``added_cond_kwargs["image_embeds"]``.

Graphs:

- ``image_encoder``: pixel_values -> (image_embeds, penultimate_hidden_states);
- the U-Net's (``unet``, ``unet_controlnet``) take, after their own inputs, one ``ip_embeds_<i>`` per
  adapter (the encoder's output, projected inside the graph) and ``ip_scale``: one scale per IP attention
  layer and adapter, so `set_ip_adapter_scale` (per layer, as diffusers allows) changes an input, not the
  graph. Each image prompt is one image per adapter.

The adapters' projections and key/value weights are weights of the U-Net's graph like any other: a second
adapter of the same kind and size shares the graph (its architecture is the kinds and shapes, not the values).
"""

from __future__ import annotations

import contextlib
import hashlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..core.components import Axis, ComponentSpec, ShapeProfile, TensorSpec
from ..core.errors import KasokuError
from ..core.standins import EngineModule, InvalidInput
from .base import Axes, ModuleRef

IMAGE_ENCODER = "image_encoder"
IP_EMBEDS = "ip_embeds_{}"
IP_SCALE = "ip_scale"
PLAIN, PLUS = "plain", "plus"
TIME = "time"  # SD3's: a resampler that reads the timestep too (IPAdapterTimeImageProjection), on SigLIP's states
IMAGE_OUTPUTS = ("image_embeds", "penultimate_hidden_states")
# Where the adapters' weights sit in the U-Net: they stay engine inputs where the backend keeps run-time weights.
# (SD3's: its projection `image_proj`, and its processors' norms beside their key/value projections)
ADAPTER_PARTS = ("encoder_hid_proj", "to_k_ip", "to_v_ip", "image_proj", "norm_ip", "norm_ip_k", "processor.norm_q",
                 "processor.norm_k")


class UnsupportedIPAdapter(KasokuError, ValueError):
    """An IP-Adapter kind or layout kasoku cannot run on engines."""


# ---- what the U-Net holds ------------------------------------------------------------------------


def projection_layers(unet) -> tuple[torch.nn.Module, ...]:
    """The image projection of each IP-Adapter loaded into `unet` (a U-Net, or Flux's transformer: both hold them in
    `encoder_hid_proj`; none: no adapter)."""
    from diffusers.models.embeddings import IPAdapterTimeImageProjection, MultiIPAdapterImageProjection

    if unet is None:
        return ()
    if isinstance(getattr(unet, "image_proj", None), IPAdapterTimeImageProjection):  # SD3's transformer: one adapter
        return (unet.image_proj,)
    projection = getattr(unet, "encoder_hid_proj", None)
    if not isinstance(projection, MultiIPAdapterImageProjection):
        return ()
    return tuple(projection.image_projection_layers)


def adapter_kinds(unet) -> tuple[str, ...]:
    """plain or plus per loaded adapter; other kinds (FaceID, Full Face) are refused with what runs."""
    from diffusers.models.embeddings import (
        ImageProjection,
        IPAdapterPlusImageProjection,
        IPAdapterTimeImageProjection,
    )

    kinds = []
    for index, layer in enumerate(projection_layers(unet)):
        if isinstance(layer, ImageProjection):
            kinds.append(PLAIN)
        elif isinstance(layer, IPAdapterPlusImageProjection):
            kinds.append(PLUS)
        elif isinstance(layer, IPAdapterTimeImageProjection):
            kinds.append(TIME)
        else:
            raise UnsupportedIPAdapter(f"IP-Adapter {index + 1} is of the kind {type(layer).__name__}; kasoku's "
                                       "engines run the plain and Plus IP-Adapters (ImageProjection, "
                                       "IPAdapterPlusImageProjection). Run this one with diffusers.")
    return tuple(kinds)


# unet -> (its adapters' projection, its IP processors): walking every module of a full-size U-Net takes
# milliseconds, and the stand-in reads the scales on every call; a load or unload replaces the projection.
_PROCESSORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ip_processors(unet) -> tuple[tuple[str, Any], ...]:
    """(name, processor) of every IP attention processor of `unet`, in diffusers' order (attn_processors)."""
    projection = getattr(unet, "encoder_hid_proj", None)
    known = _PROCESSORS.get(unet)
    if known is not None and known[0] is projection:
        return known[1]
    found = _find_ip_processors(unet)
    _PROCESSORS[unet] = (projection, found)
    return found


def _find_ip_processors(unet) -> tuple[tuple[str, Any], ...]:
    from diffusers.models.attention_processor import (
        IPAdapterAttnProcessor,
        IPAdapterAttnProcessor2_0,
        SD3IPAdapterJointAttnProcessor2_0,
    )
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    kinds = (IPAdapterAttnProcessor, IPAdapterAttnProcessor2_0, FluxIPAdapterAttnProcessor,
             SD3IPAdapterJointAttnProcessor2_0)
    try:
        from diffusers.models.attention_processor import IPAdapterXFormersAttnProcessor

        kinds = (*kinds, IPAdapterXFormersAttnProcessor)
    except ImportError:  # an older diffusers
        pass
    return tuple((name, proc) for name, proc in unet.attn_processors.items() if isinstance(proc, kinds))


def scales_of(unet) -> torch.Tensor:
    """The scales diffusers' `set_ip_adapter_scale` set, as the ``ip_scale`` input: layers x adapters, fp32."""
    rows = []
    for name, proc in ip_processors(unet):
        row = []
        for scale in (proc.scale if isinstance(proc.scale, (list, tuple)) else [proc.scale]):  # SD3's: a number
            if isinstance(scale, (list, tuple)):  # one per image of the adapter (diffusers' masks)
                if len(scale) != 1:
                    raise InvalidInput(f"the IP-Adapter scale of {name} gives {len(scale)} values (one per image); "
                                       "the engines take one image per IP-Adapter: give one scale.")
                scale = scale[0]
            row.append(float(scale))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32)


def architecture(unet) -> dict[str, Any]:
    """What makes the adapters' graph: their kinds, every projection tensor's shape, the IP layers' tokens."""
    return {
        "kinds": list(adapter_kinds(unet)),
        "projections": [{name: list(t.shape) for name, t in layer.state_dict().items()}
                        for layer in projection_layers(unet)],
        "layers": [[name, list(getattr(proc, "num_tokens", ()))] for name, proc in ip_processors(unet)],
    }


def digest(unet) -> str:
    """The digest of the adapters' weights (projections and key/value projections), to add to the U-Net's."""
    sha = hashlib.sha256()
    tensors = {f"proj.{i}.{name}": t for i, layer in enumerate(projection_layers(unet))
               for name, t in layer.state_dict().items()}
    tensors.update({f"{name}.{key}": t for name, proc in ip_processors(unet) for key, t in proc.state_dict().items()})
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu", torch.float32).contiguous()
        sha.update(name.encode())
        sha.update(str(tuple(tensor.shape)).encode())
        sha.update(tensor.numpy().tobytes())
    return sha.hexdigest()[:32]


def embeds_inputs(unet, encoder_config, axes: Axes, batch: Axis | None = None) -> tuple[TensorSpec, ...]:
    """The denoiser's IP inputs: one image encoding per adapter (one image each), then the scales. `batch` is the
    denoiser's batch axis (default: the guided one of a U-Net; Flux's transformer runs one row per image)."""
    tokens = image_tokens(encoder_config)
    # one image per adapter: diffusers' lists hold (rows, images, ...); SD3's one tensor (rows, tokens, width)
    shapes = {PLAIN: (1, getattr(encoder_config, "projection_dim", 0)), PLUS: (1, tokens, encoder_config.hidden_size),
              TIME: (tokens, encoder_config.hidden_size)}
    kinds, rows = adapter_kinds(unet), batch or axes.guided
    return (*(TensorSpec(IP_EMBEDS.format(i), (rows, *shapes[kind])) for i, kind in enumerate(kinds)),
            TensorSpec(IP_SCALE, (len(ip_processors(unet)), len(kinds))))


def is_siglip(encoder_config) -> bool:
    """SD3's image encoder (SiglipVisionModel: hidden states only, no class token) rather than CLIP's."""
    return getattr(encoder_config, "model_type", "") == "siglip_vision_model"


def image_tokens(encoder_config) -> int:
    """The hidden states' tokens: one per patch, and CLIP's class token."""
    return (encoder_config.image_size // encoder_config.patch_size) ** 2 + (0 if is_siglip(encoder_config) else 1)


def check_fits(unet, encoder_config) -> None:
    """An adapter whose projection does not take this image encoder's output is refused before any export."""
    for index, (kind, layer) in enumerate(zip(adapter_kinds(unet), projection_layers(unet))):
        takes = layer.image_embeds.in_features if kind == PLAIN else layer.proj_in.in_features
        gives = getattr(encoder_config, "projection_dim", None) if kind == PLAIN else encoder_config.hidden_size
        if takes != gives:
            raise UnsupportedIPAdapter(
                f"IP-Adapter {index + 1} ({kind}) projects image encodings {takes} wide but the image encoder gives "
                f"{gives} ({'its projection' if kind == PLAIN else 'its hidden states'}); load the image encoder the "
                "adapter was trained with (image_encoder_folder=...).")


class _RunTimeScale:
    """An adapter's scale in one layer as the graph's input: diffusers' processor skips an adapter whose scale
    `== 0` (never, for an input whose value comes at run time) and multiplies by it."""

    def __init__(self, value: torch.Tensor):
        self.value = value

    def __eq__(self, other) -> bool:
        return False

    __hash__ = None

    def __mul__(self, other):
        return self.value * other

    __rmul__ = __mul__


@contextlib.contextmanager
def run_time_scales(unet, scale: torch.Tensor) -> Iterator[None]:
    """The IP processors read their scales from `scale` (layers x adapters) for one forward."""
    processors = [proc for _, proc in ip_processors(unet)]
    kept = [proc.scale for proc in processors]
    try:
        for row, proc in enumerate(processors):
            proc.scale = [_RunTimeScale(scale[row, column]) for column in range(len(proc.scale))] \
                if isinstance(proc.scale, (list, tuple)) else _RunTimeScale(scale[row, 0])
        yield
    finally:
        for proc, value in zip(processors, kept):
            proc.scale = value


def is_ip_input(name: str) -> bool:
    return name == IP_SCALE or name.startswith(IP_EMBEDS.format(""))


def weights_and_config(ref: ModuleRef, ip: tuple[TensorSpec, ...]) -> dict[str, Any]:
    """A denoiser's weight digest and config for its spec; with IP-Adapters (`ip`: their inputs), theirs too (loaded
    into a module whose digest may have been taken before), and their weights as run-time parts."""
    if not ip:
        return {"weights": ref.digest, "config": dict(ref.config)}
    module = ref.module
    return {"weights": lambda: f"{ref.digest()}+ip{digest(module)}",
            "config": {**ref.config, "kasoku_ip_adapters": architecture(module)},
            "run_time_parts": ADAPTER_PARTS, "base_weights": ref.base_digest}


def engine_feeds(denoiser, input_names: Sequence[str], image_embeds, *, what: str = "transformer"
                 ) -> dict[str, torch.Tensor]:
    """The image prompts' encodings (diffusers' list, one per adapter) and the current IP scales of the torch
    `denoiser` as an engine's inputs: none for an engine without IP inputs, which refuses an image prompt; an
    engine built for them needs them."""
    names = [n for n in input_names if is_ip_input(n) and n != IP_SCALE]
    if not names:
        if image_embeds is not None:
            raise InvalidInput(f"this {what} engine takes no image prompt: load an IP-Adapter first "
                               "(pipe.load_ip_adapter(...)).")
        return {}
    if image_embeds is None or len(image_embeds) != len(names):
        raise InvalidInput(f"the compiled {what} takes an image prompt for each of its {len(names)} IP-Adapter(s) "
                           "(ip_adapter_image or ip_adapter_image_embeds).")
    return {**{name: embeds.to(torch.float32) for name, embeds in zip(names, image_embeds)},
            IP_SCALE: scales_of(denoiser)}


def split_inputs(rest: Sequence[torch.Tensor], adapters: int) -> tuple[tuple, list | None, torch.Tensor | None]:
    """A U-Net wrapper's trailing inputs: (the others, the adapters' encodings, the scales)."""
    if not adapters:
        return tuple(rest), None, None
    return tuple(rest[:-(adapters + 1)]), list(rest[-(adapters + 1):-1]), rest[-1]


# ---- the image encoder ---------------------------------------------------------------------------


class ImageEncoderModule(torch.nn.Module):
    """A CLIPVisionModelWithProjection returning the projected embedding and the penultimate hidden states (a
    SiglipVisionModel: the penultimate hidden states only)."""

    def __init__(self, encoder: torch.nn.Module):
        super().__init__()
        self.encoder = encoder
        self.projected = not is_siglip(encoder.config)

    def forward(self, pixel_values: torch.Tensor):
        out = self.encoder(pixel_values, output_hidden_states=True, return_dict=True)
        return (out.image_embeds, out.hidden_states[-2]) if self.projected else (out.hidden_states[-2],)


def image_encoder_spec(ref: ModuleRef, profile: ShapeProfile, axes: Axes) -> ComponentSpec:
    """The image encoder at `ref` on images of its own size (what its CLIPImageProcessor makes)."""
    config = ref.config
    size = config.image_size
    outputs = IMAGE_OUTPUTS[1:] if is_siglip(config) else IMAGE_OUTPUTS
    shapes = {"image_embeds": (axes.rows, getattr(config, "projection_dim", 0)),
              "penultimate_hidden_states": (axes.rows, image_tokens(config), config.hidden_size)}
    return ComponentSpec(
        name=IMAGE_ENCODER,
        inputs=(TensorSpec("pixel_values", (axes.rows, config.num_channels, size, size)),),
        outputs=tuple(TensorSpec(name, shapes[name]) for name in outputs),
        profile=profile,
        load_module=lambda: ImageEncoderModule(ref.load()),
        weights=ref.digest,
        config={**config.to_dict(), "kasoku_outputs": outputs},
        graph_kind="clip",
        modules=(ref.path,),
    )


class _Penultimate(tuple):
    """The hidden states the stand-in returns: only the penultimate layer (index -2), which diffusers reads."""

    def __getitem__(self, index):
        if index != -2:
            raise InvalidInput("the compiled image encoder returns its penultimate hidden states only.")
        return tuple.__getitem__(self, 0)


class EngineImageEncoder(EngineModule):
    """diffusers' `encode_image` reads `.image_embeds`, or `.hidden_states[-2]` with output_hidden_states, and
    the dtype of the encoder's first parameter."""

    def __init__(self, original: torch.nn.Module, engines, times, component: str = IMAGE_ENCODER):
        super().__init__(original, engines, times, component)
        self._dtype_probe = torch.nn.Parameter(torch.zeros((), dtype=torch.float32), requires_grad=False)

    def forward(self, pixel_values, output_hidden_states=None, return_dict=True, **kwargs):
        from transformers.models.clip.modeling_clip import CLIPVisionModelOutput

        out = self._run(self._component, pixel_values=pixel_values.to(torch.float32))
        return CLIPVisionModelOutput(image_embeds=out.get("image_embeds"),
                                     hidden_states=_Penultimate((out["penultimate_hidden_states"],)))


# ---- random adapters for tests and benchmarks (the original IP-Adapter layout diffusers converts) ------


def random_adapter_state_dict(unet, encoder_config, kind: str, *, tokens: int = 4, hidden: int = 32
                              ) -> dict[str, torch.Tensor]:
    """Random weights of an IP-Adapter of `kind` for `unet` and this image encoder, keyed as the published
    files are (``image_proj.*``, ``ip_adapter.<k>.to_k_ip.weight``), which diffusers' `load_ip_adapter` reads.
    Plus's resampler has `tokens` queries `hidden` wide (the published SD 1.5 Plus: 16 and 768)."""
    cross = unet.config.cross_attention_dim
    state: dict[str, torch.Tensor] = {}
    if kind == PLAIN:
        width = encoder_config.projection_dim
        state.update({"image_proj.proj.weight": torch.randn(4 * cross, width) * width ** -0.5,
                      "image_proj.proj.bias": torch.randn(4 * cross) * 0.02,
                      "image_proj.norm.weight": 1 + torch.randn(cross) * 0.02,
                      "image_proj.norm.bias": torch.randn(cross) * 0.02})
    elif kind == PLUS:
        state.update(_random_resampler(encoder_config.hidden_size, cross, tokens, hidden))
    else:
        raise UnsupportedIPAdapter(f"no tiny IP-Adapter of the kind {kind!r}; choose {PLAIN} or {PLUS}.")
    key = 1
    for name in unet.attn_processors:
        if name.endswith("attn1.processor"):
            continue
        attention = unet.get_submodule(name.removesuffix(".processor"))
        hidden = attention.to_k.out_features
        state[f"ip_adapter.{key}.to_k_ip.weight"] = torch.randn(hidden, cross) * cross ** -0.5
        state[f"ip_adapter.{key}.to_v_ip.weight"] = torch.randn(hidden, cross) * cross ** -0.5
        key += 2
    return state


def _random_resampler(embed: int, out: int, tokens: int, hidden: int, depth: int = 4) -> dict[str, torch.Tensor]:
    """Plus's resampler in the original layout: diffusers reads 64-wide heads (as many as fill `hidden`, at least
    one) and four layers."""
    inner = max(64, hidden // 64 * 64)

    def linear(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols) * cols ** -0.5

    state = {"image_proj.latents": torch.randn(1, tokens, hidden) / hidden ** 0.5,
             "image_proj.proj_in.weight": linear(hidden, embed), "image_proj.proj_in.bias": torch.zeros(hidden),
             "image_proj.proj_out.weight": linear(out, hidden), "image_proj.proj_out.bias": torch.zeros(out),
             "image_proj.norm_out.weight": torch.ones(out), "image_proj.norm_out.bias": torch.zeros(out)}
    for layer in range(depth):
        prefix = f"image_proj.layers.{layer}"
        for norm in ("0.norm1", "0.norm2", "1.0"):
            state[f"{prefix}.{norm}.weight"] = 1 + torch.randn(hidden) * 0.02
            state[f"{prefix}.{norm}.bias"] = torch.randn(hidden) * 0.02
        state[f"{prefix}.0.to_q.weight"] = linear(inner, hidden)
        state[f"{prefix}.0.to_kv.weight"] = linear(2 * inner, hidden)
        state[f"{prefix}.0.to_out.weight"] = linear(hidden, inner)
        state[f"{prefix}.1.1.weight"] = linear(4 * hidden, hidden)
        state[f"{prefix}.1.3.weight"] = linear(hidden, 4 * hidden)
    return state


def random_flux_adapter_state_dict(transformer, encoder_config, *, tokens: int = 4) -> dict[str, torch.Tensor]:
    """Random weights of a Flux IP-Adapter (the plain kind: XLabs' layout, which diffusers' `load_ip_adapter` on a
    Flux pipeline reads) for `transformer` and this image encoder: `tokens` image tokens as wide as the text
    embeddings, and key/value projections (with biases) in every double-stream block."""
    cross, width = transformer.config.joint_attention_dim, encoder_config.projection_dim
    hidden = transformer.inner_dim
    state = {"image_proj.proj.weight": torch.randn(tokens * cross, width) * width ** -0.5,
             "image_proj.proj.bias": torch.randn(tokens * cross) * 0.02,
             "image_proj.norm.weight": 1 + torch.randn(cross) * 0.02,
             "image_proj.norm.bias": torch.randn(cross) * 0.02}
    for block in range(transformer.config.num_layers):
        for name in ("to_k_ip", "to_v_ip"):
            state[f"ip_adapter.{block}.{name}.weight"] = torch.randn(hidden, cross) * cross ** -0.5
            state[f"ip_adapter.{block}.{name}.bias"] = torch.randn(hidden) * 0.02
    return state


def random_sd3_adapter_state_dict(transformer, encoder_config, *, tokens: int = 4, hidden: int = 64
                                  ) -> dict[str, torch.Tensor]:
    """Random weights of an SD3 IP-Adapter (InstantX's kind: a timestep-aware resampler of `tokens` queries
    `hidden` wide over SigLIP's hidden states, an IP key/value and norms in every attention) for `transformer`, in
    the layout diffusers' SD3 `load_ip_adapter` reads (``image_proj.*``, ``ip_adapter.<layer>.*``)."""
    from diffusers.models.attention_processor import SD3IPAdapterJointAttnProcessor2_0
    from diffusers.models.embeddings import IPAdapterTimeImageProjection

    config = transformer.config
    inner = config.attention_head_dim * config.num_attention_heads
    projection = IPAdapterTimeImageProjection(embed_dim=encoder_config.hidden_size, output_dim=inner,
                                              hidden_dim=hidden, heads=max(1, hidden // 64), num_queries=tokens,
                                              timestep_in_dim=hidden // 2)
    state = {f"image_proj.{name}": t for name, t in projection.state_dict().items()}
    for layer, _ in enumerate(transformer.attn_processors):
        processor = SD3IPAdapterJointAttnProcessor2_0(hidden_size=inner, ip_hidden_states_dim=inner,
                                                      head_dim=config.attention_head_dim, timesteps_emb_dim=hidden)
        state.update({f"ip_adapter.{layer}.{name}": t for name, t in processor.state_dict().items()})
    return state
