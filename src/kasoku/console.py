"""Terminal output shared by the CLI: one console, tables, a progress display per stage."""

from __future__ import annotations

import json
import logging
import sys
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


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    out = Table(title=title, title_justify="left")
    for column in columns:
        out.add_column(column)
    for row in rows:
        out.add_row(*(str(c) for c in row))
    return out


@contextmanager
def stage(description: str) -> Iterator[None]:
    """A spinner with elapsed time while a slow step runs."""
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


def write_json(path: str | Path, data: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if hasattr(data, "to_dict"):
        data = data.to_dict()
    Path(path).write_text(json.dumps(data, indent=2, default=_default))
