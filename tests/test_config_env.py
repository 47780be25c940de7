"""Boolean environment variables: a documented set of spellings, anything else refused in one line.

``ROTATIONZOO_OFFLINE=Y`` used to mean online, silently. Every boolean variable rotationzoo reads
now takes 1/true/yes/on or 0/false/no/off (any case) and refuses the rest with one line naming the
variable and the accepted values; for ``HF_HUB_OFFLINE`` the true spellings are checked against
what the installed huggingface_hub itself reads as true.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rotationzoo import config
from rotationzoo.cli.main import main
from rotationzoo.errors import ConfigError

BOOLEANS = ("ROTATIONZOO_OFFLINE", "HF_HUB_OFFLINE", "ROTATIONZOO_ALLOW_HTTP_LOOPBACK", "ROTATIONZOO_DEBUG")
TRUE = ("1", "true", "TRUE", "True", "yes", "YES", "on", "On")
FALSE = ("0", "false", "FALSE", "no", "No", "off", "OFF")
REFUSED = ("Y", "y", "n", "2", "-1", "offline", "tru", "1 1", " 1", "on ", "enabled", "\u0131")


@pytest.mark.parametrize("name", BOOLEANS)
def test_spellings(monkeypatch, name) -> None:
    for value in TRUE:
        monkeypatch.setenv(name, value)
        assert config.env_bool(name) is True, value
    for value in FALSE:
        monkeypatch.setenv(name, value)
        assert config.env_bool(name, default=True) is False, value
    for value in ("", "   "):
        monkeypatch.setenv(name, value)
        assert config.env_bool(name, default=True) is True and config.env_bool(name) is False
    monkeypatch.delenv(name)
    assert config.env_bool(name) is False
    for value in REFUSED:
        monkeypatch.setenv(name, value)
        with pytest.raises(ConfigError) as info:
            config.env_bool(name)
        message = str(info.value)
        assert message.startswith(f"{name}=") and "1/true/yes/on" in message and "0/false/no/off" in message
        assert "\n" not in message


def one_line(capsys, argv: list[str]) -> str:
    rc = main(argv)
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("error: "), cap.err
    assert "internal error" not in cap.err
    return lines[0]


@pytest.mark.parametrize("name", ("ROTATIONZOO_OFFLINE", "HF_HUB_OFFLINE"))
def test_unknown_offline_values_are_refused_before_any_download(capsys, cache_dir, monkeypatch, name) -> None:
    monkeypatch.setenv(name, "Y")
    line = one_line(capsys, ["fetch", "Qwen3-8B"])
    assert f"{name}='Y' is not a boolean" in line
    assert not any(cache_dir.rglob("*.pt"))
    monkeypatch.setenv(name, "yes")  # an accepted spelling: offline, and the cache is empty
    assert "offline mode" in one_line(capsys, ["fetch", "Qwen3-8B"])


def test_debug_and_loopback_variables(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("ROTATIONZOO_DEBUG", "maybe")
    assert "ROTATIONZOO_DEBUG='maybe' is not a boolean" in one_line(capsys, ["list"])
    monkeypatch.setenv("ROTATIONZOO_DEBUG", "off")
    assert main(["list"]) == 0
    capsys.readouterr()
    overlay = {"registry_version": 1, "models": [{
        "id": "Test/Tiny", "architecture": {"num_layers": 2, "head_dim": 64}, "default_tag": "t",
        "tags": {"t": {"objectives": {"k": "qqt", "v": "sst"}, "serving": {},
                       "files": {s: {"path": f"Tiny/t/{s}_rotation.pt", "sha256": None, "size": None,
                                     "sources": [{"type": "url", "url": f"http://127.0.0.1:9/{s}.pt"}]}
                                 for s in "kv"}}}}]}
    reg = tmp_path / "overlay.json"
    reg.write_text(json.dumps(overlay))
    monkeypatch.setenv("ROTATIONZOO_REGISTRY", str(reg))
    monkeypatch.setenv("ROTATIONZOO_ALLOW_HTTP_LOOPBACK", "Y")
    assert "ROTATIONZOO_ALLOW_HTTP_LOOPBACK='Y' is not a boolean" in one_line(capsys, ["list"])
    monkeypatch.setenv("ROTATIONZOO_ALLOW_HTTP_LOOPBACK", "TRUE")
    assert main(["list"]) == 0


def test_true_spellings_are_huggingface_hubs() -> None:
    """What rotationzoo accepts as HF_HUB_OFFLINE, the installed huggingface_hub reads the same way."""
    pytest.importorskip("huggingface_hub")
    probe = (
        "import importlib, json, os, sys\n"
        "import huggingface_hub.constants as c\n"
        "out = {}\n"
        "for v in json.loads(sys.argv[1]):\n"
        "    os.environ['HF_HUB_OFFLINE'] = v\n"
        "    out[v] = importlib.reload(c).HF_HUB_OFFLINE\n"
        "print(json.dumps(out))\n"
    )
    values = [*TRUE, *FALSE, *REFUSED]
    r = subprocess.run([sys.executable, "-c", probe, json.dumps(values)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    theirs = json.loads(r.stdout)
    for v in TRUE:
        assert theirs[v] is True, v
    for v in FALSE:
        assert theirs[v] is False, v
    assert [v for v in REFUSED if theirs[v]] == []  # every refused value is one huggingface_hub reads as online


def test_a_cache_root_that_cannot_be_one_is_refused_in_one_line(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("ROTATIONZOO_CACHE", "rel/cache")  # each working folder would get its own
    for argv in (["cache", "ls"], ["fetch", "Qwen3-8B"]):
        assert "ROTATIONZOO_CACHE='rel/cache' is a relative path" in one_line(capsys, argv)
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    monkeypatch.setenv("ROTATIONZOO_CACHE", str(not_a_folder))
    for argv in (["cache", "ls"], ["cache", "verify"], ["fetch", "Qwen3-8B"]):
        assert f"the cache root {not_a_folder} is not a folder" in one_line(capsys, argv)
    assert not_a_folder.read_text() == "x"
    monkeypatch.chdir(tmp_path)  # --cache-dir relative to the working folder: reported absolute
    assert main(["cache", "ls", "--cache-dir", "here", "--json"]) == 0
    assert str(tmp_path / "here") in capsys.readouterr().out
