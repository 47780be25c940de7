"""What `serve-args` prints is safe to paste into a shell or to `source`.

Hostile values reach a launch from three places: a model id recorded in a pair file's metadata
(``--model-path /etc; touch CANARY``), the paths of the rotation files (a folder named
``$(touch CANARY)``), and ``--model-path``. The rendered ``shell`` and ``env`` outputs are run by
bash for real, with the engines replaced by shell functions that record the argv and environment
they receive: the recording must equal the launch spec exactly, and no canary file may appear.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from rotationzoo.cli.main import main
from rotationzoo.errors import RotationZooError
from rotationzoo.files.format import RotationSet, write_rotation
from rotationzoo.files.pair import read_pair
from rotationzoo.files.pairfile import write_pair_safetensors
from rotationzoo.files.pairfile.safetensors import pair_metadata
from rotationzoo.serving import MODEL_PLACEHOLDER, LaunchSpec, ServingError, launch_spec

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

CANARY = "CANARY"
#: Values that run ``touch CANARY`` (or write it) if any shell line carries them unquoted.
HOSTILE = [
    f"--model-path /etc; touch {CANARY}",
    f"$(touch {CANARY})",
    f"`touch {CANARY}`",
    f"'; touch {CANARY}; '",
    f'"; touch {CANARY}; "',
    f"x && touch {CANARY}",
    f"x | touch {CANARY}",
    f"x > {CANARY}",
    f"a b\\ c * ~ ! $HOME ${{PATH}} #{CANARY}",
]
ENGINES = ("sglang", "vllm", "llamacpp")

#: Stand-ins for the engines: each writes the argv it got and the launch's variables (NUL-separated).
STUBS = r"""
record() { out=$1; shift
  { for k in $KEYS; do printf '%s=%s\0' "$k" "${!k-<unset>}"; done; printf '%s\0' ARGV "$@"; } > "$out"; }
python() { record "$RUN_OUT" python "$@"; }
vllm() { record "$RUN_OUT" vllm "$@"; }
llama-server() { record "$RUN_OUT" llama-server "$@"; }
rotationzoo() { record "$PREP_OUT" rotationzoo "$@"; }
"""


def rotations(d: int = 64, layers: int = 2) -> dict[str, RotationSet]:
    eye = torch.eye(d).expand(layers, d, d).clone()
    return {s: RotationSet(rotations=eye, layer_ids=tuple(range(layers)), objective=o) for s, o in
            (("k", "qqt"), ("v", "sst"))}


def pair_folder(parent: Path, name: str) -> Path:
    folder = parent / name
    folder.mkdir(parents=True)
    for side, rs in rotations().items():
        write_rotation(folder / f"{side}_rotation_{rs.objective}.pt", rs)
    return folder


def pair_file_recording(parent: Path, model: str) -> Path:
    """A safetensors pair file whose metadata says the model is ``model``."""
    sets = rotations()
    out = parent / "pair.safetensors"
    write_pair_safetensors(sets, pair_metadata(sets, model=model, tag=None, sha256={}), out)
    return out


def _records(path: Path, keys: list[str]) -> tuple[dict[str, str], list[str]]:
    items = path.read_bytes().decode().split("\0")[:-1]
    at = items.index("ARGV")
    env = dict(item.split("=", 1) for item in items[:at])
    assert list(env) == keys
    return env, items[at + 1:]


def run_in_bash(tmp_path: Path, spec: LaunchSpec, fmt: str) -> None:
    """Run ``spec.render(fmt)`` in bash (cwd: an empty folder) and check what the engine would get."""
    work = tmp_path / "sandbox"
    work.mkdir(exist_ok=True)
    text = spec.render(fmt)
    script = tmp_path / f"launch.{fmt}"
    script.write_text(text + "\n")
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    keys = list(spec.env)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "KEYS": " ".join(keys),
           "RUN_OUT": str(tmp_path / "run.out"), "PREP_OUT": str(tmp_path / "prep.out")}
    if fmt == "shell":
        body = f"{STUBS}\nsource {shlex.quote(str(script))}\n"
    else:  # what a user does with an env file: set -a; source; then run the command
        body = (f"{STUBS}\nset -a\nsource {shlex.quote(str(script))}\nset +a\n"
                f"record \"$RUN_OUT\" {shlex.join(spec.args)}\n")
    r = subprocess.run(["bash", "-c", body], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not (work / CANARY).exists() and not (tmp_path / CANARY).exists(), text
    assert sorted(p.name for p in work.iterdir()) == [], text  # nothing else was written either
    got_env, argv = _records(tmp_path / "run.out", keys)
    assert got_env == spec.env
    assert argv == spec.args
    if spec.prepare and fmt == "shell":
        _, prep = _records(tmp_path / "prep.out", keys)
        assert prep == spec.prepare[0]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("hostile", HOSTILE)
def test_hostile_paths_and_model_paths_are_quoted(cache_dir, tmp_path, engine, hostile) -> None:
    """A rotation folder and a --model-path holding shell syntax reach the engine as plain strings."""
    folder = pair_folder(tmp_path / "rot", hostile.replace("/", "_"))
    model_path = f"/models/{hostile}.gguf" if engine == "llamacpp" else f"/models/{hostile}"
    spec = launch_spec(str(folder), engine=engine, model_path=model_path)
    assert any(str(folder) in v for v in [*spec.env.values(), *spec.files.values()])
    for fmt in ("shell", "env"):
        run_in_bash(tmp_path, spec, fmt)
    assert shlex.split(spec.command)[-len(spec.args):] == spec.args
    assert json.loads(spec.render("json"))["args"] == spec.args


@pytest.mark.parametrize("engine", ("sglang", "vllm"))
@pytest.mark.parametrize("hostile", [*HOSTILE, "-x", "--trust-remote-code", "/etc", "Qwen/../etc", ""])
def test_a_model_id_from_file_metadata_never_reaches_the_command_line(tmp_path, engine, hostile) -> None:
    """Only a NAMESPACE/NAME id recorded in a pair file is used; anything else becomes MODEL, with a note."""
    pair = read_pair(pair_folder(tmp_path, "rot"))
    pair.metadata["model"] = hostile
    spec = launch_spec(pair, engine=engine)
    assert hostile not in spec.args or hostile == ""
    assert MODEL_PLACEHOLDER in spec.args
    assert "replace MODEL with the model's id" in spec.notes[0]
    for fmt in ("shell", "env"):
        run_in_bash(tmp_path, spec, fmt)


@pytest.mark.parametrize("engine", ("sglang", "vllm"))
def test_a_recorded_hub_id_is_used(tmp_path, engine) -> None:
    pair = read_pair(pair_folder(tmp_path, "rot"))
    pair.metadata["model"] = "Qwen/Qwen3-8B"
    spec = launch_spec(pair, engine=engine)
    assert "Qwen/Qwen3-8B" in spec.args and MODEL_PLACEHOLDER not in spec.args


@pytest.mark.parametrize("fmt", ("shell", "env"))
def test_serve_args_cli_on_a_pair_file_with_a_hostile_model(capsys, tmp_path, fmt) -> None:
    """End to end: `serve-args pair.safetensors` whose metadata names `--model-path /etc; touch CANARY`."""
    hostile = HOSTILE[0]
    path = pair_file_recording(tmp_path, hostile)
    rc = main(["serve-args", str(path), "-e", "sglang", "--format", fmt])
    cap = capsys.readouterr()
    if rc != 0:  # a reader that refuses such metadata is safe too, if it says so in one line
        lines = cap.err.strip().splitlines()
        assert rc == 1 and len(lines) == 1 and lines[0].startswith("error: ") and "internal" not in lines[0]
        return
    assert hostile not in cap.out and "warning: the rotations record the model as" in cap.err
    script = tmp_path / "out.sh"
    script.write_text(cap.out)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    work = tmp_path / "sandbox"
    work.mkdir()
    body = f"{STUBS}\nset -a\nsource {shlex.quote(str(script))}\nset +a\n"
    r = subprocess.run(["bash", "-c", body], cwd=work, capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "KEYS": "", "RUN_OUT": str(tmp_path / "run.out"),
                            "PREP_OUT": str(tmp_path / "prep.out"), "HOME": str(work)})
    assert r.returncode == 0, r.stderr
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("bad", ["a\nb", "x\rSGLANG_OSCAR_K_ROTATION_PATH=/tmp/evil", "tab\there", "esc\x1b[2J", "nul\x7f",
                                 "bidi\u202eexe.txt", "c1\x9b"])
def test_control_characters_are_refused_with_one_line(capsys, cache_dir, tmp_path, bad) -> None:
    """A newline would start a new line of the pasted command or of the env file: refused, not printed."""
    folder = pair_folder(tmp_path / "rot", "plain")
    with pytest.raises(ServingError, match="holds a control character"):
        launch_spec(str(folder), engine="sglang", model_path=f"/models/{bad}")
    evil = pair_folder(tmp_path / "rot2", bad.replace("/", "_"))
    with pytest.raises(ServingError, match="holds a control character"):
        launch_spec(str(evil), engine="vllm").render("env")
    rc = main(["serve-args", str(folder), "-e", "sglang", "--model-path", f"/m/{bad}"])
    cap = capsys.readouterr()
    assert rc == 1 and cap.out == "" and len(cap.err.strip().splitlines()) == 1, cap.err


@pytest.mark.parametrize("engine", ENGINES)
def test_a_model_path_that_reads_as_an_option_is_refused(cache_dir, tmp_path, engine) -> None:
    folder = pair_folder(tmp_path, "rot")
    with pytest.raises(ServingError, match="starts with '-'"):
        launch_spec(str(folder), engine=engine, model_path="--trust-remote-code.gguf")


def test_relative_paths_starting_with_a_dash_get_dot_slash(cache_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    folder = pair_folder(tmp_path, "rot")
    Path("-m.gguf").write_bytes(b"")
    spec = launch_spec(str(folder), engine="llamacpp", model_path="./-m.gguf")
    prep = spec.prepare[0]
    assert prep[prep.index("--base-gguf") + 1] == "./-m.gguf" and prep[prep.index("--out") + 1] == "./-m-rot-kv.gguf"
    assert spec.args[2] == "./-m-rot-kv.gguf"


@pytest.mark.parametrize("key", ["BAD KEY", "X;touch CANARY", "1X", "", "A=B", "É"])
def test_variable_names_must_be_shell_identifiers(key) -> None:
    spec = LaunchSpec(engine="vllm", model="m", tag=None, env={key: "1"}, args=["vllm", "serve", "m"], files={})
    for fmt in ("shell", "env", "json"):
        with pytest.raises(ServingError, match="is not a shell identifier"):
            spec.render(fmt)


def test_refusals_are_typed(tmp_path) -> None:
    assert issubclass(ServingError, RotationZooError)
