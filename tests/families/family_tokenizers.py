"""Each family's tokenizer files, written as its published checkpoint has them (file set, tokenizer_config
and special tokens), from the vocabularies and BPE builders of this package. Each writer returns the special
token ids the config.json must carry (an empty dict where the published config's ids already fit)."""
from __future__ import annotations

from pathlib import Path

from . import lm_tokenizers as lm
from . import vocabularies as v
from .tokenizer_files import (t5_special_tokens_map, t5_unigram, write_json, write_spiece_model, write_vocab_txt)

BIG_MAX_LENGTH = 1000000000000000019884624838656     # transformers' "no limit", as old hub files carry it
_ESM_SPECIALS = {"cls_token": "<cls>", "eos_token": "<eos>", "mask_token": "<mask>", "pad_token": "<pad>",
                 "unk_token": "<unk>"}
_ESM_CONFIG = {"do_lower_case": False, "model_max_length": BIG_MAX_LENGTH, "tokenizer_class": "EsmTokenizer"}


def esm(directory: Path) -> dict:
    write_vocab_txt(directory, v.ESM_VOCAB, _ESM_CONFIG, _ESM_SPECIALS)
    return {}


def saprot(directory: Path) -> dict:
    write_vocab_txt(directory, v.SAPROT_VOCAB, _ESM_CONFIG, _ESM_SPECIALS)
    return {}


def nucleotide_transformer(directory: Path) -> dict:
    """No <eos> in the vocabulary and none appended: eos_token is null (see FAMILIES.md)."""
    specials = {k: t for k, t in _ESM_SPECIALS.items() if k != "eos_token"}
    write_vocab_txt(directory, v.NT_VOCAB, {"model_max_length": 1000, "tokenizer_class": "EsmTokenizer",
                                            "eos_token": None}, specials)
    return {}


def protbert(directory: Path) -> dict:
    write_vocab_txt(directory, v.PROTBERT_VOCAB, {"do_lower_case": False},
                    {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                     "mask_token": "[MASK]"})
    return {}


def prott5(directory: Path, with_tokenizer_json: bool = True) -> dict:
    """spiece.model as published; with `with_tokenizer_json` also the tokenizer.json transformers' converter
    makes of it (loading spiece.model alone needs the sentencepiece package; see FAMILIES.md)."""
    write_spiece_model(directory / "spiece.model", v.PROTT5_PIECES)
    if with_tokenizer_json:
        t5_unigram(v.PROTT5_PIECES, v.PROTT5_EXTRA_IDS, metaspace=True).save(str(directory / "tokenizer.json"))
    write_json(directory / "tokenizer_config.json", {"do_lower_case": False, "extra_ids": v.PROTT5_EXTRA_IDS,
                                                     "model_max_length": BIG_MAX_LENGTH})
    write_json(directory / "special_tokens_map.json", t5_special_tokens_map(v.PROTT5_EXTRA_IDS))
    return {}


def prostt5(directory: Path) -> dict:
    prott5(directory, with_tokenizer_json=False)
    write_json(directory / "added_tokens.json", v.PROSTT5_ADDED)
    t5_unigram(v.PROTT5_PIECES, v.PROTT5_EXTRA_IDS, metaspace=True,
               added=v.PROSTT5_ADDED).save(str(directory / "tokenizer.json"))
    return {}


def ankh(directory: Path) -> dict:
    extra = v.ANKH_VOCAB_SIZE - len(v.ANKH_PIECES)
    t5_unigram(v.ANKH_PIECES, extra, metaspace=False).save(str(directory / "tokenizer.json"))
    write_json(directory / "tokenizer_config.json", {"tokenizer_class": "T5Tokenizer", "extra_ids": extra,
                                                     "model_max_length": BIG_MAX_LENGTH})
    write_json(directory / "special_tokens_map.json", t5_special_tokens_map(extra))
    return {}


def llama2(directory: Path) -> dict:
    """Llama 2 / Mistral 7B v0.1: <unk> <s> </s> at 0-2 as published, so the config's ids stand; the
    embedding has as many rows as the tokenizer has tokens, as the published 32,000 do."""
    tokenizer = lm.sentencepiece_bpe()
    tokenizer.save(str(directory / "tokenizer.json"))
    write_json(directory / "tokenizer_config.json", {
        "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": None, "legacy": False, "clean_up_tokenization_spaces": False, "model_max_length": BIG_MAX_LENGTH,
        "padding_side": "right", "sp_model_kwargs": {}, "tokenizer_class": "LlamaTokenizer"})
    write_json(directory / "special_tokens_map.json", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    return {"vocab_size": tokenizer.get_vocab_size()}


LLAMA3_SPECIALS = (["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"])


def llama3(directory: Path) -> dict:
    tokenizer = lm.byte_level_bpe(lm.LLAMA3_REGEX, nfc=False, specials=LLAMA3_SPECIALS,
                                  bos_template="<|begin_of_text|>")
    tokenizer.save(str(directory / "tokenizer.json"))
    write_json(directory / "tokenizer_config.json", {
        "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "clean_up_tokenization_spaces": True,
        "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast"})
    write_json(directory / "special_tokens_map.json", {"bos_token": "<|begin_of_text|>",
                                                        "eos_token": "<|end_of_text|>"})
    ids = tokenizer.get_vocab()
    return {"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": ids["<|end_of_text|>"],
            "vocab_size": tokenizer.get_vocab_size()}


QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>"]


def qwen(directory: Path, eos: str, regex: str = lm.QWEN_REGEX) -> dict:
    """Qwen2/2.5/3/3.5: no BOS is added; the embedding table is padded past the tokenizer to a multiple of
    128 rows, as the published 151,936 rows are past 151,665 tokens."""
    tokenizer = lm.byte_level_bpe(regex, nfc=True, specials=QWEN_SPECIALS)
    tokenizer.save(str(directory / "tokenizer.json"))
    write_json(directory / "tokenizer_config.json", {
        "add_prefix_space": False, "bos_token": None, "eos_token": eos, "pad_token": "<|endoftext|>",
        "errors": "replace", "model_max_length": 131072, "split_special_tokens": False, "unk_token": None,
        "clean_up_tokenization_spaces": False, "tokenizer_class": "Qwen2Tokenizer"})
    ids = tokenizer.get_vocab()
    size = tokenizer.get_vocab_size()
    return {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids[eos], "vocab_size": -(-size // 128) * 128}


def protgpt2(directory: Path) -> dict:
    """GPT-2 byte-level BPE learned on proteins, <|endoftext|> at id 0 (ProtGPT2's bos = eos = 0)."""
    tokenizer = lm.byte_level_bpe(None, nfc=False, specials=["<|endoftext|>"], specials_first=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    write_json(directory / "tokenizer_config.json", {
        "add_prefix_space": False, "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>", "model_max_length": 1024, "tokenizer_class": "GPT2Tokenizer"})
    write_json(directory / "special_tokens_map.json", {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                                                        "unk_token": "<|endoftext|>"})
    return {"vocab_size": tokenizer.get_vocab_size()}
