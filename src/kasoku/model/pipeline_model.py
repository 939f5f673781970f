"""The model: one object for a diffusers pipeline as kasoku compiles it.

A :class:`Model` carries the pipeline, its family (detected once), lazy loading (modules on the meta
device until their weights are needed, :mod:`kasoku.model.loading`) and the weight digests
(:mod:`kasoku.model.fingerprint`). It is what the builder, the runtime, the policies and the tools pass around
instead of a pipeline and the facts recomputed from it: its components, tasks, sizes and specs are asked
of it, and it answers them through its family. Families see it as a :class:`~kasoku.families.base.ModelView`:
:meth:`Model.ref` hands an architecture one module, never the pipeline.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..architectures.base import ModuleRef, module_at
from ..core.components import ComponentSpec, ShapeProfile
from ..core.recording import RecordingStore
from ..core.schedulers import few_step_defaults
from ..core.step_cache import DEFAULT_BRANCH
from ..core.weights import floating_dtype, weight_bytes
from ..families import TASKS, Family, family_of
from .fingerprint import WeightsFingerprints
from .loading import (
    in_compiled_dtypes,
    lazy_source,
    load_pipeline,
    model_label,
    own_module,
    real_module,
    release_module,
)

__all__ = ["Model", "TINY_VAE_NOTE", "component_specs"]

# what a compile says of a model whose VAE kasoku swapped for the tiny one
TINY_VAE_NOTE = ("the VAE is the tiny autoencoder (AutoencoderTiny): images differ from the full VAE's (a little "
                 "softer); verify and the parity checks compare with diffusers on the same tiny VAE.")


class Model:
    """A diffusers pipeline, its family, lazy loading and weight digests."""

    def __init__(self, pipe, *, label: str | None = None, weights: WeightsFingerprints | None = None):
        self.family: Family = family_of(pipe)  # an unsupported pipeline fails here, naming the supported ones
        self.pipe = in_compiled_dtypes(pipe, keeps_bf16=self.family.generic)
        self.label = label or model_label(pipe)
        self.weights = weights or WeightsFingerprints()
        self.notes: list[str] = []  # what a compile of it says (a VAE swapped for the tiny one)
        self.memo: dict[str, Any] = {}  # what its family learnt of it once (a generic family's recordings)
        self.recordings: RecordingStore | None = None  # where its recordings are kept across processes

    @classmethod
    def of(cls, model: Any, *, label: str | None = None, weights: WeightsFingerprints | None = None) -> Model:
        """`model` itself when it is a Model, else the Model of a live diffusers pipeline."""
        if isinstance(model, Model):
            return model
        return cls(model, label=label, weights=weights)

    @classmethod
    def load(cls, source: Any, *, lazy: bool = False, controlnet=None, tiny_vae=None, label: str | None = None,
             torch_dtype: torch.dtype | None = None) -> Model:
        """A folder, a hub id (when online), a live pipeline or a Model, with `controlnet` (folders or models)
        added and its VAE swapped for `tiny_vae` (an AutoencoderTiny or its folder); with `lazy`, a folder's
        modules are built on the meta device and loaded when needed. A folder's weights are read in `torch_dtype`
        (float32 unless given; a generic pipeline in bf16 compiles bf16 graphs from them, at half the memory)."""
        if isinstance(source, Model):
            if controlnet is None and tiny_vae is None:
                return source
            source = source.pipe
        pipe = load_pipeline(source, lazy=lazy, controlnet=controlnet, tiny_vae=tiny_vae,
                             **({"torch_dtype": torch_dtype} if torch_dtype is not None else {}))
        model = cls(pipe, label=label or model_label(source))
        if tiny_vae is not None:
            model.notes.append(TINY_VAE_NOTE)
        return model

    def remember_digests_under(self, root: str | Path) -> Model:
        """Remember what is learnt of this model in this cache folder: the digests of folder-loaded weights and a
        generic family's recordings (a warm start then reads no weights and runs no pipeline)."""
        self.weights.remember_under(root)
        self.recordings = RecordingStore(root, self.label)
        return self

    # ---- what a family reads: one module at a time ------------------------------------------------

    def ref(self, path: str) -> ModuleRef:
        """The module at `path` ("unet", "controlnet.nets.1") as an architecture takes it."""
        module = module_at(self.pipe, path)
        if module is None:
            raise KeyError(f"the {self.family.title} pipeline has no {path}")
        return ModuleRef(path, module, load=lambda: real_module(self.pipe, path),
                         digest=lambda: self.weights.of(self.pipe, path),
                         base_digest=lambda: self.weights.base_of(self.pipe, path))

    def weight_bytes(self, path: str) -> int:
        """The bytes of the module's weights in the dtype they are (or will be) read in (counted on the meta device
        too: nothing is read)."""
        return weight_bytes(module_at(self.pipe, path))

    def in_bf16(self, path: str) -> bool:
        """Whether the module's weights are (or will be) read in bfloat16, which its graph then computes in."""
        return floating_dtype(module_at(self.pipe, path)) == torch.bfloat16

    def digest_known(self, path: str) -> bool:
        """Whether the module's weight digest can be had without reading its weights from disk."""
        return self.weights.known_without_loading(self.pipe, path)

    def is_loaded(self, path: str) -> bool:
        """Whether the module's weights are in memory now (a lazily loaded module is not until it is built)."""
        return lazy_source(module_at(self.pipe, path)) is None

    def changing(self, path: str) -> torch.nn.Module:
        """The module at `path` with its weights, about to change in memory (an IP-Adapter loaded into it, or
        unloaded): kept loaded, and its digest computed again from memory when next asked; the digest of its
        weights as they are now is kept as its base digest (what adapters are loaded on)."""
        base = self.weights.base_of(self.pipe, path)
        module = own_module(self.pipe, path)
        self.weights.forget(module)
        self.weights.remember_base(module, base)
        return module

    def release(self, path: str) -> None:
        """Drop the weights of a module kasoku loaded lazily (its engines are built)."""
        release_module(self.pipe, path)

    def prefetch_digests(self, paths: Iterable[str]) -> None:
        """Start hashing these live modules' weights in the background (see WeightsFingerprints.prefetch)."""
        self.weights.prefetch(self.pipe, list(paths))

    # ---- what everything else asks -----------------------------------------------------------------

    @property
    def components(self) -> tuple[str, ...]:
        return self.family.component_names(self)

    @property
    def tasks(self) -> tuple[str, ...]:
        return self.family.tasks(self)

    @property
    def task(self) -> str:
        """The model's own task (text-to-image, or inpainting for an inpainting model)."""
        return self.tasks[0]

    def task_components(self, task: str) -> tuple[str, ...]:
        return self.family.task_components(task, self)

    @property
    def controlnets(self) -> int:
        """How many ControlNets steer it (0: none)."""
        return len(self.family.controlnet_paths(self.pipe))

    @property
    def native_size(self) -> int:
        return self.family.native_size(self)

    @property
    def pixel_multiple(self) -> int:
        return self.family.pixel_multiple(self)

    def default_profile(self, max_batch: int = 4) -> ShapeProfile:
        return self.family.default_profile(self, max_batch)

    @property
    def scheduler(self):
        return self.pipe.scheduler

    def specs(self, profile: ShapeProfile | None = None, names: Iterable[str] | None = None, *,
              cache_branch: int | None = None) -> dict[str, ComponentSpec]:
        """The component specs (all the model has, or `names`), for `profile` (default: the model's default)."""
        branch = DEFAULT_BRANCH if cache_branch is None else cache_branch
        return self.family.specs(self, profile or self.default_profile(), names, branch)

    @property
    def pipeline_tasks(self) -> tuple[str, ...]:
        """The tasks the family has a diffusers class for this model (with ControlNets: a ControlNet class)."""
        classes = self.family.pipelines_for(type(self.pipe).__name__, controlnet=bool(self.controlnets))
        return tuple(task for task in TASKS if task in classes)

    def pipeline_classes(self) -> list[type]:
        """The class the model's pipeline is, then the family's classes of the other tasks (ControlNet ones with
        ControlNets)."""
        return list(dict.fromkeys([type(self.pipe), *(self.pipeline_class(task) for task in self.pipeline_tasks)]))

    def fixed_arguments(self, profile: ShapeProfile) -> dict[str, Any]:
        """The call arguments engines built for `profile` fix, with their values: the text tokens they were compiled
        for (`max_sequence_length`; diffusers' default may be another), and no resolution binning (it computes at
        another size than the engines were built for). Every call on engines takes them: a user's, a calibration's,
        a diffusers pipeline's compared with it."""
        compiled = self.family.text_tokens(profile)
        fixed: dict[str, Any] = {} if compiled is None else {"max_sequence_length": compiled}
        if all("use_resolution_binning" in inspect.signature(cls.__call__).parameters
               for cls in self.pipeline_classes()):
            fixed["use_resolution_binning"] = False
        return fixed

    def pipeline_class(self, task: str):
        """The diffusers class this model runs `task` with (its ControlNet class with ControlNets; the class it
        was compiled from for its own task)."""
        return self.family.pipeline_class(task, controlnet=bool(self.controlnets), source=type(self.pipe).__name__)

    def command_defaults(self, scheduler=None) -> tuple[int, float]:
        """(steps, guidance) of the commands (generate, batch, serve) when not told: a few-step scheduler's
        (`scheduler`, default the model's; see kasoku.core.schedulers.few_step_defaults), else the family's."""
        few = few_step_defaults(scheduler or self.scheduler, guidance_embedded=self.family.guidance_embedded(self))
        return few or (self.family.default_steps, self.family.default_guidance)

    def doubles_batch(self, kwargs) -> bool:
        """Whether a call with these arguments runs the denoiser on twice the images (classifier-free guidance)."""
        return self.family.doubles_batch(kwargs, self)

    def task_pipeline(self, task: str, **overrides):
        """The family's diffusers pipeline of `task` on this model's components (`overrides` replace some)."""
        return self.family.task_pipeline(self.pipe, task, **overrides)

    def __repr__(self) -> str:
        return f"Model({self.label!r}, {self.family.title})"


def component_specs(pipe, profile: ShapeProfile | None = None, names: Iterable[str] | None = None, *,
                    weights: WeightsFingerprints | None = None, cache_branch: int | None = None
                    ) -> dict[str, ComponentSpec]:
    """The component specs of a diffusers pipeline (or Model): all it has, or `names`."""
    return Model.of(pipe, weights=weights).specs(profile, names, cache_branch=cache_branch)
