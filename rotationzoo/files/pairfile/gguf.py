"""GGUF rotation tensors, named and oriented as the authors' llama.cpp branch reads them.

Layout::

    blk.<layer>.attn_k_rot.weight   F32, holds M_Kᵀ   so that ggml_mul_mat(rot, K) == K @ M_K
    blk.<layer>.attn_v_rot.weight   F32, holds M_Vᵀ

Each tensor has its layer's own size: the branch creates them as ``{n_embd_head_k(il),
n_embd_head_k(il)}`` (``src/models/gemma4.cpp``), so a ragged pair (Gemma-4: 256 on sliding-window
layers, 512 on full-attention ones) is written layer by layer, its ``rotationzoo.head_dim`` the
per-layer spec (``256,5:512,…``).

A GGUF tensor stored from a numpy array ``A [rows, cols]`` has ggml shape ``ne = [cols, rows]``;
``ggml_mul_mat(a, b)`` computes ``b @ aᵀ`` on row vectors, so storing ``A = Mᵀ`` yields
``K @ M``. Metadata keys (``rotationzoo.*``: model, tag, layer_ids, head_dim, per-side objective
and source sha256) are this project's choice; the branch ignores them. Eigenvalues are not
written: llama.cpp rejects files with tensors the model graph does not use, and serving does not
need them. With ``base_gguf`` the rotation tensors are appended to a copy of a model GGUF (every
key and tensor of the base copied through unchanged, existing rotation tensors replaced), which is
the file the branch loads with ``-m``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from ..limits import MAX_LAYERS, TensorMeta, exc_line, safe_repr
from ..schema import make_limits, parse
from ..._version import __version__
from ...errors import ExportError, MissingDependencyError
from ..format import RotationSet
from ...headdims import HeadDims
from ...registry.model import SIDES
from ...safefile import check_regular, open_regular
from .gguf_header import scan_gguf_header
from .common import (
    EXPORT_FORMAT_VERSION,
    LAYER_ID,
    MAX_META_TEXT,
    Sets,
    atomic_path,
    check_metadata,
    parse_version,
    sides_of,
)

#: GGUF tensor name of one layer's rotation.
GGUF_TENSOR = "blk.{layer}.attn_{side}_rot.weight"
#: ``general.architecture`` of a rotations-only GGUF (this project's choice; not a model file).
GGUF_ARCH = "rotationzoo"
#: Prefix of the metadata keys this project writes into GGUF files.
GGUF_KEY_PREFIX = "rotationzoo."
#: Largest ``general.alignment`` of a base GGUF copied (each tensor is padded to it).
MAX_ALIGNMENT = 1 << 16


def gguf_module() -> Any:
    """The ``gguf`` package, or :class:`MissingDependencyError` naming the extra that installs it."""
    try:
        import gguf
    except ImportError:
        raise MissingDependencyError("gguf", "gguf", what="GGUF files") from None
    return gguf


def is_gguf(path: Path) -> bool:
    """True when ``path`` is a regular file starting with the GGUF magic bytes (a FIFO or a device
    is never opened: see :func:`~rotationzoo.safefile.open_regular`)."""
    try:
        with open_regular(path, what="GGUF file", error=ExportError) as f:
            return f.read(4) == b"GGUF"
    except (OSError, ExportError):
        return False


def is_rotation_tensor(name: str) -> bool:
    return name.startswith("blk.") and (name.endswith(".attn_k_rot.weight") or name.endswith(".attn_v_rot.weight"))


def check_gguf_exportable(sets: Sets, out: Path | str) -> None:
    """Refuse, in one line, what the llama.cpp branch cannot apply: it reads one orthogonal ``[d, d]``
    rotation per layer, nothing else (no head axis, no centering, no inverse companions).

    Raises:
        ExportError: naming the side and what it holds.
    """
    for s in sides_of(sets):
        rs, side = sets[s], s.upper()
        if rs.per_head:
            raise ExportError(f"{out}: {side} rotations are per KV head ([L, H_kv, d, d]); the llama.cpp GGUF "
                              f"layout holds one [d, d] rotation per layer; export to safetensors instead")
        if rs.centered:
            raise ExportError(f"{out}: {side} rotations are centered ({', '.join(f for f in rs.companions if f.endswith('_mean'))}); "
                              f"the llama.cpp branch does not subtract a mean; export to safetensors instead")
        if not rs.orthogonal or rs.q_rotation is not None or rs.o_rotation is not None:
            raise ExportError(f"{out}: {side} rotations are not orthogonal (they need q_rotation / o_rotation); the "
                              f"llama.cpp branch applies Rᵀ as the inverse; export to safetensors instead")


def _layers(rs: RotationSet) -> list[torch.Tensor]:
    """Each layer's ``[d, d]`` rotation (a ragged set holds one tensor per layer)."""
    rot = rs.rotations
    return list(rot) if isinstance(rot, tuple) else list(rot.unbind(0))


def _transposed_tensors(sets: Sets) -> list[tuple[str, Any]]:
    import numpy as np

    out = []
    for s in sides_of(sets):
        rs = sets[s]
        for lid, r in zip(rs.layer_ids, _layers(rs)):
            m = r.detach().to("cpu").double()
            out.append((GGUF_TENSOR.format(layer=lid, side=s), np.ascontiguousarray(m.numpy().T, dtype=np.float32)))
    return out


def _add_metadata(w: Any, sets: Sets, model: str | None, tag: str | None, sha256: Mapping[str, str], gguf: Any) -> None:
    T = gguf.GGUFValueType
    pre = GGUF_KEY_PREFIX
    first = sets[sides_of(sets)[0]]
    w.add_key_value(pre + "export_format_version", EXPORT_FORMAT_VERSION, T.UINT32)
    w.add_key_value(pre + "version", __version__, T.STRING)
    w.add_key_value(pre + "transposed", True, T.BOOL)  # tensors hold Mᵀ
    if first.ragged:  # the per-layer spec, as a safetensors pair file writes it
        w.add_key_value(pre + "head_dim", str(first.head_dims), T.STRING)
    else:
        w.add_key_value(pre + "head_dim", first.head_dim, T.UINT32)
    w.add_key_value(pre + "layer_ids", [int(i) for i in first.layer_ids], T.ARRAY, sub_type=T.INT32)
    w.add_key_value(pre + "sides", ",".join(sides_of(sets)), T.STRING)
    if model:
        w.add_key_value(pre + "model", model, T.STRING)
    if tag:
        w.add_key_value(pre + "tag", tag, T.STRING)
    for s in sides_of(sets):
        w.add_key_value(f"{pre}{s}.objective", str(sets[s].objective), T.STRING)
        w.add_key_value(f"{pre}{s}.format_version", str(sets[s].format_version), T.STRING)
        if sha256.get(s):
            w.add_key_value(f"{pre}{s}.sha256", sha256[s], T.STRING)


def write_gguf(sets: Sets, out: Path, *, model: str | None = None, tag: str | None = None,
               sha256: Mapping[str, str] | None = None, base_gguf: Path | None = None) -> Path:
    """Write rotation tensors (``Mᵀ``, F32) to ``out`` atomically, alone or appended to ``base_gguf``.

    Raises:
        ExportError: the base is not a model GGUF, or its layers / head size do not fit the rotations.
        MissingDependencyError: the ``gguf`` package is not installed.
    """
    check_gguf_exportable(sets, out)
    gguf = gguf_module()
    sha = dict(sha256 or {})
    if base_gguf is not None and base_gguf.resolve() == out.resolve():
        raise ExportError(f"{out}: the output must differ from --base-gguf")
    tensors = _transposed_tensors(sets)
    if base_gguf is not None:
        return _merge_into_base(base_gguf, out, sets, tensors, model, tag, sha, gguf)
    with atomic_path(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), GGUF_ARCH)
        w.add_name(f"{model}@{tag} OSCAR rotations" if model else "OSCAR rotations")
        _add_metadata(w, sets, model, tag, sha, gguf)
        for n, t in tensors:
            w.add_tensor(n, t)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return out


def _field(reader: Any, key: str, path: Path) -> Any:
    f = reader.get_field(key)
    return _contents(f, path) if f is not None else None


def _open_reader(path: Path, gguf: Any, what: str) -> Any:
    try:
        check_regular(path, what=what, error=ExportError)
    except OSError:
        raise ExportError(f"{path}: {what} not found") from None
    if not is_gguf(path):
        raise ExportError(f"{path}: not a GGUF file (no GGUF magic)")
    scan_gguf_header(path)  # bounded, before the reader builds an object for every key, item and tensor
    try:
        return gguf.GGUFReader(str(path), "r")
    except Exception as exc:  # noqa: BLE001 - gguf raises ValueError/struct errors on damage
        raise ExportError(f"{path}: cannot read GGUF ({type(exc).__name__}: {exc})") from None


def _int_field(reader: Any, key: str, path: Path) -> int | None:
    """An integer key of a model GGUF (the first of a per-layer array), or ``None`` when absent."""
    val = _field(reader, key, path)
    if isinstance(val, list):
        val = val[0] if val else None
    if val is not None and (type(val) is not int or val < 0):
        raise ExportError(f"{path}: GGUF key {key} is {safe_repr(val)}; expected a non-negative integer")
    return val


def _check_base(base: Path, reader: Any, sets: Sets, gguf: Any) -> str:
    """The base's architecture name, after checking it can hold these rotations."""
    first = sets[sides_of(sets)[0]]
    arch = _field(reader, gguf.Keys.General.ARCHITECTURE, base)
    if not arch or not isinstance(arch, str):
        raise ExportError(f"{base}: no general.architecture; not a model GGUF")
    blocks = _int_field(reader, gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch), base)
    if blocks is not None and max(first.layer_ids) >= blocks:
        raise ExportError(
            f"{base}: the model has {blocks} blocks, but the rotations cover layers up to {max(first.layer_ids)}; "
            f"these rotations belong to another model"
        )
    key_len = _int_field(reader, gguf.Keys.Attention.KEY_LENGTH.format(arch=arch), base)
    if key_len is None:
        emb = _int_field(reader, gguf.Keys.LLM.EMBEDDING_LENGTH.format(arch=arch), base)
        heads = _int_field(reader, gguf.Keys.Attention.HEAD_COUNT.format(arch=arch), base)
        key_len = emb // heads if emb and heads else None
    swa_len = _int_field(reader, gguf.Keys.Attention.KEY_LENGTH_SWA.format(arch=arch), base)
    sizes = {key_len, swa_len} - {None}
    dims = sorted({int(r.shape[-1]) for r in _layers(first)})
    if sizes and not set(dims) <= sizes:
        have = " and ".join(map(str, sorted(x for x in sizes if x is not None)))
        raise ExportError(f"{base}: the model's head size is {have}, the rotations are "
                          f"{' and '.join(f'{d}×{d}' for d in dims)}")
    return str(arch)


def _merge_into_base(base: Path, out: Path, sets: Sets, tensors: list[tuple[str, Any]], model: str | None,
                     tag: str | None, sha256: Mapping[str, str], gguf: Any) -> Path:
    reader = _open_reader(base, gguf, "base GGUF")
    arch = _check_base(base, reader, sets, gguf)
    new_names = {n for n, _ in tensors}
    with atomic_path(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), arch=arch, endianess=reader.endianess)
        alignment = _field(reader, gguf.Keys.General.ALIGNMENT, base)
        if alignment is not None:
            if type(alignment) is not int or not 1 <= alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
                raise ExportError(f"{base}: general.alignment is {safe_repr(alignment)}; expected a power of two "
                                  f"of at most {MAX_ALIGNMENT} (llama.cpp writes 32)")
            w.data_alignment = alignment
        for fld in reader.fields.values():
            if fld.name == gguf.Keys.General.ARCHITECTURE or fld.name.startswith("GGUF.") \
                    or fld.name.startswith(GGUF_KEY_PREFIX):
                continue
            vtype = fld.types[0]
            sub = fld.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(fld.name, _contents(fld, base), vtype, sub_type=sub)
        _add_metadata(w, sets, model, tag, sha256, gguf)
        kept = [t for t in reader.tensors if t.name not in new_names and not is_rotation_tensor(t.name)]
        for t in kept:
            w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
        for n, arr in tensors:
            w.add_tensor_info(n, arr.shape, arr.dtype, arr.nbytes)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in kept:
            w.write_tensor_data(t.data, tensor_endianess=reader.endianess)
        for _, arr in tensors:
            w.write_tensor_data(arr)
        w.close()
    return out


def _contents(fld: Any, path: Path) -> Any:
    try:
        return fld.contents()
    except Exception as exc:  # noqa: BLE001 - gguf decodes strings as UTF-8 on demand
        raise ExportError(f"{path}: cannot read GGUF key {safe_repr(fld.name)} ({type(exc).__name__}: "
                          f"{exc_line(exc)})") from None


def _metadata(reader: Any, path: Path, gguf: Any) -> dict[str, str]:
    """``rotationzoo.*`` keys (bounded before they are decoded), ``general.architecture`` and
    ``general.name`` as strings, plus the ``rotationzoo.`` keys without their prefix."""
    T = gguf.GGUFValueType
    meta: dict[str, str] = {}
    for fld in reader.fields.values():
        ours = fld.name.startswith(GGUF_KEY_PREFIX)
        if not ours and fld.name not in ("general.architecture", "general.name"):
            continue
        main = fld.types[0] if fld.types else None
        if main == T.ARRAY:
            bad = len(fld.data) > 2 * MAX_LAYERS or fld.types[-1] in (T.STRING, T.ARRAY)
            what = f"an array of {len(fld.data)} {fld.types[-1].name} values"
        else:
            bad = main == T.STRING and len(fld.parts[-1]) > MAX_META_TEXT
            what = f"a string of {len(fld.parts[-1])} bytes" if main == T.STRING else ""
        if bad and not ours:
            continue  # a model's own key we do not need
        if bad:
            raise ExportError(f"{path}: GGUF key {safe_repr(fld.name)} holds {what}; rotationzoo keys hold "
                              f"short strings, numbers and at most {2 * MAX_LAYERS} layer ids")
        val = _contents(fld, path)
        meta[fld.name] = ",".join(map(str, val)) if isinstance(val, list) else str(val)
    # the same keys as a safetensors pair file, so callers read one vocabulary
    plain = ("model", "tag", "export_format_version", "head_dim", "layer_ids", "sides") + tuple(
        f"{s}.{k}" for s in SIDES for k in ("objective", "format_version", "sha256"))
    for key in plain:
        if GGUF_KEY_PREFIX + key in meta:
            meta[key] = meta[GGUF_KEY_PREFIX + key]
    return meta


def read_gguf(path: Path) -> tuple[dict[str, RotationSet], dict[str, str]]:
    """Read ``blk.{i}.attn_{k,v}_rot.weight`` tensors and transpose them back to ``M`` (fp32).

    Works on rotations-only files, on model GGUFs with rotations appended, and on files written by
    other exporters with the same tensor names (objective then ``"unknown"``). Each side is
    bounded as a rotation file is (layers, ``d``, bytes), and the ``rotationzoo.*`` keys are
    checked against the tensors (:func:`~.common.check_metadata`), before any tensor is copied.

    Raises:
        ExportError: not a GGUF file, no rotation tensors, a tensor that is not a square F32/F16
            matrix, or metadata that is malformed or disagrees with the tensors.
        RotationFileError: a side beyond the limits of a rotation file.
    """
    gguf = gguf_module()
    import numpy as np

    reader = _open_reader(path, gguf, "file")
    found: dict[str, dict[int, Any]] = {}
    for t in reader.tensors:
        if not is_rotation_tensor(t.name):
            continue
        s = "k" if t.name.endswith(".attn_k_rot.weight") else "v"
        lid_s = t.name.split(".")[1]
        if not LAYER_ID.fullmatch(lid_s):
            raise ExportError(f"{path}: tensor {safe_repr(t.name)} has no plain layer number")
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            raise ExportError(f"{path}: {t.name} is {t.tensor_type.name}; expected F32")
        if t.data.ndim != 2 or t.data.shape[0] != t.data.shape[1]:
            raise ExportError(f"{path}: {t.name} has shape {tuple(int(x) for x in t.shape)}; expected a square matrix")
        if int(lid_s) in found.get(s, {}):
            raise ExportError(f"{path}: tensor {t.name} appears twice")
        found.setdefault(s, {})[int(lid_s)] = t.data  # a view of the mapped file: nothing read yet
        if len(found[s]) > MAX_LAYERS:
            raise ExportError(f"{path}: more than {MAX_LAYERS} {s.upper()} rotation tensors (max_layers={MAX_LAYERS})")
    if not found:
        raise ExportError(f"{path}: no blk.<i>.attn_k_rot.weight / attn_v_rot.weight tensors")
    meta = _metadata(reader, path, gguf)
    if meta.get(GGUF_KEY_PREFIX + "transposed", "True") != "True":
        raise ExportError(f"{path}: {GGUF_KEY_PREFIX}transposed is {safe_repr(meta[GGUF_KEY_PREFIX + 'transposed'])}; "
                          "this layout holds Mᵀ, as the llama.cpp branch reads it")
    limits = make_limits()
    layout: dict[str, tuple[tuple[int, ...], Any]] = {}
    described: dict[str, tuple[int | str, str]] = {}
    for s in sides_of(found):
        plan = {"format_version": parse_version(meta.get(f"{s}.format_version", "1")),
                "objective": meta.get(f"{s}.objective", "unknown"), "source_grouping": "layer",
                "layers": {i: {"layer_id": i, "rotation": TensorMeta(str(a.dtype), tuple(a.shape), (int(a.shape[1]), 1))}
                           for i, a in sorted(found[s].items())}}
        parsed = parse(plan, str(path), limits)  # layer count, d, bytes, version, objective
        ids = tuple(lid for lid, _ in parsed.layers)
        dims = HeadDims.of({lid: int(f["rotation"].shape[-1]) for lid, f in parsed.layers})
        assert dims is not None
        layout[s], described[s] = (ids, dims if not dims.uniform else dims.default), (parsed.version, parsed.objective)
    check_metadata(meta, layout, str(path))
    sets = {}
    for s, (ids, d) in layout.items():
        if isinstance(d, int):
            rot = np.empty((len(ids), d, d), dtype=np.float32)
            for n, i in enumerate(ids):
                rot[n] = found[s][i].T  # stored Mᵀ -> M, cast to fp32 in the one copy
            rotations: Any = torch.from_numpy(rot)
        else:  # layers of different sizes: one tensor per layer
            rotations = tuple(torch.from_numpy(np.ascontiguousarray(found[s][i].T, dtype=np.float32)) for i in ids)
        sets[s] = RotationSet(rotations=rotations, layer_ids=ids, objective=described[s][1],
                              format_version=described[s][0], path=path)
    return sets, meta
