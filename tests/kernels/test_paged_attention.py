"""paged_attention and write_kv_cache against the float64 per-sequence reference (naive.py).

On CPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set in conftest.py), so shapes
stay small; the torch path (what CPU engines run) is tested with TRITON_INTERPRET=0. Long contexts and
bfloat16 at realistic sizes run on a GPU only (small bfloat16 cases run in the interpreter too, through
tests/interpreter_bfloat16.py).

Tolerances, on unit-normal inputs (outputs are convex combinations of values, so |out| < ~4):
- float32: 1e-5 abs + 1e-5 rel. Products are true float32 (input_precision="ieee"); the only error is
  float32 accumulation over <= a few hundred keys (~1e-6 seen).
- float16: 2e-3 abs + 2e-3 rel. q, k, v are the same float16 numbers in the reference; the kernel rounds
  the softmax weights to float16 for the P @ V product (2^-11 relative each) and the output to float16
  (half an ulp is 1e-3 at |out| = 2).
- bfloat16: 2e-2 abs + 2e-2 rel, the same two roundings with a 2^-8 mantissa.
Write-then-attend is checked against torch's dense attention, in float64 for the exact values and in
float32 for the error to match (tests/float64_reference.py), not against its float32 result alone.
"""
import dataclasses
import os

import pytest
import torch

from triton_kernels import paged_attention, write_kv_cache
from triton_kernels.paged_attention import PagedAttentionLaunch, default_launch
from triton_kernels.paged_attention.kv_cache import write_kv_cache_torch
from triton_kernels.paged_attention.naive import naive_paged_attention
from triton_kernels.paged_attention.sdpa import paged_attention_sdpa

from tests.float64_reference import assert_as_accurate
from tests.kernels.float_cases import skip_interpreter_bf16

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

# triton.jit reads TRITON_INTERPRET when the kernels are defined: with it, every Triton launch (CUDA
# tensors too) is interpreted on the host; without it, CPU tensors cannot reach a kernel. So the Triton
# tests run on TRITON_DEVICE: the CPU under the interpreter, else the GPU, compiled
# (`TRITON_INTERPRET=0 pytest tests/kernels`); the GPU-only tests below need it off.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_DEVICE = "cpu" if INTERPRETED else "cuda" if torch.cuda.is_available() else None
triton_runs = pytest.mark.skipif(TRITON_DEVICE is None, reason="needs a GPU or TRITON_INTERPRET=1 (conftest.py)")
gpu = pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(),
                         reason="needs a CUDA GPU and compiled Triton: TRITON_INTERPRET=0 pytest tests/kernels")

# (q_len, kv_len) per sequence: decode, continuation (q_len < kv_len), prefill (q_len == kv_len),
# kv_len a multiple of the page size and not, and a sequence with no new tokens this step.
MIXED = [(1, 37), (7, 50), (23, 23), (0, 20), (1, 16), (12, 64), (5, 5)]


def make_batch(seqs, num_q_heads, num_kv_heads, head_dim, page_size, dtype, device="cpu", seed=0):
    """Random q and a paged cache holding each sequence's keys/values on randomly scattered pages.

    Unused cache slots hold NaN and unused block-table entries -1, so reading anything outside a
    sequence's kv_len shows up as NaN or an error instead of a quietly wrong number.
    """
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-kv_len // page_size) for _, kv_len in seqs]
    num_pages = sum(pages_per_seq) + 3
    order = torch.randperm(num_pages, generator=gen)
    k_cache = torch.full((num_pages, page_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    block_tables = torch.full((len(seqs), max(pages_per_seq) + 1), -1, dtype=torch.int32)
    used = 0
    for s, ((_, kv_len), n) in enumerate(zip(seqs, pages_per_seq)):
        pages = order[used:used + n]
        used += n
        block_tables[s, :n] = pages.int()
        k = torch.randn(n * page_size, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(n * page_size, num_kv_heads, head_dim, generator=gen)
        k[kv_len:] = float("nan")
        v[kv_len:] = float("nan")
        k_cache[pages] = k.view(n, page_size, num_kv_heads, head_dim)
        v_cache[pages] = v.view(n, page_size, num_kv_heads, head_dim)
    q_lens = torch.tensor([q_len for q_len, _ in seqs])
    q = torch.randn(int(q_lens.sum()), num_q_heads, head_dim, generator=gen)
    cu_seqlens_q = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu_seqlens_q[1:] = q_lens.cumsum(0)
    kv_lens = torch.tensor([kv_len for _, kv_len in seqs], dtype=torch.int32)
    return tuple(t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
                 for t in (q, k_cache, v_cache, block_tables, cu_seqlens_q, kv_lens))


def assert_matches_reference(batch, *, causal, dtype, **knobs):
    out = paged_attention(*batch, causal=causal, **knobs)
    assert out.dtype == dtype and out.shape == batch[0].shape
    ref = naive_paged_attention(*batch, causal=causal)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


# (Hq, Hkv, D, page_size, dtype, knobs): GQA 1/2/4/8, every supported head dim (80 and 96 pad the head
# block), page sizes 16/32/64, tiles of 1-4 pages, block_q that does and does not divide the q lengths,
# split-KV with empty splits (3 splits over 1-tile walks), float16 and bfloat16 (in the interpreter through
# tests/interpreter_bfloat16.py; every case in bfloat16 on a GPU below).
KERNEL_CASES = [
    (2, 2, 32, 16, torch.float32, dict(block_q=4, pages_per_tile=1, num_kv_splits=1)),
    (4, 2, 64, 16, torch.float32, dict(block_q=3, pages_per_tile=2, num_kv_splits=1)),
    (8, 2, 32, 32, torch.float32, dict(block_q=8, pages_per_tile=1, num_kv_splits=3)),
    (8, 1, 80, 16, torch.float32, dict(block_q=2, pages_per_tile=4, num_kv_splits=2)),
    (4, 4, 96, 64, torch.float32, dict(block_q=16, pages_per_tile=1, num_kv_splits=1)),
    (4, 2, 128, 16, torch.float32, dict(block_q=4, pages_per_tile=2, num_kv_splits=4)),
    (4, 1, 64, 16, torch.float16, dict(block_q=4, pages_per_tile=2, num_kv_splits=1)),
    (2, 1, 80, 32, torch.float16, dict(block_q=1, pages_per_tile=1, num_kv_splits=2)),
    (4, 1, 64, 16, torch.bfloat16, dict(block_q=4, pages_per_tile=2, num_kv_splits=2)),
    (2, 2, 80, 32, torch.bfloat16, dict(block_q=8, pages_per_tile=1, num_kv_splits=1)),
]


@triton_runs
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"hq{c[0]}-hkv{c[1]}-d{c[2]}-p{c[3]}-{c[4]}-"
                         + "-".join(f"{k}{v}" for k, v in c[5].items()))
def test_triton_matches_reference(case, causal):
    num_q_heads, num_kv_heads, head_dim, page_size, dtype, knobs = case
    skip_interpreter_bf16(dtype)
    batch = make_batch(MIXED, num_q_heads, num_kv_heads, head_dim, page_size, dtype, device=TRITON_DEVICE)
    assert_matches_reference(batch, causal=causal, dtype=dtype, **knobs)


@triton_runs
def test_triton_head_dim_256_and_default_knobs():
    batch = make_batch([(1, 40), (9, 30)], 2, 1, 256, 16, torch.float32, device=TRITON_DEVICE, seed=1)
    assert_matches_reference(batch, causal=True, dtype=torch.float32)


@triton_runs
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_triton_decode_batch_split_kv(causal):
    """Decode-only batch with a longer walk, the shape split-KV is for: splits must not change the result."""
    batch = make_batch([(1, 300), (1, 129), (1, 17)], 8, 2, 32, 16, torch.float32, device=TRITON_DEVICE, seed=2)
    ref = naive_paged_attention(*batch, causal=causal)
    for splits in (1, 4, 7):
        out = paged_attention(*batch, causal=causal, block_q=1, pages_per_tile=4, num_kv_splits=splits)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@triton_runs
def test_triton_scale_and_out_argument():
    batch = make_batch(MIXED[:3], 4, 2, 32, 16, torch.float32, device=TRITON_DEVICE, seed=3)
    out = torch.full_like(batch[0], float("nan"))
    result = paged_attention(*batch, scale=0.3, out=out, block_q=4, pages_per_tile=1, num_kv_splits=2)
    assert result.data_ptr() == out.data_ptr()
    ref = naive_paged_attention(*batch, causal=True, scale=0.3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2), (8, 1)], ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
def test_torch_path_matches_reference(heads, causal, dtype, monkeypatch):
    """The path CPU engines run (no TRITON_INTERPRET): pages gathered per sequence, then SDPA."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    seqs = MIXED + [(40, 200), (1, 333)]
    batch = make_batch(seqs, heads[0], heads[1], 64, 16, dtype, seed=4)
    assert_matches_reference(batch, causal=causal, dtype=dtype)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_torch_path_new_kv_reads_fresh_sequences_from_the_step(causal):
    """With the step's own keys and values passed (new_kv), sequences with no earlier tokens attend over
    them and never read their pages; continuations and decodes still read theirs. The fresh sequences'
    pages are poisoned with NaN after the step's rows are taken from them, so a read shows up."""
    seqs = MIXED + [(40, 200), (30, 30)]
    q, k_cache, v_cache, tables, cu, kv_lens = make_batch(seqs, 4, 2, 64, 16, torch.float32, seed=9)
    ref = naive_paged_attention(q, k_cache, v_cache, tables, cu, kv_lens, causal=causal)
    new_k, new_v = torch.empty(q.shape[0], 2, 64), torch.empty(q.shape[0], 2, 64)
    for s, (q_len, kv_len) in enumerate(seqs):
        pages = tables[s, : -(-kv_len // 16)].long()
        rows = slice(int(cu[s]), int(cu[s + 1]))
        new_k[rows] = k_cache[pages].flatten(0, 1)[kv_len - q_len:kv_len]
        new_v[rows] = v_cache[pages].flatten(0, 1)[kv_len - q_len:kv_len]
        if q_len == kv_len:
            k_cache[pages], v_cache[pages] = float("nan"), float("nan")
    out = paged_attention_sdpa(q, k_cache, v_cache, tables, cu, kv_lens, torch.empty_like(q), causal=causal,
                               scale=64 ** -0.5, new_kv=(new_k, new_v))
    torch.testing.assert_close(out.double(), ref, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])


def _write_case(seed, slot_dtype, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    num_pages, page_size, num_kv_heads, head_dim, num_tokens = 6, 16, 2, 80, 20
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens]
    slots[[3, 11, 12]] = -1  # padding tokens: skipped
    k_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen)
    return tuple(t.to(device) for t in (k, v, k_cache, v_cache, slots.to(slot_dtype)))


@pytest.mark.parametrize("device", [pytest.param(TRITON_DEVICE, marks=triton_runs), "cpu"], ids=["triton", "torch"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_cache_scattered_and_skipped_slots(slot_dtype, device, monkeypatch):
    # CPU tensors take the torch path with TRITON_INTERPRET=0; the Triton case runs where Triton does.
    monkeypatch.setenv("TRITON_INTERPRET", "1" if device == TRITON_DEVICE and INTERPRETED else "0")
    k, v, k_cache, v_cache, slots = _write_case(5, slot_dtype, device or "cpu")
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect_k[slot // 16, slot % 16] = k[i]
            expect_v[slot // 16, slot % 16] = v[i]
    write_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


@triton_runs
def test_write_then_attend_matches_dense_attention():
    """The engine's sequence of calls: write a prefill's keys/values, then attend over them."""
    gen = torch.Generator().manual_seed(6)
    seq_len, page_size, num_q_heads, num_kv_heads, head_dim = 40, 16, 4, 2, 32
    q, k, v = (torch.randn(seq_len, heads, head_dim, generator=gen).to(TRITON_DEVICE)
               for heads in (num_q_heads, num_kv_heads, num_kv_heads))
    k_cache = torch.zeros(5, page_size, num_kv_heads, head_dim, device=TRITON_DEVICE)
    v_cache = torch.zeros_like(k_cache)
    block_table = torch.tensor([[4, 0, 2]], dtype=torch.int32, device=TRITON_DEVICE)
    positions = torch.arange(seq_len, device=TRITON_DEVICE)
    write_kv_cache(k, v, k_cache, v_cache, block_table[0, positions // page_size] * page_size
                   + positions % page_size)
    out = paged_attention(q, k_cache, v_cache, block_table,
                          torch.tensor([0, seq_len], dtype=torch.int32, device=TRITON_DEVICE),
                          torch.tensor([seq_len], dtype=torch.int32, device=TRITON_DEVICE), block_q=8, pages_per_tile=1,
                          num_kv_splits=1)

    def dense(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
            is_causal=True).transpose(0, 1)

    assert_as_accurate(out, dense(q, k, v), dense(q.double(), k.double(), v.double()), "attention output")


class RecordingKernel:
    """Stands in for a Triton kernel: records the grid and keyword arguments of each launch."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs))
        return launch


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "default-rule"])
def test_launch_knobs_reach_the_launch(explicit, monkeypatch):
    from triton_kernels.paged_attention import kernel

    fwd, combine = RecordingKernel(), RecordingKernel()
    monkeypatch.setattr(kernel, "_paged_attention_fwd", fwd)
    monkeypatch.setattr(kernel, "_combine_splits", combine)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors take the Triton path (to the stand-ins)
    batch = make_batch(MIXED, 8, 2, 64, 16, torch.float32)
    if explicit:
        knobs = PagedAttentionLaunch(block_q=2, pages_per_tile=4, num_warps=2, num_stages=5, num_kv_splits=3)
        paged_attention(*batch, **dataclasses.asdict(knobs))
    else:
        knobs = default_launch(num_q_tokens=batch[0].shape[0], num_seqs=len(MIXED), num_q_heads=8,
                               num_kv_heads=2, head_dim=64, page_size=16,
                               max_kv_len=batch[3].shape[1] * 16)
        paged_attention(*batch)
    [(grid, kw)] = fwd.launches
    assert (kw["BLOCK_Q"], kw["TILE"], kw["num_warps"], kw["num_stages"], kw["NUM_SPLITS"]) == (
        knobs.block_q, knobs.pages_per_tile * 16, knobs.num_warps, knobs.num_stages, knobs.num_kv_splits)
    num_tokens = batch[0].shape[0]
    assert grid == ((num_tokens // knobs.block_q + len(MIXED)) * 2, knobs.num_kv_splits)
    assert len(combine.launches) == (1 if knobs.num_kv_splits > 1 else 0)


def test_default_launch_rule():
    shapes = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    decode_1 = default_launch(num_q_tokens=1, num_seqs=1, max_kv_len=32768, **shapes)
    assert decode_1.block_q == 1 and decode_1.pages_per_tile == 8 and decode_1.num_kv_splits == 32
    decode_256 = default_launch(num_q_tokens=256, num_seqs=256, max_kv_len=4096, **shapes)
    assert decode_256.num_kv_splits == 1
    prefill = default_launch(num_q_tokens=32768, num_seqs=1, max_kv_len=32768, **shapes)
    assert (prefill.block_q, prefill.pages_per_tile, prefill.num_warps, prefill.num_kv_splits) == (32, 4, 8, 1)
    short = default_launch(num_q_tokens=1, num_seqs=1, max_kv_len=300, **shapes)
    assert short.num_kv_splits == 1  # fewer than MIN_KEYS_PER_SPLIT keys per split otherwise


@pytest.mark.parametrize("change, message", [
    (lambda b: (b[0][:, :3],) + b[1:], "multiple of KV heads"),
    (lambda b: b[:3] + (b[3].long(),) + b[4:], "block_tables must be int32"),
    (lambda b: b[:4] + (b[4][:-1],) + b[5:], "cu_seqlens_q must have shape"),
    (lambda b: (b[0].half(),) + b[1:], "share a dtype"),
])
def test_bad_inputs_raise_clear_errors(change, message):
    batch = make_batch(MIXED[:2], 4, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match=message):
        paged_attention(*change(batch))


@gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_gpu_bfloat16_mixed_batch(causal):
    batch = make_batch(MIXED + [(300, 1000), (1, 777)], 32, 8, 128, 16, torch.bfloat16, device="cuda")
    assert_matches_reference(batch, causal=causal, dtype=torch.bfloat16)


@gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"hq{c[0]}-hkv{c[1]}-d{c[2]}-p{c[3]}-"
                         + "-".join(f"{k}{v}" for k, v in c[5].items()))
def test_gpu_kernel_cases_bfloat16(case, causal):
    num_q_heads, num_kv_heads, head_dim, page_size, _, knobs = case
    batch = make_batch(MIXED, num_q_heads, num_kv_heads, head_dim, page_size, torch.bfloat16, device="cuda")
    assert_matches_reference(batch, causal=causal, dtype=torch.bfloat16, **knobs)


@gpu
def test_gpu_write_kv_cache():
    k, v, k_cache, v_cache, slots = _write_case(9, torch.int64)
    on_gpu = [t.cuda() for t in (k, v, k_cache, v_cache, slots)]
    write_kv_cache_torch(k, v, k_cache, v_cache, slots)
    write_kv_cache(*on_gpu)
    assert torch.equal(on_gpu[2].cpu(), k_cache) and torch.equal(on_gpu[3].cpu(), v_cache)


@gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_long_context_bfloat16(head_dim):
    """8k-16k contexts: a long prefill, a chunked-prefill continuation and decodes, default knobs and split."""
    seqs = [(8192, 8192), (1024, 12000), (1, 16384), (1, 9000)]
    batch = make_batch(seqs, 4, 1, head_dim, 16, torch.bfloat16, device="cuda", seed=7)
    assert_matches_reference(batch, causal=True, dtype=torch.bfloat16)
    decode = make_batch(seqs[2:], 4, 1, head_dim, 16, torch.bfloat16, device="cuda", seed=8)
    assert_matches_reference(decode, causal=True, dtype=torch.bfloat16, num_kv_splits=16)


@pytest.mark.parametrize("threads", [1, 2])
def test_torch_path_attends_same_length_fresh_sequences_together_with_the_same_bits(threads, monkeypatch):
    """Bidirectional steps of whole sequences (an encoder's; a masked LM's copies all share one length) attend
    over runs of same-length sequences in one SDPA call: bit for bit the outputs of one call per sequence, for
    any thread count, and a sequence's bits do not depend on how long its run is."""
    from triton_kernels.paged_attention import sdpa
    seqs = [(30, 30)] * 5 + [(12, 12), (30, 30), (30, 30), (7, 7)] + [(8, 40)] + [(12, 12)] * 3
    q, k_cache, v_cache, tables, cu, kv_lens = make_batch(seqs, 4, 2, 64, 16, torch.float32, seed=11)
    new_k, new_v = torch.randn(q.shape[0], 2, 64), torch.randn(q.shape[0], 2, 64)
    calls = []
    batched = sdpa._attend_same_length
    monkeypatch.setattr(sdpa, "_attend_same_length", lambda q, k, v, n, **kw: calls.append(n) or batched(q, k, v, n, **kw))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run = lambda: paged_attention_sdpa(q, k_cache, v_cache, tables, cu, kv_lens, torch.empty_like(q),  # noqa: E731
                                           causal=False, scale=64 ** -0.5, new_kv=(new_k, new_v))
        together = run()
        assert calls == [5, 2, 3]
        monkeypatch.setattr(sdpa, "_same_length_run", lambda starts, lens, s: 1)
        one_by_one = run()
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(together, one_by_one)
    alone = paged_attention_sdpa(q[:30], k_cache, v_cache, tables[:1], cu[:2], kv_lens[:1], torch.empty_like(q[:30]),
                                 causal=False, scale=64 ** -0.5, new_kv=(new_k[:30], new_v[:30]))
    assert torch.equal(alone, together[:30])
