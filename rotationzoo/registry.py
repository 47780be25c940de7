"""The registry: models × calibration tags → rotation files, their hashes and where to get them.

The bundled ``registry.json`` (documented in ``docs/registry.md``, schema in
``registry.schema.json``) is read without importing torch, so listing and inspecting the zoo is
fast. ``ROTATIONZOO_REGISTRY`` may name extra registry files in the same schema; their models
replace bundled models with the same id.

Example::

    >>> from rotationzoo import get_entry
    >>> tag = get_entry("qwen3-8b")
    >>> tag.name, tag.serving.k_clip_ratio, tag.files["k"].path
    ('seq20000_prompt83_group128', 0.96, 'Qwen3-8B/seq20000_prompt83_group128/k_rotation_qqt_r_h_pbr.pt')
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping

from . import config
from .errors import RegistryError, UnknownModelError, UnknownTagError

SourceType = Literal["huggingface", "modelscope", "url", "bundled"]
Side = Literal["k", "v"]
SIDES: tuple[Side, Side] = ("k", "v")

_TAG_RE = re.compile(r"seq(?P<tokens>\d+)_prompt(?P<prompts>\d+)_group(?P<group>\d+)")
_HEX40 = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

#: Serving defaults of the published recipe (SGLang fork README / eval scripts).
DEFAULT_SERVING: dict[str, Any] = {
    "k_clip_ratio": 0.96,
    "v_clip_ratio": 0.92,
    "prefix_tokens": 64,
    "recent_tokens": 256,
    "group_size": 128,
    "hp_dtype": "bfloat16",
    "scale_dtype": "float32",
    "lloyd_max": False,
}


def parse_tag_name(tag: str) -> dict[str, int] | None:
    """Calibration numbers encoded in a tag: ``seq<T>_prompt<N>_group<G>`` → tokens, prompts, group_size.

    >>> parse_tag_name("longbench-seq150000_prompt44_group128")
    {'tokens': 150000, 'prompts': 44, 'group_size': 128}
    """
    m = _TAG_RE.search(tag)
    if not m:
        return None
    return {"tokens": int(m["tokens"]), "prompts": int(m["prompts"]), "group_size": int(m["group"])}


@dataclass(frozen=True)
class Source:
    """Where a file can be downloaded. ``type`` decides which fields matter.

    - ``huggingface`` / ``modelscope``: ``repo`` (``ns/name``), ``revision`` (branch, tag or commit
      sha), optional ``path`` inside the repo (defaults to the file's ``path``);
    - ``url``: ``url``, a plain HTTP(S) GET;
    - ``bundled``: ``path`` relative to the package's ``data/`` folder.
    """

    type: SourceType
    repo: str | None = None
    revision: str | None = None
    path: str | None = None
    url: str | None = None

    @property
    def pinned(self) -> bool:
        """True when the source names immutable bytes (a commit sha, a url, or bundled data)."""
        if self.type in ("huggingface", "modelscope"):
            return bool(self.revision and _HEX40.match(self.revision))
        return True

    def describe(self) -> str:
        if self.type in ("huggingface", "modelscope"):
            return f"{self.type}:{self.repo}@{self.revision}"
        if self.type == "url":
            return f"url:{self.url}"
        return f"bundled:{self.path}"

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class FileEntry:
    """One rotation file (the K or the V side of a tag)."""

    side: Side
    path: str
    sha256: str | None
    size: int | None
    sources: tuple[Source, ...]

    @property
    def filename(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def pinned(self) -> bool:
        return self.sha256 is not None

    def source_path(self, source: Source) -> str:
        """Path of this file inside ``source``'s repository."""
        return source.path or self.path


@dataclass(frozen=True)
class Calibration:
    dataset: str | None = None
    tokens: int | None = None
    prompts: int | None = None
    group_size: int | None = None
    notes: str | None = None


@dataclass(frozen=True)
class Serving:
    """Serving defaults that go with a rotation pair (not stored in the ``.pt`` files)."""

    k_clip_ratio: float = 0.96
    v_clip_ratio: float = 0.92
    prefix_tokens: int = 64
    recent_tokens: int = 256
    group_size: int = 128
    hp_dtype: str = "bfloat16"
    scale_dtype: str = "float32"
    lloyd_max: bool = False


@dataclass(frozen=True)
class Result:
    benchmark: str
    bf16: float | None = None
    oscar_int2: float | None = None
    source: str | None = None


@dataclass(frozen=True)
class Architecture:
    """What a model needs from a rotation pair."""

    head_dim: int
    num_layers: int | None = None
    attention_layer_ids: tuple[int, ...] | None = None
    num_kv_heads: int | None = None
    num_attention_heads: int | None = None

    def expected_layer_ids(self) -> tuple[int, ...] | None:
        """The layer ids a rotation file must cover (sparse for hybrids), or None if unknown."""
        if self.attention_layer_ids:
            return tuple(self.attention_layer_ids)
        if self.num_layers:
            return tuple(range(self.num_layers))
        return None


@dataclass(frozen=True)
class TagEntry:
    """One calibration of one model: the K/V files plus how they were made and are served."""

    model_id: str
    name: str
    description: str
    calibration: Calibration
    objectives: Mapping[str, str]
    serving: Serving
    results: tuple[Result, ...]
    files: Mapping[str, FileEntry]
    architecture: Architecture

    @property
    def key(self) -> str:
        """``model@tag``, e.g. ``Qwen/Qwen3-8B@seq20000_prompt83_group128``."""
        return f"{self.model_id}@{self.name}"

    @property
    def pinned(self) -> bool:
        return all(f.pinned for f in self.files.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model_id,
            "tag": self.name,
            "description": self.description,
            "calibration": asdict(self.calibration),
            "objectives": dict(self.objectives),
            "serving": asdict(self.serving),
            "results": [asdict(r) for r in self.results],
            "files": {
                side: {
                    "path": f.path,
                    "sha256": f.sha256,
                    "size": f.size,
                    "sources": [s.to_json() for s in f.sources],
                }
                for side, f in self.files.items()
            },
        }


@dataclass(frozen=True)
class ModelEntry:
    id: str
    aliases: tuple[str, ...]
    description: str
    architecture: Architecture
    default_tag: str
    tags: Mapping[str, TagEntry]
    origin: str = "bundled"

    def tag(self, name: str | None = None) -> TagEntry:
        """The named tag (default tag when ``None``); matching is case-insensitive."""
        if name is None:
            return self.tags[self.default_tag]
        if name in self.tags:
            return self.tags[name]
        lowered = {t.lower(): t for t in self.tags}
        if name.lower() in lowered:
            return self.tags[lowered[name.lower()]]
        close = difflib.get_close_matches(name, list(self.tags), n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise UnknownTagError(f"{self.id} has no tag '{name}'{hint} (tags: {', '.join(self.tags)})")

    def names(self) -> tuple[str, ...]:
        """Every name this model answers to: id, aliases, and the id's last segment."""
        return (self.id, *self.aliases, self.id.split("/", 1)[-1])

    def to_json(self, *, full: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "aliases": list(self.aliases),
            "description": self.description,
            "architecture": {k: v for k, v in asdict(self.architecture).items() if v is not None},
            "default_tag": self.default_tag,
            "tags": list(self.tags),
            "origin": self.origin,
        }
        if full:
            out["tags"] = {name: t.to_json() for name, t in self.tags.items()}
        return out


# -- parsing -------------------------------------------------------------------------------------


def _parse_model(raw: Mapping[str, Any], where: str, origin: str) -> ModelEntry:
    try:
        mid = raw["id"]
        arch_raw = raw["architecture"]
        arch = Architecture(
            head_dim=int(arch_raw["head_dim"]),
            num_layers=arch_raw.get("num_layers"),
            attention_layer_ids=tuple(arch_raw["attention_layer_ids"]) if arch_raw.get("attention_layer_ids") else None,
            num_kv_heads=arch_raw.get("num_kv_heads"),
            num_attention_heads=arch_raw.get("num_attention_heads"),
        )
        tags: dict[str, TagEntry] = {}
        for tname, t in raw["tags"].items():
            twhere = f"{where}.tags[{tname!r}]"
            calib_raw = dict(t.get("calibration") or {})
            parsed = parse_tag_name(tname) or {}
            for k, v in parsed.items():
                calib_raw.setdefault(k, v)
                if calib_raw[k] is None:
                    calib_raw[k] = v
            serving_raw = {**DEFAULT_SERVING, **(t.get("serving") or {})}
            tag_sources = tuple(Source(**s) for s in t.get("sources", []))
            files = {}
            for side in SIDES:
                f = t["files"][side]
                srcs = tuple(Source(**s) for s in f["sources"]) if "sources" in f else tag_sources
                if not srcs:
                    raise RegistryError(f"{twhere}.files.{side}: no sources (give 'sources' on the tag or the file)")
                files[side] = FileEntry(side=side, path=f["path"], sha256=f.get("sha256"), size=f.get("size"),
                                        sources=srcs)
            tags[tname] = TagEntry(
                model_id=mid,
                name=tname,
                description=t.get("description", ""),
                calibration=Calibration(**calib_raw),
                objectives=dict(t["objectives"]),
                serving=Serving(**serving_raw),
                results=tuple(Result(**r) for r in t.get("results", [])),
                files=files,
                architecture=arch,
            )
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


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise RegistryError(f"{path}: registry file not found") from None
    except json.JSONDecodeError as exc:
        raise RegistryError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("models"), list):
        raise RegistryError(f"{path}: expected an object with a 'models' list")
    version = data.get("registry_version", 1)
    if version != 1:
        raise RegistryError(f"{path}: registry_version {version!r} is not supported (expected 1); upgrade rotationzoo")
    return data


def bundled_registry_path() -> Path:
    """The registry shipped with the package (``registry.json``)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "registry.json", here.parent / "registry.json"):
        if candidate.is_file():
            return candidate
    raise RegistryError(f"bundled registry.json not found next to {here}; the installation is broken")


def schema_path() -> Path:
    return Path(__file__).resolve().parent / "registry.schema.json"


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
            data = _read_json(path)
            for i, raw in enumerate(data["models"]):
                models.append(_parse_model(raw, f"{path}: models[{i}]", origin))
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

    def __iter__(self):
        return iter(self.models.values())

    def __len__(self) -> int:
        return len(self.models)


@lru_cache(maxsize=8)
def _load_cached(paths: tuple[str, ...], stamps: tuple[float, ...]) -> Registry:
    files = [Path(p) for p in paths]
    return Registry.from_files(files, origins=["bundled"] + [str(p) for p in files[1:]])


def load_registry() -> Registry:
    """The bundled registry plus any ``ROTATIONZOO_REGISTRY`` overlays (cached per file mtime)."""
    paths = [bundled_registry_path(), *config.registry_overlays()]
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


# -- integrity checks (tools/check_registry.py, rotationzoo verify --registry) ---------------------


@dataclass
class LintReport:
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    unpinned_files: int = 0
    unpinned_sources: int = 0
    files: int = 0
    tags: int = 0
    models: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors


def lint_registry(data: Mapping[str, Any], *, schema: Mapping[str, Any] | None = None) -> LintReport:
    """Check a registry document beyond what parsing needs.

    Schema (when ``jsonschema`` and ``schema`` are available), unique ids and aliases across models,
    default tag exists, sha256 format, sizes positive, sources well-formed, revisions either 40-hex
    commits or counted as unpinned, and paths consistent with the tag they belong to.
    """
    rep = LintReport()
    if schema is not None:
        try:
            import jsonschema
        except ImportError:  # pragma: no cover - dev extra
            rep.warnings.append("jsonschema is not installed; schema not checked")
        else:
            validator = jsonschema.Draft202012Validator(schema)
            for err in sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path)):
                where = "/".join(map(str, err.absolute_path)) or "(root)"
                rep.errors.append(f"schema: {where}: {err.message}")
    models = data.get("models") if isinstance(data, Mapping) else None
    if not isinstance(models, list):
        rep.errors.append("'models' must be a list")
        return rep
    seen: dict[str, str] = {}
    for i, m in enumerate(models):
        if not isinstance(m, Mapping):
            rep.errors.append(f"models[{i}]: not an object")
            continue
        mid = str(m.get("id", f"models[{i}]"))
        rep.models += 1
        names = [mid, *m.get("aliases", []), mid.split("/", 1)[-1]]
        for n in dict.fromkeys(x.lower() for x in names):
            if n in seen and seen[n] != mid:
                rep.errors.append(f"{mid}: name '{n}' is also used by {seen[n]} (ids and aliases must be unique)")
            else:
                seen[n] = mid
        tags = m.get("tags") or {}
        if m.get("default_tag") not in tags:
            rep.errors.append(f"{mid}: default_tag '{m.get('default_tag')}' is not one of its tags ({', '.join(tags)})")
        for tname, t in tags.items():
            rep.tags += 1
            where = f"{mid}@{tname}"
            files = t.get("files") or {}
            for side in SIDES:
                f = files.get(side)
                if not isinstance(f, Mapping):
                    rep.errors.append(f"{where}: missing files.{side}")
                    continue
                rep.files += 1
                sha, size, path = f.get("sha256"), f.get("size"), str(f.get("path", ""))
                if sha is None:
                    rep.unpinned_files += 1
                elif not isinstance(sha, str) or not _SHA256.match(sha):
                    rep.errors.append(f"{where}: files.{side}.sha256 {sha!r} is not 64 lowercase hex digits")
                if size is not None and (not isinstance(size, int) or size <= 0):
                    rep.errors.append(f"{where}: files.{side}.size {size!r} must be a positive integer")
                if (sha is None) != (size is None):
                    rep.warnings.append(f"{where}: files.{side} has {'size' if sha is None else 'sha256'} but not the other")
                if not path or path.startswith("/") or ".." in path.split("/"):
                    rep.errors.append(f"{where}: files.{side}.path {path!r} must be a relative path")
                srcs = f.get("sources", t.get("sources", []))
                if not srcs:
                    rep.errors.append(f"{where}: files.{side} has no sources")
                hub_paths = [s for s in srcs if isinstance(s, Mapping) and s.get("type") in ("huggingface", "modelscope")
                             and not s.get("path")]
                if hub_paths and tname.split("/")[-1] not in path.split("/") and tname not in path:
                    rep.errors.append(f"{where}: files.{side}.path {path!r} is not under a folder named after the tag")
                if path and not path.split("/")[-1].startswith(f"{side}_"):
                    rep.errors.append(f"{where}: files.{side}.path {path!r} does not name a {side.upper()} file ({side}_…)")
                for j, s in enumerate(srcs):
                    sw = f"{where}: files.{side}.sources[{j}]"
                    if not isinstance(s, Mapping) or "type" not in s:
                        rep.errors.append(f"{sw}: not a source object")
                        continue
                    typ = s["type"]
                    if typ in ("huggingface", "modelscope"):
                        repo, rev = s.get("repo"), s.get("revision")
                        if not isinstance(repo, str) or repo.count("/") != 1 or not all(repo.split("/")):
                            rep.errors.append(f"{sw}: repo {repo!r} must be 'namespace/name'")
                        if not rev:
                            rep.errors.append(f"{sw}: no revision (always pin or name one)")
                        elif not _HEX40.match(str(rev)):
                            rep.unpinned_sources += 1
                    elif typ == "url":
                        url = str(s.get("url", ""))
                        if not url.startswith(("https://", "http://")):
                            rep.errors.append(f"{sw}: url {url!r} must start with https://")
                    elif typ == "bundled":
                        if not s.get("path"):
                            rep.errors.append(f"{sw}: bundled source needs a path")
                    else:
                        rep.errors.append(f"{sw}: unknown source type {typ!r}")
    return rep
