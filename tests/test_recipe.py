"""One value for what a fit is asked for (:class:`rotationzoo.recipe.FitRecipe`) and the workflows that run it:
Python writes what the CLI writes, the manifest records the recipe, every refusal comes before the work."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rotationzoo.errors import ConfigError, FitError
from rotationzoo.fit.dump import write_dump
from rotationzoo.int2kv import Int2KVConfig
from rotationzoo.recipe import FitRecipe, KeepRule, Refinement
from rotationzoo.workflows import fit_dump

from helpers import run_cli

D = 32
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    chunks: dict[int, list[dict]] = {}
    for lid in (0, 1):
        g = torch.Generator().manual_seed(lid)
        scale = torch.linspace(0.2, 3.0, D)
        chunks[lid] = [{"q": torch.randn(n, 4, D, generator=g) * scale, "k": torch.randn(n, 2, D, generator=g) * scale,
                        "v": torch.randn(n, 2, D, generator=g) * scale.flip(0), "seq_lens": [n]}
                       for n in (3, 512, 512)]
    return write_dump(tmp_path_factory.mktemp("recipe") / "dump", chunks)


def _sha(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*_rotation_*"))}


def _direct_closed(dump: Path, **kw):
    from rotationzoo.fit import fit_rotations

    return fit_rotations(dump, **kw)


def _direct_refined(dump: Path, **kw):
    from rotationzoo.fit import refine_dump

    options = Refinement(steps=3, init="oscar", loss="block", sample_tokens=512, seed=1,
                         int2kv=Int2KVConfig(scale_dtype="bfloat16", recent_tokens=32))
    return refine_dump(dump, options, **kw)


@pytest.mark.parametrize("argv, recipe, direct", [
    (["--objective", "oscar2_center"], FitRecipe(objective="oscar2_center"),
     lambda d: _direct_closed(d, objective="oscar2_center")),
    (["--composition", "r_pbr_hg", "-g", "16", "--grouping", "kv_head"],
     FitRecipe(composition="r_pbr_hg", group_size=16, grouping="kv_head"),
     lambda d: _direct_closed(d, composition="r_pbr_hg", group_size=16, grouping="kv_head")),
    (["--refine", "3", "--init", "oscar", "--grouping", "kv_head", "--center", "k", "-g", "16", "--loss", "block",
      "--sample-tokens", "512", "--seed", "1", "--scale-dtype", "bfloat16", "--recent-tokens", "32"],
     FitRecipe(grouping="kv_head", center="k", group_size=16,
               refine=Refinement(steps=3, init="oscar", loss="block", sample_tokens=512, seed=1,
                                 int2kv=Int2KVConfig(scale_dtype="bfloat16", recent_tokens=32))),
     lambda d: _direct_refined(d, grouping="kv_head", center="k", group_size=16)),
])
def test_python_writes_what_the_cli_writes(dump: Path, tmp_path: Path, capsys, argv: list[str],
                                           recipe: FitRecipe, direct) -> None:
    """The CLI, the workflow and the fitter's own functions called with the recipe's fields write the same bytes."""
    from rotationzoo.fit import write_fitted

    code, _, err = run_cli(capsys, "fit", "--dump", str(dump), "--out", str(tmp_path / "cli"), *argv)
    assert code == 0, err
    result, written = fit_dump(dump, recipe, tmp_path / "py")
    write_fitted(direct(dump), tmp_path / "direct")
    cli, py = _sha(tmp_path / "cli"), _sha(tmp_path / "py")
    assert len(cli) == 2 and cli == py == _sha(tmp_path / "direct")
    assert set(written.paths) == {"k", "v"}
    for folder in ("cli", "py"):  # the manifest records the recipe, and it reads back as the same value
        manifest = json.loads((tmp_path / folder / "rotationzoo.json").read_text())
        assert FitRecipe.from_json(manifest["recipe"]) == recipe
    if recipe.refine is not None:
        assert result.refinement is not None and result.refinement["steps"] == {"k": 3, "v": 3}


def test_the_recipe_round_trips_through_json() -> None:
    recipe = FitRecipe(grouping="kv_head", center="k", group_size=64,
                       refine=Refinement(steps=100, init="oscar", int2kv=Int2KVConfig(scale_dtype="bfloat16")),
                       keep=KeepRule(texts=(Path("held_out.txt"),), tokens=8192, k_clip_ratio=0.92))
    data = json.loads(json.dumps(recipe.check().to_json()))
    assert data["keep"]["k_clip_ratio"] == 0.92 and data["keep"]["v_clip_ratio"] is None
    assert FitRecipe.from_json(data) == recipe and recipe.keep is not None and recipe.keep.texts == ("held_out.txt",)
    assert recipe.store() == Int2KVConfig(scale_dtype="bfloat16", group_size=64)
    trained = Int2KVConfig(k_clip_ratio=0.0, v_clip_ratio=0.92)
    assert recipe.keep.judged_store(trained) == Int2KVConfig(k_clip_ratio=0.92, v_clip_ratio=0.92)
    assert KeepRule(texts=("a.txt",)).judged_store(trained) == trained
    with pytest.raises(FitError, match="recipe: unknown key"):
        FitRecipe.from_json({**data, "objectve": "qqt"})


@pytest.mark.parametrize("make, match", [
    (lambda: FitRecipe(objective="qqt_sts"), "unknown objective 'qqt_sts'"),
    (lambda: FitRecipe(objective="oscar2_center", composition="r_h"), "composes E·H·P_br"),
    (lambda: FitRecipe(composition="r_pbr_hg"), "needs a group size"),
    (lambda: FitRecipe(objective="cov_eig_hadamard_perhead", grouping="layer"), "has no shared form"),
    (lambda: FitRecipe(objective="ktk", center="k"), "needs the OSCAR targets"),
    (lambda: FitRecipe(objective="oscar2_center", refine=Refinement()), "leave objective at qqt_sst"),
    (lambda: FitRecipe(composition="r_h", refine=Refinement()), "leave composition unset"),
    (lambda: FitRecipe(keep=KeepRule(texts=("a.txt",))), "judges a refinement's result"),
    (lambda: FitRecipe(refine=Refinement(), keep=KeepRule(texts=())), "give at least one text file"),
    (lambda: FitRecipe(refine=Refinement(), keep=KeepRule(texts=("a.txt",), v_clip_ratio=1.5)),
     r"keep rule's clip \(--keep-k-clip-ratio / --keep-v-clip-ratio\): v_clip_ratio must be"),
    (lambda: Refinement(init="random"), "unknown init 'random'"),
    (lambda: Refinement(param="givens"), "param must be one of expm, cayley, signs"),
    (lambda: Refinement(int2kv=Int2KVConfig(lloyd_max=True)), "lloyd_max=True is not modelled"),
    (lambda: FitRecipe(min_tokens=0), "min_tokens must be a positive integer"),
    (lambda: FitRecipe(objective="hadamard", composition="r_h"), "data-free .*composition 'r_h' does not apply"),
    (lambda: FitRecipe(refine=Refinement(), keep=KeepRule(texts=("a.txt",), tokens=511)),
     r"keep tokens \(--keep-tokens\) must be an integer ≥ 512, got 511"),  # the command line's bound
    (lambda: FitRecipe(refine=Refinement(), keep=KeepRule(texts=("a.txt",), context=64)),
     r"keep context \(--keep-context\) must be an integer ≥ 512, got 64"),
])
def test_every_refusal_comes_from_check(make, match: str) -> None:
    with pytest.raises(FitError, match=match):
        make().check()


def test_a_refused_recipe_reads_nothing(tmp_path: Path) -> None:
    """The recipe is checked before the dump is opened: a missing dump is not what the error is about."""
    with pytest.raises(FitError, match="leave composition unset"):
        fit_dump(tmp_path / "no-such-dump", FitRecipe(composition="r_h", refine=Refinement()), tmp_path / "o")
    with pytest.raises(ConfigError, match="only objective 'hadamard'"):
        fit_dump(None, FitRecipe(), tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_the_data_free_baseline_needs_no_dump(tmp_path: Path, capsys) -> None:
    code, _, _ = run_cli(capsys, "fit", "--objective", "hadamard", "--num-layers", "3", "--head-dim", "64",
                         "--out", str(tmp_path / "cli"))
    assert code == 0
    fit_dump(None, FitRecipe(objective="hadamard"), tmp_path / "py", num_layers=3, head_dim=64)
    assert _sha(tmp_path / "cli") == _sha(tmp_path / "py") and len(_sha(tmp_path / "py")) == 2


def test_the_recipe_module_imports_no_torch() -> None:
    code = "import sys, rotationzoo.recipe; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-500:]


def test_layer_text_takes_spaces_and_counts_take_numpy_integers():
    """``--layers "3 - 7"`` reads as 3-7 (the parser shared by --layers and layers= had refused it), and a count
    given as a numpy integer is an integer (workers=np.int64(2) had been refused)."""
    import numpy as np

    from rotationzoo.files.limits import parse_layer_ids
    from rotationzoo.recipe import check_workers

    assert parse_layer_ids("3 - 7, 9") == [3, 4, 5, 6, 7, 9] and parse_layer_ids("3- 5") == [3, 4, 5]
    assert check_workers(np.int64(2)) == 2 and type(check_workers(np.int64(2))) is int
    with pytest.raises(FitError, match="workers must be an integer"):
        check_workers(np.float64(2.0))
