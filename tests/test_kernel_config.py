"""The kernels take the INT2-KV settings as one Int2KVConfig; loose keywords still work, and a keyword
given with a config must repeat the config's value."""

from __future__ import annotations

import pytest
import torch

from rotationzoo.errors import KernelInputError
from rotationzoo.int2kv import Int2KVConfig
from rotationzoo.kernels import dequantize_int2, fake_quantize_int2, quantize_int2, quantize_int2_into

DT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CONFIGS = [
    Int2KVConfig(),
    Int2KVConfig(k_clip_ratio=0.9, v_clip_ratio=0.5, group_size=16, scale_dtype="bfloat16", clip_search="bisect"),
    Int2KVConfig(lloyd_max=True, scale_dtype="float16", v_clip_ratio=0.0),
]


def rows(seed=0, n=48, d=64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, d, generator=g)
    x[..., :3] *= 6
    return x.to(torch.bfloat16)


def loose(cfg: Int2KVConfig, side: str) -> dict:
    return dict(clip_ratio=cfg.clip_ratio(side), group_size=cfg.group_size, lloyd_max=cfg.lloyd_max,
                scale_dtype=DT[cfg.scale_dtype], clip_search=cfg.clip_search)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.label())
@pytest.mark.parametrize("side", ["k", "v"])
def test_config_means_its_keywords(cfg, side):
    x = rows()
    codes, sz = quantize_int2(x, config=cfg, side=side, backend="torch")
    want_c, want_s = quantize_int2(x, **loose(cfg, side), backend="torch")
    assert torch.equal(codes, want_c) and torch.equal(sz, want_s)
    other = "v" if side == "k" else "k"
    if cfg.clip_ratio(other) != cfg.clip_ratio(side):  # side picks the clip ratio
        assert not torch.equal(quantize_int2(x, config=cfg, side=other, backend="torch")[0], codes)
    back = dequantize_int2(codes, sz, config=cfg, dtype=torch.float32, backend="torch")
    assert torch.equal(back, dequantize_int2(codes, sz, dtype=torch.float32, backend="torch"))
    fake = fake_quantize_int2(x, config=cfg, side=side, dtype=torch.float32, backend="torch")
    assert torch.equal(fake, back)
    cbuf = torch.zeros(60, 2, 16, dtype=torch.uint8)
    sbuf = torch.zeros(60, 2, sz.shape[-1], dtype=DT[cfg.scale_dtype])
    loc = torch.arange(x.shape[0]) + 5
    quantize_int2_into(x, loc, cbuf, sbuf, config=cfg, side=side, backend="torch")
    assert torch.equal(cbuf[5:53], codes) and torch.equal(sbuf[5:53], sz)


def test_no_config_keeps_the_old_defaults():
    x = rows(1)
    codes, sz = quantize_int2(x, backend="torch")
    want = quantize_int2(x, clip_ratio=0.0, group_size=None, lloyd_max=False, scale_dtype=torch.float32,
                         clip_search="exact", backend="torch")
    assert torch.equal(codes, want[0]) and torch.equal(sz, want[1]) and sz.dtype == torch.float32


def test_keywords_that_repeat_the_config_are_accepted():
    cfg = Int2KVConfig()
    x = rows(2)
    want = quantize_int2(x, config=cfg, backend="torch")
    got = quantize_int2(x, config=cfg, clip_ratio=0.96, group_size=64, lloyd_max=False, scale_dtype=torch.float32,
                        clip_search="exact", backend="torch")
    assert torch.equal(got[0], want[0])
    assert torch.equal(quantize_int2(x, config=cfg, side="v", clip_ratio=0.92, backend="torch")[0],
                       quantize_int2(x, clip_ratio=0.92, backend="torch")[0])


@pytest.mark.parametrize("keyword,value,field", [
    ("clip_ratio", 0.5, "k_clip_ratio"), ("group_size", 32, "group_size"), ("lloyd_max", True, "lloyd_max"),
    ("scale_dtype", torch.float16, "scale_dtype"), ("clip_search", "bisect", "clip_search"),
])
def test_conflicting_keywords_are_refused(keyword, value, field):
    x = rows(3)
    with pytest.raises(KernelInputError, match=f"{keyword}=.* conflicts with config.{field}") as exc:
        quantize_int2(x, config=Int2KVConfig(), **{keyword: value}, backend="torch")
    assert "\n" not in str(exc.value)
    if keyword != "scale_dtype":
        with pytest.raises(KernelInputError, match="conflicts"):
            fake_quantize_int2(x, config=Int2KVConfig(), **{keyword: value}, backend="torch")


def test_settings_the_codes_disagree_with_are_refused():
    x = rows(4)
    codes, sz = quantize_int2(x, group_size=16, backend="torch")
    with pytest.raises(KernelInputError, match="group_size 64 disagrees"):
        dequantize_int2(codes, sz, config=Int2KVConfig(), backend="torch")
    with pytest.raises(KernelInputError, match="disagrees with config.scale_dtype"):
        dequantize_int2(codes, sz, config=Int2KVConfig(group_size=16, scale_dtype="float16"), backend="torch")
    buf = torch.zeros(60, 2, 16, dtype=torch.uint8)
    with pytest.raises(KernelInputError, match="disagrees with config.scale_dtype"):
        quantize_int2_into(x, torch.arange(48), buf, torch.zeros(60, 2, 2), config=Int2KVConfig(scale_dtype="bfloat16"),
                           backend="torch")
    with pytest.raises(KernelInputError, match="side must be"):
        quantize_int2(x, config=Int2KVConfig(), side="q", backend="torch")  # type: ignore[arg-type]
    with pytest.raises(KernelInputError, match="Int2KVConfig"):
        quantize_int2(x, config={"group_size": 16}, backend="torch")  # type: ignore[arg-type]
