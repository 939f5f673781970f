"""`kasoku cache` and `kasoku info`: what is in the cache, what this machine can run."""

from __future__ import annotations

import argparse

from .base import Command, add_cache_dir, add_json


class CacheCommand(Command):
    """List (`ls`), check (`check [--repair]`) or remove (`clear [MODEL]`) the cache entries."""

    name = "cache"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("action", choices=("ls", "check", "clear"),
                       help="ls: list the entries; check: verify every file's checksum; clear: remove entries")
        p.add_argument("model", nargs="?", help="with clear: only the entries of this model (folder or name)")
        p.add_argument("--repair", action="store_true", help="with check: remove the damaged entries (the next "
                                                             "compile rebuilds them)")
        add_cache_dir(p)
        add_json(p, "the list (ls) or the damaged entries (check)")

    def run(self, args: argparse.Namespace) -> int:
        from ..cache import Cache
        from ..console import console
        from ..errors import KasokuError

        if args.model and args.action != "clear":
            raise KasokuError(f"`kasoku cache {args.action}` takes no MODEL (only `clear` does).")
        if args.repair and args.action != "check":
            raise KasokuError("--repair goes with `kasoku cache check`.")
        cache = Cache(args.cache_dir)
        if args.action == "clear":
            removed = cache.clear(args.model)
            console.print(f"removed {removed} entr{'y' if removed == 1 else 'ies'} from {cache.root}")
            return 0
        if args.action == "check":
            return self.check(cache, args)
        return self.list(cache, args)

    def list(self, cache, args) -> int:
        import datetime

        from ..console import console, table, write_json

        entries = cache.list()
        rows = [[e.key[:12], e.kind, e.model, e.component, f"{e.size_bytes / 1e6:.1f} MB",
                 datetime.datetime.fromtimestamp(e.created).strftime("%Y-%m-%d %H:%M")] for e in entries]
        console.print(table(f"cache {cache.root}", ["entry", "kind", "model", "component", "size", "created"], rows))
        console.print(f"{len(entries)} entries, {sum(e.size_bytes for e in entries) / 1e6:.1f} MB")
        if args.json:
            write_json(args.json, [vars(e) for e in entries])
        return 0

    def check(self, cache, args) -> int:
        from ..console import console, write_json

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


class Info(Command):
    """Installed backends, versions and devices, and why a backend is unavailable."""

    name = "info"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_json(p)

    def run(self, args: argparse.Namespace) -> int:
        from ..console import console, table, write_json
        from ..info import system_info

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
