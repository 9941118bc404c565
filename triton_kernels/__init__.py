"""Triton kernels with torch references beside them; see docs/kernels/."""
from .paged_attention import paged_attention, write_kv_cache
