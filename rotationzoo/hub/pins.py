"""Trust on first use for files the registry does not pin.

The first verified copy of an unpinned file from one source at one revision records its sha256 (and
the hub commit it came from) in the user's pin file (``ROTATIONZOO_PINS``, default
``<user config dir>/rotationzoo/pins.json``). Pins are keyed by the file (model, tag, side) *and* the
source it came from with its revision (``huggingface:org/repo@main``, ``url:https://…``): another
revision or another source is another first use, never a conflict. Every later download or cache hit
from the same source and revision is compared with the pin: a different file is refused with
:class:`~rotationzoo.errors.IntegrityError` unless the caller accepts it (``accept_new=True``,
``rotationzoo fetch --accept-new``), which re-pins it. A cache hit of a copy that no pin covers yet (a
shared cache, another pin file) is validated and pinned like a download.

The pin file is read defensively: a regular file of at most :data:`MAX_PIN_FILE_BYTES`, JSON whose
every entry is well formed; anything else is a :class:`~rotationzoo.errors.ConfigError` that names the
file and the entry (never silently dropped). Version 1 files (keyed by file only) are read and
rewritten as version 2 on the next pin.

Files the registry pins (``sha256`` in the entry) never use this file: the registry wins.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import time
from pathlib import Path
from typing import Any

from .. import config
from ..errors import ConfigError, IntegrityError
from ..registry import TagEntry
from ..safefile import check_regular, file_lock, read_regular

_SHA256 = re.compile(r"^[0-9a-f]{64}$")

#: What :func:`pin_state` answers for one file.
PINNED, PINNED_LOCALLY, UNPINNED = "pinned", "pinned locally", "unpinned"
#: Version written by this module (1 is read too).
PINS_VERSION = 2
#: Largest pin file read (a pin is about 300 bytes).
MAX_PIN_FILE_BYTES = 4 << 20
#: Longest source label or revision kept in a pin.
MAX_LABEL = 512
_FIELDS = ("source", "revision", "commit", "pinned_at")


def file_key(entry: TagEntry, side: str) -> str:
    """``model:tag:side``: the file a pin is about."""
    return f"{entry.model_id}:{entry.name}:{side}"


def pin_key(entry: TagEntry, side: str, source: str) -> str:
    """``model:tag:side|source``, where ``source`` is the label of the source and revision the copy came
    from (``huggingface:org/repo@rev``, ``modelscope:org/repo@master``, ``url:https://…``)."""
    return f"{file_key(entry, side)}|{source}"


_HINT = "fix or delete the pin file, or point ROTATIONZOO_PINS at another file"
#: Longest wait, in seconds, for another process writing the pin file (it holds the lock for milliseconds).
LOCK_WAIT_S = 10.0


def _bad(path: Path, what: str) -> ConfigError:
    return ConfigError(f"{path}: {what}; fix or delete the pin file (ROTATIONZOO_PINS)")


def _read_text(path: Path) -> str | None:
    """The pin file's text, or ``None`` when absent; only a regular file of bounded size is opened
    (a FIFO, a device or a ``/proc`` file is refused by its type, without blocking)."""
    try:
        st = check_regular(path, what="pin file", error=ConfigError, hint=_HINT)
    except (FileNotFoundError, NotADirectoryError):  # absent (writing it will say why it cannot be)
        return None
    except OSError as exc:
        raise _bad(path, f"cannot read the pin file ({exc.strerror or exc})") from None
    if st.st_size > MAX_PIN_FILE_BYTES:
        raise _bad(path, f"the pin file holds {st.st_size} B, more than the {MAX_PIN_FILE_BYTES} B a pin file may")
    try:
        data = read_regular(path, MAX_PIN_FILE_BYTES, what="pin file", error=ConfigError, hint=_HINT)
    except OSError as exc:
        raise _bad(path, f"cannot read the pin file ({exc.strerror or exc})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise _bad(path, "the pin file is not UTF-8 text") from None


def _one_line(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= MAX_LABEL and not any(c in v for c in "\n\r\0")


def _check_pin(path: Path, key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(path, f"pin {key[:120]!r} is not an object")
    sha = value.get("sha256")
    if not isinstance(sha, str) or not _SHA256.match(sha):
        raise _bad(path, f"pin {key[:120]!r} has no valid sha256 (64 lowercase hex digits)")
    out: dict[str, Any] = {"sha256": sha}
    for name in _FIELDS:
        v = value.get(name)
        if v is None:
            out[name] = None
        elif not _one_line(v):
            raise _bad(path, f"pin {key[:120]!r}: {name} must be a one-line string of at most {MAX_LABEL} characters")
        else:
            out[name] = v
    return out


def read_pins(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """The pin file as ``{pin_key: {"sha256": ..., "source": ..., ...}}`` (empty when absent).

    Raises:
        ConfigError: the file exists but is not a pin file, or one of its entries is malformed.
    """
    path = path or config.pins_file()
    text = _read_text(path)
    if text is None:
        return {}
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        raise _bad(path, "the pin file is not valid JSON") from None
    pins = data.get("pins") if isinstance(data, dict) else None
    version = data.get("pins_version", 1) if isinstance(data, dict) else None
    if not isinstance(pins, dict) or type(version) is not int or version not in (1, PINS_VERSION):
        raise _bad(path, f"not a pin file (expected an object with 'pins_version' 1 or {PINS_VERSION} and 'pins')")
    out: dict[str, dict[str, Any]] = {}
    for key, value in pins.items():
        pin = _check_pin(path, key, value)
        if "|" not in key:  # version 1: keyed by file only; the pin names its source
            if version != 1 or pin["source"] is None or key.count(":") < 2:
                raise _bad(path, f"pin {key[:120]!r} names no source")
            key = f"{key}|{pin['source']}"
        elif key.count(":") < 2 or not key.split("|", 1)[1]:
            raise _bad(path, f"pin key {key[:120]!r} is not 'model:tag:side|source'")
        out[key] = pin
    return out


def _write(pins: dict[str, dict[str, Any]], path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"pins_version": PINS_VERSION, "pins": pins}, indent=1, sort_keys=True),
                       encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise ConfigError(f"cannot write the pin file {path} ({exc.strerror or exc}); set ROTATIONZOO_PINS to a "
                          f"writable file") from None


def pin_for(entry: TagEntry, side: str, source: str) -> dict[str, Any] | None:
    """The local pin of an unpinned file as it came from ``source`` (a source label), if any."""
    return read_pins().get(pin_key(entry, side, source))


def local_pins(entry: TagEntry, side: str) -> dict[str, dict[str, Any]]:
    """Every local pin of one file: ``{source label: pin}``."""
    prefix = file_key(entry, side) + "|"
    return {k[len(prefix):]: v for k, v in read_pins().items() if k.startswith(prefix)}


def pin_state(entry: TagEntry, side: str) -> str:
    """``"pinned"`` (registry sha256), ``"pinned locally"`` (pin file, from some source) or ``"unpinned"``."""
    if entry.files[side].sha256 is not None:
        return PINNED
    return PINNED_LOCALLY if local_pins(entry, side) else UNPINNED


def check_or_pin(entry: TagEntry, side: str, sha: str, *, source: str, revision: str | None = None,
                 commit: str | None = None, accept_new: bool = False) -> str:
    """Compare a verified unpinned file with its pin for ``source``, recording the pin on first use.

    Returns:
        ``"new"`` (pinned now), ``"same"`` (matches the pin) or ``"repinned"`` (``accept_new``).

    Raises:
        IntegrityError: the file differs from the pin and ``accept_new`` is false.
        ConfigError: the pin file cannot be read or written (named in the message).
    """
    path = config.pins_file()
    if not _one_line(source):  # a pin the reader would refuse must never be written (it would lose every pin)
        raise ConfigError(f"{entry.key} {side.upper()}: its source label is not a one-line string of at most "
                          f"{MAX_LABEL} characters, so no local pin can record it; pin the file's sha256 in the registry")
    revision, commit = (v if _one_line(v) else None for v in (revision, commit))  # what the hub said, if sane
    key = pin_key(entry, side, source)
    hint = "set ROTATIONZOO_PINS to a writable file"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot write the pin file {path} ({exc.strerror or exc}); {hint}") from None
    read_pins(path)  # a pin file that is not one (a FIFO, /proc/...) is refused before its lock is taken
    with file_lock(path.with_name(path.name + ".lock"), timeout=LOCK_WAIT_S, what=f"pin file {path}",
                   error=ConfigError, hint=hint):
        pins = read_pins(path)
        old = pins.get(key)
        if old is not None and old["sha256"] == sha:
            return "same"
        if old is not None and not accept_new:
            raise IntegrityError(
                f"{entry.key} {side.upper()} file from {source} changed since it was first used: pinned sha256 "
                f"{old['sha256']} ({old.get('pinned_at') or '?'}), now {sha}; if the change is expected, run "
                f"`{shlex.join(['rotationzoo', 'fetch', '--model', entry.model_id, '--tag', entry.name, '--accept-new'])}`"
            )
        pins[key] = {"sha256": sha, "source": source, "revision": revision, "commit": commit,
                     "pinned_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        _write(pins, path)
        return "new" if old is None else "repinned"
