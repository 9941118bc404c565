"""Small BPE tokenizers of the kinds causal LMs publish, built offline with the `tokenizers` library: the
published vocabularies (32k-152k entries) cannot be carried, so each keeps its family's model kind,
pre-tokenizer, normalizer, post-processor and special-token layout with merges learned from a fixed corpus.

- SentencePiece-style BPE with byte fallback (Llama 2, Mistral 7B v0.1): <unk> <s> </s>, 256 <0xNN> tokens,
  then the learned pieces; "▁" marks a word start.
- Byte-level BPE with the tiktoken-style split regex (Llama 3), or Qwen's regex and NFC (Qwen2/2.5/3/3.5),
  special tokens after the learned vocabulary; GPT-2 byte-level BPE with <|endoftext|> at id 0 (ProtGPT2).
"""
from __future__ import annotations

import json
import random

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

AMINO = "ACDEFGHIKLMNPQRSTVWY"
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")

QWEN3_5_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def corpus(seed: int = 20240611) -> list[str]:
    """A fixed training text: protein sequences (FASTA-wrapped at 60 like ProtGPT2's data) and some prose."""
    rng = random.Random(seed)
    lines = []
    for _ in range(300):
        seq = "".join(rng.choice(AMINO) for _ in range(rng.randint(30, 150)))
        lines.append("\n".join(seq[i:i + 60] for i in range(0, len(seq), 60)))
    lines += ["The protein sequence below was scored by the model.", "Generate a protein: MKV 123 45."] * 5
    return lines


def _train(pre_tokenizer, vocab_size: int, alphabet: list[str]) -> tuple[dict[str, int], list[str]]:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet, show_progress=False,
                                  special_tokens=[])
    tokenizer.train_from_iterator(corpus(), trainer)
    model = json.loads(tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return model["vocab"], merges


def sentencepiece_bpe(learned: int = 160) -> Tokenizer:
    """Llama 2 / Mistral v0.1 tokenizer.json: specials 0-2, byte tokens 3-258, learned pieces after."""
    meta = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    vocab_learned, merges = _train(meta, learned, ["▁"])
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in sorted(vocab_learned, key=vocab_learned.get):
        vocab.setdefault(piece, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges],
                                     unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", 1)])
    return tokenizer


def byte_level_bpe(regex: str | None, nfc: bool, specials: list[str], learned: int = 200,
                   bos_template: str | None = None, specials_first: bool = False) -> Tokenizer:
    """A byte-level BPE: split by `regex` then bytes-to-unicode (GPT-2's ByteLevel with its own regex when
    `regex` is None); `specials` after the learned vocabulary, or before it with `specials_first`."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex is None)
    pre = (byte_level if regex is None else
           pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                                    byte_level]))
    vocab_learned, merges = _train(pre, 256 + learned, pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(specials)} if specials_first else {}
    for piece in sorted(vocab_learned, key=vocab_learned.get):
        vocab.setdefault(piece, len(vocab))
    if not specials_first:
        vocab |= {s: len(vocab) + i for i, s in enumerate(specials)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges],
                                     ignore_merges=regex == LLAMA3_REGEX))
    if nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    steps = [processors.ByteLevel(trim_offsets=False)]
    if bos_template:
        steps.append(processors.TemplateProcessing(single=f"{bos_template} $A",
                                                   pair=f"{bos_template} $A {bos_template} $B",
                                                   special_tokens=[(bos_template, vocab[bos_template])]))
    tokenizer.post_processor = processors.Sequence(steps)
    return tokenizer
