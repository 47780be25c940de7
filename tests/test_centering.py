"""Key and value centering and non-orthogonal transforms are exact for attention: with nothing
quantized, a pair with ``k_mean`` / ``v_mean`` / ``q_rotation`` / ``o_rotation`` gives the model's own
logits, in the one-shot simulation and through the real cache."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import layouts  # noqa: E402
from test_transformers_int2 import D, cfg, tiny_llama  # noqa: E402
from helpers import with_cache  # noqa: E402

from rotationzoo.integrations.transformers import OscarKV, oscar_kv  # noqa: E402
from rotationzoo.files.rotation_set import RotationSet  # noqa: E402

L, H = 2, 2


@pytest.fixture(scope="module")
def model():
    return tiny_llama(num_kv_heads=H)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(7))


def _mean(seed: int, *shape: int) -> torch.Tensor:
    return 3.0 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def sets(kind: str) -> tuple[RotationSet, RotationSet]:
    ids = tuple(range(L))
    if kind == "centered":
        k = RotationSet(layouts.orthogonal(L, H, D, D, seed=1), ids, k_mean=_mean(2, L, H, D))
        v = RotationSet(layouts.orthogonal(L, H, D, D, seed=3), ids, v_mean=_mean(4, L, H, D))
    elif kind == "centered_shared":
        k = RotationSet(layouts.orthogonal(L, D, D, seed=1), ids, k_mean=_mean(2, L, D))
        v = RotationSet(layouts.orthogonal(L, D, D, seed=3), ids, v_mean=_mean(4, L, D))
    else:  # non-orthogonal key and value transforms with their inverse transposes
        rk, rv = layouts.well_conditioned(L, H, D, D, seed=5), layouts.well_conditioned(L, D, D, seed=6)
        inv_t = (lambda r: torch.linalg.inv(r.double()).transpose(-1, -2).float())
        k = RotationSet(rk, ids, q_rotation=inv_t(rk), transform={"orthogonal": False})
        v = RotationSet(rv, ids, o_rotation=inv_t(rv), transform={"orthogonal": False})
    return k, v


@pytest.mark.parametrize("kind", ["centered", "centered_shared", "inverse"])
def test_nothing_quantized_gives_the_models_logits(model, ids, kind) -> None:
    k, v = sets(kind)
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        oscar = OscarKV.from_rotations((k, v), cfg(prefix_tokens=0, recent_tokens=0), quantize_k=False,
                                       quantize_v=False)
        with oscar_kv(model, oscar) as kv:
            sim = model(ids, use_cache=False).logits
            cached = model(ids, **kv.cache_kwargs()).logits
    torch.testing.assert_close(sim, ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(cached, ref, atol=2e-5, rtol=0)


def test_decoding_token_by_token_through_the_cache_is_exact_too(model, ids) -> None:
    k, v = sets("centered")
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits[:, -1]
        oscar = OscarKV.from_rotations((k, v), cfg(prefix_tokens=0, recent_tokens=0), quantize_k=False,
                                       quantize_v=False)
        with oscar_kv(model, oscar) as kv:
            cache = kv.new_cache()
            model(ids[:, :-1], **with_cache(cache))
            last = model(ids[:, -1:], **with_cache(cache)).logits[:, -1]
    torch.testing.assert_close(last, ref, atol=2e-5, rtol=0)


def test_centering_changes_what_is_quantized(model, ids) -> None:
    """With INT2 on, the centered keys are what gets quantized: the logits differ from the uncentered ones."""
    k, v = sets("centered")
    with torch.no_grad():
        outs = []
        for kk in (k, k.without("k_mean")):
            oscar = OscarKV.from_rotations((kk, v.without("v_mean")), cfg(prefix_tokens=4, recent_tokens=4))
            with oscar_kv(model, oscar):
                outs.append(model(ids, use_cache=False).logits)
    assert (outs[0] - outs[1]).abs().max() > 1e-3
