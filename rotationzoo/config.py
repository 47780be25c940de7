"""Every environment variable rotationzoo reads, parsed in one place.

Accessors are functions (not import-time constants) so tests and long-lived processes see changes.

===========================  ===============================================================
``ROTATIONZOO_REGISTRY``      extra registry file(s) (``os.pathsep``-separated) whose models
                              override bundled models with the same id
``ROTATIONZOO_CACHE``         cache root (default: the platform user cache dir)
``ROTATIONZOO_OFFLINE``       ``1``: never touch the network (also honoured: ``HF_HUB_OFFLINE``)
===========================  ===============================================================
"""

from __future__ import annotations

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
