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
``ROTATIONZOO_RETRIES``       extra attempts of a source after a 5xx or a timeout (default 2)
``ROTATIONZOO_PINS``          the file of sha256 pinned on first use (default: user config dir)
``ROTATIONZOO_ALLOW_HTTP_LOOPBACK``  ``1``: accept ``http://`` URLs to a loopback host (tests)
===========================  ===============================================================
"""

from __future__ import annotations

import math
import os
from pathlib import Path

_TRUE = {"1", "true", "yes", "on"}


def env_bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    return value.strip().lower() in _TRUE


def registry_overlays() -> list[Path]:
    """Paths named by ``ROTATIONZOO_REGISTRY`` (empty list when unset)."""
    raw = os.environ.get("ROTATIONZOO_REGISTRY", "")
    return [Path(p).expanduser() for p in raw.split(os.pathsep) if p.strip()]


def cache_dir() -> Path:
    """Cache root: ``ROTATIONZOO_CACHE``, else the platform user cache dir (``~/.cache/rotationzoo``)."""
    raw = os.environ.get("ROTATIONZOO_CACHE")
    if raw:
        return Path(raw).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("rotationzoo", appauthor=False))


def offline() -> bool:
    """True when ``ROTATIONZOO_OFFLINE`` or ``HF_HUB_OFFLINE`` is set to a true value."""
    return env_bool("ROTATIONZOO_OFFLINE") or env_bool("HF_HUB_OFFLINE")


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
    """Extra attempts of one source after a 5xx or a timeout: ``ROTATIONZOO_RETRIES`` (default 2)."""
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
