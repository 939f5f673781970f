"""What a model family is: its slots (text encoders, a denoiser, a VAE, optional ControlNets) and its pipelines.

A :class:`Family` owns its diffusers pipeline classes per task, how it is recognised from a folder or a live
pipeline, its slots and which architecture fills each (:mod:`kasoku.architectures`), its call defaults
(steps, guidance) and checks, and its capabilities: what ControlNet, step caching and LoRA mean for it.
Everything else in kasoku asks the family (through :class:`kasoku.model.pipeline_model.Model`); nothing outside the
families names a slot by a U-Net word.

Family methods take the *model* (a :class:`kasoku.model.pipeline_model.Model`: the pipeline, lazy loading and weight
digests; see :class:`ModelView` for what they read), except where they act on a diffusers pipeline itself
(:meth:`Family.task_pipeline`, :meth:`UNetFamily.with_controlnet`). :class:`UNetFamily` is the base of the
U-Net families (SD 1.x/2.x/XL): the ``unet`` slot, its ControlNets and its step-cache graphs.

Adding a family is one module under kasoku/families/ (a subclass of :class:`Family` or :class:`UNetFamily`
with its tiny builder), one line in the registry (kasoku/families/__init__.py), and its tests.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from ..architectures import clip, controlnet, deepcache, ip_adapter, t5, unet, vae
from ..architectures.base import Axes, ModuleRef, module_at
from ..core.choices import CONTROLNET_COMPONENT
from ..core.components import Axis, ComponentSpec, Precision, ShapeProfile, TensorSpec, default_profile
from ..core.errors import KasokuError, NotADiffusersPipeline
from ..core.standins import EngineTimes, StepCacheTargets
from ..core.step_cache import BLOCK_COMPONENTS, DEEPCACHE, DEFAULT_BRANCH, FIRST_BLOCK, TAYLORSEER
from ..core.step_cache import COMPONENTS as STEP_CACHE_COMPONENTS

TASKS = ("txt2img", "img2img", "inpaint")
# A ControlNet pipeline runs one ControlNet engine per distinct ControlNet model and, in place of the
# U-Net, the U-Net that takes their residuals as inputs.
CONTROLNET_UNET = "unet_controlnet"
VAE_COMPONENTS = ("vae_decoder", "vae_encoder")

__all__ = ["CONTROLNET_COMPONENT", "CONTROLNET_UNET", "TASKS", "Family", "ModelView", "NotADiffusersPipeline",
           "TextEncoderSlot", "UNetFamily", "UnfitControlNet", "from_pipe"]

# the attributes of a pipeline object that task pipelines made from it keep (numbers, names, lists of sizes)
PLAIN_VALUES = (bool, int, float, str, list, tuple)

UnfitControlNet = controlnet.UnfitControlNet


def from_pipe(cls, pipe, **overrides):
    """`cls.from_pipe(pipe, **overrides)` whose shared modules keep their dtypes. diffusers' own casts every module
    of the new pipeline to one dtype (float32 unless told) in place: a user's bf16 pipeline would come back in
    fp32, its memory doubled (a 4B transformer: 8 GB more), and one whose VAE was kept in fp32 would lose it."""
    kept = type(cls.__name__, (cls,), {"to": _unmoved})
    new = kept.from_pipe(pipe, **overrides)
    new.__class__ = cls
    return new


def _unmoved(pipe, *args, **kwargs):
    return pipe


class ModelView(Protocol):
    """What a family reads of a model (kasoku.model.pipeline_model.Model implements it)."""

    pipe: Any
    memo: dict[str, Any]  # what the family learnt of this model once (a generic family's recordings)
    recordings: Any  # a RecordingStore (kasoku.core.recording) keeping them across processes, or None

    def ref(self, path: str) -> ModuleRef: ...

    def is_loaded(self, path: str) -> bool: ...

    def release(self, path: str) -> None: ...


@dataclass(frozen=True)
class TextEncoderSlot:
    """A text encoder of the family's pipelines: its attribute (also its component name), its tokenizer's, the
    outputs the pipeline reads of it (see :mod:`kasoku.architectures.clip`), its architecture ("clip", or "t5":
    it reads the profile's text tokens), and whether a pipeline may leave it out (SD3's T5, as diffusers
    allows: `text_encoder_3=None`)."""

    name: str
    tokenizer: str = "tokenizer"
    outputs: tuple[str, ...] = clip.LAST_HIDDEN
    kind: str = "clip"
    optional: bool = False


class Family:
    """A family of diffusers pipelines kasoku compiles (subclass per family)."""

    name: ClassVar[str]
    title: ClassVar[str]
    generic: ClassVar[bool] = False  # compiled from recorded calls (kasoku.families.generic), not written by hand
    pipelines: ClassVar[Mapping[str, str]]  # task -> diffusers pipeline class name
    controlnet_pipelines: ClassVar[Mapping[str, str]] = {}  # task -> diffusers ControlNet pipeline class name
    # the architecture module of its ControlNets (kasoku.architectures.controlnet, .sd3_controlnet; None: it takes
    # none): their diffusers class, fit check and stand-ins
    controlnet_architecture: ClassVar[Any] = None
    controlled_denoiser: ClassVar[str] = ""  # in a ControlNet pipeline, the denoiser component taking their outputs
    # Other pipeline classes of the family, each set task -> class: a model compiled from one of a set runs that
    # set's classes for their tasks, the plain ones for the rest (LatentConsistencyModelPipeline and its img2img)
    pipeline_sets: ClassVar[tuple[Mapping[str, str], ...]] = ()
    text_encoder_slots: ClassVar[tuple[TextEncoderSlot, ...]] = (TextEncoderSlot("text_encoder"),)
    denoiser: ClassVar[str]  # the pipeline attribute that holds the denoiser; also its component's name
    vae: ClassVar[str] = "vae"
    # Call arguments only this family's pipelines take (others get a clear error).
    call_arguments: ClassVar[tuple[str, ...]] = ()
    # Pipeline attributes the engines replace besides the torch modules (a safety checker on torch images).
    replaced_attributes: ClassVar[Mapping[str, Any]] = {}
    runs_ip_adapters: ClassVar[bool] = False  # image prompts (diffusers' load_ip_adapter) on its engines
    # the argument of its pipelines' load_ip_adapter that says where the image encoder is
    ip_encoder_argument: ClassVar[str] = "image_encoder_folder"
    # whether its set_ip_adapter_scale takes one adapter's per-block numbers as a plain list (Flux's)
    ip_scale_per_block_list: ClassVar[bool] = False
    # the transformers class of the image encoder its IP-Adapters read (SD3's: SiglipVisionModel)
    ip_image_encoder: ClassVar[str] = "CLIPVisionModelWithProjection"
    # how many IP-Adapters its pipelines load at once (None: a list of any length; SD3's take one, not a list)
    ip_max_adapters: ClassVar[int | None] = None
    # kasoku's defaults for the commands (generate, batch, serve); a Python call keeps diffusers' own
    default_steps: ClassVar[int] = 30
    default_guidance: ClassVar[float] = 7.5
    # capabilities: the step-caching methods its denoiser runs (kasoku.core.step_cache; the first that reads an interval
    # is what `cache_interval` > 1 runs by default), and the step-cache graphs they build (empty: none)
    cache_methods: ClassVar[tuple[str, ...]] = ()
    step_cache_components: ClassVar[tuple[str, ...]] = ()
    # the tokens its long-prompt encoder reads when the profile does not say (diffusers' max_sequence_length
    # default); None: it has no such encoder
    default_text_tokens: ClassVar[int | None] = None
    latent_channels: ClassVar[int] = 4  # its VAE's (SD's four; the transformer families' sixteen)

    # ---- recognising it --------------------------------------------------------------------

    def class_names(self) -> tuple[str, ...]:
        """Every diffusers pipeline class of this family (the plain ones, the ControlNet ones, then the other
        sets')."""
        return tuple(dict.fromkeys((*self.pipelines.values(), *self.controlnet_pipelines.values(),
                                    *(name for group in self.pipeline_sets for name in group.values()))))

    def matches(self, pipeline_class: str, components: Mapping[str, Any],
                configs: Mapping[str, Mapping[str, Any]]) -> bool:
        """Whether a pipeline of this class, components and component configs (name -> config) is of this family."""
        return pipeline_class in self.class_names()

    def required_components(self) -> tuple[str, ...]:
        """The pipeline attributes a model of this family must have (its text encoders but optional ones, its
        denoiser, its VAE)."""
        encoders = tuple(slot.name for slot in self.text_encoder_slots if not slot.optional)
        return (*encoders, self.denoiser, self.vae)

    def check_layout(self, components: Mapping[str, Any], where: str) -> None:
        """Raise :class:`NotADiffusersPipeline` for a layout of this family kasoku cannot compile: one without a
        component the family's pipelines need. A pipeline without any text encoder is one diffusers serves (loaded
        with `text_encoder=None, ...`: its calls give the prompt embeddings)."""
        embeddings_only = all(components.get(name) is None for name in self.text_encoders)
        missing = [name for name in self.required_components() if components.get(name) is None
                   and not (embeddings_only and name in self.text_encoders)]
        if missing:
            raise NotADiffusersPipeline(
                f"{where} is a {self.title} pipeline without {', '.join(missing)}; kasoku compiles whole pipelines "
                "(save one with `pipe.save_pretrained(DIR)`).")

    # ---- components and their specs --------------------------------------------------------

    @property
    def text_encoders(self) -> tuple[str, ...]:
        return tuple(slot.name for slot in self.text_encoder_slots)

    def present_text_encoders(self, model: ModelView | None = None) -> tuple[TextEncoderSlot, ...]:
        """The text encoder slots `model` fills (an optional one may be None, and all are in a pipeline without text
        encoders: see :meth:`check_layout`); every slot without a model."""
        if model is None:
            return self.text_encoder_slots
        return tuple(s for s in self.text_encoder_slots if getattr(model.pipe, s.name, None) is not None)

    def text_tokens(self, profile: ShapeProfile) -> int | None:
        """The tokens the long-prompt encoder reads: the profile's, else the family's default."""
        return profile.text_tokens or self.default_text_tokens

    def call_default(self, name: str, task: str = "txt2img", source: str | None = None) -> Any:
        """diffusers' default of a call argument of this family's pipeline for `task` (of the pipeline set of
        the class `source`; inspect.Parameter.empty where it has none)."""
        return _call_defaults(self.pipeline_class(task, source=source)).get(name, inspect.Parameter.empty)

    def doubles_batch(self, kwargs: Mapping[str, Any], model: ModelView | None = None) -> bool:
        """Whether a call with these arguments runs the denoiser on twice the images (classifier-free guidance,
        diffusers' rule: a guidance scale above 1; diffusers' default where the call gives none)."""
        guidance = kwargs.get("guidance_scale")
        source = type(model.pipe).__name__ if model is not None else None
        return float(self.call_default("guidance_scale", source=source) if guidance is None else guidance) > 1

    def guidance_embedded(self, model: ModelView) -> bool:
        """Whether the denoiser embeds the guidance scale instead of running classifier-free guidance."""
        return False

    def denoiser_components(self, model: ModelView | None = None) -> tuple[str, ...]:
        """The denoiser's components (what runs in the loop) for this model: in a ControlNet pipeline, one engine
        per distinct ControlNet and the denoiser that takes their outputs."""
        if model is not None and self.controlnet_paths(model.pipe):
            return (*self.controlnet_components(model.pipe), self.controlled_denoiser)
        return (self.denoiser,)

    def component_names(self, model: ModelView | None = None) -> tuple[str, ...]:
        """The components of this family's pipelines (of `model`'s, when given), in build order."""
        encoders = tuple(slot.name for slot in self.present_text_encoders(model))
        return (*encoders, *self.image_prompt_components(model), *self.denoiser_components(model), *VAE_COMPONENTS)

    def image_prompt_components(self, model: ModelView | None = None) -> tuple[str, ...]:
        """The image encoder of a model with IP-Adapters loaded (see :meth:`ip_adapters`) and one to run them."""
        if model is None or not self.ip_adapters(model):
            return ()
        return (ip_adapter.IMAGE_ENCODER,) if getattr(model.pipe, ip_adapter.IMAGE_ENCODER, None) is not None else ()

    def ip_adapters(self, model: ModelView) -> tuple[str, ...]:
        """The kind of each IP-Adapter loaded into the model's denoiser (none: the family runs none)."""
        return ip_adapter.adapter_kinds(getattr(model.pipe, self.denoiser)) if self.runs_ip_adapters else ()

    def image_encoder_config(self, model: ModelView):
        """The config of the image encoder the model's IP-Adapters read (their inputs' sizes); refused without one."""
        encoder = getattr(model.pipe, ip_adapter.IMAGE_ENCODER, None)
        if encoder is None:
            raise ip_adapter.UnsupportedIPAdapter(
                "the pipeline has IP-Adapters but no image encoder; load the adapter with its image encoder "
                f"(load_ip_adapter(..., {self.ip_encoder_argument}=...)).")
        return encoder.config

    def denoiser_ip_inputs(self, model: ModelView, axes: Axes, batch: Axis | None = None) -> tuple[TensorSpec, ...]:
        """The IP-Adapters' inputs of the model's denoiser (none without adapters; `batch` its batch axis, default
        the guided one); the image encoder must fit them."""
        if not self.ip_adapters(model):
            return ()
        denoiser, config = getattr(model.pipe, self.denoiser), self.image_encoder_config(model)
        ip_adapter.check_fits(denoiser, config)
        return ip_adapter.embeds_inputs(denoiser, config, axes, batch)

    def ip_adapter_components(self, model: ModelView) -> tuple[str, ...]:
        """What loading or unloading IP-Adapters changes: the image encoder (when there is one) and the
        denoiser component that takes the image prompts."""
        return (*self.image_prompt_components(model), *self.denoiser_components(model)[-1:])

    def calibration_components(self, component: str, model: ModelView | None = None) -> tuple[str, ...]:
        """What a text-to-image run needs to reach `component` (its calibration records its inputs): the text
        encoders and the component, and for a component past the denoising loop (the VAE decoder) the denoiser's
        components too."""
        encoders = tuple(slot.name for slot in self.present_text_encoders(model))
        denoisers = self.denoiser_components(model)
        before = () if component in encoders or component in denoisers else denoisers
        return tuple(dict.fromkeys((*encoders, *before, component)))

    def tasks(self, model: ModelView) -> tuple[str, ...]:
        """The tasks this model runs."""
        return TASKS

    def task_components(self, task: str, model: ModelView | None = None) -> tuple[str, ...]:
        """The components a task runs (text-to-image never encodes an image)."""
        names = self.component_names(model)
        return tuple(n for n in names if n != "vae_encoder") if task == "txt2img" else names

    def extra_components(self, model: ModelView) -> tuple[str, ...]:
        """Components built only when named (the step-cache graphs)."""
        return ()

    def specs(self, model: ModelView, profile: ShapeProfile, names: Iterable[str] | None,
              cache_branch: int = DEFAULT_BRANCH) -> dict[str, ComponentSpec]:
        """The specs of `names` (default: every component the model has; the extra components only when named)."""
        available = self.component_names(model)
        extra = self.extra_components(model)
        names = list(available if names is None else names)
        absent = [n for n in names if n not in (*available, *extra)]
        if absent:
            raise KasokuError(f"this {self.title} model has no {', '.join(absent)}; "
                              f"its components are {', '.join(available + extra)}.")
        builders = self.spec_builders(model, profile, cache_branch)
        return {name: builders[name]() for name in names}

    def spec_builders(self, model: ModelView, profile: ShapeProfile,
                      cache_branch: int = DEFAULT_BRANCH) -> dict[str, Callable[[], ComponentSpec]]:
        axes = self.axes(model)
        builders: dict[str, Callable[[], ComponentSpec]] = {
            slot.name: (lambda slot=slot: self.text_encoder_spec(model, slot, profile, axes))
            for slot in self.present_text_encoders(model)
        }
        builders.update(self.denoiser_builders(model, profile, axes, cache_branch))
        if self.image_prompt_components(model):
            builders[ip_adapter.IMAGE_ENCODER] = lambda: ip_adapter.image_encoder_spec(
                model.ref(ip_adapter.IMAGE_ENCODER), profile, axes)
        fp32_for = self.vae_fp32_for(model)
        builders["vae_decoder"] = lambda: vae.decoder_spec(model.ref(self.vae), profile, axes, fp32_for=fp32_for)
        builders["vae_encoder"] = lambda: vae.encoder_spec(model.ref(self.vae), profile, axes, fp32_for=fp32_for)
        return builders

    def denoiser_builders(self, model: ModelView, profile: ShapeProfile, axes: Axes,
                          cache_branch: int) -> dict[str, Callable[[], ComponentSpec]]:
        """Spec builders of the denoiser's components (subclasses)."""
        raise NotImplementedError

    def text_length(self, model: ModelView, slot: TextEncoderSlot | None = None) -> int:
        """The tokens a text encoder reads (its tokenizer's model_max_length; default: the first slot's)."""
        slot = slot or self.text_encoder_slots[0]
        tokenizer = getattr(model.pipe, slot.tokenizer, None)
        return clip.TOKENS if tokenizer is None else tokenizer.model_max_length  # diffusers' own fallback

    def denoiser_text_length(self, model: ModelView, profile: ShapeProfile) -> int:
        """The text tokens the denoiser reads (the length of `prompt_embeds`): the first text encoder's."""
        return self.text_length(model)

    def text_encoder_spec(self, model: ModelView, slot: TextEncoderSlot, profile: ShapeProfile,
                          axes: Axes) -> ComponentSpec:
        if slot.kind == "t5":
            return t5.t5_spec(slot.name, model.ref(slot.name), profile, axes, length=self.text_tokens(profile))
        return clip.text_encoder_spec(slot.name, model.ref(slot.name), profile, axes,
                                      length=self.text_length(model, slot), outputs=slot.outputs)

    def axes(self, model: ModelView) -> Axes:
        return Axes(vae.scale_factor(model.ref(self.vae).config))

    def vae_fp32_for(self, model: ModelView) -> dict[Precision, str]:
        """Precision -> why the VAE is built in fp32 when that precision is asked for (empty: never)."""
        return {}

    # ---- sizes -----------------------------------------------------------------------------

    def pixel_multiple(self, model: ModelView) -> int:
        """Height and width must be multiples of this (the VAE's scale times the denoiser's downsampling)."""
        return vae.scale_factor(model.ref(self.vae).config)

    def native_size(self, model: ModelView) -> int:
        """diffusers' default image size for this model."""
        raise NotImplementedError

    def default_profile(self, model: ModelView, max_batch: int = 4) -> ShapeProfile:
        """min = half, opt = the model's native size, max = double; 1..`max_batch` images."""
        return default_profile(self.native_size(model), self.pixel_multiple(model), max_batch)

    # ---- pipelines on engines --------------------------------------------------------------

    def pipelines_for(self, source: str | None = None, *, controlnet: bool = False) -> Mapping[str, str]:
        """Task -> class name of the pipelines a model compiled from the class `source` runs."""
        if controlnet:
            return self.controlnet_pipelines
        group = next((g for g in self.pipeline_sets if source in g.values()), {})
        return {**self.pipelines, **group}

    def pipeline_class(self, task: str, *, controlnet: bool = False, source: str | None = None):
        """The diffusers class of `task` (for a model compiled from the class `source`: see `pipeline_sets`)."""
        import diffusers

        return getattr(diffusers, self.pipelines_for(source, controlnet=controlnet)[task])

    # ---- ControlNet (the families whose `controlnet_pipelines` and `controlnet_architecture` say they take them) --

    def controlnet_paths(self, pipe) -> tuple[str, ...]:
        """Where each ControlNet the pipeline runs is, in diffusers' order: "controlnet", or
        "controlnet.nets.<i>" in a multi-ControlNet (see module_at); empty without one."""
        net = getattr(pipe, "controlnet", None) if self.controlnet_architecture else None
        if net is None:
            return ()
        nets = getattr(net, "nets", None)
        return ("controlnet",) if nets is None else tuple(f"controlnet.nets.{i}" for i in range(len(nets)))

    def controlnet_components(self, pipe) -> dict[str, str]:
        """Component name -> where its ControlNet is: one engine per distinct ControlNet model (a model
        given twice runs one engine)."""
        names: dict[int, str] = {}
        components: dict[str, str] = {}
        for path in self.controlnet_paths(pipe):
            module = module_at(pipe, path)
            if id(module) not in names:
                names[id(module)] = CONTROLNET_COMPONENT.format(len(names))
                components[names[id(module)]] = path
        return components

    def check_controlnet(self, pipe, net, where: str) -> None:
        """Raise :class:`UnfitControlNet` for a ControlNet that cannot steer this pipeline's denoiser on engines."""
        wanted = self.controlnet_architecture.MODEL_CLASS
        if type(net).__name__ != wanted:
            raise UnfitControlNet(f"{where} is a {type(net).__name__}; a {self.title} pipeline takes a {wanted}.")
        self.controlnet_architecture.check_fits(net.config, getattr(pipe, self.denoiser).config,
                                                getattr(pipe, self.vae).config.latent_channels, where, self.title)

    def controlnet_task(self, pipe) -> str:
        """The task of the ControlNet pipeline `pipe` becomes with a ControlNet."""
        return "txt2img"

    def with_controlnet(self, pipe, net):
        """This family's ControlNet pipeline of `pipe`'s task, sharing `pipe`'s components, with `net` (a
        ControlNet, or a list of them for several); families without ControlNets refuse one."""
        if not self.controlnet_architecture:
            raise UnfitControlNet(f"kasoku runs no ControlNet on {self.title} pipelines; compile without "
                                  "`controlnet`.")
        nets = net if isinstance(net, (list, tuple)) else getattr(net, "nets", [net])
        for index, one in enumerate(nets):
            self.check_controlnet(pipe, one, f"ControlNet {index + 1} of {len(nets)}" if len(nets) > 1 else
                                  "the ControlNet")
        self.controlnet_architecture.check_together([one.config for one in nets])
        new = from_pipe(self.pipeline_class(self.controlnet_task(pipe), controlnet=True), pipe, controlnet=net)
        new.set_progress_bar_config(disable=True)
        return new

    def control_arguments(self, task: str, control_image) -> dict[str, Any]:
        """The control images as the family's ControlNet pipeline for `task` takes them."""
        return {"control_image": control_image}

    def controlnet_stand_in(self, pipe, engines, times):
        """What replaces the pipeline's ControlNet: one engine-backed ControlNet, or diffusers' own
        multi-ControlNet over one per ControlNet (it sums their outputs, as in diffusers)."""
        import diffusers

        architecture = self.controlnet_architecture
        single = controlnet.stand_in_class(architecture.STAND_IN, getattr(diffusers, architecture.MODEL_CLASS))
        component_of = {id(module_at(pipe, path)): name for name, path in self.controlnet_components(pipe).items()}
        nets = [single(module_at(pipe, path), engines, times, component_of[id(module_at(pipe, path))])
                for path in self.controlnet_paths(pipe)]
        if self.controlnet_paths(pipe) == ("controlnet",):
            return nets[0]
        return controlnet.multi_stand_in_class(getattr(diffusers, architecture.MULTI_CLASS))(nets)

    def tiny_controlnet(self, *, seed: int = 0):
        """A tiny ControlNet for this family's tiny pipeline, with deterministic weights from `seed`."""
        raise UnfitControlNet(f"{self.title} has no tiny ControlNet: kasoku runs no ControlNet on its pipelines.")

    def tiny_vae(self, *, seed: int = 0):
        """A tiny AutoencoderTiny (TAESD) for this family's tiny pipeline, with deterministic weights from `seed`."""
        from ..architectures.tiny import seeded, tiny_autoencoder_tiny

        return seeded(seed, 6, lambda: tiny_autoencoder_tiny(latent_channels=self.latent_channels)).eval()

    def task_pipeline(self, pipe, task: str, **overrides):
        """A diffusers pipeline of this family for `task`, sharing `pipe`'s components (a ControlNet
        pipeline where `pipe` has ControlNets)."""
        has_controlnet = bool(self.controlnet_paths(pipe))
        if getattr(pipe, "vae", None) is not None:  # from_pipe drops a VAE its type hint does not name (TAESD)
            overrides = {"vae": pipe.vae, **overrides}
        new = from_pipe(self.pipeline_class(task, controlnet=has_controlnet, source=type(pipe).__name__), pipe,
                        **overrides)
        new.set_progress_bar_config(disable=True)
        if type(new) is type(pipe):  # from_pipe copies components and config: what was set on the object, too
            components = set(pipe.components) | set(pipe.config)  # (their entries are tuples: not these)
            for name, value in vars(pipe).items():  # (Kandinsky 5's `resolutions`, the sizes it snaps to)
                if not name.startswith("_") and name in vars(new) and name not in components and \
                        isinstance(value, PLAIN_VALUES):
                    setattr(new, name, value)
        return new

    def in_torch(self, model: ModelView) -> dict[str, str]:
        """Component -> why it runs in torch, known before any build (a hand-written family compiles them all)."""
        return {}

    def keep_in_torch(self, model: ModelView, reasons: Mapping[str, str]) -> None:
        """Remember components whose engine could not be built (only recorded graphs fall back to torch)."""

    def at_one_shape(self, model: ModelView, reasons: Mapping[str, str]) -> None:
        """Remember components whose engine takes one shape since their dynamic graph failed (only recorded graphs
        fall back so)."""

    def one_shape(self, model: ModelView) -> dict[str, str]:
        """Component -> why its engine takes one shape where the profile has several (none for a hand-written
        family)."""
        return {}

    def part_specs(self, model: ModelView, profile: ShapeProfile, kept: Iterable[str],
                   step_cache: bool = False) -> dict[str, ComponentSpec]:
        """Specs of the parts of components the compile kept in torch (`kept`), compiled in their place, or (with
        `step_cache`) that a step cache runs (a denoiser's blocks: only recorded families have them)."""
        return {}

    def grows_by_shape(self, model: ModelView) -> tuple[str, ...]:
        """The components of one shape whose engine of another call shape is built on its first call (none for a
        hand-written family)."""
        return ()

    def stand_ins(self, model: ModelView, engines: Mapping[str, Any], times: EngineTimes) -> dict[str, Any]:
        """The pipeline attributes that engines replace: its torch modules, and what ran on their output."""
        pipe = model.pipe
        replaced: dict[str, Any] = {self.vae: vae.EngineVAE(getattr(pipe, self.vae), engines, times)}
        for slot in self.present_text_encoders(model):
            stand_in = t5.EngineT5Encoder if slot.kind == "t5" else clip.stand_in_for(slot.outputs)
            replaced[slot.name] = stand_in(getattr(pipe, slot.name), engines, times, slot.name)
        replaced.update(self.denoiser_stand_ins(model, engines, times))
        replaced = {**replaced, **self.replaced_attributes}
        if self.image_prompt_components(model):  # diffusers' encode_image: its processor, then the encoder
            replaced[ip_adapter.IMAGE_ENCODER] = ip_adapter.EngineImageEncoder(
                getattr(pipe, ip_adapter.IMAGE_ENCODER), engines, times)
            replaced["feature_extractor"] = pipe.feature_extractor
        return replaced

    def denoiser_stand_ins(self, model: ModelView, engines: Mapping[str, Any], times: EngineTimes) -> dict[str, Any]:
        raise NotImplementedError

    def step_cache_graphs(self, model: ModelView, caching) -> tuple[str, ...]:
        """The engines a call's step caching (a :class:`kasoku.core.step_cache.StepCaching`) runs besides the plain
        denoiser's: its method's graphs (a recorded family's first-block cache runs its denoiser's blocks)."""
        return caching.graphs

    def step_cache_specs(self, model: ModelView, profile: ShapeProfile | None,
                         names: Iterable[str]) -> dict[str, ComponentSpec] | None:
        """The specs of step-cache graphs `names` where they are not components the family's `specs` gives (None:
        they are)."""
        return None

    def step_cache_target(self, stand_ins: Mapping[str, Any], model: ModelView):
        """The stand-in that runs a call's step caching (see kasoku.core.step_cache; None without the capability): the
        denoiser, and its ControlNets (they skip the steps the run does not compute in full)."""
        if not self.cache_methods:
            return None
        nets = stand_ins.get("controlnet")
        if nets is None:
            return stand_ins[self.denoiser]
        return StepCacheTargets((stand_ins[self.denoiser], *getattr(nets, "nets", [nets])))

    # ---- call arguments --------------------------------------------------------------------

    def check_arguments(self, kwargs: Mapping[str, Any]) -> None:
        """Family-specific checks of a call's arguments (raise InvalidInput)."""

    def lora_aliases(self, components: Iterable[str]) -> dict[str, str]:
        """A LoRA file's component prefix -> the engine component it changes, where the two differ: LoRA files
        name the denoiser by its attribute; in a ControlNet pipeline its engine is the one taking their outputs."""
        components = set(components)
        return {self.denoiser: self.controlled_denoiser} if self.controlled_denoiser in components and \
            self.denoiser not in components else {}

    def lora_state_dict(self, source, model: ModelView, **kwargs) -> tuple[dict, dict | None, dict | None]:
        """diffusers' reading of a LoRA file for this family's pipelines: (state dict, network alphas, metadata).
        The families' loader mixins answer in different shapes; this is the one kasoku reads."""
        read = self.pipeline_class("txt2img").lora_state_dict
        if "return_alphas" in inspect.signature(read).parameters:  # Flux's
            return read(source, return_alphas=True, return_lora_metadata=True, **kwargs)
        state_dict, metadata = read(source, return_lora_metadata=True, **kwargs)  # SD3's: no alphas
        return state_dict, None, metadata

    # ---- the built-in tiny model -----------------------------------------------------------

    def tiny_pipeline(self, *, inpainting: bool = False, prediction: str = "epsilon", seed: int = 0):
        """A live tiny pipeline of this family with deterministic weights (see kasoku.tools.tiny)."""
        raise NotImplementedError(f"{self.title} has no built-in tiny model")

    def __repr__(self) -> str:
        return f"<family {self.name}: {self.title}>"


class UNetFamily(Family):
    """A family whose denoiser is a UNet2DConditionModel (SD 1.x, 2.x, XL): ControlNets steer it, and its
    step-cache graphs (DeepCache) are two more components of its weights."""

    denoiser = "unet"
    controlnet_architecture = controlnet
    controlled_denoiser = CONTROLNET_UNET
    cache_methods = (DEEPCACHE, TAYLORSEER)
    step_cache_components = STEP_CACHE_COMPONENTS
    runs_ip_adapters = True

    # ---- the U-Net's components ----------------------------------------------------------------

    def extra_components(self, model: ModelView) -> tuple[str, ...]:
        return STEP_CACHE_COMPONENTS

    def tasks(self, model: ModelView) -> tuple[str, ...]:
        """An inpainting model (a U-Net that also reads the mask and the masked image, 9 channels) inpaints only."""
        return ("inpaint",) if model.ref(self.denoiser).config.in_channels == 9 else TASKS

    def guidance_embedded(self, model: ModelView) -> bool:
        """An LCM-distilled U-Net embeds the guidance scale (`timestep_cond`, its config's `time_cond_proj_dim`)."""
        return bool(model.ref(self.denoiser).config.get("time_cond_proj_dim"))

    def doubles_batch(self, kwargs: Mapping[str, Any], model: ModelView | None = None) -> bool:
        """A U-Net that embeds the guidance scale runs no classifier-free guidance (diffusers' rule), whatever
        the scale."""
        if model is not None and self.guidance_embedded(model):
            return False
        return super().doubles_batch(kwargs, model)

    def unet_added_inputs(self, model: ModelView, axes: Axes) -> tuple[TensorSpec, ...]:
        """The U-Net's added conditioning inputs (none in SD 1.x/2.x)."""
        return ()

    def denoiser_builders(self, model: ModelView, profile: ShapeProfile, axes: Axes,
                          cache_branch: int) -> dict[str, Callable[[], ComponentSpec]]:
        text_length = self.denoiser_text_length(model, profile)

        def plain() -> ComponentSpec:
            return unet.unet_spec(model.ref(self.denoiser), profile, axes, text_length=text_length,
                                  added=self.unet_added_inputs(model, axes), ip=self.denoiser_ip_inputs(model, axes))

        def with_residuals() -> ComponentSpec:
            return unet.residual_unet_spec(model.ref(self.denoiser), profile, axes, text_length=text_length,
                                           added=self.unet_added_inputs(model, axes),
                                           ip=self.denoiser_ip_inputs(model, axes))

        controlled = bool(self.controlnet_paths(model.pipe))
        # DeepCache in a ControlNet pipeline: the full graph takes the residuals, the shallow one runs without them
        builders: dict[str, Callable[[], ComponentSpec]] = {
            self.denoiser: plain,
            deepcache.FULL: lambda: deepcache.unet_full_spec(with_residuals() if controlled else plain(),
                                                             model.ref(self.denoiser), axes, cache_branch),
            deepcache.SHALLOW: lambda: deepcache.unet_shallow_spec(plain(), model.ref(self.denoiser), axes,
                                                                   cache_branch),
        }
        if controlled:
            builders[CONTROLNET_UNET] = with_residuals
            for name, path in self.controlnet_components(model.pipe).items():
                builders[name] = lambda name=name, path=path: self.controlnet_spec(model, name, path, profile, axes)
        return builders

    # ---- sizes -------------------------------------------------------------------------------

    def pixel_multiple(self, model: ModelView) -> int:
        """The VAE's 8x times the U-Net's downsampling."""
        return super().pixel_multiple(model) * 2 ** unet.levels(model.ref(self.denoiser).config)

    def native_size(self, model: ModelView) -> int:
        """The U-Net's sample size times the VAE's scale factor."""
        return model.ref(self.denoiser).config.sample_size * super().pixel_multiple(model)

    # ---- ControlNet ------------------------------------------------------------------------------

    def controlnet_task(self, pipe) -> str:
        """An inpainting U-Net's ControlNet pipeline is diffusers' ControlNet inpainting one."""
        return "inpaint" if getattr(pipe, self.denoiser).config.in_channels == 9 else "txt2img"

    def control_arguments(self, task: str, control_image) -> dict[str, Any]:
        """Its text-to-image ControlNet pipeline calls the control images `image`, the others `control_image`."""
        return {"image" if task == "txt2img" else "control_image": control_image}

    def controlnet_spec(self, model: ModelView, name: str, path: str, profile: ShapeProfile,
                        axes: Axes) -> ComponentSpec:
        """A ControlNet: the latents, timestep, text embeddings, the control image at the image's size and one
        scale per residual (plus the family's added conditioning) in; its scaled residuals out."""
        ref = model.ref(path)
        self.check_controlnet(model.pipe, ref.module, f"ControlNet {name}")
        return controlnet.controlnet_spec(name, ref, profile, axes, text_length=self.text_length(model),
                                          added=self.unet_added_inputs(model, axes))

    # ---- stand-ins -------------------------------------------------------------------------------

    def denoiser_stand_ins(self, model: ModelView, engines: Mapping[str, Any], times: EngineTimes) -> dict[str, Any]:
        pipe = model.pipe
        has_controlnet = bool(self.controlnet_paths(pipe))
        replaced: dict[str, Any] = {self.denoiser: unet.EngineUNet(getattr(pipe, self.denoiser), engines, times,
                                                                   CONTROLNET_UNET if has_controlnet else
                                                                   self.denoiser)}
        if has_controlnet:
            replaced["controlnet"] = self.controlnet_stand_in(pipe, engines, times)
        return replaced

    # ---- LoRA and the tiny model -------------------------------------------------------------------

    def lora_state_dict(self, source, model: ModelView, **kwargs) -> tuple[dict, dict | None, dict | None]:
        return self.pipeline_class("txt2img").lora_state_dict(source, unet_config=model.ref(self.denoiser).config,
                                                              return_lora_metadata=True, **kwargs)

    def tiny_unet(self, in_channels: int, **config):
        """This family's tiny U-Net (subclasses); `config` adds to its config (an LCM U-Net's time_cond_proj_dim)."""
        raise NotImplementedError

    # the class an LCM-distilled U-Net of this family comes in (None: the family's own text-to-image pipeline,
    # which embeds the guidance scale when the U-Net's config says so)
    lcm_pipeline: ClassVar[str | None] = None

    def tiny_lcm_pipeline(self, *, seed: int = 0):
        """The tiny pipeline with an LCM-distilled U-Net (a guidance embedding, `time_cond_proj_dim`) and diffusers'
        LCMScheduler, as the family's LCM pipeline class."""
        import diffusers

        from ..architectures.tiny import SCHEDULER_COMMON, TINY_SIZES, seeded

        base = self.tiny_pipeline(seed=seed)
        unet = seeded(seed, 7, lambda: self.tiny_unet(4, time_cond_proj_dim=TINY_SIZES.guidance_embedding))
        cls = getattr(diffusers, self.lcm_pipeline) if self.lcm_pipeline else type(base)
        pipe = from_pipe(cls, base, unet=unet.eval(), scheduler=diffusers.LCMScheduler(**SCHEDULER_COMMON))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def tiny_controlnet(self, *, seed: int = 0):
        """A tiny ControlNet for this family's tiny U-Net, with deterministic weights from `seed`."""
        from ..architectures.tiny import seeded, tiny_controlnet

        return seeded(seed, 5, lambda: tiny_controlnet(self.tiny_unet(4)))


class TransformerFamily(Family):
    """A family whose denoiser is a diffusion transformer (`transformer`: SD3, Flux), with a T5 encoder for
    long prompts. Subclasses name their transformer's architecture module and stand-in (and their ControlNets'),
    their text encoders and their tiny model."""

    denoiser = "transformer"
    transformer_architecture: ClassVar[Any]  # its transformer's module (kasoku.architectures.sd3, .flux)
    transformer_stand_in: ClassVar[type]  # what diffusers calls in its place
    patch = 2  # latent cells per token side
    latent_channels = 16
    cache_methods = (FIRST_BLOCK, TAYLORSEER)
    step_cache_components = BLOCK_COMPONENTS

    def extra_components(self, model: ModelView) -> tuple[str, ...]:
        return BLOCK_COMPONENTS

    def transformer_ip_inputs(self, model: ModelView, axes: Axes) -> tuple[TensorSpec, ...]:
        """The transformer's IP-Adapter inputs (their rows: the guided batch's, as its other inputs)."""
        return self.denoiser_ip_inputs(model, axes)

    def denoiser_builders(self, model: ModelView, profile: ShapeProfile, axes: Axes,
                          cache_branch: int) -> dict[str, Callable[[], ComponentSpec]]:
        """The transformer, its first-block cache graphs and, in a ControlNet pipeline, the ControlNets and the
        transformer taking their samples (`controlled_denoiser`)."""
        architecture, length = self.transformer_architecture, self.denoiser_text_length(model, profile)

        def build(**control) -> ComponentSpec:
            return architecture.transformer_spec(model.ref(self.denoiser), profile, axes, text_length=length,
                                                 ip=self.transformer_ip_inputs(model, axes), **control)

        builders = {self.denoiser: build, **{name: lambda name=name: architecture.block_cache_specs(
            build(), model.ref(self.denoiser), axes)[name] for name in self.step_cache_components}}
        controlnets = self.controlnet_components(model.pipe)
        if controlnets:
            # the ControlNets have one layout (see check_together): the first says what the transformer takes
            blocks = self.controlnet_architecture.control_blocks(model.ref(next(iter(controlnets.values()))).config)
            builders[self.controlled_denoiser] = lambda: build(control_blocks=blocks, name=self.controlled_denoiser)
            builders.update({name: lambda name=name, path=path: self.controlnet_spec(model, name, path, profile, axes)
                             for name, path in controlnets.items()})
        return builders

    def controlnet_spec(self, model: ModelView, name: str, path: str, profile: ShapeProfile,
                        axes: Axes) -> ComponentSpec:
        """A ControlNet, reading the text embeddings the transformer reads."""
        ref = model.ref(path)
        self.check_controlnet(model.pipe, ref.module, f"ControlNet {name}")
        return self.controlnet_architecture.controlnet_spec(name, ref, profile, axes,
                                                            text_length=self.denoiser_text_length(model, profile))

    def denoiser_stand_ins(self, model: ModelView, engines: Mapping[str, Any], times: EngineTimes) -> dict[str, Any]:
        pipe = model.pipe
        controlled = bool(self.controlnet_paths(pipe))
        transformer = self.transformer_stand_in(getattr(pipe, self.denoiser), engines, times,
                                                self.controlled_denoiser if controlled else self.denoiser)
        return {self.denoiser: transformer, **({"controlnet": self.controlnet_stand_in(pipe, engines, times)}
                                               if controlled else {})}

    def tasks(self, model: ModelView) -> tuple[str, ...]:
        """With ControlNets, the tasks diffusers has a ControlNet pipeline for (SD3's: text-to-image only)."""
        return tuple(self.controlnet_pipelines) if self.controlnet_paths(model.pipe) else super().tasks(model)

    def task_components(self, task: str, model: ModelView | None = None) -> tuple[str, ...]:
        """Their ControlNet pipelines encode the control images with the VAE, text-to-image as it is."""
        if model is not None and self.controlnet_paths(model.pipe):
            return self.component_names(model)
        return super().task_components(task, model)

    def native_size(self, model: ModelView) -> int:
        config = model.ref(self.denoiser).config
        return int(config.get("sample_size") or self.default_sample_size) * super().pixel_multiple(model)

    default_sample_size: ClassVar[int] = 128  # diffusers' default when the transformer's config has none

    def pixel_multiple(self, model: ModelView) -> int:
        """The VAE's 8x times the transformer's patch."""
        return super().pixel_multiple(model) * self.patch


@functools.cache
def _call_defaults(pipeline_class: type) -> dict[str, Any]:
    """The defaults of a diffusers pipeline class's `__call__`."""
    parameters = inspect.signature(pipeline_class.__call__).parameters
    return {name: parameter.default for name, parameter in parameters.items()}
