"""Writing a fit: the rotation files (the authors' names and schema) and the ``rotationzoo.json`` manifest."""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .._version import __version__
from ..errors import FitError
from ..files.format import write_rotation
from ..files.manifest import (  # noqa: F401  (MANIFEST_NAME re-exported)
    MANIFEST_NAME,
    MANIFEST_VERSION,
    read_manifest,
    write_manifest,
)
from ..errors import RotationZooError
from ..hashing import sha256_file
from ..int2kv import Int2KVConfig
from ..files.validation import validate
from ..vocab import FILE_FORMATS
from ..recipe import RECIPES
from ..safefile import check_writable_parent, replace_with
from .recipes import file_marker
from .result import FitResult



def output_file_names(result: FitResult, *, fmt: str = "pt") -> dict[str, str]:
    """The authors' file names: ``{"k": "k_rotation_qqt_r_h_pbr.pt", "v": "v_rotation_sst_r_h_pbr.pt"}``.

    ``hadamard`` gives ``k_rotation_hadamard.pt`` / ``v_rotation_hadamard.pt``; ``fmt="safetensors"``
    swaps the suffix. A form other than the objective's own carries a marker (:func:`~.recipes.file_marker`):
    ``k_rotation_qqt_r_h_pbr-kv_head.pt`` (per KV head), ``k_rotation_oscar2_center-shared.pt`` (a recipe
    with one rotation per layer), ``k_rotation_oscar2_center-center_kv.pt`` (values centered too).
    """
    suffix = ".safetensors" if fmt == "safetensors" else ".pt"
    marker = file_marker(result.objective, result.grouping, result.center)
    names = {}
    for side in ("k", "v"):
        if getattr(result, side) is not None:  # a recipe's pair is named for the recipe, as the authors name it
            stem = result.objective if result.objective in RECIPES else result.side_objective(side)
            names[side] = f"{side}_rotation_{stem}{marker}{suffix}"
    return names


@dataclass
class FitOutput:
    """Files written by :func:`write_fitted`.

    Attributes:
        paths: ``{"k": Path, "v": Path}`` of the rotation files.
        manifest_path: the ``rotationzoo.json`` path.
        manifest: its content.
    """

    paths: dict[str, Path]
    manifest_path: Path
    manifest: dict[str, Any]


def build_manifest(result: FitResult, files: Mapping[str, Mapping[str, Any]], *, model: str | None, tag: str | None,
                   prompts: int | None, int2kv: Int2KVConfig | None, fmt: str) -> dict[str, Any]:
    """The ``rotationzoo.json`` manifest of written ``files`` (name, objective, sha256, size per side)
    and, as ``int2kv``, the INT2-KV settings to serve them with (``int2kv`` or the result's)."""
    config = int2kv if int2kv is not None else result.serving_config()
    return {
        "manifest_version": MANIFEST_VERSION,
        "model": model if model is not None else result.model,
        "tag": tag,
        "tokens": result.token_count,
        "prompts": prompts if prompts is not None else result.prompts,
        "head_dim": result.head_dim,
        "num_layers": len(result.layer_ids),
        "layer_ids": list(result.layer_ids),
        "num_q_heads": result.num_q_heads,
        "num_kv_heads": result.num_kv_heads,
        "objective": result.objective,
        "objectives": {side: files[side]["objective"] for side in files},
        "composition": result.composition_label,
        "grouping": result.grouping,
        "center": result.center,
        "group_size": result.group_size,
        "signs": result.signs,
        "keep_first_chunk": result.keep_first_chunk,
        "int2kv": config.to_json(),
        "format": fmt,
        "format_version": max((int(f.get("format_version", 1)) for f in files.values()), default=1),
        "source": result.source,
        "library": {"name": "rotationzoo", "version": __version__},
        "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "files": dict(files),
    }


def check_output_folder(out_dir: str | os.PathLike[str], *, what: str = "output folder") -> Path:
    """Refuse, before a long fit or capture, an output folder :func:`write_fitted` could not write: a path that
    exists and is not a folder (a file, a link to nothing), a folder this process cannot write, or a new
    folder whose nearest existing parent is not a writable folder (the counterpart for folders of
    :func:`rotationzoo.safefile.check_output_path`).

    Returns:
        The path.

    Raises:
        FitError: one line naming the path and what to do.
    """
    p = Path(out_dir)
    if p.is_symlink() and not p.exists():
        raise FitError(f"{what} {p} is a link to nothing; give a folder (new or existing)")
    if p.exists():
        if not p.is_dir():
            raise FitError(f"{what} {p} exists and is not a folder; give a folder (new or existing), or remove it")
        if not os.access(p, os.W_OK | os.X_OK):
            raise FitError(f"{what} {p} is not writable; give a folder you can write to")
        return p
    return check_writable_parent(p, what=what, error=FitError)


def _check_no_other_fit(out: Path, names: Mapping[str, str]) -> None:
    """Refuse a folder whose manifest describes other files still there: writing would replace its
    manifest and leave them undescribed (a second pair no reader could tell from the first). The same
    files again (a re-run), or the same ones in the other format, are this fit's own. A file of the names
    to write that no readable manifest describes (the authors' files copied in by hand; a manifest cut
    short) is not a fit's, and is refused rather than written over."""
    old: dict[str, Any] = {}
    if (out / MANIFEST_NAME).exists():
        try:
            old = read_manifest(out / MANIFEST_NAME, error=FitError)
        except RotationZooError as exc:
            raise FitError(f"{exc}; {out} may hold another fit it describes: give another --out, or remove the "
                           f"manifest and its files first") from None
    listed = old.get("files")
    entries: dict[str, Any] = listed if isinstance(listed, dict) else {}
    described = {e.get("name") for e in entries.values() if isinstance(e, dict)}
    foreign = sorted(n for n in names.values() if (out / n).exists() and n not in described)
    if foreign:
        raise FitError(f"{out / foreign[0]} exists and no {MANIFEST_NAME} of a fit describes it; writing this fit "
                       f"would replace it: give another --out, or move it away first")
    stems = {Path(n).stem for n in names.values()}
    others = sorted(str(e["name"]) for e in entries.values()
                    if isinstance(e, dict) and isinstance(e.get("name"), str) and Path(e["name"]).name == e["name"]
                    and Path(e["name"]).stem not in stems and (out / e["name"]).exists())
    if others:
        raise FitError(f"{out} holds another fit ({', '.join(others)}, described by its {MANIFEST_NAME}); writing "
                       f"{', '.join(sorted(names.values()))} there would leave those undescribed: give another --out, or "
                       f"remove them first")


def write_fitted(
    result: FitResult,
    out_dir: str | os.PathLike[str],
    *,
    model: str | None = None,
    tag: str | None = None,
    prompts: int | None = None,
    int2kv: Int2KVConfig | None = None,
    fmt: str = "pt",
    extra: Mapping[str, Any] | None = None,
) -> FitOutput:
    """Validate, then write the rotation files and the ``rotationzoo.json`` manifest.

    Args:
        result: from :func:`fit_rotations`.
        out_dir: destination folder (created).
        model: model id for the manifest (default: what the source recorded).
        tag: calibration tag for the manifest (e.g. ``"gpqa-seq20000"``).
        prompts: prompt count for the manifest (default: ``result.prompts``).
        int2kv: the INT2-KV settings recorded in the manifest's ``int2kv`` block (default:
            :meth:`FitResult.serving_config`: a refinement's own, else the defaults at the fitted group size).
        fmt: ``"pt"`` (the authors' format) or ``"safetensors"``.
        extra: more manifest fields.

    Returns:
        A :class:`FitOutput`.

    Raises:
        InvalidRotationError: a set fails validation (nothing is written then).
        FitError: an unknown format, nothing to write, or an output folder that cannot be written
            (:func:`check_output_folder`).
    """
    if fmt not in FILE_FORMATS:
        raise FitError(f"unknown output format {fmt!r}; expected one of {', '.join(FILE_FORMATS)}")
    out = check_output_folder(out_dir)
    names = output_file_names(result, fmt=fmt)
    if not names:
        raise FitError("nothing to write: the result has neither K nor V rotations")
    _check_no_other_fit(out, names)
    sets = {side: getattr(result, side) for side in names}
    result.attach_calibration(model)
    for side, rs in sets.items():  # everything validated before anything is written
        rs.objective = result.side_objective(side)
        validate(rs, layer_ids=result.layer_ids, head_dim=result.head_dim)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    files: dict[str, dict[str, Any]] = {}
    staged: dict[str, Path] = {}
    try:  # both sides written in full before either replaces a file: a failure between them mixes no pair
        for side, rs in sets.items():
            name = names[side]
            staged[side] = write_rotation(out / f".{name}.{os.getpid()}.new{Path(name).suffix}", rs, fmt=fmt)
        for side, tmp in staged.items():
            p = out / names[side]
            files[side] = {"name": p.name, "objective": sets[side].objective, "format_version": sets[side].layout_version,
                           "sha256": sha256_file(tmp), "size": tmp.stat().st_size}
            replace_with(tmp, p, what="fit output", error=FitError)
            paths[side] = p
    finally:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
    manifest = build_manifest(result, files, model=model, tag=tag, prompts=prompts, int2kv=int2kv, fmt=fmt)
    if result.tokens and len(set(result.tokens.values())) > 1:
        manifest["tokens_per_layer"] = {str(k): v for k, v in result.tokens.items()}
    if result.refinement is not None:
        manifest["refinement"] = result.refinement
    manifest.update(extra or {})
    mpath = write_manifest(out, manifest)
    return FitOutput(paths=paths, manifest_path=mpath, manifest=manifest)
