"""Rotary position embedding in place, in one pass: of the queries and keys of a fused QKV projection with the query
scale (kernel.py, `rotate_qk_`: ESM), and of one `[T, H, head_dim]` view with the per-head RMS norm before it
(norm_rotate.py, `norm_rotate_`; `norm_rotate_qk_`: the RMS-norm decoders' q and k in one launch). torch_path.py
holds what CPU tensors run (the same ops as pipeline/models/layers/norms.py and rotary.py, so its bits on CPU are
the unfused layer's). op.py holds the public functions (their checks and dispatch): the two kernel modules are
imported only when a kernel runs.
"""
from triton_kernels.rotary.op import norm_rotate_, norm_rotate_knobs, norm_rotate_qk_, rotary_knobs, rotate_qk_
from triton_kernels.rotary.torch_path import norm_rotate_torch_, rotate_qk_torch_

__all__ = ["rotate_qk_", "rotary_knobs", "rotate_qk_torch_", "norm_rotate_", "norm_rotate_qk_", "norm_rotate_knobs",
           "norm_rotate_torch_"]
