"""Export rotation pairs to one safetensors file or to GGUF (for the authors' llama.cpp branch).

Both layouts hold the K and the V side of a model in one file; they are described in
:mod:`rotationzoo.files.pairfile.safetensors` and :mod:`rotationzoo.files.pairfile.gguf` and in
``docs/export.md``. Every function takes any source :func:`~rotationzoo.files.pair.resolve_pair`
accepts (a folder, ``k.pt,v.pt``, one rotation file, an exported file, ``MODEL[@TAG]``, a
:class:`~rotationzoo.files.pair.RotationPair`), validates it, and writes atomically. The readers return
a :class:`~rotationzoo.files.pair.RotationPair` (``read_exported(p).k.rotations`` is ``M``, never
transposed), and ``rotationzoo verify`` reads exported files too.

Example::

    from rotationzoo.export import export_gguf, export_safetensors, read_exported
    export_safetensors("Qwen3-8B", "qwen3-8b-oscar.safetensors")
    export_gguf("Qwen3-8B", "qwen3-8b-rot.gguf")
    export_gguf("Qwen3-8B", "qwen3-8b-q4_k_m-rot-kv.gguf", base_gguf="qwen3-8b-q4_k_m.gguf")
    back = read_exported("qwen3-8b-rot.gguf")          # back.k.rotations [36, 128, 128]
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .errors import ExportError
from .safefile import check_not_input, check_output_path
from .files.pair import RotationPair, read_pair, resolve_pair
from .files.pairfile import EXPORT_FORMAT_VERSION, file_kind, is_gguf, write_gguf, write_pair_safetensors
from .files.pairfile.gguf import GGUF_KEY_PREFIX, GGUF_TENSOR
from .files.pairfile.safetensors import SAFETENSORS_FORMAT, pair_metadata
from .vocab import EXPORT_FORMATS


def _resolve(rotations: Any, tag: str | None, side: str | None, fetch: dict[str, Any], out: Any,
             base_gguf: Any = None) -> RotationPair:
    """The pair to export, after refusing an output that cannot be written or that is what the export reads:
    the pair's file or folder and the base GGUF as given (before anything is fetched or read), then the
    files the pair was read from (a registry id's cached or bundled files, and their folder)."""
    check_output_path(Path(out).expanduser(), what="export output", error=ExportError)
    inputs = [part for part in str(rotations).split(",")] if isinstance(rotations, (str, os.PathLike)) else []
    check_not_input(out, inputs + ([base_gguf] if base_gguf is not None else []), what="export output",
                    error=ExportError)
    pair = resolve_pair(rotations, tag, side=side, **fetch)
    check_not_input(out, pair_inputs(pair), what="export output", error=ExportError)
    return pair


def pair_inputs(pair: RotationPair) -> list[Path]:
    """What an output must never be written over or into, beyond the names given: the files ``pair`` was
    read from and, for a registry entry, their folder (the entry's folder in the cache, or the package's
    data folder)."""
    paths = list(pair.paths.values())
    if pair.entry is not None:
        paths += [p.parent for p in paths]
    return paths


def export_safetensors(
    rotations: Any,
    out: str | os.PathLike[str],
    *,
    tag: str | None = None,
    side: str | None = None,
    source: str = "auto",
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    offline: bool | None = None,
    timeout: float | None = None,
) -> Path:
    """Write K and V rotations (eigenvalues and companions too) into one safetensors file, atomically.

    Args:
        rotations: what to export (anything :func:`~rotationzoo.files.pair.resolve_pair` accepts).
        out: destination file.
        tag: calibration tag for a registry model.
        side: ``"k"`` or ``"v"``: export only that side (or name the side of a single file).
        source, revision, cache_dir, offline, timeout: the fetch options of a registry id (see
            :func:`rotationzoo.fetch`).

    Returns:
        The path written: tensors ``{k,v}.<layer>.rotation`` fp32 (``[d, d]`` or ``[H_kv, d, d]``), their
        eigenvalues and companions, string metadata (model, tag, objectives, sha256).
    """
    pair = _resolve(rotations, tag, side, dict(source=source, revision=revision, cache_dir=cache_dir,
                                               offline=offline, timeout=timeout), out)
    p = Path(out).expanduser()
    meta = pair_metadata(pair.sets, model=pair.model, tag=pair.tag, sha256=pair.sha256)
    return write_pair_safetensors(pair.sets, meta, p)


def export_gguf(
    rotations: Any,
    out: str | os.PathLike[str],
    *,
    tag: str | None = None,
    side: str | None = None,
    base_gguf: str | os.PathLike[str] | None = None,
    source: str = "auto",
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    offline: bool | None = None,
    timeout: float | None = None,
) -> Path:
    """Write rotations as GGUF tensors ``blk.{i}.attn_{k,v}_rot.weight`` holding ``Mᵀ`` (F32).

    Args:
        rotations, tag, side, source, revision, cache_dir, offline, timeout: see :func:`export_safetensors`.
        out: destination file (written atomically).
        base_gguf: a model GGUF to copy through: every key and tensor of it is kept byte for byte
            and the rotation tensors are appended (replacing any already there), giving the
            ``*-rot-kv.gguf`` the llama.cpp branch loads. Its ``{arch}.block_count`` must cover
            the layer ids and its head size must equal ``d``.

    Returns:
        The path written.
    """
    pair = _resolve(rotations, tag, side, dict(source=source, revision=revision, cache_dir=cache_dir,
                                               offline=offline, timeout=timeout), out, base_gguf)
    base = Path(base_gguf).expanduser() if base_gguf is not None else None
    return write_gguf(pair.sets, Path(out).expanduser(), model=pair.model, tag=pair.tag, sha256=pair.sha256,
                      base_gguf=base)


def export(
    rotations: Any,
    out: str | os.PathLike[str],
    *,
    to: str,
    tag: str | None = None,
    side: str | None = None,
    base_gguf: str | os.PathLike[str] | None = None,
    source: str = "auto",
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    offline: bool | None = None,
    timeout: float | None = None,
) -> Path:
    """Export to ``to`` = ``"safetensors"`` or ``"gguf"``; see :func:`export_safetensors`, :func:`export_gguf`."""
    fetch: dict[str, Any] = dict(source=source, revision=revision, cache_dir=cache_dir, offline=offline,
                                 timeout=timeout)
    if to == "safetensors":
        if base_gguf is not None:
            raise ExportError("base_gguf applies to GGUF exports only")
        return export_safetensors(rotations, out, tag=tag, side=side, **fetch)
    if to == "gguf":
        return export_gguf(rotations, out, tag=tag, side=side, base_gguf=base_gguf, **fetch)
    raise ExportError(f"unknown export format {to!r}; expected one of {', '.join(EXPORT_FORMATS)}")


def read_exported(path: str | os.PathLike[str]) -> RotationPair:
    """Read an exported file of either format (GGUF detected by its magic bytes).

    Raises:
        ExportError: not an exported file, or its tensors are missing or misnamed.
    """
    p = Path(path)
    if not p.is_file():
        raise ExportError(f"{p}: no such file")
    if file_kind(p) is None:
        raise ExportError(f"{p}: not an exported rotations file (safetensors pair file or GGUF)")
    return read_pair(p)


def read_exported_safetensors(path: str | os.PathLike[str]) -> RotationPair:
    """Read a file written by :func:`export_safetensors` (see :func:`read_exported`)."""
    p = Path(path)
    if p.is_file() and is_gguf(p):
        raise ExportError(f"{p}: a GGUF file, not safetensors; use read_exported_gguf")
    return read_exported(p)


def read_exported_gguf(path: str | os.PathLike[str]) -> RotationPair:
    """Read ``blk.{i}.attn_{k,v}_rot.weight`` tensors of a GGUF file (transposed back to ``M``).

    Works on rotations-only files, on model GGUFs with rotations appended, and on files written by
    other exporters with the same tensor names (objective then ``"unknown"``).
    """
    p = Path(path)
    if not p.is_file():
        raise ExportError(f"{p}: no such file")
    if not is_gguf(p):
        raise ExportError(f"{p}: not a GGUF file (no GGUF magic)")
    return read_pair(p)


__all__ = [
    "EXPORT_FORMATS",
    "EXPORT_FORMAT_VERSION",
    "GGUF_KEY_PREFIX",
    "GGUF_TENSOR",
    "SAFETENSORS_FORMAT",
    "ExportError",
    "export",
    "export_gguf",
    "export_safetensors",
    "read_exported",
    "read_exported_gguf",
    "read_exported_safetensors",
]
