"""The registry: models × calibration tags → rotation files, their hashes and where to get them.

The bundled ``registry.json`` (documented in ``docs/registry.md``, schema in
``registry.schema.json``) is read without importing torch, so listing and inspecting the zoo is
fast. ``ROTATIONZOO_REGISTRY`` may name extra registry files in the same schema; their models
replace bundled models with the same id.

Modules: :mod:`~rotationzoo.registry.model` (entry types), :mod:`~rotationzoo.registry.load`
(parsing, overlays, lookup), :mod:`~rotationzoo.registry.lint` (integrity checks),
:mod:`~rotationzoo.registry.edit` (merging entries into registry files).

Example::

    >>> from rotationzoo import get_entry
    >>> tag = get_entry("qwen3-8b")
    >>> tag.name, tag.serving.k_clip_ratio, tag.files["k"].path
    ('seq20000_prompt83_group128', 0.96, 'Qwen3-8B/seq20000_prompt83_group128/k_rotation_qqt_r_h_pbr.pt')
"""

from __future__ import annotations

from .lint import LintReport, lint_registry
from .load import (
    REGISTRY_VERSION,
    Registry,
    bundled_registry_path,
    get_entry,
    get_model,
    list_models,
    load_registry,
    parse_model,
    read_registry_json,
    schema_path,
)
from .model import (
    SIDES,
    SOURCE_TYPES,
    Architecture,
    Calibration,
    FileEntry,
    ModelEntry,
    Result,
    Serving,
    Side,
    Source,
    SourceType,
    TagEntry,
    parse_tag_name,
    split_model_tag,
)

__all__ = [
    "REGISTRY_VERSION",
    "SIDES",
    "SOURCE_TYPES",
    "Architecture",
    "Calibration",
    "FileEntry",
    "LintReport",
    "ModelEntry",
    "Registry",
    "Result",
    "Serving",
    "Side",
    "Source",
    "SourceType",
    "TagEntry",
    "bundled_registry_path",
    "get_entry",
    "get_model",
    "lint_registry",
    "list_models",
    "load_registry",
    "parse_model",
    "parse_tag_name",
    "read_registry_json",
    "schema_path",
    "split_model_tag",
]
