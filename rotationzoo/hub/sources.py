"""Downloaders, one per source type, with one signature (like pooch's ``choose_downloader``).

Each returns the downloaded file and every path that must be removed if its bytes turn out bad
(the hub clients keep poisoned blobs otherwise). Bundled data is not downloaded: see
:func:`bundled_path`.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import config
from ..registry import FileEntry, Source


@dataclass
class Download:
    """A downloaded file and what to purge when it fails verification."""

    path: Path
    purge: list[Path]


#: ``downloader(source, file, *, hub_cache, dest_dir, revision, force) -> Download``.
Downloader = Callable[..., Download]


def hf_endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def ms_endpoint() -> str | None:
    return os.environ.get("MODELSCOPE_ENDPOINT") or None


def _with_blob(path: str) -> Download:
    p = Path(path)
    # a snapshot entry may be a symlink to a blob; a bad download must remove both
    return Download(p, [p, Path(os.path.realpath(p))])


def download_huggingface(src: Source, f: FileEntry, *, hub_cache: Path, dest_dir: Path, revision: str | None,
                         force: bool) -> Download:
    from huggingface_hub import hf_hub_download

    assert src.repo is not None
    return _with_blob(hf_hub_download(
        repo_id=src.repo,
        filename=f.source_path(src),
        revision=revision,
        cache_dir=str(hub_cache / "huggingface"),
        endpoint=hf_endpoint(),
        force_download=force,
    ))


def download_modelscope(src: Source, f: FileEntry, *, hub_cache: Path, dest_dir: Path, revision: str | None,
                        force: bool) -> Download:
    from modelscope.hub.file_download import model_file_download

    assert src.repo is not None
    # its tqdm bars cannot be switched off; keep them for terminals, drop them from logs and pipes
    quiet = contextlib.nullcontext() if sys.stderr.isatty() else contextlib.redirect_stderr(io.StringIO())
    with quiet:
        path = model_file_download(
            model_id=src.repo,
            file_path=f.source_path(src),
            revision=revision,  # always explicit: None would mean "newest tag"
            cache_dir=str(hub_cache / "modelscope"),
            endpoint=ms_endpoint(),
        )
    return _with_blob(path)


def download_url(src: Source, f: FileEntry, *, hub_cache: Path, dest_dir: Path, revision: str | None,
                 force: bool, timeout: float = 60.0) -> Download:
    import urllib.request

    assert src.url is not None
    fd, tmp = tempfile.mkstemp(prefix=".url-", suffix=".part", dir=dest_dir)
    req = urllib.request.Request(src.url, headers={"User-Agent": "rotationzoo"})
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(req, timeout=timeout) as resp:
            shutil.copyfileobj(resp, out, 1 << 20)
    except BaseException:
        os.unlink(tmp)
        raise
    return Download(Path(tmp), [Path(tmp)])


DOWNLOADERS: dict[str, Downloader] = {
    "huggingface": download_huggingface,
    "modelscope": download_modelscope,
    "url": download_url,
}


def bundled_path(src: Source) -> Path:
    """The package data file a ``bundled`` source names."""
    return config.package_data_dir() / str(src.path)


def describe_exc(exc: BaseException) -> str:
    """One line: the exception and the root cause (HTTP status, connection error) the clients wrap."""
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and len(chain) < 6:
        chain.append(e)
        e = e.__cause__ or e.__context__
    status = next((getattr(getattr(c, "response", None), "status_code", None) for c in chain
                   if getattr(getattr(c, "response", None), "status_code", None) is not None), None)

    def first_line(c: BaseException) -> str:
        text = str(c).strip()
        return text.splitlines()[0] if text else ""

    root = chain[-1]
    parts = [f"{type(exc).__name__}: {first_line(exc)}"]
    if root is not exc:
        parts.append(f"cause {type(root).__name__}: {first_line(root)}")
    if status is not None:
        parts.insert(0, f"HTTP {status}")
    return "; ".join(p for p in parts if p)[:400]
