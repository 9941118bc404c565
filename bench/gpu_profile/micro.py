"""Step micro: the ESM-2 650M step's pieces one at a time, each beside its ceiling. cuBLAS at the step's four
GEMM shapes (bias as F.linear adds it) in TFLOP/s; on the step's own tokens (the engine's prepared step: its
positions, pages, cu_seqlens and launch knobs) the engine's rotary (Rotary.apply of q and k, as EsmLayer._qkv
calls it), the q scale, LayerNorm, GELU, the residual add, write_kv_cache, and our paged attention beside
F.scaled_dot_product_attention (flash, nested jagged: varlen) on the same packed lengths. GB/s are at the
fewest bytes each op must move (its inputs read once, its outputs written once).

The rows are a table of named callables (ROWS below, then FUSED): a kernel written later is one more line.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .models import esm_tokenizer, native_engine, step_texts
from .report import Report, load
from .setting import Setting
from .timing import bench_ms


@dataclass
class Buffers:
    """One step's tensors, as layer 0 of the engine sees them."""
    layer: object            # pipeline.models.esm.EsmLayer
    rotary: object           # pipeline.models.layers.rotary.Rotary
    ctx: object              # pipeline.models.step.StepContext (prepared by ModelRunner.prepare)
    x: torch.Tensor          # [T, d] a residual stream
    y: torch.Tensor          # [T, d] what is added to it
    qkv: torch.Tensor        # [T, 3d] the QKV projection's output
    q: torch.Tensor          # [T, H, D] views of it, as _qkv unbinds them
    k: torch.Tensor
    v: torch.Tensor
    q_rot: torch.Tensor      # [T, H, D] q scaled and rotated, k rotated: what attention gets
    k_rot: torch.Tensor
    cos: torch.Tensor        # [T, 1, D] from Rotary.cos_sin
    sin: torch.Tensor
    h: torch.Tensor          # [T, ffn] fc1's output
    scale: float             # head_dim ** -0.5
    gemm_rows: int           # M of the products

    @property
    def T(self) -> int:
        return self.x.shape[0]

    def nbytes(self, *tensors: torch.Tensor) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class Row:
    name: str
    family: str
    make: Callable[[Buffers], Callable[[], object]]   # buffers -> the call to time
    nbytes: Callable[[Buffers], float] = lambda b: 0.0
    flops: Callable[[Buffers], float] = lambda b: 0.0


def _qkv_elementwise(b: Buffers):
    """EsmLayer._qkv after the projection: the q scale, then the rotary of q and of k."""
    def call():
        q = b.q * b.scale
        return b.rotary.apply(q, b.cos, b.sin), b.rotary.apply(b.k, b.cos, b.sin)
    return call


def _attention_flops(b: Buffers) -> float:
    lengths = b.ctx.q_lens.astype(float)
    return 4.0 * float((lengths * lengths).sum()) * b.q.shape[1] * b.q.shape[2]


def _write_kv(b: Buffers):
    from triton_kernels import write_kv_cache
    k_cache, v_cache = b.layer.attn.kv
    return lambda: write_kv_cache(b.k_rot, b.v, k_cache, v_cache, b.ctx.slot_mapping)


def _paged(b: Buffers):
    from triton_kernels import paged_attention, write_kv_cache
    k_cache, v_cache = b.layer.attn.kv
    write_kv_cache(b.k_rot, b.v, k_cache, v_cache, b.ctx.slot_mapping)   # the keys it reads
    c = b.ctx
    return lambda: paged_attention(b.q_rot, k_cache, v_cache, c.block_tables, c.cu_seqlens, c.kv_lens, causal=False,
                                   scale=1.0, **c.attention_launch)


def _sdpa_varlen(b: Buffers):
    """SDPA's flash backend on nested jagged tensors (one varlen launch); where that is refused (CPU), one SDPA
    call per sequence."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    offsets = b.ctx.cu_seqlens.long()
    q, k, v = (t.contiguous() for t in (b.q_rot, b.k_rot, b.v))
    jagged = [torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2) for t in (q, k, v)]

    def flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(*jagged, scale=1.0)
    try:
        flash()
        return flash
    except (RuntimeError, NotImplementedError) as e:
        bounds = offsets.tolist()

        def per_sequence():
            for s, e in zip(bounds, bounds[1:]):
                F.scaled_dot_product_attention(*(t[s:e].transpose(0, 1)[None] for t in (q, k, v)), scale=1.0)
        per_sequence.label = f"one SDPA call per sequence (nested jagged flash refused: {str(e)[:60]})"
        return per_sequence


def _gelu(b: Buffers):
    from triton_kernels import pointwise
    return lambda: pointwise.gelu(b.h)


def _gemm(index: int):
    """F.linear of layer 0's index-th product (qkv, attention output, fc1, fc2) on gemm_rows rows."""
    def make(b: Buffers):
        lin = [b.layer.qkv, b.layer.attn_out, b.layer.fc1, b.layer.fc2][index]
        x = torch.randn(b.gemm_rows, lin.in_features, device=b.x.device).to(b.x.dtype)
        return lambda: F.linear(x, lin.weight, lin.bias)
    return make


def _gemm_row(label: str, index: int) -> Row:
    def size(b: Buffers):
        lin = [b.layer.qkv, b.layer.attn_out, b.layer.fc1, b.layer.fc2][index]
        return lin.in_features, lin.out_features
    return Row(f"F.linear {label}", "GEMM", _gemm(index),
               lambda b: 2.0 * (b.gemm_rows * sum(size(b)) + size(b)[0] * size(b)[1]),
               lambda b: 2.0 * b.gemm_rows * size(b)[0] * size(b)[1])


ROWS = [
    _gemm_row("M x d -> 3d (qkv)", 0),
    _gemm_row("M x d -> d (attention output)", 1),
    _gemm_row("M x d -> 4d (fc1)", 2),
    _gemm_row("M x 4d -> d (fc2)", 3),
    Row("q scale (q * head_dim^-0.5)", "other", lambda b: lambda: b.q * b.scale, lambda b: 2 * b.nbytes(b.q)),
    Row("rotary q (Rotary.apply, fp32 math)", "rotary", lambda b: lambda: b.rotary.apply(b.q, b.cos, b.sin),
        lambda b: 2 * b.nbytes(b.q)),
    Row("rotary k", "rotary", lambda b: lambda: b.rotary.apply(b.k, b.cos, b.sin), lambda b: 2 * b.nbytes(b.k)),
    Row("q scale + rotary q, k (as EsmLayer._qkv)", "rotary", _qkv_elementwise, lambda b: 4 * b.nbytes(b.q)),
    Row("LayerNorm (attn_norm)", "norm", lambda b: lambda: b.layer.attn_norm(b.x), lambda b: 2 * b.nbytes(b.x)),
    Row("GELU (pointwise.gelu) on fc1's output", "activation", _gelu,
        lambda b: 2 * b.nbytes(b.h)),
    Row("residual add", "residual", lambda b: lambda: b.x + b.y, lambda b: 3 * b.nbytes(b.x)),
    Row("write_kv_cache (k, v)", "attention", _write_kv, lambda b: 4 * b.nbytes(b.k)),
    Row("paged_attention (ours, bidirectional)", "attention", _paged, lambda b: 4 * b.nbytes(b.q), _attention_flops),
    Row("SDPA flash, nested jagged (varlen)", "attention", _sdpa_varlen, lambda b: 4 * b.nbytes(b.q), _attention_flops),
]


# ---- the fused kernels of issue 35 item 3 (EsmLayer.forward_fused): one line each -------------------------------------
# fused(label, family, "module:attribute", call(fn, buffers) -> the call to time, bytes(buffers), flops(buffers)): a row
# only when triton_kernels exposes module.attribute; a call that fails prints its error in its row.
def fused(label: str, family: str, target: str, call, nbytes=lambda b: 0.0, flops=lambda b: 0.0) -> Row | None:
    module, _, attribute = target.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError):
        return Row(f"{label}: not in triton_kernels ({target})", family, None)
    return Row(label, family, lambda b: call(fn, b), nbytes, flops)


def _rotate(fn, b: Buffers):
    qkv = b.qkv.clone()   # rotated in place again each call: b.q, b.k, b.v stay as the other rows read them
    H, D = b.q.shape[1], b.q.shape[2]
    return lambda: fn(qkv, b.cos, b.sin, num_q_heads=H, num_kv_heads=H, head_dim=D, q_scale=1.0)


def _linear_gelu(**knobs):
    def call(fn, b: Buffers):
        x = torch.randn(b.gemm_rows, b.layer.fc1.in_features, device=b.x.device).to(b.x.dtype)
        return lambda: fn(x, b.layer.fc1.weight, b.layer.fc1.bias, **knobs)
    return call


def _fc1_flops(b: Buffers) -> float:
    return 2.0 * b.gemm_rows * b.layer.fc1.in_features * b.layer.fc1.out_features


def _fc1_bytes(b: Buffers) -> float:
    f = b.layer.fc1
    return 2.0 * (b.gemm_rows * (f.in_features + f.out_features) + f.in_features * f.out_features)


def _add_rms(zero_centred: bool):
    def call(fn, b: Buffers):
        return lambda: fn(b.x, b.y, b.layer.mlp_norm.weight, 1e-6, zero_centred=zero_centred)
    return call


def _unfused_add_rms(b: Buffers):
    from pipeline.models.layers.norms import RMSNorm
    norm = RMSNorm(b.x.shape[1], 1e-6, zero_centred=True).to(b.x.device, b.x.dtype)
    return lambda: norm(b.x + b.y)


def _gated_inputs(b: Buffers):
    """o [T, d / V, V] and z a view of the same shape in a wider tensor (the mixer's input projection): heads of
    V = 128 (Qwen3.5's), or one head of d where d is not a multiple of 128 (--smoke's toy model)."""
    T, d = b.x.shape
    V = 128 if d % 128 == 0 else d
    wide = torch.randn(T, 2 * d, device=b.x.device).to(b.x.dtype)
    return b.x.view(T, d // V, V), wide[:, d:].view(T, d // V, V), b.layer.mlp_norm.weight[:V]


def _gated(fn, b: Buffers):
    o, z, w = _gated_inputs(b)
    return lambda: fn(o, z, w, 1e-6)


def _unfused_gated(b: Buffers):
    from pipeline.models.layers.norms import GatedRMSNorm
    o, z, w = _gated_inputs(b)
    norm = GatedRMSNorm(w.shape[0], 1e-6).to(b.x.device)
    return lambda: norm(o, z)


def _unfused_silu_mul(b: Buffers):
    gate, up = b.h.clone().chunk(2, dim=-1)   # a copy of its own: GatedMLP's GPU form works in place
    return lambda: F.silu(gate, inplace=True).mul_(up)


def _unfused_gelu_tanh_mul(b: Buffers):
    from triton_kernels import pointwise
    gate, up = b.h.chunk(2, dim=-1)
    return lambda: pointwise.gelu_tanh(gate).mul_(up)   # as T5FeedForward's gated form (a new tensor each call)


def _unfused_fc1_gelu(b: Buffers):
    from triton_kernels import pointwise
    x = torch.randn(b.gemm_rows, b.layer.fc1.in_features, device=b.x.device).to(b.x.dtype)
    return lambda: pointwise.gelu(F.linear(x, b.layer.fc1.weight, b.layer.fc1.bias))


def _norm_rotate(fn, b: Buffers):
    q = b.qkv.clone()[:, :b.q.shape[1] * b.q.shape[2]].view(b.q.shape)   # a view of its own, updated each call
    w = torch.zeros(q.shape[-1], device=q.device, dtype=q.dtype)
    return lambda: fn(q, b.cos, b.sin, w, 1e-6, zero_centred=True, head_dim=q.shape[-1],
                      float32_math=b.rotary.float32_math)


def _unfused_norm_rotate(b: Buffers):
    from pipeline.models.layers.norms import RMSNorm
    norm = RMSNorm(b.q.shape[-1], 1e-6, zero_centred=True).to(b.q.device, b.q.dtype)
    return lambda: b.rotary.apply(norm(b.q), b.cos, b.sin, in_place=True)


def _norm_rotate_qk(fn, b: Buffers):
    qkv = b.qkv.clone()   # views of its own, updated each call
    n = b.q.shape[1] * b.q.shape[2]
    q, k = qkv[:, :n].view(b.q.shape), qkv[:, n:2 * n].view(b.k.shape)
    w = torch.zeros(q.shape[-1], device=q.device, dtype=q.dtype)
    return lambda: fn(q, k, b.cos, b.sin, w, w, 1e-6, zero_centred=True, head_dim=q.shape[-1],
                      float32_math=b.rotary.float32_math)


def _gate_inputs(b: Buffers):
    """o contiguous (the attention's output) and the gate a strided view of the same shape (k inside the QKV
    output: a gate between the queries, as in Qwen3.5's projection)."""
    return b.q.contiguous(), b.k


def _unfused_sigmoid_gate(b: Buffers):
    from triton_kernels import pointwise
    o, gate = _gate_inputs(b)
    T = o.shape[0]
    return lambda: o.reshape(T, -1) * pointwise.sigmoid(gate.reshape(T, -1))


T5_BUCKETS, T5_MAX_DISTANCE = 32, 128   # ProtT5's relative-position bias


def _t5_bias(b: Buffers) -> dict:
    table = torch.randn(T5_BUCKETS, b.q.shape[1], device=b.x.device).to(b.x.dtype)
    return dict(rel_bias_table=table, rel_max_distance=T5_MAX_DISTANCE)


def _paged_t5(b: Buffers):
    """What a T5 layer's attention was before it read the projection: the KV write and the paged walk, with the
    bias (the default rule's bias tiles)."""
    from triton_kernels import paged_attention, write_kv_cache
    k_cache, v_cache = b.layer.attn.kv
    c, bias = b.ctx, _t5_bias(b)

    def call():
        write_kv_cache(b.k_rot, b.v, k_cache, v_cache, c.slot_mapping)
        return paged_attention(b.q_rot, k_cache, v_cache, c.block_tables, c.cu_seqlens, c.kv_lens, causal=False,
                               scale=1.0, **bias)
    return call


def _relu_inputs(b: Buffers):
    """fc1's shape without its bias (ProtT5's wi has none), and a zero bias for the epilogue's form."""
    f = b.layer.fc1
    x = torch.randn(b.gemm_rows, f.in_features, device=b.x.device).to(b.x.dtype)
    return x, f.weight, torch.zeros(f.out_features, device=b.x.device, dtype=b.x.dtype)


def _unfused_relu(b: Buffers):
    x, w, _ = _relu_inputs(b)
    return lambda: F.linear(x, w).relu_()


def _relu_epilogue(b: Buffers):
    """torch._addmm_activation with a 1-D bias: on CUDA, cuBLASLt's RELU_BIAS epilogue (no ReLU pass)."""
    x, w, zero = _relu_inputs(b)
    return lambda: torch._addmm_activation(zero, x, w.t())


DELTA_HEADS = 16   # Qwen3.5-0.8B's value heads


def _delta_gate_inputs(b: Buffers):
    """a, b: column views of a wider projection output; A_log, dt_bias in the model dtype."""
    T, HV = b.x.shape[0], DELTA_HEADS
    wide = torch.randn(T, 2 * HV + 8, device=b.x.device).to(b.x.dtype)
    A_log, dt_bias = (torch.randn(HV, device=b.x.device).to(b.x.dtype) for _ in range(2))
    return wide[:, -HV:], wide[:, -2 * HV:-HV], A_log, dt_bias


def _unfused_delta_gates(b: Buffers):
    from triton_kernels import pointwise
    a, bb, A_log, dt_bias = _delta_gate_inputs(b)
    return lambda: (pointwise.sigmoid(bb), -A_log.float().exp() * pointwise.softplus(a.float() + dt_bias))


FUSED = [
    fused("fused q scale + rotary of q, k in place (rotate_qk_)", "rotary", "triton_kernels.rotary:rotate_qk_", _rotate,
          lambda b: 4 * b.nbytes(b.q)),
    fused("fused residual add + LayerNorm (add_layer_norm)", "norm", "triton_kernels.layer_norm:add_layer_norm",
          lambda fn, b: lambda: fn(b.x, b.y, b.layer.mlp_norm.weight, b.layer.mlp_norm.bias, b.layer.mlp_norm.eps),
          lambda b: 4 * b.nbytes(b.x)),
    fused("attention from the QKV output (varlen_attention, no KV write)", "attention",
          "triton_kernels.paged_attention:varlen_attention",
          lambda fn, b: lambda: fn(b.q_rot, b.k_rot, b.v, b.ctx.cu_seqlens, b.ctx.kv_lens, causal=False, scale=1.0,
                                   **b.ctx.attention_launch),
          lambda b: 4 * b.nbytes(b.q), _attention_flops),
    Row("F.linear fc1 + pointwise.gelu (unfused)", "GEMM", _unfused_fc1_gelu, _fc1_bytes, _fc1_flops),
    fused("linear_gelu fc1 (launch table)", "GEMM", "triton_kernels.linear_gelu:linear_gelu", _linear_gelu(),
          _fc1_bytes, _fc1_flops),
    fused("linear_gelu fc1, 128x128x64 w8 s4", "GEMM", "triton_kernels.linear_gelu:linear_gelu",
          _linear_gelu(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4), _fc1_bytes, _fc1_flops),
    fused("linear_gelu fc1, 128x256x64 w8 s3 (spills 72 B)", "GEMM", "triton_kernels.linear_gelu:linear_gelu",
          _linear_gelu(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3), _fc1_bytes, _fc1_flops),
    fused("linear_gelu fc1, 64x128x64 w4 s4", "GEMM", "triton_kernels.linear_gelu:linear_gelu",
          _linear_gelu(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4), _fc1_bytes, _fc1_flops),
    # The RMS-norm decoders' kernels (docs/kernels/rms_norm.md), at this step's T and d (Qwen3.5's gated norm's
    # heads of 128 over d channels), each beside the unfused ops it replaces.
    Row("residual add + RMSNorm, zero-centred (unfused, as Qwen3_5Layer)", "norm", _unfused_add_rms,
        lambda b: 10 * b.nbytes(b.x)),
    fused("fused residual add + RMSNorm, zero-centred (add_rms_norm)", "norm", "triton_kernels.rms_norm:add_rms_norm",
          _add_rms(True), lambda b: 4 * b.nbytes(b.x)),
    fused("fused residual add + RMSNorm, Llama order (add_rms_norm)", "norm", "triton_kernels.rms_norm:add_rms_norm",
          _add_rms(False), lambda b: 4 * b.nbytes(b.x)),
    Row("GatedRMSNorm, heads of 128 (unfused)", "norm", _unfused_gated, lambda b: 3 * b.nbytes(b.x)),
    fused("fused gated RMSNorm, heads of 128 (gated_rms_norm)", "norm", "triton_kernels.rms_norm:gated_rms_norm",
          _gated, lambda b: 3 * b.nbytes(b.x)),
    Row("silu(gate) * up on fc1's output (unfused, as GatedMLP)", "activation", _unfused_silu_mul,
        lambda b: 1.5 * b.nbytes(b.h)),
    fused("fused silu(gate) * up on fc1's output (silu_mul)", "activation", "triton_kernels.rms_norm:silu_mul",
          lambda fn, b: lambda: fn(b.h), lambda b: 1.5 * b.nbytes(b.h)),
    Row("gelu_new(gate) * up on fc1's output (unfused, as T5FeedForward)", "activation", _unfused_gelu_tanh_mul,
        lambda b: 2 * b.nbytes(b.h)),   # the gelu reads and writes half of h, mul_ reads two halves and writes one
    fused("fused gelu_new(gate) * up on fc1's output (gelu_tanh_mul)", "activation",
          "triton_kernels.rms_norm:gelu_tanh_mul", lambda fn, b: lambda: fn(b.h), lambda b: 1.5 * b.nbytes(b.h)),
    Row("q RMSNorm (zero-centred) + rotary, heads of this shape (unfused, as GatedAttention)", "rotary",
        _unfused_norm_rotate, lambda b: 2 * b.nbytes(b.q)),
    fused("fused q RMSNorm + rotary in place (norm_rotate_)", "rotary", "triton_kernels.rotary:norm_rotate_",
          _norm_rotate, lambda b: 2 * b.nbytes(b.q)),
    fused("fused q and k RMSNorm + rotary in place, one launch (norm_rotate_qk_)", "rotary",
          "triton_kernels.rotary:norm_rotate_qk_", _norm_rotate_qk, lambda b: 2 * (b.nbytes(b.q) + b.nbytes(b.k))),
    # T5 encoders (docs/kernels/encoder_layer.md, "T5 encoders"): the relative-position bias read from the
    # projection beside the KV write + paged walk it replaced; the ReLU pass left in ProtT5's feed-forward beside
    # cuBLASLt's ReLU epilogue (whether the epilogue is worth taking: a GPU decides).
    Row("T5 bias: write_kv_cache + paged attention (unfused, as the T5 layer was)", "attention", _paged_t5,
        lambda b: 8 * b.nbytes(b.q), _attention_flops),
    fused("T5 bias: attention from the QKV output (varlen_attention, rel_bias_table)", "attention",
          "triton_kernels.paged_attention:varlen_attention",
          lambda fn, b: (lambda bias: lambda: fn(b.q_rot, b.k_rot, b.v, b.ctx.cu_seqlens, b.ctx.kv_lens, causal=False,
                                                 scale=1.0, **bias))(_t5_bias(b)),
          lambda b: 4 * b.nbytes(b.q), _attention_flops),
    Row("F.linear fc1 without bias + relu_ (unfused, as ProtT5's wi)", "GEMM", _unfused_relu, _fc1_bytes, _fc1_flops),
    Row("torch._addmm_activation fc1, zero bias (cuBLASLt ReLU epilogue)", "GEMM", _relu_epilogue, _fc1_bytes,
        _fc1_flops),
    # Qwen3.5's gates (docs/kernels/gates.md), beside the unfused ops they replace.
    Row("o * sigmoid(gate), the gate strided (unfused, as GatedAttention)", "activation", _unfused_sigmoid_gate,
        lambda b: 7 * b.nbytes(b.q)),   # the gate copied (2), its sigmoid (2), the product (3)
    fused("fused o * sigmoid(gate) (sigmoid_gate)", "activation", "triton_kernels.gates:sigmoid_gate",
          lambda fn, b: (lambda o, gate: lambda: fn(o, gate))(*_gate_inputs(b)), lambda b: 3 * b.nbytes(b.q)),
    # unfused: a.float() (2 + 4 bytes an element), + dt_bias (4 + 4), softplus (4 + 4), the product (4 + 4),
    # sigmoid(b) (2 + 2); fused: read a and b, write g and beta
    Row("delta-rule gates g, beta, 16 heads (unfused, as GatedDeltaNet)", "delta rule", _unfused_delta_gates,
        lambda b: b.x.shape[0] * DELTA_HEADS * 34),
    fused("fused delta-rule gates, 16 heads (delta_rule_gates)", "delta rule", "triton_kernels.gates:delta_rule_gates",
          lambda fn, b: (lambda *args: lambda: fn(*args))(*_delta_gate_inputs(b)),
          lambda b: b.x.shape[0] * DELTA_HEADS * (2 + 2 + 4 + 2)),
]


ROW_MARGIN_S = 8   # seconds a row may need on a GPU at most: a Triton compile and do_bench's ~0.2 s


def buffers(setting: Setting) -> Buffers:
    from pipeline.engine.sequence import Sequence
    tokenizer = esm_tokenizer(setting.scratch / "esm_tokenizer")
    engine = native_engine(setting, tokenizer)
    engine.runner.allocate()
    scheduler = engine._scheduler()
    for i, seq in enumerate(tokenizer(step_texts(setting))["input_ids"]):
        scheduler.add(Sequence(i, seq))
    ctx = engine.runner.prepare(scheduler.schedule(), scheduler.blocks)
    layer, rotary = engine.model.layers[0], engine.model.rotary
    T, d, dev, dt = ctx.num_tokens, layer.qkv.in_features, setting.device, setting.dtype
    rand = lambda *shape: torch.randn(*shape, device=dev).to(dt)   # noqa: E731
    with torch.inference_mode():
        x = rand(T, d)
        qkv = layer.qkv(layer.attn_norm(x))
        q, k, v = qkv.view(T, 3, layer.num_heads, layer.head_dim).unbind(1)
        cos, sin = rotary.cos_sin(ctx.positions, dt)
        q_rot, k_rot = rotary.apply(q * layer.head_dim ** -0.5, cos, sin), rotary.apply(k, cos, sin)
    return Buffers(layer, rotary, ctx, x, rand(T, d), qkv, q, k, v, q_rot, k_rot, cos, sin,
                   rand(T, layer.fc1.out_features), layer.head_dim ** -0.5, setting.gemm_rows)


def run(setting: Setting, report: Report) -> None:
    b = buffers(setting)
    report.line(f"layer 0 of the ESM-2 {b.x.shape[1]}-wide shape; {b.T:,} tokens in {b.ctx.num_seqs} sequences (the "
                f"engine's prepared step); GEMMs on {b.gemm_rows:,} rows; attention launch "
                f"{b.ctx.attention_launch or 'torch path'}")
    t = report.table("op", "family", "ms (median)", "GB/s at min bytes", "TFLOP/s")
    rows = ROWS + [r for r in FUSED if r is not None]
    for i, row in enumerate(rows):
        # A row may compile a kernel: near the step's limit the rest are left out, said so, and the headline below
        # still prints (killed by the limit, the step would lose it and the summary would show nothing of it).
        if setting.seconds_left() < ROW_MARGIN_S:
            report.line(f"{len(rows) - i} rows left out, from '{row.name}' on: {setting.seconds_left():.0f} s left "
                        "of the step's limit")
            break
        if row.make is None:
            report.line(f"- {row.name}: skipped")
            continue
        try:
            with torch.inference_mode():
                fn = row.make(b)
                ms = bench_ms(fn, setting)
        except Exception as e:  # noqa: BLE001 - one op failing is a row's result, not the step's end
            t.row(row.name, row.family, f"failed: {type(e).__name__}: {str(e)[:120]}", "", "")
            continue
        gbps, tflops = row.nbytes(b) / ms / 1e6, row.flops(b) / ms / 1e9
        name = row.name + (f": {fn.label}" if hasattr(fn, "label") else "")
        t.row(name, row.family, ms, gbps if gbps else "", tflops if tflops else "")
        report.keep(row.name, {"ms": ms, "GBps": gbps, "TFLOPs": tflops})
    numbers = load(report.out).get(report.step, {})
    gemm = [numbers[r.name]["TFLOPs"] for r in ROWS if r.family == "GEMM" and r.name in numbers]
    paged, flash = numbers.get(ROWS[-2].name, {}).get("ms"), numbers.get(ROWS[-1].name, {}).get("ms")
    rotary = numbers.get(ROWS[7].name, {}).get("ms")
    if gemm:
        report.headline(f"cuBLAS at the step's shapes: {min(gemm):,.0f}-{max(gemm):,.0f} TFLOP/s; q scale + rotary "
                        f"{rotary if rotary is None else f'{rotary:.3f}'} ms per layer; paged attention "
                        + (f"{paged:.3f} ms vs SDPA {flash:.3f} ms ({flash / paged:.2f}x)" if paged and flash else "n/a"))
