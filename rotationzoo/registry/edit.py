"""Editing registry documents: read one for update, merge a model's tag into it, write it back.

``rotationzoo publish --registry-out`` uses these; the written bytes are canonical
(``json.dumps(indent=2)`` plus a newline) so that re-publishing the same entry changes nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from .. import config
from ..errors import RegistryError
from ..safefile import write_text_atomic
from .load import REGISTRY_VERSION, bundled_registry_path, schema_path


def empty_registry() -> dict[str, Any]:
    """A registry document with no models."""
    return {"registry_version": REGISTRY_VERSION, "models": []}


def read_for_update(path: Path) -> dict[str, Any]:
    """The document in ``path`` (an empty one when the file does not exist yet).

    Raises:
        RegistryError: the file exists but is not a registry document (it is then never overwritten).
    """
    if not path.exists():
        return empty_registry()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RegistryError(f"{path}: not a readable registry file ({exc}); refusing to overwrite it") from None
    if not isinstance(data, dict) or not isinstance(data.get("models"), list):
        raise RegistryError(f"{path}: expected an object with a 'models' list; refusing to overwrite it")
    other = sorted(set(data) - {"$schema", "registry_version", "models"})
    if other or data.get("registry_version", REGISTRY_VERSION) != REGISTRY_VERSION:
        raise RegistryError(f"{path}: not a registry document of version {REGISTRY_VERSION} (its keys: "
                            f"{', '.join(map(str, sorted(data)))[:200]}); refusing to overwrite it")
    return data


def raw_model(model_id: str) -> dict[str, Any] | None:
    """A deep copy of ``model_id``'s JSON from the bundled registry or an overlay (overlays win)."""
    found = None
    for p in [bundled_registry_path(), *config.registry_overlays()]:
        try:
            data = json.loads(Path(p).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        for m in data.get("models", []) if isinstance(data, dict) else []:
            if isinstance(m, dict) and m.get("id") == model_id:
                found = m
    return json.loads(json.dumps(found)) if found is not None else None


def merge_into_registry(data: dict[str, Any], model: Mapping[str, Any], tag: str) -> dict[str, Any]:
    """Add or replace ``model``'s tag ``tag`` in a registry document (in place; also returned).

    A model already in ``data`` keeps its other fields and tags (and their order); only the one tag
    is added (at the end) or replaced (in place). A model not in ``data`` is appended whole.
    """
    models = data.setdefault("models", [])
    for m in models:
        if isinstance(m, dict) and m.get("id") == model["id"]:
            m.setdefault("tags", {})[tag] = json.loads(json.dumps(model["tags"][tag]))
            return data
    models.append(json.loads(json.dumps(dict(model))))
    return data


def registry_text(data: Mapping[str, Any]) -> str:
    """The canonical bytes of a registry file: ``json.dumps(indent=2)`` plus a newline."""
    return json.dumps(data, indent=2) + "\n"


def load_schema() -> dict[str, Any] | None:
    """The registry JSON Schema, or ``None`` when it (or ``jsonschema``) is unavailable."""
    try:
        import jsonschema  # noqa: F401
        return json.loads(schema_path().read_text(encoding="utf-8"))
    except (ImportError, OSError, ValueError):
        return None


def write_registry_file(path: str | os.PathLike[str], data: Mapping[str, Any]) -> bool:
    """Write ``data`` atomically in the canonical format; returns whether the bytes changed. A link at
    ``path`` is followed to the registry file it names, which is replaced there (the link stays a link)."""
    p = Path(os.path.realpath(path))
    text = registry_text(data)
    try:
        if p.read_text(encoding="utf-8") == text:
            return False
    except OSError:
        pass
    write_text_atomic(p, text)
    return True
