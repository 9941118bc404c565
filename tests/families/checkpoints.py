"""Tiny checkpoints of every family in FAMILIES.md, written as users have them: the published config.json
(sizes shrunk; see published_configs.py), seeded random weights in the published dtype as safetensors, and the
published tokenizer files. `build(name, directory)` writes one; `build_cached` reuses one per root directory.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import family_tokenizers as tok
from .published_configs import tiny_config
from .remote_code import load_remote_class, write_remote_code
from .tokenizer_files import write_json
from .weights import randomize, seed_of


@dataclass(frozen=True)
class Family:
    name: str
    kind: str                              # "protein" | "dna" | "causal_lm" | "remote_code"
    model_class: str                       # the transformers class whose weights the published files hold
    tokenizer: Callable[[Path], dict]      # writes the tokenizer files; returns config fields they decide


def _qwen2(d: Path) -> dict:
    return tok.qwen(d, eos="<|endoftext|>")


def _qwen3(d: Path) -> dict:
    return tok.qwen(d, eos="<|im_end|>")


def _prott5_spm_only(d: Path) -> dict:
    return tok.prott5(d, with_tokenizer_json=False)


_TABLE = [
    Family("esm2_t6_8m", "protein", "EsmForMaskedLM", tok.esm),
    Family("esm2_t33_650m", "protein", "EsmForMaskedLM", tok.esm),
    Family("esm1b", "protein", "EsmForMaskedLM", tok.esm),
    Family("esm1v", "protein", "EsmForMaskedLM", tok.esm),
    Family("prot_t5_xl_u50", "protein", "T5ForConditionalGeneration", tok.prott5),
    Family("prot_t5_xl_half_enc", "protein", "T5EncoderModel", tok.prott5),
    Family("prostt5", "protein", "T5ForConditionalGeneration", tok.prostt5),
    Family("ankh_base", "protein", "T5ForConditionalGeneration", tok.ankh),
    Family("ankh_large", "protein", "T5ForConditionalGeneration", tok.ankh),
    Family("prot_bert", "protein", "BertForMaskedLM", tok.protbert),
    Family("prot_bert_bfd", "protein", "BertForMaskedLM", tok.protbert),
    Family("saprot", "protein", "EsmForMaskedLM", tok.saprot),
    Family("nucleotide_transformer_v1", "dna", "EsmForMaskedLM", tok.nucleotide_transformer),
    Family("llama2", "causal_lm", "LlamaForCausalLM", tok.llama2),
    Family("llama3", "causal_lm", "LlamaForCausalLM", tok.llama3),
    Family("llama_rope_linear", "causal_lm", "LlamaForCausalLM", tok.llama2),
    Family("llama_rope_dynamic", "causal_lm", "LlamaForCausalLM", tok.llama2),
    Family("llama_rope_yarn", "causal_lm", "LlamaForCausalLM", tok.llama2),
    Family("llama_rope_longrope", "causal_lm", "LlamaForCausalLM", tok.llama2),
    Family("mistral", "causal_lm", "MistralForCausalLM", tok.llama2),
    Family("qwen2", "causal_lm", "Qwen2ForCausalLM", _qwen2),
    Family("qwen3", "causal_lm", "Qwen3ForCausalLM", _qwen3),
    Family("qwen3_5", "causal_lm", "Qwen3_5ForConditionalGeneration", _qwen3),
    Family("protgpt2", "causal_lm", "GPT2LMHeadModel", tok.protgpt2),
    Family("dnabert2_remote", "remote_code", "", lambda d: {}),
    Family("hyenadna_remote", "remote_code", "", lambda d: {}),
    Family("progen2_remote", "remote_code", "", lambda d: {}),
]
# Variants that are the same family with another published file set (not families of their own).
_VARIANTS = [Family("prot_t5_xl_half_enc_spm_only", "protein", "T5EncoderModel", _prott5_spm_only)]
BY_NAME = {f.name: f for f in _TABLE + _VARIANTS}
FAMILIES: list[str] = [f.name for f in _TABLE]
VARIANTS: list[str] = [f.name for f in _VARIANTS]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def build(name: str, directory: str | Path) -> Path:
    """Write the tiny checkpoint of family `name` into `directory` (created); deterministic for a name."""
    family = BY_NAME[name]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if family.kind == "remote_code":
        _build_remote(name, directory)
    elif name == "qwen3_5":
        _build_qwen3_5(family, directory)
    else:
        config = tiny_config(name.removesuffix("_spm_only")) | family.tokenizer(directory)
        write_json(directory / "config.json", config)
        _write_weights(family, directory, _DTYPES[config.get("torch_dtype", "float32")])
    return directory


def build_cached(name: str, root: str | Path) -> Path:
    """`build(name, root / name)` once per root: later calls return the finished directory."""
    root = Path(root)
    target, done = root / name, root / f"{name}.complete"
    if not done.exists():
        if target.exists():
            shutil.rmtree(target)
        build(name, target)
        done.touch()
    return target


def _write_weights(family: Family, directory: Path, dtype: torch.dtype) -> None:
    import transformers
    model_class = getattr(transformers, family.model_class)
    config = model_class.config_class.from_pretrained(directory)
    _save_weights(model_class(config), family, directory, dtype)


def _save_weights(model: torch.nn.Module, family: Family, directory: Path, dtype: torch.dtype) -> None:
    """Seeded weights in `dtype`, saved by transformers; only the weight files (and a causal LM's
    generation_config.json) are kept: config.json stays the published-form one written before."""
    randomize(model, seed_of(family.name))
    model = model.to(dtype).eval()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        for path in Path(tmp).iterdir():
            keep = path.suffix == ".safetensors" or path.name.endswith(".index.json")
            if keep or (path.name == "generation_config.json" and family.kind == "causal_lm"):
                shutil.copy(path, directory / path.name)


def _build_qwen3_5(family: Family, directory: Path) -> None:
    """Qwen3.5 as published: a vision-language Qwen3_5ForConditionalGeneration whose text model
    AutoModelForCausalLM loads alone. Config values are transformers' Qwen3_5Config defaults (its docstring's
    reference checkpoint), only sizes shrunk; written by transformers itself (the published file is v5-era)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    ids = tok.qwen(directory, eos="<|im_end|>", regex=tok.lm.QWEN3_5_REGEX)
    text = dict(vocab_size=ids["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"])
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = Qwen3_5Config(text_config=text, vision_config=vision, architectures=[family.model_class],
                           dtype="bfloat16")
    config.save_pretrained(directory)
    _save_weights(Qwen3_5ForConditionalGeneration(config), family, directory, torch.bfloat16)


def _build_remote(name: str, directory: Path) -> None:
    shape = write_remote_code(name, directory)
    config = json.loads((directory / "config.json").read_text())
    model_class = load_remote_class(directory, shape)
    model = model_class(model_class.config_class(**{k: v for k, v in config.items() if k != "auto_map"}))
    _save_weights(model, BY_NAME[name], directory, torch.float32)
    write_json(directory / "config.json", config)
