"""Decode attention read straight from the INT2 KV cache: :func:`decode_attention_int2`.

The history of each side (keys, values) is in the cache's own layout (:class:`Int2KV`): the BF16
sink, the INT2 codes with their scales/zeros, the BF16 recent tokens, all ``[B, H_kv, n, ·]`` and in
the rotated basis. Nothing is dequantized as a whole: the PyTorch backend walks the history in tiles
(:mod:`rotationzoo.kernels.decode_reference`), the C++ backend in tiles per thread
(:mod:`rotationzoo.kernels.native_ops`), the Triton backend splits it across programs
(:mod:`rotationzoo.kernels.triton_decode`); all fold the pieces with an fp32 online softmax and merge
them by their log-sum-exp. Each backend is a torch operator (:mod:`rotationzoo.kernels.ops`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..errors import KernelInputError
from ..int2kv import Int2KVConfig
from . import layout
from .backend import pick_backend
from .ops import decode_fn
from ..dtypes import TORCH_DTYPES
from ..numbers import shown
from ..vocab import Backend

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_SCALES = (torch.float32, torch.bfloat16, torch.float16)
_MIN_SCALE, _MAX_SCALE = 2.0 ** -126, 2.0 ** 127
"""The softmax scales accepted: fp32 normal numbers, with room for the Triton kernel's ``scale · log2(e)``."""


class Int2KV(NamedTuple):
    """One side (keys or values) of an OSCAR INT2 KV cache, in the cache's layout and rotated basis.

    Attributes:
        sink: ``[B, H_kv, P, d]`` window dtype: the first tokens, kept in high precision (or ``None``).
        codes: ``[B, H_kv, N, d/4]`` uint8 INT2 codes (quarter-interleaved, see
            :func:`~rotationzoo.kernels.byte_index_and_shift`), or ``None``.
        scales_zeros: ``[B, H_kv, N, 2·d/G]`` interleaved scale/zero pairs of ``codes``, or ``None``.
        recent: ``[B, H_kv, R, d]`` window dtype: the latest tokens (the new ones last), or ``None``.

    Key positions run sink, INT2, recent: ``0 … P+N+R−1``.
    """

    sink: torch.Tensor | None
    codes: torch.Tensor | None
    scales_zeros: torch.Tensor | None
    recent: torch.Tensor | None


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def _side(parts: object, name: str, lead: tuple[int, int] | None, d: int, device: torch.device
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked ``(sink, codes, scales_zeros, recent)`` of one side; ``None`` parts become empty tensors.
    (The checks run at every decode step: each reads only metadata, once.)"""
    if not isinstance(parts, tuple) or len(parts) != 4:
        raise KernelInputError(f"{name} must be an Int2KV (sink, codes, scales_zeros, recent), got {type(parts).__name__}")
    sink, codes, sz, recent = parts
    first = None
    for label, t in zip(Int2KV._fields, parts):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise KernelInputError(f"{name}.{label} must be a torch.Tensor or None, got {type(t).__name__}")
        shape = t.shape
        if len(shape) != 4 or (lead is not None and (shape[0], shape[1]) != lead) or (
                first is not None and (shape[0], shape[1]) != first):
            want = f"[{lead[0]}, {lead[1]}, n, ·]" if lead else "[B, H_kv, n, ·]"
            raise KernelInputError(f"{name}.{label} must be {want}, got {list(shape)}")
        if t.device != device:
            raise KernelInputError(f"{name}.{label} is on {t.device} but the query is on {device}")
        first = (shape[0], shape[1])
    if first is None:
        raise KernelInputError(f"{name} holds no tensor: give at least one of sink, codes and recent")
    if (codes is None) != (sz is None):
        raise KernelInputError(f"{name}: codes and scales_zeros come together (both or neither)")
    b, h = first
    for label, t in (("sink", sink), ("recent", recent)):
        if t is not None and (t.dtype not in _FLOATS or t.shape[3] != d):
            raise KernelInputError(f"{name}.{label} must be [{b}, {h}, n, {d}] of {_names(_FLOATS)}, "
                                   f"got {t.dtype} {list(t.shape)}")
    if codes is not None and sz is not None:
        if codes.dtype != torch.uint8 or codes.shape[3] != d // 4:
            raise KernelInputError(f"{name}.codes must be uint8 [{b}, {h}, N, {d // 4}], got {codes.dtype} {list(codes.shape)}")
        if sz.dtype not in _SCALES or sz.shape[2] != codes.shape[2]:
            raise KernelInputError(f"{name}.scales_zeros must be [{b}, {h}, {codes.shape[2]}, 2·groups] of "
                                   f"{_names(_SCALES)}, got {sz.dtype} {list(sz.shape)}")
    if sink is not None and codes is not None and recent is not None:
        return sink, codes, sz, recent
    hp = sink.dtype if sink is not None else recent.dtype if recent is not None else torch.bfloat16
    empty = lambda n, dt: torch.empty((b, h, 0, n), dtype=dt, device=device)  # noqa: E731
    return (sink if sink is not None else empty(d, hp), codes if codes is not None else empty(d // 4, torch.uint8),
            sz if sz is not None else empty(2, torch.float32), recent if recent is not None else empty(d, hp))


def _rotation(r: object, name: str, h: int, d: int, device: torch.device) -> torch.Tensor | None:
    if r is None:
        return None
    if not isinstance(r, torch.Tensor) or not r.is_floating_point():
        got = r.dtype if isinstance(r, torch.Tensor) else type(r).__name__
        raise KernelInputError(f"{name} must be a floating-point tensor [{d}, {d}] or [{h}, {d}, {d}], got {got}")
    if tuple(r.shape) not in ((d, d), (h, d, d)):
        raise KernelInputError(f"{name} must be [{d}, {d}] (shared) or [{h}, {d}, {d}] (per KV head), got {list(r.shape)}")
    if r.device != device:
        raise KernelInputError(f"{name} is on {r.device} but the query is on {device}")
    return r


def _groups(sz: torch.Tensor, d: int, name: str) -> int:
    last = sz.shape[-1]
    g = _group_of(d, last)
    if g is None:
        raise KernelInputError(f"{name}.scales_zeros last dimension must be 2·groups with groups dividing {d}, got {last}")
    if isinstance(g, str):
        raise KernelInputError(f"{name}.scales_zeros: {g}")
    return g


@functools.lru_cache(maxsize=64)
def _group_of(d: int, last: int) -> int | str | None:
    """The group size of a ``[..., last]`` scale/zero tensor at head_dim ``d``; ``None`` for a last dimension
    that is no ``2·groups`` of ``d``, the rule's message for a group size no kernel runs."""
    if last < 2 or last % 2 or d % (last // 2):
        return None
    try:
        return layout.resolve_group_size(d, d // (last // 2))
    except ValueError as exc:
        return str(exc)


@functools.lru_cache(maxsize=64)
def _config_group(config: Int2KVConfig, d: int) -> int:
    return config.group_for(d)


#: Signatures (shapes, dtypes, devices and settings) of calls that passed the checks. The checks read only these,
#: so a call with a known signature skips them: the layers of a decode step share one (bounded: cleared when full).
_CHECKED: set[tuple] = set()
_CHECKED_MAX = 4096


def _meta(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.dtype, t.device)


def _signature(query: object, keys: object, values: object, config: object, rotations: tuple, scale: object,
               causal: object, mask: object, num_splits: object, dtype: object, backend: object) -> tuple | None:
    """The metadata the checks read, or ``None`` where a call takes the checks every time (a part or matrix
    that is not a tensor, a cache side with a missing part, settings of unexpected types, while
    ``torch.compile`` traces)."""
    if torch.compiler.is_compiling():  # traced once: the checks cost nothing at run time, a set would add guards
        return None
    if not (isinstance(query, torch.Tensor) and isinstance(keys, tuple) and isinstance(values, tuple)
            and len(keys) == 4 and len(values) == 4 and isinstance(backend, str)
            and type(scale) in (type(None), int, float, bool) and type(causal) is bool
            and type(num_splits) in (type(None), int, bool)
            and (config is None or isinstance(config, Int2KVConfig))
            and (mask is None or isinstance(mask, torch.Tensor)) and (dtype is None or isinstance(dtype, torch.dtype))):
        return None
    parts = (*keys, *values)
    if not all(isinstance(t, torch.Tensor) for t in parts) or not all(
            r is None or isinstance(r, torch.Tensor) for r in rotations):
        return None
    return (_meta(query), tuple(map(_meta, parts)), tuple(map(_meta, rotations)), config, type(scale), scale,
            type(causal), causal, _meta(mask), type(num_splits), num_splits, dtype, backend)



def _checked(query: torch.Tensor, keys: Int2KV | tuple, values: Int2KV | tuple, config: Int2KVConfig | None,
             k_rotation: torch.Tensor | None, v_rotation: torch.Tensor | None, q_rotation: torch.Tensor | None,
             o_rotation: torch.Tensor | None, scale: float | None, causal: bool, mask: torch.Tensor | None,
             num_splits: int | None, dtype: torch.dtype | None) -> tuple[tuple, tuple]:
    """The checks of :func:`decode_attention_int2` (:class:`KernelInputError` for what fails them); the keys and
    values as a backend takes them (a missing part as an empty tensor)."""
    if not isinstance(query, torch.Tensor) or query.dim() != 4 or query.dtype not in _FLOATS:
        got = f"{query.dtype} {list(query.shape)}" if isinstance(query, torch.Tensor) else type(query).__name__
        raise KernelInputError(f"query must be [B, Hq, S, d] of {_names(_FLOATS)}, got {got}")
    b, hq, s, d = query.shape
    if d not in layout.HEAD_DIMS:
        raise KernelInputError(f"query head_dim {d} is not one of {', '.join(map(str, layout.HEAD_DIMS))}")
    if s < 1 or b < 1 or hq < 1:
        raise KernelInputError(f"query must hold at least one sequence, head and token, got {list(query.shape)}")
    dev = query.device
    k = _side(keys, "keys", None, d, dev)
    h = k[0].shape[1]
    if h < 1:
        raise KernelInputError(f"keys must hold at least one KV head, got {list(k[0].shape)}")
    if (b, h) != tuple(k[0].shape[:2]) or hq % h:
        raise KernelInputError(f"keys hold {k[0].shape[0]} sequences of {h} KV heads; the query has {b} of {hq} "
                               f"heads (Hq must be a multiple of H_kv)")
    v = _side(values, "values", (b, h), d, dev)
    for i, label in enumerate(Int2KV._fields):
        if k[i].shape[2] != v[i].shape[2]:
            raise KernelInputError(f"keys.{label} holds {k[i].shape[2]} tokens but values.{label} {v[i].shape[2]}")
    windows = {t.dtype for t in (k[0], k[3], v[0], v[3]) if t.shape[2]}
    if len(windows) > 1:
        raise KernelInputError(f"the sink and recent rows of keys and values must share one dtype, got "
                               f"{_names(tuple(sorted(windows, key=str)))}")
    total = sum(k[i].shape[2] for i in (0, 1, 3))
    if total < 1:
        raise KernelInputError("the cache holds no token: nothing to attend to")
    if causal and s > total:
        raise KernelInputError(f"causal attention of {s} query tokens needs them in the cache; it holds {total}")
    if config is not None and not isinstance(config, Int2KVConfig):
        raise KernelInputError(f"config must be a rotationzoo.Int2KVConfig, got {type(config).__name__}")
    want_group = _config_group(config, d) if config is not None else None
    for name, side in (("keys", k), ("values", v)):
        if side[1].shape[2]:
            g = _groups(side[2], d, name)
            if want_group is not None and g != want_group:
                raise KernelInputError(f"{name}.scales_zeros holds groups of {g}, not the group size {want_group}")
            if config is not None and config.lloyd_max and g != d:
                raise KernelInputError(f"lloyd_max codes use one (scale, zero) per row: group size must be {d}, got {g}")
            if config is not None and side[2].dtype != TORCH_DTYPES[config.scale_dtype]:
                raise KernelInputError(f"{name}.scales_zeros dtype {side[2].dtype} disagrees with "
                                       f"config.scale_dtype={config.scale_dtype!r}")
        for t, label in ((side[0], "sink"), (side[3], "recent")):
            if config is not None and t.shape[2] and t.dtype != TORCH_DTYPES[config.hp_dtype]:
                raise KernelInputError(f"{name}.{label} dtype {t.dtype} disagrees with config.hp_dtype={config.hp_dtype!r}")
    if k_rotation is not None and q_rotation is not None:
        raise KernelInputError("give k_rotation or q_rotation (the matrix applied to the queries), not both")
    if v_rotation is not None and o_rotation is not None:
        raise KernelInputError("give v_rotation or o_rotation (the matrix applied to the output), not both")
    _rotation(q_rotation if q_rotation is not None else k_rotation,
              "q_rotation" if q_rotation is not None else "k_rotation", h, d, dev)
    _rotation(o_rotation if o_rotation is not None else v_rotation,
              "o_rotation" if o_rotation is not None else "v_rotation", h, d, dev)
    if scale is None:
        scale = d ** -0.5
    # compared, not converted: an int past float's range is refused too; NaN fails both comparisons
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not _MIN_SCALE <= scale <= _MAX_SCALE:
        raise KernelInputError(f"scale must be a positive number within float32's normal range (2^-126 to 2^127: "
                               f"the kernels scale in fp32), got {shown(scale)}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise KernelInputError(f"num_splits must be a positive integer or None, got {num_splits!r}")
    out_dtype = query.dtype if dtype is None else dtype
    if out_dtype not in _FLOATS:
        raise KernelInputError(f"dtype {out_dtype} is not supported; expected one of {_names(_FLOATS)}")
    if not isinstance(causal, bool):
        raise KernelInputError(f"causal must be true or false, got {causal!r}")
    if mask is not None:
        if (not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[0] not in (1, b)
                or mask.shape[1] not in (1, hq) or tuple(mask.shape[2:]) != (s, total)):
            got = f"{mask.dtype} {list(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise KernelInputError(f"mask must be booleans [{b} or 1, {hq} or 1, {s}, {total}], got {got}")
        if mask.dtype != torch.bool:
            raise KernelInputError(f"mask must be booleans (True = attend), got {mask.dtype}")
        if mask.device != dev:
            raise KernelInputError(f"mask is on {mask.device} but the query is on {dev}")
    return k, v


def decode_attention_int2(
    query: torch.Tensor,
    keys: Int2KV | tuple,
    values: Int2KV | tuple,
    *,
    config: Int2KVConfig | None = None,
    k_rotation: torch.Tensor | None = None,
    v_rotation: torch.Tensor | None = None,
    q_rotation: torch.Tensor | None = None,
    o_rotation: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = True,
    mask: torch.Tensor | None = None,
    num_splits: int | None = None,
    dtype: torch.dtype | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Attention of a few new query tokens over an INT2 KV cache, reading the codes directly.

    ``out = softmax(scale · q' · Kᵀ) · V · R_out`` over all ``P + N + R`` cached tokens of each KV
    head, where the keys/values are the sink and recent rows as stored and the INT2 rows as they
    dequantize (``(c − z)·s``), ``q' = q @ R_K`` (or ``q @ q_rotation``) and ``R_out = R_Vᵀ`` (or
    ``o_rotationᵀ``). Query head ``h`` reads KV head ``h // (Hq / H_kv)`` (GQA).

    Args:
        query: ``[B, Hq, S, d]`` new query tokens in the model's basis (bf16, fp16 or fp32), ``d`` in
            64, 128, 256; ``S`` small (a decode step, a few draft tokens); ``B``, ``Hq``, ``S`` at least 1
            (an empty query is refused by every backend).
        keys, values: the cache (:class:`Int2KV` or a ``(sink, codes, scales_zeros, recent)`` tuple),
            the new tokens already appended as the last recent rows.
        config: the INT2-KV settings the cache was written with (group size, Lloyd-Max, scale dtype
            and window dtype are checked against the tensors).
        k_rotation, v_rotation: ``R_K``, ``R_V``: ``[d, d]`` shared or ``[H_kv, d, d]`` per KV head, any floating
            dtype, applied in fp32 by every backend (a float64 matrix is rounded to fp32 first).
        q_rotation, o_rotation: explicit matrices for non-orthogonal transforms (same shapes), as a
            rotation file stores them (``R_K^{-T}``, ``R_V^{-T}``): queries are multiplied by
            ``q_rotation`` instead of ``R_K``, the output by ``o_rotationᵀ`` (``R_V^{-1}``) instead of
            ``R_Vᵀ``; for orthogonal matrices the two spellings agree. Give one of ``k_rotation``/``q_rotation``, one of
            ``v_rotation``/``o_rotation``.
        scale: softmax scale (default ``d ** -0.5``), from ``2^-126`` to ``2^127`` (fp32's normal range).
        causal: query token ``t`` of ``S`` sees keys up to position ``P + N + R − S + t`` (the new
            tokens among themselves causally); ``False``: every query sees every key.
        mask: ``None``, or booleans ``[B or 1, Hq or 1, S, L]`` (``True``: may attend; ``L = P + N + R``)
            applied on top of ``causal`` (padding, a sliding window), read by the kernels on the
            device: no host synchronisation. A query row that sees no key gets zeros.
        num_splits: how many ranges the INT2 tokens are cut into (default: the backend's plan,
            :mod:`rotationzoo.kernels.decode_plan`); the result does not depend on it beyond fp32
            rounding.
        dtype: output dtype (default the query's).
        backend: ``"auto"``: Triton for CUDA tensors; on CPU the C++ kernel
            (:mod:`rotationzoo.kernels.native`, built on first use and cached) where a compiler works,
            else the PyTorch reference. ``"torch"``: the PyTorch reference; ``"cpu"``: the C++ kernel
            (:class:`~rotationzoo.errors.BackendUnavailableError` where it cannot be built); ``"triton"``.

    Returns:
        ``[B, Hq, S, d]`` in ``dtype``, in the model's basis.

    Accuracy: fp32 scores, softmax and sums throughout (the backends differ only in summation order:
    ≤ 1e-5 relative for the C++ kernel and under the Triton interpreter; compiled, the Triton
    products run on tensor cores as two or three bf16 terms each, ≤ 1e-3 relative). Rows whose
    scale/zero are NaN (the kernels' flag for a non-finite input row) make the output NaN, as
    dequantize-then-attend would.

    Raises:
        KernelInputError: shapes, dtypes, devices or settings that do not fit together.
        BackendUnavailableError: ``backend="triton"`` cannot run here.
    """
    sig = _signature(query, keys, values, config, (k_rotation, v_rotation, q_rotation, o_rotation), scale, causal, mask,
                     num_splits, dtype, backend)
    if sig is not None and sig in _CHECKED:
        k, v = tuple(keys), tuple(values)
    else:
        k, v = _checked(query, keys, values, config, k_rotation, v_rotation, q_rotation, o_rotation, scale, causal,
                        mask, num_splits, dtype)
        if sig is not None:
            if len(_CHECKED) >= _CHECKED_MAX:
                _CHECKED.clear()
            _CHECKED.add(sig)
    rq = q_rotation if q_rotation is not None else k_rotation
    ro = o_rotation if o_rotation is not None else v_rotation
    if ro is not None:
        ro = ro.transpose(-1, -2)  # R_Vᵀ, or o_rotationᵀ = R_V^{-1}
    scale = query.shape[3] ** -0.5 if scale is None else float(scale)
    out_dtype = query.dtype if dtype is None else dtype
    out = decode_fn(pick_backend(backend, query.device))(query, *k, *v, rq, ro, mask, scale, causal, num_splits or 0)
    return out if out.dtype == out_dtype else out.to(out_dtype)


__all__ = ["Int2KV", "decode_attention_int2"]
