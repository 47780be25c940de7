"""On-disk layouts of files that hold a whole K/V pair: rotationzoo's safetensors pair file and the
GGUF rotation tensors of the authors' llama.cpp branch.

Readers return ``(sets, metadata)``: ``{"k": RotationSet, "v": RotationSet}`` (one side may be
absent) and the file's metadata as strings; :mod:`rotationzoo.files.pair` wraps them into a
:class:`~rotationzoo.files.pair.RotationPair`, :mod:`rotationzoo.export` calls the writers.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..format import RotationSet
from .common import EXPORT_FORMAT_VERSION, Sets, atomic_path, parse_version, sides_of
from .gguf import is_gguf, read_gguf, write_gguf
from .safetensors import SAFETENSORS_FORMAT, is_pair_safetensors, read_pair_safetensors, write_pair_safetensors


def file_kind(path: Path) -> str | None:
    """``"gguf"``, ``"safetensors"`` (a pair file), or ``None`` when ``path`` is neither."""
    if is_gguf(path):
        return "gguf"
    if is_pair_safetensors(path):
        return "safetensors"
    return None


def read_pair_file(path: str | os.PathLike[str]) -> tuple[dict[str, RotationSet], dict[str, str]]:
    """Read a pair file of either layout (GGUF detected by its magic bytes).

    Raises:
        ExportError: not a pair file, or its tensors are missing or misnamed.
    """
    p = Path(path)
    return read_gguf(p) if p.is_file() and is_gguf(p) else read_pair_safetensors(p)


__all__ = [
    "EXPORT_FORMAT_VERSION",
    "SAFETENSORS_FORMAT",
    "Sets",
    "atomic_path",
    "file_kind",
    "is_gguf",
    "is_pair_safetensors",
    "parse_version",
    "read_gguf",
    "read_pair_file",
    "read_pair_safetensors",
    "sides_of",
    "write_gguf",
    "write_pair_safetensors",
]
