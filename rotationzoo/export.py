"""Export rotation pairs to one safetensors file or to GGUF (for the authors' llama.cpp branch).

Two layouts, both holding the K and the V side of a model in one file:

**safetensors** (this project's layout)::

    k.<layer>.rotation      fp32 [d, d]   R_K of model layer <layer>, applied as x_rot = x @ R
    k.<layer>.eigenvalues   fp32 [d]      optional (present when the source file had them)
    v.<layer>.rotation      fp32 [d, d]
    v.<layer>.eigenvalues   fp32 [d]
    metadata (strings): format="rotationzoo.rotations", export_format_version="1", model, tag,
        sides="k,v", head_dim, layer_ids="0,1,…", k.objective, k.format_version,
        k.source_grouping, k.sha256 (of the source file, when known), and the same for v.

**GGUF** (tensor names and orientation as the authors' llama.cpp branch reads them)::

    blk.<layer>.attn_k_rot.weight   F32, holds M_Kᵀ   so that ggml_mul_mat(rot, K) == K @ M_K
    blk.<layer>.attn_v_rot.weight   F32, holds M_Vᵀ

A GGUF tensor stored from a numpy array ``A [rows, cols]`` has ggml shape ``ne = [cols, rows]``;
``ggml_mul_mat(a, b)`` computes ``b @ aᵀ`` on row vectors, so storing ``A = Mᵀ`` yields
``K @ M``. Metadata keys (``rotationzoo.*``: model, tag, layer_ids, head_dim, per-side objective
and source sha256) are this project's choice; the branch ignores them. Eigenvalues are not
written to GGUF: llama.cpp rejects files with tensors the model graph does not use, and serving
does not need them. With ``base_gguf`` the rotation tensors are appended to a copy of a model
GGUF (every key and tensor of the base copied through unchanged, existing rotation tensors
replaced), which is the file the branch loads with ``-m``.

Example::

    from rotationzoo.export import export_gguf, export_safetensors, read_exported_gguf
    export_safetensors("Qwen3-8B", "qwen3-8b-oscar.safetensors")
    export_gguf("Qwen3-8B", "qwen3-8b-rot.gguf")
    export_gguf("Qwen3-8B", "qwen3-8b-q4_k_m-rot-kv.gguf", base_gguf="qwen3-8b-q4_k_m.gguf")
    back = read_exported_gguf("qwen3-8b-rot.gguf")      # back.k.rotations [36, 128, 128], M (not Mᵀ)
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Literal, Mapping, Union

from .errors import BackendUnavailableError, ExportError
from .registry import SIDES

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .api import RotationPair
    from .format import RotationSet

ExportFormat = Literal["safetensors", "gguf"]
EXPORT_FORMATS: tuple[str, ...] = ("safetensors", "gguf")
#: Version of the two export layouts described in the module docstring.
EXPORT_FORMAT_VERSION = 1
#: ``format`` metadata value of an exported safetensors file.
SAFETENSORS_FORMAT = "rotationzoo.rotations"
#: GGUF tensor name of one layer's rotation (authors' llama.cpp branch).
GGUF_TENSOR = "blk.{layer}.attn_{side}_rot.weight"
#: ``general.architecture`` of a rotations-only GGUF (this project's choice; not a model file).
GGUF_ARCH = "rotationzoo"
#: Prefix of the metadata keys this project writes into GGUF files.
GGUF_KEY_PREFIX = "rotationzoo."
#: Canonical file names of a published pair (first choice when a folder holds several files).
CANONICAL_NAMES = {
    "k": ("k_rotation_qqt_r_h_pbr", "k_rotation"),
    "v": ("v_rotation_sst_r_h_pbr", "v_rotation"),
}
_ROTATION_SUFFIXES = (".pt", ".pth", ".safetensors")


@dataclass
class ExportedRotations:
    """The K and/or V rotations of one model, as exported or read back from an export.

    Attributes:
        sets: ``{"k": RotationSet, "v": RotationSet}`` (one side may be absent); each holds
            ``rotations [L, d, d]`` fp32 applied as ``x_rot = x @ R`` (never transposed here).
        model: registry model id, when known.
        tag: calibration tag, when known.
        sha256: sha256 of the source rotation file per side, when known.
        metadata: the file's metadata as strings (empty before writing).
        path: the file read, if any.
    """

    sets: dict[str, "RotationSet"]
    model: str | None = None
    tag: str | None = None
    sha256: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    path: Path | None = None

    @property
    def k(self) -> "RotationSet | None":
        return self.sets.get("k")

    @property
    def v(self) -> "RotationSet | None":
        return self.sets.get("v")

    @property
    def sides(self) -> tuple[str, ...]:
        return tuple(s for s in SIDES if s in self.sets)

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.sets[self.sides[0]].layer_ids

    @property
    def head_dim(self) -> int:
        return self.sets[self.sides[0]].head_dim

    def __getitem__(self, side: str) -> "RotationSet":
        return self.sets[side]

    def __iter__(self) -> Iterator[tuple[str, "RotationSet"]]:
        return iter((s, self.sets[s]) for s in self.sides)


Source = Union[str, os.PathLike, "RotationPair", "RotationSet", ExportedRotations, Mapping[str, "RotationSet"]]


# -- resolving what to export ---------------------------------------------------------------------


def collect(
    source: Source,
    tag: str | None = None,
    *,
    side: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    offline: bool | None = None,
    validate: bool = True,
) -> ExportedRotations:
    """Resolve ``source`` into validated K/V rotation sets.

    Args:
        source: a :class:`~rotationzoo.api.RotationPair`; a ``{"k": RotationSet, "v": ...}``
            mapping; a single :class:`~rotationzoo.format.RotationSet` (with ``side``); a path to a
            folder holding a K/V pair (``k_rotation*.pt`` + ``v_rotation*.pt``), to one ``.pt`` or
            ``.safetensors`` rotation file, or to a file exported by this module; or a registry
            model id or alias (fetched and verified, from the cache when present).
        tag: calibration tag when ``source`` is a model id (default tag otherwise).
        side: ``"k"`` or ``"v"`` for a single rotation file or set whose side cannot be inferred
            from its name (``k_…``/``v_…``) or objective (``qqt…``/``sst…``).
        cache_dir, offline: as for :func:`rotationzoo.fetch` (model ids only).
        validate: check orthogonality (``max|RRᵀ−I| ≤ 1e-5``) and K/V agreement.

    Raises:
        ExportError: the path is neither a rotation file, a folder with a pair, nor a known model.
        InvalidRotationError: a matrix is not orthogonal, or K and V disagree on layers or ``d``.
        UnknownModelError, FetchError, OfflineError: as :func:`rotationzoo.load`.
    """
    from .format import RotationSet

    if side is not None and side not in SIDES:
        raise ExportError(f"side must be 'k' or 'v', got {side!r}")
    if isinstance(source, ExportedRotations):
        out = source
    elif isinstance(source, RotationSet):
        s = side or _infer_side(source.path, source.objective)
        if s is None:
            raise ExportError(
                f"{source.path or 'rotation set'}: cannot tell whether it is the K or the V side "
                f"(objective {source.objective!r}); pass side='k' or side='v'"
            )
        out = ExportedRotations({s: source})
    elif isinstance(source, Mapping):
        bad = [k for k in source if k not in SIDES]
        if bad or not source:
            raise ExportError(f"expected a mapping with keys 'k' and/or 'v', got keys {sorted(map(str, source))}")
        out = ExportedRotations({s: source[s] for s in SIDES if s in source})
    elif hasattr(source, "entry") and hasattr(source, "k") and hasattr(source, "v"):  # RotationPair
        pair = source
        out = ExportedRotations({"k": pair.k, "v": pair.v}, model=pair.entry.model_id, tag=pair.entry.name,
                                sha256=dict(getattr(pair, "sha256", {}) or {}))
    elif isinstance(source, (str, os.PathLike)):
        out = _collect_path_or_model(source, tag, side=side, cache_dir=cache_dir, offline=offline)
    else:
        raise ExportError(f"cannot export a {type(source).__name__}; give a path, a model id or a RotationPair")
    if validate:
        _validate(out)
    return out


def _collect_path_or_model(
    source: str | os.PathLike[str],
    tag: str | None,
    *,
    side: str | None,
    cache_dir: str | os.PathLike[str] | None,
    offline: bool | None,
) -> ExportedRotations:
    p = Path(source).expanduser()
    if p.is_dir():
        if tag is not None:
            raise ExportError(f"{p}: --tag applies to registry models, not to a folder")
        return _collect_dir(p)
    if p.is_file():
        if tag is not None:
            raise ExportError(f"{p}: --tag applies to registry models, not to a file")
        return _collect_file(p, side)
    from .errors import UnknownModelError
    from .registry import get_model

    try:
        get_model(str(source))
    except UnknownModelError as exc:
        text = str(source)
        if Path(text).suffix in (*_ROTATION_SUFFIXES, ".gguf") or text.startswith((".", "/", "~")) or text.count("/") > 1:
            raise ExportError(f"{source}: no such file or folder") from None
        raise ExportError(f"{source}: not a file, a folder or a registry model; {exc}") from None
    from .api import load

    pair = load(str(source), tag, cache_dir=cache_dir, offline=offline)
    return ExportedRotations({"k": pair.k, "v": pair.v}, model=pair.entry.model_id, tag=pair.entry.name,
                             sha256=dict(pair.sha256))


def _collect_dir(p: Path) -> ExportedRotations:
    from .format import read_rotation
    from .validation import sha256_file

    files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in _ROTATION_SUFFIXES)
    chosen: dict[str, Path] = {}
    for s in SIDES:
        cands = [f for f in files if f.name.startswith(f"{s}_rotation")]
        canonical = [f for name in CANONICAL_NAMES[s] for f in cands if f.stem == name]
        if canonical:
            chosen[s] = canonical[0]
        elif len(cands) == 1:
            chosen[s] = cands[0]
        elif len(cands) > 1:
            raise ExportError(
                f"{p}: several {s.upper()} rotation files ({', '.join(f.name for f in cands)}); "
                f"export one file at a time or keep one pair in the folder"
            )
    if not chosen:
        names = ", ".join(f.name for f in files[:8]) or "no .pt/.safetensors files"
        raise ExportError(f"{p}: no rotation pair found (expected k_rotation*.pt and v_rotation*.pt; found {names})")
    missing = [s for s in SIDES if s not in chosen]
    if missing:
        have = next(iter(chosen.values()))
        raise ExportError(
            f"{p}: found {have.name} but no {missing[0]}_rotation*.pt; export the single file instead, "
            f"or add its partner"
        )
    return ExportedRotations({s: read_rotation(chosen[s]) for s in SIDES},
                             sha256={s: sha256_file(chosen[s]) for s in SIDES})


def _collect_file(p: Path, side: str | None) -> ExportedRotations:
    from .format import detect_kind, read_rotation
    from .validation import sha256_file

    if p.suffix == ".gguf" or _is_gguf(p):
        got = read_exported_gguf(p)
        return _pick_side(got, side)
    kind = detect_kind(p)
    if kind == "safetensors" and _is_exported_safetensors(p):
        return _pick_side(read_exported_safetensors(p), side)
    rs = read_rotation(p)
    s = side or _infer_side(p, rs.objective)
    if s is None:
        raise ExportError(
            f"{p}: cannot tell whether this is the K or the V rotation (name does not start with k_/v_, "
            f"objective {rs.objective!r}); pass --side k or --side v"
        )
    return ExportedRotations({s: rs}, sha256={s: sha256_file(p)})


def _pick_side(got: ExportedRotations, side: str | None) -> ExportedRotations:
    if side is None:
        return got
    if side not in got.sets:
        raise ExportError(f"{got.path}: has no {side.upper()} rotations (sides: {', '.join(got.sides)})")
    return ExportedRotations({side: got.sets[side]}, model=got.model, tag=got.tag,
                             sha256={k: v for k, v in got.sha256.items() if k == side}, path=got.path)


def _infer_side(path: Path | None, objective: str | None) -> str | None:
    if path is not None:
        name = Path(path).name.lower()
        for s in SIDES:
            if name.startswith((f"{s}_", f"{s}.", f"{s}-")):
                return s
    obj = (objective or "").lower()
    if obj.startswith(("qqt", "ktk")) or obj == "identity-k":
        return "k"
    if obj.startswith(("sst", "vtv")) or obj == "identity-v":
        return "v"
    return None


def _validate(ex: ExportedRotations) -> None:
    from .errors import InvalidRotationError
    from .validation import validate

    if not ex.sets:
        raise ExportError("nothing to export: no K or V rotations")
    for _, rs in ex:
        validate(rs)
    if "k" in ex.sets and "v" in ex.sets:
        k, v = ex.sets["k"], ex.sets["v"]
        if k.layer_ids != v.layer_ids or k.head_dim != v.head_dim:
            raise InvalidRotationError(
                f"K and V rotations disagree: K has {len(k.layer_ids)} layers × d {k.head_dim}, "
                f"V has {len(v.layer_ids)} layers × d {v.head_dim}"
            )


# -- safetensors ---------------------------------------------------------------------------------


def export_safetensors(
    source: Source,
    out: str | os.PathLike[str],
    *,
    tag: str | None = None,
    side: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    offline: bool | None = None,
) -> Path:
    """Write K and V rotations (and eigenvalues) into one safetensors file, atomically.

    Args:
        source: what to export; see :func:`collect` (path, model id, RotationPair, sets).
        out: destination file.
        tag, side, cache_dir, offline: see :func:`collect`.

    Returns:
        The path written. Tensors ``{k,v}.<layer>.rotation`` fp32 ``[d, d]`` and
        ``{k,v}.<layer>.eigenvalues`` fp32 ``[d]``; string metadata as in the module docstring.
    """
    import torch
    from safetensors.torch import save_file

    ex = collect(source, tag, side=side, cache_dir=cache_dir, offline=offline)
    tensors: dict[str, torch.Tensor] = {}
    for s, rs in ex:
        rot = rs.rotations.detach().to("cpu", torch.float32)
        for i, lid in enumerate(rs.layer_ids):
            tensors[f"{s}.{lid}.rotation"] = rot[i].contiguous().clone()
            if rs.eigenvalues is not None:
                tensors[f"{s}.{lid}.eigenvalues"] = rs.eigenvalues[i].detach().to("cpu", torch.float32).contiguous().clone()
    meta = _metadata(ex)
    p = Path(out).expanduser()
    with _atomic_path(p) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    return p


def _metadata(ex: ExportedRotations) -> dict[str, str]:
    from ._version import __version__

    meta = {
        "format": SAFETENSORS_FORMAT,
        "export_format_version": str(EXPORT_FORMAT_VERSION),
        "sides": ",".join(ex.sides),
        "head_dim": str(ex.head_dim),
        "layer_ids": ",".join(map(str, ex.layer_ids)),
        "rotationzoo_version": __version__,
    }
    if ex.model:
        meta["model"] = ex.model
    if ex.tag:
        meta["tag"] = ex.tag
    for s, rs in ex:
        meta[f"{s}.objective"] = str(rs.objective)
        meta[f"{s}.format_version"] = str(rs.format_version)
        meta[f"{s}.source_grouping"] = str(rs.source_grouping)
        if ex.sha256.get(s):
            meta[f"{s}.sha256"] = ex.sha256[s]
    return meta


def _is_exported_safetensors(p: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            keys = list(f.keys())
    except Exception:  # noqa: BLE001 - not readable as safetensors: not ours
        return False
    return meta.get("format") == SAFETENSORS_FORMAT or any(k.startswith(("k.", "v.")) for k in keys)


def read_exported_safetensors(path: str | os.PathLike[str]) -> ExportedRotations:
    """Read a file written by :func:`export_safetensors`.

    Returns:
        :class:`ExportedRotations` with fp32 ``rotations [L, d, d]`` per side (as written, not
        transposed), eigenvalues when present, and the file's metadata.

    Raises:
        ExportError: not such a file, or tensors are missing or misnamed.
    """
    from safetensors import SafetensorError, safe_open

    from .format import RotationSet

    p = Path(path)
    if not p.is_file():
        raise ExportError(f"{p}: no such file")
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise ExportError(f"{p}: cannot read safetensors ({exc})") from None
    layers: dict[str, dict[int, dict[str, Any]]] = {}
    for key, t in tensors.items():
        parts = key.split(".")
        if len(parts) != 3 or parts[0] not in SIDES or not parts[1].isdigit() or parts[2] not in ("rotation", "eigenvalues"):
            raise ExportError(
                f"{p}: unexpected tensor {key!r}; an exported file holds k.<layer>.rotation, "
                f"k.<layer>.eigenvalues, v.<layer>.rotation, v.<layer>.eigenvalues"
            )
        layers.setdefault(parts[0], {}).setdefault(int(parts[1]), {"layer_id": int(parts[1])})[parts[2]] = t
    if not layers:
        raise ExportError(f"{p}: no rotation tensors")
    sets = {}
    for s in SIDES:
        if s not in layers:
            continue
        for lid, entry in layers[s].items():
            if "rotation" not in entry:
                raise ExportError(f"{p}: {s}.{lid}.eigenvalues without {s}.{lid}.rotation")
        version: Any = meta.get(f"{s}.format_version", "1")
        if isinstance(version, str) and version.isdigit():
            version = int(version)
        obj = {"format_version": version, "objective": meta.get(f"{s}.objective", "unknown"),
               "source_grouping": meta.get(f"{s}.source_grouping", "layer"), "layers": layers[s]}
        sets[s] = RotationSet.from_dict(obj, path=p)
    sha = {s: meta[f"{s}.sha256"] for s in SIDES if f"{s}.sha256" in meta}
    return ExportedRotations(sets, model=meta.get("model"), tag=meta.get("tag"), sha256=sha, metadata=meta, path=p)


# -- GGUF ----------------------------------------------------------------------------------------


def _gguf():
    try:
        import gguf
    except ImportError:
        raise BackendUnavailableError(
            "GGUF export needs the 'gguf' package: pip install 'rotationzoo[gguf]'"
        ) from None
    return gguf


def _is_gguf(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def export_gguf(
    source: Source,
    out: str | os.PathLike[str],
    *,
    tag: str | None = None,
    side: str | None = None,
    base_gguf: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    offline: bool | None = None,
) -> Path:
    """Write rotations as GGUF tensors ``blk.{i}.attn_{k,v}_rot.weight`` holding ``Mᵀ`` (F32).

    Args:
        source: what to export; see :func:`collect`. ``{i}`` is the model layer id.
        out: destination file (written atomically).
        tag, side, cache_dir, offline: see :func:`collect`.
        base_gguf: a model GGUF to copy through: every key and tensor of it is kept byte for byte
            and the rotation tensors are appended (replacing any already there), giving the
            ``*-rot-kv.gguf`` the llama.cpp branch loads. Its ``{arch}.block_count`` must cover
            the layer ids and its head size must equal ``d``.

    Returns:
        The path written.
    """
    gguf = _gguf()
    import numpy as np

    ex = collect(source, tag, side=side, cache_dir=cache_dir, offline=offline)
    p = Path(out).expanduser()
    if base_gguf is not None and Path(base_gguf).expanduser().resolve() == p.resolve():
        raise ExportError(f"{p}: the output must differ from --base-gguf")
    rot_tensors: list[tuple[str, Any]] = []
    for s, rs in ex:
        rot = rs.rotations.detach().to("cpu").double()
        for i, lid in enumerate(rs.layer_ids):
            mt = np.ascontiguousarray(rot[i].numpy().T, dtype=np.float32)  # store Mᵀ
            rot_tensors.append((GGUF_TENSOR.format(layer=lid, side=s), mt))
    if base_gguf is None:
        with _atomic_path(p) as tmp:
            w = gguf.GGUFWriter(str(tmp), GGUF_ARCH)
            name = f"{ex.model}@{ex.tag} OSCAR rotations" if ex.model else "OSCAR rotations"
            w.add_name(name)
            _add_gguf_metadata(w, ex, gguf)
            for n, t in rot_tensors:
                w.add_tensor(n, t)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
        return p
    return _merge_into_base(Path(base_gguf).expanduser(), p, ex, rot_tensors, gguf)


def _add_gguf_metadata(w: Any, ex: ExportedRotations, gguf: Any) -> None:
    from ._version import __version__

    T = gguf.GGUFValueType
    pre = GGUF_KEY_PREFIX
    w.add_key_value(pre + "export_format_version", EXPORT_FORMAT_VERSION, T.UINT32)
    w.add_key_value(pre + "version", __version__, T.STRING)
    w.add_key_value(pre + "transposed", True, T.BOOL)  # tensors hold Mᵀ
    w.add_key_value(pre + "head_dim", ex.head_dim, T.UINT32)
    w.add_key_value(pre + "layer_ids", [int(i) for i in ex.layer_ids], T.ARRAY, sub_type=T.INT32)
    w.add_key_value(pre + "sides", ",".join(ex.sides), T.STRING)
    if ex.model:
        w.add_key_value(pre + "model", ex.model, T.STRING)
    if ex.tag:
        w.add_key_value(pre + "tag", ex.tag, T.STRING)
    for s, rs in ex:
        w.add_key_value(f"{pre}{s}.objective", str(rs.objective), T.STRING)
        w.add_key_value(f"{pre}{s}.format_version", str(rs.format_version), T.STRING)
        if ex.sha256.get(s):
            w.add_key_value(f"{pre}{s}.sha256", ex.sha256[s], T.STRING)


def _field(reader: Any, key: str) -> Any:
    f = reader.get_field(key)
    return f.contents() if f is not None else None


def _merge_into_base(base: Path, out: Path, ex: ExportedRotations, rot_tensors: list[tuple[str, Any]], gguf: Any) -> Path:
    if not base.is_file():
        raise ExportError(f"{base}: base GGUF not found")
    if not _is_gguf(base):
        raise ExportError(f"{base}: not a GGUF file (no GGUF magic)")
    try:
        reader = gguf.GGUFReader(str(base), "r")
    except Exception as exc:  # noqa: BLE001 - gguf raises ValueError/struct errors on damage
        raise ExportError(f"{base}: cannot read GGUF ({type(exc).__name__}: {exc})") from None
    arch = _field(reader, gguf.Keys.General.ARCHITECTURE)
    if not arch:
        raise ExportError(f"{base}: no general.architecture; not a model GGUF")
    blocks = _field(reader, gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch))
    if blocks is not None and max(ex.layer_ids) >= int(blocks):
        raise ExportError(
            f"{base}: the model has {blocks} blocks, but the rotations cover layers up to {max(ex.layer_ids)}; "
            f"these rotations belong to another model"
        )
    key_len = _field(reader, gguf.Keys.Attention.KEY_LENGTH.format(arch=arch))
    if key_len is None:
        emb = _field(reader, gguf.Keys.LLM.EMBEDDING_LENGTH.format(arch=arch))
        heads = _field(reader, gguf.Keys.Attention.HEAD_COUNT.format(arch=arch))
        if isinstance(heads, list):
            heads = heads[0] if heads else None
        key_len = emb // heads if emb and heads else None
    if key_len is not None and int(key_len) != ex.head_dim:
        raise ExportError(f"{base}: the model's head size is {key_len}, the rotations are {ex.head_dim}×{ex.head_dim}")
    new_names = {n for n, _ in rot_tensors}
    with _atomic_path(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), arch=arch, endianess=reader.endianess)
        alignment = _field(reader, gguf.Keys.General.ALIGNMENT)
        if alignment is not None:
            w.data_alignment = alignment
        for fld in reader.fields.values():
            if fld.name == gguf.Keys.General.ARCHITECTURE or fld.name.startswith("GGUF.") \
                    or fld.name.startswith(GGUF_KEY_PREFIX):
                continue
            vtype = fld.types[0]
            sub = fld.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(fld.name, fld.contents(), vtype, sub_type=sub)
        _add_gguf_metadata(w, ex, gguf)
        kept = [t for t in reader.tensors if t.name not in new_names and not _is_rot_tensor(t.name)]
        for t in kept:
            w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
        for n, arr in rot_tensors:
            w.add_tensor_info(n, arr.shape, arr.dtype, arr.nbytes)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in kept:
            w.write_tensor_data(t.data, tensor_endianess=reader.endianess)
        for _, arr in rot_tensors:
            w.write_tensor_data(arr)
        w.close()
    return out


def _is_rot_tensor(name: str) -> bool:
    return name.startswith("blk.") and (name.endswith(".attn_k_rot.weight") or name.endswith(".attn_v_rot.weight"))


def read_exported_gguf(path: str | os.PathLike[str]) -> ExportedRotations:
    """Read ``blk.{i}.attn_{k,v}_rot.weight`` tensors from a GGUF file and transpose them back.

    Works on rotations-only files, on model GGUFs with rotations appended, and on files written
    by other exporters with the same tensor names (objective then ``"unknown"``).

    Returns:
        :class:`ExportedRotations` whose ``rotations [L, d, d]`` are ``M`` (the stored ``Mᵀ``
        transposed back), fp32, applied as ``x_rot = x @ M``; layer ids are the ``{i}`` of the
        tensor names.

    Raises:
        ExportError: not a GGUF file, no rotation tensors, or a tensor that is not a square F32/F16 matrix.
    """
    gguf = _gguf()
    import numpy as np
    import torch

    from .format import RotationSet

    p = Path(path)
    if not p.is_file():
        raise ExportError(f"{p}: no such file")
    if not _is_gguf(p):
        raise ExportError(f"{p}: not a GGUF file (no GGUF magic)")
    try:
        reader = gguf.GGUFReader(str(p), "r")
    except Exception as exc:  # noqa: BLE001
        raise ExportError(f"{p}: cannot read GGUF ({type(exc).__name__}: {exc})") from None
    found: dict[str, dict[int, Any]] = {}
    for t in reader.tensors:
        if not _is_rot_tensor(t.name):
            continue
        s = "k" if t.name.endswith(".attn_k_rot.weight") else "v"
        lid_s = t.name.split(".")[1]
        if not lid_s.isdigit():
            raise ExportError(f"{p}: tensor {t.name!r} has no layer number")
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            raise ExportError(f"{p}: {t.name} is {t.tensor_type.name}; expected F32")
        arr = np.asarray(t.data)
        if arr.ndim != 2 or arr.shape[0] != arr.shape[1]:
            raise ExportError(f"{p}: {t.name} has shape {tuple(int(x) for x in t.shape)}; expected a square matrix")
        found.setdefault(s, {})[int(lid_s)] = arr.astype(np.float32).T.copy()  # stored Mᵀ -> M
    if not found:
        raise ExportError(f"{p}: no blk.<i>.attn_k_rot.weight / attn_v_rot.weight tensors")
    meta: dict[str, str] = {}
    for fld in reader.fields.values():
        if fld.name.startswith(GGUF_KEY_PREFIX) or fld.name in ("general.architecture", "general.name"):
            val = fld.contents()
            meta[fld.name] = ",".join(map(str, val)) if isinstance(val, list) else str(val)
    sets = {}
    for s in SIDES:
        if s not in found:
            continue
        ids = sorted(found[s])
        rot = torch.from_numpy(np.stack([found[s][i] for i in ids]))
        version: Any = meta.get(f"{GGUF_KEY_PREFIX}{s}.format_version", "1")
        if isinstance(version, str) and version.isdigit():
            version = int(version)
        sets[s] = RotationSet(rotations=rot, layer_ids=tuple(ids),
                              objective=meta.get(f"{GGUF_KEY_PREFIX}{s}.objective", "unknown"),
                              format_version=version, path=p)
    sha = {s: meta[f"{GGUF_KEY_PREFIX}{s}.sha256"] for s in SIDES if f"{GGUF_KEY_PREFIX}{s}.sha256" in meta}
    return ExportedRotations(sets, model=meta.get(GGUF_KEY_PREFIX + "model"), tag=meta.get(GGUF_KEY_PREFIX + "tag"),
                             sha256=sha, metadata=meta, path=p)


# -- dispatch ------------------------------------------------------------------------------------


def export(
    source: Source,
    out: str | os.PathLike[str],
    *,
    to: str,
    tag: str | None = None,
    side: str | None = None,
    base_gguf: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    offline: bool | None = None,
) -> Path:
    """Export to ``to`` = ``"safetensors"`` or ``"gguf"``; see :func:`export_safetensors`, :func:`export_gguf`."""
    if to == "safetensors":
        if base_gguf is not None:
            raise ExportError("base_gguf applies to GGUF exports only")
        return export_safetensors(source, out, tag=tag, side=side, cache_dir=cache_dir, offline=offline)
    if to == "gguf":
        return export_gguf(source, out, tag=tag, side=side, base_gguf=base_gguf, cache_dir=cache_dir, offline=offline)
    raise ExportError(f"unknown export format {to!r}; expected one of {', '.join(EXPORT_FORMATS)}")


def read_exported(path: str | os.PathLike[str]) -> ExportedRotations:
    """Read an exported file of either format (GGUF detected by its magic bytes)."""
    p = Path(path)
    if p.is_file() and _is_gguf(p):
        return read_exported_gguf(p)
    return read_exported_safetensors(p)


class _atomic_path:
    """Context manager yielding a temp path beside ``target``; renamed onto it on success."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __enter__(self) -> Path:
        if self.target.is_dir():
            raise ExportError(f"{self.target}: is a folder; give a file name")
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.tmpdir = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.", dir=self.target.parent))
        return self.tmpdir / self.target.name

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is None:
                os.replace(self.tmpdir / self.target.name, self.target)
        finally:
            shutil.rmtree(self.tmpdir, ignore_errors=True)


__all__ = [
    "EXPORT_FORMATS",
    "EXPORT_FORMAT_VERSION",
    "GGUF_TENSOR",
    "ExportError",
    "ExportedRotations",
    "collect",
    "export",
    "export_gguf",
    "export_safetensors",
    "read_exported",
    "read_exported_gguf",
    "read_exported_safetensors",
]
