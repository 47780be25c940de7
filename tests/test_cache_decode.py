"""OscarInt2Cache decode steps read the codes directly (decode_attention_int2) and give the logits of
the dequantize-then-SDPA path, on tiny random Llama models."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rotationzoo.int2kv import Int2KVConfig  # noqa: E402
from rotationzoo.integrations.transformers import OscarKV, oscar_kv  # noqa: E402
from rotationzoo.integrations.transformers import cache as cache_module  # noqa: E402
from helpers import with_cache  # noqa: E402

D = 64
#: logits of the two paths (fp32 model): the same sums in another order
TOL = 1e-4


def tiny_llama(num_kv_heads=2, seed=0, layers=2, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=num_kv_heads, head_dim=D, max_position_embeddings=1024, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )
    return transformers.LlamaForCausalLM(cfg).eval().to(dtype)


def rotations(layers=2, heads=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (layers, D, D) if heads is None else (layers, heads, D, D)
    return torch.linalg.qr(torch.randn(shape, generator=g, dtype=torch.float64))[0].float()


class Counter:
    """Counts the cache's calls of decode_attention_int2 (the real function runs)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = cache_module.decode_attention_int2

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(cache_module, "decode_attention_int2", counted)


def decode(model, oscar, ids, prefill, chunk=1):
    """Logits of a prefill of ``prefill`` tokens then the rest ``chunk`` tokens at a time."""
    with torch.no_grad(), oscar_kv(model, oscar) as kv:
        cache = kv.new_cache()
        out = [model(ids[:, :prefill], **with_cache(cache)).logits[:, -1:]]
        for t in range(prefill, ids.shape[1], chunk):
            out.append(model(ids[:, t:t + chunk], **with_cache(cache)).logits)
    return torch.cat(out, dim=1), cache


CASES = {
    "G=d": dict(config=Int2KVConfig(prefix_tokens=3, recent_tokens=6, group_size=D)),
    "G=16 bisect fp16-scale": dict(config=Int2KVConfig(prefix_tokens=2, recent_tokens=5, group_size=16,
                                                       clip_search="bisect", scale_dtype="float16")),
    "per-KV-head, Lloyd-Max": dict(config=Int2KVConfig(prefix_tokens=4, recent_tokens=4, lloyd_max=True), heads=2),
    "GQA 4:1, no windows": dict(config=Int2KVConfig(prefix_tokens=0, recent_tokens=0, group_size=32), kv_heads=1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_decode_steps_equal_the_dequantize_path(case, monkeypatch):
    spec = CASES[case]
    model = tiny_llama(num_kv_heads=spec.get("kv_heads", 2), seed=3)
    heads = spec.get("heads")
    oscar = OscarKV(rotations(heads=heads), rotations(heads=heads, seed=2), config=spec["config"])
    ids = torch.randint(3, 96, (1, 36), generator=torch.Generator().manual_seed(4))
    count = Counter(monkeypatch)
    fast, cache = decode(model, oscar, ids, prefill=20)
    assert count.calls == 2 * (ids.shape[1] - 20), "every decode step of both layers reads the codes"
    assert cache.layers[0].stored_tokens()["int2"] == 36 - spec["config"].window_tokens
    monkeypatch.setattr(cache_module, "DECODE_MAX_QUERIES", 0)  # every forward: dequantize, then SDPA
    slow, _ = decode(model, oscar, ids, prefill=20)
    assert count.calls == 2 * (ids.shape[1] - 20)
    torch.testing.assert_close(fast, slow, atol=TOL, rtol=TOL)


def test_several_new_tokens_attend_causally(monkeypatch):
    """Speculative-style forwards of 3 tokens go through the kernel too, causal among themselves."""
    model = tiny_llama(seed=5)
    oscar = OscarKV(rotations(), rotations(seed=6), config=Int2KVConfig(prefix_tokens=2, recent_tokens=4))
    ids = torch.randint(3, 96, (1, 38), generator=torch.Generator().manual_seed(7))
    count = Counter(monkeypatch)
    fast, _ = decode(model, oscar, ids, prefill=14, chunk=3)
    assert count.calls == 2 * 9  # a first forward of at most 16 tokens takes the kernel as well
    monkeypatch.setattr(cache_module, "DECODE_MAX_QUERIES", 0)
    slow, _ = decode(model, oscar, ids, prefill=14, chunk=3)
    torch.testing.assert_close(fast, slow, atol=TOL, rtol=TOL)


def test_triton_backend_in_the_cache_matches_the_reference():
    pytest.importorskip("triton", reason="triton is not installed")
    model = tiny_llama(seed=8)
    conf = Int2KVConfig(prefix_tokens=2, recent_tokens=3, group_size=32)
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(9))
    ref, _ = decode(model, OscarKV(rotations(), rotations(seed=3), config=conf, backend="torch"), ids, prefill=14)
    tri, _ = decode(model, OscarKV(rotations(), rotations(seed=3), config=conf, backend="triton"), ids, prefill=14)
    torch.testing.assert_close(tri, ref, atol=TOL, rtol=TOL)


def test_padding_is_read_by_the_kernel_as_a_mask(monkeypatch):
    """A left-padded batch: the kernel reads the model's mask on the device (every step of both sequences
    goes through it) and gives the logits of the dequantize-then-SDPA path."""
    model = tiny_llama(seed=10)
    batch = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9, 10, 11, 12, 13], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]])
    mask = (batch != 0).long()
    count = Counter(monkeypatch)
    oscar = OscarKV(rotations(), rotations(seed=11), config=Int2KVConfig(prefix_tokens=2, recent_tokens=3))

    def run():
        with torch.no_grad(), oscar_kv(model, oscar) as kv:
            out = model.generate(batch, attention_mask=mask, **kv.cache_kwargs(), max_new_tokens=5, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
            single = model.generate(batch[1:], **kv.cache_kwargs(), max_new_tokens=5, do_sample=False)
        return out, single

    fast, single = run()
    assert count.calls == 2 * 5 * 2  # both batches: a 12-token prompt and 4 steps, in both layers
    assert torch.equal(fast.sequences[1], single[0])
    monkeypatch.setattr(cache_module, "DECODE_MAX_QUERIES", 0)  # every forward: dequantize, then SDPA
    slow, _ = run()
    torch.testing.assert_close(torch.stack(fast.scores), torch.stack(slow.scores), atol=TOL, rtol=TOL)


def left_padded(prompts):
    """``(ids, attention_mask)`` of ``prompts`` (1-D token tensors) left-padded to one length, as generate's
    callers batch prompts of different lengths."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = p, 1
    return ids, mask


def generate_rows(model, oscar, prompts, steps, **kwargs):
    """Greedy ``generate`` of the left-padded batch, and of each prompt alone: ``(batched, alone)`` as lists of
    ``(new tokens, scores [steps, vocab])`` per prompt."""
    ids, mask = left_padded(prompts)
    args = dict(max_new_tokens=steps, do_sample=False, output_scores=True, return_dict_in_generate=True, **kwargs)
    with torch.no_grad(), oscar_kv(model, oscar) as kv:
        out = model.generate(ids, attention_mask=mask, **kv.cache_kwargs(), **args)
        alone = [model.generate(p[None], **kv.cache_kwargs(), **args) for p in prompts]
    scores = torch.stack(out.scores)
    batched = [(out.sequences[row, ids.shape[1]:], scores[:, row]) for row in range(len(prompts))]
    return batched, [(a.sequences[0, len(p):], torch.stack(a.scores)[:, 0]) for a, p in zip(alone, prompts)]


@pytest.mark.parametrize("prefix,recent,lengths", [
    (4, 8, (40, 30)),      # the sink of the shorter prompt behind 10 padding tokens
    (4, 8, (40, 38, 29)),  # three paddings
    (16, 8, (20, 6)),      # a prompt shorter than the sink: the decode steps fill its sink
    (3, 2, (9, 30)),       # the padded row's tokens reach the INT2 tier during decode only
])
def test_each_sequence_of_a_left_padded_batch_decodes_as_alone(prefix, recent, lengths, monkeypatch):
    """A left-padded batch: every sequence keeps its own first prefix_tokens tokens in the sink and its last
    recent_tokens exact, so each row's logits are those of its prompt generated alone (the padding of another
    row changes nothing), in the decode steps that read the codes and in the dequantize path."""
    model = tiny_llama(seed=30)
    oscar = OscarKV(rotations(), rotations(seed=31), config=Int2KVConfig(prefix_tokens=prefix, recent_tokens=recent))
    g = torch.Generator().manual_seed(32)
    prompts = [torch.randint(3, 96, (n,), generator=g) for n in lengths]
    count = Counter(monkeypatch)
    for dequantize in (False, True):
        if dequantize:
            monkeypatch.setattr(cache_module, "DECODE_MAX_QUERIES", 0)  # every forward: dequantize, then SDPA
        batched, alone = generate_rows(model, oscar, prompts, steps=24)
        for (tokens, scores), (tokens1, scores1) in zip(batched, alone):
            assert torch.equal(tokens, tokens1)
            torch.testing.assert_close(scores, scores1, atol=TOL, rtol=TOL)
    assert count.calls >= 2 * 23  # the first pass's decode steps read the codes


@pytest.mark.parametrize("prefix,recent", [(4, 8), (16, 4), (3, 2)])
def test_the_simulation_keeps_each_sequences_own_sink_in_a_left_padded_batch(prefix, recent):
    """The decode-time simulation (a forward without the cache, as eval runs) reads each sequence's own first
    prefix tokens exactly, as the cache stores them: each row of a left-padded batch has its prompt's logits
    alone (it had read the shorter prompts' first tokens as INT2: 0.08-0.2 apart)."""
    model = tiny_llama(seed=40)
    g = torch.Generator().manual_seed(41)
    prompts = [torch.randint(3, 96, (n,), generator=g) for n in (60, 41, 30)]
    ids, mask = left_padded(prompts)
    oscar = OscarKV(rotations(), rotations(seed=42), config=Int2KVConfig(prefix_tokens=prefix, recent_tokens=recent))
    with torch.no_grad(), oscar_kv(model, oscar):
        batch = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=False)
        for row, p in enumerate(prompts):
            alone = model(p[None], use_cache=False).logits[0]
            torch.testing.assert_close(batch.logits[row, ids.shape[1] - len(p):], alone, atol=TOL, rtol=TOL)


def test_a_left_padded_batch_costs_the_memory_of_an_unpadded_one_and_prefills_in_chunks():
    """Each sequence's sink is its own prefix_tokens rows gathered after its padding: a batch of a long and a
    short prompt holds what two long prompts hold (no BF16 rows for the padding), a prefill in chunks
    smaller than the padding finds each sink, and a prompt of one sequence behind padding, short enough for
    the kernel path, decodes as alone."""
    model = tiny_llama(seed=46)
    oscar = OscarKV(rotations(), rotations(seed=47), config=Int2KVConfig(prefix_tokens=4, recent_tokens=8))
    g = torch.Generator().manual_seed(48)
    long, short = torch.randint(3, 96, (200,), generator=g), torch.randint(3, 96, (5,), generator=g)
    sizes = []
    for prompts in ([long, long], [long, short]):
        ids, mask = left_padded(prompts)
        with torch.no_grad(), oscar_kv(model, oscar) as kv:
            cache = kv.new_cache()
            model(ids, attention_mask=mask, **with_cache(cache))
        sizes.append((cache.nbytes(), cache.bits_per_element(), cache.layers[0].stored_tokens()))
    assert sizes[0] == sizes[1] and sizes[1][2] == {"prefix": 4, "int2": 188, "recent": 8}
    batched, alone = generate_rows(model, oscar, [torch.randint(3, 96, (30,), generator=g), short], steps=12,
                                   prefill_chunk_size=8)  # chunks of 8: the short prompt's first is all padding
    for (tokens, scores), (tokens1, scores1) in zip(batched, alone):
        assert torch.equal(tokens, tokens1)
        torch.testing.assert_close(scores, scores1, atol=TOL, rtol=TOL)
    ids1 = torch.cat([torch.zeros(5, dtype=torch.long), short])[None]
    with torch.no_grad(), oscar_kv(model, oscar) as kv:  # 10 tokens, 5 of them padding: the kernel path
        one = model.generate(ids1, attention_mask=(ids1 != 0).long(), **kv.cache_kwargs(), max_new_tokens=6,
                             do_sample=False, output_scores=True, return_dict_in_generate=True)
        ref = model.generate(short[None], **kv.cache_kwargs(), max_new_tokens=6, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    torch.testing.assert_close(torch.stack(one.scores), torch.stack(ref.scores), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("chunk", [1, 3])
def test_decode_steps_given_no_mask_after_a_padded_prefill_leave_the_padding_unread(chunk, monkeypatch):
    """Forwards without an attention mask after a left-padded prefill: the kernel path and the dequantize path
    both keep each sequence off its padding (the dequantize path had read the padding's slots: 0.38 apart)."""
    model = tiny_llama(seed=49)
    oscar = OscarKV(rotations(), rotations(seed=50), config=Int2KVConfig(prefix_tokens=4, recent_tokens=3))
    g = torch.Generator().manual_seed(51)
    ids, mask = left_padded([torch.randint(3, 96, (n,), generator=g) for n in (14, 3)])
    more = torch.randint(3, 96, (2, 9), generator=g)

    def run():
        with torch.no_grad(), oscar_kv(model, oscar) as kv:
            cache = kv.new_cache()
            model(ids, attention_mask=mask, **with_cache(cache))
            return torch.cat([model(more[:, t:t + chunk], **with_cache(cache)).logits for t in range(0, 9, chunk)], 1)

    fast = run()
    monkeypatch.setattr(cache_module, "DECODE_MAX_QUERIES", 0)  # every forward: dequantize, then SDPA
    torch.testing.assert_close(fast, run(), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("prefix,chunk", [(0, 1), (4, 1), (0, 20)])
def test_steps_without_a_mask_after_a_padded_prefill_give_each_sequence_alone(prefix, chunk):
    """After a left-padded prefill, forwards given no mask read each sequence as its prompt alone at the same
    positions, with a sink or without one (without one the padding's slots had been read: 0.09 apart), a token at
    a time (the kernel path) or in chunks past DECODE_MAX_QUERIES (the dequantize path, which had failed on an
    empty sink)."""
    model = tiny_llama(seed=30)
    oscar = OscarKV(rotations(), rotations(seed=31), config=Int2KVConfig(prefix_tokens=prefix, recent_tokens=8))
    g = torch.Generator().manual_seed(32)
    prompts = [torch.randint(3, 96, (n,), generator=g) for n in (40, 30)]
    ids, mask = left_padded(prompts)
    n = 9 if chunk == 1 else 40
    more, width = torch.randint(3, 96, (2, n), generator=g), ids.shape[1]
    with torch.no_grad(), oscar_kv(model, oscar) as kv:
        cache = kv.new_cache()
        model(ids, attention_mask=mask, **with_cache(cache))
        batched = torch.cat([model(more[:, t:t + chunk], **with_cache(cache)).logits for t in range(0, n, chunk)], 1)
        for row, p in enumerate(prompts):
            alone = kv.new_cache()
            model(p[None], **with_cache(alone), position_ids=torch.arange(width - len(p), width)[None])
            steps = [model(more[row:row + 1, t:t + chunk], **with_cache(alone),
                           position_ids=torch.arange(width + t, width + min(t + chunk, n))[None]).logits
                     for t in range(0, n, chunk)]
            torch.testing.assert_close(batched[row], torch.cat(steps, 1)[0], atol=TOL, rtol=TOL)


def test_a_forward_past_the_hook_assumes_no_padding_from_an_earlier_one():
    """The padding mask belongs to its forward: the inner model called directly afterwards (eval's hidden
    states do) reads no padding from the padded forward before it (it had: 0.39 apart)."""
    model = tiny_llama(seed=43)
    oscar = OscarKV(rotations(), rotations(seed=44), config=Int2KVConfig(prefix_tokens=4, recent_tokens=3))
    g = torch.Generator().manual_seed(45)
    ids, mask = left_padded([torch.randint(3, 96, (n,), generator=g) for n in (30, 10)])
    other = torch.randint(3, 96, (2, 30), generator=g)
    with torch.no_grad(), oscar_kv(model, oscar):
        before = model.model(other, use_cache=False).last_hidden_state
        model(ids, attention_mask=mask, use_cache=False)
        after = model.model(other, use_cache=False).last_hidden_state
    assert torch.equal(before, after)


def test_a_left_padded_batch_keeps_each_sequences_sink_through_beams_and_crop():
    """Beam search reorders the rows and their sinks together; cropping a left-padded batch's last tokens
    gives the logits of never having added them."""
    model = tiny_llama(seed=33)
    oscar = OscarKV(rotations(), rotations(seed=34), config=Int2KVConfig(prefix_tokens=4, recent_tokens=3))
    g = torch.Generator().manual_seed(35)
    prompts = [torch.randint(3, 96, (n,), generator=g) for n in (26, 12)]
    batched, alone = generate_rows(model, oscar, prompts, steps=10, num_beams=2)
    for (tokens, _), (tokens1, _) in zip(batched, alone):
        assert torch.equal(tokens, tokens1)
    ids, mask = left_padded(prompts)
    more = torch.randint(3, 96, (2, 3), generator=g)
    with torch.no_grad(), oscar_kv(model, oscar) as kv:
        cache = kv.new_cache()
        model(ids, attention_mask=mask, **with_cache(cache))
        ones = torch.ones(2, 3, dtype=torch.long)
        model(more, attention_mask=torch.cat([mask, ones], 1), **with_cache(cache))
        cache.crop(-3)
        again = model(more, attention_mask=torch.cat([mask, ones], 1), **with_cache(cache)).logits
        fresh = kv.new_cache()
        model(ids, attention_mask=mask, **with_cache(fresh))
        once = model(more, attention_mask=torch.cat([mask, ones], 1), **with_cache(fresh)).logits
    torch.testing.assert_close(again, once, atol=TOL, rtol=TOL)


def test_int2_buffers_grow_without_copying_each_step(monkeypatch):
    monkeypatch.setattr(cache_module, "INT2_GROWTH_TOKENS", 8)
    model = tiny_llama(seed=12, layers=1)
    oscar = OscarKV(None, None, config=Int2KVConfig(prefix_tokens=1, recent_tokens=2, group_size=16))
    ids = torch.randint(3, 96, (1, 70), generator=torch.Generator().manual_seed(13))
    with torch.no_grad(), oscar_kv(model, oscar) as kv:
        cache = kv.new_cache()
        model(ids[:, :4], **with_cache(cache))
        layer = cache.layers[0]
        buffers = set()
        for t in range(4, 70):
            model(ids[:, t:t + 1], **with_cache(cache))
            buffers.add(layer._buf["codes_k"].data_ptr())
    assert layer.stored_tokens() == {"prefix": 1, "int2": 67, "recent": 2}
    assert len(buffers) <= 8  # grown by at least 8 tokens or an eighth: a handful of copies in 66 steps
    assert cache.reserved_bytes() >= cache.nbytes()
    assert layer.codes_k.shape == (1, 2, 67, D // 4) and layer.sz_k.shape == (1, 2, 67, 8)


def _companion_sets(kind):
    import layouts

    from rotationzoo.files.rotation_set import RotationSet

    ids, g = (0, 1), torch.Generator().manual_seed(21)
    if kind == "centered":  # per-KV-head rotations with k_mean and v_mean
        k = RotationSet(layouts.orthogonal(2, 2, D, D, seed=1), ids, k_mean=3 * torch.randn(2, 2, D, generator=g))
        v = RotationSet(layouts.orthogonal(2, 2, D, D, seed=3), ids, v_mean=3 * torch.randn(2, 2, D, generator=g))
        return k, v
    inv_t = (lambda r: torch.linalg.inv(r.double()).transpose(-1, -2).float())
    rk, rv = layouts.well_conditioned(2, 2, D, D, seed=5), layouts.well_conditioned(2, D, D, seed=6)
    return (RotationSet(rk, ids, q_rotation=inv_t(rk), transform={"orthogonal": False}),
            RotationSet(rv, ids, o_rotation=inv_t(rv), transform={"orthogonal": False}))


@pytest.mark.parametrize("kind", ["centered", "non-orthogonal"])
def test_decode_steps_apply_the_files_companions(kind, monkeypatch):
    """k_mean / v_mean and q_rotation / o_rotation reach the codes path as they reach the dequantize path."""
    model = tiny_llama(seed=14)
    oscar = OscarKV.from_rotations(_companion_sets(kind), Int2KVConfig(prefix_tokens=2, recent_tokens=4, group_size=32))
    ids = torch.randint(3, 96, (1, 34), generator=torch.Generator().manual_seed(15))
    count = Counter(monkeypatch)
    fast, _ = decode(model, oscar, ids, prefill=20)
    assert count.calls == 2 * 14
    monkeypatch.setattr(cache_module, "DECODE_MAX_QUERIES", 0)
    slow, _ = decode(model, oscar, ids, prefill=20)
    torch.testing.assert_close(fast, slow, atol=TOL, rtol=TOL)
