"""Gated delta rule (Gated DeltaNet): chunked prefill and recurrent decode, fla-compatible API.

op.py holds the public functions (their checks and dispatch), chunk.py, split.py and fused_recurrent.py the Triton
kernels (imported only when they run), torch_path.py the vectorised torch implementations CPU tensors run, naive.py
the per-token reference tests trust.
"""
from triton_kernels.gated_delta_rule.op import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]
