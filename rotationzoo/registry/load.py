"""Reading the registry: the bundled ``registry.json`` plus ``ROTATIONZOO_REGISTRY`` overlays.

Overlay files use the same schema; their models replace bundled models with the same id. Lookups
are case-insensitive by id, alias or the id's last segment; a misspelt name gets suggestions.
"""

from __future__ import annotations

import difflib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from .. import config
from ..errors import RegistryError, UnknownModelError
from ..int2kv import Int2KVConfig
from ..vocab import WEIGHT_DTYPE_NAMES
from . import safety
from .model import (
    SIDES,
    SOURCE_TYPES,
    Architecture,
    Calibration,
    FileEntry,
    ModelEntry,
    Result,
    Source,
    TagEntry,
    parse_tag_name,
)

#: The ``registry_version`` this release reads and writes.
REGISTRY_VERSION = 1
_PACKAGE = Path(__file__).resolve().parent.parent


def bundled_registry_path() -> Path:
    """The registry shipped with the package (``registry.json``)."""
    for candidate in (_PACKAGE / "registry.json", _PACKAGE.parent / "registry.json"):
        if candidate.is_file():
            return candidate
    raise RegistryError(f"bundled registry.json not found next to {_PACKAGE}; the installation is broken")


def schema_path() -> Path:
    """The JSON Schema of registry files (``registry.schema.json``)."""
    return _PACKAGE / "registry.schema.json"


# -- parsing -------------------------------------------------------------------------------------


def _parse_weights(raw: Mapping[str, Any], where: str) -> tuple[int | None, Any]:
    """``(num_parameters, weight_dtype)`` of an architecture, checked (they come together)."""
    n, dtype = raw.get("num_parameters"), raw.get("weight_dtype")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise RegistryError(f"{where}.architecture.num_parameters must be an integer >= 1, got {n!r}")
    if dtype is not None and dtype not in WEIGHT_DTYPE_NAMES:
        raise RegistryError(f"{where}.architecture.weight_dtype must be one of {', '.join(WEIGHT_DTYPE_NAMES)}, got {dtype!r}")
    if n is not None and dtype is None:
        raise RegistryError(f"{where}.architecture: num_parameters needs weight_dtype too (e.g. \"bfloat16\")")
    return n, dtype


def _parse_architecture(raw: Mapping[str, Any], where: str) -> Architecture:
    ids = raw.get("attention_layer_ids")
    num_parameters, weight_dtype = _parse_weights(raw, where)
    layer_dims = raw.get("layer_head_dims")
    return Architecture(
        head_dim=int(raw["head_dim"]),
        layer_head_dims={int(k): int(v) for k, v in layer_dims.items()} if layer_dims else None,
        num_layers=raw.get("num_layers"),
        attention_layer_ids=tuple(ids) if ids else None,
        num_kv_heads=raw.get("num_kv_heads"),
        num_attention_heads=raw.get("num_attention_heads"),
        num_parameters=num_parameters,
        weight_dtype=weight_dtype,
    )


def _parse_source(raw: Mapping[str, Any], where: str) -> Source:
    """One source, with every name that reaches a path or a request checked (:mod:`.safety`)."""
    src = Source(**raw)
    if src.type not in SOURCE_TYPES:
        raise RegistryError(f"{where}: unknown source type {src.type!r}; expected one of {', '.join(SOURCE_TYPES)}")
    if src.is_hub:
        safety.check_model_id(src.repo, f"{where}.repo")
        safety.check_revision(src.revision, f"{where}.revision")
        if src.path is not None:
            safety.check_relpath(src.path, f"{where}.path")
    elif src.type == "url":
        safety.check_url(src.url, f"{where}.url")
    else:
        safety.bundled_file(str(src.path), f"{where}.path")
    return src


def _parse_files(t: Mapping[str, Any], where: str) -> dict[str, FileEntry]:
    tag_sources = tuple(_parse_source(s, f"{where}.sources[{i}]") for i, s in enumerate(t.get("sources", [])))
    files = {}
    for side in SIDES:
        f = t["files"][side]
        fw = f"{where}.files.{side}"
        srcs = (tuple(_parse_source(s, f"{fw}.sources[{i}]") for i, s in enumerate(f["sources"]))
                if "sources" in f else tag_sources)
        if not srcs:
            raise RegistryError(f"{fw}: no sources (give 'sources' on the tag or the file)")
        path = safety.check_relpath(f["path"], f"{fw}.path")
        if path.endswith(".verified"):
            raise RegistryError(f"{fw}.path: {path!r} ends like a cache verification marker")
        files[side] = FileEntry(side=side, path=path, sha256=f.get("sha256"), size=f.get("size"),  # type: ignore[arg-type]
                                sources=srcs)
    return files


def _parse_tag(mid: str, tname: str, t: Mapping[str, Any], arch: Architecture, where: str) -> TagEntry:
    safety.check_tag(tname, where)
    calib_raw = dict(t.get("calibration") or {})
    for k, v in (parse_tag_name(tname) or {}).items():
        if calib_raw.get(k) is None:
            calib_raw[k] = v
    return TagEntry(
        model_id=mid,
        name=tname,
        description=t.get("description", ""),
        calibration=Calibration(**calib_raw),
        objectives=dict(t["objectives"]),
        serving=Int2KVConfig.from_json(t.get("serving") or {}, where=f"{where}.serving"),
        results=tuple(Result(**r) for r in t.get("results", [])),
        files=_parse_files(t, where),
        architecture=arch,
    )


def parse_model(raw: Mapping[str, Any], where: str, origin: str) -> ModelEntry:
    """One ``models[i]`` object → :class:`ModelEntry`; any problem is a one-line :class:`RegistryError`."""
    try:
        mid = safety.check_model_id(raw["id"], f"{where}.id")
        for i, alias in enumerate(raw.get("aliases", [])):
            safety.check_alias(alias, f"{where}.aliases[{i}]")
        arch = _parse_architecture(raw["architecture"], where)
        tags = {tname: _parse_tag(mid, tname, t, arch, f"{where}.tags[{tname!r}]") for tname, t in raw["tags"].items()}
        model = ModelEntry(
            id=mid,
            aliases=tuple(raw.get("aliases", [])),
            description=raw.get("description", ""),
            architecture=arch,
            default_tag=raw["default_tag"],
            tags=tags,
            origin=origin,
        )
    except RegistryError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise RegistryError(f"{where}: malformed model entry ({type(exc).__name__}: {exc})") from None
    if model.default_tag not in model.tags:
        raise RegistryError(
            f"{where}: default_tag '{model.default_tag}' is not one of its tags ({', '.join(model.tags)})"
        )
    return model


def read_registry_json(path: Path) -> dict[str, Any]:
    """The JSON document of a registry file, checked for its top-level shape and version."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise RegistryError(f"{path}: registry file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RegistryError(f"{path}: cannot read the registry file ({exc})") from None
    except json.JSONDecodeError as exc:
        raise RegistryError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("models"), list):
        raise RegistryError(f"{path}: expected an object with a 'models' list")
    version = data.get("registry_version", REGISTRY_VERSION)
    if version != REGISTRY_VERSION:
        raise RegistryError(
            f"{path}: registry_version {version!r} is not supported (expected {REGISTRY_VERSION}); upgrade rotationzoo"
        )
    return data


# -- the registry ----------------------------------------------------------------------------------


class Registry:
    """An ordered set of :class:`ModelEntry`, with lookup by id or alias (case-insensitive)."""

    def __init__(self, models: Iterable[ModelEntry]) -> None:
        self.models: dict[str, ModelEntry] = {}
        for m in models:
            self.models[m.id] = m  # later (overlay) models replace earlier ones
        self._index: dict[str, str] = {}
        for m in self.models.values():
            for n in m.names():
                self._index.setdefault(n.lower(), m.id)
        for m in self.models.values():  # ids and aliases of overlays win over other names
            for n in (m.id, *m.aliases):
                if m.origin != "bundled":
                    self._index[n.lower()] = m.id

    @classmethod
    def from_files(cls, paths: Iterable[Path], *, origins: Iterable[str] | None = None) -> "Registry":
        paths = list(paths)
        origins = list(origins) if origins is not None else [str(p) for p in paths]
        models: list[ModelEntry] = []
        for path, origin in zip(paths, origins):
            data = read_registry_json(path)
            for i, raw in enumerate(data["models"]):
                models.append(parse_model(raw, f"{path}: models[{i}]", origin))
        return cls(models)

    def resolve(self, model: str) -> ModelEntry:
        """The model called ``model`` (id, alias or id's last segment; case-insensitive)."""
        key = model.strip().lower()
        if key in self._index:
            return self.models[self._index[key]]
        names = sorted({n for m in self.models.values() for n in (m.id, *m.aliases)})
        lowered = {n.lower(): n for n in names}
        close = difflib.get_close_matches(key, list(lowered), n=3, cutoff=0.6)
        suggestions = [lowered[c] for c in close]
        hint = f"; did you mean {' or '.join(repr(s) for s in suggestions)}?" if suggestions else ""
        raise UnknownModelError(
            f"unknown model '{model}'{hint} (run `rotationzoo list` to see all models)", suggestions
        )

    def entry(self, model: str, tag: str | None = None) -> TagEntry:
        return self.resolve(model).tag(tag)

    def __contains__(self, model: object) -> bool:
        return isinstance(model, str) and model.strip().lower() in self._index

    def __iter__(self) -> Iterator[ModelEntry]:
        return iter(self.models.values())

    def __len__(self) -> int:
        return len(self.models)


@lru_cache(maxsize=8)
def _load_cached(paths: tuple[str, ...], stamps: tuple[float, ...]) -> Registry:
    files = [Path(p) for p in paths]
    return Registry.from_files(files, origins=["bundled"] + [str(p) for p in files[1:]])


def load_registry(*, skip_missing_overlays: bool = False) -> Registry:
    """The bundled registry plus any ``ROTATIONZOO_REGISTRY`` overlays (cached per file mtime).

    Args:
        skip_missing_overlays: ignore overlay files that do not exist yet (publishing creates them)
            instead of raising.
    """
    paths = [bundled_registry_path()]
    for p in config.registry_overlays():
        if skip_missing_overlays and not p.exists():
            continue
        paths.append(p)
    stamps = []
    for p in paths:
        try:
            stamps.append(p.stat().st_mtime)
        except FileNotFoundError:
            raise RegistryError(f"{p}: registry file named by ROTATIONZOO_REGISTRY does not exist") from None
    return _load_cached(tuple(str(p) for p in paths), tuple(stamps))


def list_models() -> list[ModelEntry]:
    """Every model in the registry, in registry order."""
    return list(load_registry())


def get_model(model: str) -> ModelEntry:
    """Look up a model by id or alias (case-insensitive); unknown → :class:`UnknownModelError`."""
    return load_registry().resolve(model)


def get_entry(model: str, tag: str | None = None) -> TagEntry:
    """The registry entry for ``model`` and ``tag`` (the model's default tag when ``None``)."""
    return load_registry().entry(model, tag)
