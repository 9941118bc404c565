"""Ahead-of-time compilation of recorded launches for a GPU this machine need not have.

`compile_spec` turns a launch recorded by `_launch.dry_run` into plain data (kernel by module and name,
signature, constexprs, alignment attributes, num_warps, num_stages, compute capability), specialised
the way Triton's JIT specialises a real launch of the same arguments; `compile_and_measure` compiles it
with `triton.compile` and reads the cubin's registers, spill stack and shared memory; `cubin_sass` prints
its machine code. Needs triton compiled mode: not under TRITON_INTERPRET=1, which makes triton.jit build
interpreted functions.
"""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass

from ._launch import Launch

# Shared memory one block may use (the opt-in maximum of cudaDevAttrMaxSharedMemoryPerBlockOptin: an SM's largest
# carveout less the 1 KiB the driver keeps per block; NVIDIA CCCL's cuda/__device/arch_traits.h): A100 163 KiB,
# H100 and B200 227 KiB; sm_86, sm_89 and sm_120 (100 KiB an SM) 99 KiB.
SHARED_MEMORY_PER_BLOCK = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024,
                           120: 99 * 1024}


@dataclass(frozen=True)
class CompileSpec:
    module: str
    kernel: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[int, object], ...]
    attrs: tuple[tuple[int, str], ...]
    num_warps: int
    num_stages: int
    arch: int


@dataclass(frozen=True)
class Resources:
    registers: int
    spill_bytes: int   # the local-memory stack of the kernel: a Triton kernel has one only when it spills
    shared_bytes: int
    seconds: float


def compile_spec(launch: Launch, arch: int) -> CompileSpec:
    """The compile request a real launch of `launch` on a GPU of capability `arch` would make."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    kernel = launch.kernel
    names = kernel.arg_names
    if len(launch.args) + len(launch.constexprs) != len(names):
        raise TypeError(f"{kernel.fn.__name__}: {len(launch.args)} arguments and {sorted(launch.constexprs)} "
                        f"do not cover its parameters {names}")
    values = dict(zip(names, launch.args)) | launch.constexprs
    signature, constexprs, attrs = [], [], []
    for i, name in enumerate(names):
        value = values[name]
        if i in kernel.constexprs:
            signature.append((name, "constexpr"))
            constexprs.append((i, value))
            continue
        # What the JIT does per argument: pointers typed by dtype and marked 16-byte aligned ('D'),
        # integers i32/i64 and marked when divisible by 16, None and the integer 1 made constants.
        param = kernel.params[i]
        ty, attr = native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize,
                                          not param.do_not_specialize_on_alignment)
        signature.append((name, ty))
        if ty == "constexpr":
            constexprs.append((i, value))
        elif attr:
            attrs.append((i, attr))
    return CompileSpec(kernel.fn.__module__, kernel.fn.__name__, tuple(signature), tuple(constexprs), tuple(attrs),
                       launch.num_warps, launch.num_stages, arch)


def compile_kernel(spec: CompileSpec):
    """Compile `spec` through Triton's cache: the CompiledKernel (asm["cubin"], metadata)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    fn = getattr(importlib.import_module(spec.module), spec.kernel)
    target = GPUTarget("cuda", spec.arch, 32)
    backend = make_backend(target)
    src = ASTSource(fn, dict(spec.signature), {(i,): v for i, v in spec.constexprs},
                    {(i,): backend.parse_attr(a) for i, a in spec.attrs})
    return triton.compile(src, target=target, options=dict(num_warps=spec.num_warps, num_stages=spec.num_stages))


def compile_and_measure(spec: CompileSpec) -> Resources:
    """Compile `spec` (through Triton's cache) and read what the cubin uses."""
    start = time.perf_counter()
    compiled = compile_kernel(spec)
    registers, stack = _cubin_usage(compiled.asm["cubin"], spec.kernel)
    return Resources(registers, stack, compiled.metadata.shared, time.perf_counter() - start)


def cubin_sass(cubin: bytes) -> str:
    """The cubin's machine code as `cuobjdump -sass` prints it (one instruction a line, with its address)."""
    return _cuobjdump(cubin, "-sass")


def _cubin_usage(cubin: bytes, name: str) -> tuple[int, int]:
    """(registers, stack bytes) of kernel `name`, from `cuobjdump --dump-resource-usage` (shipped with triton)."""
    report = _cuobjdump(cubin, "--dump-resource-usage")
    m = re.search(rf"Function {re.escape(name)}:\s*REG:(\d+) STACK:(\d+)", report)
    if m is None:
        raise RuntimeError(f"no resource usage for {name} in cuobjdump's report:\n{report}")
    return int(m.group(1)), int(m.group(2))


def _cuobjdump(cubin: bytes, option: str) -> str:
    """cuobjdump (shipped with triton) run on the cubin with `option`: its output."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, option, f.name], capture_output=True, text=True, check=True).stdout
