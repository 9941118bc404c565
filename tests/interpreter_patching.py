"""The Triton interpreter (TRITON_INTERPRET=1) without its repeated patching of `triton.language`.

To run a kernel, the interpreter swaps `triton.language`'s builtins for numpy-backed ones (`_patch_lang`) and
puts them back when the grid has run. It does so again on every call of a `@triton.jit` helper from inside the
kernel (the delta rule's row loads and stores, the norm tiles, ...): an `inspect.getmembers` walk of four
modules per call, which finds them already swapped, so it changes nothing. In the kernel tests that was a fifth
of the interpreter's time (tests/test_sync_audit.py's Qwen3.5 step: 40,398 walks, 28 of 138 s under cProfile).

`skip_repeated_patching()` keeps the interpreter's behaviour and skips only those repeats: a helper's call
while its grid's kernel has already patched the same modules gets an empty patch scope; anything else (a grid's
own patching, a helper that sees a module the kernel did not) goes to the interpreter's `_patch_lang` as before.
Tests only: the product never runs the interpreter. Where the interpreter lacks the names this relies on (another
Triton version), nothing is changed.
"""
from __future__ import annotations

import functools
import inspect
import threading


def skip_repeated_patching() -> bool:
    """Install the skip; True if installed (False: this Triton's interpreter differs, left as it is)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original_patch = getattr(interpreter, "_patch_lang", None)
    grid = getattr(interpreter, "GridExecutor", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original_patch is None or grid is None or scope_type is None or getattr(original_patch, "skips_repeats", False):
        return False

    langs_of: dict[int, frozenset[int]] = {}
    patched = threading.local()   # per thread: a stack of the module ids each running grid has patched

    def langs(fn) -> frozenset[int]:
        """The triton.language modules a jit function sees (what _patch_lang patches for it)."""
        key = id(fn.__globals__)
        if key not in langs_of:
            langs_of[key] = frozenset(id(v) for v in fn.__globals__.values()
                                      if inspect.ismodule(v) and (v is tl or v is tl.core))
        return langs_of[key]

    def patch_lang(fn):
        stack = getattr(patched, "stack", None)
        if stack and langs(fn) <= stack[-1]:
            return scope_type()   # already patched by this grid's kernel: nothing to do, nothing to restore
        scope = original_patch(fn)
        if stack:
            stack[-1] |= langs(fn)
        return scope
    patch_lang.skips_repeats = True

    original_call = grid.__call__

    @functools.wraps(original_call)
    def grid_call(self, *args, **kwargs):
        stack = patched.__dict__.setdefault("stack", [])
        stack.append(set())
        try:
            return original_call(self, *args, **kwargs)
        finally:
            stack.pop()

    interpreter._patch_lang = patch_lang
    grid.__call__ = grid_call
    return True
