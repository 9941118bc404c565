"""T5's relative-position bias in paged_attention (rel_bias_table, rel_max_distance) against the float64
reference, whose buckets are T5's formula written out in float64 (naive.t5_buckets).

Encoder-shaped ragged batches: whole sequences (q_len == kv_len) on and off page boundaries and over
several pages, one of one token, one with no tokens this step, and a continuation, so the bias's query
positions are tested where they do not start at 0. max_distance is small (12-20) next to the lengths (up
to 150), so every kind of bucket is reached: exact offsets, log buckets, the saturated last bucket, both
directions. T5 does not scale its scores (scale=1.0); its weights keep q . k of order one, so the tests
scale q by D^-0.5 themselves and the tolerances of test_paged_attention.py apply unchanged. The table is
in the inputs' dtype, so the reference sees the very numbers the kernel adds.
"""
import os

import pytest
import torch

from triton_kernels import paged_attention
from triton_kernels.paged_attention.naive import naive_paged_attention, t5_buckets
from triton_kernels.paged_attention.position_bias import distance_buckets, relative_buckets
from triton_kernels.paged_attention.sdpa import paged_attention_sdpa

from tests.kernels.test_paged_attention import TOLERANCE, RecordingKernel, make_batch
from tests.kernels.float_cases import skip_interpreter_bf16

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# The Triton kernel runs compiled on a GPU, else interpreted on the CPU (tests/kernels/conftest.py).
TRITON_DEVICE = "cpu" if INTERPRETED else "cuda" if torch.cuda.is_available() else None
triton_runs = pytest.mark.skipif(TRITON_DEVICE is None, reason="needs a GPU or TRITON_INTERPRET=1 (conftest.py)")
gpu = pytest.mark.skipif(TRITON_DEVICE != "cuda", reason="bfloat16 at every case and long sequences: GPU only")

# (q_len, kv_len): whole sequences (one over 9 pages of 16), one token, nothing this step, a continuation.
ENCODER = [(37, 37), (150, 150), (1, 1), (0, 20), (16, 16), (7, 50), (64, 64)]
# (num_buckets, max_distance): ProtT5 / ProstT5, Ankh, and small distances that the lengths above cross.
BUCKETS = [(32, 128), (64, 128), (16, 12), (33, 20), (4, 9)]


def biased_batch(seqs, num_q_heads, num_kv_heads, head_dim, page_size, dtype, num_buckets, seed=0, device="cpu"):
    batch = make_batch(seqs, num_q_heads, num_kv_heads, head_dim, page_size, dtype, device=device, seed=seed)
    q = (batch[0].float() * head_dim ** -0.5).to(dtype)
    table = 2 * torch.randn(num_buckets, num_q_heads, generator=torch.Generator().manual_seed(seed + 1))
    return (q,) + batch[1:], table.to(device=device, dtype=dtype)


def assert_biased_matches_reference(batch, table, max_distance, dtype, **knobs):
    out = paged_attention(*batch, causal=False, scale=1.0, rel_bias_table=table, rel_max_distance=max_distance,
                          **knobs)
    ref = naive_paged_attention(*batch, causal=False, scale=1.0, rel_bias_table=table, rel_max_distance=max_distance)
    plain = naive_paged_attention(*batch, causal=False, scale=1.0)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    assert (plain - ref).abs().max() > 0.5   # the bias moves outputs far beyond any tolerance (<= 2e-2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the GPU's buckets: needs a CUDA GPU"))])
@pytest.mark.parametrize("num_buckets,max_distance", BUCKETS + [(32, 1024), (128, 128), (6, 5)])
def test_buckets_are_transformers_buckets(num_buckets, max_distance, device):
    """Ours (the lookup by distance), the reference's (T5's formula in float64 per offset) and transformers'
    own (its formula in float32, on the CPU) agree for every offset up to +-3,000, on the CPU and on the GPU
    (where a float64 log computed there once put ProtT5's distances 16, 32 and 64 one bucket low)."""
    from transformers.models.t5.modeling_t5 import T5Attention

    offsets = torch.arange(-3000, 3001)
    theirs = T5Attention._relative_position_bucket(offsets, True, num_buckets, max_distance)
    offsets = offsets.to(device)
    assert torch.equal(relative_buckets(offsets, num_buckets, max_distance).cpu(), theirs)
    assert torch.equal(t5_buckets(offsets, num_buckets, max_distance).cpu(), theirs)
    half = num_buckets // 2
    assert theirs.max() == 2 * half - 1 and distance_buckets(num_buckets, max_distance)[-1] == half - 1


# (Hq, Hkv, D, page_size, dtype, knobs, (num_buckets, max_distance)).
KERNEL_CASES = [
    (2, 2, 32, 16, torch.float32, dict(block_q=8, pages_per_tile=1, num_kv_splits=1), (16, 12)),
    (4, 2, 64, 16, torch.float32, dict(block_q=8, pages_per_tile=2, num_kv_splits=3), (33, 20)),
    (2, 2, 128, 32, torch.float32, dict(block_q=16, pages_per_tile=1, num_kv_splits=1), (32, 128)),
    (2, 1, 80, 16, torch.float32, dict(block_q=4, pages_per_tile=4, num_kv_splits=2), (4, 9)),
    (2, 2, 64, 16, torch.float16, dict(block_q=8, pages_per_tile=2, num_kv_splits=1), (64, 128)),
    (2, 2, 32, 16, torch.float16, dict(block_q=8, pages_per_tile=1, num_kv_splits=2), (16, 12)),
    (2, 1, 64, 16, torch.bfloat16, dict(block_q=8, pages_per_tile=2, num_kv_splits=2), (32, 128)),
]


def case_id(c):
    return (f"hq{c[0]}-hkv{c[1]}-d{c[2]}-p{c[3]}-" + "-".join(f"{k}{v}" for k, v in c[5].items())
            + f"-b{c[6][0]}-m{c[6][1]}")


@triton_runs
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"{case_id(c)}-{c[4]}")
def test_triton_bias_matches_reference(case):
    num_q_heads, num_kv_heads, head_dim, page_size, dtype, knobs, (num_buckets, max_distance) = case
    skip_interpreter_bf16(dtype)
    batch, table = biased_batch(ENCODER, num_q_heads, num_kv_heads, head_dim, page_size, dtype, num_buckets,
                                device=TRITON_DEVICE)
    assert_biased_matches_reference(batch, table, max_distance, dtype, **knobs)


@triton_runs
def test_triton_bias_default_knobs_and_a_float32_table_beside_float16_inputs():
    """The table is read in its own dtype (here float32 beside float16 q, k, v) and added in float32."""
    batch, table = biased_batch(ENCODER[:4], 4, 2, 64, 16, torch.float16, 32, seed=3, device=TRITON_DEVICE)
    assert_biased_matches_reference(batch, table.float(), 128, torch.float16)


@gpu
@pytest.mark.parametrize("case", KERNEL_CASES, ids=case_id)
def test_gpu_bias_bfloat16(case):
    num_q_heads, num_kv_heads, head_dim, page_size, _, knobs, (num_buckets, max_distance) = case
    batch, table = biased_batch(ENCODER, num_q_heads, num_kv_heads, head_dim, page_size, torch.bfloat16,
                                num_buckets, device="cuda")
    assert_biased_matches_reference(batch, table, max_distance, torch.bfloat16, **knobs)


@gpu
def test_gpu_bias_long_sequences_at_prott5_shape():
    """ProtT5-XL's heads (32 of 128, 32 buckets to 128) on 2k- and 1.5k-token sequences, default knobs."""
    batch, table = biased_batch([(2048, 2048), (1500, 1500), (3, 3)], 32, 32, 128, 16, torch.bfloat16, 32,
                                seed=6, device="cuda")
    assert_biased_matches_reference(batch, table, 128, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
@pytest.mark.parametrize("num_buckets,max_distance", BUCKETS)
def test_torch_path_bias_matches_reference(heads, dtype, num_buckets, max_distance, monkeypatch):
    """The CPU path engines run: each sequence's bias by offset read through SDPA's mask as a strided view."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    batch, table = biased_batch(ENCODER + [(300, 300)], heads[0], heads[1], 64, 16, dtype, num_buckets, seed=4)
    assert_biased_matches_reference(batch, table, max_distance, dtype)


def test_torch_path_bias_with_the_steps_own_keys():
    """The engine's call: new_kv hands fresh sequences their keys and values from the step itself."""
    seqs = [(37, 37), (150, 150), (1, 1), (64, 64)]
    (q, k_cache, v_cache, tables, cu, kv_lens), table = biased_batch(seqs, 4, 4, 32, 16, torch.float32, 32, seed=5)
    new_k = torch.cat([k_cache[tables[s, : -(-n // 16)].long()].flatten(0, 1)[:n] for s, (_, n) in enumerate(seqs)])
    new_v = torch.cat([v_cache[tables[s, : -(-n // 16)].long()].flatten(0, 1)[:n] for s, (_, n) in enumerate(seqs)])
    ref = naive_paged_attention(q, k_cache, v_cache, tables, cu, kv_lens, causal=False, scale=1.0,
                                rel_bias_table=table, rel_max_distance=128)
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    out = paged_attention_sdpa(q, k_cache, v_cache, tables, cu, kv_lens, torch.empty_like(q), causal=False,
                               scale=1.0, new_kv=(new_k, new_v), rel_bias_table=table, rel_max_distance=128)
    torch.testing.assert_close(out.double(), ref, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])


def test_bias_reaches_the_launch(monkeypatch):
    from triton_kernels.paged_attention import kernel

    fwd = RecordingKernel()
    monkeypatch.setattr(kernel, "_paged_attention_fwd", fwd)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    batch, table = biased_batch(ENCODER[:3], 4, 4, 32, 16, torch.float32, 32)
    paged_attention(*batch, causal=False, scale=1.0, rel_bias_table=table, rel_max_distance=128)
    paged_attention(*batch, causal=False, scale=1.0)
    [(_, with_bias), (_, without)] = fwd.launches
    assert (with_bias["HAS_BIAS"], with_bias["HALF"], with_bias["MAX_DISTANCE"]) == (True, 16, 128)
    assert not without["HAS_BIAS"]
    # The default rule's tiles with the bias: the launch table's bias_tile_keys (32), not 64.
    assert (with_bias["TILE"], without["TILE"]) == (32, 64)


def test_default_rule_takes_smaller_tiles_with_the_bias():
    from triton_kernels._launch import A100, H100
    from triton_kernels.paged_attention import default_launch

    shape = dict(num_q_tokens=32768, num_seqs=8, num_q_heads=32, num_kv_heads=32, head_dim=128, page_size=16,
                 max_kv_len=4096)
    for target in (A100, H100):
        plain, biased = default_launch(**shape, target=target), default_launch(**shape, target=target, relative_bias=True)
        assert (plain.pages_per_tile, biased.pages_per_tile) == (4, 2)
        assert (plain.block_q, plain.num_warps, plain.num_stages) == (biased.block_q, biased.num_warps, biased.num_stages)


@pytest.mark.parametrize("kwargs, message", [
    (dict(causal=True, rel_bias_table=torch.zeros(32, 4), rel_max_distance=128), "bidirectional attention"),
    (dict(causal=False, rel_bias_table=torch.zeros(32, 4)), "give both or neither"),
    (dict(causal=False, rel_max_distance=128), "give both or neither"),
    (dict(causal=False, rel_bias_table=torch.zeros(32, 2), rel_max_distance=128), r"\[num_buckets, Hq=4\]"),
    (dict(causal=False, rel_bias_table=torch.zeros(2, 4), rel_max_distance=128), "at least 4 buckets"),
    (dict(causal=False, rel_bias_table=torch.zeros(32, 4), rel_max_distance=8), "above num_buckets // 4 = 8"),
    (dict(causal=False, rel_bias_table=torch.zeros(32, 4, dtype=torch.int64), rel_max_distance=128), "floating-point"),
])
def test_bad_bias_arguments_raise_clear_errors(kwargs, message):
    batch = make_batch(ENCODER[:2], 4, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match=message):
        paged_attention(*batch, scale=1.0, **kwargs)
