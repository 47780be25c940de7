"""Other files the authors' tree reads beside rotations, recognised by kind.

- **PQ / RVQ codebooks** (``rotation/tools/train_pq_codebooks.py``: ``codebooks_per_layer``
  ``[L, n_sub, C, sub_dim]``, or ``codebooks_stage1`` / ``codebooks_stage2`` for RVQ, with
  ``layer_ids``, ``n_sub``, ``sub_dim``, the rotation they were trained against), served through
  ``SGLANG_OSCAR_PQ_K_CODEBOOK`` / ``_V_CODEBOOK``. They are bound to one rotation file and are not
  rotations: given where rotations are expected they are refused with one line naming what they are
  (:func:`identify_torch_file` reads only the archive's pickle opcodes, nothing is loaded).
- **K clip tables** (``SGLANG_OSCAR_K_CLIP_PER_LAYER``: a JSON object ``{global layer id: ratio}``, a
  JSON list in global layer order, or a comma list; ``SGLANG_OSCAR_K_CLIP_PER_HEAD``: a JSON object
  ``{"<layer>,<global KV head>": ratio}``): simple, so they are read and checked here
  (:func:`read_k_clip_per_layer`, :func:`read_k_clip_per_head`) against the model's layers and KV heads.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickletools
import re
import zipfile
from pathlib import Path
from typing import Any, Iterable

from ..errors import ConfigError
from ..safefile import open_regular, read_regular
from .archive import check_zip_directory
from .limits import MAX_BYTES, MAX_HEAD_DIM, MAX_LAYERS, Limits

#: Longest clip table read (a table has one number per layer or per layer and head).
MAX_TABLE_BYTES = 1 << 20
#: Most of a pickle scanned to identify a file.
MAX_SNIFF_BYTES = 4 << 20
#: The member bound an archive is identified under (a rotation file's largest; codebooks and moments hold fewer).
_SNIFF_LIMITS = Limits(max_head_dim=MAX_HEAD_DIM, max_layers=MAX_LAYERS, max_bytes=MAX_BYTES, what="file")
_KINDS = (
    (frozenset({"codebooks_per_layer", "codebooks_stage1"}),
     "a PQ codebook file (codebooks_per_layer / codebooks_stage1 per layer), not a rotation file; a codebook is "
     "bound to the rotation it was trained against and is served by the authors' tree through "
     "SGLANG_OSCAR_PQ_K_CODEBOOK / SGLANG_OSCAR_PQ_V_CODEBOOK with SGLANG_OSCAR_K_QUANTIZER=pq; rotationzoo does not "
     "serve PQ tiers"),
    (frozenset({"M_q", "k_sum", "S_v"}),
     "a calibration moments file (oscar_moments_rank*.pt: M_q, k_sum, M_k, S_v per layer), not a rotation file"),
    (frozenset({"c_kv", "k_pe"}),
     "a latent calibration dump (c_kv / k_pe rows), not a rotation file"),
)
_LAYER_KEY = re.compile(r"^(0|[1-9][0-9]{0,5})$")
_HEAD_KEY = re.compile(r"^\s*(0|[1-9][0-9]{0,5})\s*,\s*(0|[1-9][0-9]{0,3})\s*$")


def _pickle_strings(data: bytes) -> set[str]:
    """The short strings a pickle pushes, read opcode by opcode (nothing is built or run)."""
    out: set[str] = set()
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(data)):
            if isinstance(arg, str) and len(arg) <= 64:
                out.add(arg)
            if len(out) > 100_000:
                break
    except Exception:  # a damaged pickle: what was read so far is all there is
        pass
    return out


def identify_torch_file(path: str | os.PathLike[str]) -> str | None:
    """What a ``torch.save`` archive is when it is a known non-rotation artefact (a sentence), else ``None``.

    Reads the archive directory (none whose end record declares more members than a rotation file may
    hold: :func:`~rotationzoo.files.archive.check_zip_directory`) and at most :data:`MAX_SNIFF_BYTES` of its
    ``data.pkl``; never raises.
    """
    try:
        with open_regular(path, what="file", error=ConfigError) as f:
            check_zip_directory(f, str(path), _SNIFF_LIMITS)
            with zipfile.ZipFile(f) as zf:
                pkl = next((i for i in zf.infolist() if i.filename.endswith("/data.pkl")), None)
                if pkl is None or pkl.file_size > MAX_SNIFF_BYTES or pkl.compress_type != zipfile.ZIP_STORED:
                    return None
                strings = _pickle_strings(zf.read(pkl))
    except Exception:
        return None
    for keys, what in _KINDS:
        if keys & strings:
            return what
    return None


def _ratio(value: Any, where: str, *, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ConfigError(f"{where}: {value!r} is not a clip ratio (a number from 0 to 1)")
    r = float(value)
    if not (0.0 < r <= 1.0 if low_open else 0.0 <= r <= 1.0):
        raise ConfigError(f"{where}: clip ratio {r:g} must be in {'(0, 1]' if low_open else '[0, 1]'}")
    return r


def _read_json(path: Path, what: str) -> Any:
    try:
        data = read_regular(path, MAX_TABLE_BYTES, what=what, error=ConfigError)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    try:
        return json.loads(data.decode("utf-8"), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ConfigError(f"{path}: a {what} must be JSON ({type(exc).__name__})") from None


def read_k_clip_per_layer(spec: str | os.PathLike[str], layer_ids: Iterable[int] | None = None) -> dict[int, float]:
    """A per-layer K clip table (``SGLANG_OSCAR_K_CLIP_PER_LAYER``): a JSON file holding an object keyed
    by global layer id or a list in global layer order, or a comma list in global layer order.

    Returns:
        ``{layer id: ratio}`` for the layers it names (list entries for every index).

    Raises:
        ConfigError: not such a table, a ratio outside [0, 1], a layer the model does not have, or a list
            too short for the model's layers.
    """
    ids = sorted(set(layer_ids)) if layer_ids is not None else None
    p = Path(os.fspath(spec)).expanduser()
    if p.is_file():
        data = _read_json(p, "per-layer K clip table")
        where = str(p)
    else:
        text = os.fspath(spec)
        if len(text) > MAX_TABLE_BYTES:
            raise ConfigError("a per-layer K clip list is longer than 1 MiB")
        data = [x.strip() for x in text.split(",") if x.strip()]
        try:
            data = [float(x) for x in data]
        except ValueError:
            raise ConfigError(f"{text[:60]!r} is neither a file nor a comma list of clip ratios") from None
        where = "the comma list"
    out: dict[int, float] = {}
    if isinstance(data, dict):
        for k, v in data.items():
            if not isinstance(k, str) or not _LAYER_KEY.match(k):
                raise ConfigError(f"{where}: key {k!r} is not a global layer id")
            out[int(k)] = _ratio(v, f"{where}[{k}]")
    elif isinstance(data, list) and data:
        out = {i: _ratio(v, f"{where}[{i}]") for i, v in enumerate(data)}
        if ids and len(data) <= ids[-1]:
            raise ConfigError(f"{where}: {len(data)} ratios in global layer order, the model's layers run to {ids[-1]}")
        return {i: r for i, r in out.items() if ids is None or i in ids}
    else:
        raise ConfigError(f"{where}: expected a JSON object {{layer: ratio}}, a JSON list or a comma list of ratios")
    stray = sorted(set(out) - set(ids)) if ids is not None else []
    if stray:
        raise ConfigError(f"{where}: layer {stray[0]} is not an attention layer of the model")
    return out


def read_k_clip_per_head(path: str | os.PathLike[str], layer_ids: Iterable[int] | None = None,
                         num_kv_heads: int | None = None) -> dict[tuple[int, int], float]:
    """A per-head K clip table (``SGLANG_OSCAR_K_CLIP_PER_HEAD``): a JSON object
    ``{"<layer>,<global KV head>": ratio}`` with ratios in (0, 1]; heads it does not name keep the layer's clip.

    Raises:
        ConfigError: not such a table, a ratio outside (0, 1], a head or layer the model does not have.
    """
    p = Path(os.fspath(path)).expanduser()
    data = _read_json(p, "per-head K clip table")
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"{p}: a per-head K clip table is a JSON object {{\"<layer>,<head>\": ratio}}")
    ids = set(layer_ids) if layer_ids is not None else None
    out: dict[tuple[int, int], float] = {}
    for k, v in data.items():
        m = _HEAD_KEY.match(k) if isinstance(k, str) else None
        if m is None:
            raise ConfigError(f"{p}: key {k!r} is not '<layer>,<head>'")
        lid, head = int(m[1]), int(m[2])
        if ids is not None and lid not in ids:
            raise ConfigError(f"{p}: layer {lid} is not an attention layer of the model")
        if num_kv_heads is not None and head >= num_kv_heads:
            raise ConfigError(f"{p}: KV head {head} of layer {lid}, but the model has {num_kv_heads} KV heads")
        out[(lid, head)] = _ratio(v, f"{p}[{k}]", low_open=True)
    return out


__all__ = ["identify_torch_file", "read_k_clip_per_head", "read_k_clip_per_layer"]
