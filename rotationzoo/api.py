"""The high-level API: ``fetch`` files and ``load`` validated rotation pairs.

Example::

    import rotationzoo
    pair = rotationzoo.load("Qwen3-8B")                 # download once (verified), then from cache
    pair.k.rotations.shape                              # torch.Size([36, 128, 128])
    pair.serving.k_clip_ratio, pair.serving.v_clip_ratio
    paths = rotationzoo.fetch("Qwen3-8B").paths         # {"k": Path(...), "v": Path(...)}
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .registry import SIDES, Serving, TagEntry, get_entry

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .format import RotationSet


@dataclass
class FetchResult:
    """Local, verified copies of a tag's K and V files.

    Attributes:
        entry: the registry entry.
        paths: ``{"k": Path, "v": Path}``.
        sha256: ``{"k": hex, "v": hex}`` (observed; equals the registry's when pinned).
        sources: ``{"k": "huggingface:repo@rev", ...}``: where each file came from.
        from_cache: True when nothing was downloaded.
    """

    entry: TagEntry
    paths: dict[str, Path]
    sha256: dict[str, str]
    sources: dict[str, str]
    from_cache: bool

    @property
    def source(self) -> str:
        """The source of the K file (both files usually come from the same one)."""
        return self.sources["k"]

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.entry.model_id,
            "tag": self.entry.name,
            "source": self.source,
            "from_cache": self.from_cache,
            **{side: {"path": str(self.paths[side]), "sha256": self.sha256[side], "source": self.sources[side]}
               for side in SIDES},
        }


def fetch(
    model: str,
    tag: str | None = None,
    *,
    source: str = "auto",
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    offline: bool | None = None,
    force: bool = False,
    report: Any = None,
) -> FetchResult:
    """Make the K and V files of ``model``/``tag`` available locally, verified.

    Args:
        model: model id or alias (case-insensitive), e.g. ``"Qwen3-8B"``.
        tag: calibration tag; the model's default tag when ``None``.
        source: ``"auto"`` (the entry's order, failing over on errors), or one of
            ``"huggingface"``, ``"modelscope"``, ``"url"``, ``"bundled"``.
        revision: override the hub revision (branch, tag or commit sha).
        cache_dir: cache root (default ``ROTATIONZOO_CACHE`` or the user cache dir).
        offline: never use the network (default: ``ROTATIONZOO_OFFLINE`` / ``HF_HUB_OFFLINE``).
        force: download again even when a verified copy is cached.
        report: optional callable receiving one-line status messages.

    Raises:
        UnknownModelError, UnknownTagError, FetchError, IntegrityError, OfflineError.
    """
    from .hub import fetch_entry

    entry = get_entry(model, tag)
    got = fetch_entry(entry, cache_dir=cache_dir, source=source, revision=revision, offline=offline,
                      force=force, report=report)
    return FetchResult(
        entry=entry,
        paths={s: got.files[s].path for s in SIDES},
        sha256={s: got.files[s].sha256 for s in SIDES},
        sources={s: got.files[s].source for s in SIDES},
        from_cache=all(got.files[s].from_cache for s in SIDES),
    )


@dataclass
class RotationPair:
    """A model's validated K and V rotations plus how to serve them.

    Attributes:
        k: K-side :class:`~rotationzoo.format.RotationSet` (``k.rotations [L, d, d]``).
        v: V-side rotation set (same layer ids and ``d`` as ``k``).
        entry: the registry entry (model, tag, calibration, results).
        paths: local files ``{"k": Path, "v": Path}``.
    """

    k: "RotationSet"
    v: "RotationSet"
    entry: TagEntry
    paths: dict[str, Path] = field(default_factory=dict)
    sha256: dict[str, str] = field(default_factory=dict)

    @property
    def serving(self) -> Serving:
        """Clip ratios, windows, group size, dtypes: the defaults published with this entry."""
        return self.entry.serving

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.k.layer_ids

    @property
    def head_dim(self) -> int:
        return self.k.head_dim

    def serve_env(self, engine: str) -> dict[str, str]:
        """Environment variables that serve this pair with ``engine`` (``"sglang"``, ``"vllm"`` or
        ``"llamacpp"``): local rotation paths, clip ratios, windows, group size, dtypes.

        See :mod:`rotationzoo.serving` for the full launch (arguments, notes).
        """
        from .serving import pair_serve_env

        return pair_serve_env(self, engine)

    def __repr__(self) -> str:
        return (f"RotationPair({self.entry.key}, layers={len(self.layer_ids)}, d={self.head_dim}, "
                f"k={self.k.objective}, v={self.v.objective})")


def load(
    model: str,
    tag: str | None = None,
    *,
    device: "str | torch.device" = "cpu",
    dtype: "torch.dtype | None" = None,
    source: str = "auto",
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    offline: bool | None = None,
    force: bool = False,
    atol: float = 1e-5,
) -> RotationPair:
    """Fetch (if needed), read and validate a model's rotation pair.

    Args:
        model, tag, source, revision, cache_dir, offline, force: as for :func:`fetch`.
        device: device of the returned tensors.
        dtype: dtype of the returned rotations (default fp32, as stored; serving engines use bf16).
        atol: orthogonality tolerance for validation.

    Returns:
        :class:`RotationPair` whose ``k.rotations`` and ``v.rotations`` are ``[L, d, d]`` tensors for
        the model's attention layers ``pair.layer_ids``.
    """
    from .errors import InvalidRotationError
    from .format import read_rotation
    from .validation import validate

    res = fetch(model, tag, source=source, revision=revision, cache_dir=cache_dir, offline=offline, force=force)
    arch = res.entry.architecture
    sets = {}
    for side in SIDES:
        rs = read_rotation(res.paths[side])
        validate(rs, atol=atol, layer_ids=arch.expected_layer_ids(), head_dim=arch.head_dim)
        if dtype is not None or str(device) != "cpu":
            rs = rs.to(device=device, dtype=dtype)
        sets[side] = rs
    if sets["k"].layer_ids != sets["v"].layer_ids or sets["k"].head_dim != sets["v"].head_dim:
        raise InvalidRotationError(
            f"{res.entry.key}: K and V files disagree (K layers {len(sets['k'].layer_ids)} × d {sets['k'].head_dim}, "
            f"V layers {len(sets['v'].layer_ids)} × d {sets['v'].head_dim})"
        )
    return RotationPair(k=sets["k"], v=sets["v"], entry=res.entry, paths=res.paths, sha256=res.sha256)
