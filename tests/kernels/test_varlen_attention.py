"""Attention straight from a fused QKV projection (varlen_attention: the paged kernel's contiguous mode) against
the float64 reference, and against the paged path it replaces for encoder steps.

The queries, keys and values are strided views of one `[T, (Hq + 2 Hkv) * D]` projection output, as the engine
passes them. Exact values: per sequence, dense softmax attention in float64 (naive_paged_attention over a cache
holding the same keys). float32: as accurate as torch's SDPA in float32; float16 and bfloat16 (on the CPU through
tests/interpreter_bfloat16.py): the kernel's own paged mode's result bit for bit where that mode takes the head dim
(the same arithmetic, only the addresses differ), and as accurate as torch's SDPA on the same 16-bit inputs. Lengths include 1, a multiple of
the tile and not; head dims a kernel size and not (24: masked to 32, 8: to 16; no padding copy); GQA; KV splits.
"""
from __future__ import annotations

import pytest
import torch

from triton_kernels import paged_attention, write_kv_cache
from triton_kernels.paged_attention import varlen_attention
from triton_kernels.paged_attention.naive import naive_paged_attention
from triton_kernels.paged_attention.varlen import varlen_attention_torch
from tests.float64_reference import assert_as_accurate
from tests.kernels.float_cases import skip_interpreter_bf16

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 16

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _step(lens, heads, kv_heads, dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * dim, generator=g, dtype=torch.float64).to(dtype)
    q = qkv[:, :heads * dim].view(T, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(T, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(T, kv_heads, dim)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, cu, torch.tensor(lens, dtype=torch.int32)


def _paged_exact(q, k, v, cu, lens, causal, scale, **bias):
    """float64 attention through the reference's cache: each sequence's keys on pages of its own."""
    pages = [-(-int(n) // PAGE) for n in lens]
    tables = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    slots, first = [], 0
    for s, (n, p) in enumerate(zip(lens.tolist(), pages)):
        tables[s, :p] = torch.arange(first, first + p)
        slots += [(first + i // PAGE) * PAGE + i % PAGE for i in range(n)]
        first += p
    kc = torch.zeros(first, PAGE, k.shape[1], k.shape[2], dtype=torch.float64)
    vc = torch.zeros_like(kc)
    kc.view(-1, k.shape[1], k.shape[2])[slots] = k.double()
    vc.view(-1, k.shape[1], k.shape[2])[slots] = v.double()
    bias = {name: (x.double() if torch.is_tensor(x) else x) for name, x in bias.items()}
    return naive_paged_attention(q.double(), kc, vc, tables, cu, lens, causal=causal, scale=scale, **bias), tables, slots


SHAPES = [(4, 4, 32), (4, 2, 24), (2, 2, 16), (2, 2, 8)]
# bfloat16 takes the float16 cases' code paths with another rounding: a kernel size and a masked head dim, both
# split counts, both masks (the interpreter's bfloat16 costs a float16 case's time)
CASES = ([(dtype, *shape, causal, splits) for dtype in (torch.float32, torch.float16) for shape in SHAPES
          for causal in (False, True) for splits in (1, 2)]
         + [(torch.bfloat16, *shape, causal, splits) for shape in SHAPES[:2] for causal, splits in ((False, 2), (True, 1))])


@pytest.mark.parametrize("dtype,heads,kv_heads,dim,causal,splits", CASES)
def test_varlen_attention_against_float64(dtype, heads, kv_heads, dim, causal, splits):
    skip_interpreter_bf16(dtype)
    lens = [5, 40, 1, 33, 16]
    q, k, v, cu, n = _step(lens, heads, kv_heads, dim, dtype, seed=dim + heads)
    scale = dim ** -0.5
    exact, _, _ = _paged_exact(q, k, v, cu, n, causal, scale)
    knobs = dict(block_q=8, pages_per_tile=1, num_warps=4, num_stages=1, num_kv_splits=splits)
    dev = lambda t: t.to(DEVICE)   # noqa: E731   (a view of the projection stays a strided view on the device)
    qkv = q.as_strided((q.shape[0], q.stride(0)), (q.stride(0), 1)).to(DEVICE)
    T, H, Hk = q.shape[0], heads, kv_heads
    qd = qkv[:, :H * dim].view(T, H, dim)
    kd = qkv[:, H * dim:(H + Hk) * dim].view(T, Hk, dim)
    vd = qkv[:, (H + Hk) * dim:].view(T, Hk, dim)
    ours = varlen_attention(qd, kd, vd, dev(cu), dev(n), causal=causal, scale=scale, **knobs)
    theirs = varlen_attention_torch(q.float(), k.float(), v.float(), cu, causal=causal, scale=scale,
                                    out=torch.empty(q.shape, dtype=torch.float32))
    if dtype != torch.float32:   # torch's SDPA on the same 16-bit inputs
        theirs = varlen_attention_torch(q, k, v, cu, causal=causal, scale=scale, out=torch.empty_like(q))
    assert_as_accurate(ours, theirs, exact, "varlen_attention")
    if dtype != torch.float32 and dim in (32, 64, 80, 96, 128, 256):
        # The paged mode of the same kernel, same knobs, over a cache holding the same keys: the same arithmetic.
        _, tables, slots = _paged_exact(q, k, v, cu, n, causal, scale)
        kc = torch.zeros(int(tables.max()) + 1, PAGE, Hk, dim, dtype=dtype, device=DEVICE)
        vc = torch.zeros_like(kc)
        write_kv_cache(kd.contiguous(), vd.contiguous(), kc, vc, torch.tensor(slots, device=DEVICE))
        paged = paged_attention(qd.contiguous(), kc, vc, dev(tables), dev(cu), dev(n), causal=causal, scale=scale,
                                **knobs)
        assert torch.equal(ours, paged)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
@pytest.mark.parametrize("splits", (1, 2))
def test_varlen_attention_with_t5_relative_bias(dtype, splits):
    """T5's relative-position bias in the contiguous mode (an encoder step of a T5 model): against float64
    attention with the same bias, as accurate as torch's path on the same inputs; float16 bit for bit the paged
    mode of the same kernel over a cache holding the same keys. 45 tokens reach offsets past max_distance 20 (in
    both directions, the farthest buckets shared); head dim 32 and 16 (masked)."""
    skip_interpreter_bf16(dtype)
    heads, max_distance = 4, 20
    for dim in (32, 16):
        lens = [45, 1, 17]
        q, k, v, cu, n = _step(lens, heads, heads, dim, dtype, seed=7 + dim)
        table = torch.randn(32, heads, generator=torch.Generator().manual_seed(dim), dtype=torch.float64).to(dtype)
        bias = dict(rel_bias_table=table, rel_max_distance=max_distance)
        exact, tables, slots = _paged_exact(q, k, v, cu, n, False, 1.0, **bias)
        knobs = dict(block_q=16, pages_per_tile=1, num_warps=4, num_stages=1, num_kv_splits=splits)
        dev = lambda t: t.to(DEVICE)   # noqa: E731
        qd, kd, vd = (dev(x) for x in (q, k, v))
        ours = varlen_attention(qd, kd, vd, dev(cu), dev(n), scale=1.0, rel_bias_table=dev(table),
                                rel_max_distance=max_distance, **knobs)
        theirs = varlen_attention_torch(q, k, v, cu, causal=False, scale=1.0, out=torch.empty_like(q), **bias)
        assert_as_accurate(ours, theirs, exact, "varlen_attention with T5's bias")
        if dtype != torch.float32 and dim == 32:
            kc = torch.zeros(int(tables.max()) + 1, PAGE, heads, dim, dtype=dtype, device=DEVICE)
            vc = torch.zeros_like(kc)
            write_kv_cache(kd.contiguous(), vd.contiguous(), kc, vc, torch.tensor(slots, device=DEVICE))
            paged = paged_attention(qd.contiguous(), kc, vc, dev(tables), dev(cu), dev(n), causal=False, scale=1.0,
                                    rel_bias_table=dev(table), rel_max_distance=max_distance, **knobs)
            assert torch.equal(ours, paged)
    with pytest.raises(ValueError, match="bidirectional"):
        varlen_attention(qd, kd, vd, dev(cu), dev(n), causal=True, rel_bias_table=dev(table), rel_max_distance=20)
    with pytest.raises(ValueError, match="together"):
        varlen_attention(qd, kd, vd, dev(cu), dev(n), rel_bias_table=dev(table))


def test_bad_inputs_are_refused():
    q = torch.zeros(4, 2, 16)
    cu, n = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        varlen_attention(q, torch.zeros(4, 3, 16), torch.zeros(4, 3, 16), cu, n)
    with pytest.raises(ValueError, match="head dim"):
        varlen_attention(torch.zeros(4, 2, 300), torch.zeros(4, 2, 300), torch.zeros(4, 2, 300), cu, n)
    with pytest.raises(ValueError, match="int32"):
        varlen_attention(q, q, q, cu.long(), n)
