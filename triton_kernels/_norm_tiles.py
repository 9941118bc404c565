"""Triton helpers the norm kernels inline (layer_norm, rms_norm, rotary's norm_rotate_).

`residual_rows`: the residual add a pre-norm layer runs before its norm: a program's block of rows of x, with y
added where there is one (in float32, rounded to the sum's dtype as the unfused `x + y` stores it: x's, or float32
where a 16-bit x meets a float32 y, as torch promotes) and that sum stored; the norm then reads the rows from
registers. `rms_weighted`: an RMS-normalised tile weighted in the order pipeline/models/layers/norms.py RMSNorm uses
for its convention, rounded to the output's dtype."""
import triton
import triton.language as tl


@triton.jit
def residual_rows(x_ptr, y_ptr, sum_ptr, num_rows, stride_x, stride_y, stride_s,
                  N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_ROWS: tl.constexpr, HAS_Y: tl.constexpr):
    """(rows, cols, col_ok, ok, x): this program's rows (int64), the columns, which columns and elements are
    in bounds, and x + y rounded to the sum's dtype (x alone without y)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ok = (rows < num_rows)[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
    if HAS_Y:
        y = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=ok, other=0.0)
        x = (x.to(tl.float32) + y.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + rows[:, None] * stride_s + cols[None, :], x, mask=ok)
    return rows, cols, col_ok, ok, x


@triton.jit
def rms_weighted(x, rstd, w_ptr, offs, mask, ZERO_CENTRED: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """A tile of rows normalised (float32 x times rstd) and weighted in RMSNorm's order, in OUT_DTYPE (x's for
    the decoders; a T5 norm of a float32 residual stream in a float16 model: the weight's): zero-centred (Qwen3.5)
    scaled by (1 + w) in float32 before the one rounding; otherwise (Llama, Qwen3, T5) rounded to OUT_DTYPE, then
    multiplied by w and rounded again (transformers' order)."""
    normed = x.to(tl.float32) * rstd[:, None]
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        return (normed * (1.0 + w[None, :])).to(OUT_DTYPE)
    return (normed.to(OUT_DTYPE).to(tl.float32) * w[None, :]).to(OUT_DTYPE)
