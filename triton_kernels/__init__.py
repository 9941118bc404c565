"""Triton kernels for the native engine, each with a torch implementation beside it (see _device.py)."""
from triton_kernels.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
