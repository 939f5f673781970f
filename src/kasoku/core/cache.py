"""The content-addressed artefact cache.

An entry is a folder named by the digest of everything that changes the artefact (its *key
parts*: weights fingerprint and config, exporter and opset, passes, precision, backend and
version, device, shape profile...). It is built in a temporary folder and renamed into place and
carries a manifest with the size and SHA-256 of each of its files. Builders of the same key in
several processes serialize on a file lock, so each entry is built once.

A hit is cheap: the manifest must name the entry's own key and every file must have the size the
manifest records (a truncated or missing file is caught; the runtime's own loader catches the
rest). An entry that fails is rebuilt with a warning, never loaded. The full checksums are
computed when an entry is built and checked by :meth:`Cache.check` (`kasoku cache check`), which
reports damaged entries and can remove them, and by `kasoku verify`.

Footprint: a hit marks the entry used (its manifest's modification time is its last use), and
`KASOKU_CACHE_MAX` (or `kasoku cache prune --max-size`) evicts the least recently used entries down
to a size budget. Readers hold a shared lock on an entry while they build from it or load it, and
eviction only removes entries whose exclusive lock it gets without waiting: nobody is left with a
half-deleted entry.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .console import to_json
from .errors import KasokuError

logger = logging.getLogger(__name__)

MANIFEST = "kasoku-entry.json"
ENTRIES = "entries"
TMP_PREFIX = ".tmp-"
MEMORY_STOPS = "memory-stops.json"  # builds stopped for memory: entry key -> the free memory then, and the message
FAILED_EXPORTS = "failed-exports.json"  # exports of recorded graphs that failed: entry key -> the error
FORMAT_VERSION = 1
BUDGET_VARIABLE = "KASOKU_CACHE_MAX"
_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


class CacheError(KasokuError):
    """The cache folder cannot be used."""


class CorruptEntryWarning(UserWarning):
    """A cache entry failed verification and is being rebuilt."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("KASOKU_CACHE") or Path.home() / ".cache" / "kasoku").expanduser()


def unreadable_files(folder: Path) -> list[str]:
    """The files under `folder` this process may not read, each with its owner and mode."""
    import pwd

    found = []
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file() and not os.access(p, os.R_OK)):
        info = path.stat()
        try:
            owner = pwd.getpwuid(info.st_uid).pw_name
        except KeyError:
            owner = str(info.st_uid)
        found.append(f"{path} (owner {owner}, mode {info.st_mode & 0o777:04o})")
    return found


def readable_as(folder: Path, root: Path) -> None:
    """Every file and folder under `folder` readable by whom the cache folder `root` is readable by: a cache built in
    CI and served by a container's user, or shared on a volume, serves other users. (OpenVINO writes its compiled
    blob with mode 0640; a private cache folder, 0700, keeps its entries private whatever their modes.)"""
    shared = root.stat().st_mode & 0o055  # read (and, for folders, search) by group and others
    for path in (folder, *folder.rglob("*")):
        mode = path.stat().st_mode
        wanted = mode | (shared if path.is_dir() else shared & 0o044)
        if wanted != mode:
            os.chmod(path, wanted)


def digest_key(parts: dict[str, Any]) -> str:
    """The entry name: SHA-256 of the key parts as canonical JSON."""
    canonical = json.dumps({"format": FORMAT_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def parse_size(text: str) -> int:
    """Bytes from "500M", "20G", "1.5T" or a plain number of bytes (binary units)."""
    value = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    unit = value[-1] if value and value[-1] in _UNITS else ""
    try:
        number = float(value[: len(value) - len(unit)])
    except ValueError:
        raise CacheError(f"a cache size must be a number with an optional unit K, M, G or T (e.g. 20G) but is "
                         f"{text!r}.") from None
    if number < 0:
        raise CacheError(f"a cache size cannot be negative but is {text!r}.")
    return int(number * _UNITS[unit])


def budget_from_environment() -> int | None:
    """`KASOKU_CACHE_MAX` in bytes, or None when it is not set."""
    value = os.environ.get(BUDGET_VARIABLE, "").strip()
    return parse_size(value) if value else None


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: readers never see half of it."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class CacheEntry:
    """A verified entry: its folder, its key parts, and whether this call built it."""

    key: str
    path: Path
    parts: dict[str, Any]
    built: bool
    seconds: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    def file(self, name: str) -> Path:
        return self.path / name


@dataclass
class EntryInfo:
    key: str
    kind: str
    model: str
    component: str
    size_bytes: int
    created: float
    parts: dict[str, Any]
    last_used: float = 0.0


class Cache:
    """`$KASOKU_CACHE` (default `~/.cache/kasoku`), one folder per entry under `entries/`."""

    def __init__(self, root: str | Path | None = None):
        self.root = Path(root).expanduser() if root else default_cache_dir()
        if self.root.exists() and not self.root.is_dir():  # every command's first touch of the cache says so
            where = "--cache-dir, cache_dir=" if root else \
                ("KASOKU_CACHE" if os.environ.get("KASOKU_CACHE") else "the default")
            raise CacheError(f"the cache {self.root} ({where}) is a file, not a folder; point KASOKU_CACHE (or "
                             "--cache-dir) at a folder, or unset it for ~/.cache/kasoku.")
        self.entries = self.root / ENTRIES  # created when the first entry is built: reading or listing writes nothing
        self.events: list[tuple[str, str, str]] = []  # (kind, key, "built" | "reused" | "rebuilt")

    def _writable(self) -> None:
        """The entries folder, created if missing; a clear error where it cannot be written (a read-only cache
        serves the engines it holds and builds none)."""
        try:
            self.entries.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise CacheError(f"cannot create the cache folder {self.entries}: {error}. Set KASOKU_CACHE to a "
                             "writable folder.") from None
        if not os.access(self.entries, os.W_OK):
            raise CacheError(f"the cache {self.root} is read-only: it serves the engines it holds, and this build "
                             "needs a writable one. Set KASOKU_CACHE (or --cache-dir) to a writable folder, or build "
                             "these engines there first.")

    # ---- builds stopped for memory --------------------------------------------------------------

    def remember_memory_stop(self, parts: dict[str, Any], free_bytes: int, message: str) -> None:
        """Remember that building the entry of `parts` ran out of memory with `free_bytes` free, so that the next
        build of it on this machine can be refused before its work (a cache that cannot be written forgets)."""
        self._remember(MEMORY_STOPS, parts, {"free_bytes": int(free_bytes), "message": message, "when": time.time()})

    def memory_stop(self, parts: dict[str, Any]) -> dict[str, Any] | None:
        """What :meth:`remember_memory_stop` remembered for the entry of `parts` (None: it never stopped)."""
        return self._remembered(MEMORY_STOPS).get(digest_key(parts))

    def remember_failed_export(self, parts: dict[str, Any], message: str) -> None:
        """Remember that the export of `parts` failed (a recorded graph torch.export cannot capture at these shapes),
        so that the next compile falls back at once instead of exporting it again: its key holds the versions of
        torch, diffusers and kasoku's export, so an upgrade tries again."""
        self._remember(FAILED_EXPORTS, parts, {"message": message, "when": time.time()})

    def failed_export(self, parts: dict[str, Any]) -> str | None:
        """The error :meth:`remember_failed_export` remembered for `parts` (None: never failed)."""
        failure = self._remembered(FAILED_EXPORTS).get(digest_key(parts))
        return failure.get("message") if isinstance(failure, dict) else None

    def _remember(self, name: str, parts: dict[str, Any], value: dict[str, Any]) -> None:
        notes = self._remembered(name)
        notes[digest_key(parts)] = value
        with contextlib.suppress(OSError):
            self.root.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.root / name, json.dumps(notes, indent=1))

    def _remembered(self, name: str) -> dict[str, dict[str, Any]]:
        try:
            notes = json.loads((self.root / name).read_text())
        except (OSError, ValueError):
            return {}
        return notes if isinstance(notes, dict) else {}

    # ---- the one public way in -----------------------------------------------------------------

    def get_or_build(
        self,
        parts: dict[str, Any],
        build: Callable[[Path], dict[str, Any] | None],
        *,
        describe: dict[str, str] | None = None,
    ) -> CacheEntry:
        """Return the verified entry for `parts`, building it with `build(tmp_dir)` if needed.

        `build` writes the artefact's files into the folder it is given and may return metadata
        (stored in the manifest). Nothing is visible under the key until it fully succeeded.
        `describe` (model and component names) is shown by `kasoku cache ls`; it is not part of
        the key, so the same weights in two folders share their entries.
        """
        key = digest_key(parts)
        kind = str(parts.get("kind", "entry"))
        final = self.entries / key
        existing = self._load_verified(final, key)
        if existing is not None:
            self.events.append((kind, key, "reused"))
            self.touch(key)
            return existing
        self._writable()
        with self._lock(key):
            existing = self._load_verified(final, key)  # built by another process while we waited
            if existing is not None:
                self.events.append((kind, key, "reused"))
                return existing
            rebuilt = final.exists()
            if rebuilt:
                shutil.rmtree(final)
            entry = self._build(final, key, parts, build, describe or {})
            self.events.append((kind, key, "rebuilt" if rebuilt else "built"))
            return entry

    def _build(self, final: Path, key: str, parts: dict, build, describe: dict) -> CacheEntry:
        tmp = self.entries / f"{TMP_PREFIX}{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        start = time.perf_counter()
        try:
            meta = build(tmp) or {}
            seconds = time.perf_counter() - start
            files = {
                str(p.relative_to(tmp)): {"sha256": file_sha256(p), "size": p.stat().st_size}
                for p in sorted(tmp.rglob("*"))
                if p.is_file()
            }
            manifest = {
                "format": FORMAT_VERSION,
                "key": key,
                "parts": parts,
                "describe": describe,
                "files": files,
                "meta": meta,
                "build_seconds": seconds,
                "created": time.time(),
                "built_by_pid": os.getpid(),
            }
            (tmp / MANIFEST).write_text(to_json(manifest, indent=2, sort_keys=True))  # strict JSON
            readable_as(tmp, self.root)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return CacheEntry(key=key, path=final, parts=parts, built=True, seconds=seconds, meta=meta)

    # ---- verification ----------------------------------------------------------------------------

    def verify(self, path: Path, key: str | None = None, *, checksums: bool = True) -> str | None:
        """None when the entry is intact, else what is wrong with it. Without `checksums` only the
        manifest, the key and the file sizes are checked (what a cache hit costs)."""
        manifest_path = path / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            return "its manifest is missing"
        except (json.JSONDecodeError, UnicodeDecodeError):
            return "its manifest is not valid JSON"
        if key is not None and manifest.get("key") != key:
            return f"its manifest names key {manifest.get('key')!r}"
        for name, info in manifest.get("files", {}).items():
            file = path / name
            if not file.is_file():
                return f"{name} is missing"
            if file.stat().st_size != info["size"]:
                return f"{name} has {file.stat().st_size} bytes, the manifest says {info['size']}"
            if not os.access(file, os.R_OK):  # another user's file: not damaged, and building again would not help
                raise CacheError(f"cache file {', '.join(unreadable_files(path))} is unreadable by this user "
                                 f"({os.getuid()}); make the cache readable (`chmod -R a+rX {self.root}`) or run as "
                                 "its owner.")
            if checksums and file_sha256(file) != info["sha256"]:
                return f"{name} does not match its checksum"
        return None

    def lookup(self, parts: dict[str, Any]) -> CacheEntry | None:
        """The entry for `parts` if it is built and intact (cheap checks), else None; builds nothing."""
        key = digest_key(parts)
        entry = self._load_verified(self.entries / key, key)
        if entry is not None:
            self.events.append((str(parts.get("kind", "entry")), key, "reused"))
            self.touch(key)
        return entry

    def touch(self, key: str) -> None:
        """Mark an entry used now (what the least-recently-used eviction reads)."""
        try:
            os.utime(self.entries / key / MANIFEST)
        except OSError:
            pass  # a read-only cache (a shared one): last use is then its build time

    def remove(self, key: str, *, wait: bool = True) -> bool:
        """Delete an entry under its exclusive lock. Without `wait`, an entry that another process is
        building, reading or loading is left alone (returns False)."""
        with self._lock(key, wait=wait) as held:
            if held:
                shutil.rmtree(self.entries / key, ignore_errors=True)
            return held

    @contextmanager
    def reading(self, key: str) -> Iterator[None]:
        """Hold an entry while building from it or loading it: eviction and clearing skip it meanwhile."""
        with self._lock(key, shared=True):
            yield

    def entries_of(self, model: str) -> list[EntryInfo]:
        """The entries of one model: see :meth:`clear`. A folder name that several models' folders share is an
        error listing them."""
        entries = self.list()
        path = Path(model).expanduser()
        if path.exists():
            return [info for info in entries if info.model == str(path.resolve())]
        exact = [info for info in entries if info.model == model]
        if exact or "/" in model:
            return exact
        named = [info for info in entries if Path(info.model).name == model]
        owners = sorted({info.model for info in named})
        if len(owners) > 1:
            raise CacheError(f"{model!r} names {len(owners)} models in the cache ({', '.join(owners)}); give the "
                             "folder's path (or the label as `kasoku cache ls` lists it).")
        return named

    def total_bytes(self) -> int:
        return sum(info.size_bytes for info in self.list())

    def prune(self, max_bytes: int, *, keep: set[str] = frozenset()) -> list[EntryInfo]:
        """Evict least recently used entries until the cache holds at most `max_bytes`; entries in `keep`
        and entries another process holds are skipped. Returns what was removed."""
        entries = sorted(self.list(), key=lambda info: info.last_used)
        total = sum(info.size_bytes for info in entries)
        removed = []
        for info in entries:
            if total <= max_bytes:
                break
            if info.key in keep or not self.remove(info.key, wait=False):
                continue
            total -= info.size_bytes
            removed.append(info)
        return removed

    def enforce_budget(self, keep: set[str] = frozenset()) -> list[EntryInfo]:
        """Prune to `KASOKU_CACHE_MAX` when it is set (after a compile built entries)."""
        budget = budget_from_environment()
        return self.prune(budget, keep=keep) if budget is not None else []

    def discard_if_damaged(self, entry: CacheEntry) -> bool:
        """After a runtime failed to load `entry`: if its full checksums do not match, warn and remove
        it (the caller rebuilds it) and return True; False when the entry is intact."""
        with self._lock(entry.key):
            problem = self.verify(entry.path, entry.key)
            if problem is None:
                return False
            warnings.warn(f"cache entry {entry.path} is corrupt ({problem}); rebuilding it.", CorruptEntryWarning,
                          stacklevel=3)
            shutil.rmtree(entry.path, ignore_errors=True)
            return True

    def check(self, *, repair: bool = False) -> list[tuple[EntryInfo, str]]:
        """Every entry's full checksums: (entry, what is wrong) for each damaged one; with `repair`,
        damaged entries are removed (the next compile rebuilds them)."""
        damaged = []
        for info in self.list(include_unreadable=True):
            path = self.entries / info.key
            with self._lock(info.key):
                problem = self.verify(path, info.key)
                if problem is not None:
                    damaged.append((info, problem))
                    if repair:
                        shutil.rmtree(path, ignore_errors=True)
        return damaged

    def _load_verified(self, final: Path, key: str) -> CacheEntry | None:
        if not final.exists():
            return None
        problem = self.verify(final, key, checksums=False)
        if problem is not None:
            warnings.warn(
                f"cache entry {final} is corrupt ({problem}); rebuilding it.", CorruptEntryWarning, stacklevel=3
            )
            return None
        manifest = json.loads((final / MANIFEST).read_text())
        return CacheEntry(key=key, path=final, parts=manifest["parts"], built=False, meta=manifest.get("meta", {}))

    # ---- locking and leftovers -----------------------------------------------------------------

    @contextmanager
    def _lock(self, key: str, *, shared: bool = False, wait: bool = True) -> Iterator[bool]:
        """The key's file lock: exclusive to build or remove, shared to read; yields whether it is held
        (always, when waiting)."""
        lock_path = self.entries / f".{key}.lock"
        try:
            handle = open(lock_path, "a+")
        except OSError:
            if shared and self.entries.is_dir() and not os.access(self.entries, os.W_OK):
                yield True  # a read-only cache: no process can build or evict in it, so reading needs no lock
                return
            raise CacheError(f"cannot lock {lock_path}: the cache {self.root} is not writable. Set KASOKU_CACHE (or "
                             "--cache-dir) to a writable folder.") from None
        with handle:
            mode = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB)
            try:
                fcntl.flock(handle, mode)  # waits while another process builds (or reads) this key
            except BlockingIOError:
                yield False
                return
            try:
                if not shared:
                    self._clean_leftovers(key)
                yield True
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _clean_leftovers(self, key: str) -> None:
        """Temporary folders of this key left by a killed build (we hold the key's lock, so no
        live builder owns them)."""
        for leftover in self.entries.glob(f"{TMP_PREFIX}{key}-*"):
            logger.info("removing %s, left by an interrupted build", leftover)
            shutil.rmtree(leftover, ignore_errors=True)

    # ---- listing and clearing ------------------------------------------------------------------

    def list(self, *, include_unreadable: bool = False) -> list[EntryInfo]:
        out = []
        if not self.entries.is_dir():
            return out
        for path in sorted(self.entries.iterdir()):
            if path.name.startswith(".") or not path.is_dir():
                continue
            try:
                manifest = json.loads((path / MANIFEST).read_text())
            except (OSError, json.JSONDecodeError, UnicodeDecodeError):
                if include_unreadable:
                    out.append(EntryInfo(path.name, "?", "?", "-", 0, 0.0, {}))
                continue
            parts = manifest.get("parts", {})
            describe = manifest.get("describe", {})
            out.append(
                EntryInfo(
                    key=path.name,
                    kind=str(parts.get("kind", "?")),
                    model=str(describe.get("model", "?")),
                    component=str(describe.get("component", parts.get("component", "-"))),
                    size_bytes=sum(f["size"] for f in manifest.get("files", {}).values()),
                    created=float(manifest.get("created", 0.0)),
                    parts=parts,
                    last_used=(path / MANIFEST).stat().st_mtime,
                )
            )
        return out

    def clear(self, model: str | None = None) -> int:
        """Remove every entry (or exactly those of one model: a folder by its absolute path, else the label as
        listed, or a folder name that names one model only); returns how many were removed."""
        removed = 0
        for info in self.entries_of(model) if model is not None else self.list():
            removed += self.remove(info.key, wait=False)
        if model is None:
            for leftover in self.entries.glob(f"{TMP_PREFIX}*"):
                shutil.rmtree(leftover, ignore_errors=True)
            (self.root / MEMORY_STOPS).unlink(missing_ok=True)  # what ran out of memory is forgotten with the rest
            (self.root / FAILED_EXPORTS).unlink(missing_ok=True)
        return removed
