"""The Triton interpreter (TRITON_INTERPRET=1) computing bfloat16 as a GPU does.

The interpreter keeps a bfloat16 value as its 16 bits in a numpy uint16 array, and several of its operations
then work on those integers: arithmetic, comparisons, minimum / maximum and `tl.dot` read the bit patterns as
numbers, and a cast from float32 to bfloat16 drops the low 16 bits (rounding toward zero) where a GPU rounds to
nearest even (`cvt.rn.bf16.f32`). So every bfloat16 case of the kernel tests skipped on the CPU, and the
kernels' bfloat16 paths (the GPU's default dtype) were checked only by the compile matrix until a GPU ran them.

`compute_bfloat16_as_a_gpu()` mends exactly those operations on the interpreter's builder:

- casts to bfloat16 round to nearest even from float32 (from float16 and integers through float32, which holds
  them exactly up to 2^24; from float64 through float32: a double rounding where a GPU rounds once, which can
  differ only in a tie of the float32 value); casts from bfloat16 widen the bits exactly;
- arithmetic, math functions, minimum / maximum and clamps on bfloat16 run on the float32 values and round
  the result to bfloat16 once: for +, -, *, / and sqrt that is the correctly rounded bfloat16 result a GPU's
  bfloat16 instructions give (float32 has 24 bits >= 2 x 8 + 2, so rounding twice equals rounding once);
- comparisons compare the values; `tl.dot` with bfloat16 operands multiplies the float32 values with a float32
  accumulator, as the tensor cores do (in another summation order: products are exact, sums round);
- `tl.max` / `tl.min` over bfloat16 compare the values. A `tl.sum` (or cumulative sum) over bfloat16 is refused:
  Triton adds in bfloat16 in an order the compiled kernel chooses, which the interpreter cannot reproduce; no
  kernel path the tests run reduces in 16 bits (one that did would fail its test here, naming this).
- fma rounds its float32 result to bfloat16 (a GPU's bfloat16 fma rounds once: the two can differ where the
  float32 result is a bfloat16 tie).

Bit-level operations (loads, stores, `tl.where`, bitcasts, abs) already treat bfloat16 as the GPU does and are
left alone. tests/kernels/test_interpreter_bfloat16.py checks each mended operation against torch's own
bfloat16 arithmetic on the CPU, bit for bit. Tests only: the product never runs the interpreter. On a Triton
whose interpreter lacks what this relies on, nothing is changed and the bfloat16 cases skip as before.
"""
from __future__ import annotations

import functools

import numpy as np

_installed = False

# Builder operations whose bfloat16 operands are read as float32 values and whose floating-point result is rounded
# back to bfloat16 once.
_ARITHMETIC = ("create_fadd", "create_fsub", "create_fmul", "create_fdiv", "create_frem", "create_precise_divf",
               "create_approx_divf", "create_fneg", "create_minimumf", "create_minnumf", "create_maximumf",
               "create_maxnumf", "create_fma", "create_clampf", "create_exp", "create_exp2", "create_log",
               "create_log2", "create_sqrt", "create_precise_sqrt", "create_rsqrt", "create_sin", "create_cos",
               "create_floor", "create_ceil", "create_erf")
_COMPARISONS = tuple(f"create_fcmp{p}" for p in ("OLT", "OGT", "OLE", "OGE", "OEQ", "ONE",
                                                 "ULT", "UGT", "ULE", "UGE", "UEQ", "UNE"))


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """The float32 values of bfloat16 bit patterns (exact: a bfloat16 is a float32's upper half)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def float32_to_bfloat16_bits(values: np.ndarray, toward_zero: bool = False) -> np.ndarray:
    """bfloat16 bit patterns of float32 values, rounded to nearest even (the GPU's `cvt.rn.bf16.f32`, torch's
    conversion), or toward zero; NaN stays a quiet NaN of its sign."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    if toward_zero:
        rounded = bits >> np.uint32(16)
    else:
        lsb = (bits >> np.uint32(16)) & np.uint32(1)
        rounded = (bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)
    nan = np.isnan(np.asarray(values, dtype=np.float32))
    out = rounded.astype(np.uint16)
    if nan.any():
        out = np.where(nan, ((bits >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16), out)
    return out


def compute_bfloat16_as_a_gpu() -> bool:
    """Install the mended bfloat16 operations; True if installed (or already), False where this Triton's
    interpreter differs from the one this was written against (then nothing is changed)."""
    global _installed
    if _installed:
        return True
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder_type = getattr(interpreter, "InterpreterBuilder", None)
    handle_type = getattr(interpreter, "TensorHandle", None)
    reduce_ops = getattr(interpreter, "ReduceOps", None)
    scan_ops = getattr(interpreter, "ScanOps", None)
    needed = _ARITHMETIC + _COMPARISONS + ("cast_impl", "create_fp_to_fp", "create_dot")
    if (builder_type is None or handle_type is None or reduce_ops is None or scan_ops is None
            or interpreter._get_np_dtype(tl.bfloat16) != np.dtype(np.uint16)
            or not all(hasattr(builder_type, name) for name in needed)
            or not all(hasattr(reduce_ops, name) for name in ("sum", "min_max"))
            or not hasattr(scan_ops, "cumsum") or not hasattr(getattr(interpreter, "_ir", None), "ROUNDING_MODE")):
        return False
    bf16, f32 = tl.bfloat16, tl.float32

    def is_bf16(arg) -> bool:
        return isinstance(arg, handle_type) and arg.dtype.scalar == bf16

    def widened(arg):
        return handle_type(bfloat16_bits_to_float32(arg.data), f32) if is_bf16(arg) else arg

    def rounded(out, toward_zero=False):
        return handle_type(float32_to_bfloat16_bits(out.data, toward_zero), bf16)

    def through_float32(original, result_rounds: bool):
        @functools.wraps(original)
        def op(self, *args):
            if not any(is_bf16(a) for a in args):
                return original(self, *args)
            out = original(self, *(widened(a) for a in args))
            return rounded(out) if result_rounds and out.dtype.scalar == f32 else out
        return op

    for name in _ARITHMETIC:
        setattr(builder_type, name, through_float32(getattr(builder_type, name), True))
    for name in _COMPARISONS:
        setattr(builder_type, name, through_float32(getattr(builder_type, name), False))

    def convert(src, dst_type, toward_zero=False):
        """A cast with bfloat16 on one side: None where neither side is bfloat16 (or both are)."""
        source, target = src.dtype.scalar, dst_type.scalar
        if (source == bf16) == (target == bf16):
            return None
        if source == bf16:   # widen exactly, then to the target type as the interpreter does from float32
            with np.errstate(over="ignore", invalid="ignore"):   # out of the target's range: inf, as on a GPU
                return handle_type(bfloat16_bits_to_float32(src.data).astype(interpreter._get_np_dtype(target)), target)
        return handle_type(float32_to_bfloat16_bits(np.asarray(src.data).astype(np.float32), toward_zero), bf16)

    original_cast = builder_type.cast_impl

    @functools.wraps(original_cast)
    def cast_impl(self, src, dst_type):
        converted = convert(src, dst_type)
        return original_cast(self, src, dst_type) if converted is None else converted

    original_fp_to_fp = builder_type.create_fp_to_fp

    @functools.wraps(original_fp_to_fp)
    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        toward_zero = rounding_mode == interpreter._ir.ROUNDING_MODE.RTZ
        converted = convert(src, dst_type, toward_zero)
        return original_fp_to_fp(self, src, dst_type, rounding_mode) if converted is None else converted

    builder_type.cast_impl = cast_impl
    # the int / float cast entry points are lambdas calling cast_impl through self: they follow it
    builder_type.create_fp_to_fp = create_fp_to_fp

    original_dot = builder_type.create_dot

    @functools.wraps(original_dot)
    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (is_bf16(a) or is_bf16(b) or is_bf16(d)):
            return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = original_dot(self, widened(a), widened(b), widened(d), input_precision, max_num_imprecise_acc)
        return rounded(out) if is_bf16(d) else out

    builder_type.create_dot = create_dot

    def refuse_16_bit_sum(original, what):
        @functools.wraps(original)
        def reduce(self, input, *args, **kwargs):
            if input.dtype.scalar == bf16:
                raise NotImplementedError(
                    f"{what} over bfloat16: Triton adds in bfloat16 in an order the compiled kernel chooses, which "
                    "the interpreter cannot reproduce (tests/interpreter_bfloat16.py); sum in float32 instead")
            return original(self, input, *args, **kwargs)
        return reduce

    reduce_ops.sum = refuse_16_bit_sum(reduce_ops.sum, "tl.sum")
    scan_ops.cumsum = refuse_16_bit_sum(scan_ops.cumsum, "tl.cumsum")

    original_min_max = reduce_ops.min_max

    @functools.wraps(original_min_max)
    def min_max(self, input, val_reduce_op, idx_reduce_op=None):
        single = input[0] if isinstance(input, tuple) else input
        if single.dtype.scalar != bf16:
            return original_min_max(self, input, val_reduce_op, idx_reduce_op)
        values = tl.core.tensor(handle_type(bfloat16_bits_to_float32(single.handle.data), f32),
                                single.type.with_element_ty(f32) if single.type.is_block() else f32)
        result = original_min_max(self, values, val_reduce_op, idx_reduce_op)
        value = result[0] if isinstance(result, tuple) else (result if val_reduce_op else None)
        if value is not None:   # a value of the input: exact in bfloat16
            bits = handle_type(float32_to_bfloat16_bits(value.handle.data), bf16)
            value = tl.core.tensor(bits, value.type.with_element_ty(bf16) if value.type.is_block() else bf16)
        if isinstance(result, tuple):
            return value, result[1]
        return value if val_reduce_op else result

    reduce_ops.min_max = min_max
    _installed = True
    return True


def installed() -> bool:
    """Whether the interpreter computes bfloat16 as a GPU does in this process."""
    return _installed
