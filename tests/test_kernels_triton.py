"""INT2 KV kernels, triton backend vs the torch reference.

On a CUDA machine the compiled kernels are tested; elsewhere Triton's CPU interpreter runs them
(``TRITON_INTERPRET=1``, set below before triton is imported). The kernels are built on first use
for the Triton mode in effect at that moment, so the interpreter also works when another test module
imported triton earlier (checked in a subprocess below).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'rotationzoo[triton]')")

from rotationzoo.kernels import dequantize_int2, quantize_int2, quantize_int2_into  # noqa: E402
from rotationzoo.kernels import triton_int2  # noqa: E402
from rotationzoo.kernels.reference import unpack_codes  # noqa: E402

from helpers import int2_config  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _triton_runs_here():
    if DEVICE.type == "cpu" and not triton_int2.interpret_mode():
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1: the triton backend cannot run here")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_same_bytes(got, want):
    assert torch.equal(got[0], want[0]), f"{int((got[0] != want[0]).sum())} code bytes differ"
    assert got[1].dtype == want[1].dtype
    assert torch.equal(bits(got[1]), bits(want[1])), "scales/zeros differ"


def rand(shape, dtype=torch.bfloat16, seed=0, heavy=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if heavy:
        x = x * (1 + 8 * (torch.rand(shape, generator=g) > 0.97))
    return (x * 2.0 - 0.2).to(dtype).to(DEVICE)


def orthogonal(d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float().contiguous().to(DEVICE)


def both(x, **kw):
    return quantize_int2(x, backend="triton", **kw), quantize_int2(x, backend="torch", **kw)


# (d, group, clip): clip modes none / top (max-and-mask) / bottom (min-and-mask) / radix bisection
_CASES = [
    (64, 16, 0.96),
    (64, 64, 0.0),
    (128, 128, 0.96),
    (128, 32, 0.92),
    (128, 128, 0.5),
    (128, 64, 0.03),
    (128, 16, -1.0),
    (256, 256, 0.96),
    (256, 32, 0.5),
]
_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
_SDTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("case", range(len(_CASES)))
def test_prerotated_bit_exact(case):
    d, group, clip = _CASES[case]
    rows = 70 if case % 2 else 7  # 70 crosses a 64-row tile, 7 is a partial tile
    x = rand((rows, 2, d), _DTYPES[case % 3], seed=case, heavy=True)
    tri, ref = both(x, config=int2_config(clip, group, scale=_SDTYPES[(case // 3) % 3]))
    assert_same_bytes(tri, ref)


# (d, group, clip ratio, scale dtype): the decode flush's bisection at every head_dim, grouped and
# not, with ratios that clip a few, half and nearly all values
_BISECT_CASES = [
    (64, 64, 0.96, torch.float32),
    (128, 128, 0.92, torch.bfloat16),
    (128, 16, 0.5, torch.float16),
    (256, 32, 0.03, torch.float32),
]


@pytest.mark.parametrize("case", range(len(_BISECT_CASES)))
def test_bisection_clip_bit_exact(case):
    d, group, clip, sdt = _BISECT_CASES[case]
    x = rand((70, 2, d), _DTYPES[case % 3], seed=40 + case, heavy=True)
    x[1, 0] = 0.0
    x[2, 1, 3] = float("nan")
    x[4, 0, :5] = 7.0  # ties at the top
    tri, ref = both(x, config=int2_config(clip, group, scale=sdt, search="bisect"))
    assert torch.equal(tri[0], ref[0])
    nan = torch.isnan(ref[1])  # the flagged row: NaN in both, payloads not compared
    assert torch.equal(torch.isnan(tri[1]), nan) and nan.any()
    assert torch.equal(bits(tri[1][~nan]), bits(ref[1][~nan]))
    exact = quantize_int2(x, config=int2_config(clip, group, scale=sdt), backend="torch")
    assert not torch.equal(bits(ref[1]), bits(exact[1])), "the bisection clips differently from the exact search"


def test_bisection_clip_lloyd_max_rotation_and_paged_store():
    d, t, h, slots = 128, 20, 2, 32
    x = rand((t, h, d), torch.bfloat16, seed=77, heavy=True)
    assert_same_bytes(*both(x, config=int2_config(0.96, lloyd_max=True, search="bisect")))
    r = orthogonal(d, seed=6)
    loc = torch.randperm(slots, generator=torch.Generator().manual_seed(1))[:t].to(DEVICE)
    bufs = {}
    for backend in ("triton", "torch"):
        codes_buf = torch.zeros(slots, h, d // 4, dtype=torch.uint8, device=DEVICE)
        sz_buf = torch.zeros(slots, h, 2, dtype=torch.float32, device=DEVICE)
        quantize_int2_into(x, loc, codes_buf, sz_buf, config=int2_config(0.92, search="bisect"), rotation=r,
                           backend=backend)
        bufs[backend] = (codes_buf, sz_buf)
    if DEVICE.type == "cpu":  # the interpreter's fp32 matmul reproduces the reference exactly
        assert_same_bytes(bufs["triton"], bufs["torch"])
    else:
        q_tri, q_ref = unpack_codes(bufs["triton"][0]).int(), unpack_codes(bufs["torch"][0]).int()
        assert (q_tri != q_ref).float().mean() <= 1e-3


@pytest.mark.parametrize("d", [64, 128, 256])
def test_lloyd_max_bit_exact(d):
    x = rand((9, d), torch.bfloat16, seed=d, heavy=True)
    for clip in (0.0, 0.96):
        assert_same_bytes(*both(x, config=int2_config(clip, lloyd_max=True)))


def test_special_rows_and_nan_inf_policy():
    d = 64
    x = rand((12, d), torch.float32, seed=3)
    x[0] = 0.0
    x[1] = -0.0
    x[2] = 3.25
    x[3, :32], x[3, 32:] = 1.0, -1.0
    x[4, 7] = float("nan")
    x[5, 9] = float("inf")
    x[6, :3] = float("-inf")
    x[7] = torch.linspace(-1e-30, 1e-30, d)
    x[8, ::2] = 0.0
    for clip in (0.0, 0.96):
        for group in (64, 16):
            tri, ref = both(x, config=int2_config(clip, group))
            assert torch.equal(tri[0], ref[0])
            assert torch.equal(torch.isnan(tri[1]), torch.isnan(ref[1]))
            ok = ~torch.isnan(ref[1])
            assert torch.equal(bits(tri[1][ok]), bits(ref[1][ok]))
        assert torch.isnan(ref[1][4]).all() and torch.isnan(ref[1][6]).all()
        assert torch.isnan(ref[1][5]).all() == (clip == 0.0)


def test_non_contiguous_input_and_launch_overrides():
    d = 128
    base = rand((40, 3, d), torch.bfloat16, seed=5)
    x = base[::2, 1:]  # strided rows and heads
    want = quantize_int2(x, config=int2_config(0.96, 32), backend="torch")
    assert_same_bytes(quantize_int2(x, config=int2_config(0.96, 32), backend="triton"), want)
    x3 = x.reshape(-1, 1, d)
    for bt, progs in ((16, 1), (32, 3)):
        codes = torch.empty(x3.shape[0], 1, d // 4, dtype=torch.uint8, device=DEVICE)
        sz = torch.empty(x3.shape[0], 1, 8, device=DEVICE)
        triton_int2.quantize_triton(
            x3, None, None, codes, sz, clip_index=122, group_size=32, lloyd_max=False, block_rows=bt, programs=progs
        )
        assert_same_bytes((codes.reshape(want[0].shape), sz.reshape(want[1].shape)), want)


@pytest.mark.parametrize("d,rows", [(64, 64), (128, 512), (256, 64)])
def test_in_kernel_rotation_codes_agree(d, rows):
    x = rand((rows, 2, d), torch.bfloat16, seed=d, heavy=True)
    r = orthogonal(d, seed=d)
    tri, ref = both(x, config=int2_config(0.96), rotation=r)
    q_tri, q_ref = unpack_codes(tri[0]).int(), unpack_codes(ref[0]).int()
    frac = (q_tri != q_ref).float().mean().item()
    rows_same = (tri[1] == ref[1]).all(-1).float().mean().item()
    print(f"in-kernel bf16 rotation d={d}: {frac:.2e} of codes differ, {rows_same:.4f} of rows same scale/zero")
    assert frac <= 1e-3
    assert (q_tri - q_ref).abs().max() <= 1
    torch.testing.assert_close(tri[1], ref[1], rtol=2**-7, atol=0)
    if DEVICE.type == "cpu":  # the interpreter's fp32 matmul reproduces the reference exactly
        assert_same_bytes(tri, ref)


def test_per_head_rotation():
    d, h = 64, 3
    x = rand((20, h, d), torch.float16, seed=8)
    r = torch.stack([orthogonal(d, seed=s) for s in range(h)])
    tri, ref = both(x, config=int2_config(0.92), rotation=r)
    q_tri, q_ref = unpack_codes(tri[0]).int(), unpack_codes(ref[0]).int()
    assert (q_tri != q_ref).float().mean() <= 1e-3 and (q_tri - q_ref).abs().max() <= 1
    back_t = dequantize_int2(*ref, rotation=r, dtype=torch.float32, backend="triton")
    back_r = dequantize_int2(*ref, rotation=r, dtype=torch.float32, backend="torch")
    assert torch.equal(back_t, back_r)


_DEQ_CASES = [(64, 16, torch.bfloat16), (128, 128, torch.float32), (128, 32, torch.float16), (256, 64, torch.float32)]


@pytest.mark.parametrize("d,group,sdt", _DEQ_CASES)
def test_dequant_kernel_equals_reference(d, group, sdt):
    x = rand((37, d), torch.float32, seed=d + group, heavy=True)
    codes, sz = quantize_int2(x, config=int2_config(0.92, group, scale=sdt), backend="torch")
    for odt in (torch.bfloat16, torch.float16, torch.float32):
        got = dequantize_int2(codes, sz, dtype=odt, backend="triton")
        want = dequantize_int2(codes, sz, dtype=odt, backend="torch")
        assert got.dtype == odt and torch.equal(got, want), odt
    r = orthogonal(d, seed=1)
    got = dequantize_int2(codes, sz, rotation=r, backend="triton")
    assert torch.equal(got, dequantize_int2(codes, sz, rotation=r, backend="torch"))


@pytest.mark.parametrize("sdt", [torch.float32, torch.bfloat16])
def test_paged_store(sdt):
    t, h, d, slots = 70, 2, 128, 80
    x = rand((t, h, d), torch.bfloat16, seed=11)
    loc = torch.randperm(slots, generator=torch.Generator().manual_seed(0))[:t].to(torch.int32)
    loc[::7] = -1
    loc[3] = slots + 5  # past the INT2 tier: skipped
    loc = loc.to(DEVICE)
    bufs = {}
    for backend in ("triton", "torch"):
        codes_buf = torch.full((slots, h, d // 4), 0xAB, dtype=torch.uint8, device=DEVICE)
        sz_buf = torch.full((slots, h, 8), -7.0, dtype=sdt, device=DEVICE)
        quantize_int2_into(x, loc, codes_buf, sz_buf, config=int2_config(0.96, d // 4, scale=sdt), backend=backend)
        bufs[backend] = (codes_buf, sz_buf)
    assert_same_bytes(bufs["triton"], bufs["torch"])
    untouched = sorted(set(range(slots)) - {s for s in loc.tolist() if 0 <= s < slots})
    assert (bufs["triton"][0][untouched] == 0xAB).all() and (bufs["triton"][1][untouched] == -7.0).all()
    # with a fused rotation and int64 slots
    r = orthogonal(d, seed=4)
    out = {}
    for backend in ("triton", "torch"):
        codes_buf = torch.zeros(slots, h, d // 4, dtype=torch.uint8, device=DEVICE)
        sz_buf = torch.zeros(slots, h, 2, dtype=sdt, device=DEVICE)
        quantize_int2_into(x, loc.long(), codes_buf, sz_buf, config=int2_config(0.92, scale=sdt), rotation=r,
                           backend=backend)
        out[backend] = unpack_codes(codes_buf).int()
    assert (out["triton"] != out["torch"]).float().mean() <= 1e-3


_QUANT_STRIDES = {"sx_t", "sx_h", "sx_d", "sr_h", "sr_i", "sr_o", "sc_s", "sc_h", "sc_q", "ss_s", "ss_h", "ss_k"}


def test_quantize_offsets_are_64_bit_products():
    """No scalar 32-bit product in the compiled quantize kernel takes a stride: ``head * sx_h`` (and the
    codes' and scales' ``head * sc_h``, ``head * ss_h``) had been i32, so a head-major input or cache whose
    heads lie 2^31 elements apart wrapped around. Read from the kernel's TTIR (no GPU needed)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    aot_report = pytest.importorskip("aot_report")
    d, h, t, slots = 64, 3, 40, 50
    x = torch.empty(h, t, d, dtype=torch.bfloat16).transpose(0, 1)  # [T, H, d], head-major
    codes = torch.empty(h, slots, d // 4, dtype=torch.uint8).transpose(0, 1)
    sz = torch.empty(h, slots, 2).transpose(0, 1)
    loc = torch.empty(t, dtype=torch.int64)
    launch = triton_int2.quant_launch(x, None, loc, codes, sz, clip_index=-1, group_size=d, lloyd_max=False,
                                      interpret=False, num_sms=132, capability=90)
    ttir = aot_report.compile_launch(triton_int2.aot_kernels().quant, launch, 90).asm["ttir"]
    if "%sc_h" not in ttir:
        pytest.skip("this Triton's TTIR does not name values after the kernel's arguments")
    narrow = [line.strip() for line in ttir.splitlines()
              if "arith.muli" in line and "tensor<" not in line and re.search(r":\s*i32\b", line)
              and _QUANT_STRIDES & set(re.findall(r"%(\w+)", line.split("=", 1)[-1]))]
    assert "arith.muli" in ttir and not narrow, narrow


@pytest.mark.skipif(DEVICE.type != "cpu", reason="interpreter check")
def test_kernels_are_interpreted_on_cpu():
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(triton_int2._kernels(True).quant, InterpretedFunction)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="interpreter check")
def test_interpreter_enabled_after_triton_was_imported(tmp_path):
    script = tmp_path / "late_interpreter.py"  # triton.jit needs a function defined in a file
    script.write_text(textwrap.dedent(
        """
        import os
        os.environ.pop("TRITON_INTERPRET", None)
        import torch, triton, triton.language as tl

        @triton.jit
        def other_module_kernel(x_ptr):  # compiled-mode kernel defined before the switch
            pass

        os.environ["TRITON_INTERPRET"] = "1"
        from rotationzoo.int2kv import Int2KVConfig
        from rotationzoo.kernels import quantize_int2
        x = torch.randn(9, 64, dtype=torch.bfloat16)
        cfg = Int2KVConfig(k_clip_ratio=0.96, v_clip_ratio=0.0)
        a = quantize_int2(x, config=cfg, backend="triton")
        b = quantize_int2(x, config=cfg, backend="torch")
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        print("ok")
        """
    ))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
