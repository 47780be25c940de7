"""The kernels take the INT2-KV settings as one Int2KVConfig (no loose keywords beside it): every entry
point reads the same config the same way, ``side`` picks the clip ratio, no config means no clip and
one fp32 group per row, and tensors that disagree with the config are refused."""

from __future__ import annotations

import pytest
import torch

from rotationzoo.dtypes import TORCH_DTYPES
from rotationzoo.errors import KernelInputError
from rotationzoo.int2kv import Int2KVConfig
from rotationzoo.kernels import dequantize_int2, fake_quantize_int2, quantize_int2, quantize_int2_into
from rotationzoo.kernels.reference import quantize_rows

from helpers import int2_config

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


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.label())
@pytest.mark.parametrize("side", ["k", "v"])
def test_every_entry_point_reads_the_config_alike(cfg, side):
    x = rows()
    d = x.shape[-1]
    codes, sz = quantize_int2(x, config=cfg, side=side, backend="torch")
    from rotationzoo.kernels.layout import clip_index

    want_c, want_s = quantize_rows(x.reshape(-1, d), clip_index=clip_index(cfg.clip_ratio(side), d),
                                   group_size=cfg.group_for(d), lloyd_max=cfg.lloyd_max,
                                   scale_dtype=TORCH_DTYPES[cfg.scale_dtype], clip_search=cfg.clip_search)
    assert torch.equal(codes.reshape(-1, d // 4), want_c) and torch.equal(sz.reshape(want_s.shape), want_s)
    other = "v" if side == "k" else "k"
    if cfg.clip_ratio(other) != cfg.clip_ratio(side):  # side picks the clip ratio
        assert not torch.equal(quantize_int2(x, config=cfg, side=other, backend="torch")[0], codes)
    back = dequantize_int2(codes, sz, config=cfg, dtype=torch.float32, backend="torch")
    assert torch.equal(back, dequantize_int2(codes, sz, dtype=torch.float32, backend="torch"))
    fake = fake_quantize_int2(x, config=cfg, side=side, dtype=torch.float32, backend="torch")
    assert torch.equal(fake, back)
    cbuf = torch.zeros(60, 2, 16, dtype=torch.uint8)
    sbuf = torch.zeros(60, 2, sz.shape[-1], dtype=TORCH_DTYPES[cfg.scale_dtype])
    loc = torch.arange(x.shape[0]) + 5
    quantize_int2_into(x, loc, cbuf, sbuf, config=cfg, side=side, backend="torch")
    assert torch.equal(cbuf[5:53], codes) and torch.equal(sbuf[5:53], sz)


def test_no_config_means_no_clip_one_fp32_group_per_row():
    x = rows(1)
    codes, sz = quantize_int2(x, backend="torch")
    want = quantize_int2(x, config=Int2KVConfig(k_clip_ratio=0.0, group_size=64), backend="torch")
    assert torch.equal(codes, want[0]) and torch.equal(sz, want[1]) and sz.dtype == torch.float32
    assert sz.shape[-1] == 2


def test_settings_the_codes_disagree_with_are_refused():
    x = rows(4)
    codes, sz = quantize_int2(x, config=int2_config(0.0, 16), backend="torch")
    with pytest.raises(KernelInputError, match="group size 64 disagrees"):
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


def test_one_dtype_map_for_the_package():
    """kernels.settings, the transformers integration and the fitter read dtype names through the same map."""
    from rotationzoo.fit import refine_loss
    from rotationzoo.integrations.transformers import loading, oscar
    from rotationzoo.kernels import settings

    assert settings.TORCH_DTYPES is TORCH_DTYPES
    assert not hasattr(oscar, "DTYPES")
    for module in (refine_loss, loading, oscar):
        assert "getattr(torch," not in open(module.__file__).read(), module.__name__
