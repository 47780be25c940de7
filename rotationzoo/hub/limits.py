"""How long a download may take: :class:`Limits` (a per-step timeout and a minimum body rate), the limits in
force (:func:`limits`: the environment's, or those of the innermost :func:`using` block).

:mod:`~.transfer` enforces them on every socket read of a download; :mod:`~.network` bounds its
pre-flight requests by them.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass
from typing import Iterator

from .. import config
from ..errors import ConfigError


@dataclass(frozen=True)
class Limits:
    """How long a download may take.

    ``timeout``: seconds for each step of a request — DNS lookup, connect, TLS handshake, the
    answer's status line and headers, any silent read. ``min_rate``: bytes per second the body must
    keep up with — ``t`` seconds after it was first asked for, at least ``(t - timeout) * min_rate``
    bytes have arrived — so a body of ``size`` bytes ends within :meth:`body_seconds` (0: no rate
    rule, only the silent-read timeout). Environment: ``ROTATIONZOO_TIMEOUT``,
    ``ROTATIONZOO_MIN_RATE``; in code: :func:`using`.
    """

    timeout: float = config.DEFAULT_TIMEOUT
    min_rate: float = config.DEFAULT_MIN_RATE

    def __post_init__(self) -> None:
        def number(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if not (number(self.timeout) and self.timeout > 0):
            raise ConfigError(f"timeout must be a finite number of seconds > 0, got {self.timeout!r}")
        if not (number(self.min_rate) and self.min_rate >= 0):
            raise ConfigError(f"min_rate must be a finite number of bytes per second >= 0, got {self.min_rate!r}")

    def body_seconds(self, size: int) -> float:
        """The longest a body of ``size`` bytes may take (``inf`` without a rate rule)."""
        return self.timeout + size / self.min_rate if self.min_rate else math.inf


_limits: contextvars.ContextVar[Limits | None] = contextvars.ContextVar("rotationzoo_limits", default=None)


def limits() -> Limits:
    """The limits in force: the innermost :func:`using` block's, else the environment's."""
    return _limits.get() or Limits(config.timeout(), config.min_rate())


@contextlib.contextmanager
def using(*, timeout: float | None = None, min_rate: float | None = None) -> Iterator[Limits]:
    """Downloads made in this block (this thread or task only) use these limits; a knob not given
    keeps its current value::

        with network.using(timeout=5, min_rate=100_000):
            rotationzoo.fetch("Qwen3-8B")

    Raises:
        ConfigError: a value is not a finite number > 0 (``timeout``) or >= 0 (``min_rate``).
    """
    base = limits()
    chosen = Limits(base.timeout if timeout is None else timeout, base.min_rate if min_rate is None else min_rate)
    token = _limits.set(chosen)
    try:
        yield chosen
    finally:
        _limits.reset(token)
