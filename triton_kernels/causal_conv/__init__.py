"""Ragged depthwise causal conv (+ SiLU) with per-sequence windows: the short conv of Qwen3.5's delta-rule layers.

kernel.py holds the Triton kernels, the public function and its launch knobs (from the one table,
triton_kernels/launch_config.py), naive.py the per-sequence torch reference CPU tensors run, layout.py
the checks on a call's tensors.
"""
from triton_kernels.causal_conv.kernel import causal_conv1d, conv_knobs
from triton_kernels.causal_conv.naive import naive_causal_conv1d

__all__ = ["causal_conv1d", "conv_knobs", "naive_causal_conv1d"]
