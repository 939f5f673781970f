"""`kasoku cache` and `kasoku info`: what is in the cache, what this machine can run."""

from __future__ import annotations

import argparse

from .base import Command, add_cache_dir, add_json


class CacheCommand(Command):
    """List (`ls`), check (`check [--repair]`), prune (`prune --max-size SIZE`) or remove (`clear [MODEL]`)
    the cache entries. KASOKU_CACHE_MAX=SIZE prunes after every compile that builds."""

    name = "cache"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("action", choices=("ls", "check", "prune", "clear"),
                       help="ls: list the entries with their size and last use; check: verify every file's "
                            "checksum; prune: evict the least recently used entries down to --max-size; clear: "
                            "remove entries")
        p.add_argument("model", nargs="?", help="with clear: only the entries of this model (folder or name)")
        p.add_argument("--repair", action="store_true", help="with check: remove the damaged entries (the next "
                                                             "compile rebuilds them)")
        p.add_argument("--max-size", metavar="SIZE", help="with prune: the budget, e.g. 20G or 500M")
        add_cache_dir(p)
        add_json(p, "the list (ls), the damaged entries (check) or the evicted ones (prune)")

    def run(self, args: argparse.Namespace) -> int:
        from ..core.cache import Cache, parse_size
        from ..core.console import console
        from ..core.errors import KasokuError

        if args.model and args.action != "clear":
            raise KasokuError(f"`kasoku cache {args.action}` takes no MODEL (only `clear` does).")
        if args.repair and args.action != "check":
            raise KasokuError("--repair goes with `kasoku cache check`.")
        if (args.max_size is not None) != (args.action == "prune"):
            raise KasokuError("`kasoku cache prune` needs --max-size SIZE (e.g. 20G), and only prune takes it.")
        budget = parse_size(args.max_size) if args.max_size is not None else None
        cache = Cache(args.cache_dir)
        if args.action == "clear":
            if args.model and not cache.entries_of(args.model):
                from pathlib import Path

                what = "" if Path(args.model).expanduser().exists() or not cache.list() else \
                    f" ({args.model} is neither a folder here nor a model the cache lists)"
                raise KasokuError(f"the cache {cache.root} holds no entries of {args.model}{what}; `kasoku cache ls` "
                                  "lists the models it holds.")
            removed = cache.clear(args.model)
            console.print(f"removed {removed} entr{'y' if removed == 1 else 'ies'} from {cache.root}")
            return 0
        if args.action == "check":
            return self.check(cache, args)
        if args.action == "prune":
            return self.prune(cache, budget, args)
        return self.list(cache, args)

    def list(self, cache, args) -> int:
        from ..core.console import console, table, write_json

        entries = sorted(cache.list(), key=lambda e: e.last_used, reverse=True)
        rows = [[e.key[:12], e.kind, e.model, e.component, _size(e.size_bytes), _when(e.last_used)] for e in entries]
        console.print(table(f"cache {cache.root}", ["entry", "kind", "model", "component", "size", "last used"],
                            rows))
        console.print(f"{len(entries)} entries, {_size(sum(e.size_bytes for e in entries))} in all")
        if args.json:
            write_json(args.json, [vars(e) for e in entries])
        return 0

    def prune(self, cache, budget: int, args) -> int:
        from ..core.console import console, write_json

        before = cache.total_bytes()
        removed = cache.prune(budget)
        after = cache.total_bytes()
        for info in removed:
            console.print(f"evicted | {info.key[:12]} | {info.kind} {info.component} of {info.model} | "
                          f"{_size(info.size_bytes)} | last used {_when(info.last_used)}", markup=False)
        console.print(f"freed {_size(before - after)} ({len(removed)} entries); the cache holds {_size(after)} "
                      f"(budget {_size(budget)})" + ("; entries in use by another process were kept"
                                                      if after > budget else ""))
        if args.json:
            write_json(args.json, [vars(e) for e in removed])
        return 0

    def check(self, cache, args) -> int:
        from ..core.console import console, write_json

        damaged = cache.check(repair=args.repair)
        for info, problem in damaged:
            verdict = "removed" if args.repair else "DAMAGED"
            console.print(f"{verdict} | {info.key[:12]} | {info.kind} {info.component} of {info.model} | {problem}",
                          markup=False)
        total = len(cache.list()) + (len(damaged) if args.repair else 0)
        console.print(f"{total} entries checked, {len(damaged)} damaged"
                      + (", removed (the next compile rebuilds them)" if args.repair and damaged else ""))
        if args.json:
            write_json(args.json, [{"key": i.key, "problem": p} for i, p in damaged])
        return 1 if damaged and not args.repair else 0


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _when(timestamp: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M")


class Info(Command):
    """Installed backends, versions and devices, and why a backend is unavailable; a MODEL's components."""

    name = "info"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("model", nargs="?", default=None,
                       help="a diffusers folder or hub id: list its components and how each will run (engine, or "
                            "torch and why). For a family kasoku compiles from its recorded calls, this runs the "
                            "pipeline at a few small sizes first (its weights are read)")
        add_json(p)

    def run(self, args: argparse.Namespace) -> int:
        from ..core.console import console, table, write_json
        from ..tools.info import model_components, system_info

        if args.model is not None:
            components = model_components(args.model)
            console.print(table(f"{components['family']} components", ["component", "module", "runs on"],
                                [[c["component"], c["module"], c["runs"]] for c in components["components"]]))
            if args.json:
                write_json(args.json, components)
            return 0
        info = system_info()
        machine = info["machine"]
        console.print(f"python {info['python']} | CPU: {machine['cpu']} ({machine['cores']} threads) | "
                      f"GPUs: {', '.join(machine['gpus']) or 'none'}")
        console.print(table("versions", ["package", "version"], sorted(info["versions"].items())))
        rows = [[b["name"], "yes" if b["available"] else "no", b["version"] or "-", b["devices"] or b["reason"]]
                for b in info["backends"]]
        console.print(table("backends", ["backend", "available", "version", "devices / why not"], rows))
        for problem in info["problems"]:
            console.print(f"problem: {problem}", markup=False)
        if args.json:
            write_json(args.json, info)
        return 0
