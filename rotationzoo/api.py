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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConfigError
from .hub import Reporter, fetch_entry
from .numbers import shown
from .registry import SIDES, TagEntry, get_entry, split_model_tag

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .files.pair import RotationPair


@dataclass
class FetchResult:
    """Local, verified copies of a tag's K and V files.

    Attributes:
        entry: the registry entry.
        paths: ``{"k": Path, "v": Path}``.
        sha256: ``{"k": hex, "v": hex}`` (observed; equals the registry's when pinned).
        sources: ``{"k": "huggingface:repo@rev", ...}``: where each file came from.
        from_cache: True when nothing was downloaded.
        sizes: ``{"k": bytes, "v": bytes}``: with ``sha256``, what a registry entry pins.
    """

    entry: TagEntry
    paths: dict[str, Path]
    sha256: dict[str, str]
    sources: dict[str, str]
    from_cache: bool
    sizes: dict[str, int]

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
            **{side: {"path": str(self.paths[side]), "sha256": self.sha256[side], "size": self.sizes[side],
                      "source": self.sources[side]}
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
    timeout: float | None = None,
    force: bool = False,
    accept_new: bool = False,
    report: Reporter | None = None,
) -> FetchResult:
    """Make the K and V files of ``model``/``tag`` available locally, verified.

    Args:
        model: model id or alias (case-insensitive), e.g. ``"Qwen3-8B"`` (or ``"MODEL@TAG"``).
        tag: calibration tag; the model's default tag when ``None``.
        source: ``"auto"`` (the entry's order, failing over on errors), or one of
            ``"huggingface"``, ``"modelscope"``, ``"url"``, ``"bundled"``.
        revision: override the hub revision (branch, tag or commit sha).
        cache_dir: cache root (default ``ROTATIONZOO_CACHE`` or the user cache dir).
        offline: never use the network (default: ``ROTATIONZOO_OFFLINE`` / ``HF_HUB_OFFLINE``).
        timeout: seconds each step of a request may take (default ``ROTATIONZOO_TIMEOUT``).
        force: download again even when a verified copy is cached.
        accept_new: for files the registry does not pin, accept (and pin) a file that differs from
            the one pinned on first use (see :mod:`rotationzoo.hub.pins`).
        report: optional callable receiving one-line status messages.

    Raises:
        UnknownModelError, UnknownTagError, FetchError, IntegrityError, OfflineError.
    """
    name, at_tag = split_model_tag(model)
    entry = get_entry(name, tag or at_tag)
    got = fetch_entry(entry, cache_dir=cache_dir, source=source, revision=revision, offline=offline,
                      timeout=timeout, force=force, accept_new=accept_new, report=report)
    return FetchResult(
        entry=entry,
        paths={s: got.files[s].path for s in SIDES},
        sha256={s: got.files[s].sha256 for s in SIDES},
        sources={s: got.files[s].source for s in SIDES},
        from_cache=all(got.files[s].from_cache for s in SIDES),
        sizes={s: got.files[s].size for s in SIDES},
    )


def load(
    model: "str | os.PathLike[str]",
    tag: str | None = None,
    *,
    device: "str | torch.device" = "cpu",
    dtype: "torch.dtype | str | None" = None,
    source: str = "auto",
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    offline: bool | None = None,
    timeout: float | None = None,
    force: bool = False,
    accept_new: bool = False,
    atol: float = 1e-5,
) -> RotationPair:
    """Fetch (if needed), read and validate a model's rotation pair, or read a local one.

    Args:
        model, tag, source, revision, cache_dir, offline, timeout, force, accept_new: as for :func:`fetch`
            (``model`` may also be ``"MODEL@TAG"``). A path instead of a model (a pair folder, such as a
            start-up calibration folder of the authors' server, ``"K.pt,V.pt"``, a pair file) is read
            and validated locally: a ``tag`` is refused (:class:`~rotationzoo.errors.PairError`) and the fetch
            options are ignored. A path that exists is taken before a registry id of the same spelling
            (``Qwen3-8B`` names a folder of that name in the working folder when there is one; ``Qwen/Qwen3-8B``
            or ``Qwen3-8B@TAG`` names the registry entry there).
        device: device of the returned tensors (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...: one this machine
            has, checked before anything is fetched).
        dtype: dtype of the returned rotations: a torch floating-point dtype or its name as the CLI spells it
            (``"float32"``, ``"float16"``, ``"bfloat16"``); default fp32, as stored (serving engines use bf16).
        atol: orthogonality tolerance for validation.

    Returns:
        :class:`~rotationzoo.files.pair.RotationPair` whose ``k.rotations`` and ``v.rotations`` are
        ``[L, d, d]`` tensors for the model's attention layers ``pair.layer_ids``, with
        ``pair.entry`` and ``pair.serving`` from the registry.

    Raises:
        ConfigError: ``model`` is neither a string nor a path, a dtype that is not a floating-point one, a
            device torch does not know or this machine does not have (one line, before anything is read).
        UnknownModelError, UnknownTagError, FetchError, IntegrityError, OfflineError, PairError,
            RotationFileError, InvalidRotationError: as for :func:`fetch` and the local readers.
    """
    from .files.pair import load_registered, looks_like_path, resolve_pair  # torch only when tensors are needed

    if not isinstance(model, (str, os.PathLike)):
        raise ConfigError(f"load() takes a registry id (MODEL or MODEL@TAG) or a path, got {type(model).__name__} "
                          f"{shown(model)}")
    dtype = _tensor_dtype(dtype)
    _check_device(device)
    text = os.fspath(model)
    if isinstance(model, os.PathLike) or Path(text).expanduser().exists() or looks_like_path(text):
        pair = resolve_pair(text, tag, atol=atol)
        return pair.to(device=device, dtype=dtype) if dtype is not None or str(device) != "cpu" else pair
    name, at_tag = split_model_tag(text)
    return load_registered(name, tag or at_tag, device=device, dtype=dtype, source=source, revision=revision,
                           cache_dir=cache_dir, offline=offline, timeout=timeout, force=force, accept_new=accept_new,
                           atol=atol)


def _tensor_dtype(dtype: Any) -> "torch.dtype | None":
    """``dtype`` as a torch floating-point dtype (a name of :data:`~rotationzoo.dtypes.TORCH_DTYPES` accepted),
    or ``None``; anything else is a :class:`~rotationzoo.errors.ConfigError`."""
    if dtype is None:
        return None
    import torch

    from .dtypes import TORCH_DTYPES

    got = TORCH_DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if not isinstance(got, torch.dtype) or not got.is_floating_point:
        raise ConfigError(f"dtype {shown(dtype)} is not a floating-point dtype; use {', '.join(TORCH_DTYPES)} (or "
                          f"torch.float32, torch.float16, torch.bfloat16), or None for fp32 as stored")
    return got


def _check_device(device: Any) -> None:
    """Refuse a device torch does not know or this machine does not have, with the check ``eval`` and
    ``calibrate`` make (:func:`~rotationzoo.integrations.transformers.loading.check_load_options`)."""
    if isinstance(device, str) and device == "cpu":
        return
    import torch

    if not isinstance(device, (str, torch.device)):
        raise ConfigError(f"device must be a string such as 'cpu', 'cuda' or 'cuda:1' (or a torch.device), got "
                          f"{type(device).__name__} {shown(device)}")
    from .errors import ModelLoadError
    from .integrations.transformers.loading import check_load_options

    try:
        check_load_options(None, device)
    except ModelLoadError as exc:
        raise ConfigError(str(exc)) from None


def __getattr__(name: str) -> Any:
    if name == "RotationPair":
        from .files.pair import RotationPair

        return RotationPair
    raise AttributeError(name)


__all__ = ["FetchResult", "RotationPair", "fetch", "load"]
