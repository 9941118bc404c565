"""T5 encoders (ProtT5, ProstT5, Ankh): pre-norm bidirectional layers whose scores carry T5's bucketed
relative-position bias, one table (the first layer's) shared by every layer; every sequence runs whole in
one step, as ESM's do.

Semantics of transformers' T5EncoderModel: embeddings unscaled; T5LayerNorm (RMS without mean or bias,
variance in float32, cast to the weight's dtype before the weight); scores unscaled, plus the bias;
feed-forward `wo(act(wi x))` or gated `wo(act(wi_0 x) * wi_1 x)` (feed_forward_proj "relu" for ProtT5,
"gated-gelu", i.e. gelu_new, for Ankh); hidden state k < num_layers is the input of layer k, hidden state
num_layers the final layer norm's output. In float16 `wo` stays float32, as transformers keeps it
(`_keep_in_fp32_modules`), so the residual stream turns float32 at the first feed-forward, as there.
Checkpoints of T5EncoderModel and of the whole T5ForConditionalGeneration load alike (`encoder.*` and
`shared.*`; the decoder is ignored).
"""
from __future__ import annotations

import torch
from torch import nn

from triton_kernels import pointwise
from triton_kernels.rms_norm import gelu_tanh_mul

from ..errors import UserError
from .base import ModelSpec, NativeModel
from .layers.attention import PagedAttention
from .layers.linear import Linear, linear
from .layers.loader import CheckpointTensors, check_loaded, embedding, materialize
from .layers.norms import RMSNorm, add_norm, rms_normalise

# transformers' activation names (T5Config.dense_act_fn) -> element-wise functions whose every element is
# the same bits wherever it sits (triton_kernels/pointwise.py; relu is exact anyway).
ACTIVATIONS = {"relu": torch.relu, "gelu_new": pointwise.gelu_tanh, "gelu_pytorch_tanh": pointwise.gelu_tanh,
               "gelu": pointwise.gelu, "silu": pointwise.silu}
BIAS_TABLE = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"


class T5LayerNorm(RMSNorm):
    """transformers' T5LayerNorm: the RMS normalisation of x in float32, cast to the weight's dtype, times the
    weight. RMSNorm's arithmetic where x has the weight's dtype; a float32 x in a float16 model (its
    residual stream after a float32 `wo`) comes out float16, as there."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return super().forward(x)
        return self.weight * rms_normalise(x, self.eps).to(self.weight.dtype)

    def add(self, x: torch.Tensor, y: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + y, self(x + y)) in one pass (the Triton path's fused layers; y None: (x, self(x))): the sum as
        torch promotes it (float32 once a float16 model's residual stream is), the norm in the weight's dtype."""
        return add_norm(x, y, self, out_dtype=self.weight.dtype)


class T5FeedForward(nn.Module):
    """`wo(act(wi x))`, or gated `wo(act(wi_0 x) * wi_1 x)` with wi_0 and wi_1 stored as one weight: one matmul
    on a GPU, two on its halves on a CPU (GatedMLP's split, for the same reason: layers/mlp.py)."""

    def __init__(self, d_model: int, d_ff: int, act, gated: bool):
        super().__init__()
        self.d_ff, self.act, self.gated = d_ff, act, gated
        self.wi = Linear(d_model, (2 if gated else 1) * d_ff, bias=False)
        self.wo = Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            h = self.wi(x)
            h = h.relu_() if self.act is torch.relu else self.act(h)
        elif x.device.type != "cpu":
            gate, up = self.wi(x).split(self.d_ff, dim=-1)
            h = self.act(gate).mul_(up)
        else:
            w = self.wi.weight   # row slices of the fused weight: contiguous views
            h = self.act(linear(x, w[:self.d_ff])).mul_(linear(x, w[self.d_ff:]))
        return self.wo(h.to(self.wo.weight.dtype))

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """forward on the Triton path: the one projection, its activation in place (plain) or gelu_new(gate) * up
        in one pass (Ankh's gated-gelu: gelu_tanh_mul, the unfused ops' rounding points; other gated activations,
        which no published T5 family uses, unfused), then wo (float32 in a float16 model: its input cast first, as
        forward does)."""
        h = self.wi(x)
        if self.gated and self.act is pointwise.gelu_tanh:
            h = gelu_tanh_mul(h)
        elif self.gated:
            gate, up = h.split(self.d_ff, dim=-1)
            h = self.act(gate).mul_(up)
        else:
            h = h.relu_() if self.act is torch.relu else self.act(h)
        return self.wo(h.to(self.wo.weight.dtype))

    def load(self, t, p: str) -> None:
        names = ("wi_0", "wi_1") if self.gated else ("wi",)
        self.wi.weight.copy_(torch.cat([t.get(f"{p}{n}.weight") for n in names]))
        self.wo.weight.copy_(t.get(p + "wo.weight"))


class T5Layer(nn.Module):
    def __init__(self, config, act, gated: bool):
        super().__init__()
        d, eps = config.d_model, config.layer_norm_epsilon
        self.num_heads, self.head_dim = config.num_heads, config.d_kv
        self.inner = self.num_heads * self.head_dim
        self.attn_norm = T5LayerNorm(d, eps)
        self.qkv = Linear(d, 3 * self.inner, bias=False)
        self.o = Linear(self.inner, d, bias=False)
        self.ff_norm = T5LayerNorm(d, eps)
        self.ff = T5FeedForward(d, config.d_ff, act, gated)
        # T5 does not scale its scores (its weights were trained unscaled): scale 1.
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, 1.0, causal=False,
                                   relative_bias=True)

    def forward(self, x: torch.Tensor, rel_bias: tuple[torch.Tensor, int], ctx) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv(self.attn_norm(x)).view(T, 3, self.num_heads, self.head_dim).unbind(1)
        x = x + self.o(self.attn(q, k, v, ctx, rel_bias).reshape(T, self.inner))
        return x + self.ff(self.ff_norm(x))

    def forward_fused(self, x: torch.Tensor, h: torch.Tensor, rel_bias: tuple[torch.Tensor, int], ctx,
                      next_norm: T5LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer with its elementwise work fused (Triton path; T5Encoder._fused_layers): h = attn_norm(x)
        comes in and (x + the layer, next_norm of that) goes out. Attention reads q, k and v where the
        projection wrote them (no cache write: an encoder's keys are never read by a later step), and each
        residual add runs with the norm after it (T5LayerNorm.add)."""
        T = x.shape[0]
        attn = self.attn.from_projection(self.qkv(h), ctx, rel_bias).reshape(T, self.inner)
        x, h = self.ff_norm.add(x, self.o(attn))
        return next_norm.add(x, self.ff.forward_fused(h))

    def load(self, t, p: str) -> None:
        """From `{p}0.` (self-attention block) and `{p}1.` (feed-forward block) of a T5 encoder block."""
        a = p + "0.SelfAttention."
        self.attn_norm.weight.copy_(t.get(p + "0.layer_norm.weight"))
        self.qkv.weight.copy_(torch.cat([t.get(f"{a}{n}.weight") for n in ("q", "k", "v")]))
        self.o.weight.copy_(t.get(a + "o.weight"))
        self.ff_norm.weight.copy_(t.get(p + "1.layer_norm.weight"))
        self.ff.load(t, p + "1.DenseReluDense.")


def _feed_forward_kind(config) -> tuple[object, bool]:
    """(activation, gated) from the config's feed_forward_proj, as transformers' T5Config derives them."""
    name = getattr(config, "dense_act_fn", None)
    if name not in ACTIVATIONS:
        raise UserError(f"T5 config field feed_forward_proj '{config.feed_forward_proj}' (activation '{name}') is not "
                        f"supported by --engine native (it runs {', '.join(ACTIVATIONS)}, plain or gated-); "
                        "use --engine hf")
    return ACTIVATIONS[name], bool(config.is_gated_act)


class T5Encoder(NativeModel):
    def __init__(self, config):
        super().__init__()
        if getattr(config, "is_decoder", False):
            raise UserError("a T5 config with is_decoder: true is a decoder; --engine native runs T5 encoders only "
                            "(use --engine hf)")
        act, gated = _feed_forward_kind(config)
        d = config.d_model
        self.embed_tokens = embedding(config.vocab_size, d)
        self.layers = nn.ModuleList(T5Layer(config, act, gated) for _ in range(config.num_layers))
        self.final_norm = T5LayerNorm(d, config.layer_norm_epsilon)
        self.rel_bias_table = nn.Parameter(torch.empty(config.relative_attention_num_buckets, config.num_heads),
                                           requires_grad=False)
        self.max_distance = int(config.relative_attention_max_distance)
        # Relative positions only: the model itself sets no length limit.
        self.spec = ModelSpec(
            architecture="T5EncoderModel", hidden_size=d, num_layers=config.num_layers, vocab_size=config.vocab_size,
            is_causal=False, num_attention_layers=config.num_layers, num_kv_heads=config.num_heads,
            head_dim=config.d_kv, max_tokens=None)

    # The Triton path fuses each layer's elementwise work (T5Layer.forward_fused); a benchmark may turn it off to
    # time the unfused layers on the same GPU.
    fuse_elementwise = True

    def forward(self, ctx, capture=frozenset()):
        x = self.embed_tokens(ctx.input_ids)
        dtype, rel_bias = x.dtype, (self.rel_bias_table, self.max_distance)
        if ctx.triton_kernels and self.fuse_elementwise and len(self.layers):
            return self._fused_layers(x, rel_bias, ctx, capture)
        captured = {}
        for i, layer in enumerate(self.layers):
            if i in capture:
                captured[i] = x.to(dtype)   # float16 models carry a float32 residual after layer 0
            x = layer(x, rel_bias, ctx)
        return self.final_norm(x), captured

    def _fused_layers(self, x, rel_bias, ctx, capture) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """(final norm output, captured inputs) with each layer fused: every norm but the first runs with the
        residual add before it, the last layer's with the final norm. In a float16 model the residual stream
        turns float32 at the first `wo` (kept float32), as in forward; the norms' outputs stay float16."""
        captured = {}
        dtype = x.dtype
        _, h = self.layers[0].attn_norm.add(x, None)
        for i, layer in enumerate(self.layers):
            if i in capture:
                captured[i] = x.to(dtype)
            nxt = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.final_norm
            x, h = layer.forward_fused(x, h, rel_bias, ctx, nxt)
        return h, captured

    def attention_layers(self):
        return [layer.attn for layer in self.layers]

    @classmethod
    def from_checkpoint(cls, path, config, device: torch.device, dtype: torch.dtype) -> "T5Encoder":
        with torch.device("meta"):
            model = cls(config)
        materialize(model, device, dtype)
        if dtype == torch.float16:   # as transformers loads T5 in float16 (_keep_in_fp32_modules = ["wo"])
            for layer in model.layers:
                layer.ff.wo.float()
        t = CheckpointTensors(path)
        with torch.no_grad():
            # T5EncoderModel and T5ForConditionalGeneration store the tied input embeddings as shared.weight;
            # some saves keep only the encoder's copy.
            embed = "shared.weight" if t.has("shared.weight") else "encoder.embed_tokens.weight"
            model.embed_tokens.weight.copy_(t.get(embed))
            model.rel_bias_table.copy_(t.get(BIAS_TABLE))
            for i, layer in enumerate(model.layers):
                layer.load(t, f"encoder.block.{i}.layer.")
            model.final_norm.weight.copy_(t.get("encoder.final_layer_norm.weight"))
        check_loaded(model, "T5")
        return model.eval()
