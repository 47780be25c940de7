"""What a local model says about itself before it is loaded: its shape, from ``config.json`` or a GGUF header.

Loading a model takes seconds to minutes (a GGUF is dequantized tensor by tensor); everything that can
be refused without the weights is refused first: a path that is not a regular file, a GGUF cut short
or malformed, rotations made for another head_dim, KV-head count or layer count. :func:`peek_model`
reads only ``config.json`` (transformers' own config loader, offline) or the GGUF header (its
metadata and tensor table, parsed here with every count and length bounded by the file's size), and
checks that a GGUF file holds every byte its tensor table points at.

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
from ...safefile import check_model_files, open_regular
from .common import require_transformers

GGUF_MAGIC = b"GGUF"
#: Largest counts a GGUF header may declare (metadata entries, tensors, array items, dims).
MAX_GGUF_KEYS = 1 << 16
MAX_GGUF_TENSORS = 1 << 20
MAX_GGUF_DIMS = 8
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


def check_no_remote_code(folder: Path) -> None:
    """Refuse a model folder whose configs ask transformers to import the folder's own Python code
    (``auto_map``), before transformers reads them: rotationzoo never runs code from a model folder (and
    passes ``trust_remote_code=False`` besides, so transformers never asks).

    Raises:
        ModelLoadError: a config of the folder has an ``auto_map`` (or cannot be read as JSON).
    """
    import json

    from ...safefile import read_regular

    for name in CODE_NAMING_FILES:
        p = folder / name
        if not p.is_file():
            continue
        try:
            data = json.loads(read_regular(p, 64 << 20, what="model config", error=ModelLoadError).decode("utf-8"))
        except (OSError, ValueError, RecursionError) as exc:
            raise ModelLoadError(f"{p}: not a JSON config ({type(exc).__name__}); fix the model folder") from None
        if isinstance(data, dict) and "auto_map" in data:
            raise ModelLoadError(f"{p}: names Python code of the model folder (auto_map); rotationzoo never runs "
                                 f"code from a model folder: use a model transformers supports as it is, or a .gguf")


def model_shape(model: Any) -> ModelShape:
    """The :class:`ModelShape` of a transformers decoder (from its text config)."""
    return shape_of_config(model.config)


def shape_of_config(cfg: Any) -> ModelShape:
    """The :class:`ModelShape` a transformers config describes (its text config, for multimodal ones)."""
    cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    heads = int(cfg.num_attention_heads)
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    ctx = getattr(cfg, "max_position_embeddings", None)
    return ModelShape(head_dim=d, num_q_heads=heads, num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
                      layer_ids=tuple(range(int(cfg.num_hidden_layers))), context_length=int(ctx) if ctx else None)


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

    def value(self, kind: int, keep: bool) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise self.fail(f"unknown metadata type {kind}")
        item, count = self.take("<I"), self.take("<Q")
        if count > self.size - self.pos:  # every item takes at least one byte
            raise self.fail(f"an array of {count} items")
        if item in _SCALARS and not keep:  # skipped without reading the items
            width = struct.calcsize(_SCALARS[item])
            if count * width > self.size - self.pos:
                raise self.fail(f"an array of {count} items")
            self.pos += count * width
            return None
        out = [self.value(item, keep) for _ in range(count)]
        return out if keep else None


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


def _gguf_shape(meta: dict[str, Any], name: str) -> ModelShape:
    arch = meta.get("general.architecture")

    def get(key: str, required: bool = True) -> Any:
        value = meta.get(f"{arch}.{key}")
        if required and not isinstance(value, int):
            raise ModelLoadError(f"{name}: its GGUF header has no {arch}.{key}; not a decoder model GGUF")
        return value

    if not isinstance(arch, str):
        raise ModelLoadError(f"{name}: its GGUF header has no general.architecture; not a model GGUF")
    heads, layers = get("attention.head_count"), get("block_count")
    kv = get("attention.head_count_kv", False) or heads
    d = get("attention.key_length", False) or get("embedding_length") // max(heads, 1)
    ctx = get("context_length", False)
    return ModelShape(head_dim=int(d), num_q_heads=int(heads), num_kv_heads=int(kv),
                      layer_ids=tuple(range(int(layers))), context_length=int(ctx) if ctx else None)


def peek_model(model: str | os.PathLike[str], *, option: str | None = None) -> ModelShape:
    """The :class:`~rotationzoo.integrations.transformers.ModelShape` of a local model without loading it.

    Args:
        model: a ``.gguf`` file or a transformers folder (``config.json``).
        option: how the caller names the path in messages (``--model``).

    Raises:
        ModelLoadError: the path or a file in the folder is not a regular file, a GGUF file is cut
            short or malformed, or the config does not describe a decoder.
    """
    p = check_model_files(model, option=option)
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{p}: not a .gguf file; give a model folder (config.json) or a .gguf file")
        meta, _ = read_gguf_header(p)
        return _gguf_shape(meta, str(p))
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"{p}: no config.json; not a transformers model folder")
    transformers = require_transformers()
    check_no_remote_code(p)
    try:
        cfg = transformers.AutoConfig.from_pretrained(str(p), local_files_only=True, trust_remote_code=False)
        return shape_of_config(cfg)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"{p}/config.json: cannot be read as a decoder config "
                             f"({str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__})") from None
