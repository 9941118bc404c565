"""Checkpoints that need `trust_remote_code`: config.json with an `auto_map` naming Python files in the
checkpoint, shaped like DNABERT-2, HyenaDNA and ProGen2's (their config keys and tokenizer layout), with a
minimal model of our own writing (no upstream code): embeddings, residual MLP blocks with a token-mixing step
(a running mean for the causal kinds, a masked mean for the bidirectional one), a final LayerNorm and a head.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, processors

from .tokenizer_files import write_json

_MODEL_SOURCE = '''"""A minimal {title}-shaped model for run_shards' tests, loaded with trust_remote_code=True."""
import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput, MaskedLMOutput

from .{config_module} import {config_class}


class Block(nn.Module):
    def __init__(self, hidden, inner, eps):
        super().__init__()
        self.norm_mix, self.mix = nn.LayerNorm(hidden, eps=eps), nn.Linear(hidden, hidden)
        self.norm_mlp = nn.LayerNorm(hidden, eps=eps)
        self.up, self.down = nn.Linear(hidden, inner), nn.Linear(inner, hidden)

    def forward(self, x, mask):
        h = self.norm_mix(x) * mask
        if {causal}:   # each position sees the mean of itself and what precedes it
            context = h.cumsum(1) / mask.cumsum(1).clamp(min=1)
        else:          # each position sees the mean of the whole (unpadded) sequence
            context = (h.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(h)
        x = x + self.mix(context)
        return x + self.down(nn.functional.gelu(self.up(self.norm_mlp(x))))


class {prefix}PreTrainedModel(PreTrainedModel):
    config_class = {config_class}
    base_model_prefix = "{base_prefix}"

    def _init_weights(self, module):
        pass


class {prefix}Model({prefix}PreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        hidden, inner, layers = config.{hidden_key}, config.{inner_key}, config.{layers_key}
        self.embeddings = nn.Embedding(config.vocab_size, hidden)
        self.blocks = nn.ModuleList(Block(hidden, inner, config.{eps_key}) for _ in range(layers))
        self.final_norm = nn.LayerNorm(hidden, eps=config.{eps_key})
        self.post_init()

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False, return_dict=True, **kwargs):
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        mask = mask.unsqueeze(-1).to(self.embeddings.weight.dtype)
        x = self.embeddings(input_ids)
        states = [x]
        for block in self.blocks:
            x = block(x, mask)
            states.append(x)
        x = self.final_norm(x)
        states[-1] = x
        return BaseModelOutput(last_hidden_state=x, hidden_states=tuple(states) if output_hidden_states else None)


class {prefix}{head_class}({prefix}PreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.{base_prefix} = {prefix}Model(config)
        self.head = nn.Linear(config.{hidden_key}, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False, return_dict=True, **kwargs):
        out = self.{base_prefix}(input_ids, attention_mask, output_hidden_states=output_hidden_states)
        return {output_class}(logits=self.head(out.last_hidden_state), hidden_states=out.hidden_states)
'''

_CONFIG_SOURCE = '''"""The configuration of a minimal {title}-shaped model for run_shards' tests."""
from transformers import PretrainedConfig


class {config_class}(PretrainedConfig):
    model_type = "{model_type}"

    def __init__(self, vocab_size={vocab_size}, {hidden_key}=32, {inner_key}=64, {layers_key}=2,
                 {eps_key}=1e-5, **kwargs):
        self.vocab_size = vocab_size
        self.{hidden_key}, self.{inner_key}, self.{layers_key} = {hidden_key}, {inner_key}, {layers_key}
        self.{eps_key} = {eps_key}
        super().__init__(**kwargs)
'''


@dataclass(frozen=True)
class RemoteShape:
    """How one published remote-code family names things: model_type, files, classes and config keys."""
    title: str
    model_type: str
    config_module: str
    model_module: str
    prefix: str
    head_class: str
    causal: bool
    keys: tuple[str, str, str, str]       # hidden, inner, layers, eps
    extra_config: dict
    vocab: tuple[str, ...]


SHAPES = {
    # DNABERT-2 (zhihan1996/DNABERT-2-117M): model_type "bert" (transformers knows it!), bert_layers.py.
    "dnabert2_remote": RemoteShape(
        "DNABERT-2", "bert", "configuration_bert", "bert_layers", "Bert", "ForMaskedLM", False,
        ("hidden_size", "intermediate_size", "num_hidden_layers", "layer_norm_eps"),
        {"alibi_starting_size": 512, "attention_probs_dropout_prob": 0.0, "hidden_act": "gelu",
         "hidden_dropout_prob": 0.1, "max_position_embeddings": 512, "num_attention_heads": 4,
         "position_embedding_type": "absolute", "type_vocab_size": 2},
        ("[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]", "A", "C", "G", "T", "N", "AA", "AC", "AG", "AT", "CA", "CG",
         "TA", "TG", "GA", "GC")),
    # HyenaDNA (LongSafari/hyenadna-*-hf): model_type "hyenadna", configuration_hyena.py / modeling_hyena.py.
    "hyenadna_remote": RemoteShape(
        "HyenaDNA", "hyenadna", "configuration_hyena", "modeling_hyena", "HyenaDNA", "ForCausalLM", True,
        ("d_model", "d_inner", "n_layer", "layer_norm_epsilon"),
        {"max_seq_len": 1026, "pad_vocab_size_multiple": 8, "emb_dim": 5, "filter_order": 64,
         "short_filter_order": 3, "activation_freq": 10, "resid_dropout": 0.0, "embed_dropout": 0.1},
        ("[CLS]", "[SEP]", "[BOS]", "[MASK]", "[PAD]", "[RESERVED]", "[UNK]", "A", "C", "G", "T", "N")),
    # ProGen2 as its original code ships (e.g. hugohrban/progen2-small): model_type "progen".
    "progen2_remote": RemoteShape(
        "ProGen2", "progen", "configuration_progen", "modeling_progen", "ProGen", "ForCausalLM", True,
        ("n_embd", "n_inner", "n_layer", "layer_norm_epsilon"),
        {"n_head": 4, "rotary_dim": 8, "n_positions": 1024, "n_ctx": 1024, "activation_function": "gelu_new",
         "bos_token_id": 1, "eos_token_id": 2},
        ("<|pad|>", "<|bos|>", "<|eos|>", "1", "2") + tuple("ABCDEFGHIKLMNOPQRSTUVWXYZ")),
}


def write_remote_code(name: str, directory: Path) -> RemoteShape:
    """The Python files, config.json and tokenizer of a remote-code checkpoint (weights are written by the
    caller, which loads the model class from these very files)."""
    shape = SHAPES[name]
    hidden, inner, layers, eps = shape.keys
    fields = dict(title=shape.title, model_type=shape.model_type, config_module=shape.config_module,
                  config_class=f"{shape.prefix}Config", prefix=shape.prefix, head_class=shape.head_class,
                  causal=shape.causal, hidden_key=hidden, inner_key=inner, layers_key=layers, eps_key=eps,
                  base_prefix=shape.model_type if shape.model_type != "bert" else "bert",
                  vocab_size=len(shape.vocab),
                  output_class="CausalLMOutput" if shape.causal else "MaskedLMOutput")
    (directory / f"{shape.config_module}.py").write_text(_CONFIG_SOURCE.format(**fields))
    (directory / f"{shape.model_module}.py").write_text(_MODEL_SOURCE.format(**fields))
    head_auto = "AutoModelForCausalLM" if shape.causal else "AutoModelForMaskedLM"
    config = {"architectures": [f"{shape.prefix}{shape.head_class}"],
              "auto_map": {"AutoConfig": f"{shape.config_module}.{shape.prefix}Config",
                           "AutoModel": f"{shape.model_module}.{shape.prefix}Model",
                           head_auto: f"{shape.model_module}.{shape.prefix}{shape.head_class}"},
              "model_type": shape.model_type, "vocab_size": len(shape.vocab),
              hidden: 32, inner: 64, layers: 2, eps: 1e-5, "torch_dtype": "float32"} | shape.extra_config
    write_json(directory / "config.json", config)
    _write_tokenizer(shape, directory)
    return shape


def _write_tokenizer(shape: RemoteShape, directory: Path) -> None:
    """A character-level tokenizer.json (DNABERT-2's is a BPE, HyenaDNA's a remote Python class: see
    FAMILIES.md) with the family's special tokens and framing."""
    vocab = {token: i for i, token in enumerate(shape.vocab)}
    unk = next(t for t in shape.vocab if "UNK" in t or t == "<|pad|>")
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    specials = [t for t in shape.vocab if t.startswith(("[", "<|"))]
    tokenizer.add_special_tokens(specials)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1024}
    if shape.model_type == "bert":
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
        config |= {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
                   "mask_token": "[MASK]"}
    elif shape.model_type == "hyenadna":
        tokenizer.post_processor = processors.TemplateProcessing(single="$A [SEP]",
                                                                 special_tokens=[("[SEP]", vocab["[SEP]"])])
        config |= {"sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]"}
    else:
        config |= {"pad_token": "<|pad|>", "bos_token": "<|bos|>", "eos_token": "<|eos|>"}
    tokenizer.save(str(directory / "tokenizer.json"))
    write_json(directory / "tokenizer_config.json", config)


def load_remote_class(directory: Path, shape: RemoteShape):
    """The head class from the checkpoint's own files, as transformers' dynamic-module loader imports it."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module
    config = json.loads((directory / "config.json").read_text())
    head = next(v for k, v in config["auto_map"].items() if k.startswith("AutoModelFor"))
    return get_class_from_dynamic_module(head, str(directory))
