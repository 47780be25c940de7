"""Planning a dump read: the head layout every chunk must share and what a fit will read, found from
chunk metadata alone so that a bad dump is refused before any activation is loaded (:meth:`Dump.plan`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import DumpError
from .dump_ranks import MergedMeta
from .dump_schema import ChunkMeta

if TYPE_CHECKING:
    from .dump import Dump


@dataclass(frozen=True)
class DumpShape:
    """Head layout shared by every layer of a dump.

    Attributes:
        num_q_heads: ``H_q`` (``None`` when the dump has no queries).
        num_kv_heads: ``H_kv``.
        head_dim: ``d``.
        dtype: dtype name of the stored activations, e.g. ``"bfloat16"``.
    """

    num_q_heads: int | None
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def group_size(self) -> int | None:
        """Query heads per KV head, ``g = H_q // H_kv``."""
        return None if self.num_q_heads is None else self.num_q_heads // self.num_kv_heads


@dataclass(frozen=True)
class DumpPlan:
    """What reading some kinds of a dump involves, found from metadata alone (:meth:`Dump.plan`).

    Attributes:
        kinds: the tensor kinds planned.
        shape: the head layout, the same in every chunk and layer.
        chunks: the chunk ids used per layer (chunk 0 dropped unless kept).
        tokens: tokens per layer over those chunks.
        bytes: tensor bytes those chunks hold.
    """

    kinds: tuple[str, ...]
    shape: DumpShape
    chunks: dict[int, tuple[int, ...]]
    tokens: dict[int, int]
    bytes: int


def plan_dump(dump: "Dump", kinds: tuple[str, ...]) -> DumpPlan:
    """What reading ``kinds`` of ``dump`` involves, every chunk inspected from metadata alone (:meth:`Dump.plan`,
    which checks ``kinds`` and keeps the result)."""
    result: DumpShape | None = None
    where, chunks, tokens, nbytes = "", {}, {}, 0
    for layer in dump.layer_ids:
        used = dump.chunk_ids(layer, kinds)
        layer_shape: DumpShape | None = None
        ref: dict[str, tuple[int, ...]] = {}
        total = 0
        for chunk in dump.all_chunk_ids(layer, kinds[0]):  # a skipped chunk 0 is checked too, never read
            cur, rows, size, metas = _plan_chunk(dump, layer, chunk, kinds)
            if layer_shape is None:
                layer_shape, ref = cur, {kind: m.shape[1:] for kind, m in metas.items()}
            for kind, m in metas.items():
                if m.shape[1:] != ref[kind]:
                    raise DumpError(f"{m.path}: shape {m.shape}, expected [n, {ref[kind][0]}, {ref[kind][1]}] "
                                    "like the rest of the dump (inconsistent head dims)")
            dump.seq_lens(layer, chunk)  # checked where present
            if chunk not in used:
                continue
            total += rows
            nbytes += size
            if total > dump.limits.max_tokens_per_layer:
                raise DumpError(f"{dump.layer_dir(layer)}: more than max_tokens_per_layer="
                                f"{dump.limits.max_tokens_per_layer} tokens (DumpLimits)")
        assert layer_shape is not None
        hq, hkv = layer_shape.num_q_heads, layer_shape.num_kv_heads
        if hq is not None and hq % hkv:
            raise DumpError(f"{dump.layer_dir(layer)}: {hq} query heads is not a multiple of {hkv} KV heads")
        if result is None:
            result, where = layer_shape, f"layer {layer}"
        elif _heads(layer_shape) != _heads(result):
            raise DumpError(
                f"{dump.root}: inconsistent head dims between layers: {where} has "
                f"{_fmt_shape(result)}, layer {layer} has {_fmt_shape(layer_shape)}"
            )
        chunks[layer], tokens[layer] = used, total
    assert result is not None
    return DumpPlan(kinds=kinds, shape=result, chunks=chunks, tokens=tokens, bytes=nbytes)


def _plan_chunk(dump: "Dump", layer: int, chunk: int, kinds: tuple[str, ...]
                ) -> tuple[DumpShape, int, int, dict[str, ChunkMeta | MergedMeta]]:
    metas = {kind: dump.meta(layer, kind, chunk) for kind in kinds}
    dims = {kind: m.shape[2] for kind, m in metas.items()}
    if len(set(dims.values())) != 1:
        detail = ", ".join(f"{k}: {d}" for k, d in dims.items())
        raise DumpError(f"{dump.layer_dir(layer)}: inconsistent head dims within chunk {chunk} ({detail})")
    rows = metas[kinds[0]].rows
    for kind, m in metas.items():
        if m.rows != rows:
            raise DumpError(f"{m.path}: {m.rows} tokens, but other tensors of chunk {chunk} have {rows}")
    if "k" in metas and "v" in metas and metas["k"].shape[1] != metas["v"].shape[1]:
        raise DumpError(f"{dump.layer_dir(layer)}: k has {metas['k'].shape[1]} heads but v has "
                        f"{metas['v'].shape[1]} (chunk {chunk})")
    kv = metas["k"] if "k" in metas else metas["v"]
    shape = DumpShape(num_q_heads=metas["q"].shape[1] if "q" in metas else None, num_kv_heads=kv.shape[1],
                      head_dim=kv.shape[2], dtype=next(iter(metas.values())).dtype)
    return shape, rows, sum(m.storage_bytes for m in metas.values()), metas


def _heads(s: DumpShape) -> tuple[int | None, int, int]:
    return (s.num_q_heads, s.num_kv_heads, s.head_dim)


def _fmt_shape(s: DumpShape) -> str:
    q = f"H_q={s.num_q_heads}, " if s.num_q_heads is not None else ""
    return f"{q}H_kv={s.num_kv_heads}, head_dim={s.head_dim}"
