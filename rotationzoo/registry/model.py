"""Registry entry types: models, calibration tags, files and where to download them.

Frozen dataclasses parsed from ``registry.json`` by :mod:`rotationzoo.registry.load`. Plain
Python only (no torch), so listing and inspecting the zoo stays fast.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from ..errors import ConfigError, UnknownTagError
from ..headdims import HeadDims
from ..int2kv import Int2KVConfig
from ..launch import LaunchConfig
from ..numbers import shown
from ..vocab import SIDES, SOURCE_TYPES, Grouping, Side, SourceType, WeightDtypeName  # noqa: F401 - re-exported
from ..sharding import check_tp_size
from .bounds import check_architecture, check_gguf_architecture, check_layer_head_dims, check_weight_blocks

#: An entry's serving defaults are an INT2-KV configuration (one type for the concept).
Serving = Int2KVConfig

_TAG_RE = re.compile(r"seq(?P<tokens>\d+)_prompt(?P<prompts>\d+)_group(?P<group>\d+)")
HEX40 = re.compile(r"^[0-9a-f]{40}$")


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
    """``"Qwen3-8B@longbench-seq…"`` → ``("Qwen3-8B", "longbench-seq…")``; no ``@`` → tag ``None``.

    Raises:
        ConfigError: ``name`` is not a string, or has nothing before or after its ``@`` (``"$MODEL@$TAG"`` with
            a variable unset: taken as the whole model, a removal would take every tag).
    """
    if not isinstance(name, str):
        raise ConfigError(f"a model is named by its registry id or alias (MODEL or MODEL@TAG), a string such as "
                          f"'Qwen3-8B', got {type(name).__name__} {shown(name)}")
    model, at, tag = name.partition("@")
    if at and not (model and tag):
        raise ConfigError(f"{shown(name)} names {'no tag after' if model else 'no model before'} its '@' (an unset "
                          f"shell variable?); give MODEL or MODEL@TAG")
    return model, tag if at else None


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
        """The file's name in the cache: the path's last part (``k_rotation.pt`` for ``k_rotation_*.pt``)."""
        name = self.path.rsplit("/", 1)[-1]
        return name.replace("_*", "").replace("-*", "").replace("*", "") if self.pattern else name

    @property
    def pattern(self) -> bool:
        """The path names the one file of its folder matching a ``*`` (resolved at the source)."""
        return "*" in self.path

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
    """One published score of an entry: the model unquantized (``bf16``) and with this entry's INT2 store
    (``oscar_int2``); ``context``: the tokens per sequence it was measured at, when one length applies (then
    :meth:`TagEntry.bits_per_element` gives the score's bits per element, windows included)."""

    benchmark: str
    bf16: float | None = None
    oscar_int2: float | None = None
    source: str | None = None
    context: int | None = None


@dataclass(frozen=True)
class Conflict:
    """Two sources of the authors that disagree on a setting: what each says, and which the entry follows."""

    about: str
    chosen: str
    sources: tuple[tuple[str, str], ...]  # (source, what it says)

    def describe(self) -> str:
        said = "; ".join(f"{src} says {says}" for src, says in self.sources)
        return f"the authors' sources disagree on {self.about}: {said}; the entry follows {self.chosen}"

    def to_json(self) -> dict[str, Any]:
        return {"about": self.about, "chosen": self.chosen,
                "sources": [{"source": src, "says": says} for src, says in self.sources]}


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
    #: block-quantized MoE weights: the experts' intermediate size and the checkpoint's block width, which
    #: decide the TP sizes it can be served at (:meth:`check_tp_size`; MiniMax-M2.7: 1536 and 128)
    moe_intermediate_size: int | None = None
    weight_block_size: int | None = None
    #: llama.cpp's ``general.architecture`` of the model's GGUF (``qwen3``), where its id does not tell
    #: (:func:`rotationzoo.engines.llama_architecture` reads ids like ``Qwen/Qwen3-8B``)
    gguf_architecture: str | None = None

    @property
    def head_dims(self) -> HeadDims:
        """``d`` per layer: :attr:`head_dim`, except where :attr:`layer_head_dims` says otherwise."""
        return HeadDims(self.head_dim, dict(self.layer_head_dims or {}))

    def __post_init__(self) -> None:
        ids = check_architecture(self.head_dim, self.num_layers, self.attention_layer_ids, self.num_kv_heads,
                                 self.num_attention_heads, self.num_parameters, self.weight_dtype)
        object.__setattr__(self, "attention_layer_ids", ids)
        object.__setattr__(self, "layer_head_dims", check_layer_head_dims(self.layer_head_dims, ids, self.num_layers))
        check_weight_blocks(self.moe_intermediate_size, self.weight_block_size)
        check_gguf_architecture(self.gguf_architecture)

    def check_tp_size(self, tp_size: int, ep_size: int = 1, expert_parallel: str = "groups") -> None:
        """Refuse a TP size (with ``ep_size`` expert-parallel groups) this model cannot be served at (its KV heads,
        its block-quantized MoE weights: :func:`rotationzoo.sharding.check_tp_size`; ``expert_parallel``, the
        engine's kind, picks the EP sizes a refusal suggests); :class:`~rotationzoo.errors.ConfigError`, one line."""
        check_tp_size(tp_size, num_kv_heads=self.num_kv_heads, moe_intermediate_size=self.moe_intermediate_size,
                      weight_block_size=self.weight_block_size, ep_size=ep_size, expert_parallel=expert_parallel)

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
    #: set when the entry stands for an MLA latent set's files (see :meth:`LatentSet.entry`)
    latent: "LatentSet | None" = None
    #: settings on which the authors' own sources disagree (shown by ``info`` and ``serve-args``)
    conflicts: tuple[Conflict, ...] = ()

    @property
    def key(self) -> str:
        """``model@tag``, e.g. ``Qwen/Qwen3-8B@seq20000_prompt83_group128``."""
        return f"{self.model_id}@{self.name}"

    @property
    def pinned(self) -> bool:
        return all(f.pinned for f in self.files.values())

    def bits_per_element(self, context: int) -> float | None:
        """Stored bits per K/V element of this entry's INT2 store at ``context`` tokens (codes, scales and
        zeros, windows; :meth:`rotationzoo.kvformat.KVFormat.bits_per_element`), ``None`` without a head_dim."""
        d = self.architecture.head_dim
        return self.serving.kv_format().bits_per_element(d, context) if d else None

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model_id,
            "tag": self.name,
            "description": self.description,
            "calibration": asdict(self.calibration),
            "objectives": dict(self.objectives),
            "grouping": self.grouping,
            "serving": self.serving.to_json(),
            "format": self.serving.kv_format().name,
            "launch": self.launch.to_json(),
            "results": [{**asdict(r), "bits_per_element": self.bits_per_element(r.context) if r.context else None}
                        for r in self.results],
            "conflicts": [c.to_json() for c in self.conflicts],
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
#: Attention backends of the MLA recipes (GLM-5.3 serves DSA sparse attention through ``nsa``).
MLA_ATTENTION_BACKENDS = ("triton", "nsa")
#: Bits per latent value the packed pool implements.
MLA_BITS = (2, 4)


def latent_file_key(layer_id: int) -> str:
    """The key of one layer's file in a latent set's :class:`TagEntry` (``layer_12``)."""
    return f"layer_{layer_id}"


@dataclass(frozen=True)
class LatentSet:
    """An MLA latent rotation set (GLM-5.2 / 5.3, Kimi-K3): a folder of ``layer_<id>.pt`` files, each a
    ``[rank, rank]`` rotation of the shared latent ``c_kv`` (a bare tensor, or the OSCAR-2 dict with its
    mean and inverse), and the settings of the recipe that serves it.

    Attributes:
        location: where the authors keep the folder in their OSCAR image (printable text).
        recipe: the authors' recipe that serves it (``rotation/run/glm-5.2.sh@51b618f1``).
        name: the set's name (its cache folder), e.g. ``c_kv_rcov_phblock_g128``.
        path: the folder inside the hub repositories of ``sources`` (``None``: not published).
        sources: where the folder's files can be downloaded, tried in order (empty: import a copy
            with ``rotationzoo cache import FOLDER --latent MODEL``).
        rank: the latent width (``kv_lora_rank``).
        num_layers, layer_ids, layer_count: the model's latent layers: ``0 … num_layers-1``, an
            explicit list, or only their number (ids unknown); with none of them the folder's ids must
            run from 0 without a gap.
        bits: bits per latent value in the packed pool (2, or 4 for a latent that 2 bits cannot hold).
        group_size: latent values per scale/zero pair; ``lloyd_max``: pinned on/off, ``None`` = the
            pool's default (on at 2 bits).
        prefix_tokens, recent_tokens: the BF16 sink and recent windows.
        tp_size, pp_size, attention backends, mamba_scheduler_strategy: the recipe's launch.
        hp_subspace: the folder (inside the hub repositories) of ``[k, rank]`` high-precision
            subspaces, when the set has one.
        notes: what the authors measured or say about it, shown by ``info``.
    """

    location: str
    recipe: str | None = None
    name: str = "latent"
    path: str | None = None
    sources: tuple[Source, ...] = ()
    rank: int = 512
    num_layers: int | None = None
    layer_ids: tuple[int, ...] | None = None
    layer_count: int | None = None
    bits: int = 2
    group_size: int = 128
    lloyd_max: bool | None = None
    prefix_tokens: int = 64
    recent_tokens: int = 256
    tp_size: int = 1
    pp_size: int = 1
    attention_backend: str = "triton"
    prefill_attention_backend: str = "triton"
    decode_attention_backend: str = "triton"
    mamba_scheduler_strategy: str | None = None
    hp_subspace: str | None = None
    notes: tuple[str, ...] = ()

    @property
    def expected_layer_ids(self) -> tuple[int, ...] | None:
        """The latent layer ids the folder must cover, when the registry knows them."""
        if self.layer_ids is not None:
            return self.layer_ids
        return tuple(range(self.num_layers)) if self.num_layers else None

    @property
    def published(self) -> bool:
        return bool(self.sources) and self.path is not None

    def entry(self, model_id: str, layer_ids: tuple[int, ...] | None = None, *, subspace: bool = False) -> TagEntry:
        """The set as a :class:`TagEntry` whose files are its ``layer_<id>.pt`` (keyed ``layer_<id>``), so
        the hub fetches, pins, marks and caches them as it does K/V files. ``layer_ids`` overrides the
        expected ids (a set whose ids the registry does not know: those found in a copy); ``subspace``
        gives the high-precision subspace folder's entry instead (tag ``<name>-hp``)."""
        ids = layer_ids if layer_ids is not None else self.expected_layer_ids or ()
        folder = self.hp_subspace if subspace else self.path
        files = {latent_file_key(i): FileEntry(side=latent_file_key(i),  # type: ignore[arg-type]
                                               path=f"{folder or self.name}/layer_{i}.pt", sha256=None, size=None,
                                               sources=self.sources)
                 for i in ids}
        arch = Architecture(head_dim=self.rank, num_layers=max(ids) + 1 if ids else None,
                            attention_layer_ids=tuple(ids) or None)
        return TagEntry(model_id=model_id, name=self.name + ("-hp" if subspace else ""),
                        description=f"MLA latent rotation set {self.name}", calibration=Calibration(),
                        objectives={}, serving=Int2KVConfig(prefix_tokens=self.prefix_tokens,
                                                            recent_tokens=self.recent_tokens),
                        results=(), files=files, architecture=arch, latent=self)

    def describe(self, model_id: str) -> str:
        """One line: what the set is, where it comes from, how the authors' tree reads it."""
        where = (f"{', '.join(s.describe() for s in self.sources)} ({self.path}/)" if self.published
                 else f"not published in a hub; the authors keep it at {self.location}")
        return (f"{model_id} has an MLA latent rotation set {self.name}, not a K/V pair: a folder of layer_<id>.pt "
                f"files (one [{self.rank}, {self.rank}] rotation of the shared latent per layer) from {where}, read "
                f"through {MLA_LATENT_ENV}")

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if v is not None and k != "sources"}
        out["sources"] = [s.to_json() for s in self.sources]
        out["env"] = MLA_LATENT_ENV
        return out


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
    #: Hugging Face repositories of ready-made llama.cpp model GGUFs with the rotations appended
    prebuilt_gguf: tuple[str, ...] = ()

    def tag(self, name: str | None = None) -> TagEntry:
        """The named tag (default tag when ``None``); matching is case-insensitive.

        Raises:
            UnknownTagError: no such tag, or the model has an MLA latent set and no K/V pair at all.
            ConfigError: ``name`` is not a string.
        """
        if self.mla_latent is not None or self.default_tag is None:
            raise UnknownTagError(self.mla_latent.describe(self.id) if self.mla_latent is not None
                                  else f"{self.id} has no calibration tags")
        if name is None:
            return self.tags[self.default_tag]
        if not isinstance(name, str):
            raise ConfigError(f"a tag is named by a string such as {self.default_tag!r} (or None for the default), "
                              f"got {type(name).__name__} {shown(name)}")
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
            "prebuilt_gguf": list(self.prebuilt_gguf),
        }
        if self.mla_latent is not None:
            out["mla_latent"] = self.mla_latent.to_json()
        if full:
            out["tags"] = {name: t.to_json() for name, t in self.tags.items()}
        return out
