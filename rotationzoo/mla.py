"""MLA latent sets for users: fetch, load, verify and import them, from the registry or a folder.

Example::

    import rotationzoo
    lat = rotationzoo.load_latent("GLM-5.2")        # the zoo's folder: fetched once (pinned on first use), checked
    lat.rotations.layer_ids, lat.rotations.rank     # (0, 1, …, 77), 512
    rotationzoo.load_latent("./glm52-rotations", model="GLM-5.2")   # a local copy, against the model's layers

A set is valid when every ``layer_<id>.pt`` reads safely as a ``[rank, rank]`` latent rotation
(:mod:`rotationzoo.files.latent`), is finite and orthogonal (or inverted by its ``q_rotation``), and the
folder covers the model's latent layers exactly; a missing layer is an error naming it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from .errors import ConfigError, InvalidRotationError, RotationZooError, UnknownModelError, UnknownTagError
from .hub.latent import LatentFiles, fetch_latent, import_latent
from .files.latent import LatentReport, LatentRotations, is_latent_folder, read_latent_folder, validate_latent
from .registry import ModelEntry, get_model, split_model_tag
from .numbers import shown
from .registry.model import LatentSet
from .files.validation import DEFAULT_ATOL, ValidationReport


@dataclass
class LoadedLatent:
    """A validated latent set: the rotations, the registry's set (when from the registry), its cached files."""

    rotations: LatentRotations
    report: LatentReport
    model: str | None = None
    latent: LatentSet | None = None
    files: LatentFiles | None = None

    @property
    def folder(self) -> Path:
        assert self.rotations.folder is not None
        return self.rotations.folder

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "latent": self.latent.name if self.latent else None,
                **self.rotations.to_json(), "report": self.report.to_json()}


def latent_model(model: Any, tag: str | None = None) -> ModelEntry | None:
    """The registry model ``model`` (``MODEL[@NAME]``) names when its rotations are an MLA latent set, else ``None``.

    Raises:
        UnknownTagError: a tag other than the set's name.
    """
    if not isinstance(model, str) or Path(model).expanduser().exists():
        return None
    base, at_tag = split_model_tag(model)
    try:
        m = get_model(base)
    except (UnknownModelError, RotationZooError):
        return None
    if m.mla_latent is None:
        return None
    asked = at_tag or tag
    if asked is not None and asked.lower() != m.mla_latent.name.lower():
        raise UnknownTagError(f"{m.id} has no tag {asked!r}: its rotations are the MLA latent set "
                              f"{m.mla_latent.name!r}")
    return m


def expectations(model: ModelEntry | None) -> dict[str, Any]:
    """What a folder must hold for ``model``'s latent set: ``layer_ids`` / ``layer_count`` and ``rank``."""
    lat = model.mla_latent if model is not None else None
    if lat is None:
        return {}
    return {"layer_ids": lat.expected_layer_ids, "layer_count": lat.layer_count, "rank": lat.rank}


def _checked(folder: Path, expect: dict[str, Any], atol: float) -> tuple[LatentRotations, LatentReport]:
    rotations = read_latent_folder(folder, rank=expect.get("rank"), layer_ids=expect.get("layer_ids"),
                                   layer_count=expect.get("layer_count"))
    report = validate_latent(rotations, atol=atol, **expect)
    return rotations, report


def load_latent(source: str | os.PathLike[str] | None = None, /, *, model: str | None = None,
                atol: float = DEFAULT_ATOL, cache_dir: str | os.PathLike[str] | None = None,
                offline: bool | None = None, source_type: str = "auto", revision: str | None = None,
                timeout: float | None = None, **misnamed: Any) -> LoadedLatent:
    """A validated latent set: a registry model (fetched and cached) or a local folder (checked against
    ``model``'s latent layers when given, else its ids must run from 0 without a gap).

    ``source`` is what to load (a model id or a folder; ``source=`` by keyword works too); the hub it is
    fetched from is ``source_type`` (``"auto"``, ``"huggingface"``, ``"modelscope"``, ...: what
    :func:`rotationzoo.fetch` calls ``source``).

    Raises:
        ConfigError: ``source=`` given beside the positional model or folder (the hub is ``source_type=``).
        InvalidRotationError: a layer missing, stray, not finite, not orthogonal, or not inverted by its
            ``q_rotation`` (the first problem; one line naming the layer).
        RotationFileError: a file that cannot be read safely.
        OfflineError / FetchError: the set is not cached and cannot be downloaded.
    """
    source = _what_to_load(source, misnamed)
    m = latent_model(str(source)) if not Path(source).expanduser().is_dir() else None
    files = None
    if m is not None:
        files = fetch_latent(m, cache_dir=cache_dir, offline=offline, source=source_type, revision=revision,
                             timeout=timeout)
        folder = files.folder
    else:
        folder = Path(source).expanduser()
        m = _model_for(model)
    rotations, report = _checked(folder, expectations(m), atol)
    if not report.ok:
        raise InvalidRotationError(report.problems[0])
    return LoadedLatent(rotations, report, m.id if m else None, m.mla_latent if m else None, files)


def _what_to_load(source: Any, misnamed: dict[str, Any]) -> str | os.PathLike[str]:
    """``load_latent``'s model or folder, given by position or as ``source=``; ``source=`` beside a positional
    one (meant as the hub, which is ``source_type=``) is refused with one line, as is any other unknown keyword."""
    given = misnamed.pop("source", None)
    if misnamed:
        name = next(iter(misnamed))
        raise TypeError(f"load_latent() got an unexpected keyword argument {name!r}")
    if source is not None and given is not None:
        raise ConfigError(f"load_latent() names the hub to fetch from source_type=, not source= (its first argument, "
                          f"{shown(source)}, is the model or folder): load_latent({shown(source)}, "
                          f"source_type={shown(given)})")
    what = source if source is not None else given
    if not isinstance(what, (str, os.PathLike)):
        raise ConfigError(f"load_latent() takes a registry model id or a folder of layer_<id>.pt files, got "
                          f"{type(what).__name__} {shown(what)}")
    return what


def _model_for(model: str | None) -> ModelEntry | None:
    if model is None:
        return None
    m = get_model(split_model_tag(model)[0])
    if m.mla_latent is None:
        raise UnknownTagError(f"{m.id} has K/V tags, not an MLA latent set; its rotations are checked as a pair")
    return m


def verify_latent(source: str | os.PathLike[str], *, layer_ids: Iterable[int] | None = None,
                  num_layers: int | None = None, rank: int | None = None, atol: float = DEFAULT_ATOL,
                  fetch: dict[str, Any] | None = None) -> ValidationReport:
    """A :class:`~rotationzoo.files.validation.ValidationReport` of a latent folder or a registry latent set
    (``objective`` ``mla_latent``, ``head_dim`` the rank); never raises for a bad set."""
    text = os.fspath(source)
    try:
        m = latent_model(text) if not Path(text).expanduser().is_dir() else None
        expect: dict[str, Any] = expectations(m)
        if layer_ids is not None or num_layers is not None:
            expect.update(layer_ids=tuple(layer_ids) if layer_ids is not None else tuple(range(num_layers or 0)),
                          layer_count=None)
        if rank is not None:
            expect["rank"] = rank
        folder = fetch_latent(m, **(fetch or {})).folder if m is not None else Path(text).expanduser()
        rotations, report = _checked(folder, expect, atol)
    except RotationZooError as exc:
        return ValidationReport(path=text, ok=False, objective="mla_latent", problems=[str(exc)])
    return ValidationReport(path=str(folder), ok=report.ok, num_layers=len(rotations.layers), head_dim=rotations.rank,
                            layer_ids=list(rotations.layer_ids), objective="mla_latent",
                            max_orthogonality_error=report.max_orthogonality_error, source_grouping="latent",
                            layout_version="latent", companions=["mean", "q_rotation"] if rotations.companions else [],
                            orthogonal=report.max_inverse_error is None, max_inverse_error=report.max_inverse_error,
                            problems=report.problems)


def import_latent_folder(folder: str | os.PathLike[str], model: str, *,
                         cache_dir: str | os.PathLike[str] | None = None, accept_new: bool = False,
                         subspace: bool = False) -> LatentFiles:
    """Check ``folder`` as ``model``'s latent set (or, ``subspace``, its high-precision subspace folder) and
    copy it into the cache (:func:`rotationzoo.hub.latent.import_latent`).

    Raises:
        InvalidRotationError / RotationFileError: the folder is not a valid set for ``model``.
    """
    m = _model_for(model)
    assert m is not None
    if not subspace:
        _, report = _checked(Path(folder).expanduser(), expectations(m), DEFAULT_ATOL)
        if not report.ok:
            raise InvalidRotationError(report.problems[0])
    return import_latent(folder, m, cache_dir=cache_dir, accept_new=accept_new, subspace=subspace)


__all__ = ["LoadedLatent", "expectations", "import_latent_folder", "is_latent_folder", "latent_model", "load_latent",
           "verify_latent"]
