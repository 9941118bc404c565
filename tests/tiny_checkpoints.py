"""Tiny random-weight checkpoints of each architecture the native engine runs, written the way users'
checkpoints are (transformers save_pretrained: config.json + safetensors + tokenizer), for parity tests.

Weights use a larger init than transformers' default (0.02) so next-token distributions are far from
uniform: greedy decoding then has clear winners and tests of token-exact equality are not at the mercy
of near-ties.
"""
from __future__ import annotations

from pathlib import Path

import torch

from pipeline.models import demo as demo_model

INIT = 0.1

# T5 encoders with their published config values (ProtT5-XL-U50 and ProstT5: config.json of
# Rostlab/prot_t5_xl_uniref50 and Rostlab/ProstT5; Ankh: ElnaggarLab/ankh-base), only the sizes shrunk.
T5_SIZES = dict(d_model=64, d_kv=16, d_ff=128, num_layers=3, num_decoder_layers=2, num_heads=4)
PROTT5 = dict(vocab_size=128, relative_attention_num_buckets=32, relative_attention_max_distance=128,
              feed_forward_proj="relu", dropout_rate=0.1, layer_norm_epsilon=1e-6, initializer_factor=1.0,
              is_encoder_decoder=True, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
T5_FAMILIES = {"prott5": PROTT5, "prostt5": dict(PROTT5, vocab_size=150),
               "ankh": dict(PROTT5, vocab_size=144, relative_attention_num_buckets=64, feed_forward_proj="gated-gelu",
                            tie_word_embeddings=False)}
T5_KINDS = ("prott5", "prostt5", "ankh", "prott5-half-enc")


def _tiny_t5(kind: str):
    """The whole T5ForConditionalGeneration as ProtT5, ProstT5 and Ankh are published; "prott5-half-enc" is
    ProtT5's half-precision encoder-only checkpoint (T5EncoderModel saved in float16)."""
    from transformers import T5Config, T5EncoderModel, T5ForConditionalGeneration
    family = T5_FAMILIES[kind.removesuffix("-half-enc")]
    model_class = T5EncoderModel if kind.endswith("-half-enc") else T5ForConditionalGeneration
    model = model_class(T5Config(**T5_SIZES, **family))
    with torch.no_grad():   # transformers' init leaves norms at 1 and the bias table small (d^-0.5)
        for name, p in model.named_parameters():
            if name.endswith("layer_norm.weight"):
                p.normal_(1.0, 0.2)
            elif name.endswith("relative_attention_bias.weight"):
                p.normal_(0.0, 1.0)
    return model.half() if kind.endswith("-half-enc") else model


def _tiny(kind: str):
    from transformers import (EsmConfig, EsmForMaskedLM, LlamaConfig, LlamaForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig)
    common = dict(vocab_size=32, hidden_size=64, intermediate_size=96, initializer_range=INIT,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "qwen3_5":
        config = Qwen3_5TextConfig(**common, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                                   linear_key_head_dim=16, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                                   max_position_embeddings=8192, layer_types=["linear_attention", "full_attention",
                                                                            "linear_attention", "linear_attention"])
        model = Qwen3_5ForCausalLM(config)
        with torch.no_grad():   # transformers' init leaves these at 0 / 1; random values exercise them
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") or name.endswith("dt_bias"):
                    p.normal_(1.0 if "linear_attn.norm" in name or "dt_bias" in name else 0.0, 0.1)
        return model
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common, num_hidden_layers=3, num_attention_heads=4,
                                            num_key_value_heads=2, max_position_embeddings=8192))
    if kind == "llama-bias":   # attention and MLP projections with biases (transformers' init zeroes them)
        model = LlamaForCausalLM(LlamaConfig(**common, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, max_position_embeddings=8192,
                                             attention_bias=True, mlp_bias=True))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.1)
        return model
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common, num_hidden_layers=3, num_attention_heads=4,
                                            num_key_value_heads=1, head_dim=32, max_position_embeddings=8192,
                                            tie_word_embeddings=True))
    if kind in T5_KINDS:
        return _tiny_t5(kind)
    if kind in ("esm2", "esm1b"):
        rotary = kind == "esm2"
        return EsmForMaskedLM(EsmConfig(
            vocab_size=33, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            initializer_range=INIT, pad_token_id=0, mask_token_id=32, token_dropout=rotary,
            position_embedding_type="rotary" if rotary else "absolute", max_position_embeddings=1026,
            emb_layer_norm_before=not rotary))
    raise ValueError(kind)


def write_tiny(kind: str, path: Path, max_shard_size: str | None = None) -> Path:
    """A tiny random checkpoint of `kind` at `path` (float32 but for "*-half-enc", seeded), with the demo
    protein tokenizer (engine-level tests pass token ids)."""
    torch.manual_seed(sum(map(ord, kind)))
    model = _tiny(kind).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    demo_model.build_tokenizer().save_pretrained(path)
    return path


def random_sequences(lengths, seed: int = 0, bos: int = 1, eos: int | None = 2, low: int = 4, high: int = 29):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        body = torch.randint(low, high, (n,), generator=g).tolist()
        out.append([bos] + body + ([eos] if eos is not None else []))
    return out
