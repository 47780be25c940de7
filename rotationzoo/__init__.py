"""rotationzoo: OSCAR rotations for 2-bit KV caches.

Quick use::

    import rotationzoo
    pair = rotationzoo.load("SmolLM2-135M-Instruct")   # bundled, works offline
    pair.k.rotations.shape                             # torch.Size([30, 3, 64, 64]): one per KV head

Importing the package is cheap: torch and the hub clients are imported only when a function
that needs them is called.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

# public name -> module that defines it (imported on first use)
_LAZY = {
    # registry (no torch)
    "list_models": "registry",
    "get_entry": "registry",
    "get_model": "registry",
    "Registry": "registry",
    "ModelEntry": "registry",
    "TagEntry": "registry",
    # rotation files
    "RotationSet": "files.format",
    "read_rotation": "files.format",
    "write_rotation": "files.format",
    "validate": "files.validation",
    "ValidationReport": "files.validation",
    # fetch / load / resolve
    "fetch": "api",
    "load": "api",
    "FetchResult": "api",
    "RotationPair": "files.pair",
    "resolve_pair": "files.pair",
    # MLA latent sets
    "load_latent": "mla",
    "verify_latent": "mla",
    "LoadedLatent": "mla",
    # INT2 KV settings, serving and export
    "Int2KVConfig": "int2kv",
    "launch_spec": "serving",
    "export_safetensors": "export",
    "export_gguf": "export",
}

__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rotationzoo' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # pragma: no cover
    from .api import FetchResult, fetch, load
    from .export import export_gguf, export_safetensors
    from .files.format import RotationSet, read_rotation, write_rotation
    from .int2kv import Int2KVConfig
    from .mla import LoadedLatent, load_latent, verify_latent
    from .files.pair import RotationPair, resolve_pair
    from .registry import ModelEntry, Registry, TagEntry, get_entry, get_model, list_models
    from .serving import launch_spec
    from .files.validation import ValidationReport, validate
