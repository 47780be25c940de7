"""Per-TP-rank dumps (``layer_<L>/rank_<r>/{q,k,v}/<chunk>.pt``): merged exactly, partial ones refused.

Each per-rank dump here is cut from a whole-layer dump by the server's sharding rule (rank ``r`` holds
query heads ``[r·hq, (r+1)·hq)`` and the KV heads of :func:`rotationzoo.sharding.kv_heads_per_rank`,
replicated when there are fewer KV heads than ranks), so that fitting it must give the whole dump's
rotations bit for bit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rotationzoo.errors import DumpError
from rotationzoo.fit import fit_rotations, open_dump, write_dump
from rotationzoo.sharding import kv_heads_per_rank

from test_dump_hardening import refused

D = 16


def _whole(root: Path, hq: int, hkv: int, layers=(0, 2), sizes=(6, 200, 180)) -> Path:
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    chunks = {}
    for lid in layers:
        chunks[lid] = []
        for n in sizes:
            mix = torch.linalg.qr(torch.randn(D, D, generator=g))[0] * torch.linspace(0.5, 3.0, D)
            chunks[lid].append({"q": (torch.randn(n, hq, D, generator=g) @ mix).bfloat16(),
                                "k": (torch.randn(n, hkv, D, generator=g) @ mix + 1.0).bfloat16(),
                                "v": (torch.randn(n, hkv, D, generator=g) @ mix.T - 0.5).bfloat16(),
                                "seq_lens": [n]})
    return write_dump(root, chunks)


def _shard(whole: Path, out: Path, tp: int, hq: int, hkv: int) -> Path:
    """The per-rank layout of ``whole``, as ``tp`` ranks of the server write it (seq_lens on every rank)."""
    kv = kv_heads_per_rank(hkv, tp)
    local_q = hq // tp
    for layer in sorted(whole.glob("layer_*")):
        for r in range(tp):
            heads = {"q": list(range(r * local_q, (r + 1) * local_q)), "k": list(kv[r]), "v": list(kv[r])}
            for kind in ("q", "k", "v", "seq_lens"):
                dst = out / layer.name / f"rank_{r}" / kind
                dst.mkdir(parents=True)
                for f in (layer / kind).glob("*.pt"):
                    t = torch.load(f, weights_only=True)
                    torch.save(t if kind == "seq_lens" else t[:, heads[kind]].clone(), dst / f.name)
    return out


@pytest.mark.parametrize("hq,hkv,tp", [(8, 4, 2), (8, 2, 4), (8, 1, 4)])
@pytest.mark.parametrize("objective", ["qqt_sst", "oscar2_center", "cov_eig_hadamard_perhead"])
def test_a_per_rank_dump_fits_exactly_like_the_same_data_in_one_rank(tmp_path, hq, hkv, tp, objective):
    whole = _whole(tmp_path / "whole", hq, hkv)
    ranked = _shard(whole, tmp_path / "ranked", tp, hq, hkv)
    a, b = fit_rotations(whole, objective), fit_rotations(ranked, objective)
    assert open_dump(ranked).tp_size == tp and open_dump(whole).tp_size is None
    assert b.num_kv_heads == hkv and b.num_q_heads == a.num_q_heads and b.tokens == a.tokens
    assert b.num_q_heads == (None if objective == "cov_eig_hadamard_perhead" else hq)  # V2 never reads queries
    assert b.source["tp_size"] == tp and b.k.calibration["tp_size"] == tp
    for side in ("k", "v"):
        ra, rb = getattr(a, side), getattr(b, side)
        assert torch.equal(ra.rotations, rb.rotations)
        for f in ("k_mean", "v_mean", "eigenvalues"):
            x, y = getattr(ra, f), getattr(rb, f)
            assert (x is None and y is None) or torch.equal(x, y)


def test_merged_chunks_are_the_whole_layers(tmp_path):
    whole = _whole(tmp_path / "whole", 8, 2)
    ranked = open_dump(_shard(whole, tmp_path / "ranked", 4, 8, 2))
    one = open_dump(whole)
    for kind in ("q", "k", "v"):
        assert torch.equal(ranked.load(2, kind, 1), one.load(2, kind, 1))
        assert ranked.meta(2, kind, 1).shape == one.meta(2, kind, 1).shape
    assert ranked.seq_lens(2, 1) == [200] and ranked.prompt_count() == 3


@pytest.fixture
def ranked(tmp_path) -> Path:
    whole = _whole(tmp_path / "whole", 8, 2)
    return _shard(whole, tmp_path / "ranked", 4, 8, 2)


def test_a_missing_rank_is_refused_in_one_line(ranked, tmp_path):
    for case, rank, layers, match in [("middle", 1, (0,), r"layer_0: rank_1 is missing \(found rank_0, rank_2, rank_3\)"),
                                      ("last, one layer", 3, (2,), r"layer 2 has 3 rank folders but layer 0 has 4"),
                                      ("first", 0, (0, 2), r"rank_0 is missing")]:
        d = tmp_path / case
        shutil.copytree(ranked, d)
        for lid in layers:
            shutil.rmtree(d / f"layer_{lid}" / f"rank_{rank}")
        refused(lambda: fit_rotations(d), match, error=DumpError)
    # the last rank gone from every layer: only the expected TP size can tell
    d = tmp_path / "last everywhere"
    shutil.copytree(ranked, d)
    for lid in (0, 2):
        shutil.rmtree(d / f"layer_{lid}" / "rank_3")
    refused(lambda: fit_rotations(open_dump(d, tp_size=4)), r"3 rank folders per layer, but the dump was made with "
                                                           r"tp_size=4: ranks are missing", error=DumpError)
    (d / "rotationzoo_dump.json").write_text(json.dumps({"tp_size": 4}))
    refused(lambda: fit_rotations(d), r"tp_size=4: ranks are missing", error=DumpError)


def test_cli_refuses_a_removed_rank_with_one_line(ranked, tmp_path, capsys):
    from rotationzoo.cli.main import main

    code = main(["fit", "--dump", str(ranked), "--out", str(tmp_path / "out"), "--tp-size", "5"])
    assert code != 0 and "tp_size=5" in capsys.readouterr().err
    shutil.rmtree(ranked / "layer_2" / "rank_2")
    code = main(["fit", "--dump", str(ranked), "--out", str(tmp_path / "out"), "--objective", "oscar2_center"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "\n" not in err and "rank_2 is missing" in err and not (tmp_path / "out").exists()


def test_ranks_that_disagree_are_refused(ranked, tmp_path):
    def variant(name: str) -> Path:
        d = tmp_path / name
        shutil.copytree(ranked, d)
        return d

    d = variant("replica differs")  # ranks 0 and 1 replicate KV head 0: change chunk 2 of rank 1 only
    t = torch.load(d / "layer_0/rank_1/k/2.pt", weights_only=True)
    t[5, 0, 3] += 1
    torch.save(t, d / "layer_0/rank_1/k/2.pt")
    refused(lambda: fit_rotations(d), r"rank 1 holds the same KV head as rank 0 \(replicated over 2 ranks\) but its k "
                                      r"chunk 2 differs", limit=30, error=DumpError)
    d = variant("lacks a chunk")
    for kind in ("q", "k", "v", "seq_lens"):
        (d / "layer_2/rank_3" / kind / "2.pt").unlink()
    refused(lambda: fit_rotations(d), r"layer_2/rank_3/q: lacks chunk\(s\) 2 that rank_0 holds", error=DumpError)
    d = variant("token counts")
    t = torch.load(d / "layer_0/rank_2/q/1.pt", weights_only=True)
    torch.save(t[:150].clone(), d / "layer_0/rank_2/q/1.pt")
    refused(lambda: fit_rotations(d), r"rank_2/q/1.pt: 150 tokens, but rank 0's shard of the chunk has 200",
            error=DumpError)
    d = variant("mixed")
    shutil.copytree(d / "layer_0/rank_0/q", d / "layer_0/q")
    refused(lambda: fit_rotations(d), r"layer_0: holds both rank_<r>/ folders and q/", error=DumpError)
    d = variant("uneven replicas")  # rank 3 a copy of rank 2's K and V: runs of 2 and 1... then 1
    for kind in ("k", "v"):
        for f in (d / "layer_2/rank_1" / kind).glob("*.pt"):
            shutil.copy(d / "layer_2/rank_2" / kind / f.name, f)
    refused(lambda: fit_rotations(d), r"repeat in runs of 1, 3 ranks", limit=30, error=DumpError)


def test_partial_dumps_too_few_tokens_or_no_chunks(ranked, tmp_path):
    refused(lambda: fit_rotations(ranked, min_tokens=1000), r"layer 0: 380 tokens .*fewer than min_tokens=1000")
    assert fit_rotations(ranked, min_tokens=380).token_count == 380  # the minimum is overridable
    d = tmp_path / "empty"
    shutil.copytree(ranked, d)
    for r in range(4):
        for kind in ("q", "k", "v", "seq_lens"):
            for f in (d / f"layer_2/rank_{r}" / kind).glob("*.pt"):
                f.unlink()
    refused(lambda: fit_rotations(d), r"layer_2: empty layer: no <chunk>.pt files", error=DumpError)


def test_output_gradients_in_a_per_rank_dump_are_refused(ranked):
    """The fisher loss reads gradients from whole-layer dumps only: in rank folders they are named, not merged."""
    from rotationzoo.fit import samples_from_dump

    assert not open_dump(ranked).has_grads(0)
    (ranked / "layer_0" / "rank_1" / "g").mkdir()
    with pytest.raises(DumpError, match=r"layer_0: output gradients \(g/\) in a per-rank dump"):
        samples_from_dump(ranked, max_tokens=256, block_size=128, grads=True)
    assert samples_from_dump(ranked, max_tokens=256, block_size=128).layers[0].grads() is None
