"""One side (K or V) of a model's rotations, with the companions the authors' current files carry.

A :class:`RotationSet` is what every rotation file becomes once read (:mod:`rotationzoo.files.format`), in
any of the authors' layouts (``docs/format.md``):

- **one rotation per layer**: ``rotations [L, d, d]`` (V1);
- **one per (layer, KV head)**: ``rotations [L, H_kv, d, d]`` (V2, or V3 with ``source_grouping
  "head"``); the kind is decided by the shape, as the authors' server does;
- **ragged**: layers with different ``d`` (Gemma-4-12B: 256 and 512) or different ``H_kv``; then
  ``rotations`` is a tuple with one tensor per layer;
- **companions** (V3): ``k_mean`` (``[L, d]`` or ``[L, H_kv, d]``, subtracted from every stored key
  before rotation), ``q_rotation`` (``= R^{-T}``, multiplies the queries when the key transform is
  not orthogonal), ``o_rotation`` (``= R_V^{-T}``, un-rotates the attention output), and ``v_mean``
  (value centering: stored values are ``v − μ_v`` and ``μ_v`` is added back to the output; a
  rotationzoo extension the authors' engine does not read);
- **metadata**: ``calibration`` (how the set was fitted: prompt sha256, tokens, model revision, …)
  and ``transform`` (``{"key": …, "centered": bool, "orthogonal": bool}``).
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterator, Sequence, Union

import torch

from .limits import MAX_BYTES, MAX_HEAD_DIM, MAX_LAYERS, Limits, exc_line, safe_repr
from .schema import (
    KV_HEAD,
    KV_HEAD_LABELS,
    LAYER,
    MATRIX_FIELDS,
    STRING_FORMAT_VERSIONS,
    VECTOR_FIELDS,
    layout_label,
    layout_version,
    make_limits,
    parse,
)
from ..errors import ConfigError, RotationFileError
from ..vocab import Grouping
from ..headdims import HeadDims
from ..sharding import kv_heads_per_rank

#: A per-layer field: one stacked tensor (``[L, ...]``), or one tensor per layer when layers differ.
Stack = Union[torch.Tensor, tuple[torch.Tensor, ...]]
#: Companion fields, in the order they are written.
COMPANIONS: tuple[str, ...] = (*MATRIX_FIELDS, *VECTOR_FIELDS)


def stack_layers(tensors: Sequence[torch.Tensor]) -> Stack:
    """One fp32 ``[L, ...]`` tensor when every layer has the same shape, else a tuple of fp32 tensors.

    Layers are copied one by one into the result (no per-layer fp32 intermediates: the loaded size is
    what the readers' ``max_bytes`` counts); layers that shared one storage become independent.
    """
    if len({tuple(t.shape) for t in tensors}) == 1:
        out = torch.empty((len(tensors), *tensors[0].shape), dtype=torch.float32, device=tensors[0].device)
        for i, t in enumerate(tensors):
            out[i].copy_(t.detach())
        return out
    return tuple(t.detach().to(torch.float32).contiguous() for t in tensors)


def _layer_count(x: Stack) -> int:
    return len(x) if isinstance(x, tuple) else int(x.shape[0])


@dataclass(eq=False)
class RotationSet:
    """One side (K or V) of a model's rotations.

    Attributes:
        rotations: ``[L, d, d]`` (one per layer) or ``[L, H_kv, d, d]`` (one per KV head), applied as
            ``x_rot = x @ R`` (head ``h`` of a per-KV-head layer by ``R[h]``); a tuple of per-layer
            tensors when layers differ in ``d`` or ``H_kv`` (:attr:`ragged`).
        layer_ids: model layer index of each entry, ascending (sparse for hybrid models).
        objective: ``"<target>_<composition>"`` such as ``"qqt_r_h_pbr"``, ``"hadamard"``,
            ``"cov_eig_hadamard_perhead"``, ``"oscar2_center"``.
        eigenvalues: ``rotations.shape[:-1]`` eigenvalues of the fitted covariance, or ``None``.
        format_version: as read (1, 2, 3 or ``"identity-v1"``); ``None`` for a new set.
            :attr:`layout_version` is the version it is written as.
        source_grouping: :data:`~rotationzoo.files.schema.LAYER` or :data:`~rotationzoo.files.schema.KV_HEAD`,
            always what the shapes say (``None`` or any per-KV-head label is accepted on construction).
        k_mean, v_mean, q_rotation, o_rotation: the companions (see the module docstring), or ``None``.
        calibration, transform: metadata dicts (scalars and short lists), or ``None``.
        path: the file it was read from, if any.
        coarse: layer id → why its rotation, stored in 16 bits in that file, cannot be orthogonal (read as fp32;
            validation names it beside "not orthogonal", so a tolerance loose enough still accepts it).
    """

    rotations: Stack
    layer_ids: tuple[int, ...]
    objective: str = "unknown"
    eigenvalues: Stack | None = None
    format_version: int | str | None = None
    source_grouping: str | None = None
    path: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    k_mean: Stack | None = None
    v_mean: Stack | None = None
    q_rotation: Stack | None = None
    o_rotation: Stack | None = None
    calibration: dict[str, Any] | None = None
    transform: dict[str, Any] | None = None
    coarse: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        name = self._name()
        if isinstance(self.rotations, list):
            self.rotations = tuple(self.rotations)
        if not isinstance(self.rotations, (torch.Tensor, tuple)) or (
                isinstance(self.rotations, tuple) and not all(isinstance(t, torch.Tensor) for t in self.rotations)):
            raise RotationFileError(f"{name}: rotations must be a tensor, got {type(self.rotations).__name__}")
        try:
            ids = tuple(self.layer_ids)
            if any(isinstance(i, bool) for i in ids):
                raise TypeError("bool")
            self.layer_ids = tuple(operator.index(i) for i in ids)
        except TypeError:
            raise RotationFileError(f"{name}: layer ids must be integers, got {safe_repr(self.layer_ids)}") from None
        if _layer_count(self.rotations) != len(self.layer_ids):
            raise RotationFileError(f"{name}: {_layer_count(self.rotations)} matrices but {len(self.layer_ids)} "
                                    f"layer ids")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise RotationFileError(f"{name}: duplicate layer ids {self.layer_ids}")
        per_layer = self._per_layer_shapes()
        kinds = {len(s) for s in per_layer}
        if kinds - {2, 3} or len(kinds) > 1 or any(s[-1] != s[-2] for s in per_layer):
            raise RotationFileError(f"{name}: rotations must be [L, d, d] or [L, H_kv, d, d] (per KV head), got "
                                    f"{self._shape_text()}")
        kind = KV_HEAD if kinds == {3} else LAYER
        label = self.source_grouping
        if label is not None and (label in KV_HEAD_LABELS) != (kind == KV_HEAD):
            raise RotationFileError(f"{name}: source_grouping {label!r} does not match the rotations' shape "
                                    f"{self._shape_text()}")
        self.source_grouping = kind
        for f in ("eigenvalues", *COMPANIONS):
            value = getattr(self, f)
            if isinstance(value, list):
                value = tuple(value)
                setattr(self, f, value)
            if value is not None and _layer_count(value) != len(self.layer_ids):
                raise RotationFileError(f"{name}: {f} has {_layer_count(value)} entries for {len(self.layer_ids)} "
                                        f"layers")

    def _name(self) -> str:
        return str(self.path) if self.path else "rotation set"

    def _per_layer_shapes(self) -> list[tuple[int, ...]]:
        if isinstance(self.rotations, tuple):
            return [tuple(t.shape) for t in self.rotations]
        return [tuple(self.rotations.shape[1:])] * int(self.rotations.shape[0]) if self.rotations.dim() else [()]

    def _shape_text(self) -> str:
        if isinstance(self.rotations, tuple):
            return "per layer " + ", ".join(str(list(t.shape)) for t in self.rotations[:4])
        return str(tuple(self.rotations.shape))

    # -- shape helpers ---------------------------------------------------------------------------
    @property
    def ragged(self) -> bool:
        """Whether layers differ in ``d`` or ``H_kv`` (then :attr:`rotations` is a tuple)."""
        return isinstance(self.rotations, tuple)

    @property
    def per_head(self) -> bool:
        """Whether this set holds one rotation per (layer, KV head)."""
        return self.source_grouping == KV_HEAD

    @property
    def head_dims(self) -> HeadDims:
        """``d`` of every layer.

        Raises:
            RotationFileError: a layer holds empty matrices.
        """
        shapes = self._per_layer_shapes()
        if not shapes or min(s[-1] for s in shapes) < 1:
            raise RotationFileError(f"{self._name()}: no layers, or empty matrices ({self._shape_text()})")
        return HeadDims.of({lid: int(s[-1]) for lid, s in zip(self.layer_ids, shapes)}) or HeadDims(1)

    @property
    def head_dim(self) -> int:
        """``d``, the size of each rotation (refused for a ragged set: see :attr:`head_dims`)."""
        dims = self.head_dims
        if not dims.uniform:
            raise RotationFileError(f"{self._name()}: layers have different head_dims ({dims}); this operation "
                                    f"needs one head_dim")
        return dims.default

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def num_kv_heads(self) -> int | None:
        """``H_kv`` of a per-KV-head set (the same on every layer); ``None`` for one rotation per layer."""
        if not self.per_head:
            return None
        heads = {s[0] for s in self._per_layer_shapes()}
        if len(heads) != 1:
            raise RotationFileError(f"{self._name()}: layers have different numbers of KV heads ({sorted(heads)}); "
                                    f"this operation needs one count")
        return int(next(iter(heads)))

    @property
    def companions(self) -> tuple[str, ...]:
        """The companion fields present (``k_mean``, ``q_rotation``, …)."""
        return tuple(f for f in COMPANIONS if getattr(self, f) is not None)

    @property
    def centered(self) -> bool:
        """Whether keys or values are centered (``k_mean`` / ``v_mean``)."""
        return self.k_mean is not None or self.v_mean is not None

    @property
    def orthogonal(self) -> bool:
        """Whether ``rotation`` is orthogonal: ``transform["orthogonal"]`` when the file says, else
        ``True`` unless a ``q_rotation`` / ``o_rotation`` says the transform needs its inverse."""
        said = (self.transform or {}).get("orthogonal")
        if isinstance(said, bool):
            return said
        return self.q_rotation is None and self.o_rotation is None

    @property
    def layout_version(self) -> int | str:
        """The ``format_version`` this set is written as: V1 per layer, V2 per KV head, V3 with companions
        or a ``transform`` (an ``identity-v1`` file stays one)."""
        if self.format_version in STRING_FORMAT_VERSIONS and not self.per_head and not self.companions:
            return self.format_version
        return layout_version(self.source_grouping or LAYER, self.companions, self.transform)

    def __len__(self) -> int:
        return len(self.layer_ids)

    def index_of(self, layer_id: int) -> int:
        """Position of ``layer_id`` in :attr:`rotations` (``KeyError`` if absent)."""
        try:
            return self.layer_ids.index(int(layer_id))
        except ValueError:
            raise KeyError(f"{self._name()} has no layer {layer_id}; layers: {_fmt_ids(self.layer_ids)}") from None

    def __getitem__(self, layer_id: int) -> torch.Tensor:
        """The ``[d, d]`` rotation of model layer ``layer_id`` (``[H_kv, d, d]`` per KV head)."""
        return self.rotations[self.index_of(layer_id)]

    def stacked(self, name: str = "rotations", *, what: str = "this operation") -> torch.Tensor:
        """``name`` (``"rotations"``, ``"eigenvalues"`` or a companion) as one ``[L, ...]`` tensor.

        Raises:
            RotationFileError: the set is ragged (layers differ in ``d`` or ``H_kv``), or the field is absent.
        """
        value = getattr(self, name)
        if value is None:
            raise RotationFileError(f"{self._name()}: has no {name}")
        if isinstance(value, tuple):
            raise RotationFileError(f"{self._name()}: layers differ in shape ({self._shape_text()}); {what} needs "
                                    f"the same head_dim and KV heads on every layer")
        return value

    def field(self, name: str, layer_id: int) -> torch.Tensor | None:
        """Layer ``layer_id``'s ``name`` (``"eigenvalues"`` or a companion), or ``None`` when absent."""
        value = getattr(self, name)
        return None if value is None else value[self.index_of(layer_id)]

    def layers(self) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """``(layer_id, {field: tensor})`` for every layer (``rotation``, ``eigenvalues``, companions)."""
        for i, lid in enumerate(self.layer_ids):
            out = {"rotation": self.rotations[i]}
            for f in ("eigenvalues", *COMPANIONS):
                value = getattr(self, f)
                if value is not None:
                    out[f] = value[i]
            yield lid, out

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "RotationSet":
        """A copy with every tensor moved (and rotation-like fields cast to ``dtype``); eigenvalues keep fp32."""
        def move(x: Stack | None, cast: bool) -> Stack | None:
            if x is None:
                return None
            if isinstance(x, tuple):
                return tuple(t.to(device=device, dtype=dtype if cast else None) for t in x)
            return x.to(device=device, dtype=dtype if cast else None)

        changes: dict[str, Any] = {"rotations": move(self.rotations, True), "eigenvalues": move(self.eigenvalues, False)}
        for f in COMPANIONS:
            changes[f] = move(getattr(self, f), True)
        return replace(self, **changes)

    def without(self, *names: str) -> "RotationSet":
        """A copy without the named companions or metadata (``"k_mean"``, ``"transform"``, …)."""
        allowed = {*COMPANIONS, "eigenvalues", "calibration", "transform"}
        unknown = set(names) - allowed
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)}; known: {sorted(allowed)}")
        changes: dict[str, Any] = {n: None for n in names}
        return replace(self, **changes)

    # -- conversions -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The authors' ``.pt`` dict in the layout this set needs (:attr:`layout_version`): int layer keys,
        fp32 contiguous tensors, ``source_grouping`` ``layer`` / ``per_kv_head`` (V2) / ``head`` (V3).

        Each layer gets its own storage (no views of the stacked tensor); identical matrices (e.g. a
        data-free Hadamard set) share one tensor, as the authors' writer does, which keeps such files small.
        A per-KV-head set is never written as one bare stacked tensor: each layer is a dict with its
        ``[H_kv, d, d]`` rotation.
        """
        layers: dict[int, dict[str, Any]] = {}
        seen: dict[str, list[torch.Tensor]] = {}
        for lid, entry in self.layers():
            out: dict[str, Any] = {"layer_id": lid}
            for f, t in entry.items():
                out[f] = _dedupe(t.detach().to("cpu", torch.float32).contiguous().clone(), seen.setdefault(f, []))
            layers[lid] = out
        version = self.layout_version
        head: dict[str, Any] = {
            "format_version": version,
            "objective": self.objective,
            "source_grouping": (layout_label(self.source_grouping or LAYER, version) if isinstance(version, int)
                                else "identity"),
        }
        if self.calibration is not None:
            head["calibration"] = dict(self.calibration)
        if self.transform is not None:
            head["transform"] = dict(self.transform)
        return {**head, "layers": layers}

    @classmethod
    def from_dict(cls, obj: Any, **kwargs: Any) -> "RotationSet":
        """Parse the authors' dict (any layout of ``docs/format.md``); typed errors on anything else.

        See :func:`set_from_dict` for the arguments.
        """
        return set_from_dict(obj, **kwargs)


def grouping_of(*sets: "RotationSet | None") -> Grouping:
    """A pair's grouping: ``"kv_head"`` when any of ``sets`` holds one rotation per KV head
    (``[L, H_kv, d, d]``), else ``"layer"`` (what a manifest's and a registry entry's ``grouping`` say)."""
    return "kv_head" if any(rs is not None and rs.per_head for rs in sets) else "layer"


def _dedupe(t: torch.Tensor, seen: list[torch.Tensor]) -> torch.Tensor:
    for s in seen:
        if s.shape == t.shape and torch.equal(s, t):
            return s
    seen.append(t)
    return t


def _fmt_ids(ids: tuple[int, ...]) -> str:
    return ", ".join(map(str, ids[:12])) + (" ..." if len(ids) > 12 else "")


#: The dataclass fields of :class:`RotationSet` that hold per-layer tensors.
TENSOR_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(RotationSet)
                                       if f.name in ("rotations", "eigenvalues", *COMPANIONS))


# -- the authors' dict ---------------------------------------------------------------------------


class RotationFormatWarning(UserWarning):
    """A rotation file is readable but labelled inconsistently (e.g. ``source_grouping`` vs the shapes)."""


def set_from_dict(obj: Any, *, path: Path | None = None, max_head_dim: int = MAX_HEAD_DIM,
                  max_layers: int = MAX_LAYERS, max_bytes: int = MAX_BYTES,
                  limits: Limits | None = None) -> RotationSet:
    """Parse the authors' dict (any layout of ``docs/format.md``); typed errors on anything else.

    Args:
        obj: the dict, as ``torch.load`` returns it.
        path: the file it came from (named in messages).
        max_head_dim: largest accepted ``d``.
        max_layers: most accepted layers.
        max_bytes: most bytes reading and validating may take: the tensors as given, as stacked in fp32,
            and validation's working set.
        limits: the :class:`~rotationzoo.files.limits.Limits` to apply instead of the three above.

    A ``source_grouping`` label that disagrees with the rotations' shape gives one
    :class:`RotationFormatWarning`; the shape decides, as in the authors' server.
    """
    name = str(path) if path else "rotation data"
    limits = limits or make_limits(max_head_dim, max_layers, max_bytes)
    parsed = parse(obj, name, limits)
    if parsed.label_mismatch:
        warnings.warn(f"{name}: {parsed.label_mismatch}", RotationFormatWarning, stacklevel=3)
    present = parsed.fields
    # stack copies: layers that shared one storage in the file become independent tensors
    try:
        stacks: dict[str, Any] = {f: stack_layers([fields[f] for _, fields in parsed.layers]) for f in present}
    except RuntimeError as exc:  # e.g. tensors on different devices in a dict built in memory
        raise RotationFileError(f"{name}: cannot stack the layers ({exc_line(exc)})") from None
    return RotationSet(
        rotations=stacks.pop("rotation"), layer_ids=tuple(lid for lid, _ in parsed.layers), objective=parsed.objective,
        format_version=parsed.version, source_grouping=parsed.kind, path=path,
        calibration=parsed.calibration, transform=parsed.transform, coarse=parsed.coarse, **stacks,
    )


# -- tensor parallelism ---------------------------------------------------------------------------


def shard_set(rs: RotationSet, tp_size: int, rank: int) -> RotationSet:
    """The part of ``rs`` that rank ``rank`` of ``tp_size`` loads: its KV heads of a per-KV-head set (with
    the companions' head axes, by the rule of :func:`rotationzoo.sharding.kv_heads_per_rank`), or ``rs``
    itself for one rotation per layer.

    Raises:
        ConfigError: a bad rank, heads that cannot be split (see :func:`~rotationzoo.sharding.kv_heads_per_rank`).
    """
    ranks = kv_heads_per_rank(rs.num_kv_heads or 1 if rs.per_head else 1, tp_size)  # checks tp_size first
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(ranks):
        raise ConfigError(f"rank must be an integer in [0, {len(ranks)}), got {rank!r}")
    if not rs.per_head:
        return rs
    heads = ranks[rank]
    lo, hi = heads[0], heads[-1] + 1
    changes: dict[str, Any] = {"rotations": rs.stacked(what="sharding")[:, lo:hi].contiguous()}
    for f in ("eigenvalues", *COMPANIONS):
        value = getattr(rs, f)
        if value is None:
            continue
        t = rs.stacked(f, what="sharding")
        changes[f] = t[:, lo:hi].contiguous() if t.dim() >= 3 else t  # [L, H, ...] sliced; [L, d] kept
    return replace(rs, **changes)
