"""How an engine is launched for one registry entry: the knobs of a recipe that are not INT2 settings.

The INT2 store itself (clip ratios, windows, group size, dtypes, Lloyd-Max) is an
:class:`~rotationzoo.int2kv.Int2KVConfig`; this is the rest of a per-model recipe of the authors'
current SGLang tree (``rotation/run/<model>.sh`` in FutureMLS-Lab/OSCAR), one frozen type, with one
name per knob everywhere (``registry.json`` ``launch`` key, Python attribute, CLI flag):

===============================  ============================  =============================================
attribute / JSON key             CLI flag (``serve-args``)     meaning
===============================  ============================  =============================================
``tp_size``                      ``--tp-size`` / ``--tp``      tensor-parallel ranks (``--tensor-parallel-size``)
``ep_size``                      ``--ep-size`` / ``--ep``      expert-parallel groups of those ranks for MoE layers
``attention_backend``            –                             ``--attention-backend`` (the INT2 prefill reads it)
``prefill_attention_backend``    –                             ``--prefill-attention-backend``
``decode_attention_backend``     –                             ``--decode-attention-backend`` (always ``triton``)
``absorb_v_rotation``            ``--absorb-v-rotation``       fold ``R_V`` into the weights at load time
``disable_radix_cache``          ``--disable-radix-cache``     serve without the prefix cache
``mamba_scheduler_strategy``     –                             ``extra_buffer`` for hybrid models
``recipe``                       –                             the recipe these values come from (provenance)
===============================  ============================  =============================================

Defaults are the current tree's: TP 1, no expert parallelism (EP 1), triton for every backend (FA3's INT2 prefill asserts on
sliding-window layers), no absorption (it is wrong for per-head and centered files), the prefix cache
on. Bounds: ``tp_size`` 1 … :data:`~rotationzoo.sharding.MAX_TP`; ``ep_size`` a divisor of ``tp_size`` (SGLang
splits the TP ranks into ``ep_size`` expert groups; each MoE weight is then split over ``tp_size / ep_size``
ranks, attention and the KV cache still over all ``tp_size``); backends and strategies from
:mod:`rotationzoo.vocab`; ``recipe`` a printable string of at most 200 characters.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping

from .errors import ConfigError
from .numbers import check_int, shown
from .sharding import MAX_TP, check_ep_size
from .vocab import ATTENTION_BACKENDS, MAMBA_SCHEDULER_STRATEGIES, AttentionBackend, MambaSchedulerStrategy

#: Longest ``recipe`` text.
MAX_RECIPE_CHARS = 200
_RECIPE = re.compile(r"^[A-Za-z0-9._/@:+-]+$")


@dataclass(frozen=True)
class LaunchConfig:
    """The launch knobs of a recipe (see the module docstring for each).

    Raises:
        ConfigError: a value outside its bound, on construction.
    """

    tp_size: int = 1
    ep_size: int = 1
    attention_backend: AttentionBackend = "triton"
    prefill_attention_backend: AttentionBackend = "triton"
    decode_attention_backend: AttentionBackend = "triton"
    absorb_v_rotation: bool = False
    disable_radix_cache: bool = False
    mamba_scheduler_strategy: MambaSchedulerStrategy | None = None
    recipe: str | None = None

    def __post_init__(self) -> None:
        check_int(self.tp_size, "tp_size", low=1, high=MAX_TP, hint=" tensor-parallel ranks")
        check_ep_size(self.ep_size, self.tp_size)
        for name in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
            if getattr(self, name) not in ATTENTION_BACKENDS:
                raise ConfigError(f"{name} must be one of {', '.join(ATTENTION_BACKENDS)}, got {shown(getattr(self, name))}")
        if self.decode_attention_backend != "triton":
            raise ConfigError("decode_attention_backend must be triton: the OSCAR INT2 decode kernels are triton kernels")
        for name in ("absorb_v_rotation", "disable_radix_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {shown(getattr(self, name))}")
        m = self.mamba_scheduler_strategy
        if m is not None and m not in MAMBA_SCHEDULER_STRATEGIES:
            raise ConfigError(f"mamba_scheduler_strategy must be one of {', '.join(MAMBA_SCHEDULER_STRATEGIES)} "
                              f"(or null), got {shown(m)}")
        r = self.recipe
        if r is not None and (not isinstance(r, str) or len(r) > MAX_RECIPE_CHARS or not _RECIPE.match(r)):
            raise ConfigError(f"recipe must be a path such as rotation/run/qwen3-8b.sh@0bbba6d0 (letters, digits, "
                              f". _ / @ : + -, at most {MAX_RECIPE_CHARS} characters), got {shown(r)}")

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None, *, where: str = "launch") -> "LaunchConfig":
        """Build from a ``registry.json`` ``launch`` block (missing keys take the defaults).

        Raises:
            ConfigError: an unknown key or a bad value (the message names ``where``).
        """
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected an object of launch settings, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(k if len(k) <= 40 else shown(k) for k in unknown[:5])}; "
                              f"expected {', '.join(sorted(known))}")
        try:
            return cls(**dict(data))
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    def replace(self, **changes: Any) -> "LaunchConfig":
        """A copy with some knobs changed; ``None`` values are ignored (optional CLI flags)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


__all__ = ["MAX_RECIPE_CHARS", "LaunchConfig"]
