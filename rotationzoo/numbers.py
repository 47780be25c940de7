"""Numbers from users, registry files and the environment, checked against documented bounds.

Every count, size or ratio that a command line, a Python call or a registry file gives is checked
here before any arithmetic uses it: of the right kind (an integer where a count is meant; ``bool``
is never a number), finite (no NaN or infinity) and within a stated range. A refusal is one line
naming the value, the range and what to do, raised as the caller's error type
(:class:`~rotationzoo.errors.ConfigError` for settings, :class:`~rotationzoo.errors.RegistryError`
for registry files). Values are echoed cut to 60 characters, so that a 400-digit number does not
flood the terminal. Plain Python (no torch).
"""

from __future__ import annotations

import math
import operator
import re

from .errors import ConfigError, RotationZooError

#: Longest echo of a bad value in an error message.
SHOWN_CHARS = 60
#: Characters that never reach a terminal or a launch line raw: C0 controls (newline and tab included),
#: DEL, C1 controls, the Unicode line and paragraph separators, and the bidi embeddings, overrides and
#: isolates (U+202A–U+202E, U+2066–U+2069), which make a terminal show text in another order than it is.
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def shown(value: object) -> str:
    """``repr(value)``, cut to :data:`SHOWN_CHARS` characters with the full length said."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's str-digits limit
        text = f"<an integer of about {int(value.bit_length() * 0.30103) + 1} digits>" if isinstance(value, int) else "?"
    if len(text) <= SHOWN_CHARS:
        return text
    half = (SHOWN_CHARS - 10) // 2
    return f"{text[:half]}…{text[-half:]} ({len(text)} characters)"


#: Largest count a user gives of things an evaluation makes one by one (the copy probe's passage, filler and
#: probes, error windows: ``--passage-tokens``, ``--filler-tokens``, ``--probes``, ``--error-windows``): 2^20,
#: past any text an evaluation reads.
MAX_COUNT = 2**20

#: The evaluation's bootstrap: tokens per resampled block (``--block-tokens``), resamples per interval
#: (``--resamples``, at most :data:`MAX_RESAMPLES`: each costs a pass over the blocks of every comparison).
DEFAULT_BLOCK_TOKENS = 256
DEFAULT_RESAMPLES = 2000
MAX_RESAMPLES = 100_000


def check_int(value: object, what: str, *, low: int, high: int, hint: str = "",
              error: type[RotationZooError] = ConfigError) -> int:
    """``value`` when it is an integer with ``low <= value <= high``; otherwise ``error``.

    Args:
        value: the number given.
        what: its name in the message (``"context"``, ``"models[0].architecture.num_layers"``).
        low, high: the inclusive bounds.
        hint: appended to the message (``"; 0 disables"``).
        error: the exception type raised.
    """
    if not isinstance(value, (bool, int)) and hasattr(type(value), "__index__"):  # numpy / torch integers
        try:
            value = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise error(f"{what} must be an integer from {low:,} to {high:,}{hint}, got {shown(value)}")
    return value


def check_real(value: object, what: str, *, low: float, high: float, high_open: bool = False, hint: str = "",
               error: type[RotationZooError] = ConfigError) -> float:
    """``float(value)`` when it is a finite number in ``[low, high]`` (``[low, high)`` with
    ``high_open``); otherwise ``error``. Integers are accepted (huge ones are refused, not rounded)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if ok and isinstance(value, int):
        ok = abs(value) <= 2**64  # beyond any bound here; float() of a longer int would overflow
    number = float(value) if ok else math.nan  # type: ignore[arg-type]
    inside = low <= number < high if high_open else low <= number <= high
    if not ok or not math.isfinite(number) or not inside:
        span = f"[{_bound(low)}, {_bound(high)}{')' if high_open else ']'}"
        raise error(f"{what} must be a finite number in {span}{hint}, got {shown(value)}")
    return number


def _bound(x: float) -> str:
    """``1048576.0`` → ``1,048,576``; ``0.5`` → ``0.5``."""
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


__all__ = ["DEFAULT_BLOCK_TOKENS", "DEFAULT_RESAMPLES", "MAX_COUNT", "MAX_RESAMPLES", "SHOWN_CHARS", "check_int", "check_real", "shown"]
