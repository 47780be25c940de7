"""One output helper for every command: JSON for machines, rich for people, progress on terminals.

Errors are rendered here too, once for every command (:func:`report_exception`): one line
``error: …`` on stderr, the same as JSON on stdout when the command was given ``--json``, and the
full traceback with ``--debug`` (or ``ROTATIONZOO_DEBUG=1``).
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator


@dataclass
class OutputMode:
    """How the running command reports: set by ``--json`` / ``--debug`` while the command line is parsed."""

    json: bool = False
    debug: bool = False


#: The mode of the command being run (reset by :func:`reset_mode` at the start of every run).
MODE = OutputMode()

def reset_mode() -> None:
    """Back to plain output; ``--debug`` defaults to ``ROTATIONZOO_DEBUG``.

    Raises:
        ConfigError: ``ROTATIONZOO_DEBUG`` is not a boolean (see :func:`rotationzoo.config.env_bool`).
    """
    from .. import config

    MODE.json = False
    MODE.debug = False
    MODE.debug = config.debug()


def json_requested(value: bool) -> bool:
    """Click callback of every ``--json`` flag: errors of this command are then printed as JSON."""
    if value:
        MODE.json = True
    return value


def emit_json(obj: Any) -> None:
    """Print ``obj`` as indented JSON on stdout."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


#: Width of rich output when it is not a terminal (a pipe, a file): so wide that no table cell is
#: ever cut (tables are only as wide as their content; plain lines are never padded).
PIPE_WIDTH = 1_000_000

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-_]")


def plain(text: Any) -> str:
    """``text`` without ANSI escape sequences (torch and other libraries put them in messages)."""
    return _ANSI.sub("", str(text))


def is_tty(stream: Any) -> bool:
    """Whether ``stream`` is an interactive terminal (false for pipes, files and captured output)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


def stdin_is_tty() -> bool:
    """Whether a confirmation can be asked on stdin."""
    return is_tty(sys.stdin)


def console(stderr: bool = False) -> Any:
    """A rich console on stdout (or stderr); when it is not a terminal, tables keep their full width."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if is_tty(stream) else PIPE_WIDTH
    return Console(stderr=stderr, highlight=False, soft_wrap=True, width=width)


def tail(text: str, width: int) -> str:
    """The end of ``text`` in at most ``width`` characters (``…/k_rotation.pt``): paths differ at the end."""
    if len(text) <= width:
        return text
    keep = text[len(text) - (width - 1):]
    cut = keep.find("/")
    if 0 <= cut < len(keep) - 1 and len(keep) - cut >= width // 2:
        keep = keep[cut:]
    return "…" + keep


def print_error(message: str) -> None:
    """Print one error line on stderr, literally (square brackets in it are not rich markup)."""
    from rich.text import Text

    console(stderr=True).print(Text("error: ", style="bold red") + Text(plain(message)))


def print_warning(message: str) -> None:
    from rich.text import Text

    console(stderr=True).print(Text("warning: ", style="yellow") + Text(plain(message)))


def _first_line(exc: BaseException) -> str:
    text = plain(exc).strip()
    return text.splitlines()[0][:300] if text else ""


def error_json(exc: BaseException, *, internal: bool = False) -> dict[str, Any]:
    """``{"error": {"type", "message"[, "attempts"]}}`` of an exception (what ``--json`` prints)."""
    err: dict[str, Any] = {"type": type(exc).__name__,
                           "message": internal_message(exc) if internal else plain(exc)}
    attempts = getattr(exc, "attempts", None)
    if attempts is not None:
        err["attempts"] = list(attempts)
    if internal:
        err["internal"] = True
    return {"error": err}


def internal_message(exc: BaseException) -> str:
    """The one line shown for an exception that is not one of the library's errors."""
    detail = _first_line(exc)
    what = f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
    return f"internal error ({what}); re-run with --debug and report it"


def report_exception(exc: BaseException, *, internal: bool = False) -> None:
    """Report a failed command: the traceback with ``--debug``, then one line on stderr (or JSON on
    stdout when the command was given ``--json``)."""
    if MODE.debug:
        import traceback

        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    if MODE.json:
        emit_json(error_json(exc, internal=internal))
    else:
        print_error(internal_message(exc) if internal else str(exc))


def progress_enabled() -> bool:
    """Progress bars only on an interactive terminal."""
    return is_tty(sys.stderr)


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
