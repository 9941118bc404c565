"""A linear layer with the exact (erf) GELU in its epilogue: gelu(x @ weight.T + bias) in one kernel.

kernel.py holds the Triton matrix product and the public function `linear_gelu`, torch_path.py what CPU tensors
run (F.linear, then the erf GELU: the unfused ops' bits).
"""
from triton_kernels.linear_gelu.kernel import gemm_knobs, linear_gelu
from triton_kernels.linear_gelu.torch_path import linear_gelu_torch

__all__ = ["gemm_knobs", "linear_gelu", "linear_gelu_torch"]
