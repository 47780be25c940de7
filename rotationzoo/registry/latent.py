"""Parsing a model's ``mla_latent`` block (an MLA latent rotation set and the recipe that serves it).

Every value is checked here, one line naming the field: the folder ``path`` and ``hp_subspace`` as
relative paths, the sources as a tag's are, ``rank`` a registry head_dim, the layers (``num_layers``,
``layer_ids`` or ``layer_count``), ``bits`` 2 or 4 (Lloyd-Max levels only at 2), ``group_size``
dividing ``rank``, windows and parallel sizes within their bounds, backends from
:data:`~rotationzoo.registry.model.MLA_ATTENTION_BACKENDS`, ``recipe`` by the recipe rule.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ..errors import ConfigError, RegistryError
from ..int2kv import MAX_CONTEXT_TOKENS
from ..launch import LaunchConfig
from ..numbers import check_int, shown
from ..sharding import MAX_TP
from ..vocab import MAMBA_SCHEDULER_STRATEGIES
from . import bounds, safety
from .model import MLA_ATTENTION_BACKENDS, MLA_BITS, LatentSet, Source

_KEYS = ("location", "recipe", "name", "path", "sources", "rank", "num_layers", "layer_ids", "layer_count", "bits",
         "group_size", "lloyd_max", "prefix_tokens", "recent_tokens", "tp_size", "pp_size", "attention_backend",
         "prefill_attention_backend", "decode_attention_backend", "mamba_scheduler_strategy", "hp_subspace", "notes")
_BACKENDS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
MAX_NOTE_CHARS = 400


def _int(raw: Mapping[str, Any], key: str, where: str, low: int, high: int, default: int | None) -> int | None:
    value = raw.get(key, default)
    if value is None:
        return None
    try:
        return check_int(value, f"{where}.{key}", low=low, high=high)
    except ConfigError as exc:
        raise RegistryError(str(exc)) from None


def parse_latent(raw: Any, where: str, parse_source: Callable[[Mapping[str, Any], str], Source]) -> LatentSet:
    """A model's ``mla_latent`` block → :class:`LatentSet` (one-line :class:`RegistryError` on any problem)."""
    if not isinstance(raw, Mapping) or "location" not in raw:
        raise RegistryError(f"{where} must be an object with at least a location, got {shown(raw)}")
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise RegistryError(f"{where}: unknown key(s) {', '.join(map(shown, unknown[:5]))}; expected {', '.join(_KEYS)}")
    loc = raw["location"]
    if not isinstance(loc, str) or not 1 <= len(loc) <= 200 or not loc.isprintable():
        raise RegistryError(f"{where}.location must be a printable string of 1 to 200 characters, got {shown(loc)}")
    try:
        LaunchConfig(recipe=raw.get("recipe"))  # the one rule for recipe names
    except ConfigError as exc:
        raise RegistryError(f"{where}: {exc}") from None
    name = safety.check_tag(raw.get("name", "latent"), f"{where}.name")
    path = safety.check_relpath(raw["path"], f"{where}.path") if raw.get("path") is not None else None
    hp = safety.check_relpath(raw["hp_subspace"], f"{where}.hp_subspace") if raw.get("hp_subspace") else None
    sources = tuple(parse_source(s, f"{where}.sources[{i}]") for i, s in enumerate(raw.get("sources") or []))
    if any(not s.is_hub for s in sources):
        raise RegistryError(f"{where}.sources: a latent set is a folder; give huggingface or modelscope sources")
    if sources and path is None:
        raise RegistryError(f"{where}: sources need the folder's path inside the repositories")
    rank = raw.get("rank", 512)
    if type(rank) is not int or rank not in bounds.REGISTRY_HEAD_DIMS:
        raise RegistryError(f"{where}.rank must be one of {', '.join(map(str, bounds.REGISTRY_HEAD_DIMS))}, "
                            f"got {shown(rank)}")
    num_layers = _int(raw, "num_layers", where, 1, bounds.MAX_LAYERS, None)
    layer_count = _int(raw, "layer_count", where, 1, bounds.MAX_LAYERS, None)
    ids = bounds._layer_ids(raw.get("layer_ids"), None, where) if raw.get("layer_ids") is not None else None
    if sum(x is not None for x in (num_layers, layer_count, ids)) > 1:
        raise RegistryError(f"{where}: give one of num_layers, layer_ids and layer_count")
    if sources and num_layers is None and ids is None:
        raise RegistryError(f"{where}: a published set needs its layers (num_layers or layer_ids) to fetch them")
    bits = raw.get("bits", 2)
    if type(bits) is not int or bits not in MLA_BITS:
        raise RegistryError(f"{where}.bits must be one of {', '.join(map(str, MLA_BITS))}, got {shown(bits)}")
    lloyd = raw.get("lloyd_max")
    if lloyd is not None and not isinstance(lloyd, bool):
        raise RegistryError(f"{where}.lloyd_max must be true, false or null (the pool's default), got {shown(lloyd)}")
    if lloyd and bits != 2:
        raise RegistryError(f"{where}: lloyd_max is a 2-bit codebook, but bits is {bits}")
    group = _int(raw, "group_size", where, 16, rank, 128)
    if group is None:
        raise RegistryError(f"{where}.group_size must be an integer from 16 to {rank}, got null")
    if rank % group:
        raise RegistryError(f"{where}.group_size {group} does not divide rank {rank}")
    windows = {k: _int(raw, k, where, 0, MAX_CONTEXT_TOKENS, d) for k, d in (("prefix_tokens", 64), ("recent_tokens", 256))}
    tp, pp = _int(raw, "tp_size", where, 1, MAX_TP, 1), _int(raw, "pp_size", where, 1, 64, 1)
    backends = {k: raw.get(k, "triton") for k in _BACKENDS}
    for k, v in backends.items():
        if v not in MLA_ATTENTION_BACKENDS:
            raise RegistryError(f"{where}.{k} must be one of {', '.join(MLA_ATTENTION_BACKENDS)}, got {shown(v)}")
    mamba = raw.get("mamba_scheduler_strategy")
    if mamba is not None and mamba not in MAMBA_SCHEDULER_STRATEGIES:
        raise RegistryError(f"{where}.mamba_scheduler_strategy must be one of {', '.join(MAMBA_SCHEDULER_STRATEGIES)} "
                            f"or null, got {shown(mamba)}")
    notes = raw.get("notes") or []
    if not isinstance(notes, list) or not all(isinstance(n, str) and 1 <= len(n) <= MAX_NOTE_CHARS and n.isprintable()
                                              for n in notes):
        raise RegistryError(f"{where}.notes must be a list of printable strings of at most {MAX_NOTE_CHARS} characters")
    return LatentSet(location=loc, recipe=raw.get("recipe"), name=name, path=path, sources=sources, rank=rank,
                     num_layers=num_layers, layer_ids=ids, layer_count=layer_count, bits=bits, group_size=group,
                     lloyd_max=lloyd, prefix_tokens=windows["prefix_tokens"] or 0,
                     recent_tokens=windows["recent_tokens"] or 0, tp_size=tp or 1, pp_size=pp or 1,
                     mamba_scheduler_strategy=mamba, hp_subspace=hp, notes=tuple(notes), **backends)
