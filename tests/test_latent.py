"""MLA latent sets: both layouts read safely and validated, layer coverage against the model, verify,
fetch from the in-repo hub server with trust on first use, import of an unpublished set, and the
launches (the authors' current SGLang tree, the vLLM port's MLA path)."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shlex
from pathlib import Path

import pytest
import torch

import rotationzoo
from hubserver import hub_env, hub_server  # noqa: F401  (fixtures)
from rotationzoo.errors import (
    FetchError,
    IntegrityError,
    InvalidRotationError,
    OfflineError,
    RotationFileError,
    ServingError,
    UnsafeRotationFileError,
)
from rotationzoo.hadamard import hadamard_matrix
from rotationzoo.files.latent import read_latent_file, read_latent_folder, validate_latent
from rotationzoo.mla import load_latent
from rotationzoo.serving import launch_spec

from helpers import run_cli

R, L = 64, 4  # a small latent: rank 64, 4 layers
MODEL = "acme/Tiny-MLA"
REPO_ID = "zoo/RotationZoo"


def bare(seed: int, rank: int = R) -> torch.Tensor:
    """A [rank, rank] orthogonal latent rotation (Hadamard with random column signs), fp32."""
    g = torch.Generator().manual_seed(seed)
    return (hadamard_matrix(rank, dtype=torch.float32) * (torch.randint(0, 2, (rank,), generator=g) * 2 - 1)).contiguous()


def oscar2(seed: int, rank: int = R) -> dict:
    """The OSCAR-2 joint latent dict: a non-orthogonal R with q_rotation = R^{-T}, a mean, eigenvalues."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(rank, rank, generator=g, dtype=torch.float64)
    r = a @ a.T / rank + torch.eye(rank, dtype=torch.float64)
    return {"rotation": r.float(), "q_rotation": torch.linalg.inv(r).T.float(), "mean": torch.randn(rank, generator=g),
            "eigenvalues": torch.rand(rank, generator=g),
            "transform": {"latent": "joint", "centered": True, "orthogonal": False, "lam": 1.0, "rho_samples": 3}}


def latent_folder(path: Path, ids=range(L), *, rank: int = R, dict_layers=()) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for i in ids:
        torch.save(oscar2(i, rank) if i in dict_layers else bare(i, rank), path / f"layer_{i}.pt")
    return path


def overlay(tmp_path: Path, monkeypatch, **latent) -> Path:
    block = {"name": "tiny-latent", "location": "/oscar/rotations/tiny (test)", "rank": R, "num_layers": L,
             "group_size": 16, "prefix_tokens": 64, "recent_tokens": 256, "tp_size": 2, **latent}
    reg = {"registry_version": 1, "models": [{"id": MODEL, "aliases": ["Tiny-MLA"], "mla_latent": block}]}
    p = tmp_path / "overlay.json"
    p.write_text(json.dumps(reg))
    monkeypatch.setenv("ROTATIONZOO_REGISTRY", str(p))
    return p


# -- reading and validation ------------------------------------------------------------------------


def test_both_layouts_read_and_validate(tmp_path):
    d = latent_folder(tmp_path / "lat", dict_layers=(2,))
    lr = read_latent_folder(d, rank=R, layer_ids=range(L))
    assert lr.layer_ids == (0, 1, 2, 3) and lr.rank == R and lr.layouts == ("dict", "tensor") and lr.companions
    assert lr.layers[2].layout == "dict" and not lr.layers[2].orthogonal and lr.layers[2].mean is not None
    report = validate_latent(lr, layer_ids=range(L), rank=R)
    assert report.ok, report.problems
    assert report.max_orthogonality_error < 1e-6 and report.max_inverse_error < 1e-4


def test_bad_latent_files_are_refused_in_one_line(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    torch.save(bare(0) * 1.5, d / "layer_0.pt")  # not orthogonal
    torch.save({**oscar2(1), "q_rotation": torch.eye(R)}, d / "layer_1.pt")  # q_rotation does not invert it
    nan = bare(2)
    nan[3, 3] = float("nan")
    torch.save(nan, d / "layer_2.pt")
    no_q = oscar2(3)
    del no_q["q_rotation"]
    torch.save(no_q, d / "layer_3.pt")  # says non-orthogonal, has no inverse
    problems = validate_latent(read_latent_folder(d), layer_ids=range(4)).problems
    assert any("layer 0: not orthogonal" in p for p in problems)
    assert any("layer 1: q_rotation does not invert" in p for p in problems)
    assert any("layer 2: the rotation holds 1 NaN" in p for p in problems)
    assert any("layer 3: the transform is not orthogonal and the file has no q_rotation" in p for p in problems)
    torch.save(bare(0, 32), tmp_path / "layer_9.pt")
    with pytest.raises(RotationFileError, match=r"a \[32, 32\] latent rotation, but the model's latent rank is 64"):
        read_latent_file(tmp_path / "layer_9.pt", rank=R)
    torch.save({"rotation": bare(0), "extra": torch.ones(3)}, tmp_path / "extra.pt")
    with pytest.raises(RotationFileError, match="holds a tensor 'extra'"):
        read_latent_file(tmp_path / "extra.pt")
    torch.save({"rotation": bare(0), "stats": {"c_kv_norm": torch.ones(3)}}, tmp_path / "nested.pt")
    with pytest.raises(RotationFileError, match="holds a tensor 'stats'"):
        read_latent_file(tmp_path / "nested.pt")
    torch.save({"format_version": 1, "layers": {0: {"rotation": bare(0)}}}, tmp_path / "kv.pt")
    with pytest.raises(RotationFileError, match="a K/V rotation file"):
        read_latent_file(tmp_path / "kv.pt")
    torch.save({"layer_ids": [0], "n_sub": 8, "sub_dim": 8, "codebooks_per_layer": torch.randn(1, 8, 16, 8)},
               tmp_path / "pq.pt")
    with pytest.raises(RotationFileError, match="a PQ codebook file"):
        read_latent_file(tmp_path / "pq.pt")


def test_plain_values_beside_the_rotation_are_metadata_as_in_a_kv_file(tmp_path):
    """A key the latent dict does not know is refused only when it holds a tensor, as in a K/V rotation file
    (at its top level and in its layers); a note or a count is metadata."""
    from rotationzoo import read_rotation

    torch.save({"rotation": bare(0), "note": "fitted on GLM-5.2 c_kv", "tokens": 30000, "layer_id": 0},
               tmp_path / "layer_0.pt")
    lay = read_latent_file(tmp_path / "layer_0.pt", rank=R, layer_id=0)
    assert lay.layout == "dict" and torch.equal(lay.rotation, bare(0))
    kv = {"format_version": 1, "objective": "qqt_r_h_pbr", "note": "fitted on a laptop",
          "layers": {0: {"layer_id": 0, "rotation": bare(0), "note": "x"}}}
    torch.save(kv, tmp_path / "k_rotation.pt")
    assert read_rotation(tmp_path / "k_rotation.pt").layer_ids == (0,)


def test_a_latent_rotation_stored_in_16_bits_is_refused_naming_its_dtype(tmp_path):
    """Validation's "not orthogonal" line names a 16-bit rotation; the tolerance decides, as for K/V files."""
    q, _ = torch.linalg.qr(torch.randn(R, R, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    torch.save(q.to(torch.bfloat16), tmp_path / "layer_0.pt")
    torch.save({"rotation": q.half()}, tmp_path / "layer_1.pt")
    torch.save(bare(2).to(torch.bfloat16), tmp_path / "layer_2.pt")  # ±1/8: exact in bfloat16, orthogonal
    assert torch.equal(read_latent_file(tmp_path / "layer_2.pt", rank=R).rotation, bare(2))
    lr = read_latent_folder(tmp_path, rank=R)
    problems = validate_latent(lr, rank=R).problems
    assert len(problems) == 2, problems
    assert "layer 0: not orthogonal" in problems[0] and ("rotation is stored as bfloat16, too coarse to hold an "
                                                         "orthogonal matrix") in problems[0]
    assert "layer 1: not orthogonal" in problems[1] and "stored as float16" in problems[1]
    assert validate_latent(lr, rank=R, atol=1e-2).problems == []


class _Boom:
    def __reduce__(self):
        return (print, ("pwned",))


def test_a_latent_file_that_would_run_code_is_refused_before_loading(tmp_path, capsys):
    torch.save({"rotation": bare(0), "transform": _Boom()}, tmp_path / "layer_0.pt",
               pickle_protocol=2)
    with pytest.raises(UnsafeRotationFileError, match="do not trust this file"):
        read_latent_file(tmp_path / "layer_0.pt")
    assert "pwned" not in capsys.readouterr().out


def test_a_missing_layer_is_an_error_naming_it(tmp_path):
    d = latent_folder(tmp_path / "lat", ids=(0, 1, 3))
    with pytest.raises(InvalidRotationError, match=r"no layer_2\.pt for layer 2"):
        read_latent_folder(d)  # ids must run from 0 without a gap
    with pytest.raises(InvalidRotationError, match=r"no layer_4\.pt for layer 4"):
        read_latent_folder(latent_folder(tmp_path / "four", ids=range(4)), layer_ids=range(5))
    with pytest.raises(InvalidRotationError, match="holds 4 layer files, the model has 5 latent layers"):
        read_latent_folder(tmp_path / "four", layer_count=5)
    with pytest.raises(InvalidRotationError, match=r"layer_3\.pt is not a latent layer of the model"):
        read_latent_folder(tmp_path / "four", layer_ids=(0, 1, 2))


def test_verify_of_a_latent_folder_with_a_layer_missing_fails_with_one_line_naming_it(tmp_path, capsys):
    d = latent_folder(tmp_path / "lat", ids=(0, 1, 2, 3, 4, 5))
    rc, out, err = run_cli(capsys, "verify", str(d), "--json")
    assert rc == 0, err
    rep = json.loads(out)[0]
    assert rep["ok"] and rep["objective"] == "mla_latent" and rep["head_dim"] == R and rep["num_layers"] == 6
    (d / "layer_4.pt").unlink()
    rc, out, err = run_cli(capsys, "verify", str(d))
    assert rc == 1
    problems = [ln for ln in out.splitlines() if ln.startswith("✗")]
    assert len(problems) == 1 and "no layer_4.pt for layer 4" in problems[0], out
    rc, out, _ = run_cli(capsys, "verify", str(latent_folder(tmp_path / "short", ids=range(4))), "--num-layers", "5")
    assert rc == 1 and "no layer_4.pt for layer 4" in out


# -- the registry: fetch from a hub, import, load ------------------------------------------------------


@pytest.fixture
def published(hub_env, tmp_path, monkeypatch, cache_dir):
    """A hub repo holding a latent folder, and an overlay registry whose latent set points at it."""
    src = latent_folder(tmp_path / "src", dict_layers=(1,))
    server = hub_env.server
    files = {f"Tiny-MLA/tiny-latent/layer_{i}.pt": (src / f"layer_{i}.pt").read_bytes() for i in range(L)}
    commit = server.commit_files(REPO_ID, files)
    overlay(tmp_path, monkeypatch, path="Tiny-MLA/tiny-latent",
            sources=[{"type": "huggingface", "repo": REPO_ID, "revision": commit},
                     {"type": "modelscope", "repo": REPO_ID, "revision": "master"}])
    return type("Pub", (), {"server": server, "src": src, "files": files, "commit": commit})


def test_a_published_set_is_fetched_pinned_and_loaded(published, cache_dir, capsys):
    rc, out, err = run_cli(capsys, "fetch", "Tiny-MLA", "--json")
    assert rc == 0, err
    got = json.loads(out)
    assert got["layers"] == L and all(not f["from_cache"] for f in got["files"].values())
    for i in range(L):
        f = got["files"][str(i)]
        assert f["sha256"] == hashlib.sha256(published.files[f"Tiny-MLA/tiny-latent/layer_{i}.pt"]).hexdigest()
    lat = load_latent("Tiny-MLA", offline=True)
    assert lat.rotations.layer_ids == tuple(range(L)) and lat.report.ok and lat.model == MODEL
    rc, out, _ = run_cli(capsys, "cache", "ls", "--json")
    listed = [r for r in json.loads(out)["files"] if r.get("model") == MODEL]
    assert len(listed) == L and {r["tag"] for r in listed} == {"tiny-latent"}
    # pinned on first use, per source and revision: a moving branch that changes a file's bytes is refused
    load_latent("Tiny-MLA", source_type="modelscope", cache_dir=cache_dir / "ms")
    published.server.commit_files(REPO_ID, {"Tiny-MLA/tiny-latent/layer_2.pt": torch_bytes(bare(99))})
    with pytest.raises(IntegrityError, match="changed since it was first used"):
        load_latent("Tiny-MLA", source_type="modelscope", cache_dir=cache_dir / "fresh")


def torch_bytes(t: torch.Tensor) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def test_a_published_set_missing_a_layer_file_is_not_served(published, capsys):
    missing = published.server.commit_files(REPO_ID, {}, delete=["Tiny-MLA/tiny-latent/layer_3.pt"])
    with pytest.raises(FetchError, match=r"(?s)LAYER_3 file layer_3\.pt .*not found"):
        load_latent("Tiny-MLA", revision=missing)
    broken = published.server.commit_files(REPO_ID, {"Tiny-MLA/tiny-latent/layer_3.pt": b"not a torch file"})
    with pytest.raises(IntegrityError, match=r"LAYER_3 file layer_3\.pt .*not a valid latent file"):
        load_latent("Tiny-MLA", revision=broken)


def test_an_unpublished_set_is_imported_then_served_with_its_bits(tmp_path, monkeypatch, cache_dir, capsys):
    overlay(tmp_path, monkeypatch, num_layers=None, layer_count=3, bits=4, pp_size=2,
            mamba_scheduler_strategy="extra_buffer")
    rc, out, err = run_cli(capsys, "serve-args", "Tiny-MLA")
    assert rc == 1 and "not published in a hub" in err and "cache import FOLDER --latent" in err
    short = latent_folder(tmp_path / "short", ids=(3, 7))
    rc, _, err = run_cli(capsys, "cache", "import", str(short), "--latent", "Tiny-MLA")
    assert rc == 1 and "holds 2 layer files, the model has 3 latent layers" in err
    d = latent_folder(tmp_path / "k3", ids=(3, 7, 11))
    for extra in (["--name", "x"], ["--force"], ["--allow-mixed", "--force"]):  # a pair's options: refused, not dropped
        rc, out, err = run_cli(capsys, "cache", "import", str(d), "--latent", "Tiny-MLA", *extra)
        assert rc == 2 and out == "" and f"{extra[0]} go" in err and "not --latent" in err, err
    rc, out, err = run_cli(capsys, "cache", "import", str(d), "--latent", "Tiny-MLA", "--json")
    assert rc == 0, err
    assert json.loads(out)["layers"] == 3
    rc, out, err = run_cli(capsys, "serve-args", "Tiny-MLA", "--engine", "sglang", "--json")
    assert rc == 0, err
    spec = json.loads(out)
    env, args = spec["env"], spec["args"]
    assert env["SGLANG_OSCAR_MLA_KV_BITS"] == "4" and env["SGLANG_OSCAR_MLA_PACKED_GF"] == "0"
    assert env["SGLANG_LLOYD_MAX"] == "0" and env["SGLANG_OSCAR_MLA_KV_PACKED"] == "1"
    assert env["SGLANG_OSCAR_MLA_KV_GROUP_SIZE"] == "16"
    folder = Path(env["SGLANG_OSCAR_MLA_KV_ROTATION_PATH"])
    assert folder.is_dir() and sorted(p.name for p in folder.glob("layer_*.pt")) == ["layer_11.pt", "layer_3.pt",
                                                                                    "layer_7.pt"]
    assert args[args.index("--kv-cache-dtype") + 1] == "bfloat16" and "--kv-cache-quant-group-size" not in args
    assert args[args.index("--pipeline-parallel-size") + 1] == "2"
    assert args[args.index("--mamba-radix-cache-strategy") + 1] == "extra_buffer"
    assert "SGLANG_OSCAR_K_ROTATION_PATH" not in env
    # without the prefix cache the Mamba strategy is left out: SGLang refuses extra_buffer with --disable-radix-cache
    off = launch_spec("Tiny-MLA", disable_radix_cache=True)
    assert off.args[-1] == "--disable-radix-cache" and "--mamba-radix-cache-strategy" not in off.args
    assert any("extra_buffer (the entry's) is left out" in n for n in off.notes)
    # the vLLM port's MLA path is INT2 only; the other targets do not read latent sets
    with pytest.raises(ServingError, match="quantizes the latent to INT2 only"):
        launch_spec("Tiny-MLA", engine="vllm")
    for engine in ("sglang-legacy", "llamacpp", "vllm-prototype"):
        with pytest.raises(ServingError, match="an MLA latent rotation set .* cannot be served by " + engine):
            launch_spec("Tiny-MLA", engine=engine)
    # a layer file gone from the cache: the launch is refused rather than printed with a missing path
    (folder / "layer_7.pt").unlink()
    with pytest.raises(RotationZooErrorLike):
        launch_spec("Tiny-MLA")


RotationZooErrorLike = (OfflineError, InvalidRotationError, FetchError)


def test_an_import_replaces_a_set_whole_or_not_at_all(tmp_path, monkeypatch, cache_dir, capsys):
    """A folder with one bad layer imports nothing (the set before stays whole, its pins untouched); a
    good one replaces the set, layers the registry does not name included."""
    overlay(tmp_path, monkeypatch, num_layers=None, layer_count=3)
    a = latent_folder(tmp_path / "a", ids=(3, 7, 11))
    assert run_cli(capsys, "cache", "import", str(a), "--latent", "Tiny-MLA")[0] == 0
    folder = Path(json.loads(run_cli(capsys, "cache", "import", str(a), "--latent", "Tiny-MLA", "--json")[1])["folder"])
    before = {q.name: q.read_bytes() for q in folder.iterdir()}
    pins_before = Path(os.environ["ROTATIONZOO_PINS"]).read_bytes()
    b = latent_folder(tmp_path / "b", ids=(0, 1, 2))
    (b / "layer_2.pt").write_bytes(b"not a torch file")
    from rotationzoo.hub.latent import import_latent
    from rotationzoo.registry import get_model

    with pytest.raises(IntegrityError, match="nothing was imported"):  # the CLI checks the folder first; a file
        import_latent(b, get_model("Tiny-MLA"), cache_dir=cache_dir, accept_new=True)  # may change after that
    assert {q.name: q.read_bytes() for q in folder.iterdir()} == before
    assert Path(os.environ["ROTATIONZOO_PINS"]).read_bytes() == pins_before
    torch.save(bare(2, R), b / "layer_2.pt")
    assert run_cli(capsys, "cache", "import", str(b), "--latent", "Tiny-MLA", "--accept-new")[0] == 0
    assert sorted(q.name for q in folder.glob("layer_*.pt")) == ["layer_0.pt", "layer_1.pt", "layer_2.pt"]
    assert not list(folder.glob(".*"))  # no staged copy left behind


def test_a_replacement_cut_short_leaves_the_set_before_whole(tmp_path, monkeypatch, cache_dir):
    """A full disk writing the second layer's marker had left layer 3 of the new set beside layers 7 and 11 of
    the old one, each verified: the layers replaced are moved aside first and put back on a failure."""
    import errno

    from rotationzoo.hashing import sha256_file
    from rotationzoo.hub import latent as lat
    from rotationzoo.hub.latent import import_latent
    from rotationzoo.registry import get_model

    overlay(tmp_path, monkeypatch, num_layers=None, layer_count=3)
    a = latent_folder(tmp_path / "a", ids=(3, 7, 11))
    folder = import_latent(a, get_model("Tiny-MLA"), cache_dir=cache_dir).folder
    before = {q.name: q.read_bytes() for q in folder.iterdir()}
    b = tmp_path / "b"
    b.mkdir()
    for i in (3, 7, 11):
        torch.save(bare(100 + i), b / f"layer_{i}.pt")
    real, calls = lat.record_verified, []

    def full(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kw)

    monkeypatch.setattr(lat, "record_verified", full)
    with pytest.raises(OSError):
        import_latent(b, get_model("Tiny-MLA"), cache_dir=cache_dir, accept_new=True)
    assert {q.name: q.read_bytes() for q in folder.iterdir()} == before  # nothing of b, nothing left aside
    monkeypatch.setattr(lat, "record_verified", real)
    got = import_latent(b, get_model("Tiny-MLA"), cache_dir=cache_dir, accept_new=True)
    assert all(sha256_file(got.folder / f"layer_{i}.pt") == sha256_file(b / f"layer_{i}.pt") for i in (3, 7, 11))
    assert not list(got.folder.glob(".*"))


@pytest.mark.parametrize("bad", ["oversized", "dangling"])
def test_an_import_copies_at_most_a_rotation_file_and_says_why_not(tmp_path, monkeypatch, cache_dir, bad):
    """A layer file over the size bound is refused before a byte lands in the cache (a sparse file here:
    no disk used); a dangling link is one typed line, never an internal error."""
    overlay(tmp_path, monkeypatch, num_layers=None, layer_count=3)
    from rotationzoo.files.limits import MAX_BYTES
    from rotationzoo.hub.latent import import_latent
    from rotationzoo.registry import get_model

    b = latent_folder(tmp_path / "b", ids=(0, 1, 2))
    (b / "layer_1.pt").unlink()
    if bad == "oversized":
        with open(b / "layer_1.pt", "wb") as f:
            f.truncate(MAX_BYTES + 1)
    else:
        (b / "layer_1.pt").symlink_to(tmp_path / "gone.pt")
    for subspace in (False, True):
        with pytest.raises(RotationFileError, match="more than the .* B a latent rotation file may hold"
                           if bad == "oversized" else "cannot read the latent rotation file"):
            import_latent(b, get_model("Tiny-MLA"), cache_dir=cache_dir, subspace=subspace)
        used = sum(q.stat().st_size for q in cache_dir.rglob("*") if q.is_file())
        assert used < 1 << 20 and not list(cache_dir.rglob("layer_*.pt"))


def test_vllm_mla_path_reads_bare_files_only(tmp_path, monkeypatch, cache_dir, capsys):
    overlay(tmp_path, monkeypatch, lloyd_max=True)
    rc, _, err = run_cli(capsys, "cache", "import", str(latent_folder(tmp_path / "b", ids=range(L))), "--latent",
                         "Tiny-MLA")
    assert rc == 0, err
    spec = launch_spec("Tiny-MLA", engine="vllm")
    assert spec.env["VLLM_OSCAR_MLA_KV_ROTATION_PATH"].endswith("tiny-latent")
    assert spec.env["VLLM_OSCAR_MLA_KV_GROUP_SIZE"] == "16" and spec.env["VLLM_OSCAR_LLOYD_MAX"] == "1"
    assert spec.args == ["vllm", "serve", MODEL, "--tensor-parallel-size", "2"]
    assert any("identity" in n for n in spec.notes)
    sg = launch_spec("Tiny-MLA")
    assert sg.env["SGLANG_LLOYD_MAX"] == "1" and sg.env["SGLANG_OSCAR_MLA_KV_BITS"] == "2"
    assert "SGLANG_OSCAR_MLA_PACKED_GF" not in sg.env
    assert shlex.split(sg.render("shell").splitlines()[-1])[:3] == ["python", "-m", "sglang.launch_server"]
    # an OSCAR-2 dict layer in the set: the port's loader reads bare tensors only
    rc, _, err = run_cli(capsys, "cache", "import", str(latent_folder(tmp_path / "d", dict_layers=(0,))),
                         "--latent", "Tiny-MLA", "--accept-new")
    assert rc == 0, err
    with pytest.raises(ServingError, match="reads bare"):
        launch_spec("Tiny-MLA", engine="vllm")
    # a dict layer without companions is still a dict: the port does torch.load(path).shape
    plain = latent_folder(tmp_path / "p", ids=range(L))
    torch.save({"rotation": bare(1), "eigenvalues": torch.rand(R), "transform": {"latent": "joint"}},
               plain / "layer_1.pt")
    rc, _, err = run_cli(capsys, "cache", "import", str(plain), "--latent", "Tiny-MLA", "--accept-new")
    assert rc == 0, err
    assert launch_spec("Tiny-MLA").env["SGLANG_OSCAR_MLA_KV_BITS"] == "2"  # the current tree reads it
    rc, out, err = run_cli(capsys, "serve-args", "Tiny-MLA", "--engine", "vllm")
    assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "OSCAR-2 dict layer files" in err and "torch.load(path).shape" in err and "--engine sglang" in err


def test_load_latent_of_a_folder_against_a_registry_model(tmp_path, monkeypatch):
    overlay(tmp_path, monkeypatch)
    d = latent_folder(tmp_path / "lat", ids=range(L - 1))
    with pytest.raises(InvalidRotationError, match=r"no layer_3\.pt for layer 3"):
        rotationzoo.load_latent(d, model="Tiny-MLA")
    latent_folder(d, ids=(L - 1,))
    assert rotationzoo.load_latent(d, model="Tiny-MLA").rotations.layer_ids == tuple(range(L))


def test_verify_registry_checks_a_latent_set_layer_by_layer(tmp_path, monkeypatch, cache_dir, capsys):
    overlay(tmp_path, monkeypatch)
    rc, out, _ = run_cli(capsys, "verify", "--registry", "--model", "Tiny-MLA", "--json")
    (entry,) = json.loads(out)["entries"]
    assert rc == 0 and entry["status"] == "missing" and "cache import FOLDER --latent" in entry["problems"][0]
    rc, _, err = run_cli(capsys, "cache", "import", str(latent_folder(tmp_path / "lat")), "--latent", "Tiny-MLA")
    assert rc == 0, err
    rc, out, _ = run_cli(capsys, "verify", "--registry", "--model", "Tiny-MLA", "--json")
    (entry,) = json.loads(out)["entries"]
    assert rc == 0 and entry["status"] == "unpinned" and sorted(entry["files"]) == [f"layer_{i}" for i in range(L)]
    folder = Path(entry["files"]["layer_1"]["path"]).parent
    torch.save(bare(7) * 2, folder / "layer_1.pt")  # changed on disk after it was verified
    rc, out, _ = run_cli(capsys, "verify", "--registry", "--model", "Tiny-MLA", "--json")
    (entry,) = json.loads(out)["entries"]
    assert rc == 1 and entry["status"] == "failed", entry
