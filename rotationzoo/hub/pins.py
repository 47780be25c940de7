"""Trust on first use for files the registry does not pin.

The first verified download of an unpinned file records its sha256 (and the source, revision and hub
commit it came from) in the user's pin file (``ROTATIONZOO_PINS``, default
``<user config dir>/rotationzoo/pins.json``). Every later fetch or cache hit of that file is compared
with the pin: a different file is refused with :class:`~rotationzoo.errors.IntegrityError` unless the
caller accepts it (``accept_new=True``, ``rotationzoo fetch --accept-new``), which re-pins it.

Files the registry pins (``sha256`` in the entry) never use this file: the registry wins.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from .. import config
from ..errors import ConfigError, IntegrityError
from ..registry import TagEntry

_SHA256 = re.compile(r"^[0-9a-f]{64}$")

#: What :func:`pin_state` answers for one file.
PINNED, PINNED_LOCALLY, UNPINNED = "pinned", "pinned locally", "unpinned"


def pin_key(entry: TagEntry, side: str) -> str:
    return f"{entry.model_id}:{entry.name}:{side}"


def read_pins(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """The pin file as ``{key: {"sha256": ..., ...}}`` (empty when absent).

    Raises:
        ConfigError: the file exists but is not a pin file.
    """
    path = path or config.pins_file()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read the pin file ({exc}); fix or delete it") from None
    pins = data.get("pins") if isinstance(data, dict) else None
    if not isinstance(pins, dict):
        raise ConfigError(f"{path}: not a pin file (expected an object with 'pins'); fix or delete it")
    return {k: v for k, v in pins.items()
            if isinstance(v, dict) and isinstance(v.get("sha256"), str) and _SHA256.match(v["sha256"])}


def _write(pins: dict[str, dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"pins_version": 1, "pins": pins}, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


def pin_for(entry: TagEntry, side: str) -> dict[str, Any] | None:
    """The local pin of an unpinned file, if any."""
    return read_pins().get(pin_key(entry, side))


def pin_state(entry: TagEntry, side: str) -> str:
    """``"pinned"`` (registry sha256), ``"pinned locally"`` (pin file) or ``"unpinned"``."""
    if entry.files[side].sha256 is not None:
        return PINNED
    return PINNED_LOCALLY if pin_for(entry, side) is not None else UNPINNED


def check_or_pin(entry: TagEntry, side: str, sha: str, *, source: str, revision: str | None = None,
                 commit: str | None = None, accept_new: bool = False) -> str:
    """Compare a verified unpinned file with its pin, recording the pin on first use.

    Returns:
        ``"new"`` (pinned now), ``"same"`` (matches the pin) or ``"repinned"`` (``accept_new``).

    Raises:
        IntegrityError: the file differs from the pin and ``accept_new`` is false.
    """
    from filelock import FileLock

    path = config.pins_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    key = pin_key(entry, side)
    with FileLock(str(path.with_name(path.name + ".lock"))):
        pins = read_pins(path)
        old = pins.get(key)
        if old is not None and old["sha256"] == sha:
            return "same"
        if old is not None and not accept_new:
            raise IntegrityError(
                f"{entry.key} {side.upper()} file changed since it was first used: pinned sha256 {old['sha256']} "
                f"(from {old.get('source', '?')}, {old.get('pinned_at', '?')}), now {sha} from {source}; "
                f"if the change is expected, run `rotationzoo fetch --model {entry.model_id} --tag {entry.name} "
                f"--accept-new`"
            )
        pins[key] = {"sha256": sha, "source": source, "revision": revision, "commit": commit,
                     "pinned_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        _write(pins, path)
        return "new" if old is None else "repinned"
