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


def conv_window_index(ctx: StepContext, width: int):
    """Gather indices for the causal conv over a step whose sequences may continue stored conv states.

    The gather source is `[x (T rows); stored windows of the reading sequences (R * width rows); a zero
    row]`. Returns (index [T, width + 1] of each token's window, oldest first; index [W, width] of the
    new window of each writing sequence), as host int64 arrays.
    """
    T, q_lens, S = ctx.num_tokens, ctx.q_lens, ctx.num_seqs
    starts = np.zeros(S, np.int64)
    np.cumsum(q_lens[:-1], out=starts[1:])
    read_pos = np.full(S, -1, np.int64)
    if ctx.state_read is not None:
        rows = ctx.state_read[0]
        read_pos[rows] = np.arange(len(rows))
    zero_row = T + (0 if ctx.state_read is None else len(ctx.state_read[0])) * width

    def lookup(seq: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Source row of time t (may be negative: the stored window) of sequences seq (broadcast)."""
        r = read_pos[seq]
        prior = np.where(r >= 0, T + r * width + (width + t), zero_row)
        return np.where(t >= 0, starts[seq] + t, prior)

    seg = np.repeat(np.arange(S), q_lens)
    local = np.arange(T) - starts[seg]
    token_index = lookup(seg[:, None], local[:, None] - width + np.arange(width + 1)[None, :])
    write_index = None
    if ctx.state_write is not None:
        wrows = ctx.state_write[0]
        write_index = lookup(wrows[:, None], q_lens[wrows][:, None] - width + np.arange(width)[None, :])
    return token_index, write_index


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
        rule = fused_recurrent_gated_delta_rule if ctx.all_decode else chunk_gated_delta_rule
        o, final = rule(q, k, v, g, beta, initial_state=initial, output_final_state=keep, cu_seqlens=ctx.cu_seqlens,
                        use_qk_l2norm_in_kernel=True, **self.kernel_args.get(rule.__name__, {}))
        if keep:
            rows = ctx.on_device("write_rows", ctx.state_write[0])
            recurrent[ctx.on_device("write_slots", ctx.state_write[1])] = final[rows]
        o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(o.reshape(T, self.value_dim))

    def _conv(self, x: torch.Tensor, conv_state: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Depthwise causal conv + SiLU over each sequence's tokens, its stored window in front."""
        width = self.kernel - 1
        token_index, write_index = ctx.cached(f"conv_index_{width}", lambda: conv_window_index(ctx, width))
        parts = [x]
        if ctx.state_read is not None:
            parts.append(conv_state[ctx.on_device("read_slots", ctx.state_read[1])].reshape(-1, x.shape[1]))
        parts.append(x.new_zeros(1, x.shape[1]))
        src = torch.cat(parts)
        idx = ctx.cached(f"conv_token_index_{width}", lambda: torch.from_numpy(token_index.T.copy()).to(x.device).T)
        w = self.conv_weight.float()
        out = src.index_select(0, idx[:, 0]).float() * w[:, 0]
        for j in range(1, self.kernel):
            out.addcmul_(src.index_select(0, idx[:, j]), w[:, j])
        if write_index is not None:
            widx = ctx.on_device(f"conv_write_index_{width}", write_index)
            conv_state[ctx.on_device("write_slots", ctx.state_write[1])] = src[widx].to(conv_state.dtype)
        return F.silu(out).to(x.dtype)

    def load(self, t, p: str) -> None:
        self.in_proj.weight.copy_(torch.cat([t.get(p + n + ".weight") for n in
                                             ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]))
        self.conv_weight.copy_(t.get(p + "conv1d.weight").reshape(self.conv_dim, self.kernel))
        self.dt_bias.copy_(t.get(p + "dt_bias"))
        self.A_log.copy_(t.get(p + "A_log"))
        self.norm.weight.copy_(t.get(p + "norm.weight"))
        self.out_proj.weight.copy_(t.get(p + "out_proj.weight"))
