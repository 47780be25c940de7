"""What is evaluated: the unquantized model, INT2 without rotation, Hadamard, or any rotation pair.

Rotations come from :func:`rotationzoo.files.pair.resolve_pair` (a folder, ``k.pt,v.pt``, an exported
file, ``MODEL[@TAG]``, a fit result). Every rotation method can be evaluated over sign draws:
``R·D`` with ``D`` a seeded random ±1 diagonal per layer (and KV head) and side, an equally valid
variant of the same rotation (the method's math does not change, its rounding does). A side learned
by refinement is the exception: it was fitted to the INT2 rounding of its own column signs, so
``R·D`` would evaluate another, unlearned rotation; sign draws leave it as given (the file served),
and a method learned on both sides is evaluated once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Sequence

import torch

from ..errors import EvaluationError
from ..fit.result import learned_objective
from ..hadamard import hadamard_matrix
from ..int2kv import Int2KVConfig
from ..integrations.transformers import ModelShape, OscarKV
from ..kvformat import KVFormat
from ..files.pair import RotationPair, resolve_pair

MethodKind = Literal["fp", "none", "hadamard", "rotations"]
#: Names with a built-in meaning in ``--methods``.
BUILTIN_METHODS: tuple[str, ...] = ("fp", "none", "hadamard")


@dataclass
class MethodSpec:
    """One KV treatment to evaluate.

    Attributes:
        name: short name in reports (``fp``, ``none``, ``hadamard``, ``oscar``, ``refined``, ...).
        kind: ``"fp"`` (the model unchanged), ``"none"`` (INT2 without rotation), ``"hadamard"``
            (the normalised Sylvester Hadamard ``H_d`` for K and V in every layer), or
            ``"rotations"`` (``pair``).
        pair: the rotations of a ``"rotations"`` method.
        source: where they came from, for the report.
        kv_format: the cache format it is evaluated in (``None``: the evaluation's INT2 settings).
        method: the rotation method's own name (``name`` is ``method@format`` in a formats grid).
    """

    name: str
    kind: MethodKind = "rotations"
    pair: RotationPair | None = None
    source: str | None = None
    objectives: dict[str, str] = field(default_factory=dict)
    kv_format: KVFormat | None = None
    method: str = ""

    def __post_init__(self) -> None:
        if not self.method:
            self.method = self.name

    def in_format(self, fmt: KVFormat, *, named: bool = True) -> "MethodSpec":
        """This method stored in ``fmt`` (named ``method@format`` unless ``named`` is false)."""
        return replace(self, kv_format=fmt, name=f"{self.method}@{fmt.name}" if named else self.method)

    @classmethod
    def fp(cls) -> "MethodSpec":
        return cls("fp", kind="fp")

    @classmethod
    def none(cls) -> "MethodSpec":
        return cls("none", kind="none")

    @classmethod
    def hadamard(cls) -> "MethodSpec":
        return cls("hadamard", kind="hadamard", objectives={"k": "hadamard", "v": "hadamard"})

    @classmethod
    def from_source(cls, name: str, rotations: Any, **fetch: Any) -> "MethodSpec":
        """Rotations from anything :func:`~rotationzoo.files.pair.resolve_pair` accepts (validated); ``fetch``:
        the fetch options of a registry id (``source``, ``revision``, ``cache_dir``, ``offline``, ``timeout``)."""
        pair = resolve_pair(rotations, **fetch)
        source = rotations
        missing = [s for s in ("k", "v") if s not in pair.sets]
        if missing:
            raise EvaluationError(f"{pair.source}: evaluation needs K and V rotations (missing {', '.join(missing)})")
        desc = pair.entry.key if pair.entry is not None else (str(source) if isinstance(source, (str, os.PathLike))
                                                                else pair.source)
        return cls(name, pair=pair, source=desc, objectives=pair.objectives)

    @property
    def rotated(self) -> bool:
        return self.kind in ("hadamard", "rotations")

    @property
    def learned_sides(self) -> tuple[str, ...]:
        """Sides whose rotations were learned by refinement: sign draws leave them as given."""
        return tuple(side for side in ("k", "v") if learned_objective(self.objectives.get(side)))

    @property
    def drawn(self) -> bool:
        """Whether sign draws change this method (a rotation with a side that was not learned)."""
        return self.rotated and len(self.learned_sides) < 2

    def check_fits(self, shape: ModelShape) -> None:
        """Refuse rotations or a format that do not fit the model (one line, before anything runs).

        Raises:
            EvaluationError: different head_dim, layers, or KV-head count of per-head rotations; a format that
                widens a layer the model does not cache or a KV head past the model's count.
        """
        fmt = self.kv_format
        if fmt is not None:
            outside = sorted((set(fmt.wide_layers) | {lid for lid, _ in fmt.wide_heads}) - set(shape.layer_ids))
            if outside:
                raise EvaluationError(f"format {fmt.name} widens layer(s) {_ids(tuple(outside))}, but the model "
                                      f"caches layers {_ids(shape.layer_ids)}")
            heads = [f"{lid}.{h}" for lid, h in fmt.wide_heads if h >= shape.num_kv_heads]
            if heads:
                raise EvaluationError(f"format {fmt.name} widens KV head(s) {', '.join(heads)}, but the model's "
                                      f"layers have {shape.num_kv_heads} KV heads (0 to {shape.num_kv_heads - 1})")
        if self.pair is None:
            return
        p = self.pair
        for side, rs in p:
            if rs.ragged:
                raise EvaluationError(f"method {self.name!r}: {side.upper()} layers differ in head_dim or KV heads "
                                      f"({rs.head_dims}); eval needs one shape per layer ({p.source})")
        if p.head_dim != shape.head_dim:
            raise EvaluationError(f"method {self.name!r}: rotations are {p.head_dim}×{p.head_dim}, "
                                  f"the model's head_dim is {shape.head_dim} ({p.source})")
        if tuple(p.layer_ids) != tuple(shape.layer_ids):
            raise EvaluationError(f"method {self.name!r}: rotations cover {len(p.layer_ids)} layers "
                                  f"({_ids(p.layer_ids)}), the model has {len(shape.layer_ids)} ({p.source})")
        for side, rs in p:
            if rs.per_head and rs.num_kv_heads != shape.num_kv_heads:
                raise EvaluationError(f"method {self.name!r}: per-KV-head {side.upper()} rotations for "
                                      f"{rs.num_kv_heads} heads, the model has {shape.num_kv_heads}")

    def format_of(self, config: Int2KVConfig) -> KVFormat:
        """The format this method is evaluated in: its own, else ``config``'s."""
        return self.kv_format if self.kv_format is not None else config.kv_format()

    def oscar(self, shape: ModelShape, config: Int2KVConfig, *, draw: int | None = None, seed: int = 0,
              backend: str = "auto") -> OscarKV | None:
        """The :class:`OscarKV` of this method (``None`` for ``fp``) in its format (:meth:`format_of`), with
        sign draw ``draw`` applied (``None``: as served)."""
        if self.kind == "fp":
            return None
        fmt = self.format_of(config)
        if self.kind == "none":
            return OscarKV(None, None, kv_format=fmt, backend=backend)
        if self.kind == "hadamard":
            h = hadamard_matrix(shape.head_dim, dtype=torch.float32).expand(len(shape.layer_ids), -1, -1)
            base = OscarKV(h.contiguous(), h.contiguous(), layer_ids=shape.layer_ids, kv_format=fmt, backend=backend)
        else:
            assert self.pair is not None
            base = OscarKV.from_rotations(self.pair, kv_format=fmt, backend=backend)
        if draw is None:
            return base
        # R·D is as valid as R; its inverse transpose is R^{-T}·D (D = D^{-1}), so companions flip alike;
        # a learned side stays as given
        learned = self.learned_sides
        flip = (lambda t, side: sign_flip(t, draw, seed, side) if t is not None and side not in learned else t)
        return OscarKV(flip(base.k_rotations, "k"), flip(base.v_rotations, "v"), layer_ids=base.layer_ids,
                       kv_format=fmt, backend=backend, k_mean=base.k_mean, v_mean=base.v_mean,
                       q_rotations=flip(base.q_rotations, "k"), o_rotations=flip(base.o_rotations, "v"))


def formats_grid(methods: Sequence[MethodSpec], formats: Sequence[KVFormat]) -> list[MethodSpec]:
    """Every method in every format (``fp`` once, unquantized), rows named ``method@format``; one format
    keeps the methods' own names."""
    if not formats:
        return list(methods)
    names = [f.name for f in formats]
    if len(set(names)) != len(names):
        raise EvaluationError(f"a format is listed twice: {', '.join(names)}")
    out: list[MethodSpec] = []
    for m in methods:
        if m.kind == "fp":
            out.append(m)
            continue
        out.extend(m.in_format(f, named=len(formats) > 1) for f in formats)
    return out


def _ids(ids: tuple[int, ...]) -> str:
    return ", ".join(map(str, ids[:6])) + (" ..." if len(ids) > 6 else "")


def sign_flip(rotations: torch.Tensor, draw: int, seed: int, side: str) -> torch.Tensor:
    """``R·D``: the columns of every matrix of ``rotations [..., d, d]`` multiplied by seeded ±1.

    The signs depend on ``(seed, draw, side)`` and the shape only, so draw ``k`` flips every
    per-layer method the same way; per-KV-head rotations ``[L, H_kv, d, d]`` get a sign vector per head.
    """
    g = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(draw) * 2 + (side == "v")) % (2**63))
    signs = torch.randint(0, 2, rotations.shape[:-2] + (1, rotations.shape[-1]), generator=g).float() * 2 - 1
    return rotations * signs.to(rotations.device, rotations.dtype)
