"""The ``rotationzoo.json`` manifest a fit writes beside its rotation files: its name, reading and writing.

The fitter builds the content (:func:`rotationzoo.fit.build_manifest`: files with their sha256, the
calibration, the recipe, the INT2-KV settings to serve them with); this module owns the file itself:

- :func:`read_manifest`: a regular file of at most :data:`MAX_MANIFEST_BYTES`, one JSON object, or a
  typed error (``publish`` reads it this way);
- :func:`folder_manifest`: the same, but ``{}`` when a folder has none or it is unreadable (the pair
  resolver treats the manifest as a hint: the files decide);
- :func:`manifest_files`, :func:`manifest_metadata`: the file names it lists and what it says about
  serving (group size, ``int2kv`` block);
- :func:`check_manifest_files`: the files it lists must be exactly the ones given (name, sha256, size);
- :func:`write_manifest`: atomic write.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from ..errors import PairError, RotationZooError
from ..safefile import read_regular, write_text_atomic
from ..vocab import SIDES

#: Manifest written next to the rotation files.
MANIFEST_NAME = "rotationzoo.json"
#: Version of the manifest's layout (its ``manifest_version``).
MANIFEST_VERSION = 1
#: Largest manifest read.
MAX_MANIFEST_BYTES = 4 << 20


def read_manifest(path: str | os.PathLike[str], *, error: type[RotationZooError] = PairError) -> dict[str, Any]:
    """The manifest at ``path`` (a file, or a folder holding :data:`MANIFEST_NAME`) as a dict.

    Raises:
        error: not a regular file of at most :data:`MAX_MANIFEST_BYTES` (a FIFO is never opened), not
            JSON, or not a JSON object.
    """
    p = Path(path)
    if p.is_dir():
        p = p / MANIFEST_NAME
    try:
        data = json.loads(read_regular(p, MAX_MANIFEST_BYTES, what="manifest", error=error).decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise error(f"{p}: not valid JSON ({exc}); fix or remove the manifest") from None
    if not isinstance(data, dict):
        raise error(f"{p}: expected a JSON object")
    return data


def folder_manifest(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """A folder's manifest, or ``{}`` when it is absent, unreadable or not a JSON object."""
    try:
        return read_manifest(Path(folder) / MANIFEST_NAME)
    except (OSError, RotationZooError):
        return {}


def manifest_metadata(folder: str | os.PathLike[str]) -> dict[str, str]:
    """What a fitted folder's manifest says about serving the pair (strings): the fitted group size
    and the recorded ``int2kv`` block (JSON text; checked when it is used)."""
    out: dict[str, str] = {}
    manifest = folder_manifest(folder)
    g = manifest.get("group_size")
    if isinstance(g, int) and not isinstance(g, bool) and g > 0:
        out["group_size"] = str(g)
    if isinstance(manifest.get("int2kv"), Mapping):
        out["int2kv"] = json.dumps(manifest["int2kv"], sort_keys=True)
    return out


#: Suffixes of single-side rotation files (what a manifest may name).
ROTATION_SUFFIXES: tuple[str, ...] = (".pt", ".pth", ".safetensors")


def check_file_name(folder: Path, side: str, name: str) -> None:
    """A name the manifest gives a side must be one plain, visible rotation file name of the folder.

    Raises:
        PairError: a path (a separator, ``..``, absolute), a hidden name, or a name that is not a
            ``.pt`` / ``.pth`` / ``.safetensors`` file: a manifest never reaches outside its folder.
    """
    if (not name or "/" in name or "\\" in name or "\0" in name or name.startswith(".")
            or not name.endswith(ROTATION_SUFFIXES) or len(name) > 255):
        raise PairError(f"{folder / MANIFEST_NAME}: files.{side}.name {name[:80]!r} is not a rotation file name in "
                        f"the folder (expected a plain name ending in {', '.join(ROTATION_SUFFIXES)}, no path); fix the "
                        f"manifest or remove it")


def manifest_files(folder: str | os.PathLike[str]) -> dict[str, Path]:
    """The K and V files the manifest names, by side, when every one it names exists (else ``{}``).

    Raises:
        PairError: a name that is not a plain rotation file name of the folder (:func:`check_file_name`),
            or K and V named alike.
    """
    d = Path(folder)
    try:
        named = folder_manifest(d).get("files") or {}
        names = {s: named[s]["name"] for s in SIDES if isinstance(named.get(s), Mapping) and named[s].get("name")}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}
    for s, name in names.items():
        check_file_name(d, s, name if isinstance(name, str) else "")
    if len(names) == 2 and names["k"] == names["v"]:
        raise PairError(f"{d / MANIFEST_NAME}: K and V are both named {names['k']!r}; fix the manifest or remove it")
    picked = {s: d / name for s, name in names.items()}
    return picked if all(p.is_file() for p in picked.values()) else {}


def check_manifest_files(manifest: Mapping[str, Any], path: Path, files: Mapping[str, tuple[str, str, int]], *,
                         error: type[RotationZooError] = PairError) -> None:
    """The manifest must describe exactly ``files`` (``{side: (name, sha256, size)}``).

    Raises:
        error: a side it does not list, another name, another sha256 (the file changed after fitting) or size.
    """
    listed = manifest.get("files") or {}
    for role, (name, sha256, size) in files.items():
        entry = listed.get(role) if isinstance(listed, Mapping) else None
        if not isinstance(entry, Mapping):
            raise error(f"{path}: no files.{role} entry; the manifest does not describe {name}")
        if entry.get("name") not in (None, name):
            raise error(f"{path}: files.{role}.name is {entry.get('name')!r} but the {role.upper()} file is {name}")
        if entry.get("sha256") != sha256:
            raise error(f"{path}: files.{role}.sha256 is {entry.get('sha256')} but {name} has sha256 {sha256}; "
                        f"the file changed after fitting (re-run the fitter, or fix the manifest)")
        if entry.get("size") is not None and entry.get("size") != size:
            raise error(f"{path}: files.{role}.size is {entry.get('size')} but {name} has {size} B")


def write_manifest(folder: str | os.PathLike[str], manifest: Mapping[str, Any]) -> Path:
    """Write ``manifest`` as ``folder/rotationzoo.json`` atomically (indented JSON); its path."""
    return write_text_atomic(Path(folder) / MANIFEST_NAME, json.dumps(manifest, indent=2, default=str) + "\n")


__all__ = ["MANIFEST_NAME", "MANIFEST_VERSION", "MAX_MANIFEST_BYTES", "ROTATION_SUFFIXES", "check_file_name",
           "check_manifest_files", "folder_manifest", "manifest_files", "manifest_metadata", "read_manifest", "write_manifest"]
