"""Rotation pairs in local files: which files of a folder form a pair, which side a file is, and
verification of files, pair files and folders (used by ``rotationzoo verify``)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from .errors import ExportError, PairError, RotationZooError
from .fit.output import MANIFEST_NAME
from .hashing import read_hashed
from .headdims import HeadDims
from .pairfile import file_kind, read_pair_file
from .registry import SIDES
from .validation import DEFAULT_ATOL, ValidationReport, pair_disagreement, validate, verify_file

#: Suffixes of single-side rotation files.
ROTATION_SUFFIXES: tuple[str, ...] = (".pt", ".pth", ".safetensors")


def infer_side(path: Path | None, objective: str | None) -> str | None:
    """``"k"`` / ``"v"`` from a file name (``k_…``, ``v.…``) or an objective (``qqt…`` / ``sst…``)."""
    if path is not None:
        name = Path(path).name.lower()
        for s in SIDES:
            if name.startswith((f"{s}_", f"{s}.", f"{s}-")):
                return s
    obj = (objective or "").lower()
    if obj.startswith(("qqt", "ktk")) or obj == "identity-k":
        return "k"
    if obj.startswith(("sst", "vtv")) or obj == "identity-v":
        return "v"
    return None


def _manifest(d: Path) -> dict[str, Any]:
    try:
        data = json.loads((d / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _manifest_metadata(d: Path) -> dict[str, str]:
    """What a fitted folder's manifest says about serving the pair: the fitted group size (strings)."""
    out: dict[str, str] = {}
    g = _manifest(d).get("group_size")
    if isinstance(g, int) and not isinstance(g, bool) and g > 0:
        out["group_size"] = str(g)
    return out


def _manifest_files(d: Path) -> dict[str, Path]:
    try:
        named = _manifest(d).get("files") or {}
        picked = {s: d / str(named[s]["name"]) for s in SIDES
                  if isinstance(named.get(s), Mapping) and named[s].get("name")}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}
    return picked if all(p.is_file() for p in picked.values()) else {}


def _pick(d: Path, side: str, files: list[Path]) -> Path | None:
    cands = [f for f in files if f.name.startswith((f"{side}_rotation", f"{side}_perhead"))]
    by_stem: dict[str, Path] = {}
    for f in sorted(cands, key=lambda f: ROTATION_SUFFIXES.index(f.suffix)):
        by_stem.setdefault(f.stem, f)  # the same stem in several formats: copies; prefer .pt
    if len(by_stem) > 1:
        raise ExportError(
            f"{d}: several {side.upper()} rotation files ({', '.join(p.name for p in by_stem.values())}); "
            f"keep one pair in the folder, name them in {MANIFEST_NAME}, or give 'k.pt,v.pt'"
        )
    return next(iter(by_stem.values()), None)


#: Manifests the authors' server writes beside a pair it publishes (start-up calibration):
#: ``.oscar_<pair_id>.pending.json`` while it writes, ``.complete.json`` once done.
PENDING_GLOB, COMPLETE_GLOB = ".oscar_*.pending.json", ".oscar_*.complete.json"


def check_not_pending(folder: Path) -> None:
    """Refuse a folder whose pair the authors' server is still publishing (or was interrupted publishing).

    Raises:
        PairError: a ``.oscar_*.pending.json`` manifest is in ``folder``.
    """
    pending = sorted(folder.glob(PENDING_GLOB)) if folder.is_dir() else []
    if pending:
        raise PairError(f"{folder}: {pending[0].name} is present: a publication of this pair is in progress or was "
                        f"interrupted, so its files may be incomplete; wait for the server (or re-run its calibration) "
                        f"until only a .complete.json remains")


def find_pair_files(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """The rotation files of a folder, by side.

    The manifest's ``files`` names win when they name files that exist. Otherwise each side needs
    exactly one ``{side}_rotation*`` file (``.pt``, ``.pth`` or ``.safetensors``; one stem in
    several formats counts once, ``.pt`` preferred): an ambiguous folder is refused, never guessed.

    Raises:
        ExportError: not a folder, no rotation file, a side missing, or several candidates for a side.
        PairError: the authors' server is publishing the pair (a ``.oscar_*.pending.json`` is there).
    """
    d = Path(directory)
    if not d.is_dir():
        raise ExportError(f"{d}: not a folder")
    check_not_pending(d)
    picked = _manifest_files(d)
    if picked:
        return picked
    files = sorted(f for f in d.iterdir() if f.is_file() and f.suffix in ROTATION_SUFFIXES)
    chosen = {s: p for s in SIDES if (p := _pick(d, s, files)) is not None}
    if not chosen and any(re.fullmatch(r"layer_\d+\.pt", f.name) for f in files):
        raise ExportError(f"{d}: an MLA latent rotation folder (layer_<id>.pt files), not a K/V rotation pair; "
                          f"rotationzoo does not load MLA latent rotations")
    if not chosen:
        names = ", ".join(f.name for f in files[:8]) or "no .pt/.safetensors files"
        raise ExportError(f"{d}: no rotation pair found (expected k_rotation*.pt and v_rotation*.pt; found {names})")
    missing = [s for s in SIDES if s not in chosen]
    if missing:
        have = next(iter(chosen.values()))
        raise ExportError(f"{d}: found {have.name} but no {missing[0]}_rotation*.pt; give the single file instead, "
                          f"or add its partner")
    return chosen


def verify_path(path: str | os.PathLike[str], *, atol: float = DEFAULT_ATOL, layer_ids: Sequence[int] | None = None,
                num_layers: int | None = None, head_dim: int | HeadDims | None = None,
                num_kv_heads: int | None = None) -> list[ValidationReport]:
    """Validation reports of a rotation file: one for a single-side file, one per side for a pair
    file (exported safetensors or GGUF) or a pair folder (found as :func:`find_pair_files` finds it).

    K and V of a pair must agree as ``export`` requires (:func:`~rotationzoo.validation.pair_disagreement`),
    else both reports fail. Never raises for a bad file (the report says why)."""
    p = Path(path)
    expect: dict[str, Any] = dict(atol=atol, layer_ids=layer_ids, num_layers=num_layers, head_dim=head_dim,
                                  num_kv_heads=num_kv_heads)
    if p.is_dir():
        try:
            files = find_pair_files(p)
        except RotationZooError as exc:
            return [ValidationReport(path=str(p), ok=False, problems=[str(exc)])]
        by_side = {s: verify_path(files[s], **expect) for s in SIDES if s in files}
        if all(len(r) == 1 for r in by_side.values()):
            _check_agreement(p, {s: r[0] for s, r in by_side.items()})
        return [r for reps in by_side.values() for r in reps]
    kind = file_kind(p) if p.is_file() else None
    if kind is None:
        return [verify_file(p, **expect)]
    try:
        (sets, _), sha = read_hashed(p, read_pair_file)
    except RotationZooError as exc:
        return [ValidationReport(path=str(p), ok=False, problems=[str(exc)])]
    size = p.stat().st_size
    reports = {}
    for s in SIDES:
        if s in sets:
            rep = validate(sets[s], raise_on_error=False, **expect)
            rep.path, rep.sha256, rep.size = f"{p} [{s}]", sha, size
            reports[s] = rep
    _check_agreement(p, reports)
    return list(reports.values())


def _check_agreement(where: Path, reports: Mapping[str, ValidationReport]) -> None:
    """Fail both reports of a pair whose K and V disagree (only when both could be read)."""
    if len(reports) != 2 or any((r.head_dim is None and r.head_dims is None) or not r.layer_ids
                                for r in reports.values()):
        return
    problem = pair_disagreement(reports["k"], reports["v"])
    if problem is not None:
        for r in reports.values():
            r.problems.append(f"{where}: {problem}")
            r.ok = False
