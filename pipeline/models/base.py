"""What the engine needs to know about a model, and the forward contract every family implements.

`forward(ctx, capture)` runs one step's tokens and returns the final norm output `[T, D]` plus the
hidden states asked for in `capture`: layer k < num_layers is the input of decoder layer k (k = 0 is
the embedding output), exactly transformers' `hidden_states[k]`; layer num_layers is the final norm
output. `logits(hidden)` maps final hidden states to next-token logits (causal models only).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch
from torch import nn

from .layers.linear import linear


@dataclass(frozen=True)
class DeltaStateSpec:
    """Per-sequence state of each Gated DeltaNet layer: a conv window and a recurrent matrix per head."""
    num_layers: int
    conv_channels: int
    conv_width: int          # kernel - 1 previous inputs
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        conv = self.conv_width * self.conv_channels * torch.finfo(dtype).bits // 8
        recurrent = self.num_v_heads * self.head_k_dim * self.head_v_dim * 4   # float32
        return self.num_layers * (conv + recurrent)


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    is_causal: bool
    num_attention_layers: int
    num_kv_heads: int
    head_dim: int                          # of the attention layers
    max_tokens: int | None                 # absolute-position limit of the model itself, if any
    eos_token_ids: tuple[int, ...] = ()
    delta: DeltaStateSpec | None = None
    extra: dict = field(default_factory=dict)

    @property
    def kv_cache_layers(self) -> int:
        """Layers that keep KV pages: encoders run a whole sequence per step, so one buffer serves all."""
        return self.num_attention_layers if self.is_causal else min(1, self.num_attention_layers)

    def kv_bytes_per_token(self, dtype: torch.dtype, triton_kernels: bool) -> int:
        from .layers.attention import cache_head_dim
        dim = cache_head_dim(self.head_dim, triton_kernels)
        return 2 * self.kv_cache_layers * self.num_kv_heads * dim * torch.finfo(dtype).bits // 8


class NativeModel(nn.Module, metaclass=abc.ABCMeta):
    """A model family on our engine: subclasses must define forward and attention_layers (a missing one
    fails when the class is instantiated, not mid-run)."""

    spec: ModelSpec
    # forward(ctx, capture, rows) computes its final output at `rows` of the step only (an encoder's last layer
    # needs every token's keys and values, but the rest of it only at the rows whose output is read)
    computes_rows = False

    @abc.abstractmethod
    def forward(self, ctx, capture: frozenset[int] = frozenset()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """(final norm output [T, D], {layer: hidden [T, D]}) for the step's tokens; models with computes_rows
        take `rows` (int64 [n] of the step, grouped by sequence in step order) and return [n, D] for those."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits; encoders have no language-model head (runs that need one are refused first)."""
        raise TypeError(f"{self.spec.architecture} has no language-model head")

    @abc.abstractmethod
    def attention_layers(self) -> list:
        """The PagedAttention of every attention layer, in layer order."""

    def delta_layers(self) -> list:
        """Every Gated DeltaNet layer (empty for pure attention models)."""
        return []

    def run_layers(self, x, cos, sin, ctx, capture) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """x through every layer of self.layers, called as layer(x, cos, sin, self.rotary, ctx); the input
        of each layer in `capture` is kept (hidden state i is the input of layer i)."""
        captured = {}
        for i, layer in enumerate(self.layers):
            if i in capture:
                captured[i] = x
            x = layer(x, cos, sin, self.rotary, ctx)
        return x, captured


class RotaryDecoder(NativeModel):
    """The forward pass Llama/Qwen3 and Qwen3.5 share: token embeddings, rotary cos/sin from the step's
    positions, each layer called as layer(x, cos, sin, rotary, ctx), a final norm; logits from the output
    embeddings, tied to the input ones or not. Subclasses build embed_tokens, layers, norm, rotary, tied
    and lm_head."""

    # The Triton path fuses each layer's elementwise work where its layers can (a `forward_fused`, as ESM's); a
    # benchmark may turn it off to time the unfused layers on the same GPU.
    fuse_elementwise = True

    def forward(self, ctx, capture=frozenset()):
        x = self.embed_tokens(ctx.input_ids)
        cos, sin = self.rotary.cos_sin(ctx.positions, x.dtype)
        if ctx.triton_kernels and self.fuse_elementwise and len(self.layers) and \
                all(hasattr(layer, "forward_fused") for layer in self.layers):
            return self._fused_layers(x, cos, sin, ctx, capture)
        x, captured = self.run_layers(x, cos, sin, ctx, capture)
        return self.norm(x), captured

    def _fused_layers(self, x, cos, sin, ctx, capture) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """(final norm output, captured inputs) with each layer fused (`layer.forward_fused(x, h, cos, sin,
        rotary, ctx, next_norm)`): h = input_layernorm(x) comes in and (x + the layer, next_norm of that) goes
        out, so every norm but the first runs with the residual add before it (layers/norms.py add_norm); the
        last layer's next norm is the final one."""
        from .layers.norms import add_norm
        captured = {}
        _, h = add_norm(x, None, self.layers[0].input_layernorm)
        for i, layer in enumerate(self.layers):
            if i in capture:
                captured[i] = x
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            x, h = layer.forward_fused(x, h, cos, sin, self.rotary, ctx, nxt)
        return h, captured

    def logits(self, hidden):
        weight = self.embed_tokens.weight if self.tied else self.lm_head.weight
        return linear(hidden, weight)


def eos_ids(config, checkpoint_dir) -> tuple[int, ...]:
    """EOS ids as transformers' generate sees them: generation_config.json first, else config.json."""
    import json
    from pathlib import Path

    value = None
    gen = Path(checkpoint_dir) / "generation_config.json"
    if gen.exists():
        value = json.loads(gen.read_text()).get("eos_token_id")
    if value is None:
        value = getattr(config, "eos_token_id", None)
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)
