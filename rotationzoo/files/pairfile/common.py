"""Helpers shared by the pair-file layouts, and the rules their metadata must follow.

A pair file's metadata is checked before any tensor is read (:func:`check_metadata`): it may only
describe what the tensors say. ``export_format_version`` and each side's ``format_version`` are
plain ASCII decimal ints (or ``identity-v1``), ``model`` is a ``NAMESPACE/NAME`` id and ``tag`` a
tag as a registry spells them, ``sides``, ``layer_ids`` and ``head_dim`` agree with the tensors,
``{side}.sha256`` is 64 lowercase hex digits, and every value is at most :data:`MAX_META_TEXT`
characters (``layer_ids`` excepted). Anything else is refused with one :class:`ExportError` (or
:class:`UnsupportedFormatError`) line naming the file and the key. ``{side}.sha256`` records which
file the side was exported from; nothing trusts it (see :mod:`rotationzoo.files.pair`).
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any, Mapping

from ..limits import MAX_LAYERS, parse_index, safe_repr
from ...errors import ExportError, RegistryError, UnsupportedFormatError
from ...safefile import check_replaceable, replace_with
from ..format import RotationSet
from ...registry.model import SIDES
from ...registry.safety import check_model_id, check_tag

#: Version of the two pair-file layouts.
EXPORT_FORMAT_VERSION = 1
#: Rotation sets by side (``"k"``, ``"v"``).
Sets = Mapping[str, RotationSet]
#: Longest metadata value of a pair file (``layer_ids`` may hold up to 2 × MAX_LAYERS ids).
MAX_META_TEXT = 1024
_MAX_LAYER_IDS_TEXT = 11 * 2 * MAX_LAYERS
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: Layer ids of a pair file: plain decimals below 10⁹.
LAYER_ID = re.compile(r"0|[1-9][0-9]{0,8}")


def sides_of(sets: Mapping[str, Any]) -> tuple[str, ...]:
    """The sides present, in K, V order."""
    return tuple(s for s in SIDES if s in sets)


def parse_version(text: Any) -> int | str:
    """A stored ``format_version`` string back to ``int`` when it is a plain ASCII decimal
    (``"1"`` → ``1``); anything else (``"²"``, ``"1.0"``) is returned as is, for the format check
    to refuse."""
    n = parse_index(text) if isinstance(text, str) else None
    return n if n is not None else text


def check_metadata(meta: Mapping[str, str], layout: Mapping[str, tuple[tuple[int, ...], Any]], name: str) -> None:
    """Refuse metadata that is malformed or says otherwise than the tensors.

    Args:
        meta: the file's metadata (strings), keys as a safetensors pair file spells them.
        layout: ``{side: (layer_ids, head_dims)}`` of the tensors actually in the file (``head_dims`` as
            ``str(HeadDims)``: ``"128"``, or ``"256,5:512"`` when layers differ; an int is accepted).
        name: the file, for messages.

    Raises:
        UnsupportedFormatError: ``export_format_version`` is not a version, or a newer one.
        ExportError: any other value is malformed or disagrees with the tensors.
    """
    for key, value in meta.items():
        cap = _MAX_LAYER_IDS_TEXT if key == "layer_ids" else MAX_META_TEXT
        if not isinstance(value, str) or len(value) > cap:
            raise ExportError(f"{name}: metadata {safe_repr(key)} must be a string of at most {cap} characters, "
                              f"got {safe_repr(value)}")
    _check_export_version(meta.get("export_format_version"), name)
    for key, check in (("model", check_model_id), ("tag", check_tag)):
        if key in meta:
            try:
                check(meta[key], f"metadata {key!r}")
            except RegistryError as exc:
                raise ExportError(f"{name}: {exc}") from None
    for s in SIDES:
        sha = meta.get(f"{s}.sha256")
        if sha is not None and not _SHA256.fullmatch(sha):
            raise ExportError(f"{name}: metadata '{s}.sha256' {safe_repr(sha)} is not 64 lowercase hex digits")
    sides = sides_of(layout)
    if "sides" in meta and meta["sides"] != ",".join(sides):
        raise ExportError(f"{name}: metadata says sides {safe_repr(meta['sides'])}, the tensors hold "
                          f"{','.join(sides) or 'none'}")
    for s in sides:
        ids, d = layout[s]
        if "head_dim" in meta and meta["head_dim"] != str(d):
            raise ExportError(f"{name}: metadata says head_dim {safe_repr(meta['head_dim'])}, the {s.upper()} "
                              f"tensors have head_dim {d}")
        if "layer_ids" in meta and _layer_ids(meta["layer_ids"]) != tuple(ids):
            shown = ",".join(map(str, ids[:8])) + (",…" if len(ids) > 8 else "")
            raise ExportError(f"{name}: metadata says layer_ids {safe_repr(meta['layer_ids'])}, the {s.upper()} "
                              f"tensors hold layers {shown}")


def _layer_ids(text: str) -> tuple[int, ...] | None:
    parts = text.split(",")
    if not all(LAYER_ID.fullmatch(p) for p in parts):
        return None
    return tuple(int(p) for p in parts)


def _check_export_version(value: str | None, name: str) -> None:
    if value is None:
        return
    n = parse_index(value)
    if n is None or n < 1:
        raise UnsupportedFormatError(f"{name}: export_format_version {safe_repr(value)} is not a version "
                                     f"(expected {EXPORT_FORMAT_VERSION})")
    if n > EXPORT_FORMAT_VERSION:
        raise UnsupportedFormatError(f"{name}: written by a newer export format (version {n}); this rotationzoo "
                                     f"reads up to {EXPORT_FORMAT_VERSION}; upgrade rotationzoo (pip install -U rotationzoo)")


class atomic_path:  # noqa: N801 - a context manager used like a function
    """Yield a temp path beside ``target``; renamed onto it when the block succeeds."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self.tmpdir: Path | None = None

    def __enter__(self) -> Path:
        check_replaceable(self.target, what="export output", error=ExportError)
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.tmpdir = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.", dir=self.target.parent))
        return self.tmpdir / self.target.name

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        assert self.tmpdir is not None
        try:
            if exc_type is None:
                replace_with(self.tmpdir / self.target.name, self.target, what="export output", error=ExportError)
        finally:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
