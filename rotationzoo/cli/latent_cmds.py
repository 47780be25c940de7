"""What the commands print for an MLA latent set (``info``, ``fetch``, ``cache import --latent``); the work
is :mod:`rotationzoo.mla` and :mod:`rotationzoo.hub.latent`.

Examples::

    rotationzoo info GLM-5.2
    rotationzoo fetch GLM-5.2 --json
    rotationzoo cache import ./k3_latent_rot --latent Kimi-K3
"""

from __future__ import annotations

import os
from typing import Any

import typer

from ..registry import ModelEntry
from ._output import console, emit_json, printable


def latent_status(m: ModelEntry, cache_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """How much of ``m``'s latent set is in the cache (no file is read beyond its marker)."""
    from ..hub.latent import cached_layer_ids, latent_entry
    from ..hub.layout import cache_root, entry_dir
    from ..hub.pins import local_pins

    lat = m.mla_latent
    assert lat is not None
    root = cache_root(cache_dir)
    ids = cached_layer_ids(m, root)
    entry = latent_entry(m, root)
    pinned = sum(bool(local_pins(entry, side)) for side in entry.files)
    want = lat.expected_layer_ids
    return {"folder": str(entry_dir(root, entry)), "cached_layers": len(ids),
            "layers": len(want) if want is not None else lat.layer_count, "pinned_locally": pinned}


def print_latent_info(m: ModelEntry, json_out: bool) -> None:
    """``info`` of a model whose rotations are an MLA latent set: files, sources, recipe, cache."""
    lat = m.mla_latent
    assert lat is not None
    status = latent_status(m)
    if json_out:
        out = m.to_json()
        out["mla_latent"]["cache"] = status
        emit_json(out)
        return
    from rich.text import Text

    c = console()
    say = lambda text: c.print(printable(text), markup=False)  # noqa: E731 - values come from the registry: literally
    c.print(Text(printable(m.id), style="bold") + Text(printable(f"  (aliases: {', '.join(m.aliases) or '-'})")))
    if m.description:
        say(m.description)
    ids = lat.expected_layer_ids
    layers = (f"layers {ids[0]} … {ids[-1]} ({len(ids)})" if ids else
              f"{lat.layer_count} latent layers (ids not in the registry)" if lat.layer_count else
              "latent layers not in the registry (a folder's ids must run from 0 without a gap)")
    say(f"rotations: MLA latent set {lat.name}: a folder of layer_<id>.pt files, one [{lat.rank}, {lat.rank}] "
        f"rotation of the shared latent per layer; {layers}")
    if lat.published:
        say(f"files: {lat.path}/layer_<id>.pt  sha256 unpinned (each pinned on first fetch)")
        for src in lat.sources:
            say(f"    from {src.describe()}{'' if src.pinned else '  (revision not pinned)'}")
    else:
        say(f"files: not published in a hub; the authors keep them at {lat.location}: import a copy with "
            f"`rotationzoo cache import FOLDER --latent {m.id}`")
    lm = {None: "the pool's default", True: "on", False: "off"}[lat.lloyd_max]
    say(f"serving: {lat.bits}-bit packed latent, group {lat.group_size}, Lloyd-Max {lm}, bfloat16 sink "
        f"{lat.prefix_tokens} + recent {lat.recent_tokens}; TP {lat.tp_size}" + (f" x PP {lat.pp_size}" if lat.pp_size > 1
                                                                                 else "")
        + f", backends {lat.attention_backend} / {lat.prefill_attention_backend} / {lat.decode_attention_backend}"
        + (f", --mamba-radix-cache-strategy {lat.mamba_scheduler_strategy}" if lat.mamba_scheduler_strategy else "")
        + (f" (recipe {lat.recipe})" if lat.recipe else ""))
    for note in lat.notes:
        say(f"note: {note}")
    total = status["layers"] if status["layers"] is not None else "?"
    say(f"cache: {status['cached_layers']} of {total} layer files in {status['folder']}"
        + (f", {status['pinned_locally']} pinned locally" if status["pinned_locally"] else ""))


def fetch_latent_cmd(name: str, *, source: str, revision: str | None, cache_dir: Any, offline: bool | None,
                     timeout: float | None, force: bool, accept_new: bool, report: Any, json_out: bool,
                     messages: list[str]) -> None:
    """``fetch`` of a latent set: every layer file verified and cached, then the whole set checked."""
    from ..hub.latent import fetch_latent
    from ..mla import latent_model, load_latent

    m = latent_model(name)
    assert m is not None
    got = fetch_latent(m, source=source, revision=revision, cache_dir=cache_dir, offline=offline,
                       timeout=timeout, force=force, accept_new=accept_new, report=report)
    checked = load_latent(m.id, cache_dir=cache_dir, offline=True)
    if json_out:
        emit_json({**got.to_json(), "rank": checked.rotations.rank, "messages": messages})
        return
    typer.echo(printable(got.folder))


def import_latent_cmd(folder: str, model: str, *, cache_dir: Any, accept_new: bool, subspace: bool,
                      json_out: bool) -> None:
    """``cache import FOLDER --latent MODEL``."""
    from ..mla import import_latent_folder

    got = import_latent_folder(folder, model, cache_dir=cache_dir, accept_new=accept_new, subspace=subspace)
    if json_out:
        emit_json(got.to_json())
        return
    typer.echo(printable(f"imported {len(got.files)} layer files of {got.model} ({got.name}): {got.folder}"))
