"""The Gated DeltaNet token mixer (Qwen3.5's linear-attention layers) over ragged steps with state slots.

Per sequence it keeps two states between steps: the last `kernel - 1` inputs of the depthwise causal
conv, and the `[HV, K, V]` float32 delta-rule matrix. A sequence split over several steps (chunked
prefill, then decoding) reads both from its slot and writes them back, so it computes exactly what one
pass over the whole sequence computes. The delta rule itself runs on our kernels (triton_kernels).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from triton_kernels import causal_conv1d, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, pointwise

from ..step import StepContext
from .linear import Linear
from .norms import GatedRMSNorm


def conv_fixups(ctx: StepContext, width: int):
    """Index arrays for the ragged causal conv, computed as shifted slices of the step's flat input.

    Shifting the step's input x by j rows hands every token its input j rows back. That is right except
    in the first `width` rows of each sequence, where the shift reads the previous sequence's tokens (or
    nothing, before row 0) instead of the sequence's own stored window (or zeros, for a fresh sequence).
    Those few (row, shift) pairs are corrected before the activation: out[row] += w[shift] * (right - wrong).

    Sources are codes into x and a small table `extra = [zero row; stored windows of the reading sequences,
    width rows each, oldest first]`: code c >= 0 is row c of x, c < 0 is row -1 - c of extra. Returns host
    int64 arrays rows [M] (ascending), shifts [M], wrong [M], right [M], and window [W, width] (the last `width`
    inputs of each sequence whose state is kept, oldest first) or None.
    """
    S, q_lens = ctx.num_seqs, ctx.q_lens.astype(np.int64)
    starts = np.zeros(S, np.int64)
    np.cumsum(q_lens[:-1], out=starts[1:])
    read_pos = np.full(S, -1, np.int64)
    if ctx.state_read is not None:
        read_pos[ctx.state_read[0]] = np.arange(len(ctx.state_read[0]))

    def source(seq, p):
        """Code of the input at position p (negative: before this step) of sequence seq."""
        before = np.where(read_pos[seq] >= 0, -2 - (read_pos[seq] * width + width + p), -1)
        return np.where(p >= 0, starts[seq] + p, before)

    first, shift = np.triu_indices(width + 1, 1)    # every row i < width of a sequence, shifts j > i
    seq = np.repeat(np.arange(S), len(first))
    i, j = np.tile(first, S), np.tile(shift, S)
    keep = i < q_lens[seq]
    seq, i, j = seq[keep], i[keep], j[keep]
    rows = starts[seq] + i
    wrong = np.where(rows >= j, rows - j, -1)
    right = source(seq, i - j)
    differ = wrong != right
    window = None
    if ctx.state_write is not None:
        wseq = ctx.state_write[0][:, None]
        window = source(wseq, q_lens[wseq] - width + np.arange(width)[None, :])
    return rows[differ], j[differ], wrong[differ], right[differ], window


def direct_conv_sources(rows: np.ndarray, shifts: np.ndarray, right: np.ndarray, width: int):
    """For the batch-invariant conv: the distinct rows of conv_fixups' pairs (ascending) and, per row, the
    source code (conv_fixups' codes) of every tap, codes[:, j] the input j rows back: the row's own
    sequence (or its stored window, or zero) where a pair corrects it, the shifted row elsewhere."""
    fixed, at = np.unique(rows, return_inverse=True)
    codes = fixed[:, None] - np.arange(width + 1)[None, :]
    codes[codes < 0] = -1
    codes[at, shifts] = right
    return fixed, codes


def conv_slots(ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The Triton conv's view of the step's state slots: (slot per sequence, -1 for none [S]; whether it
    starts from its slot's window [S]) on the device, or None when no sequence reads or keeps a window."""
    if ctx.state_write is None:
        assert ctx.state_read is None, "a sequence continues a window it does not keep"
        return None
    slots = np.full(ctx.num_seqs, -1, np.int64)
    slots[ctx.state_write[0]] = ctx.state_write[1]
    reads = np.zeros(ctx.num_seqs, bool)
    if ctx.state_read is not None:   # the engine reads and writes a sequence's window in its one slot
        assert (slots[ctx.state_read[0]] == ctx.state_read[1]).all(), "a window read from one slot, kept in another"
        reads[ctx.state_read[0]] = True
    return (torch.from_numpy(slots).to(ctx.device, non_blocking=True),
            torch.from_numpy(reads).to(ctx.device, non_blocking=True))


# Rows per block of the CPU conv: 64 rows of a 1536-channel projection (the 1/8 Qwen3.5) are 384 KiB,
# so the four taps run in L2. Per layer on a 4k-token batch (bench/profile_cpu_layers.py
# --conv-block-rows N, three runs each): 13.4-13.6 ms in blocks of 64, 18.3-19.3 ms unblocked.
CPU_CONV_BLOCK_ROWS = 64


# Chunk size of the delta rule's torch path on CPU, after the path's grouping and triangular solve of
# 2026-11-22. ms of delta rule per layer, 1 thread, chunk 8 / 16 / 32 / 64 (bench/profile_cpu_layers.py
# [--model demo] [--batch longest|shortest] --delta-chunk-size C; this VM varies by ~10%): the demo
# model (K = V = 16) 6.3-6.5 / 5.9-6.6 / 8.9 / - on 12 sequences of ~340 tokens, 20.8-21.2 / 16.6-16.9 /
# 19.4 / - on its 4 longest; the 1/8 Qwen3.5 (K = V = 64) 41.5-43.1 / 38.5-39.3 / 43.7-48.0 / 60.4 on
# 12 sequences of ~330 tokens, - / 95.0 / 98.9 / - on its 4 longest, - / 41.0 / 48.9 / - on its shortest
# 4k tokens; on random inputs (bench/cpu_op_costs.py, the delta rule alone) Qwen3.5-0.8B's 16 heads of
# 128 204 / 146 / 156 / 192 and 8 heads of 32 17.7 / 15.9 / 17.4 / 26.1. Chunks are cut to the longest sequence of a group, so short
# sequences never pay for the size.
CPU_CHUNK_SIZE = 16


class GatedDeltaNet(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = config.linear_conv_kernel_dim
        # One matmul for the four input projections: [q k v | z | b | a].
        self.in_proj = Linear(config.hidden_size, self.conv_dim + self.value_dim + 2 * self.num_v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.kernel), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, config.hidden_size, bias=False)
        # Set by the model runner: conv windows [slots, kernel - 1, conv_dim], recurrent [slots, HV, K, V] fp32.
        self.state: tuple[torch.Tensor, torch.Tensor] | None = None
        self.kernel_args: dict = {}

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        T = x.shape[0]
        qkv, z, b, a = self.in_proj(x).split([self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], -1)
        conv_state, recurrent = self.state
        mixed = self._conv(qkv, conv_state, ctx)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(1, T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(1, T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(1, T, self.num_v_heads, self.head_v_dim)
        beta = pointwise.sigmoid(b)[None]
        g = (-self.A_log.float().exp() * pointwise.softplus(a.float() + self.dt_bias))[None]

        form = ctx.delta_rule_form()
        if form == "mixed":
            o = self._mixed(q, k, v, g, beta, recurrent, ctx)
        elif form == "recurrent":   # every sequence reads and keeps its state: updated in place in its slot
            assert ctx.state_read is not None and ctx.state_write is not None and len(ctx.state_write[0]) == T
            o = self._recurrent(q, k, v, g, beta, recurrent, ctx.cu_seqlens,
                                ctx.on_device("write_slots", ctx.state_write[1]))
        else:
            o = self._chunked(q, k, v, g, beta, recurrent, ctx.cu_seqlens, ctx.num_seqs,
                              ctx.state_read, ctx.state_write, ctx, "")
        return self._output(o, z, T)

    def _recurrent(self, q, k, v, g, beta, recurrent, cu_seqlens, slots):
        """One token per sequence (decode), each state updated in place in its slot."""
        o, _ = fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, initial_state=recurrent, state_indices=slots, cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=True, **self.kernel_args.get("fused_recurrent_gated_delta_rule", {}))
        return o

    def _chunked(self, q, k, v, g, beta, recurrent, cu_seqlens, num_seqs, state_read, state_write, ctx, key: str):
        """Sequences of any length from their stored state (state_read: rows, slots) or from zero, the
        final states of state_write's rows stored in their slots. `key` names the step's index tensors
        (built once per step, for every layer)."""
        initial = None
        if state_read is not None:
            rows = ctx.on_device(key + "read_rows", state_read[0])
            slots = ctx.on_device(key + "read_slots", state_read[1])
            if len(state_read[0]) == num_seqs:
                initial = recurrent[slots]
            else:
                initial = recurrent.new_zeros(num_seqs, *recurrent.shape[1:])
                initial[rows] = recurrent[slots]
        keep = state_write is not None
        knobs = self.kernel_args.get("chunk_gated_delta_rule", {})
        if not knobs.get("chunk_size"):
            knobs = dict(knobs, chunk_size=CPU_CHUNK_SIZE)
        o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial, output_final_state=keep,
                                          cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True, **knobs)
        if keep:
            recurrent[ctx.on_device(key + "write_slots", state_write[1])] = final[
                ctx.on_device(key + "write_rows", state_write[0])]
        return o

    def _mixed(self, q, k, v, g, beta, recurrent, ctx: StepContext):
        """Batch-invariant steps that mix generated tokens with prefill: the decoding sequences through the
        recurrent form, the rest chunked, so each token takes the path it takes in any other step (the
        one-token prefill continuation included, which the chunked form computes)."""
        decoding = ctx.decoding
        starts = np.zeros(ctx.num_seqs + 1, np.int64)
        np.cumsum(ctx.q_lens, out=starts[1:])
        slot_of = np.full(ctx.num_seqs, -1, np.int64)
        slot_of[ctx.state_write[0]] = ctx.state_write[1]
        reads = np.zeros(ctx.num_seqs, bool)
        if ctx.state_read is not None:
            reads[ctx.state_read[0]] = True
        o = q.new_empty(1, q.shape[1], self.num_v_heads, self.head_v_dim)
        dec = np.flatnonzero(decoding)
        rows = ctx.on_device("dec_rows", starts[dec])
        cu = ctx.on_device("dec_cu", np.arange(len(dec) + 1))
        part = [x[:, rows] for x in (q, k, v, g, beta)]
        o[:, rows] = self._recurrent(*part, recurrent, cu, ctx.on_device("dec_slots", slot_of[dec])).to(o.dtype)
        pre = np.flatnonzero(~decoding)
        lens = ctx.q_lens[pre].astype(np.int64)
        token_rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in pre])
        rows = ctx.on_device("pre_token_rows", token_rows)
        cu = np.zeros(len(pre) + 1, np.int64)
        np.cumsum(lens, out=cu[1:])
        read = np.flatnonzero(reads[pre])
        write = np.flatnonzero(slot_of[pre] >= 0)
        part = [x[:, rows] for x in (q, k, v, g, beta)]
        o[:, rows] = self._chunked(*part, recurrent, ctx.on_device("pre_cu", cu), len(pre),
                                   (read, slot_of[pre][read]) if len(read) else None,
                                   (write, slot_of[pre][write]) if len(write) else None, ctx, "pre_").to(o.dtype)
        return o

    def _output(self, o: torch.Tensor, z: torch.Tensor, T: int) -> torch.Tensor:
        o = self.norm(o.reshape(T, self.num_v_heads, self.head_v_dim), z.reshape(T, self.num_v_heads, self.head_v_dim))
        return self.out_proj(o.reshape(T, self.value_dim))

    def _conv(self, x: torch.Tensor, conv_state: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Depthwise causal conv + SiLU over each sequence's tokens, its stored window in front.

        Computed in float32 over the step's tokens as shifted slices (one pass per tap, no gather of x),
        with the rows next to sequence starts fixed up (see conv_fixups) before the SiLU. Returns float32
        on CPU, where the delta rule computes in float32 anyway; x's dtype on CUDA, for the kernels.
        With the Triton kernels, one pass of triton_kernels.causal_conv1d instead (x's dtype)."""
        if ctx.triton_kernels:
            slots = ctx.cached("conv_slots", lambda: conv_slots(ctx))
            return causal_conv1d(x, self.conv_weight, cu_seqlens=ctx.cu_seqlens,
                                 conv_state=None if slots is None else conv_state,
                                 state_indices=None if slots is None else slots[0],
                                 has_initial_state=None if slots is None else slots[1],
                                 **self.kernel_args.get("causal_conv1d", {}))
        width, C = self.kernel - 1, x.shape[1]
        rows, shifts, wrong, right, window = ctx.cached(f"conv_fixups_{width}", lambda: conv_fixups(ctx, width))
        parts = [x.new_zeros(1, C)]
        if ctx.state_read is not None:
            parts.append(conv_state[ctx.on_device("read_slots", ctx.state_read[1])].reshape(-1, C).to(x.dtype))
        extra = torch.cat(parts)

        def gather(codes):
            return torch.where((codes >= 0)[:, None], x[codes.clamp(min=0)], extra[(-1 - codes).clamp(min=0)])

        if window is not None:   # read every stored window before any is overwritten
            kept = gather(ctx.on_device(f"conv_window_{width}", window.ravel())).view(-1, width, C)
            conv_state[ctx.on_device("write_slots", ctx.state_write[1])] = kept.to(conv_state.dtype)
        # Taps as contiguous rows [kernel, C]: a strided weight column made each tap ~3x slower.
        w = self.conv_weight.float().T.contiguous()
        fix_rows = fix = None
        if len(rows) and ctx.invariant_block:
            # Batch-invariant: the rows next to sequence starts are computed again from their own inputs,
            # with the main loop's operations in its order, and replace the shifted ones: the same bits
            # whatever sequence came before in the step (a correction would add its rounding).
            fix_rows_np, codes = ctx.cached(f"conv_direct_sources_{width}",
                                            lambda: direct_conv_sources(rows, shifts, right, width))
            fix_rows = ctx.on_device(f"conv_rows_{width}", fix_rows_np)
            fix = gather(ctx.on_device(f"conv_direct_{width}", codes[:, 0])).float().mul_(w[width])
            for j in range(1, width + 1):
                fix.addcmul_(gather(ctx.on_device(f"conv_direct_{width}_{j}", codes[:, j])).float(), w[width - j])
            rows = fix_rows_np
        elif len(rows):   # out[row] += w[shift] * (right - wrong), added block by block before the SiLU
            right_rows = gather(ctx.on_device(f"conv_right_{width}", right)).float()
            wrong_rows = gather(ctx.on_device(f"conv_wrong_{width}", wrong)).float()
            fix = (right_rows - wrong_rows).mul_(w[width - ctx.on_device(f"conv_shifts_{width}", shifts)])
            fix_rows = ctx.on_device(f"conv_rows_{width}", rows)
        T = x.shape[0]
        on_cpu = x.device.type == "cpu"
        block = CPU_CONV_BLOCK_ROWS if on_cpu else T
        out = torch.empty(T, C, dtype=torch.float32, device=x.device)
        # 16-bit inputs are converted a block (plus the width rows before it) at a time, in cache.
        scratch = None if x.dtype == torch.float32 else x.new_empty(min(T, block + width), C, dtype=torch.float32)
        for r0 in range(0, T, block):   # on CPU, blocks of rows that stay in cache across the taps
            r1, s0 = min(T, r0 + block), max(0, r0 - width)
            src = x[s0:r1] if scratch is None else scratch[:r1 - s0].copy_(x[s0:r1])   # src[i] is x[s0 + i]
            torch.mul(src[r0 - s0:], w[width], out=out[r0:r1])
            for j in range(1, width + 1):
                a = max(r0, j)
                if a < r1:
                    out[a:r1].addcmul_(src[a - j - s0:r1 - j - s0], w[width - j])
            if fix is not None:
                lo, hi = np.searchsorted(rows, (r0, r1))
                if hi > lo and ctx.invariant_block:
                    out.index_copy_(0, fix_rows[lo:hi], fix[lo:hi])
                elif hi > lo:
                    out.index_add_(0, fix_rows[lo:hi], fix[lo:hi])
            pointwise.silu_(out[r0:r1])
        # On CPU the delta rule computes in float32, so a 16-bit model's activations go to it as they are.
        return out if on_cpu else out.to(x.dtype)

    def load(self, t, p: str) -> None:
        self.in_proj.weight.copy_(torch.cat([t.get(p + n + ".weight") for n in
                                             ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]))
        self.conv_weight.copy_(t.get(p + "conv1d.weight").reshape(self.conv_dim, self.kernel))
        self.dt_bias.copy_(t.get(p + "dt_bias"))
        self.A_log.copy_(t.get(p + "A_log"))
        self.norm.weight.copy_(t.get(p + "norm.weight"))
        self.out_proj.weight.copy_(t.get(p + "out_proj.weight"))
