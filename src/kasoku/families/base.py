"""What a model family is: one object that answers every family-specific question.

A :class:`Family` owns its diffusers pipeline classes per task, how it is recognised from a folder
or a live pipeline, its components and their specs (inputs, dynamic axes, outputs), its engine
stand-ins, its family-only call arguments and their checks, its precision rules, and its tiny
builder. Everything else in kasoku asks the family; nothing compares family names.
Adding a family is one module under kasoku/families/ (a subclass of :class:`Family`), one line in
the registry (kasoku/families/__init__.py), and its tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction
from typing import Any, ClassVar

import torch

from ..components import (
    Axis,
    ComponentSpec,
    Precision,
    ShapeProfile,
    TensorSpec,
    TextEncoderModule,
    UNetModule,
    VaeDecoderModule,
    VaeEncoderModule,
    vae_scale_factor,
)
from ..errors import KasokuError

TASKS = ("txt2img", "img2img", "inpaint")

# The components of a Stable Diffusion pipeline after its text encoder(s), in build order.
IMAGE_COMPONENTS = ("unet", "vae_decoder", "vae_encoder")

# ONNX Runtime's transformer optimizer names these graphs so; ops that overflow fp16 in each.
_VAE_FP16_KEEP = ("GroupNormalization", "InstanceNormalization", "ReduceMean", "Pow", "Sqrt", "Div", "Softmax")


class NotADiffusersPipeline(KasokuError, ValueError):
    """A folder or object that is not a diffusers pipeline kasoku supports."""


class Axes:
    """The dynamic axes of a pipeline's tensors, derived from the image shape."""

    def __init__(self, pipe):
        vae_scale = Fraction(1, vae_scale_factor(pipe.vae))
        self.images = Axis("batch", "batch")
        self.guided = Axis("batch", "batch", Fraction(2), min_scale=Fraction(1))  # prompt + negative
        self.latent_h = Axis("latent_height", "height", vae_scale)
        self.latent_w = Axis("latent_width", "width", vae_scale)
        self.pixel_h = Axis("height", "height")
        self.pixel_w = Axis("width", "width")


class Family:
    """A family of diffusers pipelines kasoku compiles (subclass per family)."""

    name: ClassVar[str]
    title: ClassVar[str]
    pipelines: ClassVar[Mapping[str, str]]  # task -> diffusers pipeline class name
    text_encoders: ClassVar[tuple[str, ...]] = ("text_encoder",)
    # Call arguments only this family's pipelines take (others get a clear error).
    call_arguments: ClassVar[tuple[str, ...]] = ()
    # Pipeline attributes the engines replace besides the torch modules (a safety checker on torch images).
    replaced_attributes: ClassVar[Mapping[str, Any]] = {}

    # ---- recognising it --------------------------------------------------------------------

    def matches(self, pipeline_class: str, components: Mapping[str, Any], unet_config: Mapping[str, Any],
                text_config: Mapping[str, Any]) -> bool:
        """Whether a pipeline of this class, components and configs is of this family."""
        return pipeline_class in self.pipelines.values()

    def check_layout(self, components: Mapping[str, Any], where: str) -> None:
        """Raise :class:`NotADiffusersPipeline` for a layout of this family kasoku cannot compile."""

    # ---- components and their specs --------------------------------------------------------

    def component_names(self, pipe=None) -> tuple[str, ...]:
        return (*self.text_encoders, *IMAGE_COMPONENTS)

    def calibration_components(self, component: str) -> tuple[str, ...]:
        """What a text-to-image run needs to reach `component` (its calibration records its inputs
        with the latents left undecoded): the text encoders and the component."""
        return (*self.text_encoders, component)

    def tasks(self, pipe) -> tuple[str, ...]:
        """The tasks this model runs: an inpainting model (a U-Net that also reads the mask and the
        masked image, 9 channels) inpaints only."""
        return ("inpaint",) if pipe.unet.config.in_channels == 9 else TASKS

    def task_components(self, task: str, pipe=None) -> tuple[str, ...]:
        """The components a task runs (text-to-image never encodes an image)."""
        names = self.component_names(pipe)
        return tuple(n for n in names if n != "vae_encoder") if task == "txt2img" else names

    def specs(self, pipe, profile: ShapeProfile, names: Iterable[str] | None, weights) -> dict[str, ComponentSpec]:
        """The specs of `names` (default: every component the pipeline has)."""
        available = self.component_names(pipe)
        names = list(available if names is None else names)
        absent = [n for n in names if n not in available]
        if absent:
            raise KasokuError(f"this {self.title} model has no {', '.join(absent)}; "
                              f"its components are {', '.join(available)}.")
        builders = self.spec_builders(pipe, profile, weights)
        return {name: builders[name]() for name in names}

    def spec_builders(self, pipe, profile: ShapeProfile, weights) -> dict[str, Callable[[], ComponentSpec]]:
        axes = Axes(pipe)
        builders: dict[str, Callable[[], ComponentSpec]] = {
            name: (lambda name=name: self.text_encoder_spec(pipe, name, profile, axes, weights))
            for name in self.text_encoders
        }
        builders["unet"] = lambda: self.unet_spec(pipe, profile, axes, weights)
        builders["vae_decoder"] = lambda: self.vae_decoder_spec(pipe, profile, axes, weights)
        builders["vae_encoder"] = lambda: self.vae_encoder_spec(pipe, profile, axes, weights)
        return builders

    def text_encoder_outputs(self, pipe, name: str, axes: Axes) -> tuple[TensorSpec, ...]:
        """What the family's pipeline reads from text encoder `name` (SD 1.x/2.x: the last hidden state).
        The pipelines encode the prompts and the negative prompts in separate calls: one row per image."""
        config = getattr(pipe, name).config
        length = pipe.tokenizer.model_max_length
        return (TensorSpec("last_hidden_state", (axes.images, length, config.hidden_size)),
                TensorSpec("pooler_output", (axes.images, config.hidden_size)))

    def text_encoder_spec(self, pipe, name: str, profile: ShapeProfile, axes: Axes, weights) -> ComponentSpec:
        from ..loading import real_module

        encoder = getattr(pipe, name)
        outputs = self.text_encoder_outputs(pipe, name, axes)
        output_names = tuple(t.name for t in outputs)
        return ComponentSpec(
            name=name,
            inputs=(TensorSpec("input_ids", (axes.images, pipe.tokenizer.model_max_length), torch.int64,
                               high=encoder.config.vocab_size),),
            outputs=outputs,
            profile=profile,
            load_module=lambda: TextEncoderModule(real_module(pipe, name), output_names),
            weights=lambda: weights.of(pipe, name),
            config={**encoder.config.to_dict(), "kasoku_outputs": output_names},
            graph_kind="clip",
            modules=(name,),
        )

    def unet_added_inputs(self, pipe, axes: Axes) -> tuple[TensorSpec, ...]:
        """The U-Net's added conditioning inputs (none in SD 1.x/2.x)."""
        return ()

    def unet_module(self, unet: torch.nn.Module) -> torch.nn.Module:
        """The U-Net as a module of positional tensors (one per spec input) returning a tuple."""
        return UNetModule(unet)

    def unet_spec(self, pipe, profile: ShapeProfile, axes: Axes, weights) -> ComponentSpec:
        from ..loading import real_module

        config = pipe.unet.config
        text_length = pipe.tokenizer.model_max_length
        added = self.unet_added_inputs(pipe, axes)
        return ComponentSpec(
            name="unet",
            inputs=(
                TensorSpec("sample", (axes.guided, config.in_channels, axes.latent_h, axes.latent_w)),
                TensorSpec("timestep", (axes.guided,), always_fp32=True),
                TensorSpec("encoder_hidden_states", (axes.guided, text_length, config.cross_attention_dim)),
                *added,
            ),
            outputs=(TensorSpec("out_sample", (axes.guided, config.out_channels, axes.latent_h, axes.latent_w)),),
            profile=profile,
            load_module=lambda: self.unet_module(real_module(pipe, "unet")),
            weights=lambda: weights.of(pipe, "unet"),
            config=dict(config),
            graph_kind="unet",
            modules=("unet",),
            int8="hybrid",
        )

    def vae_fp32_for(self, pipe) -> dict[Precision, str]:
        """Precision -> why the VAE is built in fp32 when that precision is asked for (empty: never)."""
        return {}

    def vae_decoder_spec(self, pipe, profile: ShapeProfile, axes: Axes, weights) -> ComponentSpec:
        from ..loading import real_module

        config = pipe.vae.config
        return ComponentSpec(
            name="vae_decoder",
            inputs=(TensorSpec("latent_sample", (axes.images, config.latent_channels, axes.latent_h, axes.latent_w)),),
            outputs=(TensorSpec("sample", (axes.images, config.out_channels, axes.pixel_h, axes.pixel_w)),),
            profile=profile,
            load_module=lambda: VaeDecoderModule(real_module(pipe, "vae")),
            weights=lambda: weights.of(pipe, "vae"),
            config=dict(config),
            fp32_for=self.vae_fp32_for(pipe),
            graph_kind="vae",
            fp16_keep_ops=(*_VAE_FP16_KEEP, "Resize"),  # the decoder's upsampling activations too
            modules=("vae",),
        )

    def vae_encoder_spec(self, pipe, profile: ShapeProfile, axes: Axes, weights) -> ComponentSpec:
        from ..loading import real_module

        config = pipe.vae.config
        return ComponentSpec(
            name="vae_encoder",
            inputs=(TensorSpec("sample", (axes.images, config.in_channels, axes.pixel_h, axes.pixel_w)),),
            outputs=(TensorSpec("latent_parameters",
                                (axes.images, 2 * config.latent_channels, axes.latent_h, axes.latent_w)),),
            profile=profile,
            load_module=lambda: VaeEncoderModule(real_module(pipe, "vae")),
            weights=lambda: weights.of(pipe, "vae"),
            config=dict(config),
            fp32_for=self.vae_fp32_for(pipe),
            graph_kind="vae",
            fp16_keep_ops=_VAE_FP16_KEEP,
            modules=("vae",),
        )

    # ---- pipelines on engines --------------------------------------------------------------

    def pipeline_class(self, task: str):
        import diffusers

        return getattr(diffusers, self.pipelines[task])

    def task_pipeline(self, pipe, task: str, **overrides):
        """A diffusers pipeline of this family for `task`, sharing `pipe`'s components."""
        new = self.pipeline_class(task).from_pipe(pipe, **overrides)
        new.set_progress_bar_config(disable=True)
        return new

    def text_encoder_stand_in(self, pipe, name: str, engines, times):
        from ..standins import EngineTextEncoder

        return EngineTextEncoder(getattr(pipe, name), engines, times, name)

    def stand_ins(self, pipe, engines, times) -> dict[str, Any]:
        """The pipeline attributes that engines replace: its torch modules, and what ran on their output."""
        from ..standins import EngineUNet, EngineVAE

        replaced: dict[str, Any] = dict(vae=EngineVAE(pipe.vae, engines, times),
                                        unet=EngineUNet(pipe.unet, engines, times))
        for name in self.text_encoders:
            replaced[name] = self.text_encoder_stand_in(pipe, name, engines, times)
        return {**replaced, **self.replaced_attributes}

    # ---- call arguments --------------------------------------------------------------------

    def check_arguments(self, kwargs: Mapping[str, Any]) -> None:
        """Family-specific checks of a call's arguments (raise InvalidInput)."""

    # ---- the built-in tiny model -----------------------------------------------------------

    def tiny_pipeline(self, *, inpainting: bool = False, prediction: str = "epsilon", seed: int = 0):
        """A live tiny pipeline of this family with deterministic weights (see kasoku.tiny)."""
        raise NotImplementedError(f"{self.title} has no built-in tiny model")

    def __repr__(self) -> str:
        return f"<family {self.name}: {self.title}>"
