"""A transformers checkpoint's config and tokenizer, loaded as its family needs (models/registry.py), and what
they say without building the model on a device: its text config, whether it is a causal LM, its hard
per-sequence token limit. Read by planning, both engines and the demo model; imports transformers and torch
only inside its functions."""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def text_config(config):
    """The text part of a config (a multimodal checkpoint's `text_config`), or the config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def is_causal_lm(model_type: str, architectures: list[str]) -> bool:
    """A causal LM by its checkpoint's architecture names (any of transformers' causal-LM classes, e.g. GPT-2's
    GPT2LMHeadModel, not only *ForCausalLM), or by its model type when the config names none."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if architectures:
        return any(a in causal or a.endswith("ForCausalLM") for a in architectures)
    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def is_masked_lm(architectures: list[str]) -> bool:
    """A masked LM with its head: the checkpoint's config names a *ForMaskedLM class (ESM-2, ESM-1b, ESM-1v,
    SaProt: EsmForMaskedLM; ProtBert: BertForMaskedLM). A checkpoint saved as the bare encoder (EsmModel) has no
    language-model head, so nothing to score with."""
    return any(a.endswith("ForMaskedLM") for a in architectures)


# Where configs keep the width and depth: transformers' own configs answer hidden_size/num_hidden_layers
# (their attribute maps); remote-code ones use the names of their original code (HyenaDNA d_model/n_layer,
# ProGen2 n_embd/n_layer).
WIDTH_FIELDS = ("hidden_size", "d_model", "n_embd", "dim")
DEPTH_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def model_shape(config) -> tuple[int, int]:
    """(hidden size, number of layers) of a text config; UserError naming the fields looked for."""
    def first(fields):
        return next((v for v in (getattr(config, f, None) for f in fields) if isinstance(v, int) and v > 0), None)
    width, depth = first(WIDTH_FIELDS), first(DEPTH_FIELDS)
    if width is None or depth is None:
        from ..errors import UserError
        raise UserError(f"config.json gives no {'hidden size' if width is None else 'number of layers'} under any "
                        f"of {', '.join(WIDTH_FIELDS if width is None else DEPTH_FIELDS)}; run_shards cannot size "
                        "its outputs for this model")
    return width, depth


def quiet_transformers() -> None:
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def load_config(facts, trust_remote_code: bool = False):
    """The checkpoint's transformers config. One written before configs named their model type (ProtBert's)
    is read with the config class its architecture implies."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if not facts.config.get("model_type") and facts.model_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[facts.model_type].from_pretrained(facts.path)
    return AutoConfig.from_pretrained(facts.path, trust_remote_code=trust_remote_code)


def load_tokenizer(facts, family, config, trust_remote_code: bool = False):
    """The checkpoint's tokenizer as its family's card uses it: AutoTokenizer, or the checkpoint's
    tokenizer.json pipeline as written where AutoTokenizer would rebuild it differently (Ankh: transformers 5's
    T5Tokenizer puts a word marker before every word, which Ankh's vocabulary does not have)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    if family.tokenizer_json:
        from pathlib import Path
        special = _special_tokens_of(Path(facts.path))
        return PreTrainedTokenizerFast(tokenizer_file=str(Path(facts.path) / "tokenizer.json"), **special)
    return AutoTokenizer.from_pretrained(facts.path, config=config, trust_remote_code=trust_remote_code)


def _special_tokens_of(path) -> dict:
    """The named special tokens of special_tokens_map.json / tokenizer_config.json (eos, unk, pad, ...)."""
    import json
    found = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = path / name
        data = json.loads(f.read_text(encoding="utf-8")) if f.exists() else {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token", "cls_token", "sep_token", "mask_token"):
            value = data.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                found[key] = value
    return found


def model_max_tokens(config, tokenizer, position_table=None) -> int | None:
    """The hard per-sequence token limit: a learned position table, or the tokenizer's trained maximum.
    `position_table(config)` (the registry's, for families that fix where the table is) says the table's size
    without building the model; without one the model is built on the meta device to find it."""
    limits = [n for n in ((position_table or position_table_tokens)(config),) if n]
    mml = getattr(tokenizer, "model_max_length", None)
    if isinstance(mml, int) and 0 < mml < 10**7:
        limits.append(mml)
    return min(limits) if limits else None


def position_table_tokens(config) -> int | None:
    """Positions a learned absolute position table holds (GPT-2's `wpe`, BERT's, RoBERTa's, OPT's, ESM-1b's),
    found by building the model on the meta device (no weights, no memory); None without one (rotary).

    Config fields alone do not say it: transformers 5 dropped `position_embedding_type` from most configs,
    and GPT-2 calls the size `n_positions`. Tables indexed from padding_idx + 1 (RoBERTa, ESM) or with an
    `offset` (OPT) hold that many fewer tokens.
    """
    import torch
    import torch.nn as nn
    from transformers import AutoModel

    try:
        with torch.device("meta"):
            model = AutoModel.from_config(config)
    except Exception as e:   # an architecture AutoModel cannot build: fall back to the config's word
        log.debug("could not build %s on the meta device (%s)", config.model_type, e)
        if (getattr(config, "position_embedding_type", None) == "absolute"
                and getattr(config, "max_position_embeddings", 0)):
            return config.max_position_embeddings
        return None
    limits = []
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Embedding) and ("position" in last or last == "wpe"):
            offset = getattr(module, "offset", None)
            if offset is None:
                offset = module.padding_idx + 1 if module.padding_idx is not None else 0
            limits.append(module.num_embeddings - offset)
    return min(limits) if limits else None
