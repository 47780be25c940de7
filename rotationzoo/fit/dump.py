"""Q/K/V dumps in the SGLang layout: a safe streaming reader (the writer is :mod:`.dump_writer`).

Layout (what the OSCAR dump hook writes, one folder per attention layer)::

    <dump>/layer_<L>/q/<chunk>.pt          # [n, H_q, d]   post-RoPE queries (model dtype, e.g. bf16)
    <dump>/layer_<L>/k/<chunk>.pt          # [n, H_kv, d]  post-RoPE keys
    <dump>/layer_<L>/v/<chunk>.pt          # [n, H_kv, d]  values
    <dump>/layer_<L>/seq_lens/<chunk>.pt   # int32 [num_seqs], tokens per sequence in that chunk
    <dump>/rotationzoo_dump.json           # optional: written by rotationzoo (model, prompts, tokens)

``<chunk>`` is a per-layer counter 0, 1, 2, ... (one extend batch each). Chunk 0 of an SGLang dump
is the server's warm-up request, so readers skip it unless asked to keep it, exactly as the
authors' fitter does. Layer ids may be sparse (hybrid models dump only their full-attention
layers).

Nothing is trusted: every folder and file must resolve inside the dump folder and every file must
be a regular file; each chunk's archive and pickle are inspected without being executed and must
hold one dense tensor within :class:`~rotationzoo.fit.dump_schema.DumpLimits` before it is
memory-mapped with ``torch.load(weights_only=True)`` (:mod:`.dump_schema`). :meth:`Dump.plan`
inspects every chunk a fit will read, from metadata alone, so a bad dump is refused before any
activation is read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from ..errors import DumpError
from .dump_schema import (
    DUMP_INFO_NAME,
    DUMP_UNFINISHED_NAME,
    GRAD_KIND,
    KINDS,
    ChunkMeta,
    DumpLimits,
    check_regular,
    chunk_file_id,
    file_ident,
    layer_folder_id,
    inspect_chunk,
    load_chunk,
    read_info,
    read_seq_lens,
    resolve_inside,
    scan_dir,
)
from .dump_ranks import (MergedMeta, check_rank_counts, merge, merged_meta, rank_folders, refuse_rank_listing,
                         replication)
from .dump_plan import DumpPlan, DumpShape, plan_dump
from .dump_writer import DumpWriter, write_dump  # noqa: F401  (the writer, re-exported)

_SLACK_ENTRIES = 1024  # entries of a dump folder besides its layers or chunks (notes, rotations/, ...)


class Dump:
    """A Q/K/V dump folder, read lazily one chunk at a time.

    Args:
        root: the dump folder (the one holding ``layer_<L>/``).
        keep_first_chunk: also use chunk 0 (the SGLang warm-up batch; skipped by default, as the
            authors' fitter does).
        layers: only these layer ids (default: every ``layer_<L>`` folder).
        limits: the bounds the dump must respect (default :class:`DumpLimits`).
        tp_size: the number of tensor-parallel ranks a per-rank dump (``layer_<L>/rank_<r>/…``, see
            :mod:`.dump_ranks`) must have (default: ``tp_size`` of ``rotationzoo_dump.json`` when
            present, else whatever every layer agrees on).

    Attributes:
        tp_size: the rank count of a per-rank dump, ``None`` for whole layers.

    Raises:
        DumpError: the folder does not exist, holds no ``layer_<L>`` folders, lacks a requested layer,
            holds more than ``limits.max_layers`` of them, a layer folder resolves outside it, or a
            per-rank dump lacks a rank.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_first_chunk: bool = False,
        layers: Iterable[int] | None = None,
        limits: DumpLimits | None = None,
        tp_size: int | None = None,
    ) -> None:
        self.root = Path(root)
        if tp_size is not None and (type(tp_size) is not int or tp_size < 1):
            raise DumpError(f"tp_size must be a positive integer (tensor-parallel ranks), got {tp_size!r:.40}")
        self._tp_arg = tp_size
        self.keep_first_chunk = bool(keep_first_chunk)
        if limits is not None and not isinstance(limits, DumpLimits):
            raise DumpError(f"limits must be a DumpLimits, got {type(limits).__name__}")
        self.limits = limits or DumpLimits()
        if not self.root.exists():
            raise DumpError(f"dump directory {self.root} does not exist")
        if not self.root.is_dir():
            raise DumpError(f"{self.root} is not a directory; expected a dump folder with layer_<L>/ subfolders")
        if os.path.lexists(self.root / DUMP_UNFINISHED_NAME):
            raise DumpError(f"{self.root}: the capture writing this dump did not finish ({DUMP_UNFINISHED_NAME} is "
                            f"there: interrupted or failed), so its layers may hold fewer tokens than asked; capture "
                            f"again (calibrate --dump-out ... --overwrite-dump)")
        self._root_real = os.path.realpath(self.root)
        found: dict[int, tuple[Path, str]] = {}
        for name in scan_dir(self.root, self._root_real, 4 * self.limits.max_layers + _SLACK_ENTRIES):
            lid = layer_folder_id(self.root, name)
            if lid is None:
                continue
            child = self.root / name
            real = resolve_inside(child, self._root_real, "layer folder")
            if os.path.isdir(real):
                found[lid] = (child, real)
        if not found:
            raise DumpError(
                f"{self.root}: no layer_<L>/ folders; not a Q/K/V dump "
                f"(expected layer_<L>/{{q,k,v,seq_lens}}/<chunk>.pt)"
            )
        if layers is not None:
            try:
                wanted = sorted({int(i) for i in layers})
            except (TypeError, ValueError):
                raise DumpError(f"layers must be layer ids (integers), got {layers!r:.80}") from None
            missing = [i for i in wanted if i not in found]
            if missing:
                raise DumpError(
                    f"{self.root}: no layer(s) {', '.join(map(str, missing))} in the dump "
                    f"(it has {_fmt_ids(sorted(found))})"
                )
            found = {i: found[i] for i in wanted}
        if len(found) > self.limits.max_layers:
            raise DumpError(f"{self.root}: {len(found)} layers, more than max_layers={self.limits.max_layers} "
                            "(DumpLimits); fit fewer layers at a time (--layers)")
        self._layers = dict(sorted(found.items()))
        self._layer_dirs = {lid: p for lid, (p, _) in self._layers.items()}
        self.layer_ids: tuple[int, ...] = tuple(self._layers)
        self._chunk_cache: dict[tuple[int, str], tuple[int, ...] | None] = {}
        self._reals: dict[tuple[int, str, int, int], str] = {}
        self._metas: dict[tuple[int, str, int], ChunkMeta | MergedMeta] = {}
        self._seq_lens: dict[tuple[int, int], list[int]] = {}
        self._plans: dict[tuple[str, ...], DumpPlan] = {}
        self._info: dict[str, Any] | None = None
        ranks = {lid: rank_folders(p, real, self._root_real, self.limits) for lid, (p, real) in self._layers.items()}
        self.tp_size = check_rank_counts(self.root, ranks, tp_size if tp_size is not None else self.info().get("tp_size"))
        #: the folders holding q/ k/ v/ of each layer: the layer itself, or its rank folders in rank order
        self._shards = {lid: f if f is not None else (self._layer_dirs[lid],) for lid, f in ranks.items()}
        self._reps: dict[int, int] = {}

    def __repr__(self) -> str:
        ranks = f", tp_size={self.tp_size}" if self.tp_size else ""
        return (f"Dump({str(self.root)!r}, layers={_fmt_ids(list(self.layer_ids))}, "
                f"keep_first_chunk={self.keep_first_chunk}{ranks})")

    def reopen(self, *, keep_first_chunk: bool | None = None, layers: Iterable[int] | None = None) -> "Dump":
        """The same dump with another chunk-0 rule or layer selection (limits and ``tp_size`` kept)."""
        return Dump(self.root, keep_first_chunk=self.keep_first_chunk if keep_first_chunk is None else keep_first_chunk,
                    layers=layers, limits=self.limits, tp_size=self._tp_arg)

    # -- structure --------------------------------------------------------------------------------
    def _listing(self, layer_id: int, kind: str) -> tuple[int, ...] | None:
        """Chunk ids of ``layer_<L>/<kind>/`` (``None`` when the folder does not exist), each file checked;
        of a per-rank layer, the chunks every rank's ``<kind>/`` holds (they must agree; ``seq_lens`` of rank 0)."""
        key = (layer_id, kind)
        if key not in self._chunk_cache:
            shards = self._shards[layer_id] if kind in KINDS else self._shards[layer_id][:1]
            listed = [self._shard_listing(layer_id, kind, i, base) for i, base in enumerate(shards)]
            for i, ids in enumerate(listed[1:], start=1):
                if ids != listed[0]:
                    refuse_rank_listing(self._shards[layer_id][i] / kind, kind, i, listed[0], ids)
            self._chunk_cache[key] = listed[0]
        return self._chunk_cache[key]

    def _shard_listing(self, layer_id: int, kind: str, shard: int, base: Path) -> tuple[int, ...] | None:
        folder = base / kind
        real = resolve_inside(folder, self._root_real, f"{kind}/ folder")
        if not os.path.isdir(real):
            return None
        ids: list[int] = []
        for name in scan_dir(folder, real, self.limits.max_chunks + _SLACK_ENTRIES):
            chunk = chunk_file_id(folder, name)
            if chunk is None:
                continue
            if len(ids) >= self.limits.max_chunks:
                raise DumpError(f"{folder}: more than max_chunks={self.limits.max_chunks} chunk files (DumpLimits)")
            path = folder / name
            file_real = resolve_inside(path, self._root_real, "chunk file")
            check_regular(path, file_real)
            self._reals[(layer_id, kind, chunk, shard)] = file_real
            ids.append(chunk)
        return tuple(sorted(ids))

    def _file(self, layer_id: int, kind: str, chunk_id: int, shard: int = 0) -> Path:
        return self._shards[layer_id][shard] / kind / f"{chunk_id}.pt"

    def layer_dir(self, layer_id: int) -> Path:
        """The folder of layer ``layer_id`` (``layer_<L>``), as named in messages."""
        return self._layer_dirs[layer_id]

    def all_chunk_ids(self, layer_id: int, kind: str) -> tuple[int, ...]:
        """Every chunk id of one kind of a layer, the warm-up chunk 0 included."""
        ids = self._listing(layer_id, kind)
        if ids is None:
            raise DumpError(f"{self._layer_dirs[layer_id] / kind}: missing; a dump layer needs q/, k/ and v/ folders")
        return ids

    def _require_layer(self, layer_id: int) -> None:
        if layer_id not in self._layer_dirs:
            raise DumpError(f"{self.root}: no layer {layer_id} (it has {_fmt_ids(list(self.layer_ids))})")

    def has_grads(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` holds output gradients (a ``g/`` folder, :data:`~.dump_schema.GRAD_KIND`).

        Raises:
            DumpError: a per-rank layer holds them (they are written for whole layers only).
        """
        self._require_layer(layer_id)
        if len(self._shards[layer_id]) > 1:
            if any(os.path.isdir(base / GRAD_KIND) for base in self._shards[layer_id]):
                raise DumpError(f"{self._layer_dirs[layer_id]}: output gradients (g/) in a per-rank dump; they are "
                                f"read from whole-layer dumps only (write them with calibrate --grads)")
            return False
        return self._listing(layer_id, GRAD_KIND) is not None

    def chunk_ids(self, layer_id: int, kinds: Sequence[str] = KINDS) -> tuple[int, ...]:
        """Chunk ids of a layer that the fit uses (chunk 0 dropped unless ``keep_first_chunk``).

        Args:
            layer_id: a layer of the dump.
            kinds: the tensor kinds that must all be present for every chunk.

        Raises:
            DumpError: a kind folder is missing, the kinds have different chunks, or no chunk is left.
        """
        self._require_layer(layer_id)
        per_kind = {kind: self.all_chunk_ids(layer_id, kind) for kind in kinds}
        first_kind = kinds[0]
        ref = per_kind[first_kind]
        for kind in kinds[1:]:
            if per_kind[kind] != ref:
                only_a = sorted(set(ref) - set(per_kind[kind]))
                only_b = sorted(set(per_kind[kind]) - set(ref))
                detail = []
                if only_a:
                    detail.append(f"{kind}/ lacks chunk(s) {_fmt_ids(only_a)}")
                if only_b:
                    detail.append(f"{first_kind}/ lacks chunk(s) {_fmt_ids(only_b)}")
                raise DumpError(
                    f"{self._layer_dirs[layer_id]}: {first_kind}/ and {kind}/ hold different chunks ({'; '.join(detail)})"
                )
        used = ref if self.keep_first_chunk else tuple(c for c in ref if c != 0)
        if not used:
            if ref:
                raise DumpError(
                    f"{self._layer_dirs[layer_id]}: empty layer: only the warm-up chunk 0 is present "
                    f"(pass keep_first_chunk=True / --keep-first-chunk to fit on it)"
                )
            raise DumpError(f"{self._layer_dirs[layer_id]}: empty layer: no <chunk>.pt files in {', '.join(kinds)}")
        return used

    def path(self, layer_id: int, kind: str, chunk_id: int) -> Path:
        """``<root>/layer_<L>/<kind>/<chunk>.pt`` (``<root>/layer_<L>/rank_*/<kind>/<chunk>.pt`` per rank)."""
        if len(self._shards[layer_id]) > 1:
            return self._layer_dirs[layer_id] / "rank_*" / kind / f"{chunk_id}.pt"
        return self._layer_dirs[layer_id] / kind / f"{chunk_id}.pt"

    # -- reading ----------------------------------------------------------------------------------
    def meta(self, layer_id: int, kind: str, chunk_id: int) -> ChunkMeta | MergedMeta:
        """What a chunk file holds, from its inspected archive (nothing is loaded; cached while the
        file is unchanged); for a per-rank layer, every rank's shard and the merged shape.

        Raises:
            DumpError: no such chunk, a file refused by the checks of :mod:`.dump_schema`, or shards
                that do not fit together.
        """
        if chunk_id not in self.all_chunk_ids(layer_id, kind):
            raise DumpError(f"{self.path(layer_id, kind, chunk_id)}: no such chunk")
        key = (layer_id, kind, chunk_id)
        meta = self._metas.get(key)
        if meta is None or not _fresh(meta):
            parts = [self._shard_meta(layer_id, kind, chunk_id, i) for i in range(len(self._shards[layer_id]))]
            if len(parts) == 1:
                meta = parts[0]
            else:
                rep = self._replication(layer_id) if kind in ("k", "v") else 1
                meta = merged_meta(self.path(*key), parts, kind, rep)
            self._metas[key] = meta
        return meta

    def _shard_meta(self, layer_id: int, kind: str, chunk_id: int, shard: int) -> ChunkMeta:
        return inspect_chunk(self._file(layer_id, kind, chunk_id, shard), self._reals[(layer_id, kind, chunk_id, shard)],
                             kind, self.limits)

    def _replication(self, layer_id: int) -> int:
        """Ranks per replicated KV head of a per-rank layer, from its first K (else V) chunk's shards."""
        if layer_id not in self._reps:
            kind = "k" if self._listing(layer_id, "k") else "v"
            chunks = self.all_chunk_ids(layer_id, kind)
            if not chunks:
                return 1  # an empty layer, refused by chunk_ids
            chunk = chunks[0]
            shards = [load_chunk(self._shard_meta(layer_id, kind, chunk, i)) for i in range(len(self._shards[layer_id]))]
            self._reps[layer_id] = replication(shards, self.path(layer_id, kind, chunk))
        return self._reps[layer_id]

    def load(self, layer_id: int, kind: str, chunk_id: int) -> torch.Tensor:
        """One activation chunk, ``[n, H, d]`` in its stored dtype (CPU, memory-mapped; merged over the
        ranks of a per-rank layer, replicated KV heads checked to be identical and kept once).

        Raises:
            DumpError: a file refused by the checks of :mod:`.dump_schema` (not a tensor, not 3-D
                floating point, beyond :class:`DumpLimits`, ...), one that changed since, or replicas
                that differ between ranks.
        """
        meta = self.meta(layer_id, kind, chunk_id)
        if isinstance(meta, ChunkMeta):
            return load_chunk(meta)
        return merge(meta, [load_chunk(m) for m in meta.parts], kind, chunk_id)

    def _rows(self, layer_id: int, chunk_id: int) -> int:
        for kind in ("k", "v", "q"):
            ids = self._listing(layer_id, kind)
            if ids is not None and chunk_id in ids:
                return self.meta(layer_id, kind, chunk_id).rows
        raise DumpError(f"{self.path(layer_id, 'seq_lens', chunk_id)}: no q/k/v chunk {chunk_id} in its layer")

    def seq_lens(self, layer_id: int, chunk_id: int) -> list[int] | None:
        """Per-sequence token counts of a chunk, or ``None`` when the dump has no ``seq_lens/`` file for it.

        Raises:
            DumpError: a ``seq_lens`` file that is not positive integers summing to the chunk's tokens.
        """
        key = (layer_id, chunk_id)
        if key not in self._seq_lens:
            ids = self._listing(layer_id, "seq_lens")
            if ids is None or chunk_id not in ids:
                return None
            rows = self._rows(layer_id, chunk_id)
            real = self._reals[(layer_id, "seq_lens", chunk_id, 0)]
            self._seq_lens[key] = read_seq_lens(self._file(layer_id, "seq_lens", chunk_id), real, rows, self.limits)
        return list(self._seq_lens[key])

    def context(self, kinds: Sequence[str] = ("q", "k", "v")) -> int:
        """The longest sequence of the used chunks of the first layer, in tokens (headers only).

        Each chunk holds the sequences its ``seq_lens`` file lists, or one sequence of all its rows.
        This is the context a fit from the dump saw (what :attr:`CalibrationSamples.context
        <rotationzoo.fit.samples.CalibrationSamples.context>` records once the chunks are read).
        """
        layer = self.layer_ids[0]
        return max(max(self.seq_lens(layer, c) or [self._rows(layer, c)]) for c in self.chunk_ids(layer, kinds))

    def prompt_count(self) -> int | None:
        """The authors' ``prompt<N>`` tag value: Σ ``len(seq_lens)`` over every chunk of the first layer.

        Counts (sequence, chunk) segments including the warm-up chunk, as the authors' dump script
        does; ``None`` when the dump has no ``seq_lens/``.
        """
        layer = self.layer_ids[0]
        ids = self._listing(layer, "seq_lens")
        if ids is None:
            return None
        return sum(len(self.seq_lens(layer, chunk) or []) for chunk in ids)

    def info(self) -> dict[str, Any]:
        """Contents of ``rotationzoo_dump.json`` when present (``{}`` otherwise), checked by
        :func:`~rotationzoo.fit.dump_schema.read_info`."""
        if self._info is None:
            p = self.root / DUMP_INFO_NAME
            self._info = read_info(p, self._root_real, self.limits) if os.path.lexists(p) else {}
        return dict(self._info)

    def plan(self, kinds: Sequence[str] = KINDS) -> DumpPlan:
        """Inspect every chunk of ``kinds`` that a fit reads (and its ``seq_lens``), loading nothing.

        Args:
            kinds: the tensor kinds to plan; ``"k"`` or ``"v"`` is needed for ``H_kv``.

        Raises:
            DumpError: any file refused by :mod:`.dump_schema`; inconsistent head dims or head counts
                between kinds, chunks or layers; token counts that differ between a chunk's kinds; more
                tokens per layer than ``max_tokens_per_layer``; ``H_q`` not a multiple of ``H_kv``.
        """
        kinds = tuple(dict.fromkeys(kinds))
        if not kinds or any(k not in KINDS for k in kinds) or not {"k", "v"} & set(kinds):
            raise DumpError(f"internal: plan() needs 'k' or 'v' among kinds from {KINDS}, got {kinds}")
        if kinds not in self._plans:
            self._plans[kinds] = plan_dump(self, kinds)
        return self._plans[kinds]

    def shape(self, kinds: Sequence[str] = KINDS) -> DumpShape:
        """Head layout, checked to be the same in every chunk of every layer (:meth:`plan`).

        Args:
            kinds: which kinds to inspect; ``"k"`` or ``"v"`` is needed for ``H_kv``.

        Raises:
            DumpError: see :meth:`plan`.
        """
        return self.plan(kinds).shape


def open_dump(
    root: str | os.PathLike[str], *, keep_first_chunk: bool = False, layers: Iterable[int] | None = None,
    limits: DumpLimits | None = None, tp_size: int | None = None,
) -> Dump:
    """Open a dump folder (whole layers, or one folder per TP rank); see :class:`Dump`."""
    return Dump(root, keep_first_chunk=keep_first_chunk, layers=layers, limits=limits, tp_size=tp_size)


def _fresh(meta: ChunkMeta | MergedMeta) -> bool:
    parts = meta.parts if isinstance(meta, MergedMeta) else (meta,)
    return all(file_ident(p.real) == p.ident for p in parts)


def _fmt_ids(ids: Sequence[int]) -> str:
    ids = list(ids)
    return ", ".join(map(str, ids[:12])) + (" ..." if len(ids) > 12 else "")
