"""Launch knobs of the paged attention kernel and the documented rule that picks their defaults.

The rule reads only shapes the host already knows (no device sync), so an engine can compute it once
per step, keep it in its config and forward it; `paged_attention` applies the same rule to any knob
left as None. See docs/kernels/paged_attention.md for the reasoning behind each number.
"""
from dataclasses import dataclass

from .._launch import H100, GpuTarget
from ..launch_config import launch_row

# KV split counts the rule picks from: powers of two, so that at most six variants of the kernel (and
# of its reduce) ever compile, instead of one per split count a draining decode batch passes through.
KV_SPLIT_COUNTS = (1, 2, 4, 8, 16, 32)
MAX_KV_SPLITS = KV_SPLIT_COUNTS[-1]
# A split walks at least this many keys, so the partial results and the reduce stay cheap.
MIN_KEYS_PER_SPLIT = 256


@dataclass(frozen=True)
class PagedAttentionLaunch:
    """Launch knobs of one `paged_attention` call.

    block_q: query tokens per program; each program packs them with the Hq/Hkv query heads that share
        one KV head into max(16, next_pow2(block_q * Hq/Hkv)) rows of the score matrix.
    pages_per_tile: KV pages walked per inner-loop step (tile = pages_per_tile * page_size keys; power of 2).
    num_warps, num_stages: passed to the Triton launch as is.
    num_kv_splits: programs that share one (query block, KV head)'s KV walk; > 1 adds a reduce kernel.
    """

    block_q: int
    pages_per_tile: int
    num_warps: int
    num_stages: int
    num_kv_splits: int

    def __post_init__(self) -> None:
        for name in ("block_q", "pages_per_tile", "num_warps", "num_stages", "num_kv_splits"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"paged_attention launch knob {name} must be a positive int, got {value!r}")
        if self.pages_per_tile & (self.pages_per_tile - 1):
            raise ValueError(f"pages_per_tile must be a power of two, got {self.pages_per_tile}")
        if self.num_kv_splits > MAX_KV_SPLITS:
            raise ValueError(f"num_kv_splits must be at most {MAX_KV_SPLITS}, got {self.num_kv_splits}")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def default_launch(
    *,
    num_q_tokens: int,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    max_kv_len: int,
    target: GpuTarget = H100,
    relative_bias: bool = False,
) -> PagedAttentionLaunch:
    """The documented default launch knobs for a batch of this shape.

    - block_q: as many query tokens as fill 128 rows (64 when head_dim > 128) with GQA packing, but no
      more than the mean query length rounded up to a power of two (decode batches get block_q = 1).
    - pages_per_tile: tiles of 64 keys for prefill-like batches, 128 for decode-like ones (mean query
      length <= 4), halved when head_dim > 128, at most the launch table's bias_tile_keys with T5's
      relative-position bias (`relative_bias`); never less than one page.
    - num_warps (8 from a number of rows, else 4) and num_stages: the launch table's row for `target`
      (launch_config.AttentionKnobs), by head dim (with the bias: its bias_num_stages where the row has one).
    - num_kv_splits: 1 when the (query block, KV head) programs fill the target's SMs; otherwise enough
      splits for about two programs per SM, rounded up to a power of two (KV_SPLIT_COUNTS), then capped
      by MAX_KV_SPLITS and by MIN_KEYS_PER_SPLIT keys per split (rounded down to a power of two).
    `max_kv_len` may be an upper bound (e.g. block_tables.shape[1] * page_size).
    """
    group = num_q_heads // num_kv_heads
    mean_q = -(-num_q_tokens // max(num_seqs, 1))
    decode_like = mean_q <= 4
    target_rows = 128 if head_dim <= 128 else 64
    block_q = max(1, min(_next_pow2(mean_q), target_rows // group))
    rows = max(16, _next_pow2(block_q * group))
    knobs = launch_row(target).attention
    tile_keys = (128 if decode_like else 64) // (2 if head_dim > 128 else 1)
    if relative_bias:
        tile_keys = min(tile_keys, knobs.bias_tile_keys)
    pages_per_tile = max(1, tile_keys // page_size)
    wide = head_dim > 128
    num_warps = 8 if rows >= (knobs.rows_for_8_warps_wide if wide else knobs.rows_for_8_warps) else 4
    num_stages = knobs.num_stages_wide if wide else knobs.num_stages
    if relative_bias and knobs.bias_num_stages is not None:
        num_stages = knobs.bias_num_stages

    # Programs that do work: at least one per sequence, about one per block_q tokens.
    programs = max(num_seqs, -(-num_q_tokens // block_q)) * num_kv_heads
    splits = 1
    if programs < target.num_sms:
        wanted = _next_pow2(-(-2 * target.num_sms // programs))
        by_keys = _prev_pow2(max(1, max_kv_len // MIN_KEYS_PER_SPLIT))
        splits = min(wanted, MAX_KV_SPLITS, by_keys)
    assert splits in KV_SPLIT_COUNTS
    return PagedAttentionLaunch(block_q, pages_per_tile, num_warps, num_stages, splits)


def _prev_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)
