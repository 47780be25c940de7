"""The INT2 KV-cache configuration: one frozen type for every knob of the OSCAR store.

A registry entry's ``serving`` block, the transformers cache, ``rotationzoo eval``, the memory
planner and the launch settings all read the same :class:`Int2KVConfig`, and every knob has one
name everywhere (Python attribute, ``registry.json`` key, CLI flag, JSON report):

====================  =========================  ===========================================================
attribute / JSON key  CLI flag                   meaning
====================  =========================  ===========================================================
``k_clip_ratio``      ``--k-clip-ratio``         per-row clip of keys at ``sort(|row|)[int(r·d)]``; 0 disables
``v_clip_ratio``      ``--v-clip-ratio``         the same for values
``group_size``        ``--group-size``           dims sharing one (scale, zero); ``None`` = head_dim (rule below)
``prefix_tokens``     ``--prefix-tokens``        first tokens kept in ``hp_dtype`` (the sink)
``recent_tokens``     ``--recent-tokens``        most recent tokens kept in ``hp_dtype``
``hp_dtype``          ``--hp-dtype``             dtype of the window tokens (SGLang's ``HP_DTYPE``)
``scale_dtype``       ``--scale-dtype``          dtype of the stored scale/zero pairs
``lloyd_max``         ``--lloyd-max``            approximate Lloyd-Max levels (needs ``group_size == d``)
``clip_search``       ``--clip-search``          ``exact`` threshold (SGLang prefill) or ``bisect`` (decode flush)
====================  =========================  ===========================================================

Defaults are the authors' serving recipe with SGLang's fp32 scale/zero: clip 0.96 / 0.92, one
group per row, 64 + 256 BF16 window tokens, exact clip thresholds.

Bounds: clip ratios are finite numbers in ``[0, 1]``; window sizes integers from 0 to
:data:`MAX_CONTEXT_TOKENS` (2^30). The group size follows one rule, :func:`check_group_size`,
which the configuration, the kernels and the memory planner all call: ``head_dim`` one of
:data:`HEAD_DIMS` (64, 128, 256) and ``group_size`` one of ``head_dim, head_dim/2, ...`` down to
16 (``None`` = ``head_dim``); the kernels also need one group per row for Lloyd-Max levels.

This module imports nothing heavy (no torch): dtypes are names (``"bfloat16"``, ...).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping

from .errors import ConfigError
from .kvformat import DTYPE_BITS, KVFormat
from .numbers import check_int, check_real, shown
from .vocab import CLIP_SEARCHES, DTYPE_NAMES, ClipSearch, DtypeName
#: The head dimensions the INT2 kernels run (``rotationzoo.kernels`` re-exports them).
HEAD_DIMS: tuple[int, ...] = (64, 128, 256)
#: Smallest quantization group (contiguous dims sharing one scale/zero pair).
MIN_GROUP_SIZE = 16
#: Most tokens of one sequence any setting may name (window sizes here, ``context`` in the planner):
#: 2^30 = 1,073,741,824, a hundred times the longest context served today.
MAX_CONTEXT_TOKENS = 2**30


def allowed_group_sizes(head_dim: int) -> tuple[int, ...]:
    """``head_dim, head_dim/2, head_dim/4, ...`` down to :data:`MIN_GROUP_SIZE` (``128`` → ``128, 64, 32, 16``).

    Raises:
        ConfigError: a head_dim no kernel runs (not one of :data:`HEAD_DIMS`).
    """
    if isinstance(head_dim, bool) or head_dim not in HEAD_DIMS:
        raise ConfigError(f"head_dim {shown(head_dim)} is not one the INT2 kernels run; expected one of "
                          f"{', '.join(map(str, HEAD_DIMS))}")
    out = []
    g = head_dim
    while g >= MIN_GROUP_SIZE:
        out.append(g)
        g //= 2
    return tuple(out)


def check_group_size(group_size: object, head_dim: int | None = None, *, lloyd_max: bool = False) -> int | None:
    """The one group-size rule: which ``group_size`` an INT2 kernel can run at ``head_dim``.

    ``head_dim`` must be one of :data:`HEAD_DIMS`; ``group_size`` is ``None`` (one group per row,
    i.e. ``head_dim``) or one of :func:`allowed_group_sizes` (``head_dim, head_dim/2, ...``, at
    least :data:`MIN_GROUP_SIZE`); Lloyd-Max levels need one group per row. Without ``head_dim``
    (a configuration not yet tied to a model), ``group_size`` must be allowed for some head_dim: a
    power of two from 16 to 256. :class:`Int2KVConfig`, the kernels
    (:func:`rotationzoo.kernels.quantize_int2` …) and the memory planner all call this.

    Returns:
        The effective group size (``head_dim`` for ``None``); ``None`` when both are ``None``.

    Raises:
        ConfigError: a head_dim or group size no kernel runs (the message lists the allowed ones).
    """
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)):
        raise ConfigError(f"group_size must be an integer (or None for head_dim), got {shown(group_size)}")
    if head_dim is None:
        anywhere = sorted({g for d in HEAD_DIMS for g in allowed_group_sizes(d)}, reverse=True)
        if group_size is not None and group_size not in anywhere:
            raise ConfigError(f"group_size {shown(group_size)} is not one the INT2 kernels run; expected one of "
                              f"{', '.join(map(str, anywhere))} (or None for head_dim)")
        return group_size
    allowed = allowed_group_sizes(head_dim)  # refuses a head_dim no kernel runs
    if group_size is None:
        return head_dim
    if group_size not in allowed:
        raise ConfigError(f"group_size {shown(group_size)} is not valid for head_dim {head_dim}; expected one of "
                          f"{', '.join(map(str, allowed))} (or None for head_dim)")
    if lloyd_max and group_size != head_dim:
        raise ConfigError(f"lloyd_max uses one (scale, zero) per row: group_size must be head_dim ({head_dim}), "
                          f"got {group_size}")
    return group_size


def check_knob_names(changes: Any, what: str = "INT2-KV settings") -> None:
    """Refuse ``changes`` unless it maps :class:`Int2KVConfig` field names (``group_size``, ``k_clip_ratio``, ...)
    to values: one :class:`~rotationzoo.errors.ConfigError` line naming the first unknown name and the knobs."""
    if not isinstance(changes, Mapping):
        raise ConfigError(f"{what} must be a mapping of knob names to values, got {type(changes).__name__}")
    known = [f.name for f in fields(Int2KVConfig)]
    unknown = [k for k in changes if k not in known]
    if unknown:
        raise ConfigError(f"{what}: {shown(unknown[0])} is not an INT2-KV knob; expected {', '.join(known)}")


@dataclass(frozen=True)
class Int2KVConfig:
    """How keys and values are stored in an OSCAR INT2 KV cache (everything but the rotations).

    Attributes:
        k_clip_ratio: per-row clip ratio of keys (``0`` disables; OSCAR serves 0.96).
        v_clip_ratio: per-row clip ratio of values (OSCAR serves 0.92).
        group_size: contiguous dims sharing one (scale, zero) pair; ``None`` means head_dim (one
            pair per row, the published ``group128`` at d = 128).
        prefix_tokens: tokens at the start kept in ``hp_dtype`` (the BF16 sink).
        recent_tokens: most recent tokens kept in ``hp_dtype``.
        hp_dtype: dtype of the window tokens (``"bfloat16"`` as served).
        scale_dtype: dtype of the stored scale/zero (``"float32"``, SGLang's default).
        lloyd_max: approximate Lloyd-Max INT2 levels (``SGLANG_LLOYD_MAX=1``).
        clip_search: ``"exact"`` thresholds (SGLang's prefill store) or ``"bisect"`` (the 7-step
            search of its decode-flush kernel, applied to rows demoted from the recent window).
    """

    k_clip_ratio: float = 0.96
    v_clip_ratio: float = 0.92
    group_size: int | None = None
    prefix_tokens: int = 64
    recent_tokens: int = 256
    hp_dtype: DtypeName = "bfloat16"
    scale_dtype: DtypeName = "float32"
    lloyd_max: bool = False
    clip_search: ClipSearch = "exact"

    def __post_init__(self) -> None:
        for name in ("k_clip_ratio", "v_clip_ratio"):
            value = getattr(self, name)
            object.__setattr__(self, name, check_real(value, name, low=0.0, high=1.0, hint=" (0 disables clipping)"))
        for name in ("prefix_tokens", "recent_tokens"):
            check_int(getattr(self, name), name, low=0, high=MAX_CONTEXT_TOKENS)
        check_group_size(self.group_size)
        for name in ("hp_dtype", "scale_dtype"):
            if getattr(self, name) not in DTYPE_NAMES:
                raise ConfigError(f"{name} must be one of {', '.join(DTYPE_NAMES)}, got {shown(getattr(self, name))}")
        if not isinstance(self.lloyd_max, bool):
            raise ConfigError(f"lloyd_max must be true or false, got {shown(self.lloyd_max)}")
        if self.clip_search not in CLIP_SEARCHES:
            raise ConfigError(f"clip_search must be one of {', '.join(CLIP_SEARCHES)}, got {shown(self.clip_search)}")

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, where: str = "serving") -> "Int2KVConfig":
        """Build from a ``registry.json`` ``serving`` block (missing keys take the defaults).

        Raises:
            ConfigError: an unknown key or a bad value (the message names ``where``).
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected an object of INT2-KV settings, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(k if len(k) <= 40 else shown(k) for k in unknown[:5])}; expected "
                              f"{', '.join(sorted(known))}")
        try:
            return cls(**dict(data))
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    def replace(self, **changes: Any) -> "Int2KVConfig":
        """A copy with some knobs changed; ``None`` values are ignored (handy for optional CLI flags).

        Raises:
            ConfigError: a name that is not a knob (one line listing the knobs), or a bad value.
        """
        check_knob_names(changes)
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_json(self) -> dict[str, Any]:
        """The knobs as a JSON-friendly dict (``registry.json`` / report keys)."""
        return asdict(self)

    # -- derived values ----------------------------------------------------------------------------
    def clip_ratio(self, side: str) -> float:
        """``k_clip_ratio`` for ``"k"``, ``v_clip_ratio`` for ``"v"``."""
        if side not in ("k", "v"):
            raise ConfigError(f"side must be 'k' or 'v', got {side!r}")
        return self.k_clip_ratio if side == "k" else self.v_clip_ratio

    def group_for(self, head_dim: int) -> int:
        """The effective group size for ``head_dim`` (``group_size`` or ``head_dim``).

        Raises:
            ConfigError: no INT2 kernel runs this group size at ``head_dim`` (:func:`check_group_size`).
        """
        g = check_group_size(self.group_size, head_dim)
        assert g is not None
        return g

    @property
    def window_tokens(self) -> int:
        """``prefix_tokens + recent_tokens``."""
        return self.prefix_tokens + self.recent_tokens

    def kv_format(self) -> KVFormat:
        """This store as a :class:`~rotationzoo.kvformat.KVFormat` (INT2 codes along each row)."""
        return KVFormat(code="int2", group_size=self.group_size, scale_dtype=self.scale_dtype,
                        k_clip_ratio=self.k_clip_ratio, v_clip_ratio=self.v_clip_ratio, lloyd_max=self.lloyd_max,
                        clip_search=self.clip_search, prefix_tokens=self.prefix_tokens,
                        recent_tokens=self.recent_tokens, hp_dtype=self.hp_dtype)

    @classmethod
    def from_format(cls, fmt: KVFormat) -> "Int2KVConfig":
        """The OSCAR store of an INT2 format (codes along each row, scales per group).

        Raises:
            ConfigError: another code, axis or scale layout, or mixed code widths (the INT2 kernels store
                only this one).
        """
        if fmt.code != "int2" or fmt.axis != "token" or fmt.scale != "group":
            raise ConfigError(f"{fmt.name} is not an INT2 store of this project's kernels (int2 codes along each row)")
        if fmt.mixed:
            raise ConfigError(f"{fmt.name}: mixed code widths are evaluated by the decode-time simulation only (the "
                              f"INT2 store keeps one width)")
        return cls(k_clip_ratio=fmt.k_clip_ratio, v_clip_ratio=fmt.v_clip_ratio, group_size=fmt.group_size,
                   prefix_tokens=fmt.prefix_tokens, recent_tokens=fmt.recent_tokens, hp_dtype=fmt.hp_dtype,
                   scale_dtype=fmt.scale_dtype, lloyd_max=fmt.lloyd_max, clip_search=fmt.clip_search)

    def int2_bits(self, head_dim: int) -> float:
        """Stored bits per element of an INT2 token: ``2 + 2·bits(scale_dtype)/G``."""
        self.group_for(head_dim)  # the kernels' group-size rule
        return self.kv_format().quantized_bits(head_dim)

    def bits_per_element(self, head_dim: int, context_len: int) -> float:
        """Average stored bits per cached K/V element at ``context_len`` tokens (the paper's BPE): the one
        formula, :meth:`KVFormat.bits_per_element <rotationzoo.kvformat.KVFormat.bits_per_element>`.

        ``W = min(L, prefix + recent)`` window tokens cost ``bits(hp_dtype)``; the others
        :meth:`int2_bits`: ``BPE(L) = ((L − W)·b_int2 + W·b_hp) / L``. With d = G = 128, 16-bit
        scale/zero and 64 + 256 windows, ``BPE(131072) = 2.2836`` (the paper's 2.28).
        """
        self.group_for(head_dim)
        return self.kv_format().bits_per_element(head_dim, context_len)

    def label(self, head_dim: int | None = None) -> str:
        """Short description, e.g. ``G64 clip 0.96/0.92 win 64+256 fp32``."""
        g = self.group_size if self.group_size is not None else head_dim
        parts = [f"G{g}" if g else "G=d"]
        clipped = self.k_clip_ratio > 0 or self.v_clip_ratio > 0
        parts.append(f"clip {self.k_clip_ratio:g}/{self.v_clip_ratio:g}" if clipped else "no clip")
        if clipped and self.clip_search != "exact":
            parts.append(self.clip_search)
        parts.append(f"win {self.prefix_tokens}+{self.recent_tokens}" if self.window_tokens else "no win")
        parts.append({"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[self.scale_dtype])
        if self.lloyd_max:
            parts.append("LM")
        return " ".join(parts)


__all__ = ["CLIP_SEARCHES", "DTYPE_BITS", "DTYPE_NAMES", "HEAD_DIMS", "MAX_CONTEXT_TOKENS", "MIN_GROUP_SIZE",
           "ClipSearch", "DtypeName", "Int2KVConfig", "allowed_group_sizes", "check_group_size", "check_knob_names"]
