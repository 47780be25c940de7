"""The authors' rotation-file layouts, built from their specification (docs/format.md) as plain dicts,
the way their writers build them: V1, V1 + calibration, ragged V1, V2 per KV head, V3 (OSCAR-2) with
key centering and inverse companions, and the other artefacts a client meets (calibration moments and
rows, MLA latent rotations). Tensors are fp32 and seeded."""

from __future__ import annotations

from typing import Any

import torch

from rotationzoo.hadamard import hadamard_matrix


def orthogonal(*shape: int, seed: int = 0) -> torch.Tensor:
    """Random orthogonal ``[..., d, d]`` (fp32)."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(*shape, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)).float()


def well_conditioned(*shape: int, seed: int = 0) -> torch.Tensor:
    """A non-orthogonal invertible ``[..., d, d]``: an orthogonal matrix times a diagonal in [0.5, 2]."""
    g = torch.Generator().manual_seed(seed + 99)
    d = shape[-1]
    scale = 0.5 + 1.5 * torch.rand(*shape[:-2], 1, d, generator=g)
    return (orthogonal(*shape, seed=seed) * scale).float()


def calibration(tokens: int = 4096) -> dict[str, Any]:
    return {"generation_id": "g-0001", "model_path": "Qwen/Qwen3-8B", "model_revision": None,
            "prompt_sha256": "ab" * 32, "tokens": tokens, "max_tokens": 8192, "global_q_heads": 32,
            "global_kv_heads": 8, "tp_size": 2, "post_rope": True, "accumulator_dtype": "float64",
            "created_at_unix": 1760000000.5}


def v1(layers: int = 4, d: int = 16, *, seed: int = 0, objective: str = "qqt_r_h_pbr",
       with_calibration: bool = False, ids: list[int] | None = None) -> dict[str, Any]:
    """``compute_kv_rotation.py`` / the startup calibration: one ``[d, d]`` rotation and ``[d]`` eigenvalues per layer."""
    ids = ids if ids is not None else list(range(layers))
    rot = orthogonal(len(ids), d, d, seed=seed)
    out: dict[str, Any] = {"format_version": 1, "objective": objective, "source_grouping": "layer",
                           "layers": {lid: {"layer_id": lid, "rotation": rot[i].contiguous(),
                                            "eigenvalues": torch.rand(d).sort().values} for i, lid in enumerate(ids)}}
    if with_calibration:
        out["calibration"] = calibration()
    return out


def v1_ragged(dims: dict[int, int], *, seed: int = 0) -> dict[str, Any]:
    """Gemma-4-12B: head_dim per layer (sliding 256, full 512; small here)."""
    layers = {}
    for i, (lid, d) in enumerate(sorted(dims.items())):
        layers[lid] = {"layer_id": lid, "rotation": orthogonal(d, d, seed=seed + i), "eigenvalues": torch.rand(d)}
    return {"format_version": 1, "objective": "qqt_r_h_pbr", "source_grouping": "layer", "layers": layers}


def v2(layers: int = 4, heads: int = 2, d: int = 16, *, seed: int = 0) -> dict[str, Any]:
    """``fit_perhead_rotation.py``: ``[H_kv, d, d]`` per layer, no eigenvalues, the same objective on K and V."""
    rot = orthogonal(layers, heads, d, d, seed=seed)
    return {"format_version": 2, "objective": "cov_eig_hadamard_perhead", "source_grouping": "per_kv_head",
            "layers": {lid: {"layer_id": lid, "rotation": rot[lid].contiguous()} for lid in range(layers)}}


def v3_key(layers: int = 4, heads: int = 2, d: int = 16, *, seed: int = 0, shared: bool = False,
           centered: bool = True, orthogonal_transform: bool = True) -> dict[str, Any]:
    """``fit_oscar2_variants.py``'s K file: ``rotation`` ``[H, d, d]`` (``[d, d]`` shared), ``eigenvalues``,
    ``k_mean`` (centered), ``q_rotation = R^{-T}`` (non-orthogonal transforms)."""
    lead = () if shared else (heads,)
    entries = {}
    for lid in range(layers):
        r = (orthogonal if orthogonal_transform else well_conditioned)(*lead, d, d, seed=seed + lid)
        e: dict[str, Any] = {"layer_id": lid, "rotation": r.contiguous(), "eigenvalues": torch.rand(*lead, d)}
        if not orthogonal_transform:
            e["q_rotation"] = torch.linalg.inv(r.double()).transpose(-1, -2).float().contiguous()
        if centered:
            e["k_mean"] = torch.randn(*lead, d, generator=torch.Generator().manual_seed(seed + 50 + lid))
        entries[lid] = e
    variant = "center" if centered else ("perhead" if orthogonal_transform else "whiten")
    return {"format_version": 3, "source_grouping": "layer" if shared else "head", "calibration": calibration(),
            "objective": f"oscar2_{variant}",
            "transform": {"key": variant, "centered": centered, "orthogonal": orthogonal_transform},
            "layers": entries}


def v3_value(layers: int = 4, heads: int = 2, d: int = 16, *, seed: int = 1, shared: bool = False,
             orthogonal_transform: bool = True) -> dict[str, Any]:
    """The matching V file: ``o_rotation = R_V^{-T}`` when the value transform is not orthogonal."""
    lead = () if shared else (heads,)
    entries = {}
    for lid in range(layers):
        r = (orthogonal if orthogonal_transform else well_conditioned)(*lead, d, d, seed=seed + lid)
        e: dict[str, Any] = {"layer_id": lid, "rotation": r.contiguous(), "eigenvalues": torch.rand(*lead, d)}
        if not orthogonal_transform:
            e["o_rotation"] = torch.linalg.inv(r.double()).transpose(-1, -2).float().contiguous()
        entries[lid] = e
    metric = "pre_wo" if orthogonal_transform else "post_wo"
    return {"format_version": 3, "source_grouping": "layer" if shared else "head", "calibration": calibration(),
            "objective": f"oscar2_v_{metric}", "transform": {"value": metric, "orthogonal": orthogonal_transform},
            "layers": entries}


def moments(layers: int = 2, heads: int = 2, d: int = 8) -> dict[str, Any]:
    """``oscar_moments_rank<r>.pt``: also ``format_version 2`` with a ``layers`` dict, but statistics."""
    eye = torch.eye(d, dtype=torch.float64).expand(heads, d, d).clone()
    return {"format_version": 2, "model_path": "x", "tp_rank": 0, "tp_size": 1, "local_kv_heads": heads,
            "global_kv_heads": heads, "head_dim": d,
            "layers": {lid: {"M_q": eye, "k_sum": torch.zeros(heads, d, dtype=torch.float64), "M_k": eye,
                             "S_v": eye, "rho": None, "q_scaling": 1.0, "count": 100} for lid in range(layers)}}


def rows(layers: int = 2, d: int = 8) -> dict[str, Any]:
    """``oscar_rows_rank<r>.pt``: sampled rows."""
    return {"format_version": 1,
            "layers": {lid: {"k": torch.randn(10, 2, d), "v": torch.randn(10, 2, d), "q_samples": torch.randn(5, 4, d),
                             "positions": torch.arange(10), "q_scaling": 1.0, "count": 10} for lid in range(layers)}}


def mla_latent(rank: int = 16) -> dict[str, Any]:
    """One ``layer_<id>.pt`` of an MLA latent-rotation folder (no container, no format_version)."""
    return {"rotation": hadamard_matrix(rank, dtype=torch.float32), "mean": torch.zeros(rank),
            "eigenvalues": torch.ones(rank), "transform": {"latent": "joint", "centered": True, "orthogonal": True}}
