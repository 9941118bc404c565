"""A linear layer with the exact (erf) GELU in its epilogue: gelu(x @ weight.T + bias) in one kernel.

op.py holds the public function `linear_gelu` (its checks and dispatch), kernel.py the Triton matrix product
(imported only when it runs), torch_path.py what CPU tensors run (F.linear, then the erf GELU: the unfused ops'
bits).
"""
from triton_kernels.linear_gelu.op import gemm_knobs, linear_gelu
from triton_kernels.linear_gelu.torch_path import linear_gelu_torch

__all__ = ["gemm_knobs", "linear_gelu", "linear_gelu_torch"]
