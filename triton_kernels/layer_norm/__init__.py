"""LayerNorm with the residual add before it, in one pass: what a pre-LayerNorm transformer does between its
sublayers (x = x + sublayer; h = LayerNorm(x)).

op.py holds the public function `add_layer_norm` (its checks and dispatch), kernel.py the Triton kernel (imported
only when it runs), torch_path.py what CPU tensors run (the add, then F.layer_norm: the unfused ops' bits).
"""
from triton_kernels.layer_norm.op import add_layer_norm, norm_knobs
from triton_kernels.layer_norm.torch_path import add_layer_norm_torch

__all__ = ["add_layer_norm", "norm_knobs", "add_layer_norm_torch"]
