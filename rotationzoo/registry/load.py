"""Reading the registry: the bundled ``registry.json`` plus ``ROTATIONZOO_REGISTRY`` overlays.

Overlay files use the same schema; their models replace bundled models with the same id. Lookups
are case-insensitive by id, alias or the id's last segment; a misspelt name gets suggestions.
"""

from __future__ import annotations

import difflib
import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from .. import config
from ..errors import ConfigError, RegistryError, UnknownModelError
from ..int2kv import HEAD_DIMS, Int2KVConfig
from ..launch import LaunchConfig
from ..numbers import shown
from ..vocab import GROUPINGS
from . import bounds, safety
from .latent import parse_latent as _parse_latent
from .model import (
    SIDES,
    SOURCE_TYPES,
    Architecture,
    Calibration,
    Conflict,
    FileEntry,
    LatentSet,
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


_ARCHITECTURE_KEYS = ("head_dim", "num_layers", "attention_layer_ids", "num_kv_heads", "num_attention_heads",
                      "num_parameters", "weight_dtype", "layer_head_dims", "moe_intermediate_size", "weight_block_size",
                      "gguf_architecture")


def parse_architecture(raw: Any, where: str) -> Architecture:
    """A model's ``architecture`` object, every number within :mod:`.bounds` (one-line :class:`RegistryError`)."""
    if not isinstance(raw, Mapping):
        raise RegistryError(f"{where}.architecture must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_ARCHITECTURE_KEYS))
    if unknown:
        raise RegistryError(f"{where}.architecture: unknown key(s) {', '.join(map(shown, unknown))}; expected "
                            f"{', '.join(_ARCHITECTURE_KEYS)}")
    if "head_dim" not in raw:
        raise RegistryError(f"{where}.architecture: head_dim is required")
    try:
        fields: dict[str, Any] = {k: raw.get(k) for k in _ARCHITECTURE_KEYS}
        return Architecture(**fields)
    except RegistryError as exc:
        raise RegistryError(f"{where}.{exc}") from None


def parse_serving(raw: Any, arch: Architecture, where: str) -> Int2KVConfig:
    """A tag's ``serving`` block; at a head_dim the INT2 kernels run, its group size checked against
    it by the one group-size rule (:func:`~rotationzoo.int2kv.check_group_size`)."""
    try:
        cfg = Int2KVConfig.from_json(raw if raw is not None else {}, where=where)
        if arch.head_dim in HEAD_DIMS:
            cfg.group_for(arch.head_dim)
    except ConfigError as exc:
        text = str(exc)
        raise RegistryError(text if text.startswith(where) else f"{where}: {text}") from None
    return cfg


def parse_launch(raw: Any, arch: Architecture, grouping: str, where: str) -> LaunchConfig:
    """A tag's ``launch`` block: its bounds (:class:`~rotationzoo.launch.LaunchConfig`), a TP size the
    model can be served at (its KV heads by the authors' rule, its block-quantized MoE weights:
    :meth:`~rotationzoo.registry.model.Architecture.check_tp_size`),
    and no V-rotation absorption for per-KV-head files (it folds one ``R_V`` per layer into the weights)."""
    try:
        cfg = LaunchConfig.from_json(raw, where=where)
        arch.check_tp_size(cfg.tp_size, cfg.ep_size)
    except ConfigError as exc:
        text = str(exc)
        knob = "ep_size" if "expert-parallel" in text else "tp_size"
        raise RegistryError(text if text.startswith(where) else f"{where}: {knob}: {text}") from None
    if cfg.absorb_v_rotation and grouping == "kv_head":
        raise RegistryError(f"{where}: absorb_v_rotation is true for per-KV-head files (grouping kv_head); absorption "
                            "folds one R_V per layer into the weights and is wrong for them")
    return cfg


def _text(value: Any, where: str, limit: int = 400) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= limit or not value.isprintable():
        raise RegistryError(f"{where} must be a printable string of 1 to {limit} characters, got {shown(value)}")
    return value


def parse_conflicts(raw: Any, where: str) -> tuple[Conflict, ...]:
    """A tag's ``conflicts``: ``[{about, chosen, sources: [{source, says}, ...]}]`` (printable text)."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > 16:
        raise RegistryError(f"{where} must be a list of at most 16 objects, got {shown(raw)}")
    out = []
    for i, c in enumerate(raw):
        w = f"{where}[{i}]"
        if not isinstance(c, Mapping) or set(c) != {"about", "chosen", "sources"} or not isinstance(c["sources"], list) \
                or not 2 <= len(c["sources"]) <= 8:
            raise RegistryError(f"{w} must be an object with about, chosen and 2 to 8 sources, got {shown(c)}")
        sources = []
        for j, s in enumerate(c["sources"]):
            if not isinstance(s, Mapping) or set(s) != {"source", "says"}:
                raise RegistryError(f"{w}.sources[{j}] must be an object with source and says")
            sources.append((_text(s["source"], f"{w}.sources[{j}].source", 200), _text(s["says"], f"{w}.sources[{j}].says")))
        out.append(Conflict(_text(c["about"], f"{w}.about", 200), _text(c["chosen"], f"{w}.chosen", 200), tuple(sources)))
    return tuple(out)


def parse_grouping(raw: Any, where: str) -> str:
    """A tag's ``grouping``: ``layer`` (the default) or ``kv_head``."""
    if raw is None:
        return "layer"
    if raw not in GROUPINGS:
        raise RegistryError(f"{where} must be one of {', '.join(GROUPINGS)}, got {shown(raw)}")
    return str(raw)


def parse_latent(raw: Any, where: str) -> LatentSet:
    """A model's ``mla_latent`` block (see :mod:`.latent`)."""
    return _parse_latent(raw, where, _parse_source)


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
        path = safety.check_file_path(f["path"], f"{fw}.path")
        if "*" in path and any(not src.is_hub for src in srcs):
            raise RegistryError(f"{fw}.path: a path with '*' is resolved by listing a hub folder; give huggingface "
                                f"or modelscope sources only")
        if path.endswith(".verified"):
            raise RegistryError(f"{fw}.path: {path!r} ends like a cache verification marker")
        if path.rsplit("/", 1)[-1].startswith("."):
            raise RegistryError(f"{fw}.path: {path!r} names a hidden file (the cache's names for files being written)")
        bounds.check_file_numbers(f.get("sha256"), f.get("size"), fw)
        files[side] = FileEntry(side=side, path=path, sha256=f.get("sha256"), size=f.get("size"),  # type: ignore[arg-type]
                                sources=srcs)
    if files["k"].filename == files["v"].filename:  # the cache keeps a tag's files side by side under these names
        raise RegistryError(f"{where}.files: K and V are both named {files['k'].filename!r} in the cache; give the "
                            f"two files different names")
    return files


def _parse_tag(mid: str, tname: str, t: Mapping[str, Any], arch: Architecture, where: str) -> TagEntry:
    safety.check_tag(tname, where)
    calib_raw = dict(t.get("calibration") or {})
    for k, v in (parse_tag_name(tname) or {}).items():
        if calib_raw.get(k) is None:
            calib_raw[k] = v
    bounds.check_calibration(calib_raw, f"{where}.calibration")
    bounds.check_results(t.get("results", []), f"{where}.results")
    grouping = parse_grouping(t.get("grouping"), f"{where}.grouping")
    return TagEntry(
        model_id=mid,
        name=tname,
        description=t.get("description", ""),
        calibration=Calibration(**calib_raw),
        objectives=dict(t["objectives"]),
        serving=parse_serving(t.get("serving"), arch, f"{where}.serving"),
        results=tuple(Result(**r) for r in t.get("results", [])),
        files=_parse_files(t, where),
        architecture=arch,
        launch=parse_launch(t.get("launch"), arch, grouping, f"{where}.launch"),
        grouping=grouping,  # type: ignore[arg-type]
        conflicts=parse_conflicts(t.get("conflicts"), f"{where}.conflicts"),
    )


def parse_model(raw: Mapping[str, Any], where: str, origin: str) -> ModelEntry:
    """One ``models[i]`` object → :class:`ModelEntry`; any problem is a one-line :class:`RegistryError`."""
    try:
        mid = safety.check_model_id(raw["id"], f"{where}.id")
        for i, alias in enumerate(raw.get("aliases", [])):
            safety.check_alias(alias, f"{where}.aliases[{i}]")
        if "mla_latent" in raw:
            return _latent_model(raw, mid, where, origin)
        arch = parse_architecture(raw["architecture"], where)
        if not isinstance(raw["tags"], Mapping) or not raw["tags"]:
            raise RegistryError(f"{where}.tags must be an object of tag entries, got {shown(raw['tags'])}")
        for tname, t in raw["tags"].items():
            if not isinstance(t, Mapping):
                raise RegistryError(f"{where}.tags[{shown(tname)}] must be an object, got {shown(t)}")
        if not isinstance(raw["default_tag"], str):
            raise RegistryError(f"{where}.default_tag must be one of its tags, got {shown(raw['default_tag'])}")
        tags = {tname: _parse_tag(mid, tname, t, arch, f"{where}.tags[{tname!r}]") for tname, t in raw["tags"].items()}
        model = ModelEntry(
            id=mid,
            aliases=tuple(raw.get("aliases", [])),
            description=raw.get("description", ""),
            architecture=arch,
            default_tag=raw["default_tag"],
            tags=tags,
            origin=origin,
            prebuilt_gguf=tuple(safety.check_model_id(r, f"{where}.prebuilt_gguf[{i}]")
                                for i, r in enumerate(raw.get("prebuilt_gguf") or [])),
        )
    except RegistryError:
        raise
    except ConfigError as exc:  # a serving block (Int2KVConfig); the message names where
        raise RegistryError(str(exc)) from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise RegistryError(f"{where}: malformed model entry ({type(exc).__name__}: {exc})") from None
    if model.default_tag not in model.tags:
        raise RegistryError(
            f"{where}: default_tag '{model.default_tag}' is not one of its tags ({', '.join(model.tags)})"
        )
    return model


def _latent_model(raw: Mapping[str, Any], mid: str, where: str, origin: str) -> ModelEntry:
    """A model whose rotations are an MLA latent set: no tags, no default tag, an optional architecture."""
    if raw.get("tags") or raw.get("default_tag") is not None:
        raise RegistryError(f"{where}: a model with mla_latent has no K/V tags and no default_tag (the latent set is "
                            "not a K/V pair)")
    arch = parse_architecture(raw["architecture"], where) if raw.get("architecture") is not None else None
    return ModelEntry(id=mid, aliases=tuple(raw.get("aliases", [])), description=raw.get("description", ""),
                      architecture=arch, default_tag=None, tags={}, origin=origin,
                      mla_latent=parse_latent(raw["mla_latent"], f"{where}.mla_latent"))


def read_registry_json(path: Path) -> dict[str, Any]:
    """The JSON document of a registry file, checked for its top-level shape and version."""
    text = _read_bounded(path)
    try:
        data = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise RegistryError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise RegistryError(f"{path}: JSON nested too deeply (at most {bounds.MAX_JSON_DEPTH} levels)") from None
    except ValueError as exc:  # NaN / Infinity, or an integer of thousands of digits
        raise RegistryError(f"{path}: not valid registry JSON ({exc})") from None
    if _depth(data) > bounds.MAX_JSON_DEPTH:
        raise RegistryError(f"{path}: JSON nested too deeply (at most {bounds.MAX_JSON_DEPTH} levels)")
    if not isinstance(data, dict) or not isinstance(data.get("models"), list):
        raise RegistryError(f"{path}: expected an object with a 'models' list")
    version = data.get("registry_version", REGISTRY_VERSION)
    if version != REGISTRY_VERSION:
        raise RegistryError(
            f"{path}: registry_version {version!r} is not supported (expected {REGISTRY_VERSION}); upgrade rotationzoo"
        )
    return data


def _read_bounded(path: Path) -> str:
    """The text of a registry file: a regular file of at most ``MAX_REGISTRY_BYTES``, UTF-8."""
    import os
    import stat

    limit = bounds.MAX_REGISTRY_BYTES
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO does not block the open
    except FileNotFoundError:
        raise RegistryError(f"{path}: registry file not found") from None
    except OSError as exc:
        raise RegistryError(f"{path}: cannot read the registry file ({exc.strerror or exc})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise RegistryError(f"{path}: a registry must be a regular file (this is a device, folder or pipe)")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > limit:
            raise RegistryError(f"{path}: registry file of {st.st_size:,} bytes is over the {limit:,}-byte limit")
        try:
            raw = f.read(limit + 1)
        except OSError as exc:
            raise RegistryError(f"{path}: cannot read the registry file ({exc.strerror or exc})") from None
    if len(raw) > limit:
        raise RegistryError(f"{path}: registry file is over the {limit:,}-byte limit")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RegistryError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a registry may hold")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is too large for a number a registry may hold")
    return value


def _depth(value: Any, level: int = 1) -> int:
    """Nesting depth of a JSON value (stops counting past ``MAX_JSON_DEPTH``)."""
    if level > bounds.MAX_JSON_DEPTH or not isinstance(value, (dict, list)):
        return level
    items = value.values() if isinstance(value, dict) else value
    return max((_depth(v, level + 1) for v in items), default=level)


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
        """The model called ``model`` (id, alias or id's last segment; case-insensitive).

        Raises:
            UnknownModelError: no model has this name.
            ConfigError: ``model`` is not a string.
        """
        if not isinstance(model, str):
            raise ConfigError(f"a model is named by its registry id or alias, a string such as 'Qwen3-8B', got "
                              f"{type(model).__name__} {shown(model)}")
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


def list_models(pattern: str | None = None) -> list[ModelEntry]:
    """Every model in the registry, in registry order; with ``pattern`` (``rotationzoo list PATTERN``) those whose
    id, name after the org or an alias matches it as a shell-style pattern, case-insensitive (``"qwen3*"``)."""
    from fnmatch import fnmatchcase

    models = list(load_registry())
    if pattern is None:
        return models
    pat = pattern.lower()
    return [m for m in models if any(fnmatchcase(n.lower(), pat) for n in (m.id, m.id.rsplit("/", 1)[-1], *m.aliases))]


def get_model(model: str) -> ModelEntry:
    """Look up a model by id or alias (case-insensitive); unknown → :class:`UnknownModelError`."""
    return load_registry().resolve(model)


def get_entry(model: str, tag: str | None = None) -> TagEntry:
    """The registry entry for ``model`` and ``tag`` (the model's default tag when ``None``)."""
    return load_registry().entry(model, tag)
