"""The table lookup (pipeline/tasks/residue_lookup.py) gives exactly the tokens of the tokenizer's own path
(transformers' tokenizer called on the convention's text, as each model card does, with SequenceTokenizer's
per-unit correction and truncation): ids, special masks, truncation and unknown counts, for every family in
tests/families on odd inputs; and where a tokenizer cannot be looked up exactly, the tokenizer runs."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pipeline.models import checkpoint, demo
from pipeline.models.conventions import PLAIN, PROTGPT2_FASTA, SPACED, Convention
from pipeline.tasks import residue_lookup
from pipeline.tasks.tokenization import SequenceTokenizer
from tests.families.checkpoints import BY_NAME, FAMILIES, VARIANTS
from tests.families.fixtures import family_checkpoint  # noqa: F401

from .tiny_models import ESM_VOCAB

PRINTABLE = "".join(chr(b) for b in range(33, 127))
_rng = np.random.default_rng(7)
INPUTS = [
    "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ",          # standard residues
    "MAUGCKZOBXW",                                 # rare residues (X on the cards that say so)
    "mktayiakqr", "MkTaYi",                        # lower case (the index upper-cases; direct callers may not)
    "MKVLJAAGIW", "MKJJJJJAG", "JJJ", "J", "A", "a",   # unknown characters and runs of them (ESM merges runs)
    "MK*-.#VL", "X#A#", "acdj", "#c",              # punctuation, SaProt's own characters
    "A<mask>C", "<cls>", "M[CLS]K", "<extra_id_0>A", "<bos>M", "M</s>",   # special tokens' text in a sequence
    "MKé", "MK VL", "",                            # non-ASCII, whitespace, empty
    PRINTABLE, PRINTABLE[::-1], *PRINTABLE,        # every character the table may answer for, alone too
    *(f"MK{c}{c}VL" for c in PRINTABLE),           # and between residues
    "".join(_rng.choice(list("ACDEFGHIKLMNPQRSTVWY"), 3000)),   # long
    "".join(_rng.choice(list(PRINTABLE), 700)),
]
LONG = INPUTS[-2]
# Families and conventions whose tokenizer gives each residue a token of its own, looked up.
LOOKED_UP = {"esm2_t6_8m", "esm2_t33_650m", "esm1b", "esm1v", "prot_t5_xl_u50", "prot_t5_xl_half_enc", "prostt5",
             "ankh_base", "ankh_large", "prot_bert", "prot_bert_bfd", "saprot", "prot_t5_xl_half_enc_spm_only",
             "hyenadna_remote/plain", "progen2_remote/plain"}


def _cases() -> list[tuple[str, Convention | None]]:
    """Each family with its card's convention; those without one (remote code) as written and spaced."""
    cases = []
    for name in FAMILIES + VARIANTS:
        if BY_NAME[name].kind == "remote_code":
            cases += [(name, PLAIN), (name, SPACED)]
        else:
            cases.append((name, None))
    return cases


def _tokenizer(family_checkpoint, name: str, convention: Convention | None):
    remote = BY_NAME[name].kind == "remote_code"
    source = checkpoint.local_source(str(family_checkpoint(name)))
    hf = checkpoint.read_tokenizer(source, checkpoint.read_config(source, remote), remote)
    return hf, convention or source.family.convention


def _as_tuples(toks) -> list[tuple]:
    return [(t.ids, t.special.tolist(), t.truncated, t.num_unknown, t.residues) for t in toks]


def _assert_identical(hf, convention: Convention, inputs: list[str], max_tokens: int | None) -> SequenceTokenizer:
    fast = SequenceTokenizer(hf, convention, max_tokens=max_tokens)
    reference = SequenceTokenizer(hf, convention, max_tokens=max_tokens, lookup=False)
    assert not reference.looks_up
    ours, theirs = _as_tuples(fast.encode(inputs)), _as_tuples(reference.encode(inputs))
    for s, a, b in zip(inputs, ours, theirs):
        assert a == b, (s[:40], a, b)
    return fast


@pytest.mark.parametrize("name,convention", _cases(), ids=lambda x: x.name if isinstance(x, Convention) else x)
def test_lookup_equals_the_tokenizer(name, convention, family_checkpoint):
    hf, conv = _tokenizer(family_checkpoint, name, convention)
    for max_tokens in (6, 40, None):   # truncation keeps the leading and trailing special tokens
        fast = _assert_identical(hf, conv, INPUTS, max_tokens)
    key = f"{name}/{convention.name}" if convention else name
    assert fast.looks_up == (key in LOOKED_UP), key
    if fast.looks_up:
        # The tokenizer's own call, as the card makes it, gives the same ids where nothing was corrected.
        for s, tok in zip([INPUTS[0], LONG], fast.encode([INPUTS[0], LONG])):
            assert tok.ids == hf(conv.text(s))["input_ids"]
        # Every character the table answers for is looked up in some input: one wrong entry would show above.
        lookup = fast._lookup
        looked_up = "".join(s for s, ids in zip(INPUTS, lookup.ids(INPUTS)) if ids is not None)
        assert {chr(b) for b in range(256) if lookup.safe[b]} <= set(looked_up)
        assert lookup.safe[[ord(c) for c in "ACDEFGHIKLMNPQRSTVWY"]].all()


def test_one_wrong_entry_changes_the_ids(family_checkpoint):
    """The comparison above sees a single wrong table entry, whichever character it is."""
    hf, conv = _tokenizer(family_checkpoint, "esm2_t6_8m", None)
    tok = SequenceTokenizer(hf, conv)
    reference = _as_tuples(SequenceTokenizer(hf, conv, lookup=False).encode(INPUTS))
    lookup = tok._lookup
    for b in np.flatnonzero(lookup.safe):
        table = lookup.table.copy()
        table[b] = hf.unk_token_id if table[b] != hf.unk_token_id else hf.convert_tokens_to_ids("A")
        tok._lookup = dataclasses.replace(lookup, table=table)
        assert _as_tuples(tok.encode(INPUTS)) != reference, chr(b)


def test_esm_special_text_and_unknown_runs(family_checkpoint):
    """'<' could start `<mask>`: a sequence holding it takes the tokenizer; unknown runs are one token per
    residue either way."""
    hf, conv = _tokenizer(family_checkpoint, "esm2_t6_8m", None)
    tok = SequenceTokenizer(hf, conv, max_tokens=6)
    assert not tok._lookup.safe[ord("<")] and tok._lookup.safe[ord("J")] and tok._lookup.safe[ord("a")]
    assert tok._lookup.ids(["A<mask>C", "MKJJJAG"])[0] is None
    runs = tok.encode(["MKJJJAG"])[0]
    unk = hf.unk_token_id
    assert runs.ids == [hf.cls_token_id, hf.convert_tokens_to_ids("M"), hf.convert_tokens_to_ids("K"), unk, unk,
                        hf.eos_token_id]
    assert runs.truncated and runs.num_unknown == 2 and runs.special.tolist() == [True] + [False] * 4 + [True]
    _assert_identical(hf, conv, ["A<mask>C", "MKJJJAG", "JJJJJJJJ"], 6)


def test_saprot_3di_letters_take_the_tokenizer(family_checkpoint):
    """In SaProt's 'a#c#d#j#', the vocabulary's '#c' and '#d' join two residues' text: the table would give four
    unknown tokens, the tokenizer gives <unk> #c #d <unk>. Lower-case 3Di letters are left to the tokenizer."""
    hf, conv = _tokenizer(family_checkpoint, "saprot", None)
    tok = _assert_identical(hf, conv, ["acdj", "MKac"], None)
    assert tok.looks_up and not tok._lookup.safe[ord("c")] and tok._lookup.safe[ord("C")]
    assert hf.convert_ids_to_tokens(tok.encode(["acdj"])[0].ids) == ["<cls>", "<unk>", "#c", "#d", "<unk>", "<eos>"]


def _char_tokenizer(normalizer=None, unk: str = "<unk>"):
    """The demo model's character-level tokenizer, with a normaliser or another unknown token."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(demo.VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    if normalizer is not None:
        core.normalizer = normalizer
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", vocab["<bos>"]), ("<eos>", vocab["<eos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", unk_token=unk,
                                   pad_token="<pad>")


def test_demo_tokenizer_looks_up():
    _assert_identical(demo.build_tokenizer(), PLAIN, INPUTS, None)
    assert SequenceTokenizer(demo.build_tokenizer()).looks_up


def test_context_the_probes_see_means_no_lookup():
    """A normaliser that rewrites 'AC' as 'CA': every character alone looks fine, the probes of neighbours
    differ, so no lookup at all; the tokenizer's ids as they are."""
    from tokenizers import normalizers
    hf = _char_tokenizer(normalizers.Replace("AC", "CA"))
    assert not SequenceTokenizer(hf).looks_up
    _assert_identical(hf, PLAIN, INPUTS, None)
    assert SequenceTokenizer(hf).encode(["MAC"])[0].ids == hf("MAC")["input_ids"]


def test_a_vocabulary_that_joins_residues_means_no_lookup(tmp_path):
    """ESM's vocabulary with a two-residue token 'AG': the trie would cut it where it occurs."""
    from transformers import EsmTokenizer
    (tmp_path / "vocab.txt").write_text("\n".join(ESM_VOCAB + ["AG"]) + "\n")
    hf = EsmTokenizer(str(tmp_path / "vocab.txt"))
    assert not SequenceTokenizer(hf).looks_up
    _assert_identical(hf, PLAIN, INPUTS + ["MAGAG"], 6)


def test_a_special_unknown_token_leaves_unknown_characters_to_the_tokenizer():
    """Where the unknown token is one of the named special tokens (ProtGPT2's <|endoftext|> is), an unknown
    character is a special token on the tokenizer's path: the table does not answer for it."""
    hf = _char_tokenizer(unk="<eos>")
    tok = SequenceTokenizer(hf)
    assert tok.looks_up and not tok._lookup.safe[ord("J")] and tok._lookup.safe[ord("A")]
    _assert_identical(hf, PLAIN, INPUTS, 8)


def test_line_breaks_mean_no_lookup():
    """ProtGPT2's 60-residue lines put a token between residues: never looked up."""
    assert residue_lookup.build(demo.build_tokenizer(), PROTGPT2_FASTA, lambda s: [], True) is None


@pytest.mark.parametrize("name", ["llama2", "llama3", "qwen3", "ankh_base", "nucleotide_transformer_v1",
                                  "prot_t5_xl_half_enc", "esm2_t6_8m", "saprot", "prostt5", "protgpt2"])
def test_tokens_for_residues_bounds_every_input_format(name, family_checkpoint):
    """The plan's bound on a record's tokens (the native engine's KV cache is sized for the longest record's,
    and --on-long finds the records over a limit by it) is never below the tokens the record has, with the
    family's convention and each --input-format: residues spaced through a subword vocabulary take two tokens
    each (" K" is "▁", "K"), which a bound of one per residue put under (a 300-residue record's 599 tokens
    stopped a run mid-shard: "exceeds the engine's KV cache of 400 tokens")."""
    hf, card = _tokenizer(family_checkpoint, name, None)
    ascii_inputs = [s for s in INPUTS if s.isascii() and s and not any(c.isspace() for c in s)]
    for convention in {card, PLAIN, SPACED} - {None}:
        tok = SequenceTokenizer(hf, convention)
        texts = ascii_inputs if convention.keeps_case else [s.upper() for s in ascii_inputs]   # as the index reads
        bounds = tok.tokens_for_residues(np.array([len(s) for s in texts]))
        for s, bound, encoded in zip(texts, bounds, tok.encode(texts)):
            assert len(encoded.ids) <= bound, (name, convention.name, s[:40], len(encoded.ids), int(bound))
