"""Rotary position embedding of the queries and keys of a fused QKV projection, in place, with the query scale.

kernel.py holds the Triton kernel and the public function `rotate_qk_`, torch_path.py what CPU tensors run
(the same ops as pipeline/models/layers/rotary.py's float32 rotation, so its bits on CPU are the engine's).
"""
from triton_kernels.rotary.kernel import rotate_qk_, rotary_knobs
from triton_kernels.rotary.torch_path import rotate_qk_torch_

__all__ = ["rotate_qk_", "rotary_knobs", "rotate_qk_torch_"]
