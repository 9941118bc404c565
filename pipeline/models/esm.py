"""ESM-2 (and ESM-1b): a bidirectional pre-LayerNorm encoder; every sequence runs whole in one step.

Inference semantics follow transformers' EsmModel: token dropout rescales the embeddings by
(1 - 0.15 * 0.8) / (1 - fraction of <mask> tokens in the sequence) and zeroes <mask> embeddings; queries
are scaled by head_dim^-0.5 before the rotary embedding, which is computed in float32; GELU is the
exact (erf) form; the final `emb_layer_norm_after` output is hidden state num_layers. A checkpoint of
EsmForMaskedLM also gets its masked-LM head (`logits`), as transformers' EsmLMHead computes it.

On the Triton path (a GPU) a layer's elementwise work is fused (`EsmLayer.forward_fused`): the query scale and
rotation in one in-place pass over the QKV output, attention straight from it, each residual add with the
LayerNorm after it, the first MLP product with its GELU. The CPU path keeps the unfused ops (and their bits).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from triton_kernels import pointwise
from triton_kernels.layer_norm import add_layer_norm
from triton_kernels.linear_gelu import gemm_knobs, linear_gelu
from triton_kernels.rotary import rotate_qk_

from ..errors import UserError
from .base import ModelSpec, NativeModel
from .layers.attention import PagedAttention
from .layers.linear import Linear, linear
from .layers.loader import CheckpointTensors, check_loaded, embedding, materialize
from .layers.rotary import Rotary

MASK_RATIO_TRAIN = 0.15 * 0.8   # fixed in every ESM training run; transformers hard-codes it too


def kernel_scale(head_dim: int) -> float | None:
    """The query scale head_dim^-0.5 where the attention kernel may apply it to the scores instead of a pass over
    the queries (absolute positions, ESM-1b / 1v): when it is a power of two (heads of 16, 64 or 256), scaling the
    queries or their dot products gives the same bits (only exponents change); else None (the pass stays)."""
    scale = head_dim ** -0.5
    mantissa, _ = np.frexp(scale)
    return scale if mantissa == 0.5 else None


def _gelu(x: torch.Tensor) -> torch.Tensor:
    """The erf GELU, x * 0.5 * (1 + erf(x / sqrt 2)), as one fused op (transformers spells it out)."""
    return pointwise.gelu(x)


class EsmLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = d // self.num_heads
        self.attn_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.qkv = Linear(d, 3 * d)
        self.attn_out = Linear(d, d)
        self.mlp_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.fc1 = Linear(d, config.intermediate_size)
        self.fc2 = Linear(config.intermediate_size, d)
        # q is pre-scaled (as transformers does, before the rotary), so the kernel's scale is 1.
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, 1.0, causal=False)

    def forward(self, x, cos, sin, rotary: Rotary | None, ctx,
                repeats: tuple[torch.Tensor, torch.Tensor] | None = None):
        """repeats (first layer only): (one row of each distinct input row, each row's one), from
        EsmModel.repeated_inputs: the norm, projections and rotation run on the distinct rows alone, whose
        results each repeated row takes (the same bits: every op before attention is row by row, and products
        give a row the same bits in any batch, linear.py)."""
        T, d = x.shape
        if repeats is None:
            q, k, v = self._qkv(x, cos, sin, rotary)
        else:
            first, inverse = repeats
            q, k, v = (t[inverse] for t in self._qkv(x[first], None if cos is None else cos[first],
                                                      None if sin is None else sin[first], rotary))
        x = x + self.attn_out(self.attn(q, k, v, ctx).reshape(T, d))
        return x + self.fc2(_gelu(self.fc1(self.mlp_norm(x))))

    def forward_fused(self, x, h, cos, sin, ctx, next_norm: nn.LayerNorm | None, epilogue_gelu: bool,
                      repeats: tuple[torch.Tensor, torch.Tensor] | None = None):
        """The layer with its elementwise work fused (Triton path): h = attn_norm(x) comes in, from the previous
        layer's (or the embeddings') add + norm, and (x + this layer, next_norm of that) goes out (next_norm
        None: the sum alone). Per token: one rotary pass, attention reading the projection, two add + norm
        passes, and the GELU in the first MLP product when epilogue_gelu (the launch table's choice per GPU)."""
        T, d = x.shape
        scale = kernel_scale(self.head_dim) if cos is None else None   # absolute positions: in the kernel
        if repeats is None:
            qkv = self._rotated_qkv(h, cos, sin, scale is None)
        else:
            first, inverse = repeats
            qkv = self._rotated_qkv(h[first], None if cos is None else cos[first], None if sin is None else sin[first],
                                    scale is None)
            qkv = qkv[inverse]
        a = self.attn.from_projection(qkv, ctx, scale=scale)
        x, h = add_layer_norm(x, self.attn_out(a.reshape(T, d)), self.mlp_norm.weight, self.mlp_norm.bias,
                              self.mlp_norm.eps)
        g = linear_gelu(h, self.fc1.weight, self.fc1.bias) if epilogue_gelu else _gelu(self.fc1(h))
        y = self.fc2(g)
        if next_norm is None:
            return x + y, None
        return add_layer_norm(x, y, next_norm.weight, next_norm.bias, next_norm.eps)

    def _rotated_qkv(self, h, cos, sin, scaled: bool = True) -> torch.Tensor:
        """The QKV projection of h `[n, d]` with its queries scaled (unless not `scaled`: the attention kernel
        scales them) and queries and keys rotated, in place."""
        qkv = self.qkv(h)
        scale = self.head_dim ** -0.5
        if cos is None:   # absolute positions (ESM-1b): the scale alone
            if scaled:
                qkv[:, :self.num_heads * self.head_dim].mul_(scale)
            return qkv
        return rotate_qk_(qkv, cos, sin, num_q_heads=self.num_heads, num_kv_heads=self.num_heads,
                          head_dim=self.head_dim, q_scale=scale)

    def _qkv(self, x, cos, sin, rotary: Rotary | None):
        q, k, v = self.qkv(self.attn_norm(x)).view(len(x), 3, self.num_heads, self.head_dim).unbind(1)
        q = q * self.head_dim ** -0.5
        if rotary is not None:
            q, k = rotary.apply(q, cos, sin), rotary.apply(k, cos, sin)
        return q, k, v

    def forward_rows(self, x, cos, sin, rotary: Rotary | None, ctx, rows: torch.Tensor, q_counts) -> torch.Tensor:
        """The layer's output at `rows` of the step only (q_counts[s] of them in step sequence s): keys and
        values for every token, queries, attention, projection and MLP for those rows alone."""
        T, d = x.shape
        h = self.attn_norm(x)
        w, b = self.qkv.weight, self.qkv.bias
        k, v = linear(h, w[d:], b[d:]).view(T, 2, self.num_heads, self.head_dim).unbind(1)
        q = linear(h[rows], w[:d], b[:d]).view(len(rows), self.num_heads, self.head_dim) * self.head_dim ** -0.5
        if rotary is not None:
            q, k = rotary.apply(q, cos[rows], sin[rows]), rotary.apply(k, cos, sin)
        y = x[rows] + self.attn_out(self.attn.attend_rows(q, k, v, ctx, q_counts).reshape(len(rows), d))
        return y + self.fc2(_gelu(self.fc1(self.mlp_norm(y))))

    def load(self, t, p: str) -> None:
        a = p + "attention."
        self.attn_norm.weight.copy_(t.get(a + "LayerNorm.weight"))
        self.attn_norm.bias.copy_(t.get(a + "LayerNorm.bias"))
        for part in ("weight", "bias"):
            getattr(self.qkv, part).copy_(torch.cat([t.get(f"{a}self.{n}.{part}") for n in ("query", "key", "value")]))
            getattr(self.attn_out, part).copy_(t.get(f"{a}output.dense.{part}"))
            getattr(self.mlp_norm, part).copy_(t.get(f"{p}LayerNorm.{part}"))
            getattr(self.fc1, part).copy_(t.get(f"{p}intermediate.dense.{part}"))
            getattr(self.fc2, part).copy_(t.get(f"{p}output.dense.{part}"))


class EsmLMHead(nn.Module):
    """EsmForMaskedLM's `lm_head`: dense, erf GELU, LayerNorm, then the decoder (the word embeddings unless the
    config unties them, as Nucleotide Transformer's does) plus the head's own bias."""

    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        self.dense = Linear(d, d)
        self.norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.decoder = Linear(d, config.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(_gelu(self.dense(x))))

    def load(self, t, tied_to: nn.Parameter | None) -> None:
        for part in ("weight", "bias"):
            getattr(self.dense, part).copy_(t.get(f"lm_head.dense.{part}"))
            getattr(self.norm, part).copy_(t.get(f"lm_head.layer_norm.{part}"))
        self.decoder.bias.copy_(t.get("lm_head.bias"))
        if tied_to is not None:
            self.decoder.weight = tied_to
        else:
            self.decoder.weight.copy_(t.get("lm_head.decoder.weight"))


class EsmModel(NativeModel):
    def __init__(self, config):
        super().__init__()
        if getattr(config, "is_decoder", False):
            raise UserError("ESM configured as a decoder is not supported by --engine native; use --engine hf")
        d = config.hidden_size
        self.config = config
        self.position_type = getattr(config, "position_embedding_type", "absolute")
        if self.position_type not in ("rotary", "absolute"):
            raise UserError(f"ESM position embedding '{self.position_type}' is not supported; use --engine hf")
        self.word_embeddings = embedding(config.vocab_size, d)
        self.position_embeddings = (embedding(config.max_position_embeddings, d)
                                    if self.position_type == "absolute" else None)
        self.emb_norm_before = nn.LayerNorm(d, eps=config.layer_norm_eps) if config.emb_layer_norm_before else None
        self.layers = nn.ModuleList(EsmLayer(config) for _ in range(config.num_hidden_layers))
        self.emb_norm_after = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.token_dropout = bool(config.token_dropout)
        self.mask_token_id = config.mask_token_id
        self.padding_idx = config.pad_token_id
        self.rotary: Rotary | None = None
        self.lm_head: EsmLMHead | None = None   # set by from_checkpoint when the checkpoint has one
        head_dim = d // config.num_attention_heads
        limit = None
        if self.position_type == "absolute":
            limit = config.max_position_embeddings - ((self.padding_idx + 1) if self.padding_idx is not None else 0)
        self.spec = ModelSpec(
            architecture="EsmModel", hidden_size=d, num_layers=config.num_hidden_layers,
            vocab_size=config.vocab_size, is_causal=False, num_attention_layers=config.num_hidden_layers,
            num_kv_heads=config.num_attention_heads, head_dim=head_dim, max_tokens=limit)

    computes_rows = True
    # The Triton path fuses each layer's elementwise work (forward_fused); a benchmark may turn it off to time the
    # unfused layers on the same GPU.
    fuse_elementwise = True

    def forward(self, ctx, capture=frozenset(), rows=None):
        ids = ctx.input_ids
        x = self.word_embeddings(ids)
        if self.token_dropout and self.mask_token_id is not None:
            is_mask = ids == self.mask_token_id
            x = x.masked_fill(is_mask[:, None], 0.0)
            seg = ctx.segment_ids()
            lengths = ctx.on_device("q_lens", ctx.q_lens).float()
            masked = torch.zeros(ctx.num_seqs, device=ctx.device).index_add_(0, seg, is_mask.float())
            observed = (masked / lengths)[seg][:, None]
            x = (x * (1 - MASK_RATIO_TRAIN) / (1 - observed)).to(x.dtype)
        cos = sin = None
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(ctx.positions + self.padding_idx + 1)
        else:
            cos, sin = self.rotary.cos_sin(ctx.positions, x.dtype)
        if self.emb_norm_before is not None:
            x = self.emb_norm_before(x)
        layers = list(self.layers) if rows is None else list(self.layers[:-1])
        repeats = self.repeated_inputs(ctx) if layers else None
        captured = {}
        if ctx.triton_kernels and self.fuse_elementwise:
            x, normed = self._fused_layers(x, cos, sin, ctx, layers, capture, captured, repeats, rows is None)
            if rows is None:
                return normed, captured
        else:
            for i, layer in enumerate(layers):
                if i in capture:
                    captured[i] = x
                x = layer(x, cos, sin, self.rotary, ctx, repeats if i == 0 else None)
        if rows is None:
            return self.emb_norm_after(x), captured
        last = self.layers[-1]
        if len(layers) in capture:
            captured[len(layers)] = x
        # (counted on the host by the model runner: reading `rows` back would wait for every layer queued above)
        return self.emb_norm_after(last.forward_rows(x, cos, sin, self.rotary, ctx, rows, ctx.row_counts)), captured

    def _fused_layers(self, x, cos, sin, ctx, layers, capture, captured, repeats, final: bool):
        """(residual stream after `layers`, its final norm when `final` else None), each layer fused
        (EsmLayer.forward_fused): every LayerNorm but the first runs with the residual add before it."""
        if not layers:
            return x, (self.emb_norm_after(x) if final else None)
        epilogue_gelu = gemm_knobs(ctx.device).epilogue_gelu
        first = layers[0].attn_norm
        _, h = add_layer_norm(x, None, first.weight, first.bias, first.eps)
        for i, layer in enumerate(layers):
            if i in capture:
                captured[i] = x
            nxt = layers[i + 1].attn_norm if i + 1 < len(layers) else (self.emb_norm_after if final else None)
            x, h = layer.forward_fused(x, h, cos, sin, ctx, nxt, epilogue_gelu, repeats if i == 0 else None)
        return x, h

    def repeated_inputs(self, ctx) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where rows of a step of masked copies have the same first-layer input: (the first row of each distinct
        input, each row's distinct input), or None when fewer than half the rows repeat. A row's input (and its
        rotation) is fixed by its token, its position and, with token dropout, its sequence's <mask> count and
        length. A masked LM's pseudo-log-likelihood steps hold a sequence's copies, each with one residue masked,
        whose first-layer queries, keys and values are then computed once per distinct row instead of once per
        copy. Looked for only where most of the step's sequences hold a <mask> (masked copies: pll, a variant's
        masked marginals); elsewhere rows seldom repeat and the search (a sort of the step's rows) is skipped."""
        ids, positions = ctx.host_ids, ctx.host_positions
        if ids is None or positions is None or self.mask_token_id is None or len(ids) < 2:
            return None
        seg = np.repeat(np.arange(ctx.num_seqs), ctx.q_lens)
        masked = np.bincount(seg, weights=ids == self.mask_token_id, minlength=ctx.num_seqs).astype(np.int64)
        if 2 * np.count_nonzero(masked) < ctx.num_seqs:
            return None
        columns = [ids, positions]
        if self.token_dropout:
            columns += [masked[seg], np.asarray(ctx.q_lens, np.int64)[seg]]
        first, inverse = distinct_rows(columns)
        if 2 * len(first) > len(ids):
            return None
        return ctx.on_device("esm_first_rows", first), ctx.on_device("esm_row_inputs", inverse)

    def attention_layers(self):
        return [layer.attn for layer in self.layers]

    def logits(self, hidden):
        """The masked-LM head's logits at these final hidden states (every vocabulary entry)."""
        if self.lm_head is None:
            raise UserError("this ESM checkpoint has no masked-LM head (no lm_head.* weights: it was saved as "
                            "EsmModel); scoring needs the EsmForMaskedLM checkpoint")
        return self.lm_head(hidden)

    @classmethod
    def from_checkpoint(cls, path, config, device, dtype):
        root = CheckpointTensors(path)
        with torch.device("meta"):
            model = cls(config)
            model.lm_head = EsmLMHead(config) if root.has("lm_head.dense.weight") else None
        materialize(model, device, dtype)
        t = root.with_prefix(["esm.", ""], "embeddings.word_embeddings.weight")
        with torch.no_grad():
            model.word_embeddings.weight.copy_(t.get("embeddings.word_embeddings.weight"))
            if model.position_embeddings is not None:
                model.position_embeddings.weight.copy_(t.get("embeddings.position_embeddings.weight"))
            if model.emb_norm_before is not None:
                model.emb_norm_before.weight.copy_(t.get("embeddings.layer_norm.weight"))
                model.emb_norm_before.bias.copy_(t.get("embeddings.layer_norm.bias"))
            for i, layer in enumerate(model.layers):
                layer.load(t, f"encoder.layer.{i}.")
            model.emb_norm_after.weight.copy_(t.get("encoder.emb_layer_norm_after.weight"))
            model.emb_norm_after.bias.copy_(t.get("encoder.emb_layer_norm_after.bias"))
            if model.lm_head is not None:
                tied = getattr(config, "tie_word_embeddings", True)
                model.lm_head.load(root, model.word_embeddings.weight if tied else None)
        check_loaded(model, "ESM")
        if model.position_type == "rotary":
            model.rotary = Rotary(_esm_inv_freq(t, config), float32_math=True).to(device)
        return model.eval()


def distinct_rows(columns: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(index of the first row of each distinct row of these non-negative integer columns, each row's distinct
    row): one int64 key per row where the columns' ranges fit in 63 bits, else numpy's row-wise unique."""
    bounds = [int(c.max()) + 1 for c in columns]
    if min(int(c.min()) for c in columns) >= 0 and np.prod([float(b) for b in bounds]) < 2.0 ** 62:
        key = np.zeros(len(columns[0]), np.int64)
        for c, b in zip(columns, bounds):
            key = key * b + c
    else:
        key = np.stack(columns, axis=1)
    _, first, inverse = np.unique(key, axis=0, return_index=True, return_inverse=True)
    return first, inverse.reshape(-1)


def _esm_inv_freq(t, config) -> torch.Tensor:
    """The checkpoint's own inv_freq where it stores one (possibly saved in float16: keep its values)."""
    for name in ("rotary_embeddings.inv_freq", "encoder.layer.0.attention.self.rotary_embeddings.inv_freq",
                 "encoder.layer.*.attention.self.rotary_embeddings.inv_freq"):   # transformers 5's own saves
        if t.has(name):
            return t.get(name).float()
    dim = config.hidden_size // config.num_attention_heads
    base = getattr(config, "rope_theta", 10000.0)
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
