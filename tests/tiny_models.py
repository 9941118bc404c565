"""Tiny random-weight checkpoints of real transformers architectures, saved like hub checkpoints.

Each is built from its transformers config class (no hub access) and saved with save_pretrained, so the
pipeline loads it exactly as it would load a downloaded model.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
ESM_VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>", "L", "A", "G", "V", "S", "E", "R", "T", "I", "D", "P", "K", "Q",
             "N", "F", "Y", "M", "H", "W", "C", "X", "B", "U", "Z", "O", ".", "-", "<null_1>", "<mask>"]


def _char_tokenizer(model_max_length: int = 100000):
    from pipeline.models import demo as demo_model
    tok = demo_model.build_tokenizer()
    tok.model_max_length = model_max_length
    return tok


def save_esm(path: Path, model_max_length: int = 1024) -> Path:
    from transformers import EsmConfig, EsmForMaskedLM, EsmTokenizer
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(ESM_VOCAB) + "\n")
    tok = EsmTokenizer(str(path / "vocab.txt"), model_max_length=model_max_length)
    torch.manual_seed(1)
    config = EsmConfig(vocab_size=len(ESM_VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, max_position_embeddings=1026, position_embedding_type="rotary",
                       pad_token_id=1, mask_token_id=32, token_dropout=True, emb_layer_norm_before=False)
    EsmForMaskedLM(config).eval().save_pretrained(path)
    tok.save_pretrained(path)
    return path


def save_llama(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(2)
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    _char_tokenizer().save_pretrained(path)
    return path


def save_gpt2(path: Path, n_positions: int = 64) -> Path:
    """GPT-2: a causal LM named GPT2LMHeadModel (not *ForCausalLM) with a learned position table, which
    transformers 5 configs describe only by `n_positions`; runs on the hf engine."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(4)
    config = GPT2Config(vocab_size=32, n_positions=n_positions, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    GPT2LMHeadModel(config).eval().save_pretrained(path)
    _char_tokenizer().save_pretrained(path)
    return path


def save_qwen3(path: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(3)
    config = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    Qwen3ForCausalLM(config).eval().save_pretrained(path)
    _char_tokenizer().save_pretrained(path)
    return path


def run_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The real CLI in a subprocess, as a user runs it."""
    full_env = dict(os.environ)
    full_env.pop("TRITON_INTERPRET", None)   # workers run the plain torch paths, as in production
    full_env.update(env or {})
    return subprocess.run([sys.executable, str(REPO / "bin" / "run_shards"), *args], capture_output=True,
                          text=True, env=full_env, timeout=timeout, cwd=REPO)
