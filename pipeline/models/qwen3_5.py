"""Qwen3.5 text: Gated DeltaNet layers with every `full_attention_interval`-th layer gated attention.

Semantics follow transformers' Qwen3_5TextModel: zero-centred RMSNorms (scale 1 + w) for the layer,
final and q/k norms; the attention's q projection yields a query and a sigmoid output gate per head;
partial rotary (the first `partial_rotary_factor` of each head, rotate-half); the delta-rule mixer in
layers/gated_deltanet.py. Loads `Qwen3_5ForCausalLM` checkpoints and the text model of the multimodal
`Qwen3_5ForConditionalGeneration` ones (vision and MTP weights are ignored).
"""
from __future__ import annotations

import torch
from torch import nn

from triton_kernels import pointwise
from triton_kernels.gates import sigmoid_gate

from ..errors import UserError
from .base import DeltaStateSpec, ModelSpec, RotaryDecoder
from .layers.attention import PagedAttention
from .layers.gated_deltanet import GatedDeltaNet
from .layers.linear import Linear
from .layers.loader import decoder_from_checkpoint, embedding
from .layers.mlp import GatedMLP
from .layers.norms import RMSNorm, add_norm
from .layers.rotary import Rotary, rope_frequencies


class GatedAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        # [query and gate interleaved per head (2 * q_size) | k | v]
        self.qkv = Linear(config.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, zero_centred=True)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, zero_centred=True)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, causal=True)

    def forward(self, x, cos, sin, rotary: Rotary, ctx, fused: bool = False):
        """fused (the Triton path's fused layers): q and k normalised and rotated in place in the projection's
        output, both in one pass (Rotary.norm_apply_qk_), where the unfused layer normalises into new tensors and
        rotates those; the output gate o * sigmoid(gate) in one pass (triton_kernels.gates sigmoid_gate) where the
        unfused layer copies the gate out, takes its sigmoid and multiplies."""
        T = x.shape[0]
        qg, k, v = self.qkv(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.view(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        if fused:
            q, k = rotary.norm_apply_qk_(q, k, cos, sin, self.q_norm, self.k_norm)
        else:
            q, k = self.q_norm(q), self.k_norm(k)
            q, k = rotary.apply(q, cos, sin, in_place=True), rotary.apply(k, cos, sin, in_place=True)   # norm outputs
        o = self.attn(q, k, v.view(T, self.num_kv_heads, self.head_dim), ctx)
        if fused:   # o * sigmoid(gate) in one pass, the gate read where the projection wrote it
            return self.o_proj(sigmoid_gate(o, gate))
        return self.o_proj(o.reshape(T, self.q_size) * pointwise.sigmoid(gate.reshape(T, self.q_size)))

    def load(self, t, p: str) -> None:
        names = ("q_proj", "k_proj", "v_proj")
        self.qkv.weight.copy_(torch.cat([t.get(f"{p}{n}.weight") for n in names]))
        self.o_proj.weight.copy_(t.get(p + "o_proj.weight"))
        if self.qkv.bias is not None:
            self.qkv.bias.copy_(torch.cat([t.get(f"{p}{n}.bias") for n in names]))
            self.o_proj.bias.copy_(t.get(p + "o_proj.bias"))
        self.q_norm.weight.copy_(t.get(p + "q_norm.weight"))
        self.k_norm.weight.copy_(t.get(p + "k_norm.weight"))


class Qwen3_5Layer(nn.Module):
    def __init__(self, config, layer_type: str):
        super().__init__()
        self.is_linear = layer_type == "linear_attention"
        self.mixer = GatedDeltaNet(config) if self.is_linear else GatedAttention(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centred=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centred=True)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x, cos, sin, rotary, ctx):
        h = self.input_layernorm(x)
        h = self.mixer(h, ctx) if self.is_linear else self.mixer(h, cos, sin, rotary, ctx)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, x, h, cos, sin, rotary, ctx, next_norm: RMSNorm):
        """The layer with its elementwise work fused (Triton path; RotaryDecoder._fused_layers): h =
        input_layernorm(x) comes in, (x + this layer, next_norm of that) goes out. The mixer's output norm
        (delta-rule layers), the attention's q and k norms with their rotary, and the MLP's silu(gate) * up run
        one pass each, the residual adds ride with the norms after them; so do the attention's output gate and
        the delta-rule layers' gates (triton_kernels.gates)."""
        a = self.mixer(h, ctx, fused=True) if self.is_linear else self.mixer(h, cos, sin, rotary, ctx, fused=True)
        x, h = add_norm(x, a, self.post_attention_layernorm)
        return add_norm(x, self.mlp.forward_fused(h), next_norm)


class Qwen3_5Model(RotaryDecoder):
    def __init__(self, config):
        super().__init__()
        types = list(config.layer_types)
        if set(types) - {"linear_attention", "full_attention"}:
            raise UserError(f"Qwen3.5 layer types {sorted(set(types))} are not supported; use --engine hf")
        self.config = config
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3_5Layer(config, kind) for kind in types)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centred=True)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tied else Linear(config.hidden_size, config.vocab_size, bias=False)
        inv_freq, scaling, _ = rope_frequencies(config, config.head_dim)
        self.rotary = Rotary(inv_freq, scaling)
        linear = [layer.mixer for layer in self.layers if layer.is_linear]
        delta = None
        if linear:
            m = linear[0]
            delta = DeltaStateSpec(num_layers=len(linear), conv_channels=m.conv_dim, conv_width=m.kernel - 1,
                                   num_v_heads=m.num_v_heads, head_k_dim=m.head_k_dim, head_v_dim=m.head_v_dim)
        self.spec = ModelSpec(
            architecture="Qwen3_5ForCausalLM", hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
            vocab_size=config.vocab_size, is_causal=True, num_attention_layers=types.count("full_attention"),
            num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
            max_tokens=None, delta=delta)

    def attention_layers(self):
        return [layer.mixer.attn for layer in self.layers if not layer.is_linear]

    def delta_layers(self):
        return [layer.mixer for layer in self.layers if layer.is_linear]

    @classmethod
    def from_checkpoint(cls, path, config, device, dtype):
        return decoder_from_checkpoint(
            lambda: cls(config), path, config, device, dtype, ["model.language_model.", "model.", ""],
            lambda layer: (layer.mixer, "linear_attn." if layer.is_linear else "self_attn."), "Qwen3.5")
