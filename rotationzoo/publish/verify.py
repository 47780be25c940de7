"""Checking the published zoo: every registry entry's files present, pinned sha256, valid structure."""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import config
from ..errors import OfflineError, RotationZooError
from ..hashing import sha256_file
from ..hub import UnpinnedEntryWarning, cache_root, entry_dir, fetch_entry, offline_reason, warm_hit
from ..registry import SIDES, TagEntry, get_model, load_registry, split_model_tag
from ..files.validation import verify_file

log = logging.getLogger("rotationzoo")
Reporter = Callable[[str], None]


@dataclass
class EntryCheck:
    """Outcome of checking one registry tag.

    ``status`` is ``"ok"`` (files present, sha256 as pinned, valid), ``"unpinned"`` (valid, but the
    registry has no sha256 to compare with: the observed ones are in ``files``), ``"missing"``
    (not in the cache and no download asked for) or ``"failed"``.
    """

    model: str
    tag: str
    status: str
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "tag": self.tag, "status": self.status, "files": self.files,
                "problems": list(self.problems)}


def _changed_copies(entry: TagEntry, cache_dir: str | os.PathLike[str] | None) -> list[str]:
    """Problems of cached copies that a cache hit refused (changed on disk since verification)."""
    out = []
    folder = entry_dir(cache_root(cache_dir), entry)
    for side in SIDES:
        f = entry.files[side]
        p = folder / f.filename
        if not p.is_file() or p.is_symlink() or warm_hit(p, f.sha256) is not None:
            continue
        sha = sha256_file(p)
        pinned = f" the registry pins {f.sha256}" if f.sha256 else " its verification recorded another"
        out.append(f"{side.upper()} file {p}: sha256 {sha} (changed on disk since it was verified);{pinned}")
    return out


def _changed_layers(model: str, cache_dir: str | os.PathLike[str] | None) -> list[str]:
    """Problems of cached latent layer files that a cache hit refused (changed on disk since verification)."""
    from ..hub.latent import latent_entry
    from ..hub.layout import read_marker

    root = cache_root(cache_dir)
    folder = entry_dir(root, latent_entry(get_model(model), root))
    out = []
    for p in sorted(folder.glob("layer_*.pt")) if folder.is_dir() else []:
        if read_marker(p) is not None and warm_hit(p, None) is None:
            out.append(f"{p}: sha256 {sha256_file(p)} (changed on disk since it was verified)")
    return out


def _latent_check(model: str, name: str, *, offline: bool, download: bool, source: str,
                  cache_dir: str | os.PathLike[str] | None, atol: float, revision: str | None = None,
                  timeout: float | None = None) -> EntryCheck:
    """One MLA latent set: every layer file present (cached, or downloaded), checked and covering the model.
    The registry pins no latent file, so a good set is ``"unpinned"`` with each layer's observed sha256."""
    from ..mla import load_latent

    check = EntryCheck(model, name, "failed")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnpinnedEntryWarning)
            lat = load_latent(model, cache_dir=cache_dir, offline=offline, source_type=source, atol=atol,
                              revision=revision, timeout=timeout)
    except OfflineError as exc:
        changed = _changed_layers(model, cache_dir)
        if changed:  # present but not served: the bytes changed after verification
            check.problems.extend(changed)
        else:
            check.status = "missing"
            check.problems.append("not in the cache (pass --download to fetch it, or `rotationzoo cache import "
                                  "FOLDER --latent`)" if not download else str(exc))
    except RotationZooError as exc:
        check.problems.append(str(exc))
    else:
        assert lat.files is not None
        for lid, f in sorted(lat.files.files.items()):
            check.files[f"layer_{lid}"] = {"path": str(f.path), "sha256": f.sha256, "registry_sha256": None,
                                           "size": f.size, "source": f.source}
        check.status = "unpinned"
    return check


def verify_registry(
    *,
    download: bool = False,
    model: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    source: str = "auto",
    revision: str | None = None,
    offline: bool | None = None,
    timeout: float | None = None,
    atol: float = 1e-5,
    report: Reporter | None = None,
) -> list[EntryCheck]:
    """Check every registry entry: files present (cached, bundled, or downloaded), sha256, structure.

    Args:
        download: fetch entries that are not cached (through :func:`rotationzoo.fetch`, which
            verifies on download); otherwise only cached and bundled files are checked.
            ``ROTATIONZOO_OFFLINE`` / ``HF_HUB_OFFLINE`` win: nothing is downloaded then.
        model: only this model (id or alias), or only one of its tags (``MODEL@TAG``).
        cache_dir: cache root (default ``ROTATIONZOO_CACHE`` or the user cache dir).
        source, revision, timeout: as for :func:`rotationzoo.fetch`.
        offline: never touch the network, as ``ROTATIONZOO_OFFLINE``: with ``download`` too, only cached and
            bundled files are checked.
        atol: orthogonality tolerance.
        report: called with one line per entry.

    Returns:
        One :class:`EntryCheck` per tag, in registry order. Cached files are hashed again (a warm
        cache hit alone would not notice a file changed on disk).
    """
    say: Reporter = report or (lambda msg: log.info(msg))
    offline = not download or bool(offline) or config.offline()  # --offline / ROTATIONZOO_OFFLINE win over --download
    name, only_tag = split_model_tag(model) if model is not None else (None, None)
    models = [get_model(name)] if name is not None else list(load_registry())
    latent = models[0].mla_latent if name is not None else None
    if only_tag is not None and (latent is None or only_tag != latent.name):
        only_tag = models[0].tag(only_tag).name  # an unknown tag is refused here, as everywhere
    checks: list[EntryCheck] = []
    for m in models:
        if m.mla_latent is not None:  # an MLA latent model: its set, layer by layer, instead of K/V tags
            check = _latent_check(m.id, m.mla_latent.name, offline=offline, download=download, source=source,
                                  cache_dir=cache_dir, atol=atol, revision=revision, timeout=timeout)
            say(f"{m.id}@{check.tag}: {check.status}" + (f" ({check.problems[0]})" if check.status == "failed" else ""))
            checks.append(check)
        for tname, entry in m.tags.items():
            if only_tag is not None and tname != only_tag:
                continue
            arch = entry.architecture
            ids = arch.expected_layer_ids()
            check = EntryCheck(m.id, tname, "failed")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UnpinnedEntryWarning)
                    got = fetch_entry(entry, source=source, cache_dir=cache_dir, offline=offline, revision=revision,
                                      timeout=timeout)
            except OfflineError:
                changed = _changed_copies(entry, cache_dir)
                if changed:  # present but not served: the bytes changed after verification
                    check.problems.extend(changed)
                else:
                    check.status = "missing"
                    check.problems.append("not in the cache (pass --download to fetch it)" if not download else
                                          f"not in the cache, and offline ({offline_reason()})")
            except RotationZooError as exc:
                check.problems.append(str(exc))
            else:
                layouts = {}
                for side in SIDES:
                    f = entry.files[side]
                    p = got.files[side].path
                    sha = sha256_file(p)
                    rep = verify_file(p, atol=atol, layer_ids=ids, head_dim=arch.head_dims,
                                      num_kv_heads=arch.num_kv_heads, with_hash=False)
                    check.files[side] = {"path": str(p), "sha256": sha, "registry_sha256": f.sha256,
                                         "size": p.stat().st_size, "source": got.files[side].source}
                    if f.sha256 is not None and sha != f.sha256:
                        check.problems.append(f"{side.upper()} file {p}: sha256 {sha}, the registry pins {f.sha256}")
                    if f.size is not None and p.stat().st_size != f.size:
                        check.problems.append(
                            f"{side.upper()} file {p}: {p.stat().st_size} B, the registry says {f.size} B")
                    check.problems.extend(rep.problems)
                    layouts[side] = (tuple(rep.layer_ids), rep.head_dim)
                if not check.problems and layouts["k"] != layouts["v"]:
                    check.problems.append("K and V files disagree on layers or head_dim")
                if not check.problems:
                    check.status = "ok" if entry.pinned else "unpinned"
            say(f"{m.id}@{tname}: {check.status}" + (f" ({check.problems[0]})" if check.status == "failed" else ""))
            checks.append(check)
    return checks
