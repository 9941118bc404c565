"""The Gated DeltaNet token mixer (Qwen3.5's linear-attention layers) over ragged steps with state slots.

Per sequence it keeps two states between steps: the last `kernel - 1` inputs of the depthwise causal
conv, and the `[HV, K, V]` float32 delta-rule matrix. A sequence split over several steps (chunked
prefill, then decoding) reads both from its slot and writes them back, so it computes exactly what one
pass over the whole sequence computes. The delta rule itself runs on our kernels (triton_kernels).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from triton_kernels import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

from ...engine.context import StepContext
from .norms import GatedRMSNorm


def conv_layout(ctx: StepContext, width: int):
    """Where each row of the causal conv's input comes from, for a step whose sequences may continue
    stored conv windows.

    The conv runs over `ext`: per sequence, its `width` previous inputs (its stored window, or zeros for a
    fresh sequence) followed by its tokens, so every token's window is `width + 1` consecutive rows and
    the conv is a sum of shifted slices. `ext` rows are gathered from `[x (T rows); stored windows of the
    reading sequences (R * width rows); a zero row]`. Returns host int64 arrays: ext_index [T + S * width],
    token_rows [T] (each token's row in ext), write_index [W, width] (the window each writing sequence
    keeps, as ext rows) or None.
    """
    T, q_lens, S = ctx.num_tokens, ctx.q_lens, ctx.num_seqs
    starts = np.zeros(S, np.int64)
    np.cumsum(q_lens[:-1], out=starts[1:])
    zero_row = T
    read_pos = np.full(S, -1, np.int64)
    if ctx.state_read is not None:
        rows = ctx.state_read[0]
        read_pos[rows] = np.arange(len(rows))
        zero_row = T + len(rows) * width
    ext_starts = starts + width * np.arange(S)                  # first ext row (window) of each sequence
    prior = np.where(read_pos[:, None] >= 0, T + read_pos[:, None] * width + np.arange(width)[None, :], zero_row)
    seg = np.repeat(np.arange(S), q_lens)
    token_rows = np.arange(T) + width * (seg + 1)
    ext_index = np.empty(T + S * width, np.int64)
    ext_index[(ext_starts[:, None] + np.arange(width)[None, :]).ravel()] = prior.ravel()
    ext_index[token_rows] = np.arange(T)
    write_index = None
    if ctx.state_write is not None:
        wrows = ctx.state_write[0]
        ends = ext_starts[wrows] + width + q_lens[wrows]           # one past each writing sequence's last row
        write_index = ends[:, None] - width + np.arange(width)[None, :]
    return ext_index, token_rows, write_index


# Chunk size of the delta rule's torch path on CPU, measured end to end (embed throughput vs the hf
# engine, same sequences, make_fasta lengths): heads of 16 (the demo model) run best with chunks of 8
# at every length (shortest / median / p90 / longest slices: C=8 1.52 / 1.35 / 1.27 / 1.20x hf,
# C=16 1.28 / 1.16 / 1.13 / 1.19x, C=32 1.07 / 1.01 / 1.03 / 1.10x); heads of 64 are flat between 16 and
# 64 (the GPU's 64 is used). Heads of 32 are not measured: 16, between the two.
def cpu_chunk_size(head_k_dim: int) -> int:
    return 8 if head_k_dim <= 16 else 16 if head_k_dim <= 32 else 64


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
        self.in_proj = nn.Linear(config.hidden_size, self.conv_dim + self.value_dim + 2 * self.num_v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.kernel), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, config.hidden_size, bias=False)
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
        beta = b.sigmoid()[None]
        g = (-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias))[None]

        initial = None
        if ctx.state_read is not None:
            rows, slots = ctx.on_device("read_rows", ctx.state_read[0]), ctx.on_device("read_slots", ctx.state_read[1])
            if len(ctx.state_read[0]) == ctx.num_seqs:
                initial = recurrent[slots]
            else:
                initial = recurrent.new_zeros(ctx.num_seqs, *recurrent.shape[1:])
                initial[rows] = recurrent[slots]
        keep = ctx.state_write is not None
        if ctx.all_decode:
            rule, knobs = fused_recurrent_gated_delta_rule, self.kernel_args.get("fused_recurrent_gated_delta_rule", {})
        else:
            rule, knobs = chunk_gated_delta_rule, self.kernel_args.get("chunk_gated_delta_rule", {})
            if not knobs.get("chunk_size"):
                knobs = dict(knobs, chunk_size=cpu_chunk_size(self.head_k_dim))
        o, final = rule(q, k, v, g, beta, initial_state=initial, output_final_state=keep, cu_seqlens=ctx.cu_seqlens,
                        use_qk_l2norm_in_kernel=True, **knobs)
        if keep:
            rows = ctx.on_device("write_rows", ctx.state_write[0])
            recurrent[ctx.on_device("write_slots", ctx.state_write[1])] = final[rows]
        o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(o.reshape(T, self.value_dim))

    def _conv(self, x: torch.Tensor, conv_state: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Depthwise causal conv + SiLU over each sequence's tokens, its stored window in front."""
        width = self.kernel - 1
        ext_index, token_rows, write_index = ctx.cached(f"conv_layout_{width}", lambda: conv_layout(ctx, width))
        parts = [x]
        if ctx.state_read is not None:
            parts.append(conv_state[ctx.on_device("read_slots", ctx.state_read[1])].reshape(-1, x.shape[1]))
        parts.append(x.new_zeros(1, x.shape[1]))
        ext = torch.cat(parts).index_select(0, ctx.on_device(f"conv_ext_index_{width}", ext_index))
        if write_index is not None:
            widx = ctx.on_device(f"conv_write_index_{width}", write_index)
            conv_state[ctx.on_device("write_slots", ctx.state_write[1])] = ext[widx].to(conv_state.dtype)
        # out row r is the window ending at ext row r + width: a sum of shifted slices, in float32
        n, w = ext.shape[0] - width, self.conv_weight.float()
        out = ext[:n].float() * w[:, 0]
        for j in range(1, self.kernel):
            out.addcmul_(ext[j:n + j], w[:, j])
        out = out.index_select(0, ctx.on_device(f"conv_token_rows_{width}", token_rows - width))
        return F.silu(out).to(x.dtype)

    def load(self, t, p: str) -> None:
        self.in_proj.weight.copy_(torch.cat([t.get(p + n + ".weight") for n in
                                             ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]))
        self.conv_weight.copy_(t.get(p + "conv1d.weight").reshape(self.conv_dim, self.kernel))
        self.dt_bias.copy_(t.get(p + "dt_bias"))
        self.A_log.copy_(t.get(p + "A_log"))
        self.norm.weight.copy_(t.get(p + "norm.weight"))
        self.out_proj.weight.copy_(t.get(p + "out_proj.weight"))
