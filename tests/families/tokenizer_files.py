"""Writers for the tokenizer files the protein and DNA families publish: vocab.txt (ESM, ProtBert, SaProt,
Nucleotide Transformer, DNABERT), SentencePiece spiece.model (ProtT5, ProstT5) and tokenizer.json Unigram
models (the T5 converter's output for ProtT5/ProstT5; Ankh's own file).

spiece.model is written with the SentencePiece protobuf schema transformers ships, so a checkpoint can have
exactly the published file set; tokenizer.json files are built with the `tokenizers` library.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

MARKER = "▁"


def write_json(path: Path, payload: Any) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_vocab_txt(directory: Path, vocab: Sequence[str], tokenizer_config: dict,
                    special_tokens_map: dict) -> None:
    """A vocab.txt tokenizer as BERT/ESM checkpoints ship it: one token a line, the line number its id."""
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    write_json(directory / "tokenizer_config.json", tokenizer_config)
    write_json(directory / "special_tokens_map.json", special_tokens_map)


def write_spiece_model(path: Path, pieces: Sequence[str], unk_id: int = 2) -> None:
    """A SentencePiece Unigram model with these pieces: control tokens before `unk_id`, the unknown piece at
    `unk_id`, normal pieces after it (scores decreasing with the id, as SentencePiece writes frequency order)."""
    from transformers.convert_slow_tokenizer import import_protobuf
    model_pb2 = import_protobuf()
    proto = model_pb2.ModelProto()
    for i, piece in enumerate(pieces):
        entry = proto.pieces.add()
        entry.piece = piece
        entry.score = 0.0 if i <= unk_id else -float(i - unk_id)
        entry.type = 3 if i < unk_id else (2 if i == unk_id else 1)     # CONTROL, UNKNOWN, NORMAL
    proto.trainer_spec.model_type = 1                                       # UNIGRAM
    proto.trainer_spec.unk_id, proto.trainer_spec.pad_id = unk_id, 0
    proto.trainer_spec.eos_id, proto.trainer_spec.bos_id = 1, -1
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = True
    path.write_bytes(proto.SerializeToString())


def sentinels(count: int) -> list[str]:
    """T5's sentinel tokens in id order: the last id is <extra_id_0>."""
    return [f"<extra_id_{i}>" for i in range(count - 1, -1, -1)]


def t5_unigram(pieces: Sequence[str], extra_ids: int, metaspace: bool,
               added: dict[str, int] | None = None) -> Tokenizer:
    """A T5-style Unigram tokenizer.json: `pieces` (specials <pad> </s> <unk> first), `extra_ids` sentinels,
    then `added` tokens at their ids. With `metaspace`, the pipeline transformers' SentencePiece converter
    writes for a T5 model (ProtT5); without, no normalizer or pre-tokenizer at all (Ankh's file)."""
    vocab = [(p, 0.0 if i < 3 else -float(i - 2)) for i, p in enumerate(pieces)]
    vocab += [(s, 0.0) for s in sentinels(extra_ids)]
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    if metaspace:
        tokenizer.normalizer = normalizers.Sequence([normalizers.Strip(left=False, right=True),
                                                     normalizers.Replace(Regex(" {2,}"), MARKER)])
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=MARKER, prepend_scheme="always")
        tokenizer.decoder = decoders.Metaspace(replacement=MARKER, prepend_scheme="always")
    tokenizer.add_special_tokens(list(pieces[:3]) + sentinels(extra_ids))
    for token, token_id in sorted((added or {}).items(), key=lambda kv: kv[1]):
        assert tokenizer.get_vocab_size() == token_id, (token, token_id)
        tokenizer.add_tokens([token])
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                             special_tokens=[("</s>", 1)])
    return tokenizer


def t5_special_tokens_map(extra_ids: int) -> dict:
    return {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
            "additional_special_tokens": [f"<extra_id_{i}>" for i in range(extra_ids)]}
