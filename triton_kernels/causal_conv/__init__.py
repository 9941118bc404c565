"""Ragged depthwise causal conv (+ SiLU) with per-sequence windows: the short conv of Qwen3.5's delta-rule layers.

op.py holds the public function and its launch knobs (from the one table, triton_kernels/launch_config.py),
kernel.py the Triton kernels (imported only when they run), torch_path.py what CPU tensors run (shifted float32
slices with fix-ups, batch-invariant on request), naive.py the per-sequence reference both are tested against,
layout.py the checks on a call's tensors.
"""
from triton_kernels.causal_conv.op import causal_conv1d, conv_knobs
from triton_kernels.causal_conv.naive import naive_causal_conv1d

__all__ = ["causal_conv1d", "conv_knobs", "naive_causal_conv1d"]
