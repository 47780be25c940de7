"""The rotations and INT2-KV settings of the OSCAR path, and the row operations it applies.

Keys and values are stored rotated (``(k − μ_K) @ R_K``, ``(v − μ_V) @ R_V``), the window tokens
rounded to ``hp_dtype`` and every other token clipped and INT2-quantized by :mod:`rotationzoo.kernels`
with the :class:`~rotationzoo.int2kv.Int2KVConfig` knobs (group size, clip ratios, scale dtype,
Lloyd-Max, clip search). Queries are rotated with ``R_K`` (or the set's ``q_rotation`` = ``R_K^{-T}``
when the key transform is not orthogonal); attention outputs are un-rotated with ``R_Vᵀ`` (or
``o_rotationᵀ``) and ``μ_V`` is added back. A rotation is ``[d, d]`` per layer, or ``[H_kv, d, d]`` per
layer for per-KV-head sets; the means are ``[d]`` or ``[H_kv, d]``. Key centering is exact for
attention (softmax ignores a constant added to every score of a query), and so is value centering
(each query's weights sum to one).
"""

from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ...dtypes import TORCH_DTYPES
from ...errors import ConfigError, EvaluationError
from ...int2kv import Int2KVConfig, check_group_size
from ...kernels import dequantize_int2, fake_quantize_int2, quantize_int2
from ...kernels.formats import fake_quantize_format
from ...kvformat import KVFormat
from ...files.validation import DEFAULT_ATOL, DEFAULT_INVERSE_ATOL, inverse_errors, measure_matrices

#: Attribute set on the key tensor an ``OscarInt2Cache`` layer returns (its layer object).
OSCAR_TAG = "_rotationzoo_oscar_layer"
#: Prefix of the attention implementations registered for the OSCAR path.
OSCAR_IMPL_PREFIX = "rotationzoo_oscar"
#: The ``OscarSession`` of the ``oscar_kv`` block being run (``None`` outside one): the OSCAR attention
#: reads it, and the INT2 cache refuses to store keys outside one.
ACTIVE_SESSION: contextvars.ContextVar[Any] = contextvars.ContextVar("rotationzoo_active_oscar", default=None)


class OscarKV:
    """Rotations plus INT2-KV settings of the OSCAR path.

    Args:
        k_rotations: ``None`` (no rotation) or ``[L, d, d]`` / ``[L, H_kv, d, d]`` applied as
            ``k @ R_K`` (queries too: query head ``h`` uses its KV head's matrix).
        v_rotations: ``None`` or the same shapes for values; outputs are un-rotated with ``R_Vᵀ``.
        layer_ids: model layer index of each matrix (default ``0 … L−1``).
        config: the INT2-KV settings (:class:`~rotationzoo.int2kv.Int2KVConfig`).
        kv_format: instead of ``config``, any :class:`~rotationzoo.kvformat.KVFormat` (FP8, INT3/INT4,
            KIVI, …): evaluated by the decode-time simulation; the INT2 cache stores INT2 formats only.
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
        kv_format: KVFormat | None = None,
        quantize_k: bool = True,
        quantize_v: bool = True,
        backend: str = "auto",
        k_mean: torch.Tensor | None = None,
        v_mean: torch.Tensor | None = None,
        q_rotations: torch.Tensor | None = None,
        o_rotations: torch.Tensor | None = None,
    ) -> None:
        sizes = {int(r.shape[0]) for r in (k_rotations, v_rotations) if r is not None}
        for name, r in (("k_rotations", k_rotations), ("v_rotations", v_rotations)):
            if r is not None and (r.dim() not in (3, 4) or r.shape[-1] != r.shape[-2]):
                raise EvaluationError(f"{name} must be [L, d, d] or [L, H_kv, d, d], got {list(r.shape)}")
        for name, r, base in (("q_rotations", q_rotations, k_rotations), ("o_rotations", o_rotations, v_rotations)):
            if r is not None and (base is None or r.shape != base.shape):
                raise EvaluationError(f"{name} must have the rotations' shape "
                                      f"{list(base.shape) if base is not None else '(no rotations given)'}")
        for name, m in (("k_mean", k_mean), ("v_mean", v_mean)):
            if m is not None and (m.dim() not in (2, 3) or (sizes and m.shape[0] not in sizes)):
                raise EvaluationError(f"{name} must be [L, d] or [L, H_kv, d], got {list(m.shape)}")
        if len(sizes) > 1:
            raise EvaluationError(f"k_rotations and v_rotations hold different layer counts: {sorted(sizes)}")
        if layer_ids is not None:
            ids = tuple(int(i) for i in layer_ids)
            if sizes and len(ids) != next(iter(sizes)):
                raise EvaluationError(f"{len(ids)} layer ids for {next(iter(sizes))} rotations")
        else:
            ids = tuple(range(next(iter(sizes)))) if sizes else ()
        f32 = (lambda t: t.float() if t is not None else None)
        _check_numerics(("k", k_rotations, q_rotations, k_mean), ("v", v_rotations, o_rotations, v_mean), layer_ids=ids)
        self.k_rotations, self.v_rotations = f32(k_rotations), f32(v_rotations)
        self.q_rotations, self.o_rotations = f32(q_rotations), f32(o_rotations)
        self.k_mean, self.v_mean = f32(k_mean), f32(v_mean)
        self.layer_ids = ids
        self._index = {lid: i for i, lid in enumerate(ids)}
        if config is not None and kv_format is not None and config.kv_format() != kv_format:
            raise EvaluationError(f"give config or kv_format, not two different ones ({config.label()} vs {kv_format})")
        self.kv_format = kv_format if kv_format is not None else (config or Int2KVConfig()).kv_format()
        int2 = self.kv_format.code == "int2" and self.kv_format.axis == "token" and not self.kv_format.mixed
        #: the INT2 store (``None`` for other formats, which only the simulation evaluates)
        self.config: Int2KVConfig | None = config if config is not None else (
            Int2KVConfig.from_format(self.kv_format) if int2 else None)
        self.quantize_k = bool(quantize_k)
        self.quantize_v = bool(quantize_v)
        self.backend = backend
        self._device_cache: dict[tuple[str, int, str], torch.Tensor | None] = {}
        self._layer_views: dict[int | None, OscarKV] = {}

    @classmethod
    def from_rotations(cls, rotations: Any, config: Int2KVConfig | None = None, **kwargs: Any) -> "OscarKV":
        """Build from ``None``, a :class:`~rotationzoo.files.pair.RotationPair` (or anything with ``.k``/``.v``
        rotation sets, e.g. a ``FitResult``), or a ``(k_set, v_set)`` tuple; the sets' companions
        (``k_mean`` and ``q_rotation`` of K, ``o_rotation`` and ``v_mean`` of V) are applied."""
        if rotations is None:
            return cls(None, None, config=config, **kwargs)
        if isinstance(rotations, tuple) and len(rotations) == 2:
            k, v = rotations
        else:
            k, v = getattr(rotations, "k", None), getattr(rotations, "v", None)
        ids = None
        for side, s, wrong in (("K", k, ("o_rotation", "v_mean")), ("V", v, ("q_rotation", "k_mean"))):
            if s is None:
                continue
            if ids is not None and tuple(s.layer_ids) != ids:
                raise EvaluationError("K and V rotation sets cover different layers")
            ids = tuple(s.layer_ids)
            odd = [f for f in wrong if getattr(s, f, None) is not None]
            if odd:
                raise EvaluationError(f"the {side} rotation set carries {', '.join(odd)}, which belongs to the other "
                                      f"side; check which file is K and which is V")

        def stack(s: Any, name: str) -> torch.Tensor | None:
            if s is None or getattr(s, name, None) is None:
                return None
            return s.stacked(name, what="the OSCAR attention") if hasattr(s, "stacked") else getattr(s, name)

        return cls(stack(k, "rotations"), stack(v, "rotations"), layer_ids=ids, config=config,
                   k_mean=stack(k, "k_mean"), q_rotations=stack(k, "q_rotation"),
                   o_rotations=stack(v, "o_rotation"), v_mean=stack(v, "v_mean"), **kwargs)

    def replace(self, **changes: Any) -> "OscarKV":
        """A copy with format knobs (``k_clip_ratio=…``, ``recent_tokens=…``; ``kv_format=`` a whole format) or
        ``quantize_k/quantize_v/backend`` changed; the rotations are shared."""
        own = {k: changes.pop(k) for k in ("quantize_k", "quantize_v", "backend") if k in changes}
        fmt = changes.pop("kv_format", None) or self.kv_format
        return OscarKV(self.k_rotations, self.v_rotations, layer_ids=self.layer_ids or None,
                       kv_format=fmt.replace(**changes),
                       quantize_k=own.get("quantize_k", self.quantize_k), quantize_v=own.get("quantize_v", self.quantize_v),
                       backend=own.get("backend", self.backend), k_mean=self.k_mean, v_mean=self.v_mean,
                       q_rotations=self.q_rotations, o_rotations=self.o_rotations)

    def for_layer(self, layer_id: int) -> "OscarKV":
        """What layer ``layer_id`` stores: itself, or with mixed code widths a view in that layer's own
        single-width format (the rotations shared)."""
        return self._view(layer_id)

    def wide_view(self) -> "OscarKV":
        """A view in the format of widened layers and KV heads (``kv_format.wide_format()``), the rotations
        shared; itself without mixed code widths."""
        return self._view(None)

    def _view(self, layer_id: int | None) -> "OscarKV":
        if not self.kv_format.mixed:
            return self
        view = self._layer_views.get(layer_id)
        if view is None:
            fmt = self.kv_format
            view = self.replace(kv_format=fmt.wide_format() if layer_id is None else fmt.layer_format(layer_id))
            self._layer_views[layer_id] = view
        return view

    def _per_layer(self, name: str, table: torch.Tensor | None, layer_id: int,
                   device: torch.device | str) -> torch.Tensor | None:
        if table is None:
            return None
        key = (name, int(layer_id), str(device))
        if key not in self._device_cache:
            if int(layer_id) not in self._index:
                raise EvaluationError(f"no {name} for layer {layer_id}; rotations cover layers {self.layer_ids}")
            self._device_cache[key] = table[self._index[int(layer_id)]].to(device)
        return self._device_cache[key]

    def rotation(self, side: str, layer_id: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """Layer ``layer_id``'s fp32 rotation (``[d, d]`` or ``[H_kv, d, d]``) for ``side`` on
        ``device``, or ``None`` when this side is not rotated."""
        return self._per_layer(f"{side.upper()} rotation", self.k_rotations if side == "k" else self.v_rotations,
                               layer_id, device)

    def layer(self, layer_id: int, device: torch.device | str = "cpu") -> "LayerTransform":
        """Everything layer ``layer_id`` applies: rotations, query / output transforms, means."""
        return LayerTransform(
            layer_id=int(layer_id),
            r_k=self.rotation("k", layer_id, device), r_v=self.rotation("v", layer_id, device),
            q_rot=self._per_layer("q_rotation", self.q_rotations, layer_id, device),
            o_rot=self._per_layer("o_rotation", self.o_rotations, layer_id, device),
            k_mean=self._per_layer("k_mean", self.k_mean, layer_id, device),
            v_mean=self._per_layer("v_mean", self.v_mean, layer_id, device),
        )

    @property
    def hp_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.kv_format.hp_dtype]

    def describe(self) -> dict[str, Any]:
        """JSON-friendly settings."""
        return {
            **(self.config.to_json() if self.config is not None else {}),
            "format": self.kv_format.name,
            "quantize_k": self.quantize_k,
            "quantize_v": self.quantize_v,
            "rotated": {"k": self.k_rotations is not None, "v": self.v_rotations is not None},
            "per_kv_head": any(r is not None and r.dim() == 4 for r in (self.k_rotations, self.v_rotations)),
            "centered": {"k": self.k_mean is not None, "v": self.v_mean is not None},
            "inverse_companions": {"q_rotation": self.q_rotations is not None, "o_rotation": self.o_rotations is not None},
        }


@dataclass(frozen=True)
class LayerTransform:
    """What one layer applies (fp32 tensors on the layer's device; ``None`` = identity / no mean)."""

    r_k: torch.Tensor | None
    r_v: torch.Tensor | None
    q_rot: torch.Tensor | None = None
    o_rot: torch.Tensor | None = None
    k_mean: torch.Tensor | None = None
    v_mean: torch.Tensor | None = None
    layer_id: int | None = None

    def keys(self, k: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``(k − μ_K) @ R_K`` for ``k [B, H_kv, S, d]``.

        Raises:
            EvaluationError: the rotations or the mean do not fit the keys (head_dim, KV heads).
        """
        self._fits(k, "K", self.r_k, self.k_mean)
        return rotate(k, self.r_k, out_dtype, mean=self.k_mean)

    def values(self, v: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``(v − μ_V) @ R_V`` (raises :class:`EvaluationError` as :meth:`keys` does)."""
        self._fits(v, "V", self.r_v, self.v_mean)
        return rotate(v, self.r_v, out_dtype, mean=self.v_mean)

    def _fits(self, x: torch.Tensor, side: str, r: torch.Tensor | None, mean: torch.Tensor | None) -> None:
        """One line when ``x [B, H_kv, S, d]`` is not what this layer's rotation / mean were made for."""
        if x.dim() != 4:
            raise EvaluationError(f"the OSCAR path expects {side} as [batch, KV heads, tokens, head_dim], got "
                                  f"{list(x.shape)}")
        heads, d = int(x.shape[1]), int(x.shape[-1])
        where = f"layer {self.layer_id}" if self.layer_id is not None else "this layer"
        for what, t, vector in (("rotation", r, False), ("mean", mean, True)):
            if t is None:
                continue
            td = int(t.shape[-1])
            if td != d:
                raise EvaluationError(f"{where}: the {side} {what} is for head_dim {td}, the model's {side} has head_dim "
                                      f"{d}; use rotations made for this model")
            per_head = t.dim() == (2 if vector else 3)
            if per_head and int(t.shape[0]) != heads:
                raise EvaluationError(f"{where}: {int(t.shape[0])} per-KV-head {side} {what}s, the model has {heads} KV "
                                      f"heads; use rotations made for this model")

    @property
    def query_matrix(self) -> torch.Tensor | None:
        """What multiplies the queries: ``q_rotation`` (``R_K^{-T}``) when the set has one, else ``R_K``."""
        return self.q_rot if self.q_rot is not None else self.r_k

    @property
    def output_matrix(self) -> torch.Tensor | None:
        """``M`` with the output un-rotated as ``o @ Mᵀ``: ``o_rotation`` (``R_V^{-T}``) when the set has
        one, else ``R_V``."""
        return self.o_rot if self.o_rot is not None else self.r_v

    def queries(self, q: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``q @ Q`` with ``Q`` the :attr:`query_matrix`."""
        return rotate(q, self.query_matrix, out_dtype)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """The attention output ``o [B, H_q, S, d]`` back in the model's basis: ``o @ R_Vᵀ`` (or
        ``o @ o_rotationᵀ = o @ R_V^{-1}``), plus ``μ_V``."""
        return self.with_v_mean(unrotate(o, self.output_matrix))

    def with_v_mean(self, out: torch.Tensor) -> torch.Tensor:
        """``out [B, H_q, S, d]`` (model basis) plus ``μ_V`` (each query head its KV head's mean)."""
        if self.v_mean is None:
            return out
        mean = self.v_mean.float()
        if mean.dim() == 2:  # [H_kv, d] -> the query heads that read each KV head
            mean = _per_head(mean, out.shape[1])[:, None, :]
        return (out.float() + mean).to(out.dtype)


def _check_numerics(*sides: tuple[str, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
                    layer_ids: Sequence[int]) -> None:
    """The checks a rotation file gets (:mod:`rotationzoo.files.validation`), on tensors given directly: finite,
    orthogonal within ``DEFAULT_ATOL`` (or, with an inverse companion, ``max|QᵀR − I|`` within
    ``DEFAULT_INVERSE_ATOL``), finite means."""
    for side, r, inverse, mean in sides:
        if r is None:
            continue
        if not r.is_floating_point() or r.shape[-1] < 1:
            raise EvaluationError(f"{side}_rotations must be a non-empty floating point tensor, got {r.dtype} "
                                  f"{list(r.shape)}")
        nonfinite, errors = measure_matrices(r)
        mats = r.shape[:-2]
        for label, bad in (("non-finite values (NaN or inf)", nonfinite > 0),
                           (f"not orthogonal (max|RRᵀ−I| > {DEFAULT_ATOL:.0e})",
                            (errors > DEFAULT_ATOL) if inverse is None else torch.zeros(mats, dtype=torch.bool))):
            if bool(bad.any()):
                first = bad.nonzero()[0].tolist()
                lid = layer_ids[first[0]] if first[0] < len(layer_ids) else first[0]
                head = f", KV head {first[1]}" if len(first) > 1 else ""
                worst = f" = {float(errors[tuple(first)]):.3e}" if "orthogonal" in label else ""
                raise EvaluationError(f"{side}_rotations: layer {lid}{head}: {label}{worst}; {int(bad.sum())} of "
                                      f"{bad.numel()} matrices; give the rotations a file would hold "
                                      f"(rotationzoo verify checks one)")
        if inverse is not None:
            if not bool(torch.isfinite(inverse).all()):
                raise EvaluationError(f"the {side} inverse companion holds non-finite values (NaN or inf)")
            inv = float(inverse_errors(r, inverse).max())
            if not inv <= DEFAULT_INVERSE_ATOL:
                raise EvaluationError(f"the {side} inverse companion is not the rotation's inverse transpose: "
                                      f"max|QᵀR−I| = {inv:.3e} > {DEFAULT_INVERSE_ATOL:.0e}")
        if mean is not None and not bool(torch.isfinite(mean).all()):
            raise EvaluationError(f"{side}_mean holds non-finite values (NaN or inf)")


def _per_head(r: torch.Tensor, heads: int) -> torch.Tensor:
    """A ``[H_kv, d, d]`` rotation repeated for ``heads`` heads (GQA: query head h → KV head h // g)."""
    if r.shape[0] == heads:
        return r
    if heads % r.shape[0]:
        raise EvaluationError(f"{heads} heads cannot share {r.shape[0]} per-KV-head rotations")
    return r.repeat_interleave(heads // r.shape[0], dim=0)


def rotate(x: torch.Tensor, r: torch.Tensor | None, out_dtype: torch.dtype,
           mean: torch.Tensor | None = None) -> torch.Tensor:
    """``(x − mean) @ R`` in fp32 for ``x [B, H, S, d]``, cast to ``out_dtype``; ``R = None`` does not
    rotate; ``mean`` is ``[d]`` or ``[H, d]`` (one per head of ``x``)."""
    if mean is not None:
        m = mean.float()
        x = x.float() - (m[None, :, None, :] if m.dim() == 2 else m)
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


@functools.lru_cache(maxsize=64)
def _with_clip_search(config: Int2KVConfig, clip_search: str | None) -> Int2KVConfig:
    """``config`` with another ``clip_search`` (kept: a decode step quantizes two rows per layer)."""
    return config.replace(clip_search=clip_search)


def int2_store(oscar: OscarKV, layer: int | None = None, *dims: int) -> Int2KVConfig:
    """``oscar``'s INT2 store, or one line saying that its format is simulated only; with a ``layer`` and its
    keys' and values' ``dims``, one line naming the layer when the kernels cannot store rows of that head_dim
    (their head_dims and group rule)."""
    if oscar.config is None:
        why = " (one code width per cache)" if oscar.kv_format.mixed else ""
        raise EvaluationError(f"the INT2 cache stores INT2 rows{why}; {oscar.kv_format.name} is evaluated by the "
                              f"decode-time simulation only (a forward without the cache, as rotationzoo eval runs)")
    for what, dim in zip(("keys", "values"), dims):
        try:
            check_group_size(oscar.config.group_size, int(dim), lloyd_max=oscar.config.lloyd_max)
        except ConfigError as exc:
            raise EvaluationError(f"layer {layer}: the INT2 cache cannot store these {what}: {exc}") from None
    return oscar.config


def quantize_rows(x: torch.Tensor, oscar: OscarKV, side: str, *, clip_search: str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """INT2 codes and scales/zeros of rotated rows ``x [..., d]`` with ``oscar``'s settings for ``side``
    (``clip_search`` overrides the config's, for rows a prefill demotes)."""
    cfg = _with_clip_search(int2_store(oscar), clip_search)
    return quantize_int2(x.contiguous(), config=cfg, side=side, backend=oscar.backend)  # type: ignore[arg-type]


def dequantize_rows(codes: torch.Tensor, sz: torch.Tensor, oscar: OscarKV, dtype: torch.dtype) -> torch.Tensor:
    """Rows back from INT2 (still rotated), in ``dtype``."""
    out_dtype = dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    return dequantize_int2(codes, sz, dtype=out_dtype, config=int2_store(oscar),
                           backend=oscar.backend).to(dtype)  # type: ignore[arg-type]


def fake_quantize(x: torch.Tensor, oscar: OscarKV, side: str, dtype: torch.dtype) -> torch.Tensor:
    """``dequantize(quantize(x))`` in ``oscar``'s format: what a quantized token reads back (INT2 rows: the
    kernels' values, bit for bit; other formats: :func:`~rotationzoo.kernels.formats.fake_quantize_format`)."""
    out_dtype = dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    if oscar.config is None:
        return fake_quantize_format(x, oscar.kv_format, side, dtype=out_dtype, backend=oscar.backend).to(dtype)
    return fake_quantize_int2(x.contiguous(), config=oscar.config, side=side, dtype=out_dtype,  # type: ignore[arg-type]
                              backend=oscar.backend).to(dtype)  # type: ignore[arg-type]
