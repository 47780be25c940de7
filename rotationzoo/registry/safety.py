"""What names, paths, revisions and URLs a registry (bundled, overlay, or written by publish) may hold.

Every value that ends up in a file-system path or a request is checked when a registry is loaded,
so that no entry can make the cache write outside its root, make a hub client write outside its
cache, read a file outside the package, or send a request to an unexpected scheme or host:

- **model ids** and **repositories**: ``NAMESPACE/NAME``, each part ``[A-Za-z0-9][A-Za-z0-9._-]*``
  (at most 96 characters, never ``.`` or ``..``, no ``--``: the cache's folders write ``/`` as ``--``,
  so ``a--b/c`` and ``a/b--c`` would share one; the Hugging Face Hub refuses ``--`` in ids too);
- **aliases**: ``NAME`` or ``NAMESPACE/NAME`` of such parts; **tags**: one part (``+`` allowed too),
  at most 128 characters;
- **file paths** (``files.*.path``, a source's ``path``): relative, ``/``-separated parts of
  ``[A-Za-z0-9._+-]``, none empty, ``.`` or ``..``;
- **revisions**: a branch, tag or commit: ``/``-separated parts of ``[A-Za-z0-9._+-]``, none empty,
  ``.`` or ``..``, no ``--`` (``rel/1`` and ``rel--1`` would share a cache folder: give such a branch by
  its commit), at most 200 characters;
- **URLs**: ``https://`` only; ``http://`` to a loopback host (``127.0.0.1``, ``::1``,
  ``localhost``) only when ``ROTATIONZOO_ALLOW_HTTP_LOOPBACK=1`` (the test hub server); no
  credentials in the URL;
- **bundled** paths resolve inside the package's ``data/`` folder.
"""

from __future__ import annotations

import re
import urllib.parse
from pathlib import Path

from .. import config
from ..errors import RegistryError

_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
MODEL_ID = re.compile(rf"^{_PART}/{_PART}$")
_ALIAS = re.compile(rf"^{_PART}(/{_PART})?$")
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_PATH_PART = re.compile(r"^[A-Za-z0-9._+-]+$")
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


def _no_dots(value: str) -> bool:
    return all(part not in ("", ".", "..") for part in value.split("/"))


def check_model_id(value: object, where: str) -> str:
    """A ``NAMESPACE/NAME`` model id or repository."""
    if (not isinstance(value, str) or len(value) > 96 or not MODEL_ID.match(value) or not _no_dots(value)
            or "--" in value):
        raise RegistryError(f"{where}: {value!r} is not a NAMESPACE/NAME id (letters, digits and . _ -; no '..' "
                            f"or '--')")
    return value


def check_alias(value: object, where: str) -> str:
    if not isinstance(value, str) or len(value) > 96 or not _ALIAS.match(value) or not _no_dots(value):
        raise RegistryError(f"{where}: alias {value!r} must be NAME or NAMESPACE/NAME (letters, digits and . _ -)")
    return value


def check_tag(value: object, where: str) -> str:
    """A calibration tag: one path component."""
    if not isinstance(value, str) or len(value) > 128 or not _TAG.match(value) or value in (".", ".."):
        raise RegistryError(f"{where}: tag {value!r} must be one name of letters, digits and . _ + - (no '/', '..')")
    return value


def check_relpath(value: object, where: str) -> str:
    """A relative ``/``-separated path with safe parts (no empty, ``.`` or ``..`` parts)."""
    ok = (isinstance(value, str) and 0 < len(value) <= 512 and not value.startswith("/") and _no_dots(value)
          and all(_PATH_PART.match(p) for p in value.split("/")))
    if not ok:
        raise RegistryError(f"{where}: path {value!r} must be relative, with parts of letters, digits and . _ + - "
                            f"(no empty, '.' or '..' parts)")
    return str(value)


_PATTERN_PART = re.compile(r"^[A-Za-z0-9._+-]*\*[A-Za-z0-9._+-]*$")


def check_file_path(value: object, where: str) -> str:
    """A file's path in a registry entry: a relative path (:func:`check_relpath`) whose last part may hold
    one ``*`` (``Qwen3.8-27B/k_rotation_*.pt``): the one file of its folder that matches it, as the authors'
    recipes find a zoo folder's files; resolved at the source when the file is fetched."""
    if isinstance(value, str) and "*" in value:
        head, _, last = value.rpartition("/")
        if last.count("*") != 1 or not _PATTERN_PART.match(last) or last.startswith("*") or (head and "*" in head):
            raise RegistryError(f"{where}: path {value!r} may hold one '*' in its last part only, after a prefix "
                                f"(k_rotation_*.pt)")
        if head:
            check_relpath(head, where)
        return value
    return check_relpath(value, where)


def check_revision(value: object, where: str) -> str:
    """A branch, tag or commit sha (``/`` allowed between safe parts)."""
    ok = (isinstance(value, str) and 0 < len(value) <= 200 and not value.startswith("/") and _no_dots(value)
          and all(_PATH_PART.match(p) for p in value.split("/")) and "--" not in value)
    if not ok:
        raise RegistryError(f"{where}: revision {value!r} must be a branch, tag or commit name (parts of letters, "
                            f"digits and . _ + -; no '..' or '--': give such a branch by its commit sha)")
    return str(value)


def check_url(value: object, where: str) -> str:
    """An ``https://`` URL (``http://`` only to loopback, when allowed)."""
    try:
        parts = urllib.parse.urlsplit(str(value))
    except ValueError:
        parts = None
    if not isinstance(value, str) or parts is None or not parts.hostname:
        raise RegistryError(f"{where}: url {value!r} is not an http(s) URL with a host")
    if parts.username or parts.password:
        raise RegistryError(f"{where}: url must not carry credentials")
    if parts.scheme == "https":
        return value
    if parts.scheme == "http" and parts.hostname in LOOPBACK_HOSTS and config.allow_http_loopback():
        return value
    raise RegistryError(f"{where}: url {value!r} must start with https:// (http:// only to a loopback host with "
                        f"ROTATIONZOO_ALLOW_HTTP_LOOPBACK=1)")


def bundled_file(path: str, where: str = "bundled source") -> Path:
    """The package data file a ``bundled`` source names, refused unless it resolves inside ``data/``."""
    check_relpath(path, where)
    root = config.package_data_dir().resolve()
    full = (root / path).resolve()
    if not full.is_relative_to(root):
        raise RegistryError(f"{where}: path {path!r} leaves the package's data folder")
    return full
