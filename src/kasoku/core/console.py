"""Terminal output shared by the CLI: one console, tables, a progress display per stage."""

from __future__ import annotations

import json
import logging
import math
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


def quiet_third_party_logs() -> None:
    """Libraries we call log advice meant for their own developers (xFormers' CUDA build
    mismatch, torch.onnx's optional torchvision ops); our users see our messages instead."""
    for name in ("xformers", "torch.onnx", "torch._dynamo", "torch.export", "onnxscript", "diffusers", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import diffusers.utils.logging
    import transformers.utils.logging

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    # diffusers configures its root logger lazily, resetting the level set above
    diffusers.utils.logging.set_verbosity_error()
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
