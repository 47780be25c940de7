"""One output helper for every command: JSON for machines, rich for people, progress on terminals."""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any, Callable, Iterator


def emit_json(obj: Any) -> None:
    """Print ``obj`` as indented JSON on stdout."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


#: Width of tables when the output is not a terminal (a pipe, a file): wide enough that nothing is cut.
PIPE_WIDTH = 240


def console(stderr: bool = False) -> Any:
    """A rich console on stdout (or stderr); when it is not a terminal, tables keep their full width."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else PIPE_WIDTH
    return Console(stderr=stderr, highlight=False, soft_wrap=True, width=width)


def print_error(message: str) -> None:
    """Print one error line on stderr, literally (square brackets in it are not rich markup)."""
    from rich.text import Text

    console(stderr=True).print(Text("error: ", style="bold red") + Text(message))


def print_warning(message: str) -> None:
    from rich.text import Text

    console(stderr=True).print(Text("warning: ", style="yellow") + Text(message))


def progress_enabled() -> bool:
    """Progress bars only on an interactive terminal."""
    return sys.stderr.isatty()


@contextlib.contextmanager
def progress_bar(enabled: bool, label: str) -> Iterator[Callable[[int, int, str], None]]:
    """A rich bar with an ETA on stderr; yields ``update(done, total, description)`` (a no-op when
    ``enabled`` is false, e.g. with ``--json`` or when stderr is not a terminal)."""
    if not enabled:
        yield lambda done, total, what: None
        return
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    with Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("eta"), TimeRemainingColumn(), console=console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=f"{label}: {what}"[:28])

        yield update
