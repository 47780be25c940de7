"""Pairs the authors' server fitted at start-up, imported into the cache with their provenance.

When their SGLang tree serves an OSCAR INT2 cache without a configured pair, it calibrates one at
start-up and writes it to ``$HF_HOME/oscar-rotations/<model>-<digest12>/`` (``digest12`` =
``sha256(model, revision, prompts, tokens)[:12]``): ``k_rotation_qqt_r_h_pbr.pt`` and
``v_rotation_sst_r_h_pbr.pt`` (V1 with a ``calibration`` dict: generation id, prompt sha256, tokens,
model revision, TP size, …) and, beside them, ``.oscar_<pair_id>.pending.json`` while it publishes,
``.oscar_<pair_id>.complete.json`` once done. A folder with a pending manifest is refused everywhere
(its files may be half written); :func:`import_calibrated` copies a complete pair into the cache's
``imported/`` area, checked and with markers, so that it outlives the server's folder and can be
served, evaluated or published like any other pair. What is checked, hashed and marked is the copy
the cache keeps, never the source (which may change while it is read); a K and a V recording
different calibrations are refused unless ``allow_mixed=True`` (``--allow-mixed``).

Example::

    from rotationzoo.files.calibrated import import_calibrated
    got = import_calibrated("~/.cache/huggingface/oscar-rotations/Qwen3-8B-0123456789ab")
    got.paths["k"], got.calibration["prompt_sha256"]
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .limits import MAX_BYTES
from ..errors import CacheError, PairError, RotationZooError
from .format import read_rotation
from ..hashing import read_hashed, sha256_file
from ..hub.layout import IMPORTED_AREA, area_dir, cache_root, hold_entry, inside, write_marker
from .localpair import COMPLETE_GLOB, check_not_pending, find_pair_files
from .pair import RotationPair, read_pair
from ..registry import SIDES
from ..safefile import copy_regular, read_regular

#: How long an import waits for another process holding its name's lock (another import, a cache verify).
IMPORT_LOCK_WAIT_S = 60.0

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
        data = json.loads(read_regular(path, MAX_MANIFEST_BYTES, what="manifest", error=PairError).decode("utf-8"))
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


def _manifest_of(d: Path, files: dict[str, Path]) -> dict[str, Any]:
    """The folder's newest complete manifest (``{}`` if none), refused when it names other files."""
    manifests = sorted(d.glob(COMPLETE_GLOB))
    manifest = read_manifest(manifests[-1]) if manifests else {}
    for s in SIDES:
        named = manifest.get(f"{s}_path")
        if isinstance(named, str) and Path(named).name != files[s].name:
            raise PairError(f"{d}: the manifest names {Path(named).name} as the {s.upper()} file, the folder holds "
                            f"{files[s].name}; refusing to guess which is the published pair")
    return manifest


def check_provenance(d: Path, pair: RotationPair, manifest: Mapping[str, Any], *, allow_mixed: bool = False) -> None:
    """Refuse a K and a V of different provenance: another calibration ``generation_id`` recorded in
    each file (or recorded in one only), or a file whose id is not the manifest's.

    Raises:
        PairError: the pair mixes two calibrations and ``allow_mixed`` is false.
    """
    if allow_mixed:
        return
    own = {s: (rs.calibration or {}).get("generation_id") for s, rs in pair}
    if own["k"] != own["v"]:
        raise PairError(f"{d}: the K file was written by calibration {own['k']!r}, the V file by {own['v']!r}; the "
                        f"folder mixes two calibrations (pass --allow-mixed / allow_mixed=True to import it anyway)")
    gen = manifest.get("generation_id")
    for s in SIDES:
        if gen is not None and own[s] is not None and own[s] != gen:
            raise PairError(f"{d}: the {s.upper()} file was written by calibration {own[s]!r}, the manifest says "
                            f"{gen!r}; the folder mixes two calibrations (pass --allow-mixed / allow_mixed=True to "
                            f"import it anyway)")


def read_calibrated(folder: str | os.PathLike[str], *, allow_mixed: bool = False
                    ) -> tuple[RotationPair, dict[str, Any]]:
    """The validated pair of a start-up calibration folder and its complete manifest (``{}`` if none).

    Raises:
        PairError: a publication is pending, the manifest names other files than the folder holds, or
            K and V (or a file and the manifest) record different calibrations and ``allow_mixed`` is
            false (see :func:`check_provenance`).
        RotationZooError: the files are not a valid pair.
    """
    d = Path(folder).expanduser()
    check_not_pending(d)
    manifest = _manifest_of(d, find_pair_files(d))
    pair = read_pair(d).validate()
    check_provenance(d, pair, manifest, allow_mixed=allow_mixed)
    return pair, manifest


def _copy_regular(src: Path, dst: Path) -> None:
    """Copy a regular file of at most :data:`~rotationzoo.files.limits.MAX_BYTES` (a FIFO or a device is
    refused without blocking, see :func:`~rotationzoo.safefile.copy_regular`)."""
    with open(dst, "xb") as out:
        copy_regular(src, out, MAX_BYTES, what="rotation file", error=PairError)


def _read_copies(copies: Mapping[str, Path], originals: Mapping[str, Path], source: str) -> RotationPair:
    """The copies, read once each with the sha256 of exactly the bytes read, validated as a pair. A refusal
    names the file the user gave (``originals``), never the staging copy it was read from."""
    try:
        read = {s: read_hashed(p, read_rotation) for s, p in copies.items()}
        pair = RotationPair({s: rs for s, (rs, _) in read.items()}, paths=dict(copies),
                            sha256={s: sha for s, (_, sha) in read.items()}, source=source)
        return pair.validate()
    except RotationZooError as exc:
        def named(text: Any) -> Any:
            if not isinstance(text, str):
                return text
            for s, copy in copies.items():
                text = text.replace(str(copy), str(originals[s]))
            return text

        exc.args = tuple(named(a) for a in exc.args)
        if isinstance(getattr(exc, "problems", None), list):
            exc.problems = [named(p) for p in exc.problems]  # type: ignore[attr-defined]
        raise


def _same_import(dest: Path, copies: Mapping[str, Path], sha: Mapping[str, str]) -> bool:
    """Whether ``dest`` already holds exactly these files (by sha256)."""
    try:
        return all(sha256_file(dest / p.name, error=CacheError) == sha[s] for s, p in copies.items())
    except (OSError, CacheError):
        return False


def import_calibrated(folder: str | os.PathLike[str], *, name: str | None = None,
                      cache_dir: str | os.PathLike[str] | None = None, force: bool = False,
                      allow_mixed: bool = False) -> ImportResult:
    """Copy a complete start-up calibration pair into ``<cache>/imported/<name>/`` (``name``: the folder's).

    The files are copied first, into a staging folder inside the cache; the copies (never the
    source, which may change meanwhile) are read, validated and hashed, their markers are written from
    those hashes, and only then is the staging folder renamed into place. Nothing is imported from a
    folder with a pending manifest (checked before and after copying), nor a K and V of different
    provenance unless ``allow_mixed`` (see :func:`check_provenance`), and an existing import of
    another pair under the same name is kept unless ``force``.

    Raises:
        PairError: see :func:`read_calibrated`; a bad or taken name; a source that is not a regular file.
        CacheError: the cache cannot be written.
    """
    src = Path(folder).expanduser()
    check_not_pending(src)
    files = find_pair_files(src)
    manifest = _manifest_of(src, files)
    name = name or src.resolve().name
    if not _NAME.fullmatch(name) or name in (".", ".."):
        raise PairError(f"import name {name[:80]!r}: letters, digits and . _ - (at most 128, not starting with . or -)")
    root = cache_root(cache_dir)
    dest = inside(root, area_dir(root, IMPORTED_AREA) / name)
    staging: Path | None = None
    old: Path | None = None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=dest.parent))
        copies = {s: staging / p.name for s, p in files.items()}
        for s, p in files.items():
            _copy_regular(p, copies[s])
        check_not_pending(src)  # a publication that began while we copied: its files may be half written
        pair = _read_copies(copies, files, str(src))
        check_provenance(src, pair, manifest, allow_mixed=allow_mixed)
        sha = dict(pair.sha256)
        calibration = next((rs.calibration for _, rs in pair if rs.calibration), None)
        for s, c in copies.items():
            write_marker(c, {"kind": "imported", "side": s, "sha256": sha[s], "source": str(src),
                             "model": str((calibration or {}).get("model_path") or "") or None, "tag": name,
                             "verified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        with hold_entry(root, dest, what=f"import into {dest}", timeout=IMPORT_LOCK_WAIT_S):  # verify waits
            if dest.exists() and not force and not _same_import(dest, copies, sha):
                raise PairError(f"{dest}: another pair is imported under the name {name!r}; give --name or --force")
            if dest.exists():  # the old import stays whole until the new one is in place
                old = Path(tempfile.mkdtemp(prefix=f".{name}.old.", dir=dest.parent))
                os.replace(dest, old / name)
            os.replace(staging, dest)
            staging = None
    except OSError as exc:
        raise CacheError(f"cannot import into {dest} ({exc.strerror or exc}); set ROTATIONZOO_CACHE to a writable "
                         f"folder") from None
    finally:
        if old is not None and (old / name).exists() and not dest.exists():  # the new one never arrived:
            try:
                os.replace(old / name, dest)  # the old import back in place, whole
            except OSError:
                old = None  # never removed: it stays where it was moved to
        for left in (staging, old):
            if left is not None and left.exists():
                shutil.rmtree(left, ignore_errors=True)
    paths = {s: dest / p.name for s, p in copies.items()}
    return ImportResult(name, dest, src, paths, sha, calibration, manifest)
