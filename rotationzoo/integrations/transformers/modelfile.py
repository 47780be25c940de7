"""What a local model says about itself before it is loaded: its shape, from ``config.json`` or a GGUF header.

Loading a model takes seconds to minutes (a GGUF is dequantized tensor by tensor); everything that can
be refused without the weights is refused first: a path that is not a regular file, a GGUF cut short
or malformed, rotations made for another head_dim, KV-head count or layer count. :func:`peek_model`
reads only ``config.json`` (transformers' own config loader, offline) or the GGUF header (its
metadata and tensor table, parsed here with every count and length bounded by the file's size), and
checks that a GGUF file holds every byte its tensor table points at. The shape it reads is checked before
anything is built from it: layers, heads and head_dim positive integers within the bounds of a rotation
file (:data:`~rotationzoo.files.limits.MAX_LAYERS`, :data:`~rotationzoo.files.limits.MAX_KV_HEADS`,
:data:`~rotationzoo.files.limits.MAX_HEAD_DIM`), so a header that declares 2^40 layers or 0 heads is one
:class:`~rotationzoo.errors.ModelLoadError` line.

GGUF layout (v2/v3, little-endian): ``"GGUF"``, ``u32`` version, ``u64`` tensor count, ``u64``
metadata count; metadata ``(string key, u32 type, value)``; tensor infos ``(string name, u32
n_dims, u64 dims[n_dims], u32 ggml type, u64 offset)``; the data at the next multiple of
``general.alignment`` (32 by default). A string is ``u64`` length plus UTF-8 bytes.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ModelLoadError
from ...files.limits import BIG_INT, MAX_HEAD_DIM, MAX_KV_HEADS, MAX_LAYERS, safe_repr
from ...files.pairfile.gguf_header import MAX_GGUF_DIMS, MAX_GGUF_KEYS, MAX_GGUF_TENSORS, scan_gguf_header
from ...safefile import check_model_files, open_regular
from .common import require_transformers

GGUF_MAGIC = b"GGUF"
#: Deepest nesting of metadata arrays: none (an array of arrays is refused by :func:`scan_gguf_header` first,
#: as llama.cpp reads none); kept as a bound of the walk below.
MAX_GGUF_DEPTH = 1
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class ModelShape:
    """What the OSCAR path needs to know about a decoder.

    Attributes:
        head_dim: ``d``.
        num_q_heads: query heads per layer.
        num_kv_heads: key/value heads per layer.
        layer_ids: attention layer indices.
        context_length: the model's maximum context (``max_position_embeddings``), if known.
    """

    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    layer_ids: tuple[int, ...]
    context_length: int | None


#: The JSON files of a model folder that can name Python code of the folder for transformers to import.
CODE_NAMING_FILES: tuple[str, ...] = ("config.json", "tokenizer_config.json", "generation_config.json",
                                      "processor_config.json", "preprocessor_config.json")


def _json_config(path: Path) -> Any:
    """A model folder's JSON config (at most 64 MiB, a regular file), parsed.

    Raises:
        ModelLoadError: it cannot be read or is not JSON.
    """
    import json

    from ...safefile import read_regular

    try:
        return json.loads(read_regular(path, 64 << 20, what="model config", error=ModelLoadError).decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise ModelLoadError(f"{path}: not a JSON config ({type(exc).__name__}); fix the model folder") from None


def check_no_remote_code(folder: Path) -> None:
    """Refuse a model folder that transformers could load only by importing the folder's own Python code,
    before transformers reads it: a config naming such code (``auto_map``) for a ``model_type`` transformers
    does not have itself. A model type transformers has (MiniMax-M2, DeepSeek-V3, Phi-3 ship an ``auto_map``
    beside one) loads with transformers' own classes; every call passes ``trust_remote_code=False``, so the
    folder's code is never imported either way and transformers never asks.

    Raises:
        ModelLoadError: such a folder (or a config that cannot be read as JSON).
    """
    configs = {name: _json_config(folder / name) for name in CODE_NAMING_FILES if (folder / name).is_file()}
    naming = [n for n, data in configs.items() if isinstance(data, dict) and "auto_map" in data]
    if not naming:
        return
    model_type = configs.get("config.json", {}).get("model_type") if isinstance(configs.get("config.json"), dict) \
        else None
    transformers = require_transformers()
    if isinstance(model_type, str) and model_type in transformers.CONFIG_MAPPING:
        return  # transformers' own classes; auto_map is ignored with trust_remote_code=False
    raise ModelLoadError(f"{folder / naming[0]}: names Python code of the model folder (auto_map) for model_type "
                         f"{model_type!r}, which transformers does not have; rotationzoo never runs code from a model "
                         f"folder: use a model transformers supports, or a .gguf")


def model_shape(model: Any) -> ModelShape:
    """The :class:`ModelShape` of a transformers decoder (from its text config).

    Raises:
        ModelLoadError: as :func:`shape_of_config`.
    """
    return shape_of_config(model.config)


#: What each bound on a model's shape is, for refusals.
_BOUNDS = {"layers": (MAX_LAYERS, "MAX_LAYERS, the most layers a rotation file holds"),
           "heads": (MAX_KV_HEADS, "MAX_KV_HEADS, the most heads a rotation file holds"),
           "head_dim": (MAX_HEAD_DIM, "MAX_HEAD_DIM, the largest rotation a file holds"),
           "size": (BIG_INT, ""), "context": (BIG_INT, "")}  # no bound of their own


def _shape_number(value: Any, key: str, kind: str, name: str, fix: str) -> int:
    """``value`` (the model's ``key``) as an int from 1 to the bound of ``kind``, else one refusal.

    Raises:
        ModelLoadError: not an int (a bool, float or string is not one), below 1 or above the bound.
    """
    hi, why = _BOUNDS[kind]
    if type(value) is int and 1 <= value <= hi:
        return value
    expected = f"an integer from 1 to {hi} ({why})" if hi < BIG_INT else "a positive integer"
    raise ModelLoadError(f"{name}: {key} is {safe_repr(value)}; expected {expected}; {fix}")


def checked_shape(name: str, fix: str, *, heads: tuple[str, Any], kv: tuple[str, Any], layers: tuple[str, Any],
                  head_dim: tuple[str, Any] | None = None, hidden: tuple[str, Any] | None = None,
                  context: tuple[str, Any] | None = None) -> ModelShape:
    """A :class:`ModelShape` from the values a model file declares, each given as ``(its key, its value)``,
    checked before anything is built from them: every count an integer from 1 to its bound (layers
    :data:`MAX_LAYERS`, query and KV heads :data:`MAX_KV_HEADS`, head_dim :data:`MAX_HEAD_DIM`), the query
    heads a multiple of the KV heads, the context length (if given) positive.

    Args:
        name: the file, for messages; fix: what to do, for messages.
        heads, layers: the query-head and layer counts.
        kv: the KV-head count (value ``None``: as many as the query heads).
        head_dim: ``d`` (value ``None``: ``hidden`` divided by the query heads).
        hidden: the hidden size, when ``head_dim`` is not given.
        context: the maximum context (value ``None``: unknown).

    Raises:
        ModelLoadError: one line naming the key, its value and the bound.
    """
    n_layers = _shape_number(layers[1], layers[0], "layers", name, fix)
    n_heads = _shape_number(heads[1], heads[0], "heads", name, fix)
    n_kv = n_heads if kv[1] is None else _shape_number(kv[1], kv[0], "heads", name, fix)
    if n_heads % n_kv:
        raise ModelLoadError(f"{name}: {heads[0]} is {n_heads}, not a multiple of {kv[0]} ({n_kv}); expected "
                             f"query heads in whole groups per KV head; {fix}")
    if head_dim is not None and head_dim[1] is not None:
        d = _shape_number(head_dim[1], head_dim[0], "head_dim", name, fix)
    elif hidden is not None:
        size = _shape_number(hidden[1], hidden[0], "size", name, fix)
        d = size // n_heads
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ModelLoadError(f"{name}: head_dim {d} ({hidden[0]} {size} / {heads[0]} {n_heads}); expected an "
                                 f"integer from 1 to {MAX_HEAD_DIM} ({_BOUNDS['head_dim'][1]}); {fix}")
    else:
        raise ModelLoadError(f"{name}: no head_dim and no hidden size; not a decoder model; {fix}")
    ctx = None if context is None or context[1] is None else _shape_number(context[1], context[0], "context", name, fix)
    return ModelShape(head_dim=d, num_q_heads=n_heads, num_kv_heads=n_kv, layer_ids=tuple(range(n_layers)),
                      context_length=ctx)


_MISSING = object()


def shape_of_config(cfg: Any, *, name: str = "the model's config") -> ModelShape:
    """The :class:`ModelShape` a transformers config describes (its text config, for multimodal ones), its
    values checked (:func:`checked_shape`) before any is used.

    Args:
        cfg: a transformers config.
        name: what the config is, for messages (``models/x/config.json``).

    Raises:
        ModelLoadError: a count missing, not a positive integer or beyond the bounds of a rotation file.
    """
    cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    fix = "fix config.json or give another model"

    def get(key: str, required: bool = True) -> Any:
        value = getattr(cfg, key, _MISSING)
        if value is _MISSING:
            if required:
                raise ModelLoadError(f"{name}: no {key}; not a decoder config; {fix}")
            return None
        return value

    return checked_shape(name, fix, heads=("num_attention_heads", get("num_attention_heads")),
                         kv=("num_key_value_heads", get("num_key_value_heads", False)),
                         layers=("num_hidden_layers", get("num_hidden_layers")),
                         head_dim=("head_dim", get("head_dim", False)),
                         hidden=("hidden_size", get("hidden_size", False)),
                         context=("max_position_embeddings", get("max_position_embeddings", False)))


class _Header:
    """A bounded little-endian reader over the mapped file."""

    def __init__(self, buf: Any, name: str) -> None:
        self.buf, self.pos, self.name, self.size = buf, 0, name, len(buf)

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{self.name}: not a complete GGUF file ({what} at byte {self.pos} of {self.size}); "
                              f"the file is cut short or damaged: download or copy it again")

    def take(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        if self.pos + n > self.size:
            raise self.fail("the header ends early")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if n > self.size - self.pos:
            raise self.fail(f"a string of {n} bytes")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int, keep: bool, depth: int = 0) -> Any:
        """One metadata value of type ``kind`` (an array: its items, or ``None`` unless ``keep``), arrays
        nested at most :data:`MAX_GGUF_DEPTH` deep."""
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise self.fail(f"unknown metadata type {kind}")
        if depth >= MAX_GGUF_DEPTH:
            raise self.fail(f"metadata arrays nested more than {MAX_GGUF_DEPTH} deep")
        item, count = self.take("<I"), self.take("<Q")
        least = 8 if item == _STRING else 12 if item == _ARRAY else 1  # bytes each item takes at least
        if count * least > self.size - self.pos:
            raise self.fail(f"an array of {count} items")
        if item in _SCALARS and not keep:  # skipped without reading the items
            width = struct.calcsize(_SCALARS[item])
            if count * width > self.size - self.pos:
                raise self.fail(f"an array of {count} items")
            self.pos += count * width
            return None
        if not keep:
            for _ in range(count):
                self.value(item, keep, depth + 1)
            return None
        return [self.value(item, keep, depth + 1) for _ in range(count)]


def read_gguf_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], int]:
    """``(scalar metadata, bytes the tensor table needs)`` of a GGUF model file, the weights unread.

    Raises:
        ModelLoadError: not a regular file, not a GGUF file, a header cut short or malformed, or a file
            shorter than its tensor table says.
    """
    from ...files.pairfile.gguf import gguf_module

    p = Path(path).expanduser()
    quant_sizes = gguf_module().GGML_QUANT_SIZES
    with open_regular(p, what="model", error=ModelLoadError) as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise ModelLoadError(f"{p}: {size} bytes, not a GGUF file; download or copy it again")
        if f.read(4) == GGUF_MAGIC:  # the bounds every GGUF reader of the package keeps, before this walk
            scan_gguf_header(p, error=ModelLoadError)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            h = _Header(buf, str(p))
            if bytes(buf[:4]) != GGUF_MAGIC:
                raise ModelLoadError(f"{p}: not a GGUF file (it does not start with 'GGUF'); give a .gguf model "
                                     f"file or a transformers model folder")
            h.pos = 4
            version, tensors, keys = h.take("<I"), h.take("<Q"), h.take("<Q")
            if version not in (2, 3):
                raise ModelLoadError(f"{p}: GGUF version {version}; this reader knows versions 2 and 3")
            if keys > MAX_GGUF_KEYS or tensors > MAX_GGUF_TENSORS:
                raise h.fail(f"{keys} metadata entries and {tensors} tensors declared")
            meta: dict[str, Any] = {}
            for _ in range(keys):
                key = h.string()
                value = h.value(h.take("<I"), keep=False)
                if value is not None:
                    meta[key] = value
            end = 0
            for _ in range(tensors):
                name = h.string()
                n_dims = h.take("<I")
                if n_dims > MAX_GGUF_DIMS:
                    raise h.fail(f"tensor {name!r} with {n_dims} dims")
                dims = [h.take("<Q") for _ in range(n_dims)]
                kind, offset = h.take("<I"), h.take("<Q")
                if kind not in quant_sizes:
                    raise h.fail(f"tensor {name!r} of unknown type {kind}")
                block, nbytes = quant_sizes[kind]
                count = 1
                for d in dims:
                    count *= d
                end = max(end, offset + count // block * nbytes)
            align = meta.get("general.alignment", 32)
            if not isinstance(align, int) or align < 1 or align > 1 << 20:
                raise h.fail(f"general.alignment {align!r}")
            data = -(-h.pos // align) * align
    if data + end > size:
        raise ModelLoadError(f"{p}: {size} bytes, but its tensors need {data + end}; the file is cut short: "
                             f"download or copy it again")
    return meta, data + end


def gguf_shape(meta: dict[str, Any], name: str) -> ModelShape:
    """The :class:`ModelShape` a GGUF header's metadata declares, checked (:func:`checked_shape`).

    Raises:
        ModelLoadError: no architecture, a count missing, not a positive integer or beyond the bounds.
    """
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(f"{name}: its GGUF header has no general.architecture; not a model GGUF")
    fix = "the file is damaged or not a decoder model: give another model file"

    def get(key: str, required: bool = True) -> tuple[str, Any]:
        full = f"{arch}.{key}"
        if full not in meta and required:
            raise ModelLoadError(f"{name}: its GGUF header has no {full}; not a decoder model GGUF")
        return full, meta.get(full)

    key_length = get("attention.key_length", False)
    emb = get("embedding_length", required=key_length[1] is None)  # head_dim: key_length, else embedding / heads
    return checked_shape(name, fix, heads=get("attention.head_count"), kv=get("attention.head_count_kv", False),
                         layers=get("block_count"), head_dim=key_length, hidden=emb,
                         context=get("context_length", False))


def peek_model(model: str | os.PathLike[str], *, option: str | None = None) -> ModelShape:
    """The :class:`~rotationzoo.integrations.transformers.ModelShape` of a local model without loading it.

    Args:
        model: a ``.gguf`` file or a transformers folder (``config.json``).
        option: how the caller names the path in messages (``--model``).

    Raises:
        ModelLoadError: the path or a file in the folder is not a regular file, a GGUF file is cut
            short or malformed, or the header or config does not describe a decoder: a count missing, not a
            positive integer, or beyond the bounds of a rotation file (:func:`checked_shape`).
        MissingDependencyError: transformers is not installed (checked before the GGUF header, which needs
            ``gguf``: the ``transformers`` extra installs both, so the hint names the one extra that works).
    """
    p = check_model_files(model, option=option)
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{p}: not a .gguf file; give a model folder (config.json) or a .gguf file")
        require_transformers()  # the model is loaded with transformers: name its extra, not gguf's alone
        meta, _ = read_gguf_header(p)
        return gguf_shape(meta, str(p))
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"{p}: no config.json; not a transformers model folder")
    check_no_remote_code(p)
    return config_shape(p)


def config_shape(folder: Path) -> ModelShape:
    """The :class:`ModelShape` of a transformers folder's ``config.json`` (checked first for an ``auto_map`` by
    :func:`check_no_remote_code`): its counts as written checked before transformers parses them, then
    transformers' config checked (:func:`shape_of_config`).

    Raises:
        ModelLoadError: a count not a positive integer within the bounds, or anything transformers' config
            parsing raises (a ZeroDivisionError, its strict field validation, a RecursionError), as one line.
        MissingDependencyError: transformers is not installed.
    """
    transformers = require_transformers()
    name = f"{folder}/config.json"
    _check_raw_config(folder / "config.json", name)
    try:  # whatever transformers' parsing raises: one line
        cfg = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
        return shape_of_config(cfg, name=name)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"{name}: cannot be read as a decoder config ({type(exc).__name__}: {one_line(exc)}); "
                             f"fix config.json or give another model") from None


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (its lines joined, at most 200 characters), or its type's name."""
    text = " ".join(str(exc).split())
    return text[:200] if text else type(exc).__name__


#: config.json keys that hold a count of the shape, and the bound each is checked against (``size``: no bound
#: of its own; the head_dim it gives is bounded).
_CONFIG_COUNTS = {"num_hidden_layers": "layers", "num_attention_heads": "heads", "num_key_value_heads": "heads",
                  "head_dim": "head_dim", "hidden_size": "size"}


def _check_raw_config(path: Path, name: str) -> None:
    """Refuse the shape's counts in ``config.json`` (and its ``text_config``) as written, before transformers
    parses them (it divides by the head count, and builds per-layer lists from the layer count).

    Raises:
        ModelLoadError: a count that is present (not ``null``) but not an integer from 1 to its bound, or a
            config that is not a JSON object.
    """
    data = _json_config(path)
    if not isinstance(data, dict):
        raise ModelLoadError(f"{name}: not a JSON object; fix config.json or give another model")
    for where in (data, data.get("text_config")):
        if isinstance(where, dict):
            for key, kind in _CONFIG_COUNTS.items():
                if where.get(key) is not None:
                    _shape_number(where[key], key if where is data else f"text_config.{key}", kind, name,
                                  "fix config.json or give another model")
