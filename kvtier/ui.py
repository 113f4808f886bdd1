"""Terminal output conventions shared by the commands: rich for tables and progress.

People get tables (rich) and progress bars on stderr (only when stderr is a terminal or
``--progress`` asks); machines get ``--json`` on every command, with nothing else on stdout.
Piped output is plain text (no colour codes) at a fixed width of 200 columns so that logs
and tests see whole lines.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TextIO

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table

PIPE_WIDTH = 200


def console(file: TextIO | None = None) -> Console:
    """A console on ``file`` (default stdout): the terminal's width, or 200 when piped."""
    stream = file if file is not None else sys.stdout
    c = Console(file=stream, highlight=False)
    return c if c.is_terminal else Console(file=stream, highlight=False, width=PIPE_WIDTH,
                                           no_color=True)


def table(head: Sequence[str], rows: Sequence[Sequence[str]], *, title: str | None = None,
          right: Sequence[int] = ()) -> Table:
    """A borderless table (lines start with the first cell: easy to grep); ``right`` are
    the indices of right-aligned (numeric) columns."""
    t = Table(title=title, title_justify="left", box=None, pad_edge=False,
              header_style="bold", show_edge=False)
    for i, h in enumerate(head):
        t.add_column(escape(h), justify="right" if i in right else "left", no_wrap=True)
    for row in rows:
        t.add_row(*(escape(c) for c in row))
    return t


@contextlib.contextmanager
def progress(total: int, label: str, *, enabled: bool,
             file: TextIO | None = None) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr; yields ``advance(n)``. Disabled: a no-op callable."""
    if not enabled:
        yield _noop
        return
    stream = file if file is not None else sys.stderr
    bar = Progress(TextColumn("{task.description:<18}"), BarColumn(), TaskProgressColumn(),
                   MofNCompleteColumn(), TimeRemainingColumn(),
                   console=Console(file=stream), transient=False)
    with bar:
        task = bar.add_task(label, total=max(total, 1))
        yield lambda n: bar.advance(task, n)


def _noop(n: int) -> None:
    return None

