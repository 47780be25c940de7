"""Rotation pairs in local files: which files of a folder form a pair, which side a file is, and
verification of files, pair files and folders (used by ``rotationzoo verify``)."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import PairError, RotationZooError
from ..hashing import read_hashed
from ..headdims import HeadDims
from .manifest import MANIFEST_NAME, ROTATION_SUFFIXES, manifest_files
from .pairfile import file_kind, read_pair_file
from ..registry import SIDES
from ..safefile import file_kind as mode_kind
from .validation import DEFAULT_ATOL, ValidationReport, pair_disagreement, validate, verify_file

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


def _pick(d: Path, side: str, files: list[Path]) -> Path | None:
    cands = [f for f in files if f.name.startswith((f"{side}_rotation", f"{side}_perhead"))]
    by_stem: dict[str, Path] = {}
    for f in sorted(cands, key=lambda f: ROTATION_SUFFIXES.index(f.suffix)):
        by_stem.setdefault(f.stem, f)  # the same stem in several formats: copies; prefer .pt
    if len(by_stem) > 1:
        raise PairError(
            f"{d}: several {side.upper()} rotation files ({', '.join(p.name for p in by_stem.values())}); "
            f"keep one pair in the folder, name them in {MANIFEST_NAME}, or give 'k.pt,v.pt'"
        )
    return next(iter(by_stem.values()), None)


def _kind(path: Path) -> str:
    """What ``path`` is, in words (``"a FIFO"``, ``"a link to a character device"``, ``"a broken link"``)."""
    try:
        st = path.lstat()
        if not stat.S_ISLNK(st.st_mode):
            return mode_kind(st.st_mode)
        return f"a link to {mode_kind(path.stat().st_mode)}"
    except OSError:
        return "a broken link"


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
        PairError: not a folder, no rotation file, a side missing, or several candidates for a side.
        PairError: the authors' server is publishing the pair (a ``.oscar_*.pending.json`` is there).
    """
    d = Path(directory)
    if not d.is_dir():
        raise PairError(f"{d}: not a folder")
    check_not_pending(d)
    picked = manifest_files(d)
    if picked:
        return picked
    entries = sorted(f for f in d.iterdir() if f.suffix in ROTATION_SUFFIXES)
    files = [f for f in entries if f.is_file()]
    chosen = {s: p for s in SIDES if (p := _pick(d, s, files)) is not None}
    for s in SIDES:  # a side named only by a FIFO, a device or a link to one: say so, not "no such file"
        odd = _pick(d, s, [f for f in entries if not f.is_file()]) if s not in chosen else None
        if odd is not None:
            raise PairError(f"{odd}: the {s.upper()} rotation file is {_kind(odd)}, not a regular file; a rotation "
                            f"file must be a regular file")
    if not chosen and any(re.fullmatch(r"layer_\d+\.pt", f.name) for f in files):
        raise PairError(f"{d}: an MLA latent rotation folder (layer_<id>.pt files), not a K/V rotation pair; "
                        f"check it with `rotationzoo verify {d}` and load it with rotationzoo.load_latent")
    if not chosen:
        names = ", ".join(f.name for f in files[:8]) or "no .pt/.safetensors files"
        raise PairError(f"{d}: no rotation pair found (expected k_rotation*.pt and v_rotation*.pt; found {names})")
    missing = [s for s in SIDES if s not in chosen]
    if missing:
        have = next(iter(chosen.values()))
        raise PairError(f"{d}: found {have.name} but no {missing[0]}_rotation*.pt; give the single file instead, "
                          f"or add its partner")
    return chosen


def verify_path(path: str | os.PathLike[str], *, atol: float = DEFAULT_ATOL, layer_ids: Sequence[int] | None = None,
                num_layers: int | None = None, head_dim: int | str | HeadDims | None = None,
                num_kv_heads: int | None = None, model: str | None = None,
                fetch: Mapping[str, Any] | None = None) -> list[ValidationReport]:
    """Validation reports of what names rotations: one for a single-side file, one per side for a pair
    file (exported safetensors or GGUF), a pair folder (found as :func:`find_pair_files` finds it),
    ``"K.pt,V.pt"``, or a registry id ``MODEL[@TAG]`` (fetched with the ``fetch`` options — ``source``,
    ``revision``, ``cache_dir``, ``offline``, ``timeout`` — and checked against the model's layers,
    head_dims and KV heads unless others are given).

    ``model`` (``MODEL[@TAG]``, as ``verify --model``) takes the layer ids, KV heads and head_dims not given from
    that registry model's architecture (an MLA latent set's: its latent layers and rank).

    K and V of a pair must agree as ``export`` requires (:func:`~rotationzoo.files.validation.pair_disagreement`),
    else both reports fail. Never raises for a bad file (the report says why).

    Raises:
        ConfigError, UnknownModelError: ``model`` is no registry model, or names a tag it does not have.
    """
    head_dim = HeadDims.of(head_dim)  # an int, a spec as --head-dim takes it ("256,5:512"), or HeadDims
    if model is not None:
        ids, heads, dims = model_expectations(model)
        layer_ids = layer_ids if layer_ids is not None else ids
        num_kv_heads = num_kv_heads if num_kv_heads is not None else heads
        head_dim = head_dim if head_dim is not None else dims
    text = os.fspath(path)
    p = Path(text).expanduser()
    expect: dict[str, Any] = dict(atol=atol, layer_ids=layer_ids, num_layers=num_layers, head_dim=head_dim,
                                  num_kv_heads=num_kv_heads)
    if not p.exists() and "," in text:
        parts = [Path(x.strip()).expanduser() for x in text.split(",")]
        if len(parts) != 2:
            return [ValidationReport(path=text, ok=False, problems=[f"{text}: expected 'K_FILE,V_FILE'"])]
        pair = {s: verify_path(q, **expect) for s, q in zip(SIDES, parts)}
        if all(len(r) == 1 for r in pair.values()):
            _check_agreement(Path(text), {s: r[0] for s, r in pair.items()})
        return [r for reps in pair.values() for r in reps]
    if not p.exists() and _registry_id(text):
        if _latent_id(text):
            from ..mla import verify_latent

            return [verify_latent(text, atol=atol, fetch=dict(fetch or {}))]
        return _verify_registered(text, expect, dict(fetch or {}))
    if p.is_dir() and _is_latent(p):
        from ..mla import verify_latent

        dims = HeadDims.of(head_dim)
        return [verify_latent(p, layer_ids=layer_ids, num_layers=num_layers, atol=atol,
                              rank=dims.default if dims is not None else None)]
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


def _is_latent(folder: Path) -> bool:
    """A folder of ``layer_<id>.pt`` latent rotation files and no K/V rotation files."""
    from .latent import is_latent_folder

    return is_latent_folder(folder) and not any(folder.glob("[kv]_rotation*"))


def _latent_id(text: str) -> bool:
    from ..mla import latent_model

    try:
        return latent_model(text) is not None
    except RotationZooError:
        return True  # a tag other than the set's: verify_latent says so


def _registry_id(text: str) -> bool:
    from ..registry import load_registry, split_model_tag

    try:
        load_registry().resolve(split_model_tag(text)[0])
    except RotationZooError:
        return False
    return True


def model_expectations(model: str) -> tuple[tuple[int, ...] | None, int | None, HeadDims | None]:
    """``(layer ids, KV heads, head_dims)`` that files for registry model ``MODEL[@TAG]`` must have (an MLA latent
    set's: its latent layer ids and ``HeadDims(rank)``, no KV heads).

    Raises:
        ConfigError: a latent model named with a tag other than its set's; UnknownModelError / UnknownTagError.
    """
    from ..errors import ConfigError
    from ..registry import get_model, split_model_tag

    name, at_tag = split_model_tag(model)  # MODEL@TAG: that tag's architecture
    m = get_model(name)
    if m.mla_latent is not None:
        if at_tag is not None and at_tag != m.mla_latent.name:
            raise ConfigError(f"{model}: {m.id} has one latent set, {m.mla_latent.name!r}, not {at_tag!r}; give "
                              f"{m.id}")
        ids = m.mla_latent.expected_layer_ids
        return (tuple(ids) if ids is not None else None), None, HeadDims(m.mla_latent.rank)
    return _arch_expectations(m.tag(at_tag).architecture)


def _arch_expectations(arch: Any) -> tuple[tuple[int, ...] | None, int | None, HeadDims | None]:
    """``(layer ids, KV heads, head_dims)`` of a registry ``Architecture``."""
    ids = arch.expected_layer_ids()
    return (tuple(ids) if ids is not None else None), arch.num_kv_heads, arch.head_dims


def _verify_registered(text: str, expect: dict[str, Any], fetch: dict[str, Any]) -> list[ValidationReport]:
    """Fetch (if needed) a registry entry's files and verify them against the model (or ``expect``)."""
    from ..hub import fetch_entry
    from ..registry import get_entry, split_model_tag

    try:
        name, tag = split_model_tag(text)
        entry = get_entry(name, tag)
        got = fetch_entry(entry, **fetch)
    except RotationZooError as exc:
        return [ValidationReport(path=text, ok=False, problems=[str(exc)])]
    ids, heads, dims = _arch_expectations(entry.architecture)
    model_expect: dict[str, Any] = dict(layer_ids=ids, head_dim=dims, num_kv_heads=heads)
    merged: dict[str, Any] = {k: (v if v is not None else model_expect.get(k)) for k, v in expect.items()}
    merged.update({k: v for k, v in model_expect.items() if merged.get(k) is None})
    reports = {s: verify_file(got.files[s].path, **merged) for s in SIDES}
    _check_agreement(Path(text), reports)
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
