"""Pairs the authors' server fitted at start-up, imported into the cache with their provenance.

When their SGLang tree serves an OSCAR INT2 cache without a configured pair, it calibrates one at
start-up and writes it to ``$HF_HOME/oscar-rotations/<model>-<digest12>/`` (``digest12`` =
``sha256(model, revision, prompts, tokens)[:12]``): ``k_rotation_qqt_r_h_pbr.pt`` and
``v_rotation_sst_r_h_pbr.pt`` (V1 with a ``calibration`` dict: generation id, prompt sha256, tokens,
model revision, TP size, …) and, beside them, ``.oscar_<pair_id>.pending.json`` while it publishes,
``.oscar_<pair_id>.complete.json`` once done. A folder with a pending manifest is refused everywhere
(its files may be half written); :func:`import_calibrated` copies a complete pair into the cache's
``imported/`` area, checked and with markers, so that it outlives the server's folder and can be
served, evaluated or published like any other pair.

Example::

    from rotationzoo.calibrated import import_calibrated
    got = import_calibrated("~/.cache/huggingface/oscar-rotations/Qwen3-8B-0123456789ab")
    got.paths["k"], got.calibration["prompt_sha256"]
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CacheError, PairError
from .hashing import sha256_file
from .hub.layout import IMPORTED_AREA, area_dir, cache_root, inside, write_marker
from .localpair import COMPLETE_GLOB, check_not_pending, find_pair_files
from .pair import RotationPair, read_pair

#: Largest manifest read.
MAX_MANIFEST_BYTES = 64 << 10
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: What the authors' server calls its default calibration prompts (GPQA-Diamond) in the folder digest.
DEFAULT_PROMPT_IDENTITY = "openai-simple-evals/gpqa_diamond-seed0-v1"
#: The server's default calibration token budget (``SGLANG_OSCAR_CALIBRATION_TOKENS``).
DEFAULT_CALIBRATION_TOKENS = 30000


def calibration_folder_name(model: str, *, revision: str | None = None, prompts: str | None = None,
                            tokens: int = DEFAULT_CALIBRATION_TOKENS) -> str:
    """The folder the authors' server writes a start-up calibration of ``model`` to, under
    :func:`calibration_root`: ``<name>-<sha256(model \\0 revision \\0 prompts \\0 tokens)[:12]>``, where
    ``name`` is the model's last path segment (characters other than letters, digits and ``._-`` become
    ``-``), ``revision`` defaults to ``main`` and ``prompts`` to the GPQA-Diamond default. ``model`` is
    what the server was given (a hub id; for a local folder the server uses its real path)."""
    import hashlib

    identity = f"{model}\0{revision or 'main'}\0{prompts or DEFAULT_PROMPT_IDENTITY}\0{int(tokens)}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:12]
    name = os.path.basename(model.rstrip("/")) or "model"
    safe = "".join(c if c.isalnum() or c in "._-" else "-" for c in name)[:64]
    return f"{safe}-{digest}"


def calibration_root() -> Path:
    """Where the authors' server writes start-up calibrations: ``$HF_HOME/oscar-rotations``."""
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "oscar-rotations"


def read_manifest(path: Path) -> dict[str, Any]:
    """A ``.oscar_*.complete.json`` manifest (``generation_id``, ``k_path``, ``v_path``, …), read with bounds.

    Raises:
        PairError: not a regular file of at most :data:`MAX_MANIFEST_BYTES`, or not a JSON object.
    """
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
            raise PairError(f"{path}: not a manifest (a regular file of at most {MAX_MANIFEST_BYTES} B expected)")
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise PairError(f"{path}: cannot read the manifest ({str(exc)[:80]})") from None
    if not isinstance(data, dict):
        raise PairError(f"{path}: a manifest is a JSON object")
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, (str, int, float, bool, type(None)))}


@dataclass
class ImportResult:
    """What :func:`import_calibrated` copied: the imported pair's name and files, and its provenance."""

    name: str
    folder: Path
    source: Path
    paths: dict[str, Path]
    sha256: dict[str, str]
    calibration: dict[str, Any] | None
    manifest: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "folder": str(self.folder), "source": str(self.source),
                "paths": {s: str(p) for s, p in self.paths.items()}, "sha256": dict(self.sha256),
                "calibration": self.calibration, "manifest": self.manifest}


def read_calibrated(folder: str | os.PathLike[str]) -> tuple[RotationPair, dict[str, Any]]:
    """The validated pair of a start-up calibration folder and its complete manifest (``{}`` if none).

    Raises:
        PairError: a publication is pending, the manifest names other files than the folder holds, or
            its generation id is not the files' own.
        RotationZooError: the files are not a valid pair.
    """
    d = Path(folder).expanduser()
    check_not_pending(d)
    files = find_pair_files(d)
    manifests = sorted(d.glob(COMPLETE_GLOB))
    manifest = read_manifest(manifests[-1]) if manifests else {}
    for s in ("k", "v"):
        named = manifest.get(f"{s}_path")
        if isinstance(named, str) and Path(named).name != files[s].name:
            raise PairError(f"{d}: the manifest names {Path(named).name} as the {s.upper()} file, the folder holds "
                            f"{files[s].name}; refusing to guess which is the published pair")
    pair = read_pair(d).validate()
    gen = manifest.get("generation_id")
    for s, rs in pair:
        own = (rs.calibration or {}).get("generation_id")
        if gen is not None and own is not None and own != gen:
            raise PairError(f"{d}: the {s.upper()} file was written by calibration {own!r}, the manifest says {gen!r}; "
                            f"the folder mixes two calibrations")
    return pair, manifest


def import_calibrated(folder: str | os.PathLike[str], *, name: str | None = None,
                      cache_dir: str | os.PathLike[str] | None = None, force: bool = False) -> ImportResult:
    """Copy a complete start-up calibration pair into ``<cache>/imported/<name>/`` (``name``: the folder's).

    Nothing is imported from a folder with a pending manifest, and an existing import of another pair
    under the same name is kept unless ``force``.

    Raises:
        PairError: see :func:`read_calibrated`; a bad or taken name.
        CacheError: the cache cannot be written.
    """
    src = Path(folder).expanduser()
    pair, manifest = read_calibrated(src)
    name = name or src.resolve().name
    if not _NAME.fullmatch(name) or name in (".", ".."):
        raise PairError(f"import name {name[:80]!r}: letters, digits and . _ - (at most 128, not starting with . or -)")
    root = cache_root(cache_dir)
    dest = inside(root, area_dir(root, IMPORTED_AREA) / name)
    sha = {s: sha256_file(p) for s, p in pair.paths.items()}
    if dest.exists() and not force:
        have = {s: sha256_file(dest / p.name) for s, p in pair.paths.items() if (dest / p.name).is_file()}
        if have != sha:
            raise PairError(f"{dest}: another pair is imported under the name {name!r}; give --name or --force")
    staging: Path | None = None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=dest.parent))
        paths: dict[str, Path] = {}
        for s, p in pair.paths.items():
            shutil.copyfile(p, staging / p.name)
            if sha256_file(staging / p.name) != sha[s]:
                raise PairError(f"{p}: changed while it was imported; try again")
            paths[s] = dest / p.name
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(staging, dest)
    except OSError as exc:
        raise CacheError(f"cannot import into {dest} ({exc.strerror or exc}); set ROTATIONZOO_CACHE to a writable "
                         f"folder") from None
    finally:
        if staging is not None and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    calibration = next((rs.calibration for _, rs in pair if rs.calibration), None)
    for s, p in paths.items():
        write_marker(p, {"kind": "imported", "side": s, "sha256": sha[s], "source": str(src),
                         "model": str((calibration or {}).get("model_path") or "") or None, "tag": name,
                         "verified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return ImportResult(name, dest, src, paths, sha, calibration, manifest)
