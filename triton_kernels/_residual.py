"""The residual add a pre-norm layer runs before its norm, as a Triton helper the norm kernels inline
(layer_norm, rms_norm): a program's block of rows of x, with y added where there is one (in float32, rounded to
x's dtype as the unfused `x + y` stores it) and that sum stored; the norm then reads the rows from registers."""
import triton
import triton.language as tl


@triton.jit
def residual_rows(x_ptr, y_ptr, sum_ptr, num_rows, stride_x, stride_y, stride_s,
                  N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_ROWS: tl.constexpr, HAS_Y: tl.constexpr):
    """(rows, cols, col_ok, ok, x): this program's rows (int64), the columns, which columns and elements are
    in bounds, and x + y rounded to x's dtype (x alone without y)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ok = (rows < num_rows)[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
    if HAS_Y:
        y = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=ok, other=0.0)
        x = (x.to(tl.float32) + y.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + rows[:, None] * stride_s + cols[None, :], x, mask=ok)
    return rows, cols, col_ok, ok, x
