"""LayerNorm with the residual add before it, in one pass: what a pre-LayerNorm transformer does between its
sublayers (x = x + sublayer; h = LayerNorm(x)).

kernel.py holds the Triton kernel and the public function `add_layer_norm`, torch_path.py what CPU tensors run
(the add, then F.layer_norm: the unfused ops' bits).
"""
from triton_kernels.layer_norm.kernel import add_layer_norm, norm_knobs
from triton_kernels.layer_norm.torch_path import add_layer_norm_torch

__all__ = ["add_layer_norm", "norm_knobs", "add_layer_norm_torch"]
