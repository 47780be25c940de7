"""Local preparation of an upload (no network): find, read, validate and hash the pair and manifest."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import (
    InvalidRotationError,
    PairError,
    PublishError,
    RegistryError,
    RotationZooError,
    UnknownModelError,
)
from ..files.format import read_rotation, write_rotation
from ..files.limits import MAX_BYTES
from ..files.rotation_set import grouping_of
from ..files.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, check_manifest_files, read_manifest
from ..files.pair import ROTATION_SUFFIXES, find_pair_files, resolve_pair
from ..files.pairfile import file_kind
from ..files.validation import pair_disagreement, validate
from ..hashing import read_hashed, sha256_file
from ..registry import SIDES, load_registry
from ..registry.safety import MODEL_ID, check_tag
from ..safefile import copy_regular
from ..vocab import Grouping
from .results import UploadFile



@dataclass
class Plan:
    directory: Path
    model_id: str
    model_folder: str
    tag: str
    known_model: Any  # ModelEntry | None
    files: list[UploadFile]
    layer_ids: tuple[int, ...]
    head_dim: int
    objectives: dict[str, str]
    manifest: dict[str, Any] | None
    warnings: list[str] = field(default_factory=list)
    #: ``kv_head`` when either file holds one rotation per KV head, else ``layer`` (the registry's ``grouping``)
    grouping: Grouping = "layer"

    @property
    def folder(self) -> str:
        return f"{self.model_folder}/{self.tag}"

    def pair(self, side: str) -> UploadFile:
        return next(f for f in self.files if f.role == side)


def find_pair(directory: str | os.PathLike[str]) -> tuple[Path, Path, Path | None]:
    """The K file, the V file and the manifest (or None) of a fitter output folder.

    The pair is found by :func:`rotationzoo.files.pair.find_pair_files` (the rule every command uses).

    Raises:
        PublishError: the folder is missing, or the pair is missing or ambiguous.
    """
    d = Path(directory)
    if not d.is_dir():
        raise PublishError(f"{d}: not a folder; give the folder the fitter wrote (rotation files + {MANIFEST_NAME})")
    try:
        files = find_pair_files(d)
    except PairError as exc:
        raise PublishError(f"{exc}; publish needs both the K and the V file") from None
    manifest = d / MANIFEST_NAME
    return files["k"], files["v"], manifest if manifest.is_file() else None


def _resolve_model(model: str) -> tuple[str, Any]:
    """(full model id, ModelEntry or None). Unknown models need a full ``NS/NAME`` id."""
    try:
        known = load_registry(skip_missing_overlays=True).resolve(model)
    except UnknownModelError:
        known = None
    if known is not None:
        return known.id, known
    if not MODEL_ID.match(model.strip()):
        raise PublishError(
            f"unknown model '{model}': for a model that is not in the registry, give its full id "
            f"NAMESPACE/NAME as on the Hugging Face Hub (e.g. Qwen/Qwen3-8B)"
        )
    return model.strip(), None


def check_name(what: str, value: str) -> None:
    """A tag, revision or tag name: one safe path component (the registry's tag rule)."""
    try:
        check_tag(value, what)
    except RegistryError:
        raise PublishError(f"{what} {value!r} must be one path component of letters, digits and . _ + -") from None


def pair_files(rotations: Any, staging: Path | None, fetch: Mapping[str, Any] | None = None
               ) -> tuple[Path, Path, Path | None]:
    """The K file, the V file and the manifest (or None) to publish from anything
    :func:`~rotationzoo.files.pair.resolve_pair` takes: a folder (its manifest too), ``"K.pt,V.pt"``, a
    registry id (fetched and verified with ``fetch``), or a pair file whose sides are first written
    to ``staging`` as ``{k,v}_rotation_<objective>.pt``.

    Raises:
        PublishError: no pair (a side missing, an ambiguous folder), or nothing usable.
    """
    if isinstance(rotations, (str, os.PathLike)) and Path(rotations).expanduser().is_dir():
        return find_pair(Path(rotations).expanduser())
    try:
        pair = resolve_pair(rotations, validate_pair=False, **dict(fetch or {}))
    except PairError as exc:
        raise PublishError(f"{exc}; publish needs both the K and the V file") from None
    missing = [s for s in SIDES if s not in pair.sets]
    if missing:
        raise PublishError(f"{pair.source}: no {missing[0].upper()} rotations; publish needs both the K and the V file")
    paths = {s: pair.paths.get(s) for s in SIDES}
    if all(p is not None and p.suffix in ROTATION_SUFFIXES and file_kind(p) is None for p in paths.values()) \
            and paths["k"] != paths["v"]:
        return paths["k"], paths["v"], None  # type: ignore[return-value]
    if staging is None:
        raise PublishError(f"{pair.source}: a pair file needs a staging folder to write its sides to")
    out = {s: write_rotation(staging / "sides" / f"{s}_rotation_{pair[s].objective}.pt", pair[s]) for s in SIDES}
    return out["k"], out["v"], None


def _stage(source: Path, folder: Path, max_bytes: int, *, what: str,
           error: type[RotationZooError]) -> Path:
    """Copy ``source`` (a regular file of at most ``max_bytes``; a FIFO or a device is refused without
    blocking, see :func:`~rotationzoo.safefile.copy_regular`) into ``folder`` of publish's private staging
    folder, under its own name. The copy is what is read, validated, hashed and uploaded: a source
    changed or a link retargeted afterwards changes nothing that is published.

    Raises:
        error: ``source`` is missing, unreadable, not a regular file or larger than ``max_bytes``.
        PublishError: the staging folder cannot be written.
    """
    copy = folder / source.name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(copy, "xb") as out:
            copy_regular(source, out, max_bytes, what=what, error=error)
    except RotationZooError as exc:
        raise error(f"refusing to publish: {exc}") from None
    except OSError as exc:
        raise PublishError(f"cannot copy {source} into the staging folder {folder} ({exc.strerror or exc}); "
                           f"free space in the temporary folder or point TMPDIR at another one") from None
    return copy


def _named(exc: BaseException, copy: Path, source: Path) -> str:
    """``exc``'s message naming the user's file rather than its staged copy."""
    return str(exc).replace(str(copy), str(source))


def prepare(
    rotations: Any,
    *,
    model: str,
    tag: str,
    safetensors: bool,
    atol: float,
    staging: Path,
    fetch: Mapping[str, Any] | None = None,
) -> Plan:
    """Read, validate and hash everything locally. Raises before any network access (but the fetch of
    a registry id given as ``rotations``).

    Each file (K, V, manifest) is first copied into ``staging/upload/<role>/``; the copies, never the
    sources, are read, validated and hashed (one read each, see :func:`~rotationzoo.hashing.read_hashed`)
    and are what the hubs receive (:attr:`UploadFile.staged`).

    Raises:
        InvalidRotationError: a file is not a valid rotation set (or not a regular file), or K and V disagree.
        PublishError: no pair, a manifest that does not describe the files, or a staging folder that
            cannot be written.
    """
    check_name("tag", tag)
    model_id, known = _resolve_model(model)
    folder = model_id.split("/", 1)[1]
    k_path, v_path, manifest_path = pair_files(rotations, staging, fetch)
    warn: list[str] = []
    arch = known.architecture if known is not None else None
    expected_ids = arch.expected_layer_ids() if arch is not None else None
    sets, copies, hashes = {}, {}, {}
    for side, p in (("k", k_path), ("v", v_path)):
        copy = copies[side] = _stage(p, staging / "upload" / side, MAX_BYTES, what="rotation file",
                                     error=InvalidRotationError)
        try:
            rs, hashes[side] = read_hashed(copy, read_rotation)
        except RotationZooError as exc:
            raise InvalidRotationError(f"refusing to publish: {_named(exc, copy, p)}") from None
        try:
            validate(rs, atol=atol, layer_ids=expected_ids, head_dim=arch.head_dims if arch else None,
                     num_kv_heads=arch.num_kv_heads if arch else None)
        except InvalidRotationError as exc:
            where = f" for {model_id}" if arch is not None else ""
            raise InvalidRotationError(f"refusing to publish {p.name}{where}: {exc}", exc.problems) from None
        sets[side] = rs
    k, v = sets["k"], sets["v"]
    problem = pair_disagreement(k, v)
    if problem is not None:
        raise InvalidRotationError(f"refusing to publish {k_path.name} and {v_path.name}: {problem}", [problem])
    files = [
        UploadFile(side, p, f"{folder}/{tag}/{p.name}", copies[side].stat().st_size, hashes[side], copies[side])
        for side, p in (("k", k_path), ("v", v_path))
    ]
    manifest = None
    if manifest_path is not None:
        m_copy = _stage(manifest_path, staging / "upload" / "manifest", MAX_MANIFEST_BYTES, what="manifest",
                        error=PublishError)
        manifest, m_sha = _check_manifest(m_copy, manifest_path, files, k, model_id, tag, warn)
    if safetensors:
        if k_path.suffix == ".safetensors":
            warn.append("the rotation files are safetensors already; no extra copies made")
        else:
            for side, p in (("k", k_path), ("v", v_path)):
                out = write_rotation(staging / "safetensors" / f"{p.stem}.safetensors", sets[side], fmt="safetensors")
                files.append(UploadFile(f"{side}-safetensors", out, f"{folder}/{tag}/{out.name}",
                                        out.stat().st_size, sha256_file(out), out))
    if manifest_path is not None:
        files.append(UploadFile("manifest", manifest_path, f"{folder}/{tag}/{MANIFEST_NAME}",
                                m_copy.stat().st_size, m_sha, m_copy))
    return Plan(
        directory=k_path.parent, model_id=model_id, model_folder=folder, tag=tag, known_model=known,
        files=files, layer_ids=k.layer_ids, head_dim=k.head_dim,
        objectives={"k": k.objective, "v": v.objective}, manifest=manifest, warnings=warn,
        grouping=grouping_of(k, v),
    )


def _short(ids: Sequence[int]) -> str:
    return ", ".join(map(str, list(ids)[:10])) + (" ..." if len(ids) > 10 else "")


def _check_manifest(copy: Path, path: Path, files: list[UploadFile], rs: Any, model_id: str, tag: str,
                    warn: list[str]) -> tuple[dict[str, Any], str]:
    """The manifest (read from its staged ``copy``; messages name ``path``) and the sha256 of the bytes read.
    It must describe exactly these files; disagreements on names are warnings.

    Raises:
        PublishError: not a JSON object, or it describes other files, another ``head_dim`` or other layers.
    """
    try:
        manifest, sha = read_hashed(copy, lambda c: read_manifest(c, error=PublishError))
    except RotationZooError as exc:
        raise PublishError(_named(exc, copy, path)) from None
    check_manifest_files(manifest, path, {f.role: (f.local.name, f.sha256, f.size) for f in files}, error=PublishError)
    if manifest.get("head_dim") is not None and manifest["head_dim"] != rs.head_dim:
        raise PublishError(f"{path}: head_dim {manifest['head_dim']} but the files have d = {rs.head_dim}")
    ids = manifest.get("layer_ids")
    if ids is not None and [int(i) for i in ids] != list(rs.layer_ids):
        raise PublishError(f"{path}: layer_ids {_short(ids)} but the files cover {_short(rs.layer_ids)}")
    m = manifest.get("model")
    if m and str(m).lower() != model_id.lower() and str(m).split("/")[-1].lower() != model_id.split("/")[-1].lower():
        warn.append(f"{MANIFEST_NAME} names model {m!r}, publishing as {model_id}")
    if manifest.get("tag") and manifest["tag"] != tag:
        warn.append(f"{MANIFEST_NAME} names tag {manifest['tag']!r}, publishing as {tag!r}")
    return manifest, sha
