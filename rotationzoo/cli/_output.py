"""One output helper for every command: JSON for machines, rich for people."""

from __future__ import annotations

import json
import sys
from typing import Any


def emit_json(obj: Any) -> None:
    """Print ``obj`` as indented JSON on stdout."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def print_error(message: str) -> None:
    """Print an error line on stderr (no traceback)."""
    console(stderr=True).print(f"[bold red]error:[/] {message}", markup=True, highlight=False)


def print_warning(message: str) -> None:
    console(stderr=True).print(f"[yellow]warning:[/] {message}")


def progress_enabled() -> bool:
    """Progress bars only on an interactive terminal."""
    return sys.stderr.isatty()
