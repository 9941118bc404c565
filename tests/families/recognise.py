"""Which model card's usage applies to a checkpoint, told from its files alone (config.json model_type and
architectures, the tokenizer's vocabulary), never from its name or path: the recognition rules of FAMILIES.md.
"""
from __future__ import annotations

import json
from pathlib import Path

CAUSAL_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "qwen3_5", "qwen3_5_text", "gpt2"}


def vocabulary(ckpt: Path) -> dict[str, int]:
    """Token -> id from whichever published tokenizer files the checkpoint has."""
    vocab: dict[str, int] = {}
    if (ckpt / "vocab.txt").exists():
        lines = (ckpt / "vocab.txt").read_text(encoding="utf-8").splitlines()
        vocab = {token: i for i, token in enumerate(lines)}
    elif (ckpt / "tokenizer.json").exists():
        spec = json.loads((ckpt / "tokenizer.json").read_text(encoding="utf-8"))
        model_vocab = spec["model"]["vocab"]
        vocab = ({entry[0]: i for i, entry in enumerate(model_vocab)} if isinstance(model_vocab, list)
                 else dict(model_vocab))
        vocab |= {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    elif (ckpt / "spiece.model").exists():
        from transformers.convert_slow_tokenizer import import_protobuf
        proto = import_protobuf().ModelProto()
        proto.ParseFromString((ckpt / "spiece.model").read_bytes())
        vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    if (ckpt / "added_tokens.json").exists():
        vocab |= json.loads((ckpt / "added_tokens.json").read_text(encoding="utf-8"))
    return vocab


def recognise(ckpt: Path) -> str:
    """The card key: esm, saprot, nucleotide_transformer, prott5, prostt5, ankh, protbert, protgpt2,
    causal_lm or remote_code; ValueError naming what was seen when none fits."""
    config = json.loads((ckpt / "config.json").read_text(encoding="utf-8"))
    model_type = config.get("model_type")
    architecture = (config.get("architectures") or [""])[0]
    if "auto_map" in config:
        return "remote_code"
    vocab = vocabulary(ckpt)
    if model_type == "t5":
        if "<AA2fold>" in vocab:
            return "prostt5"
        if "▁A" in vocab and "▁L" in vocab:
            return "prott5"
        if "A" in vocab and "L" in vocab and "▁A" not in vocab:
            return "ankh"
    if model_type == "esm":
        if "A#" in vocab:
            return "saprot"
        if "AAAAAA" in vocab:
            return "nucleotide_transformer"
        if "<cls>" in vocab and "L" in vocab:
            return "esm"
    if model_type in (None, "bert") and architecture.startswith("Bert") and "[CLS]" in vocab and "L" in vocab:
        return "protbert"
    if model_type == "gpt2" and vocab.get("<|endoftext|>") == 0:
        return "protgpt2"
    if model_type in CAUSAL_MODEL_TYPES:
        return "causal_lm"
    raise ValueError(f"{ckpt}: no card for model_type {model_type!r}, architecture {architecture!r} "
                     f"with a vocabulary of {len(vocab)} tokens")
