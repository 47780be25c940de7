"""Helpers shared by the pair-file layouts."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any, Mapping

from ..errors import ExportError
from ..format import RotationSet
from ..registry.model import SIDES

#: Version of the two pair-file layouts.
EXPORT_FORMAT_VERSION = 1
#: Rotation sets by side (``"k"``, ``"v"``).
Sets = Mapping[str, RotationSet]


def sides_of(sets: Mapping[str, Any]) -> tuple[str, ...]:
    """The sides present, in K, V order."""
    return tuple(s for s in SIDES if s in sets)


def parse_version(text: Any) -> int | str:
    """A stored ``format_version`` string back to ``int`` when it is one (``"1"`` → ``1``)."""
    return int(text) if isinstance(text, str) and text.isdigit() else text


class atomic_path:  # noqa: N801 - a context manager used like a function
    """Yield a temp path beside ``target``; renamed onto it when the block succeeds."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self.tmpdir: Path | None = None

    def __enter__(self) -> Path:
        if self.target.is_dir():
            raise ExportError(f"{self.target}: is a folder; give a file name")
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.tmpdir = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.", dir=self.target.parent))
        return self.tmpdir / self.target.name

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        assert self.tmpdir is not None
        try:
            if exc_type is None:
                os.replace(self.tmpdir / self.target.name, self.target)
        finally:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
