"""What a rotation file may hold: format versions, size limits, and the structure checks.

The checks of the authors' dict (see :mod:`rotationzoo.files.format`) run twice on every file: first on
the :class:`~rotationzoo.files.limits.TensorMeta` records rebuilt from a ``.pt`` pickle or a
safetensors header (before anything is loaded), then on the tensors actually read. They are
written once here, for both. The safetensors header is checked in :mod:`rotationzoo.files.stheader`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .limits import (
    BIG_INT,
    MAX_BYTES,
    MAX_HEAD_DIM,
    MAX_KV_HEADS,
    MAX_LAYERS,
    FLOAT_DTYPES,
    STORAGE_TYPES,
    Limits,
    TensorMeta,
    parse_index,
    safe_repr,
)
from ..errors import RotationFileError, UnsupportedFormatError
from ..headdims import HeadDims
from .stheader import SAFETENSORS_DTYPES, inspect_safetensors  # noqa: F401  (re-exported)

#: Integer ``format_version`` values this release reads: 1 (one rotation per layer, optionally with a
#: ``calibration`` dict or per-layer head_dims), 2 (per KV head), 3 (the OSCAR-2 family: companions,
#: ``transform``). :func:`layout_version` says which one a set is written as.
FORMAT_VERSIONS = (1, 2, 3)
#: The newest integer ``format_version`` this release reads and writes.
FORMAT_VERSION = max(FORMAT_VERSIONS)
#: String format versions also understood (the authors' VL branch identity files).
STRING_FORMAT_VERSIONS = ("identity-v1",)

#: Oldest torch allowed to ``torch.load`` a file: ``weights_only=True`` can run code before 2.6
#: (CVE-2025-32434).
MIN_TORCH = (2, 6)

_MAX_TEXT = 1024  # objective, source_grouping, metadata strings
#: Bytes of each element type, by the names :class:`~rotationzoo.files.limits.TensorMeta` uses.
ITEMSIZE: dict[str, int] = {**dict(SAFETENSORS_DTYPES.values()), **dict(STORAGE_TYPES.values())}

#: Most bytes the orthogonality check of :func:`rotationzoo.validate` works in at a time: it measures
#: ``max|R Rᵀ − I|`` in fp64 on chunks of matrices (row blocks of one matrix when ``d`` is large).
VALIDATION_CHUNK_BYTES = 16 << 20
_MAX_META_KEYS = 64
_MAX_META_LIST = 64

#: The two kinds of set, decided by the shape of each layer's rotation (as the authors' server does):
#: ``[d, d]`` is one rotation per layer, ``[H_kv, d, d]`` one per (layer, KV head).
LAYER, KV_HEAD = "layer", "kv_head"
#: ``source_grouping`` labels of per-KV-head files: V2 writes ``per_kv_head``, V3 ``head``, and files of
#: earlier rotationzoo releases ``kv_head``.
KV_HEAD_LABELS = ("per_kv_head", "head", "kv_head")
#: ``source_grouping`` labels of files with one rotation per layer (``identity``: the VL branch's
#: ``identity-v1`` files).
LAYER_LABELS = ("layer", "identity")
#: Per-layer fields beside ``rotation`` and ``eigenvalues`` (V3 companions, plus ``v_mean``: value
#: centering, an extension the authors' engine does not read).
MATRIX_FIELDS = ("q_rotation", "o_rotation")
VECTOR_FIELDS = ("k_mean", "v_mean")
LAYER_FIELDS = ("rotation", "eigenvalues", *MATRIX_FIELDS, *VECTOR_FIELDS)
#: Tensors one layer may hold (the archive limits count them).
MAX_FIELDS_PER_LAYER = len(LAYER_FIELDS)
#: Top-level keys of the authors' dict. A key holding a tensor that is not one of these (or a layer's field not
#: in :data:`LAYER_FIELDS`) is refused: a tensor this release does not know may change what the rotations mean.
#: Other values are metadata and ignored, at the top level and in a layer alike (``layer_id``, notes).
TOP_KEYS = ("format_version", "objective", "source_grouping", "layers", "calibration", "transform")
#: Largest ``max|RRᵀ − I|`` of a rotation stored in 16 bits (validation's default tolerance; float16 / bfloat16
#: hold one no closer than about 1e-4 / 1e-3 unless its entries are exact in them, as a Hadamard's may be).
LOW_PRECISION_ATOL = 1e-5

_MOMENTS_KEYS = frozenset({"M_q", "k_sum", "M_k", "S_v"})
_ROWS_KEYS = frozenset({"q_samples", "positions"})


@dataclass
class Parsed:
    """A checked rotation dict: what :func:`parse` returns (tensors or :class:`TensorMeta` records).

    Attributes:
        version: ``format_version`` as written.
        kind: :data:`LAYER` or :data:`KV_HEAD`, from the rotations' shapes.
        label: ``source_grouping`` as written.
        layers: ``[(layer_id, {field: tensor})]`` sorted by id (fields of :data:`LAYER_FIELDS`).
        calibration, transform: the top-level metadata dicts, or ``None``.
        coarse: layer id → why its orthogonal rotation, stored in 16 bits, is not orthogonal (:func:`precision_problem`).
    """

    version: int | str
    kind: str
    label: str
    objective: str
    layers: list[tuple[int, dict[str, Any]]]
    calibration: dict[str, Any] | None = None
    transform: dict[str, Any] | None = None
    coarse: dict[int, str] = field(default_factory=dict)

    @property
    def fields(self) -> tuple[str, ...]:
        """The fields present (on every layer: a field on some layers only is refused)."""
        return tuple(f for f in LAYER_FIELDS if f in self.layers[0][1])

    @property
    def label_mismatch(self) -> str | None:
        """A one-line note when ``source_grouping`` disagrees with the shapes, else ``None``."""
        per_head_label = self.label in KV_HEAD_LABELS
        if (self.kind == KV_HEAD) == per_head_label and (per_head_label or self.label in LAYER_LABELS):
            return None
        shape = "[H_kv, d, d] (per KV head)" if self.kind == KV_HEAD else "[d, d] (one per layer)"
        return f"source_grouping {self.label!r} disagrees with the rotations' shape {shape}; the shape decides"


def parse(obj: Any, name: str, limits: Limits) -> Parsed:
    """Check a rotation dict's structure; works on tensors and on :class:`TensorMeta` records alike.

    Each layer holds a ``rotation``: ``[d, d]``, or ``[H_kv, d, d]`` for one rotation per KV head (every
    layer the same kind; ``d`` and ``H_kv`` may differ between layers); optionally ``eigenvalues``
    (``rotation.shape[:-1]``), ``q_rotation`` / ``o_rotation`` (the rotation's shape) and ``k_mean`` /
    ``v_mean`` (``[d]``, or ``[H_kv, d]`` for per-KV-head rotations). A field is on every layer or on none.
    Files that are something else the authors write (calibration moments or rows, MLA latent rotations)
    are refused with what they are.
    """
    if not isinstance(obj, Mapping):
        raise RotationFileError(f"{name}: expected a dict with 'format_version' and 'layers', got {type(obj).__name__}")
    if "layers" not in obj:
        _refuse_other_artefacts(obj, name)
        keys = ", ".join(safe_repr(k) for k in list(obj)[:8]) or "none"
        raise RotationFileError(f"{name}: no 'layers' entry (keys: {keys}); not a rotation file")
    stray = [k for k in obj if k not in TOP_KEYS and holds_tensor(obj[k])]
    if stray:
        raise RotationFileError(f"{name}: holds a tensor {safe_repr(stray[0])} beside 'layers', which this rotationzoo "
                                f"does not know (known: {', '.join(TOP_KEYS)}); refusing to load it without it")
    version = obj.get("format_version", 1)
    check_format_version(version, name)
    label = _text(obj, "source_grouping", LAYER, name)
    layers = obj["layers"]
    if not isinstance(layers, Mapping) or not layers:
        raise RotationFileError(f"{name}: 'layers' must be a non-empty dict of layer id -> entry")
    if len(layers) > limits.max_layers:
        raise RotationFileError(f"{name}: {len(layers)} layers, more than max_layers={limits.max_layers}{limits.note}")
    parsed: dict[int, dict[str, Any]] = {}
    for key, entry in layers.items():
        lid = _layer_key(key, entry, name)
        if lid in parsed:
            raise RotationFileError(f"{name}: layer {lid} appears twice (key {safe_repr(key)})")
        parsed[lid] = _layer_fields(entry, lid, name, limits)
    rows = sorted(parsed.items())
    kind = KV_HEAD if len(rows[0][1]["rotation"].shape) == 3 else LAYER
    _check_layers(rows, kind, name)
    _check_loaded_bytes(rows, kind, name, limits)
    transform = _meta(obj, "transform", name)
    return Parsed(version, kind, label, _text(obj, "objective", "unknown", name), rows,
                  _meta(obj, "calibration", name), transform, _coarse(rows, transform))


def holds_tensor(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is a tensor (or record) or a dict / list holding one (nesting past 16 levels counts)."""
    if _is_tensor(value) or depth > 16:
        return True
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
    return any(holds_tensor(v, depth + 1) for v in items)


def flat_layers(obj: Any) -> bool:
    """Whether a rotation dict (tensors or inspected records) keeps its layers as bare tensors, the flat variant
    ``{"layers": {i: tensor}}``: the authors' SGLang loaders index each layer's ``rotation`` and cannot read it."""
    layers = obj.get("layers") if isinstance(obj, Mapping) else None
    return isinstance(layers, Mapping) and any(_is_tensor(v) for v in layers.values())


def precision_problem(r: Any) -> str | None:
    """Why a rotation stored in float16 / bfloat16 is not orthogonal (naming the dtype), else ``None``."""
    if not isinstance(r, torch.Tensor) or r.dtype not in (torch.float16, torch.bfloat16):
        return None
    m = r.detach().to("cpu", torch.float64).reshape(-1, r.shape[-2], r.shape[-1])
    err = float((m @ m.transpose(-1, -2) - torch.eye(m.shape[-1], dtype=torch.float64)).abs().amax())
    if not err > LOW_PRECISION_ATOL:  # NaN passes: validation names non-finite values
        return None
    dtype = str(r.dtype).removeprefix("torch.")
    return (f"rotation is stored as {dtype}, too coarse to hold an orthogonal matrix (max|RRᵀ−I| = {err:.1e} > "
            f"{LOW_PRECISION_ATOL:.0e} in {dtype}); store rotations in float32 or float64")


def _coarse(rows: list[tuple[int, dict[str, Any]]], transform: Mapping[str, Any] | None) -> dict[int, str]:
    """:func:`precision_problem` of each orthogonal rotation (as :attr:`RotationSet.orthogonal` says: ``transform
    ["orthogonal"]`` when given, else unless the layer has companions), for validation's message to name."""
    said = (transform or {}).get("orthogonal")
    found = {lid: precision_problem(f["rotation"]) for lid, f in rows
             if (said if isinstance(said, bool) else not set(f) & set(MATRIX_FIELDS))}
    return {lid: problem for lid, problem in found.items() if problem}


def _refuse_other_artefacts(obj: Mapping, name: str) -> None:
    transform = obj.get("transform")
    if "rotation" in obj and (isinstance(transform, Mapping) and "latent" in transform or "mean" in obj):
        latent = safe_repr(transform.get("latent")) if isinstance(transform, Mapping) else "?"
        raise RotationFileError(f"{name}: an MLA latent rotation (one layer_<id>.pt of a latent-rotation folder, "
                                f"latent {latent}), not a K/V rotation file; check its folder with rotationzoo verify "
                                f"and load it with rotationzoo.load_latent")
    if {"codebooks_per_layer", "codebooks_stage1"} & set(obj):
        raise RotationFileError(f"{name}: a PQ codebook file (codebooks_per_layer), not a rotation file; it is served "
                                f"by the authors' tree through SGLANG_OSCAR_PQ_K_CODEBOOK / _V_CODEBOOK")


def _layer_fields(entry: Any, lid: int, name: str, limits: Limits) -> dict[str, Any]:
    if _is_tensor(entry):  # flat {layer: matrix} variant
        fields = {"rotation": entry}
    elif isinstance(entry, Mapping) and "rotation" in entry:
        fields = {}
        for key, value in entry.items():
            if key in LAYER_FIELDS:
                if value is not None:
                    fields[key] = value
            elif holds_tensor(value):  # a tensor we do not know may change what the rotation means
                raise RotationFileError(f"{name}: layer {lid} holds a tensor {safe_repr(key)} this rotationzoo does "
                                        f"not know (known: {', '.join(LAYER_FIELDS)}); refusing to load it without it")
    elif isinstance(entry, Mapping) and _MOMENTS_KEYS & set(entry):
        raise RotationFileError(f"{name}: a calibration moments file (oscar_moments_rank*.pt: M_q, k_sum, M_k, S_v "
                                f"per layer), not a rotation file; it holds statistics to fit rotations from")
    elif isinstance(entry, Mapping) and _ROWS_KEYS & set(entry) or isinstance(entry, Mapping) and {"k", "v"} <= set(entry):
        raise RotationFileError(f"{name}: a calibration rows file (oscar_rows_rank*.pt: sampled q/k/v rows per layer), "
                                f"not a rotation file")
    else:
        raise RotationFileError(f"{name}: layer {lid}: expected a dict with a 'rotation' tensor")
    if "rotation" not in fields:  # {"rotation": None, ...}
        raise RotationFileError(f"{name}: layer {lid}: 'rotation' is {safe_repr(entry.get('rotation'))}; expected a "
                                f"[d, d] or [H_kv, d, d] tensor")
    for key, t in fields.items():
        _check_tensor(t, key, lid, name, limits)
    return fields


def _check_layers(rows: list[tuple[int, dict[str, Any]]], kind: str, name: str) -> None:
    """Shapes within each layer, the same kind and the same fields on every layer."""
    present = set(rows[0][1])
    for lid, fields in rows:
        shape = tuple(fields["rotation"].shape)
        if len(shape) == 2 and shape[0] == shape[1]:
            this = LAYER
        elif len(shape) == 3 and shape[1] == shape[2]:
            this = KV_HEAD
        else:
            raise RotationFileError(f"{name}: layer {lid}: rotation must be [d, d], or [H_kv, d, d] per KV head; "
                                    f"got {list(shape)}")
        if this != kind:
            raise RotationFileError(f"{name}: layer {lid}: rotation {list(shape)} mixes per-KV-head and per-layer "
                                    f"rotations in one file")
    for lid, fields in rows:
        if set(fields) != present:
            odd = sorted(present ^ set(fields))[0]
            have = [i for i, f in rows if odd in f]
            raise RotationFileError(f"{name}: '{odd}' is on layers {_ids(have)} but not on every layer; a field is "
                                    f"on all layers or on none")
        shape = tuple(fields["rotation"].shape)
        for f, t in fields.items():
            got = tuple(t.shape)
            if f == "eigenvalues" and got != shape[:-1]:
                raise RotationFileError(f"{name}: layer {lid}: eigenvalues must have shape {list(shape[:-1])}, "
                                        f"got {list(got)}")
            if f in MATRIX_FIELDS and got != shape:
                raise RotationFileError(f"{name}: layer {lid}: {f} must have the rotation's shape {list(shape)}, "
                                        f"got {list(got)}")
            if f in VECTOR_FIELDS and got not in {shape[-1:], shape[:-1]}:
                want = f"[{shape[-1]}]" + (f" or {list(shape[:-1])}" if kind == KV_HEAD else "")
                raise RotationFileError(f"{name}: layer {lid}: {f} must be {want} (the rotation's head axis), "
                                        f"got {list(got)}")


def _ids(ids: list[int]) -> str:
    return ", ".join(map(str, ids[:8])) + (" ..." if len(ids) > 8 else "")


def validation_chunks(d: int, count: int) -> tuple[int, int]:
    """``(matrices per chunk, rows per block)`` of the fp64 orthogonality check of ``count`` ``[d, d]``
    matrices: whole matrices while 17·d² bytes each fit :data:`VALIDATION_CHUNK_BYTES`, else one
    matrix at a time in blocks of rows."""
    per = 17 * d * d  # an fp64 copy, its fp64 product and a bool finiteness mask
    if per <= VALIDATION_CHUNK_BYTES:
        return max(1, min(count, VALIDATION_CHUNK_BYTES // per)), d
    return 1, max(1, VALIDATION_CHUNK_BYTES // (25 * d))


def validation_work_bytes(d: int, count: int) -> int:
    """The most bytes :func:`rotationzoo.validate` allocates at once to check ``count`` ``[d, d]`` matrices."""
    n, b = validation_chunks(d, count)
    return n * 17 * d * d if b == d else 17 * b * d + 8 * b * b  # two fp64 row blocks, their product, a mask


def _numel(t: Any) -> int:
    n = 1
    for s in t.shape:
        n *= int(s)
    return n


def _stored_bytes(rows: list[tuple[int, dict[str, Any]]]) -> int:
    """Bytes the tensors of ``rows`` occupy as stored (each storage once), as records or as tensors."""
    seen: dict[Any, int] = {}
    for _, fields in rows:
        for t in fields.values():
            if isinstance(t, TensorMeta):
                key: Any = ("record", t.storage.key) if t.storage is not None else id(t)
                size = (t.storage.numel * t.storage.itemsize if t.storage is not None
                        else t.numel * ITEMSIZE.get(t.dtype, 8))
            else:
                try:
                    st = t.untyped_storage()
                    key, size = ("tensor", st.data_ptr(), t.device), int(st.nbytes())
                except Exception:  # a tensor kind without a plain storage
                    key, size = id(t), t.numel() * t.element_size()
            seen[key] = max(seen.get(key, 0), size)
    return sum(seen.values())


def memory_need(rows: list[tuple[int, dict[str, Any]]]) -> tuple[int, int, int]:
    """``(stored, loaded, validation)`` bytes of reading and validating ``rows``: the tensors as stored
    (what ``torch.load`` / safetensors materialise), as stacked in fp32 (layers that share one stored
    tensor count once per layer), and the fp64 working set of :func:`rotationzoo.validate` (for the
    largest ``d``, over every matrix: rotations and inverse companions)."""
    loaded = 4 * sum(_numel(t) for _, fields in rows for t in fields.values())
    d = max(int(fields["rotation"].shape[-1]) for _, fields in rows)
    count = sum(_numel(t) // (int(t.shape[-1]) ** 2) for _, fields in rows
                for f, t in fields.items() if f == "rotation" or f in MATRIX_FIELDS)
    return _stored_bytes(rows), loaded, validation_work_bytes(d, max(1, count))


def _check_loaded_bytes(rows: list[tuple[int, dict[str, Any]]], kind: str, name: str, limits: Limits) -> None:
    stored, loaded, work = memory_need(rows)
    cap = limits.max_bytes_kv_head if kind == KV_HEAD else limits.max_bytes
    if stored + loaded + work > cap:
        shape = tuple(rows[0][1]["rotation"].shape)
        what = f"{len(rows)} layers of {list(shape)}"
        raise RotationFileError(f"{name}: {what} need {stored + loaded + work} bytes to read and validate ({stored} "
                                f"stored, {loaded} loaded in fp32, {work} to validate), more than max_bytes={cap}"
                                f"{limits.note}")


def _is_tensor(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, TensorMeta))


def _layer_key(key: Any, entry: Any, name: str) -> int:
    lid = parse_index(key)
    if lid is None:
        raise RotationFileError(
            f"{name}: layer key {safe_repr(key)} is not an integer layer index (expected a non-negative int "
            "or its ASCII decimal string)"
        )
    if isinstance(entry, Mapping) and "layer_id" in entry and parse_index(entry["layer_id"]) != lid:
        raise RotationFileError(
            f"{name}: layer key {safe_repr(key)} disagrees with its layer_id {safe_repr(entry['layer_id'])}"
        )
    return lid


def _check_tensor(t: Any, what: str, lid: int, name: str, limits: Limits) -> None:
    if not _is_tensor(t):
        raise RotationFileError(f"{name}: layer {lid}: '{what}' is {type(t).__name__}, not a tensor")
    if isinstance(t, TensorMeta):
        floating, dtype = t.dtype in FLOAT_DTYPES, t.dtype
    else:
        if t.layout != torch.strided:
            raise RotationFileError(f"{name}: layer {lid}: '{what}' is a {t.layout} tensor; save dense tensors")
        floating, dtype = t.is_floating_point(), str(t.dtype)
    if not floating:
        raise RotationFileError(f"{name}: layer {lid}: {what} dtype {dtype} is not floating point")
    shape = tuple(t.shape)
    if not shape or len(shape) > 3 or min(shape) < 1:
        raise RotationFileError(f"{name}: layer {lid}: {what} has shape {shape}; expected [d, d] or [d] "
                                "(per KV head: [H, d, d] or [H, d]) with d >= 1")
    matrix = what == "rotation" or what in MATRIX_FIELDS
    if len(shape) == 3 or (not matrix and len(shape) == 2):
        if shape[0] > limits.max_kv_heads:
            raise RotationFileError(f"{name}: layer {lid}: {what} of shape {shape} has more than "
                                    f"max_kv_heads={limits.max_kv_heads} KV heads{limits.note}")
    if max(shape[-2:] if matrix else shape[-1:]) > limits.max_head_dim:
        raise RotationFileError(
            f"{name}: layer {lid}: {what} of shape {shape} exceeds max_head_dim={limits.max_head_dim}{limits.note}"
        )


def _text(obj: Mapping, key: str, default: str, name: str) -> str:
    value = obj.get(key, default)
    if not isinstance(value, str) or len(value) > _MAX_TEXT:
        raise RotationFileError(f"{name}: '{key}' must be a string of at most {_MAX_TEXT} characters, "
                                f"got {safe_repr(value)}")
    return value


def _scalar(v: Any) -> bool:
    if v is None or isinstance(v, (bool, float)):
        return True
    if type(v) is int:
        return abs(v) < BIG_INT
    return isinstance(v, str) and len(v) <= _MAX_TEXT


def _meta(obj: Mapping, key: str, name: str) -> dict[str, Any] | None:
    """A top-level metadata dict (``calibration``, ``transform``): string keys, scalar or short-list values."""
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, Mapping) or len(value) > _MAX_META_KEYS:
        raise RotationFileError(f"{name}: '{key}' must be a dict of at most {_MAX_META_KEYS} entries, got "
                                f"{safe_repr(value)}")
    out: dict[str, Any] = {}
    for k, v in value.items():
        if not isinstance(k, str) or len(k) > 128:
            raise RotationFileError(f"{name}: '{key}' has a key {safe_repr(k)} that is not a short string")
        if isinstance(v, (list, tuple)) and len(v) <= _MAX_META_LIST and all(_scalar(x) for x in v):
            out[k] = list(v)
        elif _scalar(v):
            out[k] = v
        else:
            raise RotationFileError(f"{name}: {key}[{k!r}] is {safe_repr(v)}; expected a number, a string, a bool, "
                                    f"None or a short list of them")
    if key == "transform" and "orthogonal" in out and not isinstance(out["orthogonal"], bool):
        raise RotationFileError(f"{name}: transform['orthogonal'] must be true or false, got {safe_repr(out['orthogonal'])}")
    return out


def check_format_version(version: Any, name: str) -> None:
    if isinstance(version, bool):
        raise UnsupportedFormatError(f"{name}: format_version {version!r} is not a version")
    if isinstance(version, int):
        if version > FORMAT_VERSION:
            raise UnsupportedFormatError(
                f"{name}: written by a newer format version ({safe_repr(version)}); this rotationzoo reads "
                f"{', '.join(map(str, FORMAT_VERSIONS))}; upgrade rotationzoo (pip install -U rotationzoo)"
            )
        if version not in FORMAT_VERSIONS:
            raise UnsupportedFormatError(f"{name}: format_version {safe_repr(version)} is not valid (expected "
                                         f"{', '.join(map(str, FORMAT_VERSIONS))})")
        return
    if isinstance(version, str) and version in STRING_FORMAT_VERSIONS:
        return
    raise UnsupportedFormatError(
        f"{name}: unknown format_version {safe_repr(version)}; expected {', '.join(map(str, FORMAT_VERSIONS))} or one "
        f"of {', '.join(STRING_FORMAT_VERSIONS)}"
    )


def layout_version(kind: str, fields: tuple[str, ...], transform: Mapping[str, Any] | None) -> int:
    """The ``format_version`` a set is written as, in the authors' layouts: 3 when it carries companions
    (``k_mean``, ``q_rotation``, ...) or a ``transform``; else 2 per KV head, 1 per layer."""
    if transform is not None or set(fields) & {*MATRIX_FIELDS, *VECTOR_FIELDS}:
        return 3
    return 2 if kind == KV_HEAD else 1


def layout_label(kind: str, version: int) -> str:
    """``source_grouping`` the authors write for that layout: ``layer``; ``per_kv_head`` (V2); ``head`` (V3)."""
    if kind != KV_HEAD:
        return LAYER
    return "per_kv_head" if version == 2 else "head"


def make_limits(max_head_dim: int = MAX_HEAD_DIM, max_layers: int = MAX_LAYERS, max_bytes: int = MAX_BYTES,
                *, head_dim: "int | HeadDims | None" = None, num_layers: int | None = None,
                num_kv_heads: int | None = None) -> Limits:
    """The :class:`~rotationzoo.files.limits.Limits` in force: the maxima, tightened by expectations.

    Per-layer files get ``min(max_bytes, max_layers·(d² + d)·16 + validation_work_bytes(d,
    max_layers))``: fp64 as stored plus fp32 as loaded plus room for a companion matrix and the
    vectors of each layer, plus validation's working set; per-KV-head files the same for
    ``max_layers·num_kv_heads`` matrices when ``num_kv_heads`` is known, else ``max_bytes``. With
    per-layer head_dims the largest applies.
    """
    note = ""
    dims = HeadDims.of(head_dim)
    if dims is not None:
        max_head_dim = min(max_head_dim, dims.max)
        note += f"; the model's head_dim is {dims}"
    if num_layers is not None:
        max_layers = min(max_layers, int(num_layers))
        note += f"; the model has {num_layers} layers"
    max_kv_heads, kv_bytes = MAX_KV_HEADS, max_bytes
    if num_kv_heads is not None:
        max_kv_heads = min(max_kv_heads, int(num_kv_heads))
        note += f"; the model has {num_kv_heads} KV heads"
    if min(max_head_dim, max_layers, max_bytes, max_kv_heads) < 1:
        raise RotationFileError(f"limits must be positive: max_head_dim={max_head_dim}, max_layers={max_layers}, "
                                f"max_bytes={max_bytes}, max_kv_heads={max_kv_heads}")

    def derived(count: int) -> int:  # `count` matrices of max_head_dim: stored + loaded + companions + validation
        return count * (max_head_dim * max_head_dim + max_head_dim) * 16 + validation_work_bytes(max_head_dim, count)

    if num_kv_heads is not None:
        kv_bytes = min(max_bytes, derived(max_layers * max_kv_heads))
    return Limits(max_head_dim=max_head_dim, max_layers=max_layers, max_bytes=min(max_bytes, derived(max_layers)),
                  note=note, max_kv_heads=max_kv_heads, max_bytes_kv_head=kv_bytes)
