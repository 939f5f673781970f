"""What a model family is: one object that answers every family-specific question.

A :class:`Family` owns its diffusers pipeline classes per task, how it is recognised from a folder
or a live pipeline, its components and their specs (inputs, dynamic axes, outputs), its engine
stand-ins, its family-only call arguments and their checks, its precision rules, and its tiny
builder. Everything else in kasoku asks the family; nothing compares family names.
Adding a family is one module under kasoku/families/ (a subclass of :class:`Family`), one line in
the registry (kasoku/families/__init__.py), and its tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction
from typing import Any, ClassVar

import torch

from ..components import (
    Axis,
    ComponentSpec,
    ControlNetModule,
    Precision,
    ResidualUNetModule,
    ShapeProfile,
    TensorSpec,
    TextEncoderModule,
    UNetModule,
    VaeDecoderModule,
    VaeEncoderModule,
    residual_names,
    vae_scale_factor,
)
from ..errors import KasokuError
from ..step_cache import COMPONENTS as STEP_CACHE_COMPONENTS
from ..step_cache import (
    DEFAULT_BRANCH,
    FEATURE,
    FULL,
    SHALLOW,
    Branch,
    StepCacheFullModule,
    StepCacheShallowModule,
)

TASKS = ("txt2img", "img2img", "inpaint")

# The components of a Stable Diffusion pipeline after its text encoder(s), in build order.
IMAGE_COMPONENTS = ("unet", "vae_decoder", "vae_encoder")
# A ControlNet pipeline runs one ControlNet engine per distinct ControlNet model and, in place of the
# U-Net, the U-Net that takes their residuals as inputs.
CONTROLNET_COMPONENT = "controlnet_{}"
CONTROLNET_UNET = "unet_controlnet"
# What a ControlNet must share with the U-Net it steers (their residuals are added to its features).
_CONTROLNET_FITS = ("cross_attention_dim", "addition_embed_type", "addition_time_embed_dim",
                    "projection_class_embeddings_input_dim")

# ONNX Runtime's transformer optimizer names these graphs so; ops that overflow fp16 in each.
_VAE_FP16_KEEP = ("GroupNormalization", "InstanceNormalization", "ReduceMean", "Pow", "Sqrt", "Div", "Softmax")


class NotADiffusersPipeline(KasokuError, ValueError):
    """A folder or object that is not a diffusers pipeline kasoku supports."""


class UnfitControlNet(NotADiffusersPipeline):
    """A ControlNet kasoku cannot run with this pipeline."""


class Axes:
    """The dynamic axes of a pipeline's tensors, derived from the image shape."""

    def __init__(self, pipe):
        self.vae_scale = Fraction(1, vae_scale_factor(pipe.vae))
        self.images = Axis("batch", "batch")
        self.guided = Axis("batch", "batch", Fraction(2), min_scale=Fraction(1))  # prompt + negative
        self.latent_h = Axis("latent_height", "height", self.vae_scale)
        self.latent_w = Axis("latent_width", "width", self.vae_scale)
        self.pixel_h = Axis("height", "height")
        self.pixel_w = Axis("width", "width")

    def latent_at(self, level: int) -> tuple[Axis, Axis]:
        """(height, width) of the U-Net's features after `level` downsamplings (level 0: the latent)."""
        if level == 0:
            return self.latent_h, self.latent_w
        scale = self.vae_scale / 2**level
        return Axis(f"latent_height_down{level}", "height", scale), Axis(f"latent_width_down{level}", "width", scale)


def controlnet_residuals(config: Mapping[str, Any]) -> tuple[tuple[int, int], ...]:
    """(channels, downsamplings) of each residual a ControlNet adds to a U-Net of this config, in
    diffusers' order (ControlNetModel.forward, step 3): the input convolution's output, each down
    block's resnet outputs and its downsampler's (all but the last block), then the mid block's.
    A U-Net's config gives the residuals it takes, a ControlNet's those it makes."""
    channels = tuple(config["block_out_channels"])
    layers = config["layers_per_block"]
    per_block = [layers] * len(channels) if isinstance(layers, int) else list(layers)
    residuals = [(channels[0], 0)]
    for level, (width, count) in enumerate(zip(channels, per_block)):
        residuals += [(width, level)] * count
        if level < len(channels) - 1:
            residuals.append((width, level + 1))
    return (*residuals, (channels[-1], len(channels) - 1))


class Family:
    """A family of diffusers pipelines kasoku compiles (subclass per family)."""

    name: ClassVar[str]
    title: ClassVar[str]
    pipelines: ClassVar[Mapping[str, str]]  # task -> diffusers pipeline class name
    controlnet_pipelines: ClassVar[Mapping[str, str]] = {}  # task -> diffusers ControlNet pipeline class name
    text_encoders: ClassVar[tuple[str, ...]] = ("text_encoder",)
    # Call arguments only this family's pipelines take (others get a clear error).
    call_arguments: ClassVar[tuple[str, ...]] = ()
    # Pipeline attributes the engines replace besides the torch modules (a safety checker on torch images).
    replaced_attributes: ClassVar[Mapping[str, Any]] = {}

    # ---- recognising it --------------------------------------------------------------------

    def class_names(self) -> tuple[str, ...]:
        """Every diffusers pipeline class of this family (the plain ones, then the ControlNet ones)."""
        return (*self.pipelines.values(), *self.controlnet_pipelines.values())

    def matches(self, pipeline_class: str, components: Mapping[str, Any], unet_config: Mapping[str, Any],
                text_config: Mapping[str, Any]) -> bool:
        """Whether a pipeline of this class, components and configs is of this family."""
        return pipeline_class in self.class_names()

    def check_layout(self, components: Mapping[str, Any], where: str) -> None:
        """Raise :class:`NotADiffusersPipeline` for a layout of this family kasoku cannot compile."""

    # ---- components and their specs --------------------------------------------------------

    def component_names(self, pipe=None) -> tuple[str, ...]:
        if pipe is not None and self.controlnet_paths(pipe):
            return (*self.text_encoders, *self.controlnet_components(pipe), CONTROLNET_UNET, "vae_decoder",
                    "vae_encoder")
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

    def specs(self, pipe, profile: ShapeProfile, names: Iterable[str] | None, weights,
              cache_branch: int = DEFAULT_BRANCH) -> dict[str, ComponentSpec]:
        """The specs of `names` (default: every component the pipeline has; the step-cache components
        only when named, built for skip branch `cache_branch`)."""
        available = self.component_names(pipe)
        names = list(available if names is None else names)
        absent = [n for n in names if n not in (*available, *STEP_CACHE_COMPONENTS)]
        if absent:
            raise KasokuError(f"this {self.title} model has no {', '.join(absent)}; "
                              f"its components are {', '.join(available + STEP_CACHE_COMPONENTS)}.")
        builders = self.spec_builders(pipe, profile, weights, cache_branch)
        return {name: builders[name]() for name in names}

    def spec_builders(self, pipe, profile: ShapeProfile, weights,
                      cache_branch: int = DEFAULT_BRANCH) -> dict[str, Callable[[], ComponentSpec]]:
        axes = Axes(pipe)
        builders: dict[str, Callable[[], ComponentSpec]] = {
            name: (lambda name=name: self.text_encoder_spec(pipe, name, profile, axes, weights))
            for name in self.text_encoders
        }
        builders["unet"] = lambda: self.unet_spec(pipe, profile, axes, weights)
        builders["vae_decoder"] = lambda: self.vae_decoder_spec(pipe, profile, axes, weights)
        builders["vae_encoder"] = lambda: self.vae_encoder_spec(pipe, profile, axes, weights)
        if self.controlnet_paths(pipe):
            builders[CONTROLNET_UNET] = lambda: self.controlnet_unet_spec(pipe, profile, axes, weights)
            for name, path in self.controlnet_components(pipe).items():
                builders[name] = lambda name=name, path=path: self.controlnet_spec(pipe, name, path, profile, axes,
                                                                                   weights)
        builders.update(self.step_cache_builders(pipe, profile, axes, weights, cache_branch))
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
            takes_lora=True,
        )

    def unet_added_inputs(self, pipe, axes: Axes) -> tuple[TensorSpec, ...]:
        """The U-Net's added conditioning inputs (none in SD 1.x/2.x)."""
        return ()

    def unet_module(self, unet: torch.nn.Module) -> torch.nn.Module:
        """The U-Net as a module of positional tensors (one per spec input) returning a tuple."""
        return UNetModule(unet)

    def denoiser_inputs(self, pipe, config, axes: Axes, *, fp32_timestep: bool = False) -> tuple[TensorSpec, ...]:
        """The inputs every denoiser takes first (a U-Net, a ControlNet): the latent sample, the timestep and
        the text embeddings, shaped by its config."""
        return (
            TensorSpec("sample", (axes.guided, config.in_channels, axes.latent_h, axes.latent_w)),
            TensorSpec("timestep", (axes.guided,), always_fp32=fp32_timestep),
            TensorSpec("encoder_hidden_states", (axes.guided, pipe.tokenizer.model_max_length,
                                                 config.cross_attention_dim)),
        )

    def unet_spec(self, pipe, profile: ShapeProfile, axes: Axes, weights) -> ComponentSpec:
        from ..loading import real_module

        config = pipe.unet.config
        added = self.unet_added_inputs(pipe, axes)
        return ComponentSpec(
            name="unet",
            inputs=(
                *self.denoiser_inputs(pipe, config, axes, fp32_timestep=True),
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
            takes_lora=True,
        )

    # ---- step caching (kasoku.step_cache): two more graphs of the U-Net's weights ----------------

    def step_cache_builders(self, pipe, profile: ShapeProfile, axes: Axes, weights,
                            branch: int) -> dict[str, Callable[[], ComponentSpec]]:
        return {FULL: lambda: self.unet_full_spec(pipe, profile, axes, weights, branch),
                SHALLOW: lambda: self.unet_shallow_spec(pipe, profile, axes, weights, branch)}

    def unet_full_module(self, unet: torch.nn.Module, branch: Branch) -> torch.nn.Module:
        """The whole U-Net, also returning the deep feature (positional tensors, one per spec input)."""
        return StepCacheFullModule(unet, branch)

    def unet_shallow_module(self, unet: torch.nn.Module, branch: Branch) -> torch.nn.Module:
        """The U-Net's outer layers on the deep feature (its last input)."""
        return StepCacheShallowModule(unet, branch)

    def deep_feature(self, axes: Axes, branch: Branch) -> TensorSpec:
        """The input of the up layer at `branch`: its spatial size follows the latent's at the branch's depth."""
        below = 2**branch.level
        return TensorSpec(FEATURE, (axes.guided, branch.channels,
                                    Axis("feature_height", "height", axes.latent_h.scale / below),
                                    Axis("feature_width", "width", axes.latent_w.scale / below)))

    def _step_cache_spec(self, pipe, profile: ShapeProfile, axes: Axes, weights, branch: int, name: str,
                         build_module) -> tuple[ComponentSpec, Branch]:
        """The plain U-Net's spec (the same inputs and weights) made into a step-cache graph: the branch is
        part of its architecture; int8 quantizes its weights only (calibration records the plain U-Net)."""
        from ..loading import real_module

        plain = self.unet_spec(pipe, profile, axes, weights)
        geometry = Branch.of(pipe.unet.config, branch)
        spec = dataclasses.replace(plain, name=name,
                                   load_module=lambda: build_module(real_module(pipe, "unet"), geometry),
                                   config={**plain.config, "kasoku_step_cache": {"graph": name, "branch": branch}},
                                   int8="weights")
        return spec, geometry

    def unet_full_spec(self, pipe, profile: ShapeProfile, axes: Axes, weights, branch: int) -> ComponentSpec:
        spec, geometry = self._step_cache_spec(pipe, profile, axes, weights, branch, FULL, self.unet_full_module)
        return dataclasses.replace(spec, outputs=(*spec.outputs, self.deep_feature(axes, geometry)))

    def unet_shallow_spec(self, pipe, profile: ShapeProfile, axes: Axes, weights, branch: int) -> ComponentSpec:
        spec, geometry = self._step_cache_spec(pipe, profile, axes, weights, branch, SHALLOW, self.unet_shallow_module)
        return dataclasses.replace(spec, inputs=(*spec.inputs, self.deep_feature(axes, geometry)))

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

    # ---- ControlNet -------------------------------------------------------------------------

    def controlnet_paths(self, pipe) -> tuple[str, ...]:
        """Where each ControlNet the pipeline runs is, in diffusers' order: "controlnet", or
        "controlnet.nets.<i>" in a MultiControlNetModel (see kasoku.loading.module_at); empty without one."""
        controlnet = getattr(pipe, "controlnet", None)
        if controlnet is None:
            return ()
        nets = getattr(controlnet, "nets", None)
        return ("controlnet",) if nets is None else tuple(f"controlnet.nets.{i}" for i in range(len(nets)))

    def controlnet_components(self, pipe) -> dict[str, str]:
        """Component name -> where its ControlNet is: one engine per distinct ControlNet model (a model
        given twice runs one engine)."""
        from ..loading import module_at

        names: dict[int, str] = {}
        components: dict[str, str] = {}
        for path in self.controlnet_paths(pipe):
            module = module_at(pipe, path)
            if id(module) not in names:
                names[id(module)] = CONTROLNET_COMPONENT.format(len(names))
                components[names[id(module)]] = path
        return components

    def check_controlnet(self, pipe, controlnet, where: str) -> None:
        """Raise :class:`UnfitControlNet` for a ControlNet that cannot steer this pipeline's U-Net on engines."""
        config, unet = controlnet.config, pipe.unet.config
        if config.get("global_pool_conditions"):
            raise UnfitControlNet(f"{where} pools its residuals to 1x1 (global_pool_conditions, the shuffle "
                                  "ControlNet); kasoku compiles ControlNets whose residuals have the U-Net's sizes.")
        differ = [key for key in _CONTROLNET_FITS if config.get(key) != unet.get(key)]
        if controlnet_residuals(config) != controlnet_residuals(unet):
            differ.append("residuals (block_out_channels, layers_per_block)")
        if config.get("in_channels") != pipe.vae.config.latent_channels:
            differ.append("in_channels (the latent channels)")
        if differ:
            raise UnfitControlNet(f"{where} does not fit this {self.title} model's U-Net: its {', '.join(differ)} "
                                  "differ; give a ControlNet trained for this model.")

    def with_controlnet(self, pipe, controlnet):
        """This family's ControlNet pipeline of `pipe`'s task, sharing `pipe`'s components, with
        `controlnet` (a ControlNetModel, or a list of them for several)."""
        nets = controlnet if isinstance(controlnet, (list, tuple)) else getattr(controlnet, "nets", [controlnet])
        for index, net in enumerate(nets):
            self.check_controlnet(pipe, net, f"ControlNet {index + 1} of {len(nets)}" if len(nets) > 1 else
                                  "the ControlNet")
        new = self.pipeline_class(self.tasks(pipe)[0], controlnet=True).from_pipe(pipe, controlnet=controlnet)
        new.set_progress_bar_config(disable=True)
        return new

    def control_arguments(self, task: str, control_image) -> dict[str, Any]:
        """The control images as the family's ControlNet pipeline for `task` takes them (its text-to-image
        pipeline calls them `image`, the others `control_image`)."""
        return {"image" if task == "txt2img" else "control_image": control_image}

    def controlnet_profile(self, profile: ShapeProfile) -> ShapeProfile:
        """The ControlNet's profile: in guess mode with guidance, diffusers runs it on the conditional half
        of the batch only, so a profile for calls with guidance serves both batch sizes."""
        return dataclasses.replace(profile, guidance=None) if profile.guidance else profile

    def residual_specs(self, config: Mapping[str, Any], axes: Axes) -> tuple[TensorSpec, ...]:
        """The residuals a ControlNet makes and the U-Net takes, one per down-block output and the mid block's."""
        residuals = controlnet_residuals(config)
        return tuple(TensorSpec(name, (axes.guided, channels, *axes.latent_at(level)))
                     for name, (channels, level) in zip(residual_names(len(residuals) - 1), residuals))

    def controlnet_spec(self, pipe, name: str, path: str, profile: ShapeProfile, axes: Axes, weights
                        ) -> ComponentSpec:
        """A ControlNet: the latents, timestep, text embeddings, the control image at the image's size and one
        scale per residual (plus the family's added conditioning) in; its scaled residuals out."""
        from ..loading import module_at, real_module

        controlnet = module_at(pipe, path)
        self.check_controlnet(pipe, controlnet, f"ControlNet {name}")
        config = controlnet.config
        residuals = self.residual_specs(config, axes)
        added = self.unet_added_inputs(pipe, axes)
        added_names = tuple(t.name for t in added)
        return ComponentSpec(
            name=name,
            inputs=(
                *self.denoiser_inputs(pipe, config, axes),
                TensorSpec("controlnet_cond", (axes.guided, config.conditioning_channels, axes.pixel_h, axes.pixel_w)),
                TensorSpec("conditioning_scale", (len(residuals),)),
                *added,
            ),
            outputs=residuals,
            profile=self.controlnet_profile(profile),
            load_module=lambda: ControlNetModule(real_module(pipe, path), added_names),
            weights=lambda: weights.of(pipe, path),
            config=dict(config),
            graph_kind="unet",
            modules=(path,),
        )

    def controlnet_unet_spec(self, pipe, profile: ShapeProfile, axes: Axes, weights) -> ComponentSpec:
        """The U-Net that takes a ControlNet's residuals as inputs (after its own and its added conditioning).
        int8 quantizes its weights only: the calibration recipe records plain text-to-image runs."""
        from ..loading import real_module

        config = pipe.unet.config
        added = self.unet_added_inputs(pipe, axes)
        added_names = tuple(t.name for t in added)
        return ComponentSpec(
            name=CONTROLNET_UNET,
            inputs=(
                *self.denoiser_inputs(pipe, config, axes),
                *added,
                *self.residual_specs(config, axes),
            ),
            outputs=(TensorSpec("out_sample", (axes.guided, config.out_channels, axes.latent_h, axes.latent_w)),),
            profile=profile,
            load_module=lambda: ResidualUNetModule(real_module(pipe, "unet"), added_names),
            weights=lambda: weights.of(pipe, "unet"),
            config=dict(config),
            graph_kind="unet",
            modules=("unet",),
        )

    def controlnet_stand_in(self, pipe, engines, times):
        """What replaces the pipeline's ControlNet: one engine-backed ControlNetModel, or diffusers' own
        MultiControlNetModel over one per ControlNet (it sums their residuals, as in diffusers)."""
        from ..loading import module_at
        from ..standins import engine_controlnet, engine_multi_controlnet

        component_of = {id(module_at(pipe, path)): name for name, path in self.controlnet_components(pipe).items()}
        nets = [engine_controlnet(module_at(pipe, path), engines, times, component_of[id(module_at(pipe, path))])
                for path in self.controlnet_paths(pipe)]
        return nets[0] if self.controlnet_paths(pipe) == ("controlnet",) else engine_multi_controlnet(nets)

    # ---- pipelines on engines --------------------------------------------------------------

    def pipeline_class(self, task: str, *, controlnet: bool = False):
        import diffusers

        return getattr(diffusers, (self.controlnet_pipelines if controlnet else self.pipelines)[task])

    def task_pipeline(self, pipe, task: str, **overrides):
        """A diffusers pipeline of this family for `task`, sharing `pipe`'s components (a ControlNet
        pipeline where `pipe` has ControlNets)."""
        controlnet = bool(self.controlnet_paths(pipe))
        new = self.pipeline_class(task, controlnet=controlnet).from_pipe(pipe, **overrides)
        new.set_progress_bar_config(disable=True)
        return new

    def text_encoder_stand_in(self, pipe, name: str, engines, times):
        from ..standins import EngineTextEncoder

        return EngineTextEncoder(getattr(pipe, name), engines, times, name)

    def stand_ins(self, pipe, engines, times) -> dict[str, Any]:
        """The pipeline attributes that engines replace: its torch modules, and what ran on their output."""
        from ..standins import EngineUNet, EngineVAE

        controlnet = bool(self.controlnet_paths(pipe))
        replaced: dict[str, Any] = dict(vae=EngineVAE(pipe.vae, engines, times),
                                        unet=EngineUNet(pipe.unet, engines, times,
                                                        CONTROLNET_UNET if controlnet else "unet"))
        for name in self.text_encoders:
            replaced[name] = self.text_encoder_stand_in(pipe, name, engines, times)
        if controlnet:
            replaced["controlnet"] = self.controlnet_stand_in(pipe, engines, times)
        return {**replaced, **self.replaced_attributes}

    # ---- call arguments --------------------------------------------------------------------

    def check_arguments(self, kwargs: Mapping[str, Any]) -> None:
        """Family-specific checks of a call's arguments (raise InvalidInput)."""

    # ---- the built-in tiny model -----------------------------------------------------------

    def tiny_pipeline(self, *, inpainting: bool = False, prediction: str = "epsilon", seed: int = 0):
        """A live tiny pipeline of this family with deterministic weights (see kasoku.tiny)."""
        raise NotImplementedError(f"{self.title} has no built-in tiny model")

    def tiny_controlnet(self, *, seed: int = 0):
        """A tiny ControlNet for this family's tiny U-Net, with deterministic weights from `seed`."""
        from ..tiny import seeded, tiny_controlnet

        return seeded(seed, 5, lambda: tiny_controlnet(self.tiny_unet(4)))

    def __repr__(self) -> str:
        return f"<family {self.name}: {self.title}>"
