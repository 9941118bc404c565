"""The ESM-2 models and inputs the steps share: the native engine and transformers' EsmModel with random weights
made on the device (no checkpoint files to write or read), the ESM tokenizer built offline from ESM's published
vocabulary, an ESM-2-shaped checkpoint on local disk for the end-to-end run, and make_fasta.py's sequences."""
from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import torch
from bench_pll import ESM2_COMMON, ESM_VOCAB

from . import REPO
from .setting import Setting

MAX_TOKENS = 1024   # ESM-2's tokens per sequence (1,026 positions), what --on-long truncate cuts to


def make_fasta_texts(n: int, seed: int = 1) -> list[str]:
    """The first n sequences tools/make_fasta.py writes for `seed` (its default length range)."""
    spec = importlib.util.spec_from_file_location("make_fasta", REPO / "tools" / "make_fasta.py")
    make_fasta = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_fasta)
    buffer = io.BytesIO()
    make_fasta.write(buffer, n, seed, 20, 35000, 10**9, None)
    return [record.split("\n", 1)[1].strip() for record in buffer.getvalue().decode().split(">")[1:]]


def step_texts(setting: Setting) -> list[str]:
    """make_fasta.py's sequences (seed 1) in file order, cut to what ESM-2 holds, as many as fill one step."""
    texts, total = [], 0
    for text in make_fasta_texts(setting.step_tokens // 100 + 10):
        text = text[:MAX_TOKENS - 2]
        if total + len(text) + 2 > setting.step_tokens:
            break
        texts.append(text)
        total += len(text) + 2
    return texts


def esm_config(setting: Setting):
    from transformers import EsmConfig
    return EsmConfig(**setting.esm_shape, **ESM2_COMMON)


def esm_tokenizer(directory: Path):
    """transformers' EsmTokenizer on ESM-2's vocabulary (as bench_pll.py and the tests build it: no hub)."""
    from transformers import EsmTokenizer
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text("\n".join(ESM_VOCAB) + "\n")
    return EsmTokenizer(str(directory / "vocab.txt"), model_max_length=MAX_TOKENS)


def _randomize(model: torch.nn.Module) -> None:
    """Random weights of the scale a trained model has (norms at 1, biases 0): throughput does not depend on
    their values, but NaN or zeros could (and NaN is what `materialize` leaves)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
            elif "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()


def native_engine(setting: Setting, tokenizer):
    """The native engine on an ESM-2 model of setting.esm_shape, random weights made on the device, with the
    budgets a worker has (one step of setting.step_tokens tokens, 256 sequences)."""
    from pipeline.engine.config import EngineConfig
    from pipeline.engine.native import NativeEngine
    from pipeline.models.checkpoint import EngineInfo
    from pipeline.models.esm import EsmModel
    from pipeline.models.layers.loader import materialize
    from pipeline.models.layers.rotary import Rotary

    config = esm_config(setting)
    with torch.device("meta"):
        model = EsmModel(config)
    materialize(model, setting.device, setting.dtype)
    _randomize(model)
    dim = config.hidden_size // config.num_attention_heads   # the default frequencies (checkpoints without inv_freq)
    model.rotary = Rotary(1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim)), float32_math=True).to(setting.device)
    info = EngineInfo("native", config.hidden_size, config.num_hidden_layers, False, MAX_TOKENS, "EsmModel")
    budgets = EngineConfig(max_tokens_per_step=setting.step_tokens, max_seqs=256, max_model_len=MAX_TOKENS)
    return NativeEngine(model.eval(), tokenizer, info, budgets, setting.device, setting.dtype)


def hf_model(setting: Setting):
    """transformers' EsmModel (SDPA attention) of the same shape, random weights made on the device."""
    from transformers import EsmModel
    torch.manual_seed(0)
    config = esm_config(setting)
    config._attn_implementation = "sdpa"
    with torch.device(setting.device):
        model = EsmModel(config, add_pooling_layer=False)
    return model.to(setting.dtype).eval()


def write_checkpoint(setting: Setting, path: Path) -> Path:
    """An ESM-2 checkpoint of setting.esm_shape (EsmModel, random weights in the setting's dtype) with the ESM
    tokenizer's files, as a user's local copy of facebook/esm2_t33_650M_UR50D would be laid out."""
    model = hf_model(setting)
    model.save_pretrained(path)
    esm_tokenizer(path).save_pretrained(path)
    del model
    if setting.gpu:
        torch.cuda.empty_cache()
    return path
