"""Files an engine reads that are derived from verified rotations, kept in the cache's ``derived/``
area: the llama.cpp rotations GGUF, and the K and V ``.pt`` files of a pair held in one file (a
safetensors pair file or a rotations GGUF), which the SGLang and vLLM trees read as two paths.

Each is keyed by the sha256 of the bytes the pair was read from (:attr:`RotationPair.sha256`), its
marker records those inputs, and a cached copy is served only when its bytes match the marker and
it reads back as exactly the pair's rotations; otherwise it is written again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import RotationZooError, ServingError
from ..export import export_gguf
from .format import read_rotation, write_rotation
from ..hub import derived_hit, derived_path, record_derived, writing_derived
from .pair import RotationPair

ROTATIONS_GGUF_NAME = "oscar-rot-kv.gguf"
#: names of the two files derived from a one-file pair (the authors' V1 stem, any layout inside)
ROTATION_FILE_NAMES = {"k": "k_rotation.pt", "v": "v_rotation.pt"}


def rotations_gguf_path(pair: RotationPair, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the rotations GGUF of ``pair`` is kept: the cache's derived area, under the entry (or,
    for local files, under an id made from the sha256 of the bytes they were read from)."""
    return derived_path(ROTATIONS_GGUF_NAME, entry=pair.entry, inputs=pair.sha256, cache_dir=cache_dir)


def _inputs(pair: RotationPair, what: str) -> dict[str, str]:
    if not all(pair.sha256.get(s) for s in ("k", "v")):
        raise ServingError(f"{pair.source}: {what} needs both rotation files with known sha256")
    return {s: pair.sha256[s] for s in ("k", "v")}


def ensure_rotations_gguf(pair: RotationPair, *, cache_dir: str | os.PathLike[str] | None = None,
                          force: bool = False) -> Path:
    """The rotations GGUF of ``pair`` in the derived area, exported unless one is already there that
    was built from the same bytes (its marker records the sha256 of the K and V files read,
    :attr:`RotationPair.sha256`) and holds exactly ``pair``'s rotations (read back and compared).

    Raises:
        ServingError: the pair has no K or V file read from disk, or the GGUF just written does
            not hold its rotations.
    """
    inputs = _inputs(pair, "the llama.cpp launch")
    out = rotations_gguf_path(pair, cache_dir)
    if not force and derived_hit(out, inputs) and _gguf_holds(out, pair):  # read only: a read-only cache serves it
        return out
    with writing_derived(out, cache_dir):  # a cache verify meanwhile waits, never sees it without its marker
        if not force and derived_hit(out, inputs) and _gguf_holds(out, pair):  # another process wrote it meanwhile
            return out
        export_gguf(pair, out)
        if not _gguf_holds(out, pair):
            raise ServingError(f"{out}: the rotations GGUF just written does not read back as {pair.source}; "
                               "check the disk and the cache (rotationzoo cache verify)")
        record_derived(out, inputs=inputs, entry=pair.entry)
    return out


def ensure_rotation_files(pair: RotationPair, *, cache_dir: str | os.PathLike[str] | None = None,
                          force: bool = False) -> dict[str, Path]:
    """A K and a V rotation file of ``pair``: its own when they are two files, else (a pair held in
    one file) two ``.pt`` files written in the authors' layout of what each side holds
    (:func:`~rotationzoo.files.format.write_rotation`) into the derived area, reused while their bytes
    match their markers and they read back as the pair's rotations.

    Raises:
        ServingError: the pair was not read from files, or a file just written does not read back as
            its side.
    """
    paths = {s: pair.paths.get(s) for s in ("k", "v")}
    if paths["k"] is not None and paths["v"] is not None and Path(paths["k"]) != Path(paths["v"]):
        return {s: Path(p) for s, p in paths.items() if p is not None}
    inputs = _inputs(pair, "a launch from a one-file pair")
    out = {s: derived_path(name, entry=pair.entry, inputs=inputs, cache_dir=cache_dir)
           for s, name in ROTATION_FILE_NAMES.items()}
    if not force and all(derived_hit(p, inputs) and _pt_holds(p, pair, s) for s, p in out.items()):
        return out  # read only: a read-only cache serves them
    with writing_derived(out["k"], cache_dir):  # one folder for both (made from the same inputs)
        for s, p in out.items():
            if not force and derived_hit(p, inputs) and _pt_holds(p, pair, s):
                continue
            write_rotation(p, pair[s], fmt="pt")
            if not _pt_holds(p, pair, s):
                raise ServingError(f"{p}: the {s.upper()} file just written does not read back as {pair.source}; "
                                   "check the disk and the cache (rotationzoo cache verify)")
            record_derived(p, inputs=inputs, entry=pair.entry)
    return out


def _pt_holds(path: Path, pair: RotationPair, side: str) -> bool:
    """Whether the ``.pt`` file at ``path`` holds exactly ``pair``'s ``side`` (rotations, layer ids
    and companions, as written: fp32)."""
    import torch

    try:
        got = read_rotation(path)
    except RotationZooError:
        return False
    want = pair[side]
    if got.layer_ids != want.layer_ids:
        return False
    for name in ("rotations", "eigenvalues", "k_mean", "v_mean", "q_rotation", "o_rotation"):
        a, b = getattr(got, name), getattr(want, name)
        if (a is None) != (b is None):
            return False
        if a is not None and not all(x.shape == y.shape and torch.equal(x, y.detach().to("cpu", torch.float32))
                                     for x, y in zip(a, b)):
            return False
    return True


def _gguf_holds(path: Path, pair: RotationPair) -> bool:
    """Whether the GGUF at ``path`` holds exactly ``pair``'s K and V rotations (as exported: fp32)."""
    import torch

    from .pairfile import read_gguf

    try:
        sets, _ = read_gguf(path)
    except RotationZooError:
        return False
    def layers(rot: Any) -> list[Any]:
        return list(rot) if isinstance(rot, tuple) else list(rot.unbind(0))

    return sets.keys() == {"k", "v"} and all(
        sets[s].layer_ids == rs.layer_ids
        and all(a.shape == b.shape and torch.equal(a, b.detach().to("cpu", torch.float64).to(torch.float32))
                for a, b in zip(layers(sets[s].rotations), layers(rs.rotations)))
        for s, rs in pair)


__all__ = ["ROTATIONS_GGUF_NAME", "ROTATION_FILE_NAMES", "ensure_rotation_files", "ensure_rotations_gguf",
           "rotations_gguf_path"]
