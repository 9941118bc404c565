"""RMSNorm's elementwise work in one pass each, for decoder layers with RMS norms (Qwen3.5, Llama, Qwen3):
the residual add with the RMSNorm after it, the delta-rule mixer's gated output norm, and the gated MLP's
silu(gate) * up (T5's gated feed-forward's gelu_tanh(gate) * up by the same kernel).

op.py holds the public functions (their checks and dispatch), kernel.py the Triton kernels (imported only when a
kernel runs), torch_path.py what CPU tensors run (the unfused ops in plain torch).
"""
from triton_kernels.rms_norm.op import add_rms_norm, gated_rms_norm, gelu_tanh_mul, rms_norm_knobs, silu_mul
from triton_kernels.rms_norm.torch_path import (add_rms_norm_torch, gated_rms_norm_torch, gelu_tanh_mul_torch,
                                                silu_mul_torch)

__all__ = ["add_rms_norm", "gated_rms_norm", "silu_mul", "gelu_tanh_mul", "rms_norm_knobs", "add_rms_norm_torch",
           "gated_rms_norm_torch", "silu_mul_torch", "gelu_tanh_mul_torch"]
