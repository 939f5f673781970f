"""Terminal output shared by the CLI: one console, tables, a progress display per stage."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

# Reports are tables: when piped (CI logs, files) give them room instead of rich's 80 columns.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 132)


VERBOSE_ENV = "KASOKU_VERBOSE"  # set (to anything but 0): third-party logs and export chatter are shown
_quiet = False


def third_party_logs_shown() -> bool:
    """Whether the libraries' own logs are wanted (`kasoku -v`, or KASOKU_VERBOSE=1)."""
    return os.environ.get(VERBOSE_ENV, "0") not in ("", "0")


def quiet_third_party_logs(verbose: bool = False) -> None:
    """Libraries we call log advice meant for their own developers (xFormers' CUDA build mismatch, torch.onnx's
    optional torchvision ops, transformers' image processors without torchvision); our users see our messages
    instead, unless `verbose` (or KASOKU_VERBOSE=1) asks for theirs too. Nothing is imported here: a command that
    fails its checks answers before torch and diffusers are loaded."""
    global _quiet
    if verbose:
        os.environ[VERBOSE_ENV] = "1"  # worker processes (batch, Ray) inherit it
    if third_party_logs_shown():
        return
    for name in ("xformers", "torch.onnx", "torch._dynamo", "torch.export", "onnxscript", "diffusers", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # diffusers and transformers set their loggers' level when first imported: from these
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    _quiet = True
    hush_loaded_libraries()


def hush_loaded_libraries() -> None:
    """After quiet_third_party_logs, diffusers' and transformers' loading bars off (once they are imported: the
    model loader calls this before it loads)."""
    if not _quiet:
        return
    if "diffusers" in sys.modules:
        import diffusers.utils.logging

        diffusers.utils.logging.disable_progress_bar()
        diffusers.utils.logging.set_verbosity_error()  # it configures its root logger lazily, resetting the level
    if "transformers" in sys.modules:
        import transformers.utils.logging

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()


def show_markdown(text: str) -> None:
    """A markdown report: rendered on a terminal; as its text where piped (a log, CI), so that no table is cut."""
    if console.is_terminal:
        from rich.markdown import Markdown

        console.print(Markdown(text))
    else:
        console.print(text, markup=False, highlight=False, soft_wrap=True)


def progress_line(message: str) -> None:
    """One line of a slow command's progress, with the time (not the source line rich's `console.log` adds)."""
    console.print(f"[{time.strftime('%H:%M:%S')}] {message}", markup=False, highlight=False)


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    out = Table(title=title, title_justify="left")
    for column in columns:
        out.add_column(column, overflow="fold")  # piped into a narrow log, a cell wraps: nothing is cut
    for row in rows:
        out.add_row(*(str(c) for c in row))
    return out


@contextmanager
def stage(description: str) -> Iterator[None]:
    """A spinner with the stage and its elapsed time while a slow step runs; where the output is no terminal (CI, a
    log file, a container), one line per stage when it ends: `unet: engine … 45 s`."""
    if not console.is_terminal:
        start = time.perf_counter()
        yield  # a stage that fails says nothing here: its error is the one line
        console.print(f"{description} … {time.perf_counter() - start:.1f} s", markup=False, highlight=False)
        return
    progress = Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=True
    )
    with progress:
        progress.add_task(description, total=None)
        yield


def steps_bar() -> Progress:
    """A bar for a loop whose length is known once it starts (denoising steps)."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def _default(value: Any) -> Any:
    if is_dataclass(value):
        return asdict(value)
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return str(value)


def _strict(value: Any) -> Any:
    """`value` with everything JSON has no word for made plain: dataclasses and reports as dicts, paths as
    strings, and non-finite numbers (an unbounded tolerance's Infinity, a NaN) as null."""
    if hasattr(value, "to_dict") and not isinstance(value, type):
        value = value.to_dict()
    elif is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    if isinstance(value, dict):
        return {str(k): _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_strict(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return _default(value)


def to_json(data: Any, **kwargs: Any) -> str:
    """Strict JSON of `data` (see _strict): any JSON reader reads what kasoku writes."""
    return json.dumps(_strict(data), allow_nan=False, **kwargs)


def write_json(path: str | Path, data: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(to_json(data, indent=2))
