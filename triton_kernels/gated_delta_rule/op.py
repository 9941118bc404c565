"""The public ops `chunk_gated_delta_rule` (prefill) and `fused_recurrent_gated_delta_rule` (decode): their checks,
then the Triton kernels (chunk.py, split.py, fused_recurrent.py: imported only on that path, so a CPU-only install
never imports triton) or the torch paths (torch_path.py)."""
from __future__ import annotations

import torch

from triton_kernels._device import kernels, knobs_for, use_triton
from triton_kernels.gated_delta_rule.layout import SequenceLayout, check_inputs, check_state_indices
from triton_kernels.gated_delta_rule.torch_path import chunk_fwd_torch, recurrent_fwd_torch
from triton_kernels.launch_config import DeltaRuleChunkKnobs, DeltaRuleDecodeKnobs


def chunk_gated_delta_rule(
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
    cu_seqlens_cpu: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = 64,
    block_v: int | None = None,
    min_block_v: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    prep_num_warps: int | None = None,
    design: str | None = None,
    solve_num_warps: int | None = None,
    output_block_v: int | None = None,
    output_num_warps: int | None = None,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule over whole sequences, chunk by chunk (prefill). fla-compatible arguments.

    Args:
        q, k: [B, T, H, K]. v: [B, T, HV, V], HV a multiple of H (value head j uses key head j // (HV // H)).
        g: [B, T, HV] log decay (<= 0). beta: [B, T, HV].
        scale: query scale, default K ** -0.5.
        initial_state: [N, HV, K, V] (float32 math), zeros when None.
        output_final_state: also return the final states [N, HV, K, V] float32.
        cu_seqlens: [N+1] int32/int64 token offsets of N sequences packed in a B == 1 batch.
        cu_seqlens_cpu: the same offsets in host memory (a CPU tensor), as fla takes them: given, the call
            reads these, and a GPU call never waits for the device (cu_seqlens' values are trusted to match).
        use_qk_l2norm_in_kernel: normalise q and k rows: x * rsqrt(sum(x^2) + 1e-6).
        chunk_size: tokens per chunk; the Triton kernels take 64 or 128, the torch path any size.
        batch_invariant: every sequence's outputs and final state bitwise the same whatever the other
            sequences of the call: chunks of exactly chunk_size from each sequence's first token (the
            torch path otherwise shrinks them to a group's longest sequence), and the Triton walk never
            cut into segments (their number follows the batch). A sequence continued from its state in
            a later call computes what one call over it would when it was cut at a multiple of chunk_size.
    Launch knobs (Triton only; explicit, never tuned behind the caller's back):
        block_v: V columns per walk program (power of two >= 16; capped at V rounded up to a power of two).
        min_block_v: the walk narrows its V blocks from block_v down to this while its programs leave SMs
            idle, before it cuts sequences into segments (walk_layout.plan_walk; not under batch_invariant).
            min_block_v = block_v keeps block_v whatever the shape.
        num_warps, num_stages: of the sequential walk kernel (num_stages pipelines its chunk loop).
        prep_num_warps: of the parallel per-chunk kernel.
        design: "fused" (chunk.py's prep kernel and a walk that also writes the outputs) or "split"
            (split.py: a 4-warp prep in two kernels, a state-only walk storing chunk-start states, a parallel
            output kernel).
            block_v, min_block_v, num_warps and num_stages are the walk's in both.
        solve_num_warps: of the split design's prep kernels (solve, W / U). output_block_v, output_num_warps:
            of its output kernel (V columns per program, a power of two >= 16).
        A knob left as None takes the value of triton_kernels/launch_config.py for the tensors' GPU
        (compiled there without spilling registers at K = V = 128 in 16-bit: see the compile-matrix
        test); timings are left to the benchmark.
    Returns:
        o [B, T, HV, V] in q's dtype, and the final states or None.
    """
    dims = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    layout = SequenceLayout.from_inputs(dims, cu_seqlens, cu_seqlens_cpu)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    scale = dims.head_k_dim**-0.5 if scale is None else float(scale)
    args = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                layout=layout, dims=dims, use_qk_l2norm=use_qk_l2norm_in_kernel, chunk_size=chunk_size,
                batch_invariant=batch_invariant)
    if not use_triton(q):
        return chunk_fwd_torch(q, k, v, g, beta, **args)
    knobs = chunk_knobs(q.device, block_v=block_v, min_block_v=min_block_v, num_warps=num_warps,
                        num_stages=num_stages, prep_num_warps=prep_num_warps, design=design,
                        solve_num_warps=solve_num_warps, output_block_v=output_block_v,
                        output_num_warps=output_num_warps)
    return kernels("gated_delta_rule.chunk").chunk_fwd_triton(q, k, v, g, beta, **args, **vars(knobs))


def chunk_knobs(device: torch.device, **given: int | str | None) -> DeltaRuleChunkKnobs:
    """The chunk kernels' launch knobs for `device`: the launch table's row, with the knobs given (not None)."""
    return knobs_for(device, "chunk", **given)


def fused_recurrent_gated_delta_rule(
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
    state_indices: torch.Tensor | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule one token at a time (decode: T == 1 per sequence). fla-compatible arguments.

    Same arguments, shapes and results as `chunk_gated_delta_rule` (no chunk_size), plus in-place
    states: with `state_indices` (int32 or int64 [N], distinct slots; the GPU path trusts their values),
    `initial_state` is a float32 state pool [slots, HV, K, V] (contiguous), sequence n starts from
    initial_state[state_indices[n]] and its final state is written back there; the call then returns
    (o, None) and output_final_state must be False. Launch knobs
    (Triton only): block_v, V columns per program (power of two >= 16, capped at V rounded up);
    num_warps and num_stages of the kernel. A knob left as None takes the value of
    triton_kernels/launch_config.py for the tensors' GPU.
    """
    dims = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_indices)
    if state_indices is not None and output_final_state:
        raise ValueError("with state_indices the final states are written into initial_state in place; "
                         "output_final_state must be False")
    scale = dims.head_k_dim**-0.5 if scale is None else float(scale)
    args = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                dims=dims, use_qk_l2norm=use_qk_l2norm_in_kernel, state_indices=state_indices)
    if q.device.type == "cpu":  # reading cu_seqlens is free here: check its values (the torch path needs them)
        layout = SequenceLayout.from_inputs(dims, cu_seqlens)
        if state_indices is not None:
            check_state_indices(state_indices, initial_state.shape[0])
        if not use_triton(q):
            return recurrent_fwd_torch(q, k, v, g, beta, **args, layout=layout)
    # The kernel reads cu_seqlens and state_indices where they live: no host sync on the GPU decode path
    # (values trusted).
    knobs = decode_knobs(q.device, block_v=block_v, num_warps=num_warps, num_stages=num_stages)
    return kernels("gated_delta_rule.fused_recurrent").recurrent_fwd_triton(q, k, v, g, beta, **args,
                                                                            cu_seqlens=cu_seqlens, **vars(knobs))


def decode_knobs(device: torch.device, **given: int | None) -> DeltaRuleDecodeKnobs:
    """The decode kernel's launch knobs for `device`: the launch table's row, with the knobs given (not None)."""
    return knobs_for(device, "decode", **given)
