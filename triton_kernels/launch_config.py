"""Launch knobs per GPU generation (and Triton version where they differ): the one table they come from.

A row per compute capability the knobs were checked on: 80 (A100), 86 (sm_86 to sm_89: RTX 30xx and 40xx, A10,
A40, L4, L40S), 90 (H100), 100 (B200) and 120 (RTX 50xx). Every value here is held by tests/kernels/test_compile_matrix.py,
which compiles every kernel for the A100 and H100 rows at real model shapes, in bfloat16 and float16, and fails on
a register spill or a shared-memory overflow (and the 86, 100 and 120 rows where they differ from the A100's and
H100's; the whole matrix for them: `python -m tests.kernels.compile_matrix --targets 89,100,120`); its table is
quoted in docs/BENCHMARKS.md. Other GPUs take the row of the nearest capability below theirs.
float32 inputs run the same knobs but spill (full-fp32 products need about twice the registers): the
engine refuses float32 on a GPU (pipeline/engine/config.py); the kernels accept it for tests.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ._launch import GpuTarget


@dataclass(frozen=True)
class DeltaRuleChunkKnobs:
    """Chunked delta rule (prefill): the walk's block_v / num_warps / num_stages, the prep kernel's warps.

    block_v is the walk's widest V block; min_block_v the narrowest it takes when its programs would leave
    SMs idle (few sequences x value heads), before it cuts sequences into segments
    (gated_delta_rule/walk_layout.plan_walk).

    design: "fused" (chunk.py: a prep kernel, then a walk that also writes the outputs) or "split" (split.py,
    issue 36: a 4-warp prep in two kernels, a state-only walk, a fully parallel output kernel). The walk knobs
    above are the state walk's in the split design; solve_num_warps is its prep kernels' (solve, W / U),
    output_block_v / output_num_warps its output kernel's (prep_num_warps stays the fused design's)."""

    block_v: int
    num_warps: int
    num_stages: int
    prep_num_warps: int
    min_block_v: int
    design: str = "fused"
    solve_num_warps: int = 4
    output_block_v: int = 64
    output_num_warps: int = 4


@dataclass(frozen=True)
class DeltaRuleDecodeKnobs:
    """Recurrent delta rule (decode)."""

    block_v: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class AttentionKnobs:
    """Paged attention: what `paged_attention.default_launch` takes per GPU; the rest of its rule is shapes.

    num_stages / num_stages_wide: pipeline depth of the KV walk for head dims <= 128 / > 128 (the wide
    tiles take twice the shared memory per stage and the registers that come with them).
    rows_for_8_warps / rows_for_8_warps_wide: a program of at least this many score rows (query tokens
    x query heads per KV head) runs 8 warps, a smaller one 4.
    bias_tile_keys: tiles of at most this many keys when T5's relative-position bias is added (its
    per-element offsets, buckets and gathered table values take registers beside the scores).
    bias_num_stages: the KV walk's depth with the bias, where it differs from num_stages (None: the same)."""

    num_stages: int
    num_stages_wide: int
    rows_for_8_warps: int
    rows_for_8_warps_wide: int
    bias_tile_keys: int
    bias_num_stages: int | None = None


@dataclass(frozen=True)
class CausalConvKnobs:
    """Causal conv of the delta-rule layers: block_t tokens x block_c channels per program of the conv,
    block_c channels per program of the window update, num_warps of both (powers of two, block_t >= 1,
    block_c >= 16). No num_stages: neither kernel has a loop to pipeline (the taps are unrolled, the
    binary search's loads depend on each other), so both launch with one stage."""

    block_t: int
    block_c: int
    num_warps: int


@dataclass(frozen=True)
class RotaryKnobs:
    """The fused query-scale + rotary kernel (triton_kernels/rotary): (token, head) rows per program, warps. A
    memory-bound pass over the QKV output: tiles of block_rows x half a head dim, a few elements per thread.
    norm_block_elements / norm_num_warps: norm_rotate_ (q/k RMS norm + rotary), whose programs hold whole heads (the
    two rotary halves and the rest, each padded to a power of two): as many rows as fit in norm_block_elements,
    rounded down to a power of two (at least 1)."""

    block_rows: int
    num_warps: int
    norm_block_elements: int
    norm_num_warps: int


@dataclass(frozen=True)
class NormKnobs:
    """The residual add + LayerNorm kernel (triton_kernels/layer_norm): warps per program (a program holds
    about 4,096 elements: one row of a wide model, several of a narrow one)."""

    num_warps: int


@dataclass(frozen=True)
class RmsNormKnobs:
    """The RMS-norm kernels (triton_kernels/rms_norm): add_rms_norm and gated_rms_norm hold whole rows, up to
    block_elements a program (a row of width d padded to a power of two: rows per program =
    block_elements // that, at least 1, at most max_rows), in num_warps; silu_mul and gelu_tanh_mul (one kernel) run
    tiles of silu_block_rows x silu_block_cols in silu_num_warps (a stream: read gate and up, write the product)."""

    block_elements: int
    max_rows: int
    num_warps: int
    silu_block_rows: int
    silu_block_cols: int
    silu_num_warps: int


@dataclass(frozen=True)
class GemmKnobs:
    """The linear + erf-GELU product (triton_kernels/linear_gelu): output tile, K step, row-tile group (L2 reuse
    of the weight tiles), warps, pipeline stages. epilogue_gelu: whether encoder layers run their first MLP
    linear and its GELU as this one product (True) or as cuBLAS plus a GELU pass (False)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    epilogue_gelu: bool


@dataclass(frozen=True)
class GateKnobs:
    """Qwen3.5's gate kernels (triton_kernels/gates): sigmoid_gate holds whole heads, as many as fit in
    block_elements (a head padded to a power of two, at least 1), in num_warps (a stream: read o and the gate, write
    the product); delta_rule_gates takes delta_block_tokens tokens (all their value heads) a program in
    delta_num_warps."""

    block_elements: int
    num_warps: int
    delta_block_tokens: int
    delta_num_warps: int


@dataclass(frozen=True)
class LaunchRow:
    chunk: DeltaRuleChunkKnobs
    decode: DeltaRuleDecodeKnobs
    attention: AttentionKnobs
    conv: CausalConvKnobs
    rotary: RotaryKnobs
    norm: NormKnobs
    gemm: GemmKnobs
    rms: RmsNormKnobs
    gates: GateKnobs


TABLE: dict[int, LaunchRow] = {
    # A100: the sm_90 walk (block_v 64, 4 warps, 2 stages) spills 656 B here; 32 columns in one stage
    # compile clean at 236-247 registers (and double the walk's programs). Head dim 256 prefill
    # attention (64 rows) spills 120 B in 4 warps, none in 8 (187 registers).
    # The causal conv, on both: a memory-bound stream over [T, C], a program takes 32 tokens x 128
    # channels (rows of 256 bytes in 16-bit), 16 elements per thread in 8 warps, and reads each input row
    # once from memory (the other taps hit L1): 1,024 x 48 programs for a 32k-token step of Qwen3.5-0.8B
    # (6,144 channels), 8 x 48 for 256 decoding sequences. 64 x 128 in 4 warps (64 elements per thread)
    # spilled 72-160 B on sm_90 where sequences read stored windows.
    # Attention with T5's relative-position bias (ProtT5-XL: 32 heads of 128, 128 rows, 8 warps, 3 stages):
    # 64-key tiles spill 48 B (Triton 3.9) / 64 B (3.6) at 255 registers on sm_80 (200 on sm_90); 32-key
    # tiles compile at 186 / 193 on sm_80, 175 / 162 on sm_90 (bias_tile_keys).
    # The delta rule's prep kernel: 8 warps on both, clean under Triton 3.6 and 3.9 since its A stage reads
    # its keys again (3.6 spilled 8 B on sm_80 before; 56 B in 4 warps, 992 B in 16; no stage count helped).
    # The walk's min_block_v 16 on both (issue 36): few sequences x value heads walk in blocks of 32 or 16
    # before any sequence is cut into segments. Compiled clean (Triton 3.9): block_v 16 on sm_90 in 2 stages
    # at 116-126 registers and 120 KiB of shared memory (one block an SM, as at 64: the q, k, w, p tiles fill
    # it whatever the V block), on sm_80 in 1 stage at 200 registers and 46 KiB (two an SM, by registers).
    # The delta rule's split design (issue 36; design="split", not the default until a GPU has timed it): its prep
    # at 4 warps compiles clean at 231 registers on sm_90 and 255 on sm_80 (2 blocks an SM; 8 warps: 210, one
    # block), its output kernel at 64 columns and 4 warps at 154-160 / 255, its state walk with the walk's knobs at
    # 76-226 / 128-214 (Triton 3.9; docs/kernels/gated_delta_rule.md, "The split design").
    # ESM's fused kernels (32k-token steps of ESM-2 650M and 3B): the rotary pass and add + norm are streams of
    # a few elements per thread (44-48 and 32-42 registers). The linear + GELU product: 128 x 128 output tiles,
    # K steps of 64, 8 warps, 3 stages (HGMMA with cp.async on sm_90: 123-125 registers, 96 KiB of shared
    # memory, two programs per SM; 153-170 registers and 64 KiB on sm_80); 128 x 256 tiles spill 72 B at 255
    # registers on sm_90 with the erf epilogue, 256 x 128 spill 40 B. Triton 3.6 and 3.9 alike.
    # The q/k norm + rotary pass (rotary.norm_*): 2,048 elements a program in 4 warps: 4 heads of Qwen3.5-0.8B's 256
    # (two 32-channel rotary halves and 192 others padded to 256) at 32 registers, 16 of Llama-8B's 128 at 28-36,
    # no spills at 32k tokens on both. 16 Qwen3.5 heads a program took 128-137 registers (3-4 blocks an SM), 8
    # spilled 8 B on sm_80 (Triton 3.9).
    # The RMS-norm kernels (rms): rows of up to 4,096 elements in 8 warps (4 rows of Qwen3.5-0.8B's 1,024, 32 heads
    # of 128 for the gated norm), silu_mul tiles of 8 x 512 in 8 warps: 32-42 registers, no spills, at a 32k-token
    # Qwen3.5-0.8B step on both (Triton 3.9; docs/kernels/rms_norm.md). gelu_tanh_mul takes silu_mul's tiles: 37-38
    # registers at Ankh-large's d_ff (3,840), no spills, 6 blocks an SM. Not yet timed on a GPU.
    # Qwen3.5's gates (gates): sigmoid_gate over rows of whole heads, 4,096 elements (16 heads of 256) in 8 warps;
    # delta_rule_gates 64 tokens x 16 value heads a program in 4 warps. Compile report: docs/kernels/gates.md.
    # epilogue_gelu False on both: on an H100 (2026-11-27, docs/BENCHMARKS.md) the product with the GELU in its
    # epilogue ran ESM-2 650M's fc1 (32k x 1,280 -> 5,120) in 0.947 ms (454 TFLOP/s; 128 x 256 tiles 0.900 ms),
    # cuBLAS in 0.681 ms (630 TFLOP/s) plus 0.233 ms for the GELU pass: 0.892 ms, and a whole step in 90.5 ms
    # against 95.0. Not measured on an A100: cuBLAS there too until it is.
    80: LaunchRow(chunk=DeltaRuleChunkKnobs(block_v=32, num_warps=4, num_stages=1, prep_num_warps=8, min_block_v=16),
                  decode=DeltaRuleDecodeKnobs(block_v=32, num_warps=4, num_stages=1),
                  attention=AttentionKnobs(num_stages=3, num_stages_wide=2, rows_for_8_warps=128,
                                           rows_for_8_warps_wide=64, bias_tile_keys=32),
                  conv=CausalConvKnobs(block_t=32, block_c=128, num_warps=8),
                  rotary=RotaryKnobs(block_rows=64, num_warps=4, norm_block_elements=2048, norm_num_warps=4),
                  norm=NormKnobs(num_warps=8),
                  gemm=GemmKnobs(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3,
                                 epilogue_gelu=False),
                  rms=RmsNormKnobs(block_elements=4096, max_rows=32, num_warps=8, silu_block_rows=8,
                                   silu_block_cols=512, silu_num_warps=8),
                  gates=GateKnobs(block_elements=4096, num_warps=8, delta_block_tokens=64, delta_num_warps=4)),
    90: LaunchRow(chunk=DeltaRuleChunkKnobs(block_v=64, num_warps=4, num_stages=2, prep_num_warps=8, min_block_v=16),
                  decode=DeltaRuleDecodeKnobs(block_v=32, num_warps=4, num_stages=1),
                  attention=AttentionKnobs(num_stages=3, num_stages_wide=2, rows_for_8_warps=128,
                                           rows_for_8_warps_wide=128, bias_tile_keys=32),
                  conv=CausalConvKnobs(block_t=32, block_c=128, num_warps=8),
                  rotary=RotaryKnobs(block_rows=64, num_warps=4, norm_block_elements=2048, norm_num_warps=4),
                  norm=NormKnobs(num_warps=8),
                  gemm=GemmKnobs(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3,
                                 epilogue_gelu=False),
                  rms=RmsNormKnobs(block_elements=4096, max_rows=32, num_warps=8, silu_block_rows=8,
                                   silu_block_cols=512, silu_num_warps=8),
                  gates=GateKnobs(block_elements=4096, num_warps=8, delta_block_tokens=64, delta_num_warps=4)),
}

# sm_86 to sm_89 (RTX 30xx and 40xx, A10, A40, A6000, L4, L40S) and sm_120 (RTX 50xx, RTX PRO 6000 Blackwell): 100 KiB
# of shared memory and 1,536 threads an SM, and sm_80's mma.sync products (no wgmma). Compiled for an L40S (sm_89)
# and an RTX 5090 (sm_120), bfloat16 and float16, Triton 3.9 (python -m tests.kernels.compile_matrix --targets
# 89,120; docs/BENCHMARKS.md): the A100 row fits their shared memory everywhere (75 KiB at most) and compiles clean
# but for attention over heads of 128 with 128 rows a program (Llama-8B's GQA prefill), which spills 40 B (sm_89) /
# 72 B (sm_120) at 255 registers in 3 stages and none in 2 (212-218 registers, 64 KiB); with T5's bias 2 stages
# spill 24 B on sm_120 (Ankh-large's heads of 64, float16) and 3 do not, so the bias keeps 3 there; on sm_120 the
# split design's output kernel spills 16-24 B at 64 columns in 4 warps (88 B at 32) and none in 8 (182-201
# registers). Before these rows sm_120 took the H100 row, whose walk (64 columns, 2 stages) spilled 720 B there.
TABLE[86] = replace(TABLE[80], attention=replace(TABLE[80].attention, num_stages=2))
TABLE[120] = replace(TABLE[86], attention=replace(TABLE[86].attention, bias_num_stages=3),
                     chunk=replace(TABLE[86].chunk, output_num_warps=8))
# B200 (sm_100; B300, Thor take its row): the H100's spilled in the delta rule's walk at 64 columns (16-32 B at 255
# registers, states carried in or out) and in linear_gelu's 128 x 128 tiles (8 B: 8 warps are held to 128 registers
# there); 32 columns (168-176 registers, two blocks an SM) and 128 x 64 tiles (79 registers) compile clean (Triton
# 3.9, compile_matrix --targets 100).
TABLE[100] = replace(TABLE[90], chunk=replace(TABLE[90].chunk, block_v=32), gemm=replace(TABLE[90].gemm, block_n=64))

# Rows that differ on older Triton versions: {(major, minor): {arch: {part: {knob: value}}}}; versions up
# to and including the key take the change (the first key that applies wins).
TRITON_OVERRIDES: dict[tuple[int, int], dict[int, dict[str, dict]]] = {
    # Triton 3.6 (the GPU image's): head dim 256 prefill attention on sm_90 spills 40 B in 4 warps,
    # none in 8 (171 registers); 3.9 compiles the 4-warp program clean. No override for rows 86 and 100,
    # where 3.6 parks 16 B in local memory across the KV walk of one attention launch each (sm_86-89: a
    # 32-split decode; sm_100: 8-warp paged prefill at head dim 64), never inside it: one stage or 4 warps,
    # which remove it, would cost every attention launch of the row (docs/BENCHMARKS.md, "Other GPUs' rows").
    (3, 6): {90: {"attention": {"rows_for_8_warps_wide": 64}}},
}


def _triton_version() -> tuple[int, int]:
    try:
        import triton
    except ImportError:  # CPU-only installs: the table still answers (the knobs are never used)
        return (99, 0)
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def table_arch(arch: int) -> int:
    """The table row for a compute capability: the nearest one at or below it (at least the lowest)."""
    below = [row for row in TABLE if row <= arch]
    return max(below) if below else min(TABLE)


def launch_row(target: GpuTarget, triton_version: tuple[int, int] | None = None) -> LaunchRow:
    """The knobs for `target` under the given (default: installed) Triton version."""
    arch = table_arch(target.arch)
    row = TABLE[arch]
    version = triton_version or _triton_version()
    for upto in sorted(TRITON_OVERRIDES):
        if version <= upto and arch in TRITON_OVERRIDES[upto]:
            changes = TRITON_OVERRIDES[upto][arch]
            return LaunchRow(**{part.name: replace(getattr(row, part.name), **changes.get(part.name, {}))
                                for part in fields(LaunchRow)})
    return row
