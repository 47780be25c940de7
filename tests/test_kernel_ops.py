"""The kernels as torch operators: registered with torch.library, checked by ``torch.library.opcheck``
(schema, fake/meta implementation, dispatch), and ``torch.compile(fullgraph=True)`` of functions that
call them traces without a graph break; ``backend=`` names every implementation."""

from __future__ import annotations

import pytest
import torch

from rotationzoo.errors import BackendUnavailableError, KernelInputError
from rotationzoo.int2kv import Int2KVConfig
from rotationzoo.kernels import decode_attention_int2, native, quantize_int2
from rotationzoo.kernels.backend import pick_backend

from test_decode_attention import make_cache, orthogonal

needs_cpp = pytest.mark.skipif(not native.native_available(), reason="the C++ kernels cannot be built here")


def _inputs(s=2, hq=4, hkv=2, d=64):
    k, _ = make_cache(1, hkv, d, 3, 130, 5, seed=1, group=16)
    v, _ = make_cache(1, hkv, d, 3, 130, 5, seed=2, group=64)
    q = torch.randn(1, hq, s, d, generator=torch.Generator().manual_seed(3))
    return q, k, v, orthogonal(d, None, 4), orthogonal(d, None, 5)


def test_the_operators_are_registered():
    for name in ("decode_int2_torch", "decode_int2_cpu", "decode_int2_triton", "quantize_int2_cpu"):
        assert hasattr(torch.ops.rotationzoo, name), name


@pytest.mark.parametrize("name", ["decode_int2_torch", pytest.param("decode_int2_cpu", marks=needs_cpp)])
def test_decode_operators_pass_opcheck(name):
    q, k, v, rk, rv = _inputs()
    mask = torch.ones(1, 1, 2, 138, dtype=torch.bool)
    mask[..., :2] = False
    op = getattr(torch.ops.rotationzoo, name)
    args = (q.bfloat16(), *k, *v, rk, rv.T.contiguous(), mask, 0.125, True, 0)  # a bf16 query, an fp32 result
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    out = op(*args)
    assert out.shape == q.shape and out.dtype == torch.float32
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert fake.shape == out.shape and fake.dtype == out.dtype


@needs_cpp
def test_quantize_operator_passes_opcheck():
    x = torch.randn(5, 2, 64).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.rotationzoo.quantize_int2_cpu, (x, 61, 16, "exact", torch.bfloat16),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=needs_cpp), pytest.param("auto", marks=needs_cpp)])
def test_compiling_a_function_that_calls_decode_needs_no_graph_break(backend):
    q, k, v, rk, rv = _inputs()

    def step(query, kt, vt):
        out = decode_attention_int2(query, kt, vt, k_rotation=rk, v_rotation=rv, backend=backend)
        return out * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)  # a graph break would raise
    got = compiled(q, k, v)
    want = step(q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


_FIRST_CALL_COMPILED = r"""
import torch
from rotationzoo.kernels import Int2KV, decode_attention_int2, native
g = torch.Generator().manual_seed(0)
x = torch.randn(1, 2, 40, 64, generator=g)
codes = torch.randint(0, 256, (1, 2, 30, 16), dtype=torch.uint8, generator=g)
sz = torch.rand(1, 2, 30, 2, generator=g) + 0.5
kv = Int2KV(x[:, :, :5].bfloat16(), codes, sz, x[:, :, 35:].bfloat16())
q = torch.randn(1, 4, 1, 64, generator=g)
fn = torch.compile(lambda t: decode_attention_int2(t, kv, kv, backend="auto"), backend="aot_eager", fullgraph=True)
out = fn(q)  # the first kernel call of the process happens while tracing: the build runs then, off the graph
assert native.native_available()
torch.testing.assert_close(out, decode_attention_int2(q, kv, kv, backend="torch"), rtol=1e-5, atol=1e-5)
print("OK")
"""


@needs_cpp
def test_the_first_kernel_call_may_happen_while_compiling():
    """Whether the C++ kernel runs is decided once while tracing (the build, or the cache lookup, is no
    part of the graph)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FIRST_CALL_COMPILED], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


@needs_cpp
def test_compiling_quantize_on_the_cpu_backend_needs_no_graph_break():
    x = torch.randn(40, 2, 64).to(torch.bfloat16)
    cfg = Int2KVConfig(k_clip_ratio=0.96, group_size=16, scale_dtype="bfloat16")
    fn = lambda t: quantize_int2(t, config=cfg, backend="cpu")  # noqa: E731
    torch._dynamo.reset()
    codes, sz = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
    want = quantize_int2(x, config=cfg, backend="torch")
    assert torch.equal(codes, want[0]) and torch.equal(sz, want[1])


def test_backend_names():
    cpu = torch.device("cpu")
    assert pick_backend("torch", cpu) == "torch"
    with pytest.raises(BackendUnavailableError, match="needs CPU tensors"):
        pick_backend("cpu", torch.device("meta"))
    with pytest.raises(KernelInputError, match="'auto', 'torch', 'cpu' or 'triton'"):
        pick_backend("c", cpu)
    assert pick_backend("cpu", cpu, None) == "torch"  # no C++ kernel for this operation: the reference
    if native.native_available():
        assert pick_backend("cpu", cpu) == "cpu" and pick_backend("auto", cpu) == "cpu"
