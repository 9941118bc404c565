"""Ragged paged attention over a paged KV cache (causal and bidirectional) and the KV-cache write.

attention.py (public op, dispatch) -> kernel.py (Triton) | sdpa.py (CPU torch path); naive.py is the
float64 reference the tests hold both to; launch.py holds the launch knobs and their default rule. varlen.py
runs the same kernel over a step's own keys and values (an encoder's steps: no cache write, no gather).
"""
from .attention import paged_attention
from .varlen import varlen_attention
from .kv_cache import write_kv_cache
from .launch import PagedAttentionLaunch, default_launch

__all__ = ["paged_attention", "varlen_attention", "write_kv_cache", "PagedAttentionLaunch", "default_launch"]
