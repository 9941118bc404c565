"""Triton kernels with torch implementations beside them (see _device.py and docs/kernels/).

Each package's public ops (op.py; paged_attention's attention.py, varlen.py, kv_cache.py) check their inputs and run
the torch path on CPU tensors; they import their Triton kernels, and with them triton, only when one runs. So a CPU
process never imports triton, and a CPU-only install, which has none (setup.cfg installs it on Linux only), runs.
"""
from ._device import kernels
from .causal_conv import causal_conv1d
from .gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from .paged_attention import paged_attention, write_kv_cache

# The modules holding the engine's @triton.jit kernels (those they import come with them).
KERNEL_MODULES = ("causal_conv.kernel", "gated_delta_rule.chunk", "gated_delta_rule.fused_recurrent", "gates.kernel",
                  "layer_norm.kernel", "linear_gelu.kernel", "paged_attention.kernel", "rms_norm.kernel",
                  "rotary.kernel", "rotary.norm_rotate")


def import_kernels() -> None:
    """Import triton and every kernel module now: a GPU worker does it while its parent plans, so its first step
    does not wait for the imports."""
    for name in KERNEL_MODULES:
        kernels(name)
