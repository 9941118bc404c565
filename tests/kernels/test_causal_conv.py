"""Ragged causal conv (+ SiLU): the Triton kernels and the naive torch path against transformers' own conv.

The reference we did not write is transformers' Qwen3.5 conv (`causal_conv1d_fn` for a fresh sequence,
`causal_conv1d_update` for one that continues a stored window: the torch fallbacks its Gated DeltaNet runs
without the causal-conv1d package), with the weights of a Qwen3.5 Gated DeltaNet layer built from its
config. Tolerances are grounded in float64: the same transformers functions on the same (already
rounded) inputs in float64 are the exact values, and in float32 ours must be as accurate as transformers'
float32 conv (FACTOR x its error + FLOOR, tests/float64_reference.py). float16 inputs give float16
outputs: each is the exact value rounded once to float16 (at most 2^-11 of it) after float32 sums
(FLOOR). Windows kept in the slots are copies of inputs, so they must be bit for bit.

Triton runs on CUDA when present, else through the interpreter (tests/kernels/conftest.py): shapes are
small, with explicit blocks of 16 tokens x 32 channels so that sequences straddle blocks, lengths are
1, multiples of the block and not, and the 56 channels end inside a block.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from triton_kernels import causal_conv1d, launch_config
from triton_kernels._launch import A100, H100, dry_run
from triton_kernels.causal_conv import conv_knobs, naive_causal_conv1d
from triton_kernels.launch_config import CausalConvKnobs, launch_row

from tests.float64_reference import FLOOR, assert_as_accurate, relative_error
from tests.kernels.float_cases import skip_interpreter_bf16

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
KNOBS = dict(block_t=16, block_c=32, num_warps=4)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def qwen35_conv_weight() -> torch.Tensor:
    """[C, 4] float32: the depthwise conv of a small Qwen3.5 Gated DeltaNet layer (C = 2 x 16 + 24 = 56)."""
    config = Qwen3_5TextConfig(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=2,
                               linear_key_head_dim=8, linear_value_head_dim=12, num_hidden_layers=1,
                               layer_types=["linear_attention"])
    torch.manual_seed(0)
    layer = hf.Qwen3_5GatedDeltaNet(config, 0)
    assert layer.activation == "silu" and layer.conv1d.bias is None
    return layer.conv1d.weight.detach().squeeze(1).contiguous()


WEIGHT = qwen35_conv_weight()
C, WIDTH = WEIGHT.shape[0], WEIGHT.shape[1] - 1


def transformers_conv(x: torch.Tensor, window: torch.Tensor | None, dtype: torch.dtype, weight=WEIGHT):
    """transformers' conv of one sequence x [L, C] after `window` [WIDTH, C] (None: fresh), in `dtype`:
    (output [L, C], the window it leaves [WIDTH, C])."""
    w, seq = weight.to(dtype), x.to(dtype).T[None]
    if window is None:
        out = hf.causal_conv1d_fn(seq, w, None, activation="silu")
        window = torch.zeros(WIDTH, C, dtype=dtype)
        left = torch.cat([window, x.to(dtype)])[-WIDTH:]
    else:
        state = window.to(dtype).T[None].clone()             # [1, C, WIDTH], updated in place
        out = hf.causal_conv1d_update(seq, state, w, None, activation="silu")
        left = state[0].T
    return out[0].T, left


def lengths_cu(lengths) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=DEVICE)


def test_fresh_ragged_batch_matches_transformers():
    """One pass over sequences of 1, 16 (a block), 17, 33 and 2 tokens, read from a column slice of a wider
    projection (as the engine passes it), no windows."""
    lengths = [1, 16, 17, 5, 33, 2]
    gen = torch.Generator().manual_seed(1)
    proj = torch.randn(sum(lengths), C + 24, generator=gen)
    x = proj[:, 8:8 + C]                                       # row stride C + 24: read in place
    out = causal_conv1d(x.to(DEVICE), WEIGHT.to(DEVICE), cu_seqlens=lengths_cu(lengths), **KNOBS).cpu()
    naive = naive_causal_conv1d(x, WEIGHT, cu_seqlens=lengths_cu(lengths).cpu())
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    theirs, exact = (torch.cat([transformers_conv(x[a:b], None, dt)[0] for a, b in zip(bounds, bounds[1:])])
                     for dt in (torch.float32, torch.float64))
    assert_as_accurate(out, theirs, exact, "triton conv")
    assert_as_accurate(naive, theirs, exact, "naive conv")


def random_windows(num_slots: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(num_slots, WIDTH, C, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_continuing_and_fresh_sequences_with_slots(dtype):
    """A step mixing fresh sequences, ones that continue their slot's window (with 1, 2 and more tokens:
    fewer than the window keep part of the old one), and one without a slot; slots scattered in the pool,
    the unused ones untouched."""
    skip_interpreter_bf16(dtype)
    lengths = [2, 1, 20, 7, 3, 1]
    slots = [5, 0, 2, -1, 7, 3]
    reads = [True, True, False, False, True, False]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(sum(lengths), C, generator=gen).to(dtype)
    weight = WEIGHT.to(dtype)                                  # the references take the same rounded values
    pool = random_windows(9, seed=3, dtype=dtype)
    before = pool.clone()
    dev_pool = pool.to(DEVICE)
    out = causal_conv1d(x.to(DEVICE), weight.to(DEVICE), cu_seqlens=lengths_cu(lengths),
                        conv_state=dev_pool, state_indices=torch.tensor(slots, device=DEVICE),
                        has_initial_state=torch.tensor(reads, device=DEVICE), **KNOBS)
    assert out.dtype == dtype
    out, dev_pool = out.cpu(), dev_pool.cpu()
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    parts = {torch.float32: [], torch.float64: []}
    for n, (a, b) in enumerate(zip(bounds, bounds[1:])):
        window = before[slots[n]] if reads[n] else None
        for dt, rows in parts.items():
            y, left = transformers_conv(x[a:b].float(), None if window is None else window.float(), dt,
                                        weight.float())
            rows.append(y)
        if slots[n] >= 0:
            assert torch.equal(dev_pool[slots[n]], left.to(dtype)), f"window of sequence {n}"
    untouched = [s for s in range(9) if s not in slots]
    assert torch.equal(dev_pool[untouched], before[untouched])
    theirs, exact = torch.cat(parts[torch.float32]), torch.cat(parts[torch.float64])
    if dtype == torch.float32:
        assert_as_accurate(out, theirs, exact, "conv output")
    else:   # one rounding to 16 bits of each output: at most the dtype's unit roundoff (2^-11, 2^-8) of its magnitude
        assert relative_error(out, exact) <= torch.finfo(dtype).eps / 2 + FLOOR


def test_chunked_prefill_then_decode_equals_one_pass():
    """Four sequences run in chunks of different sizes (1, shorter than the window, across blocks), mixed
    in ragged steps, then decoded one token per sequence per step: every output is what one pass over
    the whole sequences gives (transformers' float64 conv as the exact values), and each slot ends with
    the sequence's last three inputs."""
    lengths = [9, 23, 4, 14]
    chunks = [[1, 2, 6], [17, 1, 5], [4], [3, 11]]            # prefill pieces per sequence
    decode_steps = 3
    slots = torch.tensor([6, 1, 3, 4], device=DEVICE)
    total = [n + decode_steps for n in lengths]
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randn(n, C, generator=gen) for n in total]
    pool = torch.zeros(8, WIDTH, C, device=DEVICE)
    weight = WEIGHT.to(DEVICE)
    outs = [[] for _ in seqs]
    done = [0] * len(seqs)
    # Prefill: step k runs the k-th chunk of every sequence that has one.
    for k in range(max(map(len, chunks))):
        step = [n for n in range(len(seqs)) if k < len(chunks[n])]
        pieces = [seqs[n][done[n]:done[n] + chunks[n][k]] for n in step]
        out = causal_conv1d(torch.cat(pieces).to(DEVICE), weight, cu_seqlens=lengths_cu([len(p) for p in pieces]),
                            conv_state=pool, state_indices=slots[step],
                            has_initial_state=torch.tensor([done[n] > 0 for n in step], device=DEVICE), **KNOBS).cpu()
        for n, rows in zip(step, out.split([len(p) for p in pieces])):
            outs[n].append(rows)
            done[n] += len(rows)
    assert done == lengths
    for _ in range(decode_steps):     # every sequence adds one token
        out = causal_conv1d(torch.stack([s[d] for s, d in zip(seqs, done)]).to(DEVICE), weight,
                            cu_seqlens=lengths_cu([1] * len(seqs)), conv_state=pool, state_indices=slots,
                            has_initial_state=torch.ones(len(seqs), dtype=torch.bool, device=DEVICE), **KNOBS).cpu()
        for n in range(len(seqs)):
            outs[n].append(out[n:n + 1])
            done[n] += 1
    ours = torch.cat([torch.cat(o) for o in outs])
    theirs, exact = (torch.cat([transformers_conv(s, None, dt)[0] for s in seqs]) for dt in (torch.float32, torch.float64))
    assert_as_accurate(ours, theirs, exact, "chunked prefill + decode")
    for n, s in enumerate(seqs):
        assert torch.equal(pool[slots[n]].cpu(), s[-WIDTH:]), f"window of sequence {n}"


def test_the_values_the_kernels_trust_are_checked_on_cpu():
    x, cu = torch.randn(4, C), torch.tensor([0, 2, 4], dtype=torch.int32)
    pool = torch.zeros(3, WIDTH, C)
    with pytest.raises(ValueError, match="share a state slot"):
        causal_conv1d(x, WEIGHT, cu_seqlens=cu, conv_state=pool, state_indices=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="needs a state slot"):
        causal_conv1d(x, WEIGHT, cu_seqlens=cu, conv_state=pool, state_indices=torch.tensor([-1, 0]),
                      has_initial_state=torch.tensor([True, False]))
    with pytest.raises(ValueError, match="end at the token count"):
        causal_conv1d(x, WEIGHT, cu_seqlens=torch.tensor([0, 2, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[slots, 3, 56\]"):
        causal_conv1d(x, WEIGHT, cu_seqlens=cu, conv_state=torch.zeros(3, 4, C), state_indices=torch.tensor([0, 1]))


def _planned_conv(target):
    """The two launches of a 4k-token bf16 step of 8 sequences with windows, planned for `target`."""
    meta = torch.device("meta")
    x, w = torch.empty(4096, 6144, dtype=torch.bfloat16, device=meta), torch.empty(6144, 4, dtype=torch.bfloat16, device=meta)
    with dry_run(target) as launches:
        causal_conv1d(x, w, cu_seqlens=torch.empty(9, dtype=torch.int32, device=meta),
                      conv_state=torch.empty(8, 3, 6144, dtype=torch.bfloat16, device=meta),
                      state_indices=torch.empty(8, dtype=torch.int64, device=meta))
    return launches


def test_launch_knobs_come_from_the_table_for_the_gpu_and_explicit_ones_win():
    meta = torch.device("meta")
    for target in (A100, H100):
        row = launch_row(target).conv
        conv, window = _planned_conv(target)
        assert conv.grid == (4096 // row.block_t, 6144 // row.block_c) and window.grid == (8, 6144 // row.block_c)
        assert (conv.constexprs["BT"], conv.constexprs["BC"], window.constexprs["BC"]) == (row.block_t, row.block_c,
                                                                                         row.block_c)
        assert conv.num_warps == window.num_warps == row.num_warps and conv.num_stages == window.num_stages == 1
        with dry_run(target):
            assert conv_knobs(meta, block_t=16, num_warps=None) == CausalConvKnobs(16, row.block_c, row.num_warps)


def test_launch_knobs_are_read_from_the_launch_table(monkeypatch):
    """A change to launch_config.TABLE's conv part reaches the launches (the table is their only source)."""
    changed = CausalConvKnobs(block_t=64, block_c=256, num_warps=4)
    table = dict(launch_config.TABLE)
    table[80] = replace(table[80], conv=changed)
    monkeypatch.setattr(launch_config, "TABLE", table)
    conv, window = _planned_conv(A100)
    assert (conv.grid, conv.constexprs["BT"], conv.constexprs["BC"], conv.num_warps) == ((64, 24), 64, 256, 4)
    assert (window.grid, window.constexprs["BC"], window.num_warps) == ((8, 24), 256, 4)
    conv, _ = _planned_conv(H100)   # the sm_90 row is untouched
    assert conv.constexprs["BT"] == launch_config.TABLE[90].conv.block_t
