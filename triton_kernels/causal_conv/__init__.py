"""Ragged depthwise causal conv (+ SiLU) with per-sequence windows: the short conv of Qwen3.5's delta-rule layers.

kernel.py holds the Triton kernels and the public function, naive.py the per-sequence torch reference
CPU tensors run, launch.py the launch knobs per GPU, layout.py the checks on a call's tensors.
"""
from triton_kernels.causal_conv.kernel import causal_conv1d
from triton_kernels.causal_conv.naive import naive_causal_conv1d

__all__ = ["causal_conv1d", "naive_causal_conv1d"]
