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
from triton_kernels.causal_conv.torch_path import causal_conv1d_torch, conv_index
from triton_kernels.gates import delta_rule_gates
from triton_kernels.rms_norm import gated_rms_norm

from ..step import StepContext
from ..transfers import to_device
from .linear import Linear
from .norms import GatedRMSNorm


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
    # One copy from pinned memory: a non-blocking copy from pageable memory still waits for the device.
    return tuple(to_device([slots, reads], ctx.device))


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

    def forward(self, x: torch.Tensor, ctx: StepContext, fused: bool = False) -> torch.Tensor:
        """fused (the Triton path's fused layers): the output norm in one pass (triton_kernels.rms_norm
        gated_rms_norm, GatedRMSNorm's arithmetic) instead of its float32 passes, and the gates g and beta in one
        (triton_kernels.gates delta_rule_gates, the same float32 arithmetic) instead of eight small kernels."""
        T = x.shape[0]
        qkv, z, b, a = self.in_proj(x).split([self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], -1)
        conv_state, recurrent = self.state
        mixed = self._conv(qkv, conv_state, ctx)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(1, T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(1, T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(1, T, self.num_v_heads, self.head_v_dim)
        if fused:   # one pass from a and b where the projection wrote them
            g, beta = (t[None] for t in delta_rule_gates(a, b, self.A_log, self.dt_bias))
        else:
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
            host_cu = ctx.cached("host_cu_seqlens", lambda: torch.from_numpy(np.cumsum(np.r_[0, ctx.q_lens])))
            o = self._chunked(q, k, v, g, beta, recurrent, ctx.cu_seqlens, host_cu, ctx.num_seqs,
                              ctx.state_read, ctx.state_write, ctx, "")
        return self._output(o, z, T, fused)

    def _recurrent(self, q, k, v, g, beta, recurrent, cu_seqlens, slots):
        """One token per sequence (decode), each state updated in place in its slot."""
        o, _ = fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, initial_state=recurrent, state_indices=slots, cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=True, **self.kernel_args.get("fused_recurrent_gated_delta_rule", {}))
        return o

    def _chunked(self, q, k, v, g, beta, recurrent, cu_seqlens, host_cu, num_seqs, state_read, state_write, ctx,
                 key: str):
        """Sequences of any length from their stored state (state_read: rows, slots) or from zero, the
        final states of state_write's rows stored in their slots. `key` names the step's index tensors
        (built once per step, for every layer). host_cu: cu_seqlens' values in host memory, so that the
        kernels never read them back from the device."""
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
                                          cu_seqlens=cu_seqlens, cu_seqlens_cpu=host_cu,
                                          use_qk_l2norm_in_kernel=True, **knobs)
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
        o[:, rows] = self._chunked(*part, recurrent, ctx.on_device("pre_cu", cu), torch.from_numpy(cu), len(pre),
                                   (read, slot_of[pre][read]) if len(read) else None,
                                   (write, slot_of[pre][write]) if len(write) else None, ctx, "pre_").to(o.dtype)
        return o

    def _output(self, o: torch.Tensor, z: torch.Tensor, T: int, fused: bool = False) -> torch.Tensor:
        o, z = o.reshape(T, self.num_v_heads, self.head_v_dim), z.reshape(T, self.num_v_heads, self.head_v_dim)
        if fused:
            o = gated_rms_norm(o, z, self.norm.weight, self.norm.eps)
        else:
            o = self.norm(o, z)
        return self.out_proj(o.reshape(T, self.value_dim))

    def _conv(self, x: torch.Tensor, conv_state: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Depthwise causal conv + SiLU over each sequence's tokens, its stored window in front: one pass of
        triton_kernels.causal_conv1d with the Triton kernels (x's dtype), else its torch path (float32 on CPU,
        where the delta rule computes in float32 anyway), whose index arrays every layer of the step shares."""
        if ctx.triton_kernels:
            slots = ctx.cached("conv_slots", lambda: conv_slots(ctx))
            return causal_conv1d(x, self.conv_weight, cu_seqlens=ctx.cu_seqlens,
                                 conv_state=None if slots is None else conv_state,
                                 state_indices=None if slots is None else slots[0],
                                 has_initial_state=None if slots is None else slots[1],
                                 **self.kernel_args.get("causal_conv1d", {}))
        width, invariant = self.kernel - 1, bool(ctx.invariant_block)
        index = ctx.cached(f"conv_index_{width}", lambda: conv_index(
            ctx.q_lens, None if ctx.state_read is None else ctx.state_read[0],
            None if ctx.state_write is None else ctx.state_write[0], width, invariant))
        read = None if ctx.state_read is None else ctx.on_device("read_slots", ctx.state_read[1])
        write = None if ctx.state_write is None else ctx.on_device("write_slots", ctx.state_write[1])
        return causal_conv1d_torch(x, self.conv_weight, index, conv_state=conv_state, read_slots=read,
                                   write_slots=write, batch_invariant=invariant)

    def load(self, t, p: str) -> None:
        self.in_proj.weight.copy_(torch.cat([t.get(p + n + ".weight") for n in
                                             ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]))
        self.conv_weight.copy_(t.get(p + "conv1d.weight").reshape(self.conv_dim, self.kernel))
        self.dt_bias.copy_(t.get(p + "dt_bias"))
        self.A_log.copy_(t.get(p + "A_log"))
        self.norm.weight.copy_(t.get(p + "norm.weight"))
        self.out_proj.weight.copy_(t.get(p + "out_proj.weight"))
