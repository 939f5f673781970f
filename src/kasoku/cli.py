"""`kasoku`: compile diffusers Stable Diffusion pipelines into fast engines, and prove them.

Every command is a thin layer over a library call that returns data; this module only parses
arguments and prints.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from .errors import KasokuError

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(name: str):
    def register(fn: Callable[[argparse.Namespace], int]):
        COMMANDS[name] = fn
        return fn

    return register


# ---- commands --------------------------------------------------------------------------------


@command("tiny")
def cmd_tiny(args: argparse.Namespace) -> int:
    """Write the built-in tiny Stable Diffusion pipeline as a diffusers folder."""
    from .console import console
    from .tiny import write_tiny_pipeline

    path = write_tiny_pipeline(args.dir, inpainting=args.inpainting, seed=args.seed)
    kind = "inpainting " if args.inpainting else ""
    console.print(f"wrote the tiny Stable Diffusion 1.x {kind}pipeline (seed {args.seed}) to {path}")
    return 0


@command("export")
def cmd_export(args: argparse.Namespace) -> int:
    """Export a pipeline's components to ONNX, with a parity check against torch."""
    from .console import console, stage, table, write_json
    from .export import export_pipeline

    current = {}

    def on_component(name: str) -> None:
        current["name"] = name

    with stage(f"exporting {args.model} ({args.exporter}, opset {args.opset})"):
        manifest = export_pipeline(
            args.model,
            args.outdir,
            components=args.components,
            exporter=args.exporter,
            opset=args.opset,
            on_component=on_component,
        )
    rows = []
    for c in manifest.components:
        worst = max(c.parity, key=lambda p: p.max_abs / p.limit)
        rows.append(
            [c.name, c.path, f"{c.size_bytes / 1e6:.1f} MB", f"{c.seconds:.1f} s",
             f"{worst.max_abs:.1e} (tol {worst.limit:.0e})", len({p.shape for p in c.parity})]
        )
    console.print(
        table("ONNX export", ["component", "file", "size", "time", "worst max|Δ| vs torch", "shapes checked"], rows)
    )
    console.print(f"manifest: {Path(args.outdir) / 'manifest.json'}")
    if args.json:
        write_json(args.json, manifest)
    return 0


@command("demo")
def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on the built-in tiny pipeline, offline: export, prove parity, report."""
    from .console import console, write_json
    from .demo import print_demo_report, run_demo

    report = run_demo(workdir=args.workdir)
    print_demo_report(report, console)
    if args.json:
        write_json(args.json, report)
    return 0


# ---- parser ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from .components import COMPONENT_NAMES
    from .export import DEFAULT_EXPORTER, DEFAULT_OPSET, EXPORTERS

    parser = argparse.ArgumentParser(
        prog="kasoku",
        description=(
            "kasoku (加速) compiles diffusers Stable Diffusion pipelines into ONNX Runtime, OpenVINO "
            "and TensorRT engines and proves they compute the same thing. Start with `kasoku demo`."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, **kwargs) -> argparse.ArgumentParser:
        doc = COMMANDS[name].__doc__.strip()
        return sub.add_parser(name, help=doc.splitlines()[0], description=doc, **kwargs)

    p = add("demo")
    p.add_argument("--workdir", type=Path, default=None,
                   help="keep the tiny model and its ONNX files here (default: a temporary folder)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON")

    p = add("tiny")
    p.add_argument("dir", type=Path, help="an empty or new folder to write the pipeline into")
    p.add_argument("--inpainting", action="store_true", help="the 9-input-channel inpainting U-Net variant")
    p.add_argument("--seed", type=int, default=0, help="seed of the deterministic weights (default 0)")

    p = add("export")
    p.add_argument("model", help="a diffusers pipeline folder (or a hub id when online)")
    p.add_argument("outdir", type=Path, help="folder for <component>/model.onnx and manifest.json")
    p.add_argument("--exporter", choices=EXPORTERS, default=DEFAULT_EXPORTER,
                   help=f"torch.onnx exporter (default {DEFAULT_EXPORTER})")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset (default {DEFAULT_OPSET})")
    p.add_argument("--components", nargs="+", choices=COMPONENT_NAMES, default=list(COMPONENT_NAMES),
                   metavar="NAME", help=f"which components (default all: {' '.join(COMPONENT_NAMES)})")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the manifest to PATH")

    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from rich.markup import escape

    from .console import console, quiet_third_party_logs

    quiet_third_party_logs()
    try:
        return COMMANDS[args.command](args)
    except KasokuError as error:
        console.print("[bold red]error:[/]", escape(str(error)), soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
