"""OscarInt2Cache in a decode step reads nothing on the host (masks go to the kernel as they are), keeps
only the window of a sliding-window layer, and reports its batch size as transformers' Cache API does."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from rotationzoo.int2kv import Int2KVConfig  # noqa: E402
from rotationzoo.integrations.transformers import OscarKV, oscar_kv  # noqa: E402
from rotationzoo.integrations.transformers import cache as cache_module  # noqa: E402
from rotationzoo.kernels import native  # noqa: E402

from test_cache_decode import TOL, Counter, decode, generate_rows, rotations, tiny_llama  # noqa: E402
from helpers import with_cache  # noqa: E402

D = 64
#: aten operators that copy a tensor's value to the host (a device synchronisation on a GPU)
HOST_READS = ("aten._local_scalar_dense", "aten.equal", "aten.is_nonzero", "aten.item")


class HostReads(TorchDispatchMode):
    """Records the operators of :data:`HOST_READS` run while active."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.startswith(HOST_READS):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def tiny_qwen2(window: int, seed: int = 0):
    """Two layers: full attention, then a sliding window of ``window`` tokens."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=D, max_position_embeddings=1024, use_sliding_window=True, sliding_window=window,
        max_window_layers=1, layer_types=["full_attention", "sliding_attention"], pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    return transformers.Qwen2ForCausalLM(cfg).eval()


@pytest.mark.skipif(not native.native_available(), reason="the C++ kernels (no host reads) cannot be built here")
@pytest.mark.parametrize("impl,chunk,padded", [("eager", 1, False), ("sdpa", 3, False), ("sdpa", 1, True)])
def test_a_decode_step_reads_no_tensor_on_the_host(impl, chunk, padded, monkeypatch):
    """The cache's update and attend in decode steps with a materialized mask (the eager attention's,
    draft tokens', a padded batch's) run no operator that copies a value to the host."""
    model = tiny_llama(seed=20)
    model.set_attn_implementation(impl)
    oscar = OscarKV(rotations(), rotations(seed=21), config=Int2KVConfig(prefix_tokens=2, recent_tokens=4))
    layer_cls = cache_module.cache_classes()["OscarInt2Layer"]
    mode = HostReads()
    for name in ("update", "attend"):
        real = getattr(layer_cls, name)

        def watched(self, *args, _real=real, **kwargs):
            with mode:
                return _real(self, *args, **kwargs)

        monkeypatch.setattr(layer_cls, name, watched)
    count = Counter(monkeypatch)
    ids = torch.randint(3, 96, (2, 30), generator=torch.Generator().manual_seed(22))
    mask = torch.ones_like(ids)
    if padded:
        ids[0, :3], mask[0, :3] = 0, 0
    with torch.no_grad(), oscar_kv(model, oscar) as kv:
        cache = kv.new_cache()
        model(ids[:, :20], attention_mask=mask[:, :20], **with_cache(cache))
        mode.seen.clear()
        for t in range(20, 30, chunk):
            model(ids[:, t:t + chunk], attention_mask=mask[:, :t + chunk], **with_cache(cache))
    assert count.calls >= 2 * (10 // chunk)  # the steps went through the kernel
    assert mode.seen == [], sorted(set(mode.seen))


@pytest.mark.parametrize("chunk", [1, 3])
def test_a_sliding_layer_without_int2_rows_is_the_dynamic_cache(chunk):
    """Windows that hold every token (nothing quantized, fp32 rows, identity rotations): the logits of
    transformers' own sliding-window cache, step by step, while the sliding layer holds W − 1 tokens."""
    window = 8
    model = tiny_qwen2(window, seed=23)
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(24))
    eye = torch.eye(D).expand(2, D, D).contiguous()
    oscar = OscarKV(eye, eye, config=Int2KVConfig(prefix_tokens=2, recent_tokens=64, hp_dtype="float32"))
    with torch.no_grad():
        dyn = transformers.DynamicCache(config=model.config)
        want = [model(ids[:, :12], **with_cache(dyn)).logits[:, -1:]]
        for t in range(12, 30, chunk):
            want.append(model(ids[:, t:t + chunk], **with_cache(dyn)).logits)
    got, cache = decode(model, oscar, ids, prefill=12, chunk=chunk)
    torch.testing.assert_close(got, torch.cat(want, dim=1), atol=1e-5, rtol=1e-5)
    full, sliding = cache.layers
    assert not full.is_sliding and sliding.is_sliding and cache.is_sliding == [False, True]
    assert sum(full.stored_tokens().values()) == 30
    assert sum(sliding.stored_tokens().values()) == window - 1
    assert sliding.get_mask_sizes(1) == (window, 30 - window + 1)


def test_a_sliding_layer_keeps_only_its_window_of_int2_rows(monkeypatch):
    """With INT2 rows: the sliding layer drops the sink and the front of its INT2 tier (no copy), its
    decode steps read the codes with the model's sliding mask, and give the dequantize path's logits."""
    window = 24
    model = tiny_qwen2(window, seed=25)
    oscar = OscarKV(rotations(), rotations(seed=26), config=Int2KVConfig(prefix_tokens=2, recent_tokens=4))
    ids = torch.randint(3, 96, (1, 60), generator=torch.Generator().manual_seed(27))
    monkeypatch.setattr(cache_module, "INT2_GROWTH_TOKENS", 8)
    count = Counter(monkeypatch)
    fast, cache = decode(model, oscar, ids, prefill=20)
    assert count.calls == 2 * 40
    sliding = cache.layers[1]
    assert sliding.stored_tokens() == {"prefix": 0, "int2": window - 1 - 4, "recent": 4}
    assert cache.layers[0].stored_tokens() == {"prefix": 2, "int2": 60 - 6, "recent": 4}
    assert sliding._buf["codes_k"].shape[2] <= window + 8  # grown from the window's first token: bounded
    assert cache.layers[0]._buf["codes_k"].shape[2] >= 54
    monkeypatch.setattr(cache_module, "DECODE_MAX_QUERIES", 0)  # every forward: dequantize, then SDPA
    slow, _ = decode(model, oscar, ids, prefill=20)
    torch.testing.assert_close(fast, slow, atol=1e-4, rtol=1e-4)


def test_a_left_padded_batch_on_a_sliding_layer_decodes_each_sequence_as_alone():
    """The sliding layer drops the same token slots as transformers' sliding cache, from each sequence's own
    sink and the shared INT2 tier: each row of a left-padded batch gets the logits of its prompt alone, while
    the window moves past the sink."""
    window = 24
    model = tiny_qwen2(window, seed=36)
    oscar = OscarKV(rotations(), rotations(seed=37), config=Int2KVConfig(prefix_tokens=4, recent_tokens=4))
    g = torch.Generator().manual_seed(38)
    prompts = [torch.randint(3, 96, (n,), generator=g) for n in (18, 9)]
    batched, alone = generate_rows(model, oscar, prompts, steps=30)
    for (tokens, scores), (tokens1, scores1) in zip(batched, alone):
        assert torch.equal(tokens, tokens1)
        torch.testing.assert_close(scores, scores1, atol=TOL, rtol=TOL)


def test_batch_size_follows_the_cache_api():
    """-1 before any forward (no layer holds a batch) and after reset, the batch once tokens are held."""
    model = tiny_llama(seed=28)
    oscar = OscarKV(rotations(), rotations(seed=29), config=Int2KVConfig(prefix_tokens=2, recent_tokens=4))
    with torch.no_grad(), oscar_kv(model, oscar) as kv:
        cache = kv.new_cache()
        assert cache.batch_size == -1
        model(torch.randint(3, 96, (3, 9)), **with_cache(cache))
        assert cache.batch_size == 3
        cache.reset()
        assert cache.batch_size == -1


def test_visible_never_pairs_one_masks_reference_with_anothers_booleans(monkeypatch):
    """Another thread's call landing between the reads of the one-entry cache must not hand this call the
    other mask's booleans (forced here: the first read of the cache runs a call with another mask)."""
    from rotationzoo.integrations.transformers import windows

    low = torch.finfo(torch.float32).min
    mine = torch.tensor([0.0, low, 0.0, low])
    other = torch.tensor([low, 0.0, low, 0.0])
    assert torch.equal(windows.visible(mine), mine == 0)  # cached now

    class Interleaved(list):
        busy = False

        def __getitem__(self, i):
            got = super().__getitem__(i)
            if not Interleaved.busy:
                Interleaved.busy = True
                windows.visible(other)  # the other thread's call
                Interleaved.busy = False
            return got

    monkeypatch.setattr(windows, "_LAST_MASK", Interleaved(windows._LAST_MASK))
    assert torch.equal(windows.visible(mine), mine == 0)
    assert torch.equal(windows.visible(other), other == 0)
