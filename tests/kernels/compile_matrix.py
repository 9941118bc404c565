"""The kernel compile matrix (issue 20): every Triton launch the engine makes at real model shapes,
compiled ahead of time for A100 (sm_80) and H100 (sm_90) in bfloat16 and float16, without a GPU.

Each case calls a public op on `meta` tensors inside `dry_run(target)`, so the launches (grid, knobs,
constexprs, argument types) are the ones the op's own launch code picks for that GPU; identical
specialisations are compiled once, in parallel over the CPU cores, through Triton's cache. Each row reads
registers, spills and shared memory from the cubin, then how many blocks an SM holds and in how many waves
the grid runs (sm_model.py); the delta rule's walk also gets the instructions of one chunk, from its SASS.
The delta rule runs at the engine's shapes and at bench_gated_delta_rule.py's (issue 36).

    python -m tests.kernels.compile_matrix [--json OUT] [--only TEXT]   # prints the tables (not under
                                                                         # TRITON_INTERPRET=1)
    python -m tests.kernels.compile_matrix --targets 89,100,120          # L40S (the sm_86-89 row), B200, RTX 5090
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass

import torch

from triton_kernels import causal_conv1d, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, paged_attention, write_kv_cache
from triton_kernels.gates import delta_rule_gates, sigmoid_gate
from triton_kernels.layer_norm import add_layer_norm
from triton_kernels.linear_gelu import linear_gelu
from triton_kernels.rms_norm import add_rms_norm, gated_rms_norm, gelu_tanh_mul, silu_mul
from triton_kernels.paged_attention import varlen_attention
from triton_kernels.rotary import norm_rotate_, norm_rotate_qk_, rotate_qk_
from triton_kernels._launch import A100, B200, H100, L40S, RTX5090, Launch, dry_run
from triton_kernels.aot import (SHARED_MEMORY_PER_BLOCK, CompileSpec, Resources, compile_and_measure, compile_kernel,
                                compile_spec, cubin_sass)

from tests.kernels.sm_model import blocks_per_sm, kernel_counts, local_accesses, loop_counts, waves

TARGETS = (A100, H100)   # what the test compiles; --targets picks from KNOWN_TARGETS
KNOWN_TARGETS = {t.arch: t for t in (A100, L40S, H100, B200, RTX5090)}
SMS = {target.arch: target.num_sms for target in KNOWN_TARGETS.values()}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
META = torch.device("meta")
PAGE_SIZE = 16
LONG = 32768   # the lone long sequence


@dataclass(frozen=True)
class Attention:
    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool
    rel_bias: tuple[int, int] | None = None   # T5's relative-position bias: (num_buckets, max_distance)


QWEN35_ATTENTION = Attention("Qwen3.5-0.8B attn", 8, 2, 256, True)
ESM2 = Attention("ESM-2 650M", 20, 20, 64, False)
LLAMA8B = Attention("Llama-8B", 32, 8, 128, True)
PROTT5 = Attention("ProtT5-XL enc", 32, 32, 128, False, rel_bias=(32, 128))
ANKH_LARGE = Attention("Ankh-large enc", 16, 16, 64, False, rel_bias=(64, 128))
# Qwen3.5-0.8B's Gated DeltaNet layers: 16 key and 16 value heads of 128.
DELTA_HEADS, DELTA_V_HEADS, DELTA_DIM = 16, 16, 128
CONV_CHANNELS = (2 * DELTA_HEADS + DELTA_V_HEADS) * DELTA_DIM   # their causal conv runs over [q|k|v]


def _empty(*shape, dtype):
    return torch.empty(*shape, dtype=dtype, device=META)


def _conv_columns(B: int, T: int, H: int, HV: int, D: int, dtype) -> tuple[torch.Tensor, ...]:
    """q, k [B, T, H, D] and v [B, T, HV, D] as the delta-rule mixer hands them over: column views of the causal
    conv's output [B, T, (2 H + HV) D], read in place by the kernels (their token stride is the conv's width)."""
    q, k, v = _empty(B, T, (2 * H + HV) * D, dtype=dtype).split([H * D, H * D, HV * D], dim=-1)
    return q.reshape(B, T, H, D), k.reshape(B, T, H, D), v.reshape(B, T, HV, D)


def delta_prefill(dtype, num_seqs: int, seq_len: int, continues: bool, keeps_state: bool,
                  heads: int | None = None, design: str | None = None) -> None:
    """A prefill at Qwen3.5-0.8B's delta-rule shapes (`heads`: that many key and value heads instead; `design`:
    the chunked kernels' design, default the launch table's)."""
    H, HV, D = heads or DELTA_HEADS, heads or DELTA_V_HEADS, DELTA_DIM
    q, k, v = _conv_columns(num_seqs, seq_len, H, HV, D, dtype)
    g, beta = _empty(num_seqs, seq_len, HV, dtype=torch.float32), _empty(num_seqs, seq_len, HV, dtype=dtype)
    h0 = _empty(num_seqs, HV, D, D, dtype=torch.float32) if continues else None
    chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=keeps_state,
                           use_qk_l2norm_in_kernel=True, chunk_size=64, design=design)


def delta_bench_prefill(dtype, H: int, HV: int, D: int, lengths: tuple[int, ...], design: str | None = None) -> None:
    """One call as bench_gated_delta_rule.py makes it: sequences packed with cu_seqlens (their bounds also in
    host memory, as the engine passes them: meta tensors have no values), final states out."""
    T = sum(lengths)
    q, k = _empty(1, T, H, D, dtype=dtype), _empty(1, T, H, D, dtype=dtype)
    v = _empty(1, T, HV, D, dtype=dtype)
    g, beta = _empty(1, T, HV, dtype=torch.float32), _empty(1, T, HV, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]) if len(lengths) > 1 else None
    chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=64,
                           cu_seqlens=None if cu is None else _empty(len(lengths) + 1, dtype=torch.int32),
                           cu_seqlens_cpu=cu, design=design)


def bench_cases() -> list:
    """bench_gated_delta_rule.py's prefill shapes (bench/ is not a package: its folder goes on the path)."""
    sys.path.insert(0, os.path.join(REPO, "bench"))
    from bench_gated_delta_rule import prefill_cases
    return prefill_cases(smoke=False)


def delta_decode(dtype, num_seqs: int) -> None:
    H, HV, D = DELTA_HEADS, DELTA_V_HEADS, DELTA_DIM
    q, k, v = _conv_columns(1, num_seqs, H, HV, D, dtype)
    g, beta = _empty(1, num_seqs, HV, dtype=torch.float32), _empty(1, num_seqs, HV, dtype=dtype)
    # As the engine decodes: states read and written in place in their slots of the pool (one per sequence here).
    fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=_empty(num_seqs, HV, D, D, dtype=torch.float32),
                                     state_indices=_empty(num_seqs, dtype=torch.int64),
                                     cu_seqlens=_empty(num_seqs + 1, dtype=torch.int32), use_qk_l2norm_in_kernel=True)


def conv_step(dtype, num_seqs: int, tokens_each: int, windows: bool) -> None:
    """The delta-rule layers' causal conv as the engine calls it: on the [q|k|v] columns of the input
    projection (read in place), windows read and kept in their slots when sequences continue."""
    C, tokens = CONV_CHANNELS, num_seqs * tokens_each
    proj = _empty(tokens, C + DELTA_V_HEADS * DELTA_DIM + 2 * DELTA_V_HEADS, dtype=dtype)
    slots = {}
    if windows:
        slots = dict(conv_state=_empty(num_seqs, 3, C, dtype=dtype), state_indices=_empty(num_seqs, dtype=torch.int64),
                     has_initial_state=_empty(num_seqs, dtype=torch.bool))
    causal_conv1d(proj[:, :C], _empty(C, 4, dtype=dtype), cu_seqlens=_empty(num_seqs + 1, dtype=torch.int32), **slots)


def attention_step(dtype, model: Attention, num_seqs: int, q_len: int, kv_len: int) -> None:
    """One engine step: the step's keys and values written to the cache, then attention over it."""
    tokens = num_seqs * q_len
    pages = num_seqs * -(-kv_len // PAGE_SIZE)
    k_cache = _empty(pages, PAGE_SIZE, model.num_kv_heads, model.head_dim, dtype=dtype)
    v_cache = _empty(pages, PAGE_SIZE, model.num_kv_heads, model.head_dim, dtype=dtype)
    k_new = _empty(tokens, model.num_kv_heads, model.head_dim, dtype=dtype)
    write_kv_cache(k_new, k_new, k_cache, v_cache, _empty(tokens, dtype=torch.int64))
    bias = {}
    if model.rel_bias is not None:   # T5: the table in the model's dtype, unscaled scores
        bias = dict(rel_bias_table=_empty(model.rel_bias[0], model.num_q_heads, dtype=dtype),
                    rel_max_distance=model.rel_bias[1])
    paged_attention(_empty(tokens, model.num_q_heads, model.head_dim, dtype=dtype), k_cache, v_cache,
                    _empty(num_seqs, -(-kv_len // PAGE_SIZE), dtype=torch.int32),
                    _empty(num_seqs + 1, dtype=torch.int32), _empty(num_seqs, dtype=torch.int32),
                    causal=model.causal, scale=1.0 if bias else model.head_dim ** -0.5, **bias)


@dataclass(frozen=True)
class Encoder:
    name: str
    hidden: int
    heads: int
    ffn: int


ESM2_650M = Encoder("ESM-2 650M", 1280, 20, 5120)
ESM2_3B = Encoder("ESM-2 3B", 2560, 40, 10240)
ENCODER_TOKENS = 32768   # one step at the default token budget


def encoder_layer(dtype, model: Encoder) -> None:
    """The fused kernels of one ESM layer on the Triton path (esm.py EsmLayer.forward_fused): the q-scale +
    rotary pass over the QKV output, attention straight from it (108 sequences of ~300 tokens), the two
    add + norm passes, and the first MLP product with its GELU."""
    T, d, H = ENCODER_TOKENS, model.hidden, model.heads
    D = d // H
    qkv = _empty(T, 3 * d, dtype=dtype)
    cos = _empty(T, 1, D, dtype=dtype)
    rotate_qk_(qkv, cos, cos, num_q_heads=H, num_kv_heads=H, head_dim=D, q_scale=D ** -0.5)
    varlen_attention(qkv[:, :d].view(T, H, D), qkv[:, d:2 * d].view(T, H, D), qkv[:, 2 * d:].view(T, H, D),
                     _empty(109, dtype=torch.int32), _empty(108, dtype=torch.int32), scale=1.0)
    x = _empty(T, d, dtype=dtype)
    add_layer_norm(x, x, _empty(d, dtype=dtype), _empty(d, dtype=dtype), 1e-5)
    add_layer_norm(x, None, _empty(d, dtype=dtype), _empty(d, dtype=dtype), 1e-5)
    linear_gelu(x, _empty(model.ffn, d, dtype=dtype), _empty(model.ffn, dtype=dtype))


T5_HIDDEN = {PROTT5.name: 1024, ANKH_LARGE.name: 1536}   # d_model


def t5_encoder_layer(dtype, model: Attention) -> None:
    """A T5 encoder step's fused kernels on the Triton path (t5.py T5Layer.forward_fused): attention straight from
    the QKV projection with the relative-position bias (108 sequences of ~300 tokens; the default rule's bias
    tiles, as the engine's launch), unscaled; the add + RMS norms, and in float16 those of the float32 residual
    stream (`wo` kept float32) with the norm in float16, for each pairing of the sum's operands."""
    T, H, D, d = ENCODER_TOKENS, model.num_q_heads, model.head_dim, T5_HIDDEN[model.name]
    n = H * D
    qkv = _empty(T, 3 * n, dtype=dtype)
    varlen_attention(qkv[:, :n].view(T, H, D), qkv[:, n:2 * n].view(T, H, D), qkv[:, 2 * n:].view(T, H, D),
                     _empty(109, dtype=torch.int32), _empty(108, dtype=torch.int32), scale=1.0,
                     rel_bias_table=_empty(model.rel_bias[0], H, dtype=dtype), rel_max_distance=model.rel_bias[1])
    x, w = _empty(T, d, dtype=dtype), _empty(d, dtype=dtype)
    add_rms_norm(x, x, w, 1e-6, zero_centred=False, out_dtype=dtype)
    if dtype == torch.float16:
        r = _empty(T, d, dtype=torch.float32)
        for a, b in ((x, r), (r, x), (r, r)):
            add_rms_norm(a, b, w, 1e-6, zero_centred=False, out_dtype=dtype)


QWEN35_HIDDEN, QWEN35_INTERMEDIATE = 1024, 3584


def rms_decoder_layer(dtype) -> None:
    """The fused RMS-norm kernels of a Qwen3.5-0.8B layer on the Triton path (RotaryDecoder._fused_layers): add +
    norm with and without the residual, zero-centred (Qwen3.5) and in Llama's order (Llama, Qwen3: another
    specialisation), the delta-rule mixer's gated norm over o [T, 16, 128] with z a view of the input projection,
    and the MLP's silu(gate) * up over the gate_up product."""
    T, d, n = ENCODER_TOKENS, QWEN35_HIDDEN, QWEN35_INTERMEDIATE
    x, w = _empty(T, d, dtype=dtype), _empty(d, dtype=dtype)
    for zero_centred in (True, False):
        add_rms_norm(x, x, w, 1e-6, zero_centred=zero_centred)
        add_rms_norm(x, None, w, 1e-6, zero_centred=zero_centred)
    HV, V = DELTA_V_HEADS, DELTA_DIM
    projection = _empty(T, CONV_CHANNELS + HV * V + 2 * HV, dtype=dtype)
    z = projection[:, CONV_CHANNELS:CONV_CHANNELS + HV * V].view(T, HV, V)
    gated_rms_norm(_empty(T, HV, V, dtype=dtype), z, _empty(V, dtype=dtype), 1e-6)
    silu_mul(_empty(T, 2 * n, dtype=dtype))


ANKH_LARGE_FF = 3840   # Ankh-large's d_ff (tests/families/published_configs.py ankh_large)


def t5_gated_gelu(dtype) -> None:
    """Ankh-large's gated-gelu feed-forward between its two GEMMs: gelu_tanh(gate) * up over the wi product
    [T, 2 d_ff] (wi_0's columns, then wi_1's)."""
    gelu_tanh_mul(_empty(ENCODER_TOKENS, 2 * ANKH_LARGE_FF, dtype=dtype))


def qwen35_gates(dtype) -> None:
    """Qwen3.5-0.8B's gates on the fused Triton path (triton_kernels.gates, 32k tokens): the attention's output gate
    over o [T, 8, 256] with the gate between the queries in the projection (head stride 2 x 256), and a delta-rule
    layer's g and beta from a and b, column views of its input projection."""
    T, m = ENCODER_TOKENS, QWEN35_ATTENTION
    H, D = m.num_q_heads, m.head_dim
    qkv = _empty(T, 2 * H * D + 2 * m.num_kv_heads * D, dtype=dtype)
    sigmoid_gate(_empty(T, H, D, dtype=dtype), qkv[:, :2 * H * D].view(T, H, 2 * D)[..., D:])
    HV, V = DELTA_V_HEADS, DELTA_DIM
    projection = _empty(T, CONV_CHANNELS + HV * V + 2 * HV, dtype=dtype)
    b, a = projection[:, -2 * HV:-HV], projection[:, -HV:]
    delta_rule_gates(a, b, _empty(HV, dtype=dtype), _empty(HV, dtype=dtype))


def qk_norm_rotary(dtype, model: Attention, rotary_dim: int, norm: str | None) -> None:
    """The q and k pass of one attention layer on the fused Triton path (norm_rotate_qk_, 32k tokens; norm_rotate_ of
    k alone beside it): Qwen3.5's zero-centred norms and partial rotary on q between its gates (head stride 2
    head_dim) and on k; a Llama-shaped layer's rotary alone (norm None) or with Qwen3's norms in Llama's order
    ("llama")."""
    T, H, Hkv, D = ENCODER_TOKENS, model.num_q_heads, model.num_kv_heads, model.head_dim
    gated = norm == "zero_centred"
    q_width = (2 if gated else 1) * H * D
    projection = _empty(T, q_width + 2 * Hkv * D, dtype=dtype)
    q = projection[:, :q_width].view(T, H, 2 * D)[..., :D] if gated else projection[:, :q_width].view(T, H, D)
    k = projection[:, q_width:q_width + Hkv * D].view(T, Hkv, D)
    cos = _empty(T, 1, rotary_dim, dtype=dtype)
    w = None if norm is None else _empty(D, dtype=dtype)
    norm_rotate_qk_(q, k, cos, cos, w, w, 1e-6, zero_centred=gated, head_dim=D)   # the engine's one launch
    norm_rotate_(k, cos, cos, w, 1e-6, zero_centred=gated, head_dim=D)            # one tensor alone


def cases() -> list[tuple[str, object]]:
    """(shape label, function of the dtype that makes the launches)."""
    D = DELTA_DIM
    out = [
        (f"delta H={DELTA_HEADS} HV={DELTA_V_HEADS} K=V={D}: 8 x 4k prefill",
         lambda dt: delta_prefill(dt, 8, 4096, continues=False, keeps_state=False)),
        ("... 8 x 4k, state kept", lambda dt: delta_prefill(dt, 8, 4096, continues=False, keeps_state=True)),
        ("... 8 x 4k continuing, state kept", lambda dt: delta_prefill(dt, 8, 4096, continues=True, keeps_state=True)),
        ("... 8 x 4k continuing, last chunk", lambda dt: delta_prefill(dt, 8, 4096, continues=True, keeps_state=False)),
        (f"... 1 x {LONG // 1024}k prefill", lambda dt: delta_prefill(dt, 1, LONG, continues=False, keeps_state=False)),
        # Few heads: the walk cut into segments (local states, transitions from the identity, outputs).
        (f"... 2 value heads, 1 x {2 * LONG // 1024}k continuing (segmented)",
         lambda dt: delta_prefill(dt, 1, 2 * LONG, continues=True, keeps_state=True, heads=2)),
        ("... decode 256 sequences", lambda dt: delta_decode(dt, 256)),
        # The split design (issue 36; design="split"): prep, state walk (whole and segmented), output kernel.
        (f"delta split H={DELTA_HEADS} HV={DELTA_V_HEADS} K=V={D}: 8 x 4k continuing, state kept",
         lambda dt: delta_prefill(dt, 8, 4096, continues=True, keeps_state=True, design="split")),
        (f"... 1 x {LONG // 1024}k prefill",
         lambda dt: delta_prefill(dt, 1, LONG, continues=False, keeps_state=False, design="split")),
        (f"... 2 value heads, 1 x {2 * LONG // 1024}k continuing (segmented)",
         lambda dt: delta_prefill(dt, 1, 2 * LONG, continues=True, keeps_state=True, heads=2, design="split")),
        (f"conv C={CONV_CHANNELS}: 8 x 4k prefill", lambda dt: conv_step(dt, 8, 4096, windows=False)),
        ("... 8 x 4k, windows kept", lambda dt: conv_step(dt, 8, 4096, windows=True)),
        (f"... 1 x {LONG // 1024}k prefill", lambda dt: conv_step(dt, 1, LONG, windows=False)),
        ("... decode 256 sequences", lambda dt: conv_step(dt, 256, 1, windows=True)),
    ]
    for case in bench_cases():
        n = len(case.lengths)
        label = f"bench delta H={case.H} HV={case.HV}: {case.tokens // 1024}k tokens in {n} seq{'s' * (n > 1)}"
        out.append((label, lambda dt, c=case: delta_bench_prefill(dt, c.H, c.HV, c.K, c.lengths)))
        out.append((label.replace("bench delta", "bench delta split"),
                    lambda dt, c=case: delta_bench_prefill(dt, c.H, c.HV, c.K, c.lengths, design="split")))
    for model in (ESM2_650M, ESM2_3B):
        out.append((f"{model.name} layer ({ENCODER_TOKENS // 1024}k tokens)", lambda dt, m=model: encoder_layer(dt, m)))
    for model in (PROTT5, ANKH_LARGE):
        out.append((f"{model.name} layer, attention from the projection ({ENCODER_TOKENS // 1024}k tokens)",
                    lambda dt, m=model: t5_encoder_layer(dt, m)))
    out.append((f"Qwen3.5-0.8B RMS-norm layer ({ENCODER_TOKENS // 1024}k tokens)", rms_decoder_layer))
    out.append((f"Qwen3.5-0.8B gates ({ENCODER_TOKENS // 1024}k tokens)", qwen35_gates))
    out.append((f"Ankh-large gated-gelu feed-forward ({ENCODER_TOKENS // 1024}k tokens)", t5_gated_gelu))
    out += [(f"Qwen3.5-0.8B q/k norm + rotary ({ENCODER_TOKENS // 1024}k tokens)",
             lambda dt: qk_norm_rotary(dt, QWEN35_ATTENTION, 64, "zero_centred")),
            (f"Llama-8B q/k rotary ({ENCODER_TOKENS // 1024}k tokens)",
             lambda dt: qk_norm_rotary(dt, LLAMA8B, 128, None)),
            ("... with Qwen3's q/k norms", lambda dt: qk_norm_rotary(dt, LLAMA8B, 128, "llama"))]
    for model in (QWEN35_ATTENTION, ESM2, LLAMA8B, PROTT5, ANKH_LARGE):
        label = f"{model.name} {model.num_q_heads}/{model.num_kv_heads} D={model.head_dim}"
        out.append((f"{label}: 8 x 4k prefill", lambda dt, m=model: attention_step(dt, m, 8, 4096, 4096)))
        if model.causal:
            out += [(f"... 1 x {LONG // 1024}k prefill", lambda dt, m=model: attention_step(dt, m, 1, LONG, LONG)),
                    ("... decode 256 x 4k", lambda dt, m=model: attention_step(dt, m, 256, 1, 4096)),
                    (f"... decode 1 x {LONG // 1024}k", lambda dt, m=model: attention_step(dt, m, 1, 1, LONG))]
    return out


@dataclass(frozen=True)
class Row:
    kernel: str
    shape: str
    dtype: str
    arch: int
    grid: tuple[int, ...]
    knobs: str
    num_warps: int


def plan(only: str | None = None, targets=TARGETS, dtypes: tuple[str, ...] = tuple(DTYPES)
         ) -> tuple[list[Row], list[CompileSpec]]:
    """Every (case, dtype, target) launch as a table row, and the spec each row compiles; `only`: the cases
    whose label holds this text (a case labelled "..." continues the one above: it goes with it)."""
    rows, specs = [], []
    chosen, keep = [], False
    for shape, make in cases():
        keep = keep if shape.startswith("...") else (only is None or only in shape)
        if keep:
            chosen.append((shape, make))
    for target in targets:
        for dt_name, dtype in ((name, DTYPES[name]) for name in dtypes):
            for shape, make in chosen:
                if shape.startswith("bench") and dt_name != "bf16":
                    continue   # the benchmark runs bfloat16 only
                with dry_run(target) as launches:
                    make(dtype)
                for launch in launches:
                    rows.append(Row(launch.kernel.fn.__name__.strip("_"), shape, dt_name, target.arch, launch.grid,
                                    _knobs(launch), launch.num_warps))
                    specs.append(compile_spec(launch, target.arch))
    return rows, specs


def _knobs(launch: Launch) -> str:
    names = ("BV", "BLOCK_Q", "TILE", "NUM_SPLITS", "BLOCK", "BT", "BC", "BLOCK_ROWS", "BLOCK_N", "BLOCK_M",
             "BLOCK_K", "BLOCK_COLS")
    shown = [f"{n}={launch.constexprs[n]}" for n in names if n in launch.constexprs]
    if "ACTIVATION" in launch.constexprs:   # the gated MLPs' kernel: silu or gelu_tanh
        shown.append(launch.constexprs["ACTIVATION"])
    if launch.constexprs.get("HAS_BIAS") and "HALF" in launch.constexprs:   # T5's bias in attention
        shown.append(f"+bias/{2 * launch.constexprs['HALF']}")
    for flag, meaning in (("USE_H0", "h0"), ("STORE_HT", "ht"), ("USE_U", "u"), ("WRITE_O", "o"), ("STORE_CHUNKS", "s"),
                          ("H0_IDENTITY", "eye"), ("CONTIGUOUS_KV", "contiguous"), ("HAS_Y", "add"),
                          ("HAS_WEIGHT", "norm"), ("ZERO_CENTRED", "zc")):
        if flag in launch.constexprs:
            shown.append(("+" if launch.constexprs[flag] else "-") + meaning)
    return " ".join(shown + [f"w{launch.num_warps}", f"s{launch.num_stages}"])


# Kernels whose instructions the report counts from their SASS: the walk's main loop (what one chunk chains), the
# prep kernel whole (one chunk's intra-chunk algebra).
LOOP_KERNELS = ("_chunk_walk_kernel", "_split_state_kernel")
WHOLE_KERNELS = ("_chunk_prep_kernel", "_split_solve_kernel", "_split_wu_kernel", "_split_output_kernel")


def measure(spec: CompileSpec) -> tuple[Resources, dict | None, int | None]:
    """Resources of the compiled spec, its counted instructions (LOOP_KERNELS, WHOLE_KERNELS, else None), and
    where it spills: how many of its local loads and stores lie inside a loop (None when it does not spill)."""
    found = compile_and_measure(spec)
    if spec.kernel not in LOOP_KERNELS + WHOLE_KERNELS and not found.spill_bytes:
        return found, None, None
    sass = cubin_sass(compile_kernel(spec).asm["cubin"])   # (the compile is cached)
    counted = (loop_counts(sass) if spec.kernel in LOOP_KERNELS else
               kernel_counts(sass) if spec.kernel in WHOLE_KERNELS else None)
    return found, counted, local_accesses(sass)[1] if found.spill_bytes else None


def compile_all(specs: list[CompileSpec], workers: int) -> dict[CompileSpec, tuple[Resources, dict | None, int | None]]:
    """Each distinct spec compiled once, over `workers` processes, longest kernels first."""
    unique = sorted(set(specs), key=lambda s: ("prep" not in s.kernel, s.kernel, s.arch))
    if workers <= 1:
        return {s: measure(s) for s in unique}
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return dict(zip(unique, pool.map(measure, unique)))


def occupancy(row: Row, r: Resources) -> tuple[int, str, int]:
    """(blocks per SM, what limits them, waves of the row's grid) on its GPU."""
    per_sm, limiter = blocks_per_sm(row.arch, r.registers, row.num_warps, r.shared_bytes)
    programs = 1
    for n in row.grid:
        programs *= n
    return per_sm, limiter, waves(programs, SMS[row.arch], per_sm)


def table(rows: list[Row], specs: list[CompileSpec], found: dict) -> list[str]:
    lines = ["| kernel | shape | dtype | arch | grid | knobs | registers | spills (B) | shared (B) | blocks/SM "
             "| waves |", "|---|---|---|---|---|---|---:|---:|---:|---:|---:|"]
    for row, spec in zip(rows, specs):
        r = found[spec][0]
        per_sm, limiter, n = occupancy(row, r)
        grid = " x ".join(map(str, row.grid))
        lines.append(f"| {row.kernel} | {row.shape} | {row.dtype} | sm_{row.arch} | {grid} | {row.knobs} | "
                     f"{r.registers} | {r.spill_bytes} | {r.shared_bytes} | {per_sm} ({limiter}) | {n} |")
    return lines


def loop_table(rows: list[Row], specs: list[CompileSpec], found: dict) -> list[str]:
    """One line per distinct compiled kernel whose instructions are counted (see measure), by kind."""
    from tests.kernels.sm_model import SASS_KINDS
    kinds = [*SASS_KINDS, "instructions"]
    lines = [f"| kernel | first shape | dtype | arch | knobs | {' | '.join(kinds)} |",
             "|---|---|---|---|---|" + "---:|" * len(kinds)]
    seen = set()
    for row, spec in zip(rows, specs):
        counts = found[spec][1]
        if counts is None or spec in seen:
            continue
        seen.add(spec)
        lines.append(f"| {row.kernel} | {row.shape} | {row.dtype} | sm_{row.arch} | {row.knobs} | "
                     f"{' | '.join(str(counts[k]) for k in kinds)} |")
    return lines


def spill_text(r: Resources, in_loops: int) -> str:
    where = "some of them inside a loop" if in_loops else "all of them outside its loops"
    return f"spills {r.spill_bytes} B at {r.registers} registers ({where})"


def problems(rows: list[Row], specs: list[CompileSpec], found: dict, cold_spills_ok: bool = False
             ) -> tuple[list[str], list[str]]:
    """(problems, notes): every spill, shared memory over the GPU's, a walk without a loop; with `cold_spills_ok`
    a spill whose local loads and stores all lie outside the kernel's loops is a note instead (registers parked
    across the loops: a few accesses a program, not some every trip)."""
    out, notes = [], []
    for row, spec in zip(rows, specs):
        r, counted, spills_in_loops = found[spec]
        where = f"{row.kernel} [{row.shape}] {row.dtype} sm_{row.arch} ({row.knobs})"
        if r.spill_bytes:
            (notes if cold_spills_ok and not spills_in_loops else out).append(
                f"{where} {spill_text(r, spills_in_loops)}")
        if r.shared_bytes > SHARED_MEMORY_PER_BLOCK[row.arch]:
            out.append(f"{where} needs {r.shared_bytes} B of shared memory, over sm_{row.arch}'s "
                       f"{SHARED_MEMORY_PER_BLOCK[row.arch]}")
        if spec.kernel in LOOP_KERNELS and counted is None:
            out.append(f"{where}: no loop found in its SASS")
    return out, notes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write rows, resources and timings here")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--only", help="just the cases whose label holds this text (e.g. 'delta')")
    parser.add_argument("--targets", default=",".join(str(t.arch) for t in TARGETS),
                        help=f"compute capabilities to compile for, of {', '.join(map(str, KNOWN_TARGETS))} "
                             f"(default: {','.join(str(t.arch) for t in TARGETS)})")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"of {', '.join(DTYPES)} (default: both)")
    parser.add_argument("--cold-spills-ok", action="store_true",
                        help="a spill whose local loads and stores all lie outside the kernel's loops is printed "
                             "as a note, not a problem")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
    try:
        targets = [KNOWN_TARGETS[int(arch)] for arch in args.targets.split(",")]
    except (KeyError, ValueError):
        parser.error(f"--targets takes compute capabilities of {', '.join(map(str, KNOWN_TARGETS))}, got {args.targets}")
    dtypes = tuple(args.dtypes.split(","))
    if not set(dtypes) <= set(DTYPES):
        parser.error(f"--dtypes takes {', '.join(DTYPES)}, got {args.dtypes}")
    start = time.perf_counter()
    rows, specs = plan(args.only, targets, dtypes)
    planned = time.perf_counter()
    found = compile_all(specs, args.workers)
    done = time.perf_counter()
    import triton
    print(f"# {len(rows)} launches, {len(found)} distinct compiles, triton {triton.__version__}: planned in "
          f"{planned - start:.1f} s, compiled in {done - planned:.1f} s over {args.workers} process(es) "
          f"(compile seconds summed: {sum(r.seconds for r, _, _ in found.values()):.1f})")
    print("\n".join(table(rows, specs, found)))
    print(f"\n# Instructions by kind, from the SASS: the main loop of {', '.join(LOOP_KERNELS)} (one trip = one "
          f"chunk), the whole of {', '.join(WHOLE_KERNELS)} (one chunk)\n")
    print("\n".join(loop_table(rows, specs, found)))
    bad, notes = problems(rows, specs, found, args.cold_spills_ok)
    for line in notes:
        print("NOTE:", line)
    for line in bad:
        print("PROBLEM:", line)
    if args.json:
        out = []
        for r, s in zip(rows, specs):
            res, counts, spills_in_loops = found[s]
            per_sm, limiter, n = occupancy(r, res)
            out.append(dict(kernel=r.kernel, shape=r.shape, dtype=r.dtype, arch=r.arch, grid=list(r.grid),
                            knobs=r.knobs, num_warps=r.num_warps, registers=res.registers, spill_bytes=res.spill_bytes,
                            shared_bytes=res.shared_bytes, blocks_per_sm=per_sm, limiter=limiter, waves=n,
                            spill_accesses_in_loops=spills_in_loops, sass=counts))
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "plan_s": planned - start, "compile_s": done - planned,
                       "distinct": len(found), "problems": bad, "notes": notes, "rows": out}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
