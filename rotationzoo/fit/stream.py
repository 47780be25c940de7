"""Streaming the chunks of a Q/K/V dump through the fp64 accumulators, one layer at a time.

Pass 1 reads each chunk of the kinds the targets need once; pass 2 (``sst`` only) reads each K
and V chunk once more (see :mod:`rotationzoo.fit.accumulate`). Every chunk is checked before it is
read (:meth:`~rotationzoo.fit.dump.Dump.load`), and after it is accumulated its statistics must
still be finite, so a NaN or Inf in the dump is refused at the chunk that holds it, at no extra
cost (:meth:`~rotationzoo.fit.accumulate.LayerAccumulator.finite`).
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from ..errors import DumpError
from .accumulate import LayerAccumulator, ProgressFn, Workspace, pass1_kinds
from .dump import Dump
from .dump_plan import DumpShape

_thread_local = threading.local()


def thread_workspace(device: torch.device | str = "cpu") -> Workspace:
    """The calling thread's reusable :class:`Workspace` for ``device``."""
    key = str(torch.device(device))
    spaces = getattr(_thread_local, "spaces", None)
    if spaces is None:
        spaces = _thread_local.spaces = {}
    if key not in spaces:
        spaces[key] = Workspace(device)
    return spaces[key]


def _refuse_non_finite(dump: Dump, layer_id: int, chunk: int, kinds: Sequence[str],
                       tensors: Sequence[torch.Tensor]) -> DumpError:
    """The error naming the first of ``kinds`` (loaded as ``tensors``) that holds a NaN or Inf."""
    kind = kinds[0]
    for k, t in zip(kinds, tensors):
        if not bool(torch.isfinite(t).all()):
            kind = k
            break
    return DumpError(f"{dump.path(layer_id, kind, chunk)}: holds non-finite values (NaN or Inf) or values too "
                     "large to square in fp64; rotations fitted from it would be garbage (re-dump the model)")


def layer_reads(dump: Dump, layer_id: int, targets: Sequence[str], chunks: Sequence[int] | None = None) -> int:
    """Chunk reads :func:`accumulate_dump_layer` makes for one layer (the ``total`` of its progress)."""
    second = ("k", "v") if "sst" in targets else ()
    n = len(chunks) if chunks is not None else len(dump.chunk_ids(layer_id, tuple(dict.fromkeys(pass1_kinds(targets) + second))))
    return n * (2 if second else 1)


def accumulate_dump_layer(
    dump: Dump,
    layer_id: int,
    shape: DumpShape,
    targets: Sequence[str],
    *,
    device: torch.device | str = "cpu",
    workspace: Workspace | None = None,
    progress: ProgressFn | None = None,
    per_head: bool = False,
    chunks: Sequence[int] | None = None,
) -> tuple[LayerAccumulator, dict[str, int]]:
    """Stream one layer of a dump through a :class:`LayerAccumulator`.

    Pass 1 reads each chunk of the kinds the targets need once; pass 2 (``sst`` only) reads each
    K and V chunk once more. Q is never read twice.

    Args:
        dump: the opened dump.
        layer_id: the layer to process.
        shape: the dump's head layout (:meth:`Dump.shape`).
        targets: subset of :data:`~rotationzoo.fit.accumulate.TARGETS`.
        device: accumulation device.
        workspace: scratch buffers (default: the calling thread's).
        progress: ``progress(layer_id, done, total)`` after each chunk.
        per_head: accumulate ktk / vtv per KV head (see :class:`LayerAccumulator`).
        chunks: read only these of the layer's chunks (default: every used one).

    Returns:
        ``(accumulator, io)`` with ``io = {"bytes_read": ..., "chunks_read": ...}``.

    Raises:
        DumpError: a chunk refused by the dump's checks, with the wrong shape, K/V chunk sizes that
            differ from Q's, or non-finite values.
    """
    ws = workspace if workspace is not None else thread_workspace(device)
    acc = LayerAccumulator(
        layer_id,
        num_q_heads=shape.num_q_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        targets=targets,
        device=device,
        workspace=ws,
        per_head=per_head,
    )
    kinds1 = acc.pass1_kinds
    kinds2 = ("k", "v") if acc.needs_second_pass else ()
    needed = tuple(dict.fromkeys(kinds1 + kinds2))
    if chunks is None:
        chunks = dump.chunk_ids(layer_id, needed)
    else:
        dump.chunk_ids(layer_id, needed)  # the kinds hold the same chunks
    total = layer_reads(dump, layer_id, targets, chunks)
    done = 0
    io = {"bytes_read": 0, "chunks_read": 0}
    sizes: dict[int, int] = {}
    heads = {"q": shape.num_q_heads, "k": shape.num_kv_heads, "v": shape.num_kv_heads}

    def load(kind: str, chunk: int) -> torch.Tensor:
        t = dump.load(layer_id, kind, chunk)
        if t.shape[1] != heads[kind] or t.shape[2] != shape.head_dim:
            raise DumpError(
                f"{dump.path(layer_id, kind, chunk)}: shape {tuple(t.shape)}, expected "
                f"[n, {heads[kind]}, {shape.head_dim}] like the rest of the dump (inconsistent head dims)"
            )
        n = int(t.shape[0])
        if sizes.setdefault(chunk, n) != n:
            raise DumpError(
                f"{dump.path(layer_id, kind, chunk)}: {n} tokens, but other tensors of chunk {chunk} have {sizes[chunk]}"
            )
        io["bytes_read"] += t.numel() * t.element_size()
        io["chunks_read"] += 1
        return t

    add = {"q": acc.add_q, "k": acc.add_k, "v": acc.add_v}
    for chunk in chunks:
        for kind in kinds1:
            t = load(kind, chunk)
            add[kind](t)
            if not acc.finite(kind):
                raise _refuse_non_finite(dump, layer_id, chunk, (kind,), (t,))
            del t
        done += 1
        if progress is not None:
            progress(layer_id, done, total)
    if acc.num_tokens == 0:
        raise DumpError(f"{dump.root}/layer_{layer_id}: empty layer: its chunks hold 0 tokens")
    if kinds2:
        acc.start_second_pass()
        for chunk in chunks:
            k = load("k", chunk)
            v = load("v", chunk)
            acc.add_kv(k, v)
            if not acc.finite("kv"):
                raise _refuse_non_finite(dump, layer_id, chunk, ("k", "v"), (k, v))
            del k, v
            done += 1
            if progress is not None:
                progress(layer_id, done, total)
    return acc, io


def second_pass_from_dump(
    acc: LayerAccumulator,
    dump: Dump,
    layer_id: int | None = None,
    *,
    progress: ProgressFn | None = None,
) -> dict[str, int]:
    """Run pass 2 (``sst``) of an accumulator whose pass 1 was fed elsewhere (e.g. live capture).

    Args:
        acc: an accumulator that has seen every chunk of pass 1.
        dump: a dump (possibly holding only ``k/`` and ``v/``) with the same chunks, in order.
        layer_id: the dump layer to read (default ``acc.layer_id``).
        progress: ``progress(layer_id, done, total)`` after each chunk.

    Returns:
        ``{"bytes_read": ..., "chunks_read": ...}``.
    """
    if not acc.needs_second_pass:
        return {"bytes_read": 0, "chunks_read": 0}
    lid = acc.layer_id if layer_id is None else int(layer_id)
    acc.start_second_pass()
    chunks = dump.chunk_ids(lid, ("k", "v"))
    io = {"bytes_read": 0, "chunks_read": 0}
    for i, chunk in enumerate(chunks):
        k = dump.load(lid, "k", chunk)
        v = dump.load(lid, "v", chunk)
        io["bytes_read"] += k.numel() * k.element_size() + v.numel() * v.element_size()
        io["chunks_read"] += 2
        acc.add_kv(k, v)
        if not acc.finite("kv"):
            raise _refuse_non_finite(dump, lid, chunk, ("k", "v"), (k, v))
        del k, v
        if progress is not None:
            progress(lid, i + 1, len(chunks))
    return io
