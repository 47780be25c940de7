"""Per-TP-rank dumps: ``layer_<L>/rank_<r>/{q,k,v}/<chunk>.pt``, read and merged into whole layers.

Under tensor parallelism every rank of the authors' server dumps its own slice of the head axis
(MiniMax-M3's hook, ``rotation/MiniMax-M3/save_qkv_m3.sh``): rank ``r`` holds query heads
``[r·hq, (r+1)·hq)`` and a contiguous block of KV heads. A rank's slice alone is not the layer:
"a rank-0-only dump captures 4 of 64 query heads and 1 of 4 KV heads" and fits no better than
Hadamard. The reader therefore

* requires every rank: the rank folders of each layer must be ``rank_0 … rank_{R−1}``, the same
  ``R`` on every layer and equal to ``tp_size`` when it is known (given, or ``tp_size`` in
  ``rotationzoo_dump.json``); every rank must hold the same chunks, each with the same tokens;
* concatenates the slices along the head axis in rank order;
* de-duplicates **replicated KV heads**: with fewer KV heads than ranks each KV head is held by
  ``rep = R·local / H_kv`` consecutive ranks (the server's sharding rule). ``rep`` is found from
  the data (the smallest K chunk of the layer: consecutive ranks whose shards are bit-identical),
  and then every chunk's replicas must be exactly equal to the first rank of their group — a
  difference is a real inconsistency and is refused, never resolved by picking one
  (the authors' ``merge_qkv_allhead.py`` does the same).

Every shard file goes through the same checks as a whole-layer chunk (:mod:`.dump_schema`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ..errors import DumpError
from .dump_schema import KINDS, ChunkMeta, DumpLimits, parse_index, resolve_inside, scan_dir

#: Prefix of a rank folder inside a layer folder.
RANK_PREFIX = "rank_"
#: Folders a whole (not per-rank) layer holds.
LAYER_KINDS: tuple[str, ...] = (*KINDS, "seq_lens")


def _rank_id(folder: Path, name: str) -> int | None:
    if not name.startswith(RANK_PREFIX):
        return None
    r = parse_index(name[len(RANK_PREFIX):])
    if r is None and name[len(RANK_PREFIX):].isdigit():
        raise DumpError(f"{folder / name}: not a canonical rank folder name (expected rank_<r>, r in ASCII digits "
                        "without leading zeros)")
    return r


def rank_folders(layer_dir: Path, layer_real: str, root_real: str, limits: DumpLimits) -> tuple[Path, ...] | None:
    """The ``rank_<r>`` folders of a layer in rank order, ``None`` for a whole-layer folder.

    Raises:
        DumpError: a layer mixing rank folders with ``q/ k/ v/``, a rank folder resolving outside the
            dump, or rank ids that are not ``0 … R−1`` (a rank missing).
    """
    ranks: dict[int, Path] = {}
    plain: list[str] = []
    for name in scan_dir(layer_dir, layer_real, limits.max_heads + len(LAYER_KINDS) + 1024):
        if name in LAYER_KINDS:
            plain.append(name)
            continue
        r = _rank_id(layer_dir, name)
        if r is None:
            continue
        child = layer_dir / name
        if os.path.isdir(resolve_inside(child, root_real, "rank folder")):
            ranks[r] = child
    if not ranks:
        return None
    if plain:
        raise DumpError(f"{layer_dir}: holds both rank_<r>/ folders and {', '.join(sorted(plain))}/; a layer is either "
                        "per rank or whole")
    if len(ranks) > limits.max_heads:
        raise DumpError(f"{layer_dir}: {len(ranks)} rank folders, more than max_heads={limits.max_heads} (DumpLimits)")
    missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
    if missing:
        raise DumpError(f"{layer_dir}: rank_{missing[0]} is missing (found {_ranks(sorted(ranks))}); a per-rank dump "
                        "needs every TP rank's folder, a partial one fits no better than Hadamard (re-dump every rank)")
    return tuple(ranks[r] for r in range(len(ranks)))


def _ranks(ids: Sequence[int]) -> str:
    shown = ", ".join(f"rank_{r}" for r in ids[:8])
    return shown + (" ..." if len(ids) > 8 else "")


def check_rank_counts(root: Path, per_layer: dict[int, tuple[Path, ...] | None], tp_size: int | None) -> int | None:
    """The dump's TP size (``None`` for whole layers), refusing layers that disagree or a count other than
    ``tp_size``."""
    ranked = {lid: len(f) for lid, f in per_layer.items() if f is not None}
    whole = [lid for lid, f in per_layer.items() if f is None]
    if not ranked:
        if tp_size not in (None, 1):
            raise DumpError(f"{root}: tp_size={tp_size} was given, but the dump's layers are whole (no rank_<r>/ "
                            "folders)")
        return None
    if whole:
        raise DumpError(f"{root}: layer {whole[0]} is whole but layer {next(iter(ranked))} is per rank "
                        f"(rank_<r>/ folders); a dump is one or the other")
    counts = sorted(set(ranked.values()))
    if len(counts) > 1:
        few = min(ranked, key=lambda lid: ranked[lid])
        many = max(ranked, key=lambda lid: ranked[lid])
        raise DumpError(f"{root}: layer {few} has {ranked[few]} rank folders but layer {many} has {ranked[many]}: "
                        f"rank_{ranked[few]} of layer {few} is missing (re-dump every rank)")
    if tp_size is not None and counts[0] != tp_size:
        raise DumpError(f"{root}: {counts[0]} rank folders per layer, but the dump was made with tp_size={tp_size}: "
                        f"{'ranks are missing' if counts[0] < tp_size else 'more ranks than expected'} "
                        "(re-dump every rank, or give the right tp_size / --tp-size)")
    return counts[0]


def refuse_rank_listing(where: Path, kind: str, shard: int, ref: tuple[int, ...] | None,
                        got: tuple[int, ...] | None) -> None:
    """Raise for rank ``shard``'s ``<kind>/`` folder (``where``) holding other chunks than rank 0's."""
    if got is None or ref is None:
        has = shard if got is not None else 0
        raise DumpError(f"{where}: {kind}/ exists in rank_{has} but not in every rank; every rank dumps the same "
                        "tensors (re-dump every rank)")
    lacks, extra = sorted(set(ref) - set(got)), sorted(set(got) - set(ref))
    shown = ", ".join(map(str, (lacks or extra)[:12]))
    detail = f"lacks chunk(s) {shown} that rank_0 holds" if lacks else f"has chunk(s) {shown} that rank_0 lacks"
    raise DumpError(f"{where}: {detail}; every rank dumps the same batches (re-dump every rank)")


@dataclass(frozen=True)
class MergedMeta:
    """A chunk of a per-rank layer: every rank's inspected shard, and the merged tensor they make.

    Attributes:
        path: a display path (``layer_<L>/rank_*/<kind>/<chunk>.pt``).
        parts: each rank's :class:`~.dump_schema.ChunkMeta`, in rank order.
        rep: consecutive ranks holding the same KV heads (1: none replicated; always 1 for queries).
        shape: ``[n, heads, d]`` of the merged tensor (replicas counted once).
    """

    path: Path
    parts: tuple[ChunkMeta, ...]
    rep: int
    shape: tuple[int, ...]

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def dtype(self) -> str:
        return self.parts[0].dtype

    @property
    def storage_bytes(self) -> int:
        return sum(p.storage_bytes for p in self.parts)


def merged_meta(path: Path, parts: Sequence[ChunkMeta], kind: str, rep: int) -> MergedMeta:
    """Check that the ranks' shards of one chunk fit together and describe the merged tensor."""
    first = parts[0]
    for r, p in enumerate(parts[1:], start=1):
        if p.rows != first.rows:
            raise DumpError(f"{p.path}: {p.rows} tokens, but rank 0's shard of the chunk has {first.rows}; the ranks "
                            "dumped different batches")
        if p.shape[1:] != first.shape[1:] or p.dtype != first.dtype:
            raise DumpError(f"{p.path}: shape {list(p.shape)} {p.dtype}, but rank 0's shard is {list(first.shape)} "
                            f"{first.dtype}; every rank holds the same number of heads")
    rep = rep if kind in ("k", "v") else 1
    heads = first.shape[1] * (len(parts) // rep)
    return MergedMeta(path=path, parts=tuple(parts), rep=rep, shape=(first.rows, heads, first.shape[2]))


def replication(shards: Sequence[torch.Tensor], where: Path) -> int:
    """``rep``: how many consecutive ranks hold the same KV heads, from bit-identical shards of one chunk.

    Raises:
        DumpError: runs of identical shards of different lengths, or replicated shards holding more than
            one KV head (not how the server shards heads).
    """
    runs, n = [], 1
    for a, b in zip(shards, shards[1:]):
        if torch.equal(a, b):
            n += 1
        else:
            runs.append(n)
            n = 1
    runs.append(n)
    rep = runs[0]
    if any(r != rep for r in runs):
        raise DumpError(f"{where}: the ranks' KV shards repeat in runs of {', '.join(map(str, runs))} ranks; replicated "
                        "KV heads are held by equally many consecutive ranks, so the dump is inconsistent")
    if rep > 1 and shards[0].shape[1] != 1:
        raise DumpError(f"{where}: consecutive ranks hold identical shards of {shards[0].shape[1]} KV heads; the server "
                        "replicates only when each rank holds one KV head, so the dump is inconsistent")
    return rep


def merge(meta: MergedMeta, shards: Sequence[torch.Tensor], kind: str, chunk: int) -> torch.Tensor:
    """The whole layer's tensor of one chunk: the shards in rank order, replicas checked bit for bit and kept once."""
    rep = meta.rep
    for r in range(len(shards)):
        first = r - r % rep
        if r != first and not torch.equal(shards[r], shards[first]):
            raise DumpError(f"{meta.parts[r].path}: rank {r} holds the same KV head as rank {first} (replicated over "
                            f"{rep} ranks) but its {kind} chunk {chunk} differs; the dump is inconsistent (refused "
                            "rather than picking one)")
    return torch.cat([shards[r] for r in range(0, len(shards), rep)], dim=1)
