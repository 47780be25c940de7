"""One output helper for every command: JSON for machines, rich for people, progress on terminals.

Errors are rendered here too, once for every command (:func:`report_exception`, :func:`report_failure`):
one line ``error: …`` on stderr, the same as JSON on stdout when the command was given ``--json``, and
the full traceback with ``--debug`` (or ``ROTATIONZOO_DEBUG=1``).

Text that came from outside the program (a rotation file's metadata, a manifest, a registry overlay,
a hub, the cache's markers, a path) reaches the terminal only through :func:`printable`: every control
character shown escaped, so that it can neither move the cursor, recolour or clear the screen, reorder
what is shown, nor start a line of its own. JSON output is never escaped this way (``json.dumps``
escapes control characters itself, and values stay exact).
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from ..numbers import CONTROL_CHARS


@dataclass
class OutputMode:
    """How the running command reports: set by ``--json`` / ``--debug`` while the command line is parsed."""

    json: bool = False
    debug: bool = False


#: The mode of the command being run (reset by :func:`reset_mode` at the start of every run).
MODE = OutputMode()

def reset_mode(*, json: bool = False) -> None:
    """Back to plain output (JSON when ``json``); ``--debug`` defaults to ``ROTATIONZOO_DEBUG``.

    ``json`` is set before the environment is read, so that a bad ``ROTATIONZOO_DEBUG`` is reported as
    JSON to a command line that asked for it (:func:`json_in_args`).

    Raises:
        ConfigError: ``ROTATIONZOO_DEBUG`` is not a boolean (see :func:`rotationzoo.config.env_bool`).
    """
    from .. import config

    MODE.json = json
    MODE.debug = False
    MODE.debug = config.debug()


def json_in_args(args: Sequence[str]) -> bool:
    """Whether a command line asks for JSON (``--json``, or ``serve-args``' ``--format json``), read
    before it is parsed: a usage error, a bad ``ROTATIONZOO_DEBUG`` or Ctrl-C is then JSON too."""
    for i, arg in enumerate(args):
        if arg == "--":  # what follows is positional
            return False
        if arg in ("--json", "--format=json", "-fjson"):
            return True
        if arg in ("--format", "-f") and args[i + 1:i + 2] == ["json"]:
            return True
    return False


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


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(match: re.Match[str]) -> str:
    ch = match.group()
    return _NAMED.get(ch) or (f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")


def printable(text: Any, *, drop_ansi: bool = False) -> str:
    """``text`` as it may reach a terminal: every control character shown escaped (``\\x1b``, ``\\n``,
    ``\\u202e``; see :data:`~rotationzoo.numbers.CONTROL_CHARS`), so that one value stays on one line and
    cannot clear, recolour or reorder the screen. The one filter of every text that came from a file, a manifest, a registry, a
    hub or a path, and of every message; JSON output does not need it.

    Args:
        text: what to print (``str()`` of it).
        drop_ansi: drop whole ANSI escape sequences first (:func:`plain`): for messages, which torch
            and other libraries colour; a file's values keep them, shown escaped.
    """
    return CONTROL_CHARS.sub(_escaped, plain(text) if drop_ansi else str(text))


def printable_lines(text: Any) -> str:
    """A message as :func:`printable` shows it (ANSI sequences dropped), its own line breaks kept: the
    library's multi-line messages (a failed fetch: one line per source tried, then a hint) stay lines."""
    return "\n".join(printable(line, drop_ansi=True) for line in str(text).split("\n"))


def plain(text: Any) -> str:
    """``text`` without ANSI escape sequences (torch and other libraries put them in messages), the
    rest unchanged (for JSON); on a terminal, use ``printable(text, drop_ansi=True)``."""
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


def print_error(text: str) -> None:
    """Print an error on stderr, literally (square brackets in it are not rich markup, control characters
    but the message's own line breaks shown escaped: :func:`printable_lines`)."""
    from rich.text import Text

    console(stderr=True).print(Text("error: ", style="bold red") + Text(printable_lines(text)))


def print_warning(text: str) -> None:
    """Print a warning on stderr, literally (:func:`printable_lines`)."""
    from rich.text import Text

    console(stderr=True).print(Text("warning: ", style="yellow") + Text(printable_lines(text)))


def print_note(text: str) -> None:
    """One line of what the command is doing on stderr, literally (never on stdout)."""
    from rich.text import Text

    console(stderr=True).print(Text(printable(text, drop_ansi=True), style="dim"))


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


def report_failure(kind: str, text: str) -> None:
    """Report a failure that is no exception of the library (a usage error, Ctrl-C): one line
    ``error: text`` on stderr, or ``{"error": {"type": kind, "message": text}}`` on stdout with ``--json``."""
    if MODE.json:
        emit_json({"error": {"type": kind, "message": text}})
    else:
        print_error(text)


def progress_enabled() -> bool:
    """Whether stderr is an interactive terminal (progress is then a bar, else plain lines)."""
    return is_tty(sys.stderr)


#: Least seconds between two plain progress lines of one stage (its first and last lines always show).
LINE_INTERVAL_S = 10.0
#: Plain progress lines report at most every this share of a stage.
LINE_STEP = 0.1


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``1 h 02 min``."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class ProgressLines:
    """``progress(done, total, what)`` (:mod:`rotationzoo.progress`) as a few plain lines on a
    stream: one when a stage starts, then at most one per :data:`LINE_STEP` of it and no more often
    than every ``interval`` seconds (with elapsed time and an ETA), and one when it ends.
    Thread-safe."""

    def __init__(self, label: str, stream: Any = None, *, interval: float = LINE_INTERVAL_S,
                 clock: Callable[[], float] | None = None) -> None:
        import threading
        import time

        self.label, self.stream, self.interval = label, stream, interval
        self.clock = clock or time.monotonic
        self._lock = threading.Lock()
        self._total: int | None = None
        self._done = 0
        self._t0 = self._last = 0.0
        self._mark = 0
        self._ended = False

    def _write(self, line: str) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        stream.write(printable(line, drop_ansi=True) + "\n")
        stream.flush()

    def __call__(self, done: int, total: int, what: str) -> None:
        with self._lock:
            now = self.clock()
            if self._total is None or total != self._total or done < self._done:  # a new stage
                self._total, self._t0, self._mark, self._ended = total, now, 0, False
                self._done, self._last = done, now
                self._write(f"{self.label}: {done:,}/{total:,}" + (f" · {what}" if what else ""))
                return
            self._done = done
            if self._ended:
                return
            elapsed = now - self._t0
            if done >= total:
                self._ended = True
                self._write(f"{self.label}: {done:,}/{total:,} (100%) in {duration(elapsed)}")
                return
            mark = int(done / total / LINE_STEP) if total else 0
            if mark > self._mark and now - self._last >= self.interval:
                self._mark, self._last = mark, now
                eta = elapsed * (total - done) / done if done else 0.0
                self._write(f"{self.label}: {done:,}/{total:,} ({100 * done // total}%), {duration(elapsed)} elapsed, "
                            f"eta {duration(eta)}" + (f" · {what}" if what else ""))


@contextlib.contextmanager
def progress_reporter(label: str, *, enabled: bool = True) -> Iterator[Callable[[int, int, str], None]]:
    """Progress of a long command on stderr, never stdout (``--json`` output stays clean): a rich
    bar with an ETA on a terminal, else :class:`ProgressLines`. Yields the ``progress(done, total,
    what)`` callable to hand to the library (a no-op when ``enabled`` is false)."""
    if not enabled:
        yield lambda done, total, what: None
        return
    if not progress_enabled():
        yield ProgressLines(label)
        return
    import threading

    from rich.markup import escape
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    lock = threading.Lock()
    with Progress(TextColumn("{task.description:<32}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("eta"), TimeRemainingColumn(), console=console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=None)
        stage: list[int | None] = [None, 0]  # total, done

        def update(done: int, total: int, what: str) -> None:
            text = escape(f"{label}: {what}"[:32] if what else label)
            with lock:
                if total != stage[0] or done < (stage[1] or 0):  # a new stage: its own elapsed time and ETA
                    bar.reset(task, total=total, completed=done, description=text)
                else:
                    bar.update(task, completed=done, total=total, description=text)
                stage[0], stage[1] = total, done

        yield update
