"""Gated delta rule (Gated DeltaNet): chunked prefill and recurrent decode, fla-compatible API.

chunk.py and fused_recurrent.py hold the Triton kernels and the public functions, torch_path.py the
vectorised torch implementations CPU tensors run, naive.py the per-token reference tests trust.
"""
from triton_kernels.gated_delta_rule.chunk import chunk_gated_delta_rule
from triton_kernels.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]
