"""Head dimensions per layer: one ``d`` for every layer, or a default with per-layer overrides.

Most models have one head_dim. Some mix two (Gemma-4-12B: 256 on sliding-window layers, 512 on the
full-attention ones), and so do their rotation files. :class:`HeadDims` says which ``d`` each layer
has; the registry's architecture (``head_dim`` + ``layer_head_dims``), ``rotationzoo verify
--head-dim`` and :func:`rotationzoo.read_rotation` all take it.

Spec strings (the CLI's ``--head-dim``): ``128``, or ``256,5:512,11:512`` (default 256; layers 5 and 11
have 512), or ranges ``256,5-11:512`` (layers 5 … 11).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from .errors import ConfigError

#: Most per-layer overrides a spec may hold.
MAX_OVERRIDES = 4096
_ITEM = re.compile(r"^(\d{1,6})(?:-(\d{1,6}))?:(\d{1,6})$")


@dataclass(frozen=True)
class HeadDims:
    """``d`` of each layer: :attr:`default` unless :attr:`overrides` names the layer."""

    default: int
    overrides: Mapping[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for what, d in [("head_dim", self.default), *((f"head_dim of layer {k}", v) for k, v in self.overrides.items())]:
            if isinstance(d, bool) or not isinstance(d, int) or d < 1:
                raise ConfigError(f"{what} must be a positive integer, got {d!r}")
        for k in self.overrides:
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise ConfigError(f"layer ids of per-layer head_dims must be integers >= 0, got {k!r}")
        object.__setattr__(self, "overrides", {k: v for k, v in sorted(self.overrides.items()) if v != self.default})

    @classmethod
    def of(cls, value: "int | str | HeadDims | Mapping[int, int] | None") -> "HeadDims | None":
        """``value`` as :class:`HeadDims`: an int, a spec as ``--head-dim`` takes it (``"256,5:512"``,
        :meth:`parse`), a ``{layer: d}`` mapping (the most common ``d`` is the default), or ``None`` (unknown)."""
        if value is None or isinstance(value, HeadDims):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, Mapping):
            if not value:
                raise ConfigError("per-layer head_dims must name at least one layer")
            counts: dict[int, int] = {}
            for d in value.values():
                counts[d] = counts.get(d, 0) + 1
            default = max(counts, key=lambda d: (counts[d], -d))
            return cls(default, dict(value))
        return cls(value)

    @classmethod
    def parse(cls, spec: str) -> "HeadDims":
        """``"128"`` or ``"256,5:512,11-13:512"``; raises :class:`ConfigError` with the accepted form."""
        parts = [p.strip() for p in str(spec).split(",") if p.strip()]
        form = "expected D or D,LAYER:D,FIRST-LAST:D (e.g. 256,5:512)"
        if not parts or not parts[0].isdigit() or len(parts[0]) > 6:
            raise ConfigError(f"head_dim spec {str(spec)[:80]!r}: {form}")
        overrides: dict[int, int] = {}
        for p in parts[1:]:
            m = _ITEM.match(p)
            if m is None:
                raise ConfigError(f"head_dim spec {str(spec)[:80]!r}: item {p[:40]!r}: {form}")
            first, last, d = int(m[1]), int(m[2] if m[2] is not None else m[1]), int(m[3])
            if last < first or last - first + len(overrides) >= MAX_OVERRIDES:
                raise ConfigError(f"head_dim spec {str(spec)[:80]!r}: item {p[:40]!r} is an empty or too long range")
            overrides.update({i: d for i in range(first, last + 1)})
        return cls(int(parts[0]), overrides)

    def __call__(self, layer_id: int) -> int:
        """``d`` of ``layer_id``."""
        return self.overrides.get(layer_id, self.default)

    @property
    def uniform(self) -> bool:
        return not self.overrides

    @property
    def max(self) -> int:
        return max([self.default, *self.overrides.values()])

    def values(self, layer_ids: Iterable[int]) -> tuple[int, ...]:
        return tuple(self(i) for i in layer_ids)

    def to_json(self) -> Any:
        """An int when uniform, else ``{"default": d, "layers": {"5": 512, ...}}``."""
        if self.uniform:
            return self.default
        return {"default": self.default, "layers": {str(k): v for k, v in self.overrides.items()}}

    def __str__(self) -> str:
        if self.uniform:
            return str(self.default)
        return ",".join([str(self.default), *(f"{k}:{v}" for k, v in self.overrides.items())])
