"""The obviously correct gated delta rule: one token at a time, straight from the recurrence.

Slow on purpose (a Python loop over sequences and tokens); tests run it in float64 as the ground truth
for the chunked and recurrent implementations.
"""
from __future__ import annotations

import torch

from triton_kernels.gated_delta_rule.layout import SequenceLayout, check_inputs


def naive_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token reference; same arguments as `chunk_gated_delta_rule`, computed and returned in `dtype`.

    Per sequence and value head j (key head j // (HV // H)), with state S [K, V]:
        S <- exp(g_t) S;  u = beta_t (v_t - S^T k_t);  S <- S + k_t u^T;  o_t = S^T (scale q_t)
    Returns o [B, T, HV, V] and, if asked, the final states [N, HV, K, V], both in `dtype`.
    """
    d = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    layout = SequenceLayout.from_inputs(d, cu_seqlens)
    scale = d.head_k_dim**-0.5 if scale is None else scale
    group = d.num_v_heads // d.num_heads
    # Flatten the batch into one token axis; layout.bounds index it.
    q, k = (x.reshape(-1, d.num_heads, d.head_k_dim).to(dtype) for x in (q, k))
    v = v.reshape(-1, d.num_v_heads, d.head_v_dim).to(dtype)
    g, beta = (x.reshape(-1, d.num_v_heads).to(dtype) for x in (g, beta))
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q.repeat_interleave(group, dim=1)  # [tokens, HV, K]: value head j sees key head j // group
    k = k.repeat_interleave(group, dim=1)

    o = torch.zeros_like(v)
    final = torch.zeros(layout.num_sequences, d.num_v_heads, d.head_k_dim, d.head_v_dim, dtype=dtype, device=v.device)
    for n, (bos, eos) in enumerate(zip(layout.bounds, layout.bounds[1:])):
        S = final[n].clone() if initial_state is None else initial_state[n].to(dtype).clone()
        for t in range(bos, eos):
            S = S * g[t].exp()[:, None, None]
            u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t]))
            S = S + k[t][:, :, None] * u[:, None, :]
            o[t] = torch.einsum("hkv,hk->hv", S, q[t] * scale)
        final[n] = S
    o = o.reshape(d.batch, d.seq_len, d.num_v_heads, d.head_v_dim)
    return o, (final if output_final_state else None)
