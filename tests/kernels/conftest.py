"""Kernel tests run the Triton kernels compiled on the GPU when there is one, else through the Triton
interpreter on CPU tensors.

Triton picks compiled or interpreted when a function is decorated, i.e. at import, from
TRITON_INTERPRET. Setting that variable for the whole session would have to happen before anything
imports triton, and would send every CPU caller (the engine's tests too) through the slow interpreter
instead of the torch path. So the interpreter is switched on per test instead: the jit functions our
kernels call (theirs and triton.language's) are swapped for interpreted ones and TRITON_INTERPRET=1 is
set (read at call time by `_device.use_triton`), all through monkeypatch, undone after each test.
"""
import pytest
import torch


@pytest.fixture(autouse=True)
def triton_kernels_on_cpu(monkeypatch):
    if torch.cuda.is_available():
        return
    import triton.language as tl
    import triton.language.standard as tl_standard
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from triton_kernels.gated_delta_rule import chunk, fused_recurrent

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for module in (chunk, fused_recurrent, tl, tl_standard):
        for name, obj in list(vars(module).items()):
            if isinstance(obj, JITFunction):  # already interpreted if TRITON_INTERPRET=1 was set at import
                monkeypatch.setattr(module, name, InterpretedFunction(obj.fn))
