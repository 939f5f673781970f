"""LoRA adapters on compiled engines: diffusers' files and names, weights rebound without re-export.

An adapter is read with diffusers' own `lora_state_dict` (its conversions of kohya/A1111 and older
diffusers formats included) and, per component, diffusers' own key conversions (the U-Net's to PEFT's
names; the text encoders' through diffusers' format to PEFT's, as `load_lora_into_text_encoder` does).
Each layer's scale is PEFT's: alpha / rank, alpha from the file's metadata or network alphas
(`get_peft_kwargs`), else the rank (scale 1). kasoku merges the layers itself (W + sum of weight x
scale x B A, the formula of PEFT's `get_delta_weight`), so it needs no PEFT, and text-encoder LoRA
works with the PEFT the registry serves (transformers 5 wants PEFT >= 0.22 to load it into a model).

Applying adapters rebinds weights (:class:`WeightBinding`, one per component): the base weights are
never modified, so unloading binds exactly the base weights again (never a subtraction: TensorRT issue
3628). An engine compiled with LoRA targets (`CompileOptions.lora_targets`) takes the targeted weights as
inputs: a switch merges and binds them, in seconds at full size. Weights outside the targets (or every
weight, on an engine compiled without targets) are bound by building an engine of the architecture graph
with the merged weights in memory: no export, but a session creation or compile.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..core.errors import KasokuError
from ..core.weights import GraphWeight, bindable_tensors, weights_for
from ..model.pipeline_model import Model

LORA_FILE_KINDS = (".safetensors", ".bin")


class LoraError(KasokuError, ValueError):
    """A LoRA file, adapter name or adapter weight kasoku cannot use."""


# ---- one adapter ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraLayer:
    """One adapted weight: W + scale x B A (`down` is A, `up` is B)."""

    down: torch.Tensor
    up: torch.Tensor
    scale: float

    def delta(self, shape: Sequence[int]) -> torch.Tensor:
        """scale x B A in fp32, shaped as the weight (Linear: out x in; Conv: out x in x k x k), PEFT's formula."""
        down, up = self.down.float(), self.up.float()
        if down.ndim == 2:
            delta = up @ down
        elif tuple(down.shape[2:]) == (1, 1) and tuple(up.shape[2:]) == (1, 1):
            delta = (up.flatten(1) @ down.flatten(1))[:, :, None, None]
        else:
            delta = torch.nn.functional.conv2d(down.transpose(0, 1), up).transpose(0, 1)
        if tuple(delta.shape) != tuple(shape):
            raise LoraError(f"a LoRA layer of shape {tuple(delta.shape)} does not fit a weight of shape "
                            f"{tuple(shape)}.")
        return delta * self.scale


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter: per component, the graph weights it changes and how."""

    name: str
    layers: Mapping[str, Mapping[str, LoraLayer]]  # component -> graph weight name -> layer
    source: str = ""

    @property
    def components(self) -> tuple[str, ...]:
        return tuple(c for c, layers in self.layers.items() if layers)


def _pattern_key(patterns: Sequence[str], module: str) -> str | None:
    """PEFT's rule for rank/alpha patterns: a pattern matches a module name as its dotted suffix."""
    return next((p for p in patterns if re.match(rf"(.*\.)?({p})$", module)), None)


def _scales(component: str, state_dict: Mapping[str, torch.Tensor], alphas: Mapping[str, float] | None,
            metadata: Mapping[str, Any] | None, denoiser: str) -> dict[str, float]:
    """Per adapted module: alpha / rank, as PEFT's LoraLayer computes it from diffusers' LoraConfig."""
    from diffusers.utils.peft_utils import get_peft_kwargs

    ranks = {f"{key.split('.lora_B.')[0]}.lora_B.weight": value.shape[1] for key, value in state_dict.items()
             if ".lora_B." in key and value.ndim > 1}
    config = dict(metadata) if metadata else get_peft_kwargs(ranks, alphas, state_dict, is_unet=component == denoiser)
    alpha_pattern = config.get("alpha_pattern") or {}
    scales = {}
    for key, value in state_dict.items():
        if ".lora_A." not in key:
            continue
        module = key.split(".lora_A.")[0]
        rank = value.shape[0]
        matched = _pattern_key(list(alpha_pattern), module)
        alpha = alpha_pattern[matched] if matched is not None else config.get("lora_alpha", rank)
        scales[module] = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return scales


def _peft_keys(component: str, state_dict: dict[str, torch.Tensor], denoiser: str) -> dict[str, torch.Tensor]:
    """Keys in PEFT's layout (`<module>.lora_A.weight`), converted as diffusers converts them per component."""
    from diffusers.utils import (
        convert_state_dict_to_diffusers,
        convert_state_dict_to_peft,
        convert_unet_state_dict_to_peft,
    )

    if not state_dict:
        return {}
    if component == denoiser:
        return state_dict if "lora_A" in next(iter(state_dict)) else convert_unet_state_dict_to_peft(state_dict)
    return convert_state_dict_to_peft(convert_state_dict_to_diffusers(state_dict))


def _graph_name(module: str, names: Mapping[str, GraphWeight], component: str) -> str:
    """The graph weight of an adapted module (its dotted path, matched as a suffix; CLIP's old `text_model.`
    prefix dropped where the encoder has none, as diffusers does)."""
    for path in (module, module.removeprefix("text_model.")):
        # the graph names a weight by the wrapper's attribute and the module's own path ("transformer.proj_out");
        # that exact name first, where a suffix would also match a deeper module's ("...blocks.0.proj_out")
        exact = [n for n in names if n.split(".", 1)[-1] == f"{path}.weight" or n == f"{path}.weight"]
        found = exact or [n for n in names if n.endswith(f".{path}.weight")]
        if len(found) == 1:
            return found[0]
    raise LoraError(f"the adapter changes {component} module {module!r}, which the {component} does not have; the "
                    "adapter is for another model.")


def read_adapter(source: str | Path | Mapping[str, torch.Tensor], name: str, model: Model,
                 graph_weights: Mapping[str, Mapping[str, GraphWeight]], **kwargs) -> LoraAdapter:
    """A LoRA file (or folder, or state dict) as diffusers reads it for `model`'s family, for the components in
    `graph_weights` (component -> its graph's weights). `kwargs` go to diffusers' `lora_state_dict`
    (weight_name, ...)."""
    given = dict(source) if isinstance(source, Mapping) else str(source)
    denoiser = model.family.denoiser
    try:
        state_dict, alphas, metadata = model.family.lora_state_dict(given, model, **kwargs)
    except Exception as error:  # safetensors, torch.load and diffusers' converters raise many kinds
        raise LoraError(f"cannot read the LoRA adapter {source if not isinstance(source, Mapping) else '(dict)'}: "
                        f"{error}") from None
    aliases = model.family.lora_aliases(graph_weights)
    if aliases:
        state_dict, alphas, metadata = (_aliased(part, aliases) for part in (state_dict, alphas, metadata))
        denoiser = aliases.get(denoiser, denoiser)
    unknown = sorted({key.split(".")[0] for key in state_dict} - set(graph_weights))
    if unknown:
        raise LoraError(f"the LoRA adapter changes {', '.join(unknown)}, which this pipeline has no engines for (it "
                        f"has {', '.join(graph_weights)}); compile those components.")
    layers: dict[str, dict[str, LoraLayer]] = {}
    for component, names in graph_weights.items():
        prefix = f"{component}."
        own = {k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)}
        own = _peft_keys(component, own, denoiser)
        if not own:
            continue
        unsupported = [k for k in own if ".lora_A." not in k and ".lora_B." not in k or k.endswith(".bias")]
        if unsupported:
            raise LoraError(f"the LoRA adapter has {component} tensors kasoku cannot merge ({unsupported[0]}: DoRA, "
                            "LoKr or a LoRA bias); load it with diffusers, fuse it (`pipe.fuse_lora()`), then compile.")
        own_alphas = {k.removeprefix(prefix): v for k, v in (alphas or {}).items() if k.split(".")[0] == component}
        own_metadata = {k.removeprefix(prefix): v for k, v in (metadata or {}).items() if k.startswith(prefix)}
        scales = _scales(component, own, own_alphas or None, own_metadata or None, denoiser)
        layers[component] = {
            _graph_name(module, names, component): LoraLayer(own[f"{module}.lora_A.weight"],
                                                             own[f"{module}.lora_B.weight"], scale)
            for module, scale in scales.items()
        }
    adapter = LoraAdapter(name, layers, str(source) if not isinstance(source, Mapping) else "(dict)")
    if not adapter.components:
        raise LoraError(f"the LoRA adapter {adapter.source} changes none of {', '.join(graph_weights)}.")
    return adapter


def _aliased(mapping: Mapping[str, Any] | None, aliases: Mapping[str, str]) -> dict[str, Any] | None:
    """Keys whose first part names a component by another name, renamed."""
    if mapping is None:
        return None
    return {(aliases[k.split(".")[0]] + k[len(k.split(".")[0]):] if k.split(".")[0] in aliases else k): v
            for k, v in mapping.items()}


def check_adapter_file(path: str | Path, model: Model, flag: str = "adapter") -> None:
    """Before anything heavy: `path` exists and diffusers reads it as LoRA weights for `model`'s family."""
    path = Path(path)
    if not path.exists():
        raise LoraError(f"{flag} {path} does not exist; give a LoRA .safetensors file or the folder holding one.")
    try:
        state_dict, _, _ = model.family.lora_state_dict(str(path), model)
    except Exception as error:  # safetensors, torch.load and diffusers' converters raise many kinds
        raise LoraError(f"{flag} {path} is not a LoRA adapter diffusers can read: {error}") from None
    if not state_dict or not all("lora" in key for key in state_dict):
        raise LoraError(f"{flag} {path} holds no LoRA weights (its tensor names carry no 'lora').")


def merged(base: Mapping[str, torch.Tensor], contributions: Sequence[tuple[LoraAdapter, float]],
           component: str, names: set[str]) -> dict[str, torch.Tensor]:
    """The weights in `names` with the adapters' layers added (W + sum of weight x scale x B A, in fp32, then
    in the base weight's dtype); only the weights some adapter changes."""
    out: dict[str, torch.Tensor] = {}
    for adapter, weight in contributions:
        for name, layer in adapter.layers.get(component, {}).items():
            if name in names and weight != 0:
                total = out[name] if name in out else base[name].float()
                out[name] = total + layer.delta(base[name].shape) * weight
    return {name: value.to(base[name].dtype) for name, value in out.items()}


# ---- which adapters are in force (diffusers' semantics) ----------------------------------------------


AdapterWeight = float | Mapping[str, float]  # one weight, or one per component ({"unet": 0.5, ...})


@dataclass
class LoraState:
    """The adapters a pipeline holds and how they apply, as diffusers' LoRA mixins keep it: the most recently
    loaded adapter is the active one until `set_adapters`; `disable` turns the active ones off; `fuse` makes
    the active ones part of the weights (unload keeps them, `unfuse` restores the base exactly)."""

    adapters: dict[str, LoraAdapter] = field(default_factory=dict)
    active: list[str] = field(default_factory=list)
    weights: dict[str, AdapterWeight] = field(default_factory=dict)
    enabled: bool = True
    fused: list[tuple[LoraAdapter, str, float]] = field(default_factory=list)  # (adapter, component, weight)
    # diffusers' per-call LoRA scale (`cross_attention_kwargs={"scale": s}`): the active adapters' weights times it
    call_scale: float = 1.0

    def next_name(self) -> str:
        return f"default_{len(self.adapters)}"

    def check_new(self, name: str) -> None:
        if name in self.adapters:
            raise LoraError(f"adapter name {name!r} is already in use; pass another `adapter_name` or "
                            "`unload_lora_weights()` first.")

    def add(self, adapter: LoraAdapter) -> None:
        self.check_new(adapter.name)
        self.adapters[adapter.name] = adapter
        self.active, self.weights = [adapter.name], {adapter.name: 1.0}

    def check_names(self, names: Sequence[str]) -> None:
        unknown = [n for n in names if n not in self.adapters]
        if unknown:
            loaded = ", ".join(self.adapters) or "none"
            raise LoraError(f"no adapter is named {', '.join(map(repr, unknown))}; loaded adapters: {loaded}.")

    def set_active(self, names: Sequence[str], weights: Sequence[AdapterWeight | None]) -> None:
        self.check_names(names)
        for name, weight in zip(names, weights):
            _check_weight(name, weight)
        self.active = list(names)
        self.weights = {n: 1.0 if w is None else w for n, w in zip(names, weights)}

    def weight(self, name: str, component: str) -> float:
        value = self.weights.get(name, 1.0)
        return float(value.get(component, 1.0)) if isinstance(value, Mapping) else float(value)

    def contributions(self, component: str) -> list[tuple[LoraAdapter, float]]:
        """What changes `component`'s weights now: fused adapters, then the active ones when enabled."""
        fused = [(adapter, weight) for adapter, c, weight in self.fused if c == component]
        fused_names = {adapter.name for adapter, _ in fused}
        live = [(self.adapters[n], self.weight(n, component) * self.call_scale) for n in self.active
                if self.enabled and n not in fused_names]
        return fused + [(a, w) for a, w in live if component in a.layers]

    def fuse(self, components: Sequence[str], lora_scale: float, names: Sequence[str] | None = None) -> None:
        """Make the active adapters (or `names`) part of the weights of `components`, each at its weight x
        `lora_scale`."""
        names = list(self.active if names is None else names)
        self.check_names(names)
        for name in names:
            adapter = self.adapters[name]
            self.fused += [(adapter, c, self.weight(name, c) * lora_scale) for c in components if c in adapter.layers
                           and not any(a is adapter and fc == c for a, fc, _ in self.fused)]

    def unfuse(self, components: Sequence[str]) -> None:
        self.fused = [(a, c, w) for a, c, w in self.fused if c not in components]

    def delete(self, names: Sequence[str]) -> None:
        self.check_names(names)
        for name in names:
            del self.adapters[name]
        self.active = [n for n in self.active if n not in names]
        self.weights = {n: w for n, w in self.weights.items() if n not in names}


def _check_weight(name: str, weight: AdapterWeight | None) -> None:
    values = list(weight.values()) if isinstance(weight, Mapping) else [weight]
    for value in values:
        if value is not None and (isinstance(value, (Mapping, bool)) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise LoraError(f"adapter {name!r}: a weight is a finite number, or one per component such as "
                            f"{{'unet': 0.5, 'text_encoder': 1.0}}, but is {weight!r} (per-block weights are not "
                            "supported).")


# ---- rebinding one component's weights --------------------------------------------------------------


class WeightBinding:
    """Binds merged weights to one component's engine, keeping its base weights untouched.

    `engine` is the compiled engine (from the cache); its run-time weights' base values are kept as loaded.
    A set of contributions that changes run-time weights only rebinds them on that engine; one that changes
    other weights gets an engine of the graph with them bound (the module's weights for the rest); no
    contribution at all goes back to the compiled engine with its base values: the exact base."""

    def __init__(self, spec, backend, precision, graph: Path, engine, graph_weights: Mapping[str, GraphWeight]):
        self.spec = spec
        self.backend = backend
        self.precision = precision
        self.graph = graph
        self.compiled = engine
        self.graph_weights = dict(graph_weights)
        self.base_run_time = engine.bound  # the exact base values, as the entry stores them
        self.current = engine
        self._constants_key: tuple = ()  # which adapters, at which weights, the current engine's constants hold
        self._constants_adapters: list[LoraAdapter] = []  # kept alive: the key names them by id
        self._module_weights: dict[str, torch.Tensor] | None = None

    @property
    def run_time(self) -> frozenset[str]:
        return frozenset(self.base_run_time)

    def base(self, names: set[str]) -> dict[str, torch.Tensor]:
        """Base values of `names`: the engine's own for run-time weights, the module's for the others."""
        out = {n: self.base_run_time[n] for n in names if n in self.base_run_time}
        rest = names - set(out)
        if rest:
            module = self.module_weights()
            out.update({n: module[n] for n in rest})
        return out

    def module_weights(self) -> dict[str, torch.Tensor]:
        """The module's weights for the graph, in its dtypes (loaded once; what constants are bound from)."""
        if self._module_weights is None:
            self._module_weights = weights_for(self.graph_weights, bindable_tensors(self.spec.module), self.spec.name)
        return self._module_weights

    def apply(self, contributions: Sequence[tuple[LoraAdapter, float]]):
        """The engine that runs the base weights with `contributions` merged (seconds when they touch run-time
        weights only)."""
        component = self.spec.name
        touched = {n for adapter, _ in contributions for n in adapter.layers.get(component, {})}
        constant_names = touched - self.run_time
        changing = [(a, w) for a, w in contributions if set(a.layers.get(component, {})) & constant_names]
        key = tuple((id(a), w) for a, w in changing)
        if key != self._constants_key:
            if not key:
                self.current = self.compiled
            else:
                constants = merged(self.base(constant_names), contributions, component, constant_names)
                weights = {**self.module_weights(), **constants, **self.base_run_time}
                self.current = self.backend.bind_weights(self.spec, self.graph, self.precision, weights, self.run_time)
            self._constants_key, self._constants_adapters = key, [a for a, _ in changing]
        if self.run_time:
            run_time = touched & self.run_time
            self.current.bind({**self.base_run_time, **merged(self.base(run_time), contributions, component,
                                                              run_time)})
        return self.current


def weight_binding(compiler, spec, backend_name: str, engine) -> WeightBinding:
    """The binding of `spec`'s compiled `engine` (on `backend_name`), its graph from `compiler`'s cache."""
    backend, graph, graph_weights = compiler.graph_and_weights(spec, backend_name)
    return WeightBinding(spec, backend, compiler.precision(spec), graph, engine, graph_weights)
