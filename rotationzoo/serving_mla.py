"""Launches of MLA latent sets: the set fetched (or taken from the cache), checked, and handed to a target.

:func:`latent_spec` resolves the registry model's latent set (:func:`rotationzoo.mla.load_latent`:
every ``layer_<id>.pt`` read safely and validated, the model's latent layers covered exactly), checks
that every path it is about to print exists, and builds the launch of the target (one that reads
``mla`` files; others refuse the set in one line) from the set's recipe: windows, bits, group size,
Lloyd-Max, tensor- and pipeline-parallel sizes, backends, the high-precision subspace folder when the
set has one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .engines import EngineTarget, LatentLaunch, check_expert_parallel, prepare, refuse
from .errors import ServingError
from .int2kv import Int2KVConfig
from .launch import LaunchConfig
from .launchspec import LaunchSpec, check_printable
from .mla import latent_model, load_latent
from .registry import ModelEntry
from .numbers import shown

__all__ = ["latent_model", "latent_spec"]


def _existing(path: Path, what: str) -> str:
    """``path`` as printed, after checking that it exists (a launch never names a missing path)."""
    if not path.exists():
        raise ServingError(f"{path}: the {what} the launch would name does not exist; fetch or import the set again")
    return check_printable(str(path), what)


def latent_spec(t: EngineTarget, model: ModelEntry, *, model_path: str | None, source: str, revision: str | None,
                cache_dir: str | os.PathLike[str] | None, offline: bool | None, timeout: float | None,
                knobs: dict[str, Any]) -> LaunchSpec:
    """The launch of ``model``'s MLA latent set on target ``t``.

    Raises:
        ServingError: a target that does not read latent sets, a knob it does not take, a path that is gone.
        InvalidRotationError / OfflineError / FetchError: as :func:`rotationzoo.mla.load_latent`.
    """
    lat = model.mla_latent
    assert lat is not None
    lc = LaunchConfig(tp_size=lat.tp_size, mamba_scheduler_strategy=lat.mamba_scheduler_strategy,  # type: ignore[arg-type]
                      recipe=lat.recipe)
    if "mla" not in t.reads:  # before anything is fetched
        refuse(t, frozenset({"mla"}), f"{model.id}@{lat.name}")
    check_expert_parallel(t, lc, f"{model.id}@{lat.name}", tp_size=knobs.get("tp_size"), ep_size=knobs.get("ep_size"))
    got = load_latent(model.id, cache_dir=cache_dir, offline=offline, source_type=source, revision=revision,
                      timeout=timeout)
    assert got.files is not None
    folder = _existing(got.folder, "latent rotation folder")
    for f in got.files.files.values():
        _existing(Path(f.path), "latent layer file")
    hp = _existing(got.files.subspace, "high-precision subspace folder") if got.files.subspace else None
    if model_path is not None and str(model_path).startswith("-"):
        raise ServingError(f"--model-path {shown(model_path)} starts with '-', which the engine would read as an "
                           "option; write ./ before a relative path")
    loads = check_printable(str(model_path), "--model-path") if model_path is not None else model.id
    launch = LatentLaunch(folder=folder, rank=lat.rank, layers=len(got.rotations.layers), bits=lat.bits,
                          group_size=lat.group_size, lloyd_max=lat.lloyd_max, hp_subspace=hp, pp_size=lat.pp_size,
                          attention_backend=lat.attention_backend,
                          prefill_attention_backend=lat.prefill_attention_backend,
                          decode_attention_backend=lat.decode_attention_backend, companions=got.rotations.companions,
                          layouts=got.rotations.layouts)
    config = Int2KVConfig(prefix_tokens=lat.prefix_tokens, recent_tokens=lat.recent_tokens)
    inp = prepare(t, config=config, launch=lc, paths=None, model=loads, head_dims=None, kinds=frozenset({"mla"}),
                  source=f"{model.id}@{lat.name}", model_path=model_path, latent=launch, **knobs)
    built = t.build(inp)
    notes = list(built.notes) + list(lat.notes)
    files = {"latent": folder, **({"hp_subspace": hp} if hp else {}), **built.files}
    return LaunchSpec(engine=t.name, model=model.id, tag=lat.name, env=built.env, args=built.args, files=files,
                      prepare=built.prepare, notes=notes, ranks=[], checks=built.checks)
