"""What rotationzoo writes where a user asked for it: whole or not at all, with the permissions a plain write
would give, and checked before long work rather than after it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from rotationzoo.files.manifest import write_manifest
from rotationzoo.fit.dump_writer import DumpWriter
from rotationzoo.registry.edit import write_registry_file
from rotationzoo.registry.load import bundled_registry_path


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_outputs_get_the_umask_not_0600(tmp_path, umask022) -> None:
    """Each writer renames a temporary file onto its output; that file must not carry mkstemp's 0600."""
    import json

    manifest = write_manifest(tmp_path, {"manifest_version": 1})
    reg = tmp_path / "registry.json"
    write_registry_file(reg, json.loads(bundled_registry_path().read_text()))
    info = DumpWriter(tmp_path / "dump").write_info({"model": "m"})
    for p in (manifest, reg, info):
        assert _mode(p) == 0o644, (p, oct(_mode(p)))
    assert not [p for p in tmp_path.rglob(".*") if p.is_file()]  # no temporary file left
