"""A launch as printed by ``serve-args``: :class:`LaunchSpec` and its shell / env / JSON renderings.

Every value and argument is quoted with :func:`shlex.quote`; a variable name that is not a shell
identifier, or a value holding a control character, is refused rather than printed.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from .errors import ServingError
from .numbers import CONTROL_CHARS, shown

OutputFormat = Literal["shell", "env", "json"]
OUTPUT_FORMATS: tuple[str, ...] = get_args(OutputFormat)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_printable(value: str, what: str) -> str:
    """``value`` unless it holds a control character (a newline would start a new line of a
    pasted command or of an env file); the launch is then refused rather than printed."""
    if not isinstance(value, str):
        raise ServingError(f"{what} must be a string, got {type(value).__name__}")
    if CONTROL_CHARS.search(value):
        raise ServingError(f"{what} {shown(value)} holds a control character (newline, tab, escape, a bidi override …); a launch line "
                           "cannot carry it safely: rename the file or folder, or pass a plain --model-path")
    return value


@dataclass
class LaunchSpec:
    """Everything needed to start one engine with one rotation pair.

    Attributes:
        engine: a name of :data:`rotationzoo.engines.TARGETS`.
        model: registry model id (e.g. ``"Qwen/Qwen3-8B"``), or the pair's source when not from the registry.
        tag: calibration tag (``None`` when not from the registry).
        env: environment variables, in launch order.
        args: the command line (``argv``).
        files: local files the launch uses: ``k``, ``v`` (and ``gguf`` for llama.cpp); none for a
            start-up calibration launch.
        prepare: commands (``argv`` lists) to run once before ``args`` (llama.cpp: build the
            model GGUF with the rotations appended).
        notes: caveats for this engine and entry.
        ranks: ``{"rank", "kv_heads", "of"}`` per tensor-parallel rank (and per KV-head count of a file
            whose layers differ), when the KV heads are known.
        checks: lines the server's log must show for the rotations to have been read as meant.
    """

    engine: str
    model: str
    tag: str | None
    env: dict[str, str]
    args: list[str]
    files: dict[str, str]
    prepare: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)

    def check(self) -> None:
        """Refuse what cannot be printed into a shell line or an env file safely: variable names
        that are not shell identifiers, and values or arguments holding control characters.

        Raises:
            ServingError: one line naming the bad name or value.
        """
        for k, v in self.env.items():
            if not isinstance(k, str) or not _ENV_NAME.match(k):
                raise ServingError(f"environment variable name {shown(k)} is not a shell identifier ([A-Za-z_][A-Za-z0-9_]*)")
            check_printable(v, k)
        for i, a in enumerate(self.args):
            check_printable(a, f"argument {i}")
        for c in self.prepare:
            for a in c:
                check_printable(a, "preparation argument")

    @property
    def command(self) -> str:
        """The launch as one shell line: ``K=V … argv`` (every value shell-quoted)."""
        self.check()
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.args)

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "model": self.model,
            "tag": self.tag,
            "env": dict(self.env),
            "args": list(self.args),
            "command": self.command,
            "files": dict(self.files),
            "prepare": [shlex.join(c) for c in self.prepare],
            "notes": list(self.notes),
            "ranks": [dict(r) for r in self.ranks],
            "checks": list(self.checks),
        }

    def render(self, fmt: str = "shell") -> str:
        """Text for ``fmt``:

        - ``shell``: copy-pasteable; preparation commands joined with ``&&``, one variable per line;
        - ``env``: ``KEY=VALUE`` lines (values shell-quoted with :func:`shlex.quote` when needed),
          safe to ``set -a; source``: names are shell identifiers, values one line each;
        - ``json``: :meth:`to_json`, indented.

        Every value and argument is quoted with :func:`shlex.quote`; a name that is not a shell
        identifier or a value with a control character is refused (:meth:`check`).
        """
        self.check()
        if fmt == "json":
            return json.dumps(self.to_json(), indent=2)
        if fmt == "env":
            return "\n".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        if fmt == "shell":
            lines = [shlex.join(c) + " && \\" for c in self.prepare]
            lines += [f"{k}={shlex.quote(v)} \\" for k, v in self.env.items()]
            lines.append(shlex.join(self.args))
            return "\n".join(lines)
        raise ServingError(f"unknown output format {shown(fmt)}; expected one of {', '.join(OUTPUT_FORMATS)}")


__all__ = ["OUTPUT_FORMATS", "LaunchSpec", "OutputFormat", "check_printable"]
