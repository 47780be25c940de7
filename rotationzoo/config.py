"""Every environment variable rotationzoo reads, parsed in one place.

Accessors are functions (not import-time constants) so tests and long-lived processes see changes.

===========================  ===============================================================
``ROTATIONZOO_REGISTRY``      extra registry file(s) (``os.pathsep``-separated) whose models
                              override bundled models with the same id
``ROTATIONZOO_CACHE``         cache root (default: the platform user cache dir)
``ROTATIONZOO_OFFLINE``       ``1``: never touch the network (also honoured: ``HF_HUB_OFFLINE``)
``ROTATIONZOO_TIMEOUT``       seconds for each step of a request: DNS lookup, connect, TLS
                              handshake, an answer's headers, a silent read (default 10)
``ROTATIONZOO_MIN_RATE``      bytes per second a download's body must keep up with: a body of
                              S bytes ends within TIMEOUT + S / MIN_RATE seconds (default 32768;
                              0: no rate rule, only the silent-read timeout)
``ROTATIONZOO_RETRIES``       extra attempts of a source after a 5xx, a dropped connection (on
                              the pre-flight or the download) or a silent pre-flight (default 2)
``ROTATIONZOO_PINS``          the file of sha256 pinned on first use (default: user config dir)
``ROTATIONZOO_ALLOW_HTTP_LOOPBACK``  ``1``: accept ``http://`` URLs to a loopback host (tests)
``ROTATIONZOO_DEBUG``         ``1``: the CLI prints tracebacks (as ``--debug``)
``ROTATIONZOO_NATIVE``        ``0``: CPU kernels stay on the PyTorch reference; no C compiler is
                              run (default ``1``: :mod:`rotationzoo.kernels.native`)
===========================  ===============================================================

Boolean variables (``ROTATIONZOO_OFFLINE``, ``HF_HUB_OFFLINE``, ``ROTATIONZOO_ALLOW_HTTP_LOOPBACK``,
``ROTATIONZOO_DEBUG``, ``ROTATIONZOO_NATIVE``) take ``1``, ``true``, ``yes`` or ``on`` for true and ``0``, ``false``,
``no`` or ``off`` for false, in any case; unset, empty or blank is the default. Anything else
(``Y``, ``2``, ``offline``, `` 1``) is refused with one :class:`~rotationzoo.errors.ConfigError`
line naming the variable, rather than silently read as false. The true spellings are exactly
those ``huggingface_hub`` reads as true for ``HF_HUB_OFFLINE`` (``1``/``ON``/``YES``/``TRUE``,
any case, nothing around them), so the two never disagree on a value rotationzoo accepts; a
value ``huggingface_hub`` would quietly read as online (``HF_HUB_OFFLINE=Y``) is refused here.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

#: Spellings of a true boolean variable (any case); the same as huggingface_hub's.
TRUE_VALUES: tuple[str, ...] = ("1", "true", "yes", "on")
#: Spellings of a false boolean variable (any case).
FALSE_VALUES: tuple[str, ...] = ("0", "false", "no", "off")


def env_bool(name: str, default: bool = False) -> bool:
    """The boolean environment variable ``name`` (``default`` when unset or empty).

    Raises:
        ConfigError: a value that is none of :data:`TRUE_VALUES` or :data:`FALSE_VALUES`.
    """
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    word = value.lower()  # not stripped: huggingface_hub reads " 1" as false, so " 1" is refused
    if word in TRUE_VALUES:
        return True
    if word in FALSE_VALUES:
        return False
    from .errors import ConfigError
    from .numbers import shown

    raise ConfigError(f"{name}={shown(value)} is not a boolean; use one of {'/'.join(TRUE_VALUES)} (true) or "
                      f"{'/'.join(FALSE_VALUES)} (false), any case, or leave it unset")


def registry_overlays() -> list[Path]:
    """Paths named by ``ROTATIONZOO_REGISTRY`` (empty list when unset)."""
    raw = os.environ.get("ROTATIONZOO_REGISTRY", "")
    return [Path(p).expanduser() for p in raw.split(os.pathsep) if p.strip()]


def cache_dir() -> Path:
    """Cache root: ``ROTATIONZOO_CACHE``, else the platform user cache dir (``~/.cache/rotationzoo``).

    Raises:
        ConfigError: ``ROTATIONZOO_CACHE`` is a relative path.
    """
    raw = os.environ.get("ROTATIONZOO_CACHE")
    if raw:
        path = Path(raw).expanduser()
        if not path.is_absolute():  # each working folder would get a cache of its own
            from .errors import ConfigError

            raise ConfigError(f"ROTATIONZOO_CACHE={raw[:200]!r} is a relative path; give an absolute one (or ~/...)")
        return path
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("rotationzoo", appauthor=False))


def offline() -> bool:
    """True when ``ROTATIONZOO_OFFLINE`` or ``HF_HUB_OFFLINE`` is set to a true value.

    Both are read (a bad spelling of either is a :class:`~rotationzoo.errors.ConfigError`).
    """
    ours, hubs = env_bool("ROTATIONZOO_OFFLINE"), env_bool("HF_HUB_OFFLINE")
    return ours or hubs


def package_data_dir() -> Path:
    """Folder of data files shipped inside the package (bundled rotations)."""
    return Path(__file__).resolve().parent / "data"


def _number(name: str, default: float, kind: type) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        from .errors import ConfigError

        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if not math.isfinite(value):
        from .errors import ConfigError

        raise ConfigError(f"{name} must be a finite number, got {raw}")
    if value < 0:
        from .errors import ConfigError

        raise ConfigError(f"{name} must be >= 0, got {raw}")
    return value


#: Defaults of ``ROTATIONZOO_TIMEOUT`` (seconds) and ``ROTATIONZOO_MIN_RATE`` (bytes per second).
DEFAULT_TIMEOUT = 10.0
DEFAULT_MIN_RATE = 32768.0


def timeout() -> float:
    """Seconds for each step of a network request (DNS lookup, connect, TLS handshake, an answer's
    headers, a silent read): ``ROTATIONZOO_TIMEOUT`` (default 10)."""
    value = float(_number("ROTATIONZOO_TIMEOUT", DEFAULT_TIMEOUT, float))
    if value == 0:
        from .errors import ConfigError

        raise ConfigError("ROTATIONZOO_TIMEOUT must be > 0 seconds, got 0")
    return value


def min_rate() -> float:
    """Bytes per second a download's body must keep up with: ``ROTATIONZOO_MIN_RATE`` (default
    32768; 0 turns the rate rule off). See :class:`rotationzoo.hub.network.Limits`."""
    return float(_number("ROTATIONZOO_MIN_RATE", DEFAULT_MIN_RATE, float))


def retries() -> int:
    """Extra attempts of one source after a 5xx / 408 / 429 or a dropped connection (on any request of a
    download) or a silent pre-flight: ``ROTATIONZOO_RETRIES`` (default 2)."""
    return int(_number("ROTATIONZOO_RETRIES", 2, int))


def pins_file() -> Path:
    """Where sha256 pinned on first use are kept: ``ROTATIONZOO_PINS``, else the user config dir."""
    raw = os.environ.get("ROTATIONZOO_PINS")
    if raw:
        return Path(raw).expanduser()
    from platformdirs import user_config_dir

    return Path(user_config_dir("rotationzoo", appauthor=False)) / "pins.json"


def allow_http_loopback() -> bool:
    """``ROTATIONZOO_ALLOW_HTTP_LOOPBACK``: accept ``http://`` URLs to a loopback host (the test hub)."""
    return env_bool("ROTATIONZOO_ALLOW_HTTP_LOOPBACK")


def debug() -> bool:
    """``ROTATIONZOO_DEBUG``: the CLI prints tracebacks (the default of ``--debug``)."""
    return env_bool("ROTATIONZOO_DEBUG")


def native_kernels() -> bool:
    """``ROTATIONZOO_NATIVE`` (default true): build and run the C kernels for CPUs
    (:mod:`rotationzoo.kernels.native`); false keeps CPU kernels on the PyTorch reference."""
    return env_bool("ROTATIONZOO_NATIVE", default=True)


def offline_reason() -> str:
    """Why offline mode is on (the variable that set it, else the caller's flag), for error messages."""
    if env_bool("ROTATIONZOO_OFFLINE"):
        return "ROTATIONZOO_OFFLINE is set"
    if env_bool("HF_HUB_OFFLINE"):
        return "HF_HUB_OFFLINE is set"
    return "--offline (offline=True) was given"
