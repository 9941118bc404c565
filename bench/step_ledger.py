"""Step ledger: every GPU kernel of one ~32k-token engine step, counted on the meta device, no GPU needed.

    python bench/step_ledger.py esm2-650m            # or esm2-3b, prott5-xl, ankh-large, qwen35-0.8b
    python bench/step_ledger.py esm2-650m --tokens 16384 --json ledger.json
    python bench/step_ledger.py qwen35-0.8b --delta-design split   # the delta rule's split design

The real model class of each shape (pipeline/models/esm.py, t5.py, qwen3_5.py; published config values) is
built on the meta device in bfloat16 and run through the native engine's own step (NativeEngine.forward:
scheduler, ModelRunner.prepare, ModelRunner.run, the output copy) on one step of make_fasta-length sequences
(tools/make_fasta.py lengths, seed 1, in file order until the token budget is full). Inside
`triton_kernels._launch.dry_run(H100)` the ops take their GPU (Triton) path and record their launches instead
of running; a TorchDispatchMode records every aten op that would launch a kernel (views, allocations and
host-only ops do not) with the bytes of its tensor arguments (read) and results (written).

Bytes are a minimum-traffic model: each argument read once, each result written once (a GEMM's weights
included). Triton launches are counted by a bytes model per project kernel (KERNEL_BYTES: from the launch's
arguments and the step's lengths; attention reads each sequence's K and V once) and, for kernels it does not
know, by their tensor arguments other than the caches ("estimated"). Families (FAMILIES) come from where an op
is called: rotary.py, attention.py and the attention kernels, norms, the MLP, the delta rule; GEMMs by name;
residual adds in a layer's forward; copies; other. "d" is the hidden size in bytes: "40 d per token-layer" is
40 x hidden bytes moved per token and layer.

Predicted step time (printed, and in `ledger()`'s dict): non-GEMM bytes / 3.0e12 B/s + GEMM FLOPs / 6.5e14
FLOP/s + attention FLOPs / 3.0e14 FLOP/s: an H100's sustained copy bandwidth, cuBLAS bf16 and flash-attention
rates, with no overlap and no launch gaps. Delta-rule kernels enter by their bytes only.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from triton_kernels._launch import H100, Launch, dry_run  # noqa: E402

HBM_BYTES_PER_S = 3.0e12         # an H100's device-to-device copy, read + write (docs/.library KINDS: ~3.0 TB/s)
GEMM_FLOPS_PER_S = 6.5e14        # cuBLAS bf16 at large M (H100 SXM: 989 TFLOP/s peak)
ATTENTION_FLOPS_PER_S = 3.0e14   # flash-style attention prefill (our paged kernel measured 263-293 TFLOP/s)
FAMILIES = ("GEMM", "attention", "rotary", "norm", "activation", "residual", "delta rule", "copies", "other")
GEMM_OPS = {"linear", "addmm", "mm", "bmm", "matmul", "baddbmm", "addmv", "mv"}
ACTIVATION_OPS = {"gelu", "relu", "relu_", "silu", "silu_", "sigmoid", "softplus", "tanh", "gelu_", "sigmoid_"}
COPY_OPS = {"_to_copy", "to", "copy_", "clone", "contiguous", "cat", "index_copy_", "index_copy", "index",
            "index_select", "index_put_", "gather", "reshape", "stack", "repeat", "constant_pad_nd", "pad"}
SCATTERS = {"copy_", "index_copy_", "index_put_", "index_add_"}
GATHERS = {"embedding", "index", "index_select", "gather"}
FILLS = {"fill_", "zero_", "zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "new_zeros", "new_full"}
NO_KERNEL = {"empty", "detach_", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
             "_local_scalar_dense", "set_", "resize_", "is_nonzero", "equal"}
# Where an op is called from (innermost frame first) -> its family. Paths relative to the checkout.
CALL_SITES = (("pipeline/models/layers/rotary.py", "rotary"),
              ("pipeline/models/layers/attention.py", "attention"),
              ("triton_kernels/paged_attention/", "attention"),
              ("pipeline/models/layers/norms.py", "norm"),
              ("torch/nn/modules/normalization.py", "norm"),
              ("pipeline/models/layers/mlp.py", "activation"),
              ("pipeline/models/layers/gated_deltanet.py", "delta rule"),
              ("triton_kernels/gated_delta_rule/", "delta rule"),
              ("triton_kernels/causal_conv/", "delta rule"))
CALL_FUNCTIONS = (("T5FeedForward.forward", "activation"),)
# Kernel names the ledger has no bytes model for (new fused kernels) take a family from words in their name.
NAME_WORDS = (("rotary", "rotary"), ("rope", "rotary"), ("norm", "norm"), ("attention", "attention"),
              ("attn", "attention"), ("kv", "attention"), ("gelu", "activation"), ("silu", "activation"),
              ("delta", "delta rule"), ("conv", "delta rule"), ("chunk", "delta rule"))


# ---- the four shapes --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    family: str            # "esm", "t5", "qwen3_5"
    config: dict
    specials: int          # tokens a sequence gets besides its residues
    max_tokens: int | None  # the model's own limit per sequence (longer ones are cut, as --on-long truncate)


# Ankh-large's encoder (ElnaggarLab/ankh-large's config.json; tests/families/published_configs.py ankh_large): 48
# layers of 1,536, 16 heads of 64, a gated-gelu feed-forward of 3,840 (gelu_new), 64 position buckets.
ANKH_LARGE = dict(vocab_size=144, d_model=1536, d_kv=64, d_ff=3840, num_heads=16, num_layers=48,
                  relative_attention_num_buckets=64, relative_attention_max_distance=128,
                  feed_forward_proj="gated-gelu", dense_act_fn="gelu_new", is_gated_act=True, layer_norm_epsilon=1e-6,
                  is_encoder_decoder=True, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)


def shapes() -> dict[str, Shape]:
    """Published config values of each shape (bench_engine.py / bench_t5.py hold the ones the GPU benches use)."""
    from bench_engine import ESM2_650M, ESM2_COMMON, QWEN35_08B
    from bench_t5 import PROTT5_XL
    esm2_3b = dict(ESM2_COMMON, hidden_size=2560, intermediate_size=10240, num_hidden_layers=36, num_attention_heads=40)
    return {"esm2-650m": Shape("esm", ESM2_650M, 2, 1024),
            "esm2-3b": Shape("esm", esm2_3b, 2, 1024),
            "prott5-xl": Shape("t5", dict(PROTT5_XL, num_layers=24), 1, None),
            "ankh-large": Shape("t5", ANKH_LARGE, 1, None),
            "qwen35-0.8b": Shape("qwen3_5", dict(QWEN35_08B, max_position_embeddings=65536, pad_token_id=0,
                                                 bos_token_id=1, eos_token_id=2), 0, None)}


def build_on_meta(shape: Shape, layers: int | None = None):
    """The project's model class for `shape`, on the meta device in bfloat16, as its from_checkpoint leaves
    it (ESM's rotary in float32 math with the default frequencies, the decoder's rotary on the device)."""
    meta = torch.device("meta")
    cfg = dict(shape.config)
    if shape.family == "esm":
        from transformers import EsmConfig
        from pipeline.models.esm import EsmModel
        from pipeline.models.layers.rotary import Rotary
        config = EsmConfig(**dict(cfg, num_hidden_layers=layers or cfg["num_hidden_layers"]))
        with meta:
            model = EsmModel(config).to(torch.bfloat16)
        dim = config.hidden_size // config.num_attention_heads
        model.rotary = Rotary(1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim)), float32_math=True).to(meta)
    elif shape.family == "t5":
        from transformers import T5Config
        from pipeline.models.t5 import T5Encoder
        config = T5Config(**dict(cfg, num_layers=layers or cfg["num_layers"]))
        with meta:
            model = T5Encoder(config).to(torch.bfloat16)
    else:
        from transformers import Qwen3_5TextConfig
        from pipeline.models.qwen3_5 import Qwen3_5Model
        config = Qwen3_5TextConfig(**dict(cfg, num_hidden_layers=layers or cfg["num_hidden_layers"]))
        with meta:
            model = Qwen3_5Model(config).to(torch.bfloat16)
        model.rotary.to(meta)
    return model.eval()


def step_lengths(tokens: int, shape: Shape, seed: int = 1) -> np.ndarray:
    """Token counts of make_fasta.py's sequences (seed 1), in file order, as many as fill `tokens`."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("make_fasta", REPO / "tools" / "make_fasta.py")
    make_fasta = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_fasta)
    raw = make_fasta.lengths(np.random.default_rng(seed), 4096, 20, 35000) + shape.specials
    if shape.max_tokens:
        raw = np.minimum(raw, shape.max_tokens)
    kept = raw[np.cumsum(raw) <= tokens]
    return kept if len(kept) else raw[:1]


# ---- bytes models of the project's Triton kernels ---------------------------------------------------------

def _nb(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


@dataclass(frozen=True)
class StepLengths:
    """What a kernel's bytes depend on beyond its arguments (the step's lengths live on the host)."""
    q_lens: np.ndarray
    kv_lens: np.ndarray


def _write_kv_cache(L: Launch, step: StepLengths) -> tuple[int, int]:
    k, v, k_cache, v_cache, slots = L.args[:5]
    return _nb(k) + _nb(v) + _nb(slots), (k.numel() * k_cache.element_size() + v.numel() * v_cache.element_size())


def _paged_attention_fwd(L: Launch, step: StepLengths) -> tuple[int, int]:
    q, k_cache, v_cache, out, part_o, part_ml, tables, cu, kv_lens = L.args[:9]
    c = L.constexprs
    kv = int(step.kv_lens.sum()) * c["NUM_KV_HEADS"] * c["HEAD_DIM"] * (k_cache.element_size() + v_cache.element_size())
    read = _nb(q) + kv + _nb(tables) + _nb(cu) + _nb(kv_lens) + (_nb(L.args[9]) if c["HAS_BIAS"] else 0)
    written = _nb(out) if c["NUM_SPLITS"] == 1 else _nb(part_o) + _nb(part_ml)
    return read, written


def _combine_splits(L: Launch, step: StepLengths) -> tuple[int, int]:
    part_o, part_ml, out = L.args[:3]
    return _nb(part_o) + _nb(part_ml), _nb(out)


def _chunk_prep_kernel(L: Launch, step: StepLengths) -> tuple[int, int]:
    q, k, v, g, beta, w, u, p, gamma, q_scale, k_scale, bounds = L.args[:12]
    return (sum(map(_nb, (q, k, v, g, beta, bounds))), sum(map(_nb, (w, u, p, gamma, q_scale, k_scale))))


def _chunk_walk_kernel(L: Launch, step: StepLengths) -> tuple[int, int]:
    q, k, w, u, p, gamma, q_scale, k_scale, o, h0, ht, ranges, order = L.args[:13]
    c = L.constexprs
    read = _nb(k) + _nb(w) + _nb(gamma) + _nb(k_scale) + _nb(ranges) + _nb(order)
    read += (_nb(u) if c.get("USE_U", True) else 0) + (_nb(h0) if c["USE_H0"] else 0)
    read += (_nb(q) + _nb(p) + _nb(q_scale)) if c.get("WRITE_O", True) else 0
    written = (_nb(o) if c.get("WRITE_O", True) else 0) + (_nb(ht) if c["STORE_HT"] else 0)
    return read, written


def _split_solve_kernel(L: Launch, step: StepLengths) -> tuple[int, int]:
    k, g, beta, t, gamma, k_scale, w_scale, bounds = L.args[:8]
    return sum(map(_nb, (k, g, beta, bounds))), sum(map(_nb, (t, gamma, k_scale, w_scale)))


def _split_wu_kernel(L: Launch, step: StepLengths) -> tuple[int, int]:
    k, v, beta, t, w_scale, w, u, bounds = L.args[:8]
    return sum(map(_nb, (k, v, beta, t, w_scale, bounds))), _nb(w) + _nb(u)


def _split_state_kernel(L: Launch, step: StepLengths) -> tuple[int, int]:
    k, w, u, gamma, k_scale, states, vn, h0, ht, ranges, order, first = L.args[:12]
    c = L.constexprs
    read = sum(map(_nb, (k, w, gamma, k_scale, ranges, order, first)))
    read += (_nb(u) if c.get("USE_U", True) else 0) + (_nb(h0) if c["USE_H0"] else 0)
    written = (_nb(states) + _nb(vn) if c.get("STORE_CHUNKS", True) else 0) + (_nb(ht) if c["STORE_HT"] else 0)
    return read, written


def _split_output_kernel(L: Launch, step: StepLengths) -> tuple[int, int]:
    q, k, gamma, states, vn, o, bounds = L.args[:7]
    return sum(map(_nb, (q, k, gamma, states, vn, bounds))), _nb(o)


def _causal_conv_kernel(L: Launch, step: StepLengths) -> tuple[int, int]:
    x, w, out = L.args[:3]
    return x.numel() * x.element_size() + _nb(w), _nb(out)   # x may be a column slice: its own elements only


def _conv_window_kernel(L: Launch, step: StepLengths) -> tuple[int, int]:
    x, state = L.args[:2]
    width, channels = L.constexprs["WIDTH"], L.args[5]
    window = len(step.q_lens) * width * channels * state.element_size()
    return window, window


def _rotate_qk_kernel(L: Launch, step: StepLengths) -> tuple[int, int]:
    qkv, cos, sin, rows = L.args[:4]
    c = L.constexprs
    # Each (token, head) row's rotated halves are read and written once; a query head's unrotated rest too when
    # scaled. cos and sin: the first half of each token's table, once (the heads of a token share it in cache).
    touched = rows * 2 * c["HALF"] * qkv.element_size()
    if c["SCALE_Q"] and c["REST"]:
        touched += (rows // c["NUM_HEADS"]) * c["NUM_Q_HEADS"] * c["REST"] * qkv.element_size()
    tables = (rows // c["NUM_HEADS"]) * c["HALF"] * (cos.element_size() + sin.element_size())
    return touched + tables, touched


def _norm_rotate_kernel(L: Launch, step: StepLengths) -> tuple[int, int]:
    x, cos, sin, w, rows = L.args[:5]
    w2, rows2 = L.args[12], L.args[13]   # the second tensor's (norm_rotate_qk_: the keys), 0 rows without one
    c = L.constexprs
    # Each (token, head) row of the views read and written once: its rotary halves, and with a norm the rest too
    # (without one the rest is not touched). cos and sin: the first half of each token's table, once per tensor
    # (its programs and the other's are apart); the weights.
    touched = (rows + rows2) * (2 * c["HALF"] + (c["REST"] if c["HAS_WEIGHT"] else 0)) * x.element_size()
    tensors = 2 if rows2 else 1
    tables = tensors * x.shape[0] * c["HALF"] * (cos.element_size() + sin.element_size())
    weights = (_nb(w) + (_nb(w2) if rows2 else 0)) if c["HAS_WEIGHT"] else 0
    return touched + tables + weights, touched


def _add_layer_norm_kernel(L: Launch, step: StepLengths) -> tuple[int, int]:
    x, y, w, b, s, out = L.args[:6]
    c = L.constexprs
    read = _nb(x) + (_nb(y) if c["HAS_Y"] else 0) + _nb(w) + (_nb(b) if c["HAS_BIAS"] else 0)
    return read, _nb(out) + (_nb(s) if c["HAS_Y"] else 0)


def _add_rms_norm_kernel(L: Launch, step: StepLengths) -> tuple[int, int]:
    x, y, w, s, out = L.args[:5]
    has_y = L.constexprs["HAS_Y"]
    return _nb(x) + (_nb(y) if has_y else 0) + _nb(w), _nb(out) + (_nb(s) if has_y else 0)


def _gated_rms_norm_kernel(L: Launch, step: StepLengths) -> tuple[int, int]:
    o, z, w, out = L.args[:4]   # o and z may be views of wider tensors: their own elements only
    return _nb(o) + _nb(z) + _nb(w), _nb(out)


def _act_mul_kernel(L: Launch, step: StepLengths) -> tuple[int, int]:
    g, u, out = L.args[:3]   # silu_mul and gelu_tanh_mul: gate and up (views of one product) read, the output written
    return _nb(g) + _nb(u), _nb(out)


def _sigmoid_gate_kernel(L: Launch, step: StepLengths) -> tuple[int, int]:
    o, gate, out = L.args[:3]   # o and the gate may be views of wider tensors: their own elements only
    return _nb(o) + _nb(gate), _nb(out)


def _delta_rule_gates_kernel(L: Launch, step: StepLengths) -> tuple[int, int]:
    a, b, A_log, dt_bias, g, beta = L.args[:6]   # a and b: column views of the input projection
    return _nb(a) + _nb(b) + _nb(A_log) + _nb(dt_bias), _nb(g) + _nb(beta)


def _linear_gelu_kernel(L: Launch, step: StepLengths) -> tuple[int, int]:
    x, w, b, out = L.args[:4]
    return _nb(x) + _nb(w) + (_nb(b) if L.constexprs["HAS_BIAS"] else 0), _nb(out)


KERNEL_BYTES = {f.__name__: f for f in (_write_kv_cache, _paged_attention_fwd, _combine_splits, _chunk_prep_kernel,
                                        _chunk_walk_kernel, _causal_conv_kernel, _conv_window_kernel,
                                        _rotate_qk_kernel, _add_layer_norm_kernel, _linear_gelu_kernel,
                                        _add_rms_norm_kernel, _gated_rms_norm_kernel, _act_mul_kernel,
                                        _norm_rotate_kernel, _sigmoid_gate_kernel, _delta_rule_gates_kernel,
                                        _split_solve_kernel, _split_wu_kernel, _split_state_kernel,
                                        _split_output_kernel)}
KERNEL_FAMILY = {"_write_kv_cache": "attention", "_paged_attention_fwd": "attention", "_combine_splits": "attention",
                 "_chunk_prep_kernel": "delta rule", "_chunk_walk_kernel": "delta rule",
                 "_causal_conv_kernel": "delta rule", "_conv_window_kernel": "delta rule",
                 "_recurrent_kernel": "delta rule", "_rotate_qk_kernel": "rotary", "_add_layer_norm_kernel": "norm",
                 "_linear_gelu_kernel": "GEMM", "_add_rms_norm_kernel": "norm", "_gated_rms_norm_kernel": "norm",
                 "_act_mul_kernel": "activation", "_norm_rotate_kernel": "rotary",
                 "_sigmoid_gate_kernel": "activation", "_delta_rule_gates_kernel": "delta rule",
                 "_split_solve_kernel": "delta rule", "_split_wu_kernel": "delta rule",
                 "_split_state_kernel": "delta rule", "_split_output_kernel": "delta rule"}


def kernel_flops(launch: Launch) -> float:
    """Matrix-product FLOPs of a Triton launch that is a product (the linear + GELU), else 0."""
    if kernel_name(launch) == "_linear_gelu_kernel":
        x, w = launch.args[:2]
        return 2.0 * x.shape[0] * w.shape[0] * w.shape[1]
    return 0.0


def kernel_name(launch: Launch) -> str:
    fn = getattr(launch.kernel, "fn", launch.kernel)
    return getattr(fn, "__name__", str(fn))


def launch_bytes(launch: Launch, step: StepLengths, caches: set[int]) -> tuple[int, int, bool]:
    """(read, written, exact) bytes of one launch: the kernel's model, else its non-cache tensor arguments
    counted as read (estimated: a cache argument is the whole cache, not what the kernel touches)."""
    model = KERNEL_BYTES.get(kernel_name(launch))
    if model is not None:
        return (*model(launch, step), True)
    tensors = [a for a in launch.args if isinstance(a, torch.Tensor) and a.untyped_storage()._cdata not in caches]
    return sum(map(_nb, tensors)), 0, False


def kernel_family(name: str) -> str:
    if name in KERNEL_FAMILY:
        return KERNEL_FAMILY[name]
    lower = name.lower()
    return next((family for word, family in NAME_WORDS if word in lower), "other")


# ---- recording aten ops -----------------------------------------------------------------------------------

@dataclass
class Op:
    name: str
    family: str
    in_model: bool   # inside ModelRunner.run (else the engine's own work around the model)
    read: int
    written: int
    flops: float = 0.0


def _flat(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat(y)
    else:
        yield x


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _gemm_flops(name: str, args, out) -> float:
    """2 x M x N x K of a product, from its output's elements and the reduced dimension."""
    k = (args[1] if name in ("addmm", "baddbmm", "addmv") else args[0]).shape[-1]   # the bias comes first there
    return 2.0 * out.numel() * k


class _Recorder(TorchDispatchMode):
    """Every aten op that launches a kernel on the model's device, with its bytes and family."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.ops = device, []
        self.host_values: dict[int, torch.Tensor] = {}   # storage of a tensor copied from the host -> its values
        self.host_reads: list[str] = []                  # where device values were read back (a sync on a GPU)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in ("to", "_to_copy") and args[0].device == self.device and _to_host(args, kwargs):
            return self._read_back(args[0], kwargs.get("dtype"))
        out = func(*args, **kwargs)
        if name in ("to", "_to_copy") and args[0].device.type == "cpu" and isinstance(out, torch.Tensor) \
                and out.device == self.device:
            # The bytes as sent (a staging buffer of several arrays, read back later through typed views of it).
            self.host_values[_storage(out)] = args[0].contiguous().reshape(-1).view(torch.uint8).clone()
        given = list(args) + [v for k, v in kwargs.items() if k != "out"]
        inputs = [a for a in _flat(given) if isinstance(a, torch.Tensor)]
        outputs = [o for o in _flat(out) if isinstance(o, torch.Tensor)]
        if name in NO_KERNEL or not any(t.device == self.device for t in inputs + outputs):
            return out   # an allocation, a host-side op
        in_storages = {_storage(t) for t in inputs}
        aliases = [r.alias_info for r in func._schema.returns]
        if aliases and all(a is not None and not a.is_write for a in aliases) and \
                all(_storage(o) in in_storages for o in outputs):
            return out   # a view (or a `to`/`contiguous` that had nothing to do)
        self.ops.append(self._op(name, args, kwargs, inputs, outputs, out))
        return out

    def _read_back(self, t: torch.Tensor, dtype) -> torch.Tensor:
        """A meta tensor's values, where it is a whole tensor the step copied from the host: what code that
        reads device values on the host (a sync on a GPU) needs to go on."""
        raw = self.host_values.get(_storage(t))
        if raw is None or raw.numel() % t.element_size():
            raise RuntimeError("the step reads back a device tensor whose values the meta device does not have")
        values = raw.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
        frame = next(f for f in _frames(sys._getframe(2)) if "/torch/" not in f.f_code.co_filename)
        path = Path(frame.f_code.co_filename)
        where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        self.host_reads.append(f"{where}:{frame.f_lineno}")
        return values.to(dtype or values.dtype).clone()

    def _op(self, name, args, kwargs, inputs, outputs, out) -> Op:
        written = sum(map(_nb, outputs))
        if name in SCATTERS:   # the destination is touched only where the values land
            sources = inputs[1:]
            written = sources[-1].numel() * inputs[0].element_size()
            read = sum(map(_nb, sources)) + (written if name == "index_add_" else 0)
        elif name in GATHERS:   # rows picked from a table: the table is read where they come from
            read = sum(map(_nb, inputs[1:])) + written
        elif name in FILLS:
            read = 0
        else:
            read = sum(map(_nb, inputs))
        family, in_model = _call_site(name)
        flops = _gemm_flops(name, args, outputs[0]) if family == "GEMM" else 0.0
        return Op(name, family, in_model, read, written, flops)


def _to_host(args, kwargs) -> bool:
    device = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (torch.device, str))), None))
    return device is not None and torch.device(device).type == "cpu"


def _frames(frame):
    while frame is not None:
        yield frame
        frame = frame.f_back


def _call_site(name: str) -> tuple[str, bool]:
    """(family, inside ModelRunner.run) of the op being dispatched, from the Python frames calling it."""
    frame = sys._getframe(2)
    family = layer_forward = None
    in_model = False
    while frame is not None:
        code = frame.f_code
        path = code.co_filename.replace("\\", "/")
        if family is None:
            family = next((f for site, f in CALL_SITES if site in path), None) or \
                next((f for fn, f in CALL_FUNCTIONS if code.co_qualname == fn), None)
        if layer_forward is None and "/pipeline/models/" in path:
            layer_forward = code.co_qualname
        if code.co_qualname == "ModelRunner.run":
            in_model = True
            break
        frame = frame.f_back
    if name in GEMM_OPS:
        return "GEMM", in_model
    if family is not None:
        return family, in_model
    if name in ACTIVATION_OPS:
        return "activation", in_model
    if name in ("add", "add_") and layer_forward is not None and layer_forward.endswith("Layer.forward"):
        return "residual", in_model
    if name in COPY_OPS:
        return "copies", in_model
    return "other", in_model


# ---- the ledger ------------------------------------------------------------------------------------------

def attention_flops(model, q_lens: np.ndarray, prior: np.ndarray) -> float:
    """QK^T and PV of every attention layer: 4 x query-key pairs x query heads x head dim (causal: the pairs
    at or before each query)."""
    layers = model.attention_layers()
    if not layers:
        return 0.0
    a = layers[0]
    q, p = q_lens.astype(np.float64), prior.astype(np.float64)
    pairs = (q * p + q * (q + 1) / 2).sum() if a.causal else (q * (q + p)).sum()
    return 4.0 * pairs * a.num_heads * a.head_dim * len(layers)


def ledger(model_name: str, tokens: int = 32768, layers: int | None = None, lengths=None,
           delta_design: str = "fused") -> dict:
    """One engine step of `model_name` (a key of shapes()) on the meta device: kernels, bytes, FLOPs and the
    predicted step time. `layers` overrides the shape's layer count, `lengths` the step's token counts,
    `delta_design` the chunked delta rule's design (fused, the launch table's default, or split)."""
    from pipeline.engine.config import EngineConfig
    from pipeline.engine.native import NativeEngine
    from pipeline.models.checkpoint import EngineInfo

    table = shapes()
    if model_name not in table:
        raise SystemExit(f"unknown model {model_name!r}: one of {', '.join(table)}")
    shape = table[model_name]
    model = build_on_meta(shape, layers)
    spec, meta, dtype = model.spec, torch.device("meta"), torch.bfloat16
    lengths = np.asarray(step_lengths(tokens, shape) if lengths is None else lengths, np.int64)
    T, S, L, d = int(lengths.sum()), len(lengths), spec.num_layers, spec.hidden_size
    config = EngineConfig(max_tokens_per_step=max(tokens, T), max_seqs=max(256, S), max_model_len=int(lengths.max()),
                          kernels="triton", gdn_launch={"chunk_gated_delta_rule": {"design": delta_design}})
    info = EngineInfo("native", d, L, spec.is_causal, shape.max_tokens, spec.architecture)
    engine = NativeEngine(model, None, info, config, meta, dtype)
    engine.runner.allocate()   # the caches exist before a step runs: their allocation is not the step's work
    caches = {_storage(t) for a in model.attention_layers() for t in a.kv}
    caches |= {_storage(t) for layer in getattr(model, "delta_layers", lambda: [])() for t in layer.state}
    rng = np.random.default_rng(0)
    batch = [list(rng.integers(4, 24, int(n))) for n in lengths]   # residue ids of every family's vocabulary
    with torch.inference_mode(), dry_run(H100), _Recorder(meta):   # (the recorder serves host reads)
        # A first step of other lengths, not recorded: what is built once per process (T5's bucket table) is
        # built there, what is built per step layout (the delta rule's chunk tables) is built again below.
        engine.forward([batch[0][:17]], [L], False)
    steps_before = engine.stats.steps
    recorder = _Recorder(meta)
    with torch.inference_mode(), dry_run(H100) as launches, recorder:
        engine.forward(batch, [L], False)
    steps = engine.stats.steps - steps_before
    assert steps == 1, f"the batch ran in {steps} steps, not one"
    step = StepLengths(lengths, lengths)
    result = _summarise(model_name, model, recorder.ops, launches, step, caches, T, S, L, d)
    result["host_reads"] = dict(collections.Counter(recorder.host_reads))
    return result


def _summarise(model_name, model, ops: list[Op], launches: list[Launch], step: StepLengths, caches, T, S, L, d) -> dict:
    fam = {f: {"kernels": 0, "read": 0, "written": 0} for f in FAMILIES}
    by_op = collections.defaultdict(lambda: {"count": 0, "read": 0, "written": 0})
    gemm_flops = 0.0
    model_ops = [o for o in ops if o.in_model]
    for o in model_ops:
        f = fam[o.family]
        f["kernels"] += 1
        f["read"] += o.read
        f["written"] += o.written
        r = by_op[f"{o.family}: {o.name}"]
        r["count"] += 1
        r["read"] += o.read
        r["written"] += o.written
        gemm_flops += o.flops
    triton = collections.defaultdict(lambda: {"count": 0, "read": 0, "written": 0, "exact": True, "family": ""})
    for launch in launches:
        name = kernel_name(launch)
        read, written, exact = launch_bytes(launch, step, caches)
        r = triton[name]
        r["count"] += 1
        r["read"] += read
        r["written"] += written
        r["exact"] = r["exact"] and exact
        r["family"] = kernel_family(name)
        gemm_flops += kernel_flops(launch)
        f = fam[r["family"]]
        f["kernels"] += 1
        f["read"] += read
        f["written"] += written
    engine_ops = [o for o in ops if not o.in_model]
    token_layer = float(T) * L * d
    for f in fam.values():
        f["bytes"] = f["read"] + f["written"]
        f["d_per_token_layer"] = f["bytes"] / token_layer
        f["kernels_per_layer"] = f["kernels"] / L
    non_gemm = sum(f["bytes"] for name, f in fam.items() if name != "GEMM")
    engine_bytes = sum(o.read + o.written for o in engine_ops)
    attn_flops = attention_flops(model, step.q_lens, step.kv_lens - step.q_lens)
    seconds = {"non-GEMM bytes / 3.0e12": (non_gemm + engine_bytes) / HBM_BYTES_PER_S,
               "GEMM FLOPs / 6.5e14": gemm_flops / GEMM_FLOPS_PER_S,
               "attention FLOPs / 3.0e14": attn_flops / ATTENTION_FLOPS_PER_S}
    total = sum(seconds.values())
    return {
        "model": model_name, "tokens": T, "sequences": S, "layers": L, "hidden": d,
        "aten_kernels": len(model_ops), "triton_launches": len(launches),
        "kernels_per_layer": (len(model_ops) + len(launches)) / L,
        "aten_kernels_per_layer": len(model_ops) / L, "triton_launches_per_layer": len(launches) / L,
        "triton": {k: dict(v) for k, v in triton.items()},
        "families": fam, "ops": {k: dict(v) for k, v in by_op.items()},
        "engine_ops": {"count": len(engine_ops), "bytes": engine_bytes,
                       "names": dict(collections.Counter(o.name for o in engine_ops))},
        "non_gemm_bytes": non_gemm, "non_gemm_d_per_token_layer": non_gemm / token_layer,
        "gemm_flops": gemm_flops, "attention_flops": attn_flops,
        "predicted_ms": {k: v * 1e3 for k, v in seconds.items()}, "predicted_step_ms": total * 1e3,
        "predicted_tokens_per_s": T / total if total else 0.0,
    }


def render(r: dict) -> str:
    """The ledger as markdown tables."""
    L, gb = r["layers"], 1e9
    lines = [f"## Step ledger: {r['model']} ({r['layers']} layers x {r['hidden']}), one step of {r['tokens']:,} tokens "
             f"in {r['sequences']} sequences, bfloat16, GPU path planned for an H100 (meta device)", "",
             f"kernels per layer: **{r['kernels_per_layer']:.1f}** ({r['aten_kernels_per_layer']:.1f} aten + "
             f"{r['triton_launches_per_layer']:.1f} Triton); non-GEMM traffic: **{r['non_gemm_d_per_token_layer']:.1f} d** "
             f"per token-layer (d = {r['hidden']} bytes), {r['non_gemm_bytes'] / gb:.1f} GB per step", "",
             "| family | kernels / layer | read GB | written GB | d per token-layer |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, f in r["families"].items():
        if f["kernels"]:
            lines.append(f"| {name} | {f['kernels_per_layer']:.2f} | {f['read'] / gb:.2f} | {f['written'] / gb:.2f} | "
                         f"{f['d_per_token_layer']:.1f} |")
    lines += ["", "| aten op (family: op) | count | per layer | read GB | written GB |",
              "| --- | ---: | ---: | ---: | ---: |"]
    for name, o in sorted(r["ops"].items(), key=lambda kv: -(kv[1]["read"] + kv[1]["written"])):
        lines.append(f"| {name} | {o['count']} | {o['count'] / L:.2f} | {o['read'] / gb:.2f} | {o['written'] / gb:.2f} |")
    lines += ["", "| Triton kernel | family | launches | per layer | read GB | written GB | bytes |",
              "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for name, t in sorted(r["triton"].items(), key=lambda kv: -kv[1]["count"]):
        lines.append(f"| {name} | {t['family']} | {t['count']} | {t['count'] / L:.2f} | {t['read'] / gb:.2f} | "
                     f"{t['written'] / gb:.2f} | {'model' if t['exact'] else 'estimated (non-cache args read)'} |")
    e = r["engine_ops"]
    lines += ["", f"engine work around the model (schedule, prepare's host-to-device copies, the output copy): "
                  f"{e['count']} ops, {e['bytes'] / gb:.3f} GB ({', '.join(f'{k} x{v}' for k, v in e['names'].items())})",
              "", "device values read on the host during the step (each a sync on a GPU, unless the code caches it): "
              + (", ".join(f"{k} x{v}" for k, v in r["host_reads"].items()) or "none"),
              "", f"predicted step time (non-GEMM bytes / 3.0e12 B/s + GEMM FLOPs / 6.5e14 FLOP/s + attention FLOPs / "
                  f"3.0e14 FLOP/s, no overlap): **{r['predicted_step_ms']:.1f} ms** = "
              + " + ".join(f"{v:.1f} ms ({k})" for k, v in r["predicted_ms"].items())
              + f"; {r['gemm_flops'] / 1e12:.1f} TFLOP of GEMMs, {r['attention_flops'] / 1e12:.2f} TFLOP of attention; "
                f"{r['predicted_tokens_per_s']:,.0f} tok/s"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", metavar="MODEL", help="esm2-650m, esm2-3b, prott5-xl, ankh-large, qwen35-0.8b")
    parser.add_argument("--tokens", type=int, default=32768, help="the step's token budget (default 32768, a GPU worker's)")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (per-layer numbers hold)")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    parser.add_argument("--delta-design", choices=("fused", "split"), default="fused",
                        help="the chunked delta rule's design (docs/kernels/gated_delta_rule.md; default fused)")
    args = parser.parse_args(argv)
    try:
        import triton   # noqa: F401 - the ledger records the Triton launches (their grids come from triton)
    except ImportError as e:
        print(f"step_ledger.py records the kernels' Triton launches and needs triton ({e}): install it "
              f"(`{sys.executable} -m pip install triton`, Linux)", file=sys.stderr)
        return 2
    from pipeline.models.hf_config import quiet_transformers
    quiet_transformers()
    results = []
    for name in args.models:
        results.append(ledger(name, args.tokens, args.layers, delta_design=args.delta_design))
        print(render(results[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
