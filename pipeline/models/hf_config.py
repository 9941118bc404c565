"""What a transformers checkpoint's config and tokenizer say about it, without building it on a device:
its text config, whether it is a causal LM, and its hard per-sequence token limit. Read by planning, both
engines and the demo model; imports transformers and torch only inside its functions."""
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


def quiet_transformers() -> None:
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def model_max_tokens(config, tokenizer) -> int | None:
    """The hard per-sequence token limit: a learned position table, or the tokenizer's trained maximum."""
    limits = [n for n in (position_table_tokens(config),) if n]
    mml = getattr(tokenizer, "model_max_length", None)
    if isinstance(mml, int) and 0 < mml < 10**7:
        limits.append(mml)
    return min(limits) if limits else None


# Families whose positions are rotary only, by design: answered without building them, which would import
# their transformers modeling code (about 2 s of every run's planning). tests/test_units.py holds this list
# to what building them finds.
ROTARY_ONLY_MODEL_TYPES = ("llama", "qwen3", "qwen3_5", "qwen3_5_text")


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

    if config.model_type in ROTARY_ONLY_MODEL_TYPES:
        return None
    try:
        with torch.device("meta"):
            model = AutoModel.from_config(config)
    except Exception as e:   # an architecture AutoModel cannot build: fall back to the config's word
        log.debug("could not build %s on the meta device (%s)", config.model_type, e)
        if getattr(config, "position_embedding_type", None) == "absolute" and getattr(config, "max_position_embeddings", 0):
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
