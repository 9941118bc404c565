"""Llama and Qwen3 (dense): pre-norm decoder layers of rotary GQA attention and a gated SiLU MLP.

Qwen3 adds an RMSNorm over each query and key head before the rotary embedding. q, k and v are one
fused projection, gate and up another, so a layer runs four matmuls.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import UserError
from .base import ModelSpec, RotaryDecoder
from .layers.attention import PagedAttention
from .layers.linear import Linear
from .layers.loader import decoder_from_checkpoint, embedding
from .layers.mlp import GatedMLP
from .layers.norms import RMSNorm, add_norm
from .layers.rotary import Rotary, rope_frequencies


class LlamaAttention(nn.Module):
    def __init__(self, config, qk_norm: bool):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5,
                                   causal=True)

    def forward(self, x, cos, sin, rotary: Rotary, ctx, fused: bool = False):
        """fused (the Triton path's fused layers): q and k (Qwen3: with their norms) normalised and rotated in
        place in the projection's output, both in one pass (Rotary.norm_apply_qk_)."""
        T = x.shape[0]
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = (t.view(T, -1, self.head_dim) for t in (q, k, v))
        if fused:
            q, k = rotary.norm_apply_qk_(q, k, cos, sin, self.q_norm, self.k_norm)
            return self.o_proj(self.attn(q, k, v, ctx).reshape(T, self.q_size))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary.apply(q, cos, sin), rotary.apply(k, cos, sin)
        return self.o_proj(self.attn(q, k, v, ctx).reshape(T, self.q_size))

    def load(self, t, p: str) -> None:
        names = ("q_proj", "k_proj", "v_proj")
        self.qkv.weight.copy_(torch.cat([t.get(f"{p}{n}.weight") for n in names]))
        if self.qkv.bias is not None:
            self.qkv.bias.copy_(torch.cat([t.get(f"{p}{n}.bias") for n in names]))
            self.o_proj.bias.copy_(t.get(f"{p}o_proj.bias"))
        self.o_proj.weight.copy_(t.get(f"{p}o_proj.weight"))
        if self.q_norm is not None:
            self.q_norm.weight.copy_(t.get(f"{p}q_norm.weight"))
            self.k_norm.weight.copy_(t.get(f"{p}k_norm.weight"))


class LlamaLayer(nn.Module):
    def __init__(self, config, qk_norm: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=bool(getattr(config, "mlp_bias", False)))

    def forward(self, x, cos, sin, rotary, ctx):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, rotary, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, x, h, cos, sin, rotary, ctx, next_norm: RMSNorm):
        """The layer with its elementwise work fused (Triton path; RotaryDecoder._fused_layers): h =
        input_layernorm(x) comes in, (x + this layer, next_norm of that) goes out; the residual adds ride with
        the norms after them, q and k (with Qwen3's norms) and the MLP's silu(gate) * up are one pass each."""
        x, h = add_norm(x, self.self_attn(h, cos, sin, rotary, ctx, fused=True), self.post_attention_layernorm)
        return add_norm(x, self.mlp.forward_fused(h), next_norm)


class LlamaModel(RotaryDecoder):
    def __init__(self, config, architecture: str, qk_norm: bool):
        super().__init__()
        types = set(getattr(config, "layer_types", None) or ["full_attention"])
        if types != {"full_attention"} or getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            raise UserError(f"{architecture}: sliding-window attention is not supported by --engine native; "
                            "use --engine hf")
        self.config = config
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(config, qk_norm) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tied else Linear(config.hidden_size, config.vocab_size, bias=False)
        head_dim = self.layers[0].self_attn.head_dim
        inv_freq, scaling, _ = rope_frequencies(config, head_dim)
        self.rotary = Rotary(inv_freq, scaling)
        self.spec = ModelSpec(
            architecture=architecture, hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
            vocab_size=config.vocab_size, is_causal=True, num_attention_layers=config.num_hidden_layers,
            num_kv_heads=config.num_key_value_heads, head_dim=head_dim, max_tokens=None)

    def attention_layers(self):
        return [layer.self_attn.attn for layer in self.layers]

    @classmethod
    def from_checkpoint(cls, path, config, device, dtype, architecture: str, qk_norm: bool):
        return decoder_from_checkpoint(lambda: cls(config, architecture, qk_norm), path, config, device, dtype,
                                       ["model.", ""], lambda layer: (layer.self_attn, "self_attn."), architecture)
