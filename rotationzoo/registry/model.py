"""Registry entry types: models, calibration tags, files and where to download them.

Frozen dataclasses parsed from ``registry.json`` by :mod:`rotationzoo.registry.load`. Plain
Python only (no torch), so listing and inspecting the zoo stays fast.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from ..errors import UnknownTagError
from ..headdims import HeadDims
from ..int2kv import Int2KVConfig
from ..launch import LaunchConfig
from ..vocab import SIDES, SOURCE_TYPES, Grouping, Side, SourceType, WeightDtypeName  # noqa: F401 - re-exported
from .bounds import check_architecture, check_layer_head_dims

#: An entry's serving defaults are an INT2-KV configuration (one type for the concept).
Serving = Int2KVConfig

_TAG_RE = re.compile(r"seq(?P<tokens>\d+)_prompt(?P<prompts>\d+)_group(?P<group>\d+)")
HEX40 = re.compile(r"^[0-9a-f]{40}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")


def parse_tag_name(tag: str) -> dict[str, int] | None:
    """Calibration numbers encoded in a tag: ``seq<T>_prompt<N>_group<G>`` → tokens, prompts, group_size.

    >>> parse_tag_name("longbench-seq150000_prompt44_group128")
    {'tokens': 150000, 'prompts': 44, 'group_size': 128}
    """
    m = _TAG_RE.search(tag)
    if not m:
        return None
    return {"tokens": int(m["tokens"]), "prompts": int(m["prompts"]), "group_size": int(m["group"])}


def split_model_tag(name: str) -> tuple[str, str | None]:
    """``"Qwen3-8B@longbench-seq…"`` → ``("Qwen3-8B", "longbench-seq…")``; no ``@`` → tag ``None``."""
    model, at, tag = name.partition("@")
    return model, (tag or None) if at else None


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
            return bool(self.revision and HEX40.match(self.revision))
        return True

    @property
    def is_hub(self) -> bool:
        """A Hugging Face or ModelScope repository (downloaded through the hub's client)."""
        return self.type in ("huggingface", "modelscope")

    def describe(self) -> str:
        if self.is_hub:
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

    @property
    def bundled(self) -> bool:
        """True when the first source is data shipped with the package."""
        return bool(self.sources) and self.sources[0].type == "bundled"

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
class Result:
    benchmark: str
    bf16: float | None = None
    oscar_int2: float | None = None
    source: str | None = None


@dataclass(frozen=True)
class Architecture:
    """What a model needs from a rotation pair (and what the memory planner needs from a model).

    ``num_parameters`` and ``weight_dtype`` (``bfloat16``, ``float16``, ``float32`` or ``float8``)
    give the planner the weights' size: ``num_parameters × bytes(weight_dtype)``.

    Every number is checked on construction against the bounds of :mod:`rotationzoo.registry.bounds`
    (``head_dim`` 16 … 512, at most 1024 layers and 256 KV heads, layer ids distinct, increasing and
    below ``num_layers``); a bad one raises :class:`~rotationzoo.errors.RegistryError`.
    """

    head_dim: int
    num_layers: int | None = None
    attention_layer_ids: tuple[int, ...] | None = None
    num_kv_heads: int | None = None
    num_attention_heads: int | None = None
    num_parameters: int | None = None
    weight_dtype: WeightDtypeName | None = None
    #: layers whose head_dim differs from ``head_dim`` (Gemma-4: the full-attention layers' 512).
    layer_head_dims: Mapping[int, int] | None = None

    @property
    def head_dims(self) -> HeadDims:
        """``d`` per layer: :attr:`head_dim`, except where :attr:`layer_head_dims` says otherwise."""
        return HeadDims(self.head_dim, dict(self.layer_head_dims or {}))

    def __post_init__(self) -> None:
        ids = check_architecture(self.head_dim, self.num_layers, self.attention_layer_ids, self.num_kv_heads,
                                 self.num_attention_heads, self.num_parameters, self.weight_dtype)
        object.__setattr__(self, "attention_layer_ids", ids)
        object.__setattr__(self, "layer_head_dims", check_layer_head_dims(self.layer_head_dims, ids, self.num_layers))

    def expected_layer_ids(self) -> tuple[int, ...] | None:
        """The layer ids a rotation file must cover (sparse for hybrids), or None if unknown."""
        if self.attention_layer_ids:
            return tuple(self.attention_layer_ids)
        if self.num_layers:
            return tuple(range(self.num_layers))
        return None


@dataclass(frozen=True)
class TagEntry:
    """One calibration of one model: the K/V files plus how they were made and are served.

    ``serving`` holds the INT2 settings, ``launch`` the rest of the authors' recipe (TP size,
    backends, absorption, prefix cache); ``grouping`` says whether the files hold one rotation per
    layer (``layer``) or one per KV head (``kv_head``), before anything is downloaded.
    """

    model_id: str
    name: str
    description: str
    calibration: Calibration
    objectives: Mapping[str, str]
    serving: Int2KVConfig
    results: tuple[Result, ...]
    files: Mapping[str, FileEntry]
    architecture: Architecture
    launch: LaunchConfig = LaunchConfig()
    grouping: Grouping = "layer"

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
            "grouping": self.grouping,
            "serving": self.serving.to_json(),
            "launch": self.launch.to_json(),
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


#: The variable through which the authors' current tree reads an MLA latent rotation folder.
MLA_LATENT_ENV = "SGLANG_OSCAR_MLA_KV_ROTATION_PATH"


@dataclass(frozen=True)
class LatentSet:
    """An MLA latent rotation set (GLM-5.2 / 5.3, Kimi-K3): a folder of ``layer_<id>.pt`` files, each a
    ``[rank, rank]`` rotation of the shared latent ``c_kv`` with its mean and eigenvalues. It is not a
    K/V pair: rotationzoo lists it (where it lives, the recipe that serves it) and does not load it.

    Attributes:
        location: where the folder lives (the authors' OSCAR image path).
        recipe: the authors' recipe that serves it (``rotation/run/glm-5.2.sh@51b618f1``).
    """

    location: str
    recipe: str | None = None

    def describe(self, model_id: str) -> str:
        """One line: what the set is, where it lives, how the authors' tree reads it."""
        via = f" by the recipe {self.recipe}" if self.recipe else ""
        return (f"{model_id} has an MLA latent rotation set, not a K/V pair: a folder of layer_<id>.pt files (one "
                f"[rank, rank] rotation of the shared latent per layer) at {self.location}, read through "
                f"{MLA_LATENT_ENV}{via}; rotationzoo lists it and does not load it (yet)")


@dataclass(frozen=True)
class ModelEntry:
    """A model of the registry: its calibration tags (K/V pairs), or, for an MLA model, its latent set.

    ``default_tag`` is ``None`` and ``tags`` empty exactly when ``mla_latent`` is given; such a model
    may omit its ``architecture``.
    """

    id: str
    aliases: tuple[str, ...]
    description: str
    architecture: Architecture | None
    default_tag: str | None
    tags: Mapping[str, TagEntry]
    origin: str = "bundled"
    mla_latent: LatentSet | None = None

    def tag(self, name: str | None = None) -> TagEntry:
        """The named tag (default tag when ``None``); matching is case-insensitive.

        Raises:
            UnknownTagError: no such tag, or the model has an MLA latent set and no K/V pair at all.
        """
        if self.mla_latent is not None or self.default_tag is None:
            raise UnknownTagError(self.mla_latent.describe(self.id) if self.mla_latent is not None
                                  else f"{self.id} has no calibration tags")
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
        arch = self.architecture
        out: dict[str, Any] = {
            "id": self.id,
            "aliases": list(self.aliases),
            "description": self.description,
            "architecture": {k: v for k, v in asdict(arch).items() if v is not None} if arch is not None else None,
            "default_tag": self.default_tag,
            "tags": list(self.tags),
            "origin": self.origin,
        }
        if self.mla_latent is not None:
            out["mla_latent"] = {**{k: v for k, v in asdict(self.mla_latent).items() if v is not None},
                                 "env": MLA_LATENT_ENV, "loaded_by_rotationzoo": False}
        if full:
            out["tags"] = {name: t.to_json() for name, t in self.tags.items()}
        return out
