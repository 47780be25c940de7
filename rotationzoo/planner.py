"""Memory planning: KV-cache bytes of BF16, FP8 and OSCAR INT2, and what fits on one GPU.

:func:`plan` answers "how much memory does INT2 KV save for my model and context, and how many
sequences fit?" from a model's registry architecture and an :class:`~rotationzoo.int2kv.Int2KVConfig`
(the entry's serving settings unless another is given). Pure arithmetic: no torch, no download.

Per token, over every layer that holds a KV cache (only ``attention_layer_ids`` for hybrids), K and
V: ``2 · layers_with_kv · num_kv_heads · head_dim · bits / 8`` bytes, with

- ``bf16``: 16 bits; ``fp8``: 8 bits (no windows, scales not counted);
- ``oscar_int2``: ``2 + 2 · bits(scale_dtype) / G`` bits for INT2 tokens (2-bit codes plus one
  scale and one zero per group of ``G`` dims) and ``bits(hp_dtype)`` for the
  ``min(L, prefix_tokens + recent_tokens)`` window tokens of each sequence: per element, the one formula
  of :meth:`rotationzoo.kvformat.KVFormat.bits_per_element` (``docs/kv-formats.md``).

``sequence_bytes`` is exact (what :class:`~rotationzoo.integrations.transformers.OscarInt2Cache`
holds for ``L`` tokens); ``sequence_bytes_paged`` rounds each tier (prefix window, INT2 history,
recent window) up to whole pages of the engine. Capacity is computed on the paged figure within
``gpu_memory · (1 − reserve) − weights``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Callable

from .engines import VLLM_DEFAULT_BLOCK, check_engine, target
from .errors import ConfigError
from .int2kv import DTYPE_BITS, MAX_CONTEXT_TOKENS, Int2KVConfig
from .numbers import check_int, check_real, shown
from .registry import Architecture, ModelEntry, TagEntry, get_model
from .registry.model import split_model_tag

#: KV-cache formats compared, in output order.
KV_FORMATS: tuple[str, ...] = ("bf16", "fp8", "oscar_int2")
#: Default fraction of GPU memory kept for activations, CUDA graphs and workspace (vLLM's default
#: ``gpu_memory_utilization`` is 0.9; SGLang's ``mem_fraction_static`` is about 0.88).
DEFAULT_RESERVE = 0.1
#: Tokens per KV page (block) of each engine; SGLang's is the fork's quantised page ``4·itemsize(hp_dtype)``.
VLLM_BLOCK_TOKENS = VLLM_DEFAULT_BLOCK
#: Bits per parameter of each ``architecture.weight_dtype``.
WEIGHT_DTYPE_BITS: dict[str, int] = {"float32": 32, "bfloat16": 16, "float16": 16, "float8": 8}
#: Most concurrent sequences a plan may ask for (``batch``): 2^20 = 1,048,576.
MAX_BATCH = 2**20
#: Largest memory a plan may name (``gpu_memory_bytes``, ``weights_bytes``): 2^50 bytes = 1 PiB,
#: far beyond one model replica today (8 × 141 GB is 1.1 TB).
MAX_MEMORY_BYTES = 2**50
_HP_BYTES = {name: bits // 8 for name, bits in DTYPE_BITS.items()}


#: Size suffixes: SI (powers of 1000) with or without ``B``, IEC (powers of 1024) with ``iB``.
_SIZE_UNITS: dict[str, int] = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    _SIZE_UNITS.update({_p: 1000 ** _i, f"{_p}b": 1000 ** _i, f"{_p}ib": 1024 ** _i})
_SIZE_RE = re.compile(r"^\s*(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-z]*)\s*$", re.IGNORECASE)
#: Longest size text :func:`parse_size` reads (``1125899906842624`` is 16 characters).
_SIZE_CHARS = 40
#: Smallest GPU memory :func:`parse_gpu_memory` reads from a number without a unit (1 MiB): a smaller one is a
#: unit left out (``--gpu-memory 80`` meant 80GiB, not 80 bytes).
MIN_UNITLESS_GPU_BYTES = 2**20


def parse_size(text: str) -> int:
    """Bytes of a size such as ``80GiB``, ``80GB``, ``141G``, ``80000MiB`` or ``1.5TB``.

    ``KiB``/``MiB``/``GiB``/``TiB`` are binary (1 GiB = 1024³ bytes); ``K``/``M``/``G``/``T`` with or
    without ``B`` are decimal (1 GB = 1 G = 10⁹ bytes); a bare number is bytes. Case is ignored.

    Raises:
        ConfigError: not a size with a known unit, or not from one byte to :data:`MAX_MEMORY_BYTES` (1 PiB).
    """
    text = str(text)
    m = _SIZE_RE.match(text) if len(text) <= _SIZE_CHARS else None
    unit = m["unit"].lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise ConfigError(f"cannot read the size {shown(text)}; write e.g. 80GiB (binary), 80GB or 80G (decimal), "
                          f"80000MiB, or a byte count (at most {_SIZE_CHARS} characters)")
    exact = Decimal(m["num"]) * _SIZE_UNITS[unit]  # exact: no float overflow or rounding of long numbers
    if not 1 <= exact <= MAX_MEMORY_BYTES:
        raise ConfigError(f"size {shown(text)} must be from one byte to {MAX_MEMORY_BYTES:,} bytes (1 PiB, "
                          f"written 1024TiB)")
    return round(exact)


def parse_gpu_memory(text: str) -> int:
    """Bytes of a GPU memory size (``--gpu-memory``): :func:`parse_size`, except that a number without a unit
    below :data:`MIN_UNITLESS_GPU_BYTES` (1 MiB) is refused as a unit left out (``80`` is 80 bytes, not 80GiB).

    Raises:
        ConfigError: as :func:`parse_size`, or such a number, with the size it probably meant.
    """
    n = parse_size(text)
    m = _SIZE_RE.match(str(text))  # parse_size read it: it matches
    if n < MIN_UNITLESS_GPU_BYTES and m is not None and not m["unit"]:
        raise ConfigError(f"GPU memory {shown(text)} has no unit, so it is {n:,} bytes (less than 1 MiB); did you "
                          f"mean {str(text).strip()}GiB? Write the unit: 80GiB (binary), 80GB (decimal) or 80000MiB")
    return n


def check_reserve(reserve: float, what: str = "reserve") -> float:
    """``reserve`` (the fraction of GPU memory kept for activations and workspace) as a float: a finite number
    in [0, 1); ``what`` names it in the refusal (``--reserve`` on the command line).

    Raises:
        ConfigError: NaN, infinite, negative, 1 or more, or not a number.
    """
    return check_real(reserve, what, low=0.0, high=1.0, high_open=True)


def gib_bytes(gib: float, what: str = "weights_gib") -> int:
    """Bytes of ``gib`` GiB (``--weights-gib``): a finite number from 0 to 2^20 GiB (1 PiB).

    Raises:
        ConfigError: NaN, infinite, negative or beyond 1 PiB.
    """
    return round(check_real(gib, what, low=0.0, high=MAX_MEMORY_BYTES / 2**30) * 2**30)


def engine_page_size(engine: str, hp_dtype: str = "bfloat16") -> int:
    """Tokens per KV page, from the engine table: the SGLang targets ``4 · itemsize(hp_dtype)`` (8 for
    bfloat16), the vLLM targets 16, llama.cpp 1."""
    return target(engine).page_size(hp_dtype)


@dataclass(frozen=True)
class KVFormatPlan:
    """KV-cache figures of one storage format at the plan's context and batch.

    Attributes:
        name: ``bf16``, ``fp8`` or ``oscar_int2``.
        bytes_per_token: bytes of one token over all KV layers, K and V (INT2 tokens for
            ``oscar_int2``; window tokens cost ``window_bytes_per_token``).
        window_bytes_per_token: bytes of one ``hp_dtype`` window token (0 without windows).
        window_tokens: tokens of one sequence kept in ``hp_dtype`` at this context.
        bits_per_element: average stored bits per K/V element at this context (BPE).
        sequence_bytes: exact bytes of one sequence of ``context`` tokens (no page rounding).
        sequence_bytes_paged: the same with each tier rounded up to whole engine pages.
        batch_bytes: ``batch · sequence_bytes``; batch_bytes_paged: ``batch · sequence_bytes_paged``.
        saving_vs_bf16: ``bf16 sequence_bytes / sequence_bytes`` (1.0 for bf16).
        max_context: longest context (a whole number of pages) for ``batch`` sequences, or None
            without a GPU memory figure.
        max_sequences: sequences of ``context`` tokens that fit, or None without a GPU memory figure.
        fits: whether ``batch`` sequences of ``context`` tokens fit, or None.
    """

    name: str
    bytes_per_token: int
    window_bytes_per_token: int
    window_tokens: int
    bits_per_element: float
    sequence_bytes: int
    sequence_bytes_paged: int
    batch_bytes: int
    batch_bytes_paged: int
    saving_vs_bf16: float
    max_context: int | None
    max_sequences: int | None
    fits: bool | None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class MemoryPlan:
    """The answer of :func:`plan`: the model's KV shape, the memory budget and one
    :class:`KVFormatPlan` per format (``bf16``, ``fp8``, ``oscar_int2``)."""

    model: str
    tag: str | None
    engine: str
    page_size: int
    context: int
    batch: int
    layers_with_kv: int
    num_kv_heads: int
    head_dim: int
    group_size: int
    config: Int2KVConfig
    gpu_memory_bytes: int | None
    reserve: float
    weights_bytes: int | None
    weights_source: str | None
    kv_budget_bytes: int | None
    formats: tuple[KVFormatPlan, ...]
    notes: tuple[str, ...]

    def format(self, name: str) -> KVFormatPlan:
        """The figures of one format (``bf16``, ``fp8`` or ``oscar_int2``)."""
        for f in self.formats:
            if f.name == name:
                return f
        raise ConfigError(f"unknown KV format {name!r}; expected one of {', '.join(KV_FORMATS)}")

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("config", "formats", "notes")}
        out["config"] = self.config.to_json()
        out["formats"] = {f.name: f.to_json() for f in self.formats}
        out["notes"] = list(self.notes)
        return out


@dataclass(frozen=True)
class _Shape:
    """Bytes per token of each tier and the window sizes of one format."""

    name: str
    per_token: int
    window_per_token: int
    prefix: int
    recent: int

    def tiers(self, tokens: int) -> tuple[int, int, int]:
        """``(prefix, low-precision history, recent)`` token counts of a sequence (SGLang's split)."""
        prefix = min(tokens, self.prefix)
        recent = min(max(tokens - prefix, 0), self.recent)
        return prefix, tokens - prefix - recent, recent

    def nbytes(self, tokens: int, page: int = 1) -> int:
        prefix, body, recent = (math.ceil(n / page) * page for n in self.tiers(tokens))
        return body * self.per_token + (prefix + recent) * self.window_per_token


def _resolve(model: Any, tag_name: str | None = None) -> tuple[str, str | None, Architecture, TagEntry | None]:
    """``(model id, tag, architecture, registry entry)`` of a name, an entry or a bare architecture; ``tag_name``
    picks a tag of a name or a :class:`ModelEntry` (and must agree with ``MODEL@TAG``)."""
    if isinstance(model, TagEntry) and tag_name is not None:
        raise ConfigError("tag= picks a tag of a model name or a ModelEntry; a TagEntry is one tag already")
    if isinstance(model, Architecture) and tag_name is not None:
        raise ConfigError("tag= picks a tag of a registry model; a bare Architecture has no tags")
    if isinstance(model, Architecture):
        return "custom", None, model, None
    if isinstance(model, TagEntry):
        return model.model_id, model.name, model.architecture, model
    if isinstance(model, ModelEntry):
        tag = model.tag(tag_name)
        return model.id, tag.name, tag.architecture, tag
    if isinstance(model, str):
        name, at_tag = split_model_tag(model)
        if tag_name is not None and at_tag is not None and tag_name != at_tag:
            raise ConfigError(f"tag {tag_name!r} (--tag) and {model!r} name different tags; give one")
        tag = get_model(name).tag(tag_name or at_tag)
        return tag.model_id, tag.name, tag.architecture, tag
    raise ConfigError(f"plan needs a model name, a ModelEntry, a TagEntry or an Architecture, got {type(model).__name__}")


def _kv_shape(name: str, arch: Architecture) -> tuple[int, int]:
    """``(layers_with_kv, num_kv_heads)``; a missing field is a one-line error saying what to add."""
    ids = arch.expected_layer_ids()
    if not ids:
        raise ConfigError(f"{name}: the registry gives neither num_layers nor attention_layer_ids; "
                          "add them (a ROTATIONZOO_REGISTRY overlay) or plan with an Architecture")
    if not arch.num_kv_heads:
        raise ConfigError(f"{name}: the registry has no architecture.num_kv_heads; add it (a ROTATIONZOO_REGISTRY "
                          "overlay) or plan with an Architecture")
    return len(ids), int(arch.num_kv_heads)


def _weights(name: str, arch: Architecture, weights_bytes: int | None) -> tuple[int | None, str | None]:
    if weights_bytes is not None:
        return check_int(weights_bytes, "weights_bytes", low=0, high=MAX_MEMORY_BYTES, hint=" (1 PiB)"), "given"
    if arch.num_parameters is None or arch.weight_dtype is None:
        return None, None
    nbytes = arch.num_parameters * WEIGHT_DTYPE_BITS[arch.weight_dtype] // 8
    return nbytes, f"{_count(arch.num_parameters)} parameters × {arch.weight_dtype}"


def _count(n: int) -> str:
    """``8200000000`` → ``8.2B``; ``134515008`` → ``134.5M``."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return str(n)


def _largest(fits: Callable[[int], bool], step: int) -> int:
    """The largest multiple ``n`` of ``step`` with ``fits(n)`` (``fits`` monotone; 0 if none)."""
    if not fits(step):
        return 0
    lo, hi = 1, 2
    while fits(hi * step):
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # fits(lo·step), not fits(hi·step)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
    return lo * step


def _format_plan(s: _Shape, context: int, batch: int, page: int, budget: int | None, elems: int,
                 bf16_bytes: int) -> KVFormatPlan:
    """The figures of one format; capacities only with a ``budget`` (bytes for the KV cache)."""
    exact, paged = s.nbytes(context), s.nbytes(context, page)
    prefix, _, recent = s.tiers(context)
    return KVFormatPlan(
        name=s.name, bytes_per_token=s.per_token, window_bytes_per_token=s.window_per_token,
        window_tokens=prefix + recent, bits_per_element=8.0 * exact / (elems * context),
        sequence_bytes=exact, sequence_bytes_paged=paged, batch_bytes=batch * exact,
        batch_bytes_paged=batch * paged, saving_vs_bf16=bf16_bytes / exact,
        max_context=_largest(lambda n: batch * s.nbytes(n, page) <= budget, page) if budget is not None else None,
        max_sequences=max(budget, 0) // paged if budget is not None else None,
        fits=batch * paged <= budget if budget is not None else None,
    )


def _check_inputs(context: int, batch: int, gpu_memory_bytes: int | None, reserve: float) -> float:
    """Every number of a plan within its documented bound (docs/plan.md); the reserve as a float."""
    check_int(context, "context", low=1, high=MAX_CONTEXT_TOKENS, hint=" tokens (2^30)")
    check_int(batch, "batch", low=1, high=MAX_BATCH, hint=" sequences (2^20)")
    if gpu_memory_bytes is not None:
        check_int(gpu_memory_bytes, "gpu_memory_bytes", low=1, high=MAX_MEMORY_BYTES, hint=" (1 PiB)")
    return check_reserve(reserve)


def plan(
    model: Any,
    tag: str | None = None,
    *,
    context: int,
    batch: int | None = None,
    gpu_memory_bytes: int | None = None,
    engine: str = "sglang",
    weights_bytes: int | None = None,
    config: Int2KVConfig | None = None,
    reserve: float = DEFAULT_RESERVE,
) -> MemoryPlan:
    """KV-cache memory of BF16, FP8 and OSCAR INT2 for a model, and what fits on one GPU.

    Args:
        model: a registry name (``"Qwen3-8B"``, ``"MODEL@TAG"``), a
            :class:`~rotationzoo.registry.ModelEntry` (its default tag), a
            :class:`~rotationzoo.registry.TagEntry`, or a bare :class:`~rotationzoo.registry.Architecture`.
        tag: a tag of a name or a ``ModelEntry`` (default: the model's default tag), as ``--tag``.
        context: tokens per sequence.
        batch: concurrent sequences for the totals and ``max_context`` (default 1).
        gpu_memory_bytes: memory of the GPU (or of all GPUs holding one replica); without it no
            capacity figures are computed.
        engine: a target of :data:`rotationzoo.engines.TARGETS`: the page size capacities are rounded to.
        weights_bytes: bytes of the weights; default ``num_parameters × bytes(weight_dtype)`` of
            the registry architecture.
        config: INT2-KV settings; default the entry's serving settings, its windows included
            (``Int2KVConfig()`` for a bare architecture). ``group_size=None`` means head_dim. Per-KV-head
            rotations change no KV bytes (a note says so for such entries).
        reserve: fraction of ``gpu_memory_bytes`` kept for activations and workspace (0.1).

    Returns:
        A :class:`MemoryPlan`.

    Raises:
        ConfigError: a number outside its bound (``context`` 1 … 2^30, ``batch`` 1 … 2^20, memory
            sizes up to 1 PiB, ``reserve`` in [0, 1)), a head_dim or group size no INT2 kernel runs
            (:func:`rotationzoo.int2kv.check_group_size`), or a model whose registry entry lacks what
            the arithmetic needs (layers, KV heads, weights with a GPU size).
    """
    name, tag, arch, entry = _resolve(model, tag)
    serving = entry.serving if entry is not None else None
    batch = 1 if batch is None else batch
    reserve = _check_inputs(context, batch, gpu_memory_bytes, reserve)
    cfg = config if config is not None else (serving or Int2KVConfig())
    if not isinstance(cfg, Int2KVConfig):
        raise ConfigError(f"config must be an Int2KVConfig, got {type(cfg).__name__}")
    layers, heads = _kv_shape(name, arch)
    d = arch.head_dim
    try:
        g = cfg.group_for(d)  # the one group-size rule (rotationzoo.int2kv.check_group_size)
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    e = check_engine(engine)
    page = engine_page_size(e, cfg.hp_dtype)
    elems = 2 * layers * heads * d  # K and V elements of one token
    hp = elems * _HP_BYTES[cfg.hp_dtype]
    int2 = elems // 4 + 2 * layers * heads * 2 * (d // g) * _HP_BYTES[cfg.scale_dtype]
    shapes = (_Shape("bf16", elems * 2, 0, 0, 0), _Shape("fp8", elems, 0, 0, 0),
              _Shape("oscar_int2", int2, hp, cfg.prefix_tokens, cfg.recent_tokens))
    weights, source = _weights(name, arch, weights_bytes)
    budget = None
    if gpu_memory_bytes is not None:
        if weights is None:
            raise ConfigError(f"{name}: the registry has no num_parameters/weight_dtype; give the weights' size "
                              "(weights_bytes, or --weights-gib on the command line)")
        budget = int(gpu_memory_bytes * (1 - reserve)) - weights
    notes = target(e).plan_notes(cfg, page)
    if cfg.lloyd_max and g != d:
        notes.append(f"lloyd_max with group_size {g} < head_dim {d}: rotationzoo's kernels and transformers cache "
                     "need one group per row for Lloyd-Max levels (the bytes planned are the same)")
    if entry is not None and entry.grouping == "kv_head":
        notes.append("per-KV-head rotations change no KV bytes: the cache holds the same INT2 codes, scales and BF16 "
                     f"windows; only the rotation files are {heads} times larger (weights read at load, not cache)")
    if budget is not None and budget <= 0:
        notes.append("the weights alone exceed gpu_memory · (1 − reserve): nothing fits")
    bf16_bytes = shapes[0].nbytes(context)
    formats = tuple(_format_plan(s, context, batch, page, budget, elems, bf16_bytes) for s in shapes)
    # the one bits-per-element formula (rotationzoo.kvformat) is what the exact bytes above add up to
    assert math.isclose(formats[2].bits_per_element, cfg.bits_per_element(d, context), rel_tol=1e-12)
    return MemoryPlan(
        model=name, tag=tag, engine=e, page_size=page, context=context, batch=batch, layers_with_kv=layers,
        num_kv_heads=heads, head_dim=d, group_size=g, config=cfg, gpu_memory_bytes=gpu_memory_bytes,
        reserve=float(reserve), weights_bytes=weights, weights_source=source, kv_budget_bytes=budget,
        formats=formats, notes=tuple(notes),
    )


__all__ = ["DEFAULT_RESERVE", "KV_FORMATS", "MAX_BATCH", "MAX_MEMORY_BYTES", "MIN_UNITLESS_GPU_BYTES",
           "VLLM_BLOCK_TOKENS", "WEIGHT_DTYPE_BITS", "KVFormatPlan", "MemoryPlan", "check_reserve", "engine_page_size",
           "gib_bytes", "parse_gpu_memory", "parse_size", "plan"]
