"""Triton kernels with torch implementations beside them (see _device.py and docs/kernels/)."""
from .causal_conv import causal_conv1d
from .gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from .paged_attention import paged_attention, write_kv_cache
