"""`kasoku`: compile diffusers text-to-image pipelines into fast engines, and prove them.

Every command is a small :class:`~kasoku.cli.base.Command` that declares its own arguments beside
its code and is a thin layer over a library call that returns data. A user error ends in one line
and a non-zero exit, never a traceback, and nothing is written.

One of the apps (with batch and serve), the top layer. May import: every layer, and the other apps.
"""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from ..core.errors import KasokuError
from .admin import CacheCommand, Info
from .base import Command
from .build import Compile, Export, Tiny
from .check import Bench, Demo, Tune, Verify
from .generate import Batch, Generate
from .serve import Serve

COMMANDS: dict[str, Command] = {c.name: c for c in (Demo(), Generate(), Batch(), Serve(), Tiny(), Export(), Compile(),
                                                     CacheCommand(), Verify(), Bench(), Tune(), Info())}


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line: what is wrong and where the help is."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kasoku",
        description=(
            "kasoku (加速) compiles diffusers text-to-image pipelines (Stable Diffusion 1.x, 2.x, XL, 3/3.5, Flux.1) "
            "into ONNX Runtime, OpenVINO, TensorRT and AOTInductor engines and proves they compute the same thing. "
            "Start with `kasoku demo`."
        ),
    )
    parser.add_argument("--version", action="version", version=f"kasoku {__version__}")
    _add_verbose(parser, default=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    for name, command in COMMANDS.items():
        doc = (type(command).__doc__ or "").strip()
        command_parser = sub.add_parser(name, help=command.summary(), description=doc)
        command.add_arguments(command_parser)
        _add_verbose(command_parser, default=argparse.SUPPRESS)  # `kasoku -v X` and `kasoku X -v` alike
    return parser


def _add_verbose(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", default=default,
                        help="show the logs and warnings of the libraries kasoku calls (torch.onnx, diffusers, "
                             "transformers, xFormers), which are filtered by default; also KASOKU_VERBOSE=1")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from rich.markup import escape

    from ..core.console import console, quiet_third_party_logs

    quiet_third_party_logs(verbose=args.verbose)
    try:
        return COMMANDS[args.command].run(args)
    except KasokuError as error:
        console.print("[bold red]error:[/]", escape(str(error)), soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130


__all__ = ["COMMANDS", "Command", "build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
