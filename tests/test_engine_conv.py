"""The delta-rule layers' ragged causal conv against torch's own conv1d, one sequence at a time.

A step mixes fresh sequences with ones that continue a stored conv window, with 1..N new tokens each
(fewer tokens than the window is the decode case). The reference runs F.conv1d over each sequence's
window followed by its tokens, in float64 (the exact values) and in float32: ours, four float32 products
per channel, must be as accurate as torch's float32 conv (tests/float64_reference.py), since how the two
round depends on the CPU's kernels. bfloat16 inputs (a bfloat16 model) are converted block by block and
the result stays float32 on CPU, so the reference is the same conv of the same bfloat16 values.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.models.step import StepContext
from pipeline.models.layers.gated_deltanet import GatedDeltaNet
from tests.float64_reference import assert_as_accurate


class Config:
    linear_num_key_heads, linear_num_value_heads = 2, 2
    linear_key_head_dim, linear_value_head_dim = 4, 4
    linear_conv_kernel_dim = 4
    hidden_size, rms_norm_eps = 8, 1e-6


def step_context(q_lens, read, write, slots, invariant_block=0):
    q_lens = np.asarray(q_lens, np.int64)
    T = int(q_lens.sum())
    z = torch.zeros(T, dtype=torch.int64)
    as_pair = lambda rows: (np.asarray(rows, np.int64), slots[np.asarray(rows, np.int64)]) if rows else None  # noqa: E731
    return StepContext(input_ids=z, positions=z, cu_seqlens=torch.zeros(1), kv_lens=torch.zeros(1),
                       block_tables=torch.zeros(1), slot_mapping=z, q_lens=q_lens,
                       prior_lens=np.where(np.isin(np.arange(len(q_lens)), read), 5, 0),
                       state_read=as_pair(read), state_write=as_pair(write), invariant_block=invariant_block)


@pytest.mark.parametrize("invariant", [False, True], ids=["corrected", "batch-invariant"])
@pytest.mark.parametrize("seed,dtype", [(s, torch.float32) for s in range(8)] + [(7, torch.bfloat16)])
def test_ragged_conv_matches_conv1d_per_sequence(seed, dtype, invariant):
    """Both ways of fixing the rows next to sequence starts: a correction added to the shifted sum, or (batch-
    invariant) the row computed again from its own inputs."""
    rng = np.random.default_rng(seed)
    layer = GatedDeltaNet(Config())
    width, C = layer.kernel - 1, layer.conv_dim
    torch.manual_seed(seed)
    layer.conv_weight.data = torch.randn(C, layer.kernel)
    large = seed >= 6   # steps of hundreds of tokens: the CPU conv runs them in blocks of rows
    S = int(rng.integers(1, 40 if large else 9))
    q_lens = rng.integers(1, 80 if large else 7, S)
    if seed % 2 and not large:
        q_lens[:] = 1   # a decode step: every sequence adds one token to its window
    read = sorted(rng.choice(S, int(rng.integers(0, S + 1)), replace=False).tolist())
    write = sorted(rng.choice(S, int(rng.integers(0, S + 1)), replace=False).tolist())
    slots = rng.permutation(S + 3)[:S]   # slots are anywhere in the table
    state = torch.randn(S + 3, width, C).to(dtype)
    before = state.clone()
    x = torch.randn(int(q_lens.sum()), C).to(dtype)

    out = layer._conv(x, state, step_context(q_lens, read, write, slots, invariant_block=64 if invariant else 0))
    assert out.dtype == torch.float32
    x, before = x.float(), before.float()

    starts = np.concatenate([[0], np.cumsum(q_lens)])
    refs = {torch.float32: [], torch.float64: []}
    for s in range(S):
        window = before[slots[s]] if s in read else torch.zeros(width, C)
        full = torch.cat([window, x[starts[s]:starts[s + 1]]])          # [width + q_len, C]
        for ref_dtype, rows in refs.items():
            conv = F.conv1d(full.T[None].to(ref_dtype), layer.conv_weight[:, None, :].to(ref_dtype), groups=C)
            rows.append(F.silu(conv[0].T))
        kept = state[slots[s]]
        torch.testing.assert_close(kept.float(), full[-width:] if s in write else before[slots[s]], atol=0, rtol=0)
    assert_as_accurate(out, torch.cat(refs[torch.float32]), torch.cat(refs[torch.float64]), "conv output")
