"""Weight digests: the weights key of an engine (its graph is keyed by architecture alone), computed
as rarely as possible.

The digest of a module is SHA-256 over the weights its graph binds (:func:`kasoku.core.weights.bindable_tensors`:
parameters and buffers, PEFT LoRA layers merged) in name order: each tensor's name, shape and the
CRC-32 of its fp32 bytes, so a module gives the same digest however it was loaded. CRC-32 runs
at memory speed (zlib releases the GIL, so two threads share the work): about half a second for
SD 1.5's 4 GB, where SHA-256 of the bytes took three. It is a change detector, not a defence
against forgery: a changed tensor goes unnoticed with probability 2^-32, and a fine-tune or a
LoRA changes hundreds of tensors at once.

A module that kasoku loaded itself from a diffusers folder is remembered by its weights files:
the digest is stored under `<cache>/fingerprints/`, keyed by each file's path, size and
modification time and the dtype the module is read in, so a warm start never reads the weights at all (see
:func:`kasoku.model.loading.load_pipeline` with ``lazy=True``). A live module handed to kasoku is always
hashed: its weights may have changed in memory since it was loaded (a fused LoRA, say).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import weakref
import zlib
from pathlib import Path

import torch

from ..architectures.base import config_dict
from ..core.cache import atomic_write_text
from ..core.components import architecture_config
from ..core.weights import bindable_tensors, floating_dtype

THREADS = 2
FINGERPRINTS = "fingerprints"
DIGEST_VERSION = 2  # 2: over the bound weights (parameters and buffers, PEFT layers merged), not the state dict


def _tensor_digest(tensor: torch.Tensor) -> bytes:
    data = tensor.detach().to(torch.float32).contiguous().reshape(-1).numpy()
    return zlib.crc32(memoryview(data).cast("B")).to_bytes(4, "little")


def module_fingerprint(module: torch.nn.Module, skip: frozenset[str] | None = None) -> str:
    """SHA-256 of the weights the module's graph binds (but `skip`): names, shapes and the CRC-32 of the fp32
    values."""
    items = sorted((n, t) for n, t in bindable_tensors(module).items() if not skip or n not in skip)
    digests: dict[str, bytes] = {}

    def digest_all(names: list[str]) -> None:
        for name in names:
            digests[name] = _tensor_digest(state[name])

    state = dict(items)
    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(digest_all, _balanced(state, THREADS)))  # one task per thread: no per-tensor overhead
    total = hashlib.sha256()
    for name, tensor in items:
        total.update(f"{name}:{tuple(tensor.shape)}:".encode())
        total.update(digests[name])
    return total.hexdigest()


def _balanced(state: dict[str, torch.Tensor], parts: int) -> list[list[str]]:
    """Tensor names in `parts` groups of about equal bytes (largest first, each to the lightest group)."""
    groups: list[list[str]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for name in sorted(state, key=lambda n: -state[n].numel()):
        lightest = loads.index(min(loads))
        groups[lightest].append(name)
        loads[lightest] += state[name].numel()
    return groups


def weights_files(folder: Path) -> list[Path]:
    """The safetensors files a diffusers component folder loads its weights from."""
    return sorted(p for p in Path(folder).glob("*.safetensors") if p.is_file())


def _files_key(files: list[Path], config: dict) -> str:
    stats = []
    for path in files:
        info = path.stat()
        stats.append([str(path.resolve()), info.st_size, info.st_mtime_ns])
    described = json.dumps({"files": stats, "config": config, "digest": DIGEST_VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(described.encode()).hexdigest()[:32]


class WeightsFingerprints:
    """Digests of a pipeline's modules, each computed once per call and, for modules loaded from a
    folder by kasoku, once per weights file (remembered under `root`)."""

    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) / FINGERPRINTS if root is not None else None
        # keyed by the module itself, weakly: once a module is gone its id is the next object's, and a digest
        # kept under the id would be served to whatever module is created at that address
        self._computed: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self._pending: weakref.WeakKeyDictionary[torch.nn.Module, concurrent.futures.Future] = \
            weakref.WeakKeyDictionary()
        # digests without the adapters loaded into a module since
        self._base: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()

    def remember_under(self, root: str | Path) -> None:
        """Remember digests of folder-loaded modules under `root` (a cache folder) from now on, unless a
        folder was given already."""
        if self.root is None:
            self.root = Path(root) / FINGERPRINTS

    def prefetch(self, pipe, attributes) -> None:
        """Start hashing these live modules in the background (in this order), so that loading one
        component's engine overlaps hashing the next one's weights. Lazily loaded modules are left to
        :meth:`of` (their digest is remembered, or their weights must be loaded first)."""
        from .loading import lazy_source, module_at

        modules = [module_at(pipe, a) for a in dict.fromkeys(attributes)]
        todo = [m for m in modules if lazy_source(m) is None and m not in self._computed and m not in self._pending]
        if not todo:
            return
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kasoku-fingerprint")
        for module in todo:
            self._pending[module] = pool.submit(module_fingerprint, module)
        pool.shutdown(wait=False)

    def _memo(self, module) -> Path | None:
        """Where the digest of a module kasoku loaded lazily from a folder is remembered (None: nowhere)."""
        from .loading import lazy_source

        source = lazy_source(module)
        if source is None or self.root is None:
            return None
        files = weights_files(source)
        # read in another dtype, the same files are other tensors (the config's own dtype entry, which transformers
        # sets once a module is loaded, is left out with the rest of its metadata)
        described = {**architecture_config(config_dict(module.config)), "read_in": str(floating_dtype(module))}
        return self.root / f"{_files_key(files, described)}.json" if files else None

    def known_without_loading(self, pipe, attribute: str) -> bool:
        """Whether the digest can be had without reading weights from disk (computed, remembered, or of a live
        module, which is hashed in memory)."""
        from .loading import lazy_source, module_at

        module = module_at(pipe, attribute)
        if module in self._computed or module in self._pending or lazy_source(module) is None:
            return True
        memo = self._memo(module)
        return memo is not None and memo.is_file()

    def of(self, pipe, attribute: str) -> str:
        """The digest of the torch module at `attribute` of `pipe` (a dotted path such as
        "controlnet.nets.0"), loading it only when it must."""
        from .loading import lazy_source, module_at, real_module

        module = module_at(pipe, attribute)
        if module in self._computed:
            return self._computed[module]
        if module in self._pending:
            return self._remember(digest=self._pending.pop(module).result(), modules=[module])
        source = lazy_source(module)
        memo = self._memo(module)
        if memo is not None and memo.is_file():
            try:
                return self._remember(digest=json.loads(memo.read_text())["fingerprint"], modules=[module])
            except (ValueError, KeyError):
                pass  # a damaged memo: compute it again
        real = real_module(pipe, attribute)
        digest = module_fingerprint(real)
        if memo is not None:
            try:
                memo.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(memo, json.dumps({"fingerprint": digest, "folder": str(source), "pid": os.getpid()}))
            except OSError:
                pass  # a read-only cache: the digest is computed again next time
        return self._remember(digest=digest, modules=[module, real])

    def base_of(self, pipe, attribute: str) -> str:
        """The digest of the module's weights without the IP-Adapters loaded into it: remembered from before
        they were loaded, else computed without them."""
        from ..architectures.ip_adapter import ADAPTER_PARTS, projection_layers
        from ..core.weights import named_parts
        from .loading import module_at

        module = module_at(pipe, attribute)
        if module in self._base:
            return self._base[module]
        if not projection_layers(module):
            return self.of(pipe, attribute)
        skip = named_parts(bindable_tensors(module), ADAPTER_PARTS)
        return self.remember_base(module, module_fingerprint(module, skip))

    def remember_base(self, module: torch.nn.Module, digest: str) -> str:
        self._base[module] = digest
        return digest

    def forget(self, module: torch.nn.Module) -> None:
        """Drop what is known of `module`'s digest (its weights changed in memory)."""
        self._computed.pop(module, None)
        pending = self._pending.pop(module, None)
        if pending is not None:
            pending.cancel()

    def _remember(self, *, digest: str, modules: list[torch.nn.Module]) -> str:
        for module in modules:  # a lazy module and the real one that replaced it share a digest
            self._computed[module] = digest
        return digest
