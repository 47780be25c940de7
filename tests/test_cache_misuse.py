"""The INT2 cache and the OSCAR attention refuse misuse before they compute: used outside ``oscar_kv``,
rotations that a file could not hold (non-finite, not orthogonal), rotations made for another head_dim
or KV-head count; and they support what transformers expects of a cache (``reset``, ``crop``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rotationzoo.errors import EvaluationError  # noqa: E402
from rotationzoo.int2kv import Int2KVConfig  # noqa: E402
from rotationzoo.integrations.transformers import OscarKV, oscar_kv  # noqa: E402
from rotationzoo.integrations.transformers.cache import CROP_TOKENS  # noqa: E402

from test_transformers_int2 import tiny_llama  # noqa: E402
from helpers import with_cache  # noqa: E402

D = 64
pytestmark = pytest.mark.timeout(120)


def rotations(layers: int = 2, heads: int | None = None, d: int = D, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (layers, d, d) if heads is None else (layers, heads, d, d)
    return torch.linalg.qr(torch.randn(shape, generator=g, dtype=torch.float64))[0].float()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 96, (1, 48), generator=torch.Generator().manual_seed(5))


def small(**knobs) -> Int2KVConfig:
    return Int2KVConfig(**{"prefix_tokens": 2, "recent_tokens": 4, "group_size": 32, **knobs})


# -- used outside its block ------------------------------------------------------------------------


def test_forward_outside_oscar_kv_raises_before_any_logit(model, ids) -> None:
    """The first forward after the block raises (no logits from rotated keys read by the plain attention)
    and the cache keeps nothing."""
    with oscar_kv(model, OscarKV(rotations(), rotations(seed=2), config=small())) as kv:
        cache = kv.new_cache()
    out = None
    with torch.no_grad(), pytest.raises(EvaluationError, match=r"outside oscar_kv") as info:
        out = model(ids[:, :10], **with_cache(cache))
    assert out is None and "\n" not in str(info.value)
    assert all(layer.get_seq_length() == 0 for layer in cache.layers)


def test_cache_filled_in_its_block_refuses_a_later_forward(model, ids) -> None:
    with torch.no_grad(), oscar_kv(model, OscarKV(rotations(), rotations(seed=2), config=small())) as kv:
        cache = kv.new_cache()
        model(ids[:, :10], **with_cache(cache))
    with torch.no_grad(), pytest.raises(EvaluationError, match=r"outside oscar_kv"):
        model(ids[:, 10:11], **with_cache(cache))
    assert cache.get_seq_length() == 10


# -- rotations a file could not hold ---------------------------------------------------------------


@pytest.mark.parametrize("bad, what", [
    (lambda r: r.index_fill(1, torch.tensor([3]), float("nan")), "non-finite"),
    (lambda r: r.index_fill(2, torch.tensor([0]), float("inf")), "non-finite"),
    (lambda r: torch.zeros_like(r), "not orthogonal"),
    (lambda r: r * 1.01, "not orthogonal"),
])
def test_rotations_must_be_finite_and_orthogonal(bad, what) -> None:
    r = rotations()
    broken = r.clone()
    broken[1] = bad(r[1:2])[0]
    with pytest.raises(EvaluationError, match=what) as info:
        OscarKV(r, broken, config=small())
    assert "v_rotations: layer 1" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(EvaluationError, match=what):
        OscarKV(broken, None, config=small())


def test_a_non_orthogonal_transform_needs_its_inverse_companion() -> None:
    g = torch.Generator().manual_seed(3)
    m = rotations() + 0.05 * torch.randn(2, D, D, generator=g)
    inv_t = torch.linalg.inv(m.double()).transpose(-1, -2).float()
    with pytest.raises(EvaluationError, match="not orthogonal"):
        OscarKV(m, None, config=small())
    OscarKV(m, None, q_rotations=inv_t, config=small())  # accepted: the companion is the inverse transpose
    with pytest.raises(EvaluationError, match="inverse transpose"):
        OscarKV(m, None, q_rotations=rotations(seed=9), config=small())


def test_non_finite_means_are_refused() -> None:
    mean = torch.zeros(2, D)
    mean[0, 5] = float("nan")
    with pytest.raises(EvaluationError, match="k_mean holds non-finite"):
        OscarKV(rotations(), rotations(), k_mean=mean, config=small())


# -- rotations made for another model --------------------------------------------------------------


@pytest.mark.parametrize("path", ["cache", "simulation"])
@pytest.mark.parametrize("make, match", [
    (lambda: OscarKV(rotations(d=128), rotations(d=128), config=small()), r"head_dim 128.*head_dim 64"),
    (lambda: OscarKV(rotations(heads=1), rotations(heads=1), config=small()), r"1 per-KV-head K rotations.*2 KV heads"),
    (lambda: OscarKV(rotations(heads=4), rotations(heads=4), config=small()), r"4 per-KV-head K rotations.*2 KV heads"),
    (lambda: OscarKV(rotations(), rotations(), k_mean=torch.zeros(2, 3, D), config=small()),
     r"3 per-KV-head K means.*2 KV heads"),
])
def test_rotations_for_another_shape_fail_on_the_first_call(model, ids, path, make, match) -> None:
    """A typed one-line error on the first forward (the prefill), never mid-generation."""
    oscar = make()
    with torch.no_grad(), oscar_kv(model, oscar) as kv:
        cache = kv.new_cache() if path == "cache" else None
        with pytest.raises(EvaluationError, match=match) as info:
            model(ids[:, :3], **with_cache(cache)) if cache is not None else model(ids[:, :3], use_cache=False)
    assert "layer 0" in str(info.value) and "\n" not in str(info.value)
    if cache is not None:
        assert cache.get_seq_length() == 0


# -- what transformers expects of a cache ----------------------------------------------------------


def test_a_head_dim_the_kernels_do_not_run_fails_on_the_first_forward(ids) -> None:
    """head_dim 32 (the kernels run 64, 128, 256): the prefill is refused naming the layer, before a row is kept
    (it had been accepted and failed at the first decode step, one layer ahead of the other)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    m32 = transformers.LlamaForCausalLM(cfg).eval()
    oscar = OscarKV(rotations(d=32), rotations(d=32, seed=2), config=small(group_size=None))
    with torch.no_grad(), oscar_kv(m32, oscar) as kv:
        cache = kv.new_cache()
        with pytest.raises(EvaluationError, match=r"layer 0: .* head_dim 32 .* 64, 128, 256"):
            m32(ids[:, :20], **with_cache(cache))
        assert cache.get_seq_length() == 0 and all(layer.get_seq_length() == 0 for layer in cache.layers)


def test_reset_between_prompts_equals_a_fresh_cache(model, ids) -> None:
    oscar = OscarKV(rotations(), rotations(seed=2), config=small())
    with torch.no_grad(), oscar_kv(model, oscar) as kv:
        used = kv.new_cache()
        model.generate(ids[:, :12], **with_cache(used), max_new_tokens=8, do_sample=False)
        used.reset()
        assert used.get_seq_length() == 0
        again = model.generate(ids[:, 20:30], **with_cache(used), max_new_tokens=10, do_sample=False)
        fresh = model.generate(ids[:, 20:30], **kv.cache_kwargs(), max_new_tokens=10, do_sample=False)
    assert torch.equal(again, fresh)


def _state(layer) -> list[torch.Tensor]:
    out = [layer.sink_k, layer.sink_v, layer.recent_k, layer.recent_v, layer.codes_k, layer.sz_k, layer.codes_v,
           layer.sz_v]
    return [t if t is not None and t.numel() else torch.empty(0) for t in out]


@pytest.mark.parametrize("prefill, draft, remove", [
    (20, 5, 3),   # the draft demotes rows; some come back into the recent window
    (20, 5, 5),   # the whole last forward undone
    (3, 6, 4),    # a short sequence: the removed tokens reach into the sink
    (20, 1, 1),   # one decode step
    (10, 24, 20),  # a forward longer than a decode step (the prefill path)
])
def test_crop_undoes_the_last_forward_exactly(model, prefill, draft, remove) -> None:
    """crop(-n) after a forward of ``draft`` tokens leaves the state of never having seen the last n, bit for
    bit. The layer is fed the same key/value rows either way (a model's own rows may differ by rounding
    with how tokens are grouped into forwards: its matrix products follow their shapes)."""
    oscar = OscarKV(rotations(), rotations(seed=2), config=small())
    g = torch.Generator().manual_seed(prefill + draft)
    k, v = (torch.randn(1, 2, prefill + draft + 2, D, generator=g) for _ in range(2))
    keep = prefill + draft - remove

    def feed(layer, a: int, b: int) -> None:
        layer.update(k[:, :, a:b], v[:, :, a:b])
        layer.consumed = True  # what the OSCAR attention does with the keys it reads
        layer.pending = None

    with torch.no_grad(), oscar_kv(model, oscar) as kv:
        cropped, ref = kv.new_cache().layers[0], kv.new_cache().layers[0]
        feed(cropped, 0, prefill)
        feed(cropped, prefill, prefill + draft)
        cropped.crop(-remove)
        feed(ref, 0, prefill)
        if keep > prefill:
            feed(ref, prefill, keep)
        else:
            ref.crop(-(prefill - keep))
        assert cropped.get_seq_length() == ref.get_seq_length() == keep
        for layer in (cropped, ref):
            feed(layer, keep, keep + 2)  # and both go on alike
    for a, b in zip(_state(cropped), _state(ref)):
        assert torch.equal(a, b)


def test_crop_refuses_what_it_cannot_restore(model, ids) -> None:
    oscar = OscarKV(rotations(), rotations(seed=2), config=small())
    with torch.no_grad(), oscar_kv(model, oscar) as kv:
        cache = kv.new_cache()
        model(ids[:, :20], **with_cache(cache))
        model(ids[:, 20:23], **with_cache(cache))
        cache.crop(0)  # nothing to do
        with pytest.raises(EvaluationError, match=r"last forward \(3\)"):
            cache.crop(-4)
        with pytest.raises(EvaluationError, match="negative count"):
            cache.crop(10)
        assert cache.get_seq_length() == 23


def test_crop_after_a_long_prefill_is_bounded(model) -> None:
    """Only the newest CROP_TOKENS demoted rows are kept: a crop that needs more is refused."""
    oscar = OscarKV(rotations(), rotations(seed=2), config=Int2KVConfig(prefix_tokens=1, recent_tokens=2,
                                                                        group_size=32))
    n = CROP_TOKENS + 40
    ids = torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), oscar_kv(model, oscar) as kv:
        cache = kv.new_cache()
        model(ids, **with_cache(cache))
        layer = cache.layers[0]
        assert layer._demoted["k"].shape[2] == CROP_TOKENS
        with pytest.raises(EvaluationError, match="cannot remove"):
            cache.crop(-(CROP_TOKENS + 1))
        cache.crop(-CROP_TOKENS)  # the window refilled from the newest demoted rows
        assert cache.get_seq_length() == n - CROP_TOKENS
        assert layer.stored_tokens() == {"prefix": 1, "int2": n - CROP_TOKENS - 3, "recent": 2}


def test_prompt_lookup_decoding_runs_on_the_cache(model) -> None:
    """Prompt-lookup decoding verifies drafted tokens and crops the rejected ones."""
    oscar = OscarKV(rotations(), rotations(seed=2), config=small())
    prompt = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
    with torch.no_grad(), oscar_kv(model, oscar) as kv:
        cache = kv.new_cache()
        calls = []
        real = cache.crop
        cache.crop = lambda n: (calls.append(n), real(n))[1]
        out = model.generate(prompt, **with_cache(cache), max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=4)
    assert out.shape[1] == prompt.shape[1] + 12
    assert calls and cache.get_seq_length() == out.shape[1] - 1
    assert cache.batch_size == 1
