"""The rotations and INT2-KV settings of the OSCAR path, and the row operations it applies.

Keys and values are stored rotated (``k @ R_K``, ``v @ R_V``), the window tokens rounded to
``hp_dtype`` and every other token clipped and INT2-quantized by :mod:`rotationzoo.kernels` with
the :class:`~rotationzoo.int2kv.Int2KVConfig` knobs (group size, clip ratios, scale dtype,
Lloyd-Max, clip search). Queries are rotated with ``R_K``; attention outputs are un-rotated with
``R_Vᵀ``. A rotation is ``[d, d]`` per layer, or ``[H_kv, d, d]`` per layer for per-KV-head sets.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ...errors import EvaluationError
from ...int2kv import Int2KVConfig
from ...kernels import dequantize_int2, fake_quantize_int2, quantize_int2

#: Attribute set on the key tensor an ``OscarInt2Cache`` layer returns (its layer object).
OSCAR_TAG = "_rotationzoo_oscar_layer"
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class OscarKV:
    """Rotations plus INT2-KV settings of the OSCAR path.

    Args:
        k_rotations: ``None`` (no rotation) or ``[L, d, d]`` / ``[L, H_kv, d, d]`` applied as
            ``k @ R_K`` (queries too: query head ``h`` uses its KV head's matrix).
        v_rotations: ``None`` or the same shapes for values; outputs are un-rotated with ``R_Vᵀ``.
        layer_ids: model layer index of each matrix (default ``0 … L−1``).
        config: the INT2-KV settings (:class:`~rotationzoo.int2kv.Int2KVConfig`).
        quantize_k: quantize keys (``False`` keeps them rotated in ``hp_dtype``).
        quantize_v: quantize values.
        backend: kernel backend, ``"auto"`` (Triton for CUDA tensors, the PyTorch reference
            otherwise), ``"torch"`` or ``"triton"``.

    Rotations are applied in fp32 (``x.float() @ R``) and the rotated rows rounded to ``hp_dtype``;
    INT2 tokens are quantized from those rounded rows, exactly as the SGLang fork demotes a BF16
    window token to INT2.
    """

    def __init__(
        self,
        k_rotations: torch.Tensor | None = None,
        v_rotations: torch.Tensor | None = None,
        *,
        layer_ids: Sequence[int] | None = None,
        config: Int2KVConfig | None = None,
        quantize_k: bool = True,
        quantize_v: bool = True,
        backend: str = "auto",
    ) -> None:
        sizes = {int(r.shape[0]) for r in (k_rotations, v_rotations) if r is not None}
        for name, r in (("k_rotations", k_rotations), ("v_rotations", v_rotations)):
            if r is not None and (r.dim() not in (3, 4) or r.shape[-1] != r.shape[-2]):
                raise EvaluationError(f"{name} must be [L, d, d] or [L, H_kv, d, d], got {list(r.shape)}")
        if len(sizes) > 1:
            raise EvaluationError(f"k_rotations and v_rotations hold different layer counts: {sorted(sizes)}")
        if layer_ids is not None:
            ids = tuple(int(i) for i in layer_ids)
            if sizes and len(ids) != next(iter(sizes)):
                raise EvaluationError(f"{len(ids)} layer ids for {next(iter(sizes))} rotations")
        else:
            ids = tuple(range(next(iter(sizes)))) if sizes else ()
        self.k_rotations = k_rotations.float() if k_rotations is not None else None
        self.v_rotations = v_rotations.float() if v_rotations is not None else None
        self.layer_ids = ids
        self._index = {lid: i for i, lid in enumerate(ids)}
        self.config = config if config is not None else Int2KVConfig()
        self.quantize_k = bool(quantize_k)
        self.quantize_v = bool(quantize_v)
        self.backend = backend
        self._device_cache: dict[tuple[str, int, str], torch.Tensor | None] = {}

    @classmethod
    def from_rotations(cls, rotations: Any, config: Int2KVConfig | None = None, **kwargs: Any) -> "OscarKV":
        """Build from ``None``, a :class:`~rotationzoo.pair.RotationPair` (or anything with ``.k``/``.v``
        rotation sets, e.g. a ``FitResult``), or a ``(k_set, v_set)`` tuple."""
        if rotations is None:
            return cls(None, None, config=config, **kwargs)
        if isinstance(rotations, tuple) and len(rotations) == 2:
            k, v = rotations
        else:
            k, v = getattr(rotations, "k", None), getattr(rotations, "v", None)
        ids = None
        for s in (k, v):
            if s is not None:
                if ids is not None and tuple(s.layer_ids) != ids:
                    raise EvaluationError("K and V rotation sets cover different layers")
                ids = tuple(s.layer_ids)
        return cls(k.rotations if k is not None else None, v.rotations if v is not None else None,
                   layer_ids=ids, config=config, **kwargs)

    def replace(self, **changes: Any) -> "OscarKV":
        """A copy with ``config`` knobs (``k_clip_ratio=…``) or ``quantize_k/quantize_v/backend``
        changed; the rotations are shared."""
        own = {k: changes.pop(k) for k in ("quantize_k", "quantize_v", "backend") if k in changes}
        return OscarKV(self.k_rotations, self.v_rotations, layer_ids=self.layer_ids or None,
                       config=self.config.replace(**changes),
                       quantize_k=own.get("quantize_k", self.quantize_k), quantize_v=own.get("quantize_v", self.quantize_v),
                       backend=own.get("backend", self.backend))

    def rotation(self, side: str, layer_id: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """Layer ``layer_id``'s fp32 rotation (``[d, d]`` or ``[H_kv, d, d]``) for ``side`` on
        ``device``, or ``None`` when this side is not rotated."""
        rots = self.k_rotations if side == "k" else self.v_rotations
        if rots is None:
            return None
        key = (side, int(layer_id), str(device))
        if key not in self._device_cache:
            if int(layer_id) not in self._index:
                raise EvaluationError(f"no {side.upper()} rotation for layer {layer_id}; "
                                      f"rotations cover layers {self.layer_ids}")
            self._device_cache[key] = rots[self._index[int(layer_id)]].to(device)
        return self._device_cache[key]

    @property
    def hp_dtype(self) -> torch.dtype:
        return DTYPES[self.config.hp_dtype]

    def describe(self) -> dict[str, Any]:
        """JSON-friendly settings."""
        return {
            **self.config.to_json(),
            "quantize_k": self.quantize_k,
            "quantize_v": self.quantize_v,
            "rotated": {"k": self.k_rotations is not None, "v": self.v_rotations is not None},
            "per_kv_head": any(r is not None and r.dim() == 4 for r in (self.k_rotations, self.v_rotations)),
        }


def _per_head(r: torch.Tensor, heads: int) -> torch.Tensor:
    """A ``[H_kv, d, d]`` rotation repeated for ``heads`` heads (GQA: query head h → KV head h // g)."""
    if r.shape[0] == heads:
        return r
    if heads % r.shape[0]:
        raise EvaluationError(f"{heads} heads cannot share {r.shape[0]} per-KV-head rotations")
    return r.repeat_interleave(heads // r.shape[0], dim=0)


def rotate(x: torch.Tensor, r: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``x @ R`` in fp32 for ``x [B, H, S, d]``, cast to ``out_dtype``; ``R = None`` only casts."""
    if r is None:
        return x.to(out_dtype)
    if r.dim() == 2:
        return torch.matmul(x.float(), r.float()).to(out_dtype)
    return torch.matmul(x.float(), _per_head(r.float(), x.shape[1])[None]).to(out_dtype)


def unrotate(x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    """``x @ Rᵀ`` in fp32 (``x [B, H, S, d]``), back in ``x``'s dtype."""
    if r is None:
        return x
    rt = r.float().transpose(-1, -2)
    if r.dim() == 2:
        return torch.matmul(x.float(), rt).to(x.dtype)
    return torch.matmul(x.float(), _per_head(rt, x.shape[1])[None]).to(x.dtype)


def quantize_rows(x: torch.Tensor, oscar: OscarKV, side: str, *, clip_search: str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """INT2 codes and scales/zeros of rotated rows ``x [..., d]`` with ``oscar``'s settings for ``side``
    (``clip_search`` overrides the config's, for rows a prefill demotes)."""
    cfg = oscar.config.replace(clip_search=clip_search)
    return quantize_int2(x.contiguous(), config=cfg, side=side, backend=oscar.backend)  # type: ignore[arg-type]


def dequantize_rows(codes: torch.Tensor, sz: torch.Tensor, oscar: OscarKV, dtype: torch.dtype) -> torch.Tensor:
    """Rows back from INT2 (still rotated), in ``dtype``."""
    out_dtype = dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    return dequantize_int2(codes, sz, dtype=out_dtype, config=oscar.config,
                           backend=oscar.backend).to(dtype)  # type: ignore[arg-type]


def fake_quantize(x: torch.Tensor, oscar: OscarKV, side: str, dtype: torch.dtype) -> torch.Tensor:
    """``dequantize(quantize(x))``: what an INT2 token reads back (the kernels' values, bit for bit)."""
    out_dtype = dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    return fake_quantize_int2(x.contiguous(), config=oscar.config, side=side, dtype=out_dtype,  # type: ignore[arg-type]
                              backend=oscar.backend).to(dtype)  # type: ignore[arg-type]
