"""Recording the calls a diffusers pipeline makes to its torch components: the generic path's evidence.

kasoku compiles a component it has no hand-written architecture for from what the pipeline does with it
(Torch-TensorRT's `MutableTorchTensorRTModule` compiles from the inputs it sees; cache-dit matches a block
loop): while the pipeline's own ``__call__`` runs, each component's `forward` and the methods pipelines call
on it (a VAE's ``decode`` and ``encode``) are wrapped, and every call is kept as a :class:`Call`:

- its arguments, positional and keyword, nested dicts, lists and tuples included, flattened by torch's pytree
  into leaves with a path each (``hidden_states``, ``joint_attention_kwargs.scale``, ``img_shapes.0.1``);
  a tensor leaf is kept (its value seeds the graph's sample inputs), any other leaf is a constant;
- the structure of its output (a tuple, a ``ModelOutput``, a dataclass) and its leaves: tensors by shape
  and dtype, a distribution (a VAE's ``latent_dist``, sampled later with the call's generator) by its
  parameters;
- which output tensors the pipeline read: each is handed back as a :class:`Watched` tensor that marks
  itself on its first use, so a text encoder called with ``output_hidden_states=True``, of which the
  pipeline reads one layer, is known to need that layer only.

Nothing here knows a model: the calls become component specs in :mod:`kasoku.architectures.recorded`.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import pickle
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .cache import Cache, CacheError

__all__ = ["Call", "Distribution", "Opaque", "RECORDED_METHODS", "RECORDING_FORMAT", "RecordingStore", "Watched",
           "canonical_call", "leaf_name", "recording", "unwatched"]

log = logging.getLogger(__name__)

# What pipelines call on their components besides forward (a VAE decodes and encodes).
RECORDED_METHODS = ("forward", "decode", "encode")
# the recordings' layout in the cache: raised when what a Call keeps changes, so older entries are not read
RECORDING_FORMAT = 1
RECORDINGS_FILE = "recordings.pickle"


class Watched(torch.Tensor):
    """An output tensor handed to the pipeline: the first torch operation on it (an index, a cast, its shape
    included) marks it read in its `flag`, and computes on the plain tensor."""

    _flag: list[bool]

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, flag: list[bool]):
        watched = tensor.as_subclass(cls)
        watched._flag = flag
        return watched

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*unwatched(args), **unwatched(kwargs or {}))


def unwatched(value: Any) -> Any:
    """`value` with every :class:`Watched` tensor in it marked read and turned back into a plain tensor."""
    def plain(leaf):
        if isinstance(leaf, Watched):
            leaf._flag[0] = True
            with torch._C.DisableTorchFunctionSubclass():
                return leaf.as_subclass(torch.Tensor)
        return leaf

    return pytree.tree_map(plain, value)


@dataclass(frozen=True)
class Distribution:
    """An output leaf that is a distribution over latents (diffusers' DiagonalGaussianDistribution, the identity
    one of DC-AE): it crosses engines as its `parameters` and is rebuilt as `kind(parameters)`."""

    kind: type
    shape: tuple[int, ...]
    deterministic: bool = False
    dtype: torch.dtype = torch.float32

    @staticmethod
    def holds(value: Any) -> bool:
        return not isinstance(value, torch.Tensor) and isinstance(getattr(value, "parameters", None), torch.Tensor)

    def rebuild(self, parameters: torch.Tensor) -> Any:
        if "deterministic" in inspect.signature(self.kind).parameters:
            return self.kind(parameters, deterministic=self.deterministic)
        return self.kind(parameters)


@dataclass
class Call:
    """One call of a component's method: its flattened arguments and output, and what the pipeline read."""

    component: str
    method: str
    arguments: pytree.TreeSpec  # of (args, kwargs)
    paths: tuple[str, ...]  # a name per argument leaf
    leaves: tuple[Any, ...]  # a tensor (detached), or a constant
    output: pytree.TreeSpec
    output_paths: tuple[str, ...]
    # per output leaf: a torch.Size and dtype for a tensor, a Distribution, or the constant itself
    output_leaves: tuple[Any, ...]
    read: list[list[bool]] = field(default_factory=list)  # per output leaf: read by the pipeline

    @property
    def tensor_indices(self) -> tuple[int, ...]:
        return tuple(i for i, leaf in enumerate(self.leaves) if isinstance(leaf, torch.Tensor))

    @property
    def constants(self) -> dict[str, Any]:
        return {self.paths[i]: leaf for i, leaf in enumerate(self.leaves) if not isinstance(leaf, torch.Tensor)}

    def outputs_read(self) -> tuple[bool, ...]:
        return tuple(flag[0] for flag in self.read)


def _flatten_with_paths(value: Any, is_leaf=None) -> tuple[list[Any], pytree.TreeSpec, list[tuple[str, ...]]]:
    """pytree's leaves and tree of `value`, with a path of keys per leaf. Read from the tree itself, not from
    pytree's key functions, which the types diffusers registers (its ModelOutputs) do not give."""
    leaves, spec = pytree.tree_flatten(value, is_leaf=is_leaf)
    return leaves, spec, list(_spec_paths(spec, ()))


def _spec_paths(spec: pytree.TreeSpec, prefix: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    if spec.is_leaf():
        yield prefix
        return
    context, children = spec.context, spec.children()
    if isinstance(context, (list, tuple)) and len(context) == len(children):
        keys = [str(key) for key in context]  # a dict's or a ModelOutput's keys
    elif isinstance(context, type) and hasattr(context, "_fields"):
        keys = list(context._fields)  # a namedtuple's
    elif isinstance(context, list) and len(context) == 2 and isinstance(context[1], list):
        keys = [str(key) for key in context[1]]  # a defaultdict's (its factory, its keys)
    else:
        keys = [str(index) for index in range(len(children))]
    for key, child in zip(keys, children):
        yield from _spec_paths(child, (*prefix, key))


def leaf_name(path: tuple[str, ...]) -> str:
    """An argument or output path as a graph tensor name: letters, digits and underscores."""
    return re.sub(r"[^0-9A-Za-z_]+", "_", ".".join(path)).strip("_") or "value"


def canonical_call(method: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """(args, kwargs) as keywords in the order of `method`'s parameters, so that calls that pass the same values
    positionally or by keyword, in any order, have one tree (a method taking *args is left as it was called)."""
    try:
        signature = inspect.signature(method)
        if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in signature.parameters.values()):
            return args, kwargs
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    canonical: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            canonical.update(value)
        else:
            canonical[name] = value
    return (), canonical


def _argument_paths(method: Callable, args: tuple, kwargs: dict) -> tuple[list[Any], pytree.TreeSpec, tuple[str, ...]]:
    """The leaves of (args, kwargs), their tree, and a name per leaf: a positional argument is named by its
    parameter (`forward(self, hidden_states, ...)`), a keyword one by its key, nested ones by their keys."""
    try:
        names = list(inspect.signature(method).parameters)
    except (TypeError, ValueError):
        names = []
    leaves, spec, key_paths = _flatten_with_paths((args, kwargs))
    paths = []
    for keys in key_paths:
        where, first = keys[0], keys[1]
        if where == "0":  # positional
            index = int(first)
            head = names[index] if index < len(names) and names[index] not in ("args", "kwargs") else f"arg{index}"
        else:
            head = first
        paths.append(leaf_name((head, *keys[2:])))
    return leaves, spec, tuple(paths)


def _output_leaves(output: Any) -> tuple[list[Any], pytree.TreeSpec, tuple[str, ...]]:
    leaves, spec, key_paths = _flatten_with_paths(output, is_leaf=Distribution.holds)
    paths = tuple(leaf_name(("output", *keys)) if not keys or keys[0].isdigit() else leaf_name(keys)
                  for keys in key_paths)
    return leaves, spec, paths


@dataclass(frozen=True)
class Opaque:
    """An output leaf kasoku does not carry across an engine (a key-value cache object): only its kind is kept."""

    kind: type


CONSTANT_TYPES = (type(None), bool, int, float, str)


def _described(leaf: Any) -> Any:
    """What a recorded output leaf is: (shape, dtype) of a tensor, a Distribution, a constant, or Opaque."""
    if isinstance(leaf, torch.Tensor):
        return tuple(leaf.shape), leaf.dtype
    if Distribution.holds(leaf):
        return Distribution(type(leaf), tuple(leaf.parameters.shape), bool(getattr(leaf, "deterministic", False)),
                            leaf.parameters.dtype)
    return leaf if isinstance(leaf, CONSTANT_TYPES) else Opaque(type(leaf))


def _handed_back(leaf: Any, flag: list[bool]) -> Any:
    if isinstance(leaf, torch.Tensor):
        return Watched(leaf, flag)
    flag[0] = Distribution.holds(leaf)  # a distribution is sampled from, always
    return leaf


def _recorder(component: str, method: str, original: Callable, calls: list[Call], depth: list[int]) -> Callable:
    def record(*args, **kwargs):
        args, kwargs = unwatched((args, kwargs))
        if depth[0]:  # a recorded method calling another of the same module: the outer call is the pipeline's
            return original(*args, **kwargs)
        depth[0] += 1
        try:
            output = original(*args, **kwargs)
        finally:
            depth[0] -= 1
        leaves, arguments, paths = _argument_paths(original, *canonical_call(original, args, kwargs))
        out_leaves, out_spec, out_paths = _output_leaves(output)
        flags = [[False] for _ in out_leaves]
        described = tuple(_described(leaf) for leaf in out_leaves)
        calls.append(Call(component, method, arguments, paths,
                          tuple(leaf.detach() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves),
                          out_spec, out_paths, described, flags))
        return pytree.tree_unflatten([_handed_back(leaf, flag) for leaf, flag in zip(out_leaves, flags)], out_spec)

    return record


@contextlib.contextmanager
def recording(modules: Mapping[str, torch.nn.Module], methods: tuple[str, ...] = RECORDED_METHODS
              ) -> Iterator[list[Call]]:
    """Record every call of `methods` on `modules` (pipeline attribute -> module) while the block runs; the
    modules are as they were afterwards."""
    calls: list[Call] = []
    patched: list[tuple[torch.nn.Module, str, bool, Any]] = []
    try:
        for component, module in modules.items():
            depth = [0]
            for method in methods:
                original = getattr(module, method, None)
                if not callable(original):
                    continue
                had = method in vars(module)
                patched.append((module, method, had, vars(module).get(method)))
                setattr(module, method, _recorder(component, method, original, calls, depth))
        yield calls
    finally:
        for module, method, had, before in reversed(patched):
            if had:
                setattr(module, method, before)
            else:
                delattr(module, method)


class RecordingStore:
    """Recordings kept in the cache, so a model is recorded once per machine: at full size a recording runs the
    whole pipeline at every probe (Sana Sprint 0.6B's took minutes on two cores), and a warm start would pay it
    again. The key names everything the calls depend on (the caller's `parts`: the pipeline class, its modules'
    configs and weight digests, its other components, the probes, the library versions); a miss records, a
    read-only cache serves what it holds and keeps nothing new. A recording that cannot be pickled (a constant
    argument of a type pickle cannot write) is simply not kept."""

    def __init__(self, root: str | Path, label: str = ""):
        self.root, self.label = Path(root), label

    def get(self, parts: dict[str, Any]) -> Any | None:
        """What `put` kept for `parts`, or None."""
        entry = Cache(self.root).lookup({"kind": "recording", "format": RECORDING_FORMAT, **parts})
        if entry is None:
            return None
        try:
            with warnings.catch_warnings():  # torch's pytree warns of its own legacy leaf class while unpickling
                warnings.simplefilter("ignore", FutureWarning)
                return pickle.loads(entry.file(RECORDINGS_FILE).read_bytes())  # written by `put` on this cache
        except Exception as error:  # noqa: BLE001 - an unreadable entry is a miss: the pipeline is recorded again
            log.info("recording %s not read (%s): recording again", entry.key, error)
            return None

    def put(self, parts: dict[str, Any], value: Any) -> None:
        """Keep `value` for `parts` where the cache can be written and `value` pickled."""
        try:
            data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError) as error:
            log.info("recording not kept in the cache: %s", error)
            return

        def build(folder: Path) -> None:
            (folder / RECORDINGS_FILE).write_bytes(data)

        with contextlib.suppress(CacheError):  # a read-only cache: recorded again next time
            Cache(self.root).get_or_build({"kind": "recording", "format": RECORDING_FORMAT, **parts}, build,
                                          describe={"model": self.label, "component": "recording"})
