"""A registry file path with one ``*`` (``Qwen3.8-27B/k_rotation_*.pt``) resolved at a hub source.

The authors' recipes find the files of a zoo folder by pattern and refuse to guess: a folder must
hold exactly one ``k_rotation_*.pt`` and one ``v_rotation_*.pt`` (``rotation/run/_common.sh``,
``need_rot``). A registry path with a ``*`` follows the same rule: the folder is listed at the source
(Hugging Face's tree API, ModelScope's file listing, each one bounded request) and the one name
matching is downloaded; none or several is the source's failure, named, and the next source is tried.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import urllib.parse
from typing import Callable

from ..registry import FileEntry, Source
from . import network
from .sources import hf_endpoint, ms_endpoint


def _listed(src: Source, folder: str, rev: str, say: Callable[[str], None] | None) -> list[str]:
    """Paths of the files directly in ``folder`` at ``src`` (repository paths)."""
    assert src.repo is not None
    q = urllib.parse.quote
    if src.type == "huggingface":
        base = (hf_endpoint() or network.HF_DEFAULT_ENDPOINT).rstrip("/")
        url = f"{base}/api/models/{src.repo}/tree/{q(rev, safe='')}/{q(folder)}"
        body = network.ask(url, method="GET", headers={"Accept": "application/json"}, read_body=True, say=say).body
        try:
            items = json.loads(body)
            return [str(i["path"]) for i in items if isinstance(i, dict) and i.get("type") == "file"]
        except (ValueError, KeyError, TypeError):
            raise network.Unavailable("the folder listing is not Hugging Face's JSON", "error") from None
    url, method, headers = network.file_url("modelscope", src.repo, f"{folder}/x", rev,
                                            ms_endpoint())
    body = network.ask(url, method=method, headers=headers, read_body=True, say=say).body
    try:
        files = json.loads(body)["Data"]["Files"]
        return [str(f["Path"]) for f in files if isinstance(f, dict) and f.get("Type") == "blob"]
    except (ValueError, KeyError, TypeError):
        raise network.Unavailable("the folder listing is not ModelScope's JSON", "error") from None


def resolve(src: Source, f: FileEntry, rev: str, say: Callable[[str], None] | None = None) -> FileEntry:
    """``f`` with its path resolved at ``src`` when it holds a ``*`` (else ``f`` itself).

    Raises:
        network.Unavailable: the folder cannot be listed, or no file / several files match.
    """
    path = f.source_path(src)
    if "*" not in path:
        return f
    folder, _, pattern = path.rpartition("/")
    names = sorted(p for p in _listed(src, folder, rev, say)
                   if p.rpartition("/")[0] == folder and fnmatch.fnmatchcase(p.rpartition("/")[2], pattern))
    if not names:
        raise network.Unavailable(f"no file matches {path}", "not_found")
    if len(names) > 1:
        shown = ", ".join(n.rpartition("/")[2] for n in names[:4])
        raise network.Unavailable(f"several files match {path} ({shown}); the registry must name one", "error")
    if say is not None:
        say(f"{src.describe()}: {path} is {names[0]}")
    return dataclasses.replace(f, path=names[0])


__all__ = ["resolve"]
