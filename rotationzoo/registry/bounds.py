"""What numbers a registry (bundled, overlay, or written by publish) may hold.

Every number of a registry entry is checked when the registry is loaded (and by ``lint``), so that
no entry can make ``plan``, ``verify`` or ``fetch`` compute with an impossible model. Bounds
(``registry.schema.json`` states the same):

- ``architecture.head_dim``: one of :data:`REGISTRY_HEAD_DIMS` (16 … 512, powers of two; the INT2
  kernels run 64, 128 and 256, :data:`rotationzoo.int2kv.HEAD_DIMS`);
- ``architecture.num_layers``: 1 … :data:`MAX_LAYERS` (1024, the most layers a rotation file holds);
- ``architecture.attention_layer_ids``: 1 … 1024 distinct increasing integers from 0 to 1023,
  each below ``num_layers`` when that is given;
- ``architecture.num_kv_heads``: 1 … :data:`MAX_KV_HEADS` (256); ``num_attention_heads``:
  1 … :data:`MAX_ATTENTION_HEADS` (4096), a multiple of ``num_kv_heads``;
- ``architecture.num_parameters``: 1 … :data:`MAX_PARAMETERS` (10^15), with ``weight_dtype``;
- ``architecture.moe_intermediate_size``: 1 … :data:`MAX_INTERMEDIATE` (2^20), with ``weight_block_size``
  (1 … 4096), a whole number of its blocks;
- ``architecture.gguf_architecture``: a llama.cpp architecture name (lowercase letters, digits, ``_``;
  at most 40 characters);
- ``files.*.size``: 1 … :data:`MAX_FILE_BYTES` (256 MiB, the most a rotation file may hold);
  ``files.*.sha256``: 64 lowercase hex digits;
- ``calibration.tokens`` / ``prompts``: 0 … :data:`MAX_COUNT` (2^40); ``calibration.group_size``:
  1 … 4096; ``results.*.bf16`` / ``oscar_int2``: finite numbers;
- ``serving``: the bounds of :class:`~rotationzoo.int2kv.Int2KVConfig` (clip ratios in [0, 1],
  windows 0 … 2^30 tokens, the one group-size rule).

A registry file itself is a regular file of at most :data:`MAX_REGISTRY_BYTES` (16 MiB), JSON
without ``NaN`` or ``Infinity``, nested at most :data:`MAX_JSON_DEPTH` deep.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from ..files.limits import MAX_BYTES, MAX_HEAD_DIM, MAX_KV_HEADS, MAX_LAYERS
from ..errors import RegistryError
from ..int2kv import MAX_CONTEXT_TOKENS
from ..numbers import check_int, check_real, shown
from ..vocab import WEIGHT_DTYPE_NAMES

#: llama.cpp's ``general.architecture`` as a registry may name it (``qwen3``, ``gemma4``).
GGUF_ARCHITECTURE = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
#: A sha256 as the registry spells it: 64 lowercase hex digits.
SHA256 = re.compile(r"^[0-9a-f]{64}$")
#: ``architecture.head_dim`` values a registry may hold.
REGISTRY_HEAD_DIMS: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
#: Most attention heads of one layer (``num_attention_heads``).
MAX_ATTENTION_HEADS = 4096
#: Most parameters of one model (``num_parameters``): 10^15.
MAX_PARAMETERS = 10**15
#: Largest MoE intermediate size (``moe_intermediate_size``): 2^20.
MAX_INTERMEDIATE = 2**20
#: Widest quantization block of a checkpoint's weights (``weight_block_size``).
MAX_WEIGHT_BLOCK = 4096
#: Largest rotation file a registry entry may name (``files.*.size``): 256 MiB.
MAX_FILE_BYTES = MAX_BYTES
#: Largest calibration count (``calibration.tokens``, ``calibration.prompts``): 2^40.
MAX_COUNT = 2**40
#: Largest registry file read: 16 MiB (the bundled one is about 30 KB).
MAX_REGISTRY_BYTES = 16 << 20
#: Deepest nesting of a registry document (a file source is 9 levels down).
MAX_JSON_DEPTH = 32

__all__ = ["MAX_ATTENTION_HEADS", "MAX_COUNT", "MAX_FILE_BYTES", "MAX_INTERMEDIATE", "MAX_JSON_DEPTH", "MAX_KV_HEADS",
           "MAX_LAYERS", "MAX_PARAMETERS", "MAX_REGISTRY_BYTES", "MAX_WEIGHT_BLOCK", "REGISTRY_HEAD_DIMS",
           "check_architecture", "check_calibration", "check_gguf_architecture", "check_weight_blocks",
           "check_file_numbers", "check_results"]


def _int(value: Any, what: str, low: int, high: int) -> int:
    return check_int(value, what, low=low, high=high, error=RegistryError)


def check_architecture(head_dim: Any, num_layers: Any, attention_layer_ids: Any, num_kv_heads: Any,
                       num_attention_heads: Any, num_parameters: Any, weight_dtype: Any,
                       where: str = "architecture") -> tuple[int, ...] | None:
    """Check every number of an architecture; the layer ids as a tuple (``None`` when not given).

    Raises:
        RegistryError: one line naming the field (``{where}.head_dim must be one of …``).
    """
    if type(head_dim) is not int or head_dim not in REGISTRY_HEAD_DIMS:  # not 128.0, not True
        raise RegistryError(f"{where}.head_dim must be one of {', '.join(map(str, REGISTRY_HEAD_DIMS))}, "
                            f"got {shown(head_dim)}")
    if num_layers is not None:
        _int(num_layers, f"{where}.num_layers", 1, MAX_LAYERS)
    ids = _layer_ids(attention_layer_ids, num_layers, where)
    if num_kv_heads is not None:
        _int(num_kv_heads, f"{where}.num_kv_heads", 1, MAX_KV_HEADS)
    if num_attention_heads is not None:
        _int(num_attention_heads, f"{where}.num_attention_heads", 1, MAX_ATTENTION_HEADS)
        if num_kv_heads is not None and num_attention_heads % num_kv_heads:
            raise RegistryError(f"{where}.num_attention_heads {num_attention_heads} is not a multiple of "
                                f"num_kv_heads {num_kv_heads} (each KV head serves a whole group of query heads)")
    if num_parameters is not None:
        _int(num_parameters, f"{where}.num_parameters", 1, MAX_PARAMETERS)
    if weight_dtype is not None and weight_dtype not in WEIGHT_DTYPE_NAMES:
        raise RegistryError(f"{where}.weight_dtype must be one of {', '.join(WEIGHT_DTYPE_NAMES)}, "
                            f"got {shown(weight_dtype)}")
    if num_parameters is not None and weight_dtype is None:
        raise RegistryError(f"{where}: num_parameters needs weight_dtype too (e.g. \"bfloat16\")")
    return ids


def check_weight_blocks(moe_intermediate_size: Any, weight_block_size: Any, where: str = "architecture") -> None:
    """Both or neither; bounded; the intermediate size a whole number of blocks (else no TP size serves it).

    Raises:
        RegistryError: one line naming the field.
    """
    if (moe_intermediate_size is None) != (weight_block_size is None):
        raise RegistryError(f"{where}: moe_intermediate_size and weight_block_size go together (the TP rule of "
                            "block-quantized MoE weights needs both)")
    if moe_intermediate_size is None:
        return
    _int(moe_intermediate_size, f"{where}.moe_intermediate_size", 1, MAX_INTERMEDIATE)
    _int(weight_block_size, f"{where}.weight_block_size", 1, MAX_WEIGHT_BLOCK)
    if moe_intermediate_size % weight_block_size:
        raise RegistryError(f"{where}.moe_intermediate_size {moe_intermediate_size} is not a multiple of "
                            f"weight_block_size {weight_block_size} (no TP size could split it)")


def check_gguf_architecture(name: Any, where: str = "architecture") -> None:
    """``None`` or a llama.cpp architecture name (:data:`GGUF_ARCHITECTURE`).

    Raises:
        RegistryError: one line naming the field.
    """
    if name is not None and (not isinstance(name, str) or not GGUF_ARCHITECTURE.fullmatch(name)):
        raise RegistryError(f"{where}.gguf_architecture must be a llama.cpp architecture name (lowercase letters, "
                            f"digits and _, e.g. \"qwen3\"), got {shown(name)}")


def check_layer_head_dims(raw: Any, ids: tuple[int, ...] | None, num_layers: Any,
                          where: str = "architecture") -> dict[int, int] | None:
    """``layer_head_dims`` (``{"5": 512, …}``: layers whose head_dim differs) as ``{5: 512}``; ``None`` if not given.

    Raises:
        RegistryError: a key that is not a layer id of the model, a head_dim not in :data:`REGISTRY_HEAD_DIMS`.
    """
    if raw is None:
        return None
    what = f"{where}.layer_head_dims"
    if not isinstance(raw, Mapping) or not 1 <= len(raw) <= MAX_LAYERS:
        raise RegistryError(f"{what} must be an object of 1 to {MAX_LAYERS} layer ids -> head_dim, got {shown(raw)}")
    out: dict[int, int] = {}
    for key, d in raw.items():
        lid = key if type(key) is int else (int(key) if isinstance(key, str) and key.isascii() and key.isdigit()
                                            and len(key) <= 4 else None)
        if lid is None or not 0 <= lid < MAX_LAYERS or (ids is not None and lid not in ids) or (
                ids is None and type(num_layers) is int and lid >= num_layers):
            raise RegistryError(f"{what}: {shown(key)} is not a layer id of the model")
        if type(d) is not int or d not in REGISTRY_HEAD_DIMS:
            raise RegistryError(f"{what}[{lid}] must be one of {', '.join(map(str, REGISTRY_HEAD_DIMS))}, got {shown(d)}")
        out[lid] = d
    return out


def _layer_ids(raw: Any, num_layers: Any, where: str) -> tuple[int, ...] | None:
    if raw is None:
        return None
    what = f"{where}.attention_layer_ids"
    if not isinstance(raw, (list, tuple)) or not 1 <= len(raw) <= MAX_LAYERS:
        got = f"{len(raw)} items" if isinstance(raw, (list, tuple)) else shown(raw)
        raise RegistryError(f"{what} must be a list of 1 to {MAX_LAYERS} layer ids, got {got}")
    top = (num_layers if num_layers is not None else MAX_LAYERS) - 1
    previous = -1
    for i, layer in enumerate(raw):
        _int(layer, f"{what}[{i}]", 0, top)
        if layer <= previous:
            raise RegistryError(f"{what}[{i}] = {layer} must be above the id before it ({previous}): layer ids are "
                                "distinct and increasing")
        previous = layer
    return tuple(raw)


def check_file_numbers(sha256: Any, size: Any, where: str) -> None:
    """``files.*.sha256`` (64 lowercase hex digits or null) and ``files.*.size`` (1 … 256 MiB or null)."""
    if sha256 is not None and (not isinstance(sha256, str) or not SHA256.match(sha256)):
        raise RegistryError(f"{where}.sha256 {shown(sha256)} is not 64 lowercase hex digits (or null)")
    if size is not None:
        check_int(size, f"{where}.size", low=1, high=MAX_FILE_BYTES, error=RegistryError,
                  hint=" bytes (256 MiB): it must be a positive integer")


def check_calibration(raw: Mapping[str, Any], where: str) -> None:
    """``calibration.tokens`` / ``prompts`` (0 … 2^40), ``group_size`` (1 … 4096), text fields strings."""
    for key in ("tokens", "prompts"):
        if raw.get(key) is not None:
            _int(raw[key], f"{where}.{key}", 0, MAX_COUNT)
    if raw.get("group_size") is not None:
        _int(raw["group_size"], f"{where}.group_size", 1, MAX_HEAD_DIM)
    for key in ("dataset", "notes"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise RegistryError(f"{where}.{key} must be a string, got {shown(raw[key])}")


def check_results(results: Any, where: str) -> None:
    """``results``: a list of objects whose ``bf16`` / ``oscar_int2`` scores are finite numbers or null."""
    if not isinstance(results, list):
        raise RegistryError(f"{where} must be a list, got {shown(results)}")
    for i, r in enumerate(results):
        if not isinstance(r, Mapping):
            raise RegistryError(f"{where}[{i}] must be an object, got {shown(r)}")
        for key in ("bf16", "oscar_int2"):
            if r.get(key) is not None:
                check_real(r[key], f"{where}[{i}].{key}", low=-1e12, high=1e12, error=RegistryError)
        if r.get("context") is not None:
            check_int(r["context"], f"{where}[{i}].context", low=1, high=MAX_CONTEXT_TOKENS, error=RegistryError)
