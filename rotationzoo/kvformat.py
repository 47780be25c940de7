"""How a KV-cache history row is stored: one frozen type for every format a user could pick, and the one
bits-per-element formula.

A :class:`KVFormat` says what a cache keeps of each key and value: the code (``bf16``, ``fp8_e4m3``,
``int2``, ``int3``, ``int4``), how codes share scales (``group_size`` dims of a (token, KV head) row, or
one static per-tensor scale for FP8), the scale/zero dtype, the axis (``token``: groups along head_dim of
each row, as OSCAR, QuaRot and the engines' INT/FP8 caches; ``kivi``: keys per channel over groups of
tokens and values per token, as KIVI), clip ratios, Lloyd-Max levels and the full-precision windows.
The OSCAR store's serving configuration, :class:`~rotationzoo.int2kv.Int2KVConfig`, is one of these
formats (``Int2KVConfig.kv_format()`` / ``Int2KVConfig.from_format``), not a second settings type.

Names. Every format has one canonical name, used by the CLI (``eval --formats``), JSON and the docs,
and :func:`parse_format` reads it back (shorter spellings take the defaults)::

    bf16                                   rows rounded to bfloat16
    fp8                                    FP8 e4m3, one static per-tensor scale (1.0: the engines' default)
    fp8-row                                FP8 e4m3, one dynamic fp32 scale per (token, KV head) row
    int4-g64-bf16-w64+256-c0/0             4-bit codes, groups of 64 dims, bf16 scale/zero, 64 + 256 windows
    int2-g64-bf16-w64+256-c0.96/0.92-lm    OSCAR INT2 with Lloyd-Max levels (``-bisect``: the decode search)
    kivi2-g32-r128-fp16                    KIVI-2: groups of 32, a residual of 128 fp16 tokens, fp16 scale/min
    int2-g64-bf16-int3:0/1/29              mixed code widths: layers 0, 1 and 29 keep 3-bit codes (simulated)
    int2-g64-bf16-int3:18.1/23.0/29        ... KV head 1 of layer 18, head 0 of layer 23 and all of layer 29

``g`` is omitted for one group per row (``group_size=None``); an INT name without ``w`` keeps the 64 + 256
windows (``-w0+0`` for none), without ``c`` it clips as OSCAR serves INT2 (0.96 / 0.92) for ``int2`` and
not at all for wider codes. Windows are bf16 unless a name says ``-hpfp16`` or ``-hpfp32``; KIVI keeps its
residual in fp16 as its code does (``-hpbf16`` names a bf16 residual).

Bits per element (:meth:`KVFormat.bits_per_element`): a quantized row costs its codes plus its share of
scales (and zeros); window tokens cost ``hp_dtype``'s bits; the average over the ``T`` tokens of a
context is what a cache of that context stores per element (K and V averaged). For KIVI the residual
follows its paper: ``T mod R`` keys and ``min(T, R)`` values stay in full precision. With mixed code
widths the layers are averaged too (each layer caches as many elements), and with widened KV heads the
(layer, KV head) pairs (each caches as many elements).

This module imports nothing heavy (no torch).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal, Mapping, get_args

from .errors import ConfigError
from .numbers import check_int, check_real, shown
from .vocab import CLIP_SEARCHES, DTYPE_NAMES, ClipSearch, DtypeName

Code = Literal["bf16", "fp8_e4m3", "int2", "int3", "int4"]
CODES: tuple[str, ...] = get_args(Code)
Axis = Literal["token", "kivi"]
AXES: tuple[str, ...] = get_args(Axis)
ScaleGranularity = Literal["group", "tensor"]

#: Bits of one stored value of each dtype name.
DTYPE_BITS: dict[str, int] = {"bfloat16": 16, "float16": 16, "float32": 32}
#: Bits of one code.
CODE_BITS: dict[str, int] = {"bf16": 16, "fp8_e4m3": 8, "int2": 2, "int3": 3, "int4": 4}
#: Windows an INT name keeps when it names none (the OSCAR serving recipe's sink and recent tokens).
DEFAULT_WINDOWS: tuple[int, int] = (64, 256)
#: Clip ratios an ``int2`` name gets when it names none (the OSCAR serving recipe).
INT2_CLIPS: tuple[float, float] = (0.96, 0.92)
#: KIVI's group size and residual when a ``kivi`` name gives none (its LongBench runs).
KIVI_DEFAULTS: tuple[int, int] = (32, 128)
#: The dtype of KIVI's full-precision residual when a ``kivi`` name gives none (``-hp…``): its code keeps
#: the residual, like its scales and minima, in fp16.
KIVI_HP_DTYPE: DtypeName = "float16"
_SHORT_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_DTYPE_SHORT = {v: k for k, v in _SHORT_DTYPES.items()}
_MAX_TOKENS = 2**30


@dataclass(frozen=True)
class KVFormat:
    """How every key and value row of a KV cache is stored (everything but a rotation).

    Attributes:
        code: ``bf16``, ``fp8_e4m3``, ``int2``, ``int3`` or ``int4``.
        group_size: ``token`` axis: contiguous dims of a row sharing one scale (and zero); ``None`` =
            the whole row (head_dim). ``kivi``: tokens per key-channel group and dims per value group.
        scale_dtype: dtype of the stored scales and zeros (``fp8-row`` stores fp32 scales).
        scale: ``group`` (scales per group, computed from the data) or ``tensor`` (FP8 only: one static
            scale of 1.0, what vLLM and SGLang use without calibrated scales).
        axis: ``token`` (groups along each row) or ``kivi`` (keys per channel over token groups, values
            per token; ``recent_tokens`` is KIVI's residual ``R``).
        k_clip_ratio, v_clip_ratio: per-row clip of INT codes at ``sort(|row|)[int(r·d)]`` (0: none).
        lloyd_max: approximate Lloyd-Max INT2 levels (one group per row).
        clip_search: ``exact`` or ``bisect`` clip thresholds (INT2).
        prefix_tokens, recent_tokens: tokens kept in ``hp_dtype`` (the sink and the recent window).
        hp_dtype: dtype of the window tokens (KIVI's residual). A KIVI name without ``-hp…`` gives
            ``float16``, KIVI's own; the field's default, for a format built field by field, is ``bfloat16``.
        wide_code, wide_layers, wide_heads: mixed code widths per layer or KV head (INT codes along rows;
            the decode-time simulation only: the INT2 store keeps one width): the layers ``wide_layers`` (ids
            as the model numbers them) and the ``(layer, KV head)`` pairs ``wide_heads`` store ``wide_code``
            codes with the same groups, scale dtype and windows, no clip and uniform levels
            (:meth:`wide_format`); the others ``code``.
    """

    code: Code = "int2"
    group_size: int | None = None
    scale_dtype: DtypeName = "bfloat16"
    scale: ScaleGranularity = "group"
    axis: Axis = "token"
    k_clip_ratio: float = 0.0
    v_clip_ratio: float = 0.0
    lloyd_max: bool = False
    clip_search: ClipSearch = "exact"
    prefix_tokens: int = 0
    recent_tokens: int = 0
    hp_dtype: DtypeName = "bfloat16"
    wide_code: Code | None = None
    wide_layers: tuple[int, ...] = ()
    wide_heads: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise ConfigError(f"code must be one of {', '.join(CODES)}, got {shown(self.code)}")
        if self.axis not in AXES:
            raise ConfigError(f"axis must be one of {', '.join(AXES)}, got {shown(self.axis)}")
        if self.scale not in ("group", "tensor"):
            raise ConfigError(f"scale must be 'group' or 'tensor', got {shown(self.scale)}")
        for name in ("scale_dtype", "hp_dtype"):
            if getattr(self, name) not in DTYPE_NAMES:
                raise ConfigError(f"{name} must be one of {', '.join(DTYPE_NAMES)}, got {shown(getattr(self, name))}")
        for name in ("k_clip_ratio", "v_clip_ratio"):
            object.__setattr__(self, name, check_real(getattr(self, name), name, low=0.0, high=1.0,
                                                      hint=" (0 disables clipping)"))
        for name in ("prefix_tokens", "recent_tokens"):
            check_int(getattr(self, name), name, low=0, high=_MAX_TOKENS)
        if self.group_size is not None:
            check_int(self.group_size, "group_size", low=1, high=4096)
        if self.clip_search not in CLIP_SEARCHES:
            raise ConfigError(f"clip_search must be one of {', '.join(CLIP_SEARCHES)}, got {shown(self.clip_search)}")
        if not isinstance(self.lloyd_max, bool):
            raise ConfigError(f"lloyd_max must be true or false, got {shown(self.lloyd_max)}")
        self._check_combination()
        self._check_widths()

    def _check_widths(self) -> None:
        layers = self.wide_layers
        if isinstance(layers, (str, bytes)) or not isinstance(layers, (tuple, list)):
            raise ConfigError(f"wide_layers must be a list of layer ids, got {shown(layers)}")
        for lid in layers:
            check_int(lid, "a wide_layers id", low=0, high=_MAX_TOKENS)
        object.__setattr__(self, "wide_layers", tuple(sorted(set(layers))))
        heads = self.wide_heads
        if isinstance(heads, (str, bytes)) or not isinstance(heads, (tuple, list)):
            raise ConfigError(f"wide_heads must be a list of (layer, KV head) pairs, got {shown(heads)}")
        pairs = set()
        for pair in heads:
            if isinstance(pair, (str, bytes)) or not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ConfigError(f"a wide_heads entry must be a (layer, KV head) pair, got {shown(pair)}")
            pairs.add((check_int(pair[0], "a wide_heads layer id", low=0, high=_MAX_TOKENS),
                       check_int(pair[1], "a wide_heads KV head", low=0, high=4096)))
        both = sorted({lid for lid, _ in pairs} & set(self.wide_layers))
        if both:
            raise ConfigError(f"layer {both[0]} is widened whole and by KV head; keep int3:{both[0]}, or drop it "
                              f"and list only the heads {both[0]}.h")
        object.__setattr__(self, "wide_heads", tuple(sorted(pairs)))
        if self.wide_code is None and not self.mixed:
            return
        if self.wide_code is None or not self.mixed:
            raise ConfigError("mixed code widths need both wide_code and wide_layers or wide_heads "
                              "(e.g. int2-g64-bf16-int3:0/1 or int2-g64-bf16-int3:0.1)")
        if self.wide_code not in CODES or not self.wide_code.startswith("int"):
            raise ConfigError(f"wide_code must be int3 or int4, got {shown(self.wide_code)}")
        if not self.integer or self.axis != "token" or CODE_BITS[self.wide_code] <= CODE_BITS[self.code]:
            raise ConfigError(f"mixed code widths give some layers or KV heads a wider INT code than the others' "
                              f"along rows; {self.wide_code} ones in a {self.code} ({self.axis} axis) format are not "
                              f"that (e.g. int2-g64-bf16-int3:0/1)")

    def _check_combination(self) -> None:
        integer = self.code.startswith("int")
        if self.scale == "tensor" and self.code != "fp8_e4m3":
            raise ConfigError(f"{self.code}: a static per-tensor scale is an FP8 layout; INT codes scale per group")
        if not integer and (self.k_clip_ratio or self.v_clip_ratio or self.lloyd_max or self.axis != "token"):
            raise ConfigError(f"{self.code}: clip ratios, Lloyd-Max levels and the kivi axis are INT-code settings")
        if self.lloyd_max and self.code != "int2":
            raise ConfigError("lloyd_max levels are INT2 levels (one group per row: the kernels check it against "
                              "head_dim)")
        if self.axis == "kivi" and (self.prefix_tokens or self.group_size is None or self.recent_tokens % self.group_size
                                    or self.k_clip_ratio or self.v_clip_ratio):
            raise ConfigError("kivi: a group size that divides the residual (recent_tokens), no sink, no clip")

    # -- names -------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The canonical name (:func:`parse_format` reads it back to an equal format)."""
        if self.code == "bf16":
            return "bf16" + self._windows_part()
        if self.code == "fp8_e4m3":
            base = "fp8" if self.scale == "tensor" else (
                "fp8-row" if self.group_size is None and self.scale_dtype == "float32"
                else f"fp8{self._group_part()}-{_DTYPE_SHORT[self.scale_dtype]}")
            return base + self._windows_part()
        if self.axis == "kivi":
            hp = "" if self.hp_dtype == KIVI_HP_DTYPE else f"-hp{_DTYPE_SHORT[self.hp_dtype]}"
            return (f"kivi{CODE_BITS[self.code]}-g{self.group_size}-r{self.recent_tokens}-"
                    f"{_DTYPE_SHORT[self.scale_dtype]}{hp}")
        parts = [self.code + self._group_part(), _DTYPE_SHORT[self.scale_dtype],
                 f"w{self.prefix_tokens}+{self.recent_tokens}", f"c{self.k_clip_ratio:g}/{self.v_clip_ratio:g}"]
        if self.lloyd_max:
            parts.append("lm")
        if self.clip_search != "exact":
            parts.append(self.clip_search)
        if self.hp_dtype != "bfloat16":
            parts.append(f"hp{_DTYPE_SHORT[self.hp_dtype]}")
        if self.mixed:
            units = sorted([(lid, -1) for lid in self.wide_layers] + list(self.wide_heads))
            parts.append(f"{self.wide_code}:" + "/".join(str(lid) if h < 0 else f"{lid}.{h}" for lid, h in units))
        return "-".join(parts)

    def _group_part(self) -> str:
        return "" if self.group_size is None else f"-g{self.group_size}"

    def _windows_part(self) -> str:
        w = f"-w{self.prefix_tokens}+{self.recent_tokens}" if self.window_tokens else ""
        return w + (f"-hp{_DTYPE_SHORT[self.hp_dtype]}" if w and self.hp_dtype != "bfloat16" else "")

    def __str__(self) -> str:
        return self.name

    # -- what it stores ------------------------------------------------------------------------------
    @property
    def integer(self) -> bool:
        """INT codes (asymmetric, a scale and a zero per group)."""
        return self.code.startswith("int")

    @property
    def window_tokens(self) -> int:
        """``prefix_tokens + recent_tokens`` (``token`` axis)."""
        return self.prefix_tokens + self.recent_tokens

    def group_for(self, head_dim: int) -> int:
        """Dims per (scale, zero) group of a row at ``head_dim`` (``token`` axis; values of ``kivi``).

        Raises:
            ConfigError: a group size that does not divide ``head_dim``.
        """
        g = head_dim if self.group_size is None else self.group_size
        if head_dim % g:
            raise ConfigError(f"{self.name}: group_size {g} does not divide head_dim {head_dim}")
        return g

    @property
    def mixed(self) -> bool:
        """Mixed code widths: some layers or KV heads store ``wide_code`` codes."""
        return bool(self.wide_layers or self.wide_heads)

    def layer_format(self, layer_id: int) -> "KVFormat":
        """The single-width format layer ``layer_id`` stores: with mixed code widths :meth:`wide_format` in
        ``wide_layers`` and :meth:`narrow_format` elsewhere (KV heads widened in a layer: see
        :meth:`wide_heads_of`); otherwise itself."""
        if not self.mixed:
            return self
        return self.wide_format() if layer_id in self.wide_layers else self.narrow_format()

    def wide_heads_of(self, layer_id: int) -> tuple[int, ...]:
        """The KV heads of layer ``layer_id`` widened one by one (``wide_heads``); they store
        :meth:`wide_format`, the layer's other heads :meth:`layer_format`."""
        return tuple(h for lid, h in self.wide_heads if lid == layer_id)

    def narrow_format(self) -> "KVFormat":
        """This format with every layer and head at ``code`` (no mixed widths)."""
        return replace(self, wide_code=None, wide_layers=(), wide_heads=())

    def wide_format(self) -> "KVFormat":
        """What a widened layer or KV head stores: ``wide_code`` codes with the same groups, scale dtype and
        windows, no clip and uniform levels (itself without mixed widths)."""
        if not self.mixed:
            return self
        return replace(self.narrow_format(), code=self.wide_code or self.code, k_clip_ratio=0.0, v_clip_ratio=0.0,
                       lloyd_max=False, clip_search="exact")

    def quantized_bits(self, head_dim: int) -> float:
        """Stored bits per element of a quantized row: codes plus its share of scales (and zeros); with mixed
        code widths, of a row in the ``code`` layers."""
        bits = CODE_BITS[self.code]
        if self.code == "bf16" or self.scale == "tensor":
            return float(bits)
        per_group = DTYPE_BITS[self.scale_dtype] * (2 if self.integer else 1)  # FP8: a scale, no zero
        return bits + per_group / self.group_for(head_dim)

    def bits_per_element(self, head_dim: int, context_len: int, num_layers: int | None = None,
                         num_kv_heads: int | None = None) -> float:
        """Average stored bits per cached K/V element at ``context_len`` tokens (K and V averaged).

        ``token`` axis: ``W = min(T, prefix + recent)`` window tokens cost ``bits(hp_dtype)``, the others
        :meth:`quantized_bits`: ``((T − W)·q + W·h) / T``. ``kivi``: ``T mod R`` keys and ``min(T, R)``
        values stay in ``hp_dtype``: ``((2T − r_K − r_V)·q + (r_K + r_V)·h) / 2T``. With d = G = 128,
        16-bit scale/zero and 64 + 256 windows, INT2 at 131,072 tokens: 2.2836 (the paper's 2.28).
        Mixed code widths: the mean over the ``num_layers`` cached layers (and, with widened KV heads, their
        ``num_kv_heads`` heads) of each one's value.

        Raises:
            ConfigError: ``context_len < 1``; mixed code widths without ``num_layers`` (or with fewer layers
                than it widens); widened KV heads without ``num_kv_heads``.
        """
        if context_len < 1:
            raise ConfigError(f"context_len must be >= 1, got {context_len}")
        if self.mixed:
            if num_layers is not None:
                check_int(num_layers, "num_layers", low=1, high=_MAX_TOKENS)
            if num_kv_heads is not None:
                check_int(num_kv_heads, "num_kv_heads", low=1, high=4096)
            k = len(self.wide_layers) + len({lid for lid, _ in self.wide_heads})
            if num_layers is None or num_layers < k:
                raise ConfigError(f"{self.name}: bits per element of mixed code widths need the number of cached "
                                  f"layers (at least {k}), got {num_layers}")
            if self.wide_heads and (num_kv_heads is None or num_kv_heads <= max(h for _, h in self.wide_heads)):
                raise ConfigError(f"{self.name}: bits per element of widened KV heads need the number of KV heads "
                                  f"(more than {max(h for _, h in self.wide_heads)}), got {num_kv_heads}")
            base = self.narrow_format().bits_per_element(head_dim, context_len)
            wide = self.wide_format().bits_per_element(head_dim, context_len)
            units = num_layers * (num_kv_heads or 1)
            n_wide = len(self.wide_layers) * (num_kv_heads or 1) + len(self.wide_heads)
            return ((units - n_wide) * base + n_wide * wide) / units
        q, h, t = self.quantized_bits(head_dim), DTYPE_BITS[self.hp_dtype], context_len
        if self.axis == "kivi":
            r_k, r_v = t % self.recent_tokens if self.recent_tokens else 0, min(t, self.recent_tokens)
            return ((2 * t - r_k - r_v) * q + (r_k + r_v) * h) / (2 * t)
        w = min(t, self.window_tokens)
        return ((t - w) * q + w * h) / t

    def replace(self, **changes: Any) -> "KVFormat":
        """A copy with some fields changed (``None`` values ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_json(self) -> dict[str, Any]:
        """The fields and the canonical name."""
        return {"name": self.name, **asdict(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, where: str = "format") -> "KVFormat":
        """From :meth:`to_json` (``name`` alone, or the fields; an unknown key is refused)."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected an object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        rest = {k: v for k, v in data.items() if k != "name"}
        unknown = sorted(set(rest) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(map(str, unknown[:5]))}; expected name or "
                              f"{', '.join(sorted(known))}")
        if not rest and isinstance(data.get("name"), str):
            return parse_format(data["name"])
        try:
            return cls(**rest)
        except (ConfigError, TypeError) as exc:
            raise ConfigError(f"{where}: {exc}") from None


_INT = re.compile(r"int([234])(?:-g(\d+))?(?:-(bf16|fp16|fp32))?(?:-w(\d+)\+(\d+))?(?:-c([\d.]+)/([\d.]+))?"
                  r"(-lm)?(-bisect)?(?:-hp(bf16|fp16|fp32))?(?:-(int[34]):(\d+(?:\.\d+)?(?:/\d+(?:\.\d+)?)*))?")
_FP8 = re.compile(r"fp8(?:-(row)|(?:-g(\d+))?-(bf16|fp16|fp32))?(?:-w(\d+)\+(\d+))?(?:-hp(bf16|fp16|fp32))?")
_BF16 = re.compile(r"bf16(?:-w(\d+)\+(\d+))?")
_KIVI = re.compile(r"kivi([24])(?:-g(\d+))?(?:-r(\d+))?(?:-(bf16|fp16|fp32))?(?:-hp(bf16|fp16|fp32))?")


def parse_format(text: str) -> KVFormat:
    """A :class:`KVFormat` from its name (see the module docstring); shorter spellings take the defaults.

    Raises:
        ConfigError: not a format name (the message shows the grammar).
    """
    s = str(text).strip().lower()
    try:
        m = _INT.fullmatch(s)
        if m:
            code, g, sdt, p, r, kc, vc, lm, bisect, hp, wide, units = m.groups()
            names = units.split("/") if units else []
            clips = (float(kc), float(vc)) if kc is not None else (INT2_CLIPS if code == "2" else (0.0, 0.0))
            wins = (int(p), int(r)) if p is not None else DEFAULT_WINDOWS
            return KVFormat(code=f"int{code}", group_size=int(g) if g else None,  # type: ignore[arg-type]
                            scale_dtype=_SHORT_DTYPES[sdt or "bf16"],  # type: ignore[arg-type]
                            k_clip_ratio=clips[0], v_clip_ratio=clips[1], lloyd_max=bool(lm),
                            clip_search="bisect" if bisect else "exact", prefix_tokens=wins[0], recent_tokens=wins[1],
                            hp_dtype=_SHORT_DTYPES[hp or "bf16"],  # type: ignore[arg-type]
                            wide_code=wide,  # type: ignore[arg-type]
                            wide_layers=tuple(int(x) for x in names if "." not in x),
                            wide_heads=tuple((int(x.split(".")[0]), int(x.split(".")[1])) for x in names if "." in x))
        m = _FP8.fullmatch(s)
        if m:
            row, g, sdt, p, r, hp = m.groups()
            grouped = bool(row or sdt)
            return KVFormat(code="fp8_e4m3", scale="group" if grouped else "tensor",
                            group_size=int(g) if g else None,
                            scale_dtype="float32" if row else _SHORT_DTYPES[sdt or "bf16"],  # type: ignore[arg-type]
                            prefix_tokens=int(p or 0), recent_tokens=int(r or 0),
                            hp_dtype=_SHORT_DTYPES[hp or "bf16"])  # type: ignore[arg-type]
        m = _BF16.fullmatch(s)
        if m:
            return KVFormat(code="bf16", prefix_tokens=int(m.group(1) or 0), recent_tokens=int(m.group(2) or 0))
        m = _KIVI.fullmatch(s)
        if m:
            bits, g, r, sdt, hp = m.groups()
            return KVFormat(code=f"int{bits}", axis="kivi",  # type: ignore[arg-type]
                            group_size=int(g) if g else KIVI_DEFAULTS[0],
                            recent_tokens=int(r) if r else KIVI_DEFAULTS[1],
                            scale_dtype=_SHORT_DTYPES[sdt or "fp16"],  # type: ignore[arg-type]
                            hp_dtype=_SHORT_DTYPES[hp] if hp else KIVI_HP_DTYPE)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise ConfigError(f"format {text!r}: {exc}") from None
    raise ConfigError(f"format {str(text)[:60]!r} is not a KV format name; expected bf16, fp8, fp8-row, "
                      f"int{{2,3,4}}[-gG][-bf16|fp16|fp32][-wP+R][-cK/V][-lm][-bisect][-int{{3,4}}:L/L.h…] or "
                      f"kivi{{2,4}}[-gG][-rR][-bf16|fp16|fp32][-hpDT] "
                      f"(e.g. int4-g64-bf16, int2-g64-bf16-w64+256, kivi2)")


__all__ = ["AXES", "CODES", "CODE_BITS", "DEFAULT_WINDOWS", "DTYPE_BITS", "INT2_CLIPS", "KIVI_DEFAULTS", "KIVI_HP_DTYPE",
           "Axis", "Code", "KVFormat", "parse_format"]
