"""Hostile registries: every name that reaches a path or a request is refused on load, in one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from rotationzoo.errors import RegistryError
from rotationzoo.registry import safety
from rotationzoo.registry.load import Registry

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = json.loads((ROOT / "registry.json").read_text())


def _qwen(d: dict) -> dict:
    return next(m for m in d["models"] if m["id"] == "Qwen/Qwen3-8B")


def _tag(d: dict) -> dict:
    return _qwen(d)["tags"]["seq20000_prompt83_group128"]


def _set(path: str, value):
    def mutate(d: dict) -> None:
        target: object = d
        keys = path.split(".")
        for k in keys[:-1]:
            target = target[int(k)] if isinstance(target, list) else target[k]  # type: ignore[index]
        last = keys[-1]
        if isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value  # type: ignore[index]
    return mutate


def _load(tmp_path: Path, mutate) -> Registry:
    data = copy.deepcopy(BUNDLED)
    mutate(data)
    p = tmp_path / "overlay.json"
    p.write_text(json.dumps(data))
    return Registry.from_files([p])


HOSTILE = [
    ("file path climbs out", lambda d: _tag(d)["files"]["k"].update(path="../../../etc/k.pt"), "must be relative"),
    ("absolute file path", lambda d: _tag(d)["files"]["k"].update(path="/etc/passwd"), "must be relative"),
    ("marker-like file path", lambda d: _tag(d)["files"]["k"].update(path="Qwen3-8B/x/k.pt.verified"),
     "cache verification marker"),
    ("tag with a slash", lambda d: _qwen(d)["tags"].update({"a/../../b": _qwen(d)["tags"].pop("seq20000_prompt83_group128")})
     or _qwen(d).update(default_tag="a/../../b"), "must be one name"),
    ("model id with ..", lambda d: _qwen(d).update(id="../Qwen3-8B"), "is not a NAMESPACE/NAME id"),
    ("alias with ..", lambda d: _qwen(d)["aliases"].append("../x"), "must be NAME or NAMESPACE/NAME"),
    ("repo with ..", lambda d: _tag(d)["sources"][0].update(repo="../../x"), "is not a NAMESPACE/NAME id"),
    ("revision climbing", lambda d: _tag(d)["sources"][0].update(revision="../../main"), "revision"),
    # the cache writes '/' as '--': these would share a folder with Qwen/x--Qwen3-8B, rel/1
    ("model id with --", lambda d: _qwen(d).update(id="Qwen--x/Qwen3-8B"), "no '..' or '--'"),
    ("revision with --", lambda d: _tag(d)["sources"][0].update(revision="rel--1"), "no '..' or '--'"),
    ("hidden file name", lambda d: _tag(d)["files"]["k"].update(path="Qwen3-8B/x/.k_rotation.pt.tmp"),
     "names a hidden file"),
    ("K and V named alike", lambda d: _tag(d)["files"]["v"].update(
        path="Qwen3-8B/other/" + _tag(d)["files"]["k"]["path"].rsplit("/", 1)[-1]), "K and V are both named"),
    ("source path climbing", lambda d: _tag(d)["sources"][0].update(path="../k.pt"), "must be relative"),
    ("plain http url", lambda d: _tag(d)["sources"].append({"type": "url", "url": "http://example.com/k.pt"}),
     "must start with https://"),
    ("file url", lambda d: _tag(d)["sources"].append({"type": "url", "url": "file:///etc/passwd"}),
     "http(s) URL with a host"),
    ("url with credentials", lambda d: _tag(d)["sources"].append({"type": "url", "url": "https://u:p@example.com/k"}),
     "must not carry credentials"),
    ("bundled outside data", lambda d: _tag(d)["sources"].append({"type": "bundled", "path": "../../setup.py"}),
     "must be relative"),
    ("unknown source type", lambda d: _tag(d)["sources"].append({"type": "ftp", "repo": "a/b"}),
     "unknown source type"),
    # values of the wrong JSON type: one line, never an internal error
    ("tags a list", lambda d: _qwen(d).update(tags=[]), "tags must be an object of tag entries"),
    ("default_tag a list", lambda d: _qwen(d).update(default_tag=[]), "default_tag must be one of its tags"),
    ("a tag null", lambda d: _qwen(d)["tags"].update(seq20000_prompt83_group128=None), "must be an object"),
    ("latent group_size null", lambda d: next(m for m in d["models"] if "mla_latent" in m)["mla_latent"].update(
        group_size=None), "group_size must be an integer"),
]


@pytest.mark.parametrize("name, mutate, message", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_overlay_refused(tmp_path: Path, name: str, mutate, message: str) -> None:
    with pytest.raises(RegistryError) as info:
        _load(tmp_path, mutate)
    text = str(info.value)
    assert message in text, text
    assert "\n" not in text and str(tmp_path / "overlay.json") in text


def test_bundled_registry_passes_the_checks(tmp_path: Path) -> None:
    reg = _load(tmp_path, lambda d: None)
    assert len(reg) == len(BUNDLED["models"])


def test_http_loopback_needs_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    url = "http://127.0.0.1:8080/k.pt"
    monkeypatch.setenv("ROTATIONZOO_ALLOW_HTTP_LOOPBACK", "1")
    assert safety.check_url(url, "x") == url
    monkeypatch.setenv("ROTATIONZOO_ALLOW_HTTP_LOOPBACK", "0")
    with pytest.raises(RegistryError, match="https://"):
        safety.check_url(url, "x")
    with pytest.raises(RegistryError, match="https://"):
        safety.check_url("http://127.0.0.1.example.com/k.pt", "x")


def test_bundled_file_stays_in_data() -> None:
    path = "rotations/SmolLM2-135M-Instruct/hadamard/k_rotation_hadamard.pt"
    assert safety.bundled_file(path).is_file()
    with pytest.raises(RegistryError):
        safety.bundled_file("../__init__.py")
