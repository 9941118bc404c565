"""The family checkpoints of tests/families are what their published checkpoints are: they load the way the
published ones do (or fail the way they do), their tokenizers are the published kind and behave as the
published ones on sample inputs, only size fields differ from the published config, and each model card's
usage (tests/families/card_usage.py) runs on them with float32 as accurate as float64 grounds it.
"""
from __future__ import annotations

import filecmp
import importlib.util
import json

import pytest
import torch
import transformers as tf
from tokenizers import Tokenizer

from tests.families import card_usage, vocabularies
from tests.families.checkpoints import BY_NAME, FAMILIES, build
from tests.families.fixtures import family_checkpoint  # noqa: F401  (session fixture)
from tests.families.published_configs import PUBLISHED, TINY, tiny_config
from tests.families.recognise import recognise
from tests.float64_reference import relative_error

SEQS = ["MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ", "GSUZBOXLLK", "MA"]
STANDARD = ["MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ", "GSLLKWCDEH", "MA"]   # SaProt has the 20 only
DNA = ["ATTCCGATTCCGATTCCGAT", "ATTTCTCTCTCTCTCTGAGATCGATCGATCGATN"]
REMOTE = [n for n in FAMILIES if BY_NAME[n].kind == "remote_code"]
EMBEDDERS = [n for n in FAMILIES if BY_NAME[n].kind in ("protein", "dna")]
SCORERS = [n for n in FAMILIES if BY_NAME[n].kind == "causal_lm"]
CARD = {"esm2_t6_8m": "esm", "esm2_t33_650m": "esm", "esm1b": "esm", "esm1v": "esm", "prot_t5_xl_u50": "prott5",
        "prot_t5_xl_half_enc": "prott5", "prostt5": "prostt5", "ankh_base": "ankh", "ankh_large": "ankh",
        "prot_bert": "protbert", "prot_bert_bfd": "protbert", "saprot": "saprot",
        "nucleotide_transformer_v1": "nucleotide_transformer", "protgpt2": "protgpt2"}
# The tokenizer class AutoTokenizer gives for the published checkpoint under transformers 5.
TOKENIZER_CLASS = {"esm": "EsmTokenizer", "saprot": "EsmTokenizer", "nucleotide_transformer": "EsmTokenizer",
                   "prott5": "T5Tokenizer", "prostt5": "T5Tokenizer", "ankh": "T5Tokenizer",
                   "protgpt2": "GPT2Tokenizer", "llama2": "LlamaTokenizer", "mistral": "TokenizersBackend",
                   "llama3": "TokenizersBackend", "qwen2": "Qwen2Tokenizer", "qwen3": "Qwen2Tokenizer",
                   "qwen3_5": "Qwen3_5Tokenizer"}
# float32 against float64: 2**-16 of the tensor's scale (128 float32 ulps) covers the rounding of these
# 2-4 layer models (measured: 3e-7 to 3e-6) with room for other CPUs' kernels; a reference that lost float64
# somewhere (e.g. float32 norms) still passes it, which is why float64 outputs are also checked for dtype.
BOUND = 2.0 ** -16


def _card(name: str) -> str:
    return CARD.get(name, "causal_lm" if BY_NAME[name].kind == "causal_lm" else "remote_code")


def _tokenizer_class(name: str) -> str:
    """By card; causal LMs by family (the Llama rope variants carry Llama 2's tokenizer)."""
    return TOKENIZER_CLASS.get(_card(name)) or TOKENIZER_CLASS.get(name, "LlamaTokenizer")


@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in REMOTE and n != "qwen3_5"])
def test_only_size_fields_differ_from_the_published_config(family_checkpoint, name):
    written = json.loads((family_checkpoint(name) / "config.json").read_text())
    assert written == tiny_config(name) | {k: written[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")
                                           if k in written}
    changed = {k for k in written if written[k] != PUBLISHED[name].get(k, object())}
    allowed = set(TINY[name]) | ({"vocab_size", "bos_token_id", "eos_token_id"} if name in SCORERS else set())
    assert changed <= allowed | ({"rope_scaling"} if name == "llama_rope_longrope" else set()), changed - allowed


def test_the_published_vocabularies_are_whole(family_checkpoint):
    vocabularies.check_sizes()
    for name, size in [("esm2_t6_8m", 33), ("prot_t5_xl_half_enc", 128), ("prostt5", 150), ("ankh_base", 144),
                       ("prot_bert", 30), ("saprot", 446), ("nucleotide_transformer_v1", 4105)]:
        config = json.loads((family_checkpoint(name) / "config.json").read_text())
        tokenizer = (tf.BertTokenizer.from_pretrained(family_checkpoint(name), do_lower_case=False)
                     if _card(name) == "protbert" else tf.AutoTokenizer.from_pretrained(family_checkpoint(name)))
        assert len(tokenizer) == config["vocab_size"] == size, name


@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in REMOTE and _card(n) != "protbert"])
def test_auto_classes_load_the_family(family_checkpoint, name):
    ckpt = family_checkpoint(name)
    config = tf.AutoConfig.from_pretrained(ckpt)
    assert type(tf.AutoTokenizer.from_pretrained(ckpt)).__name__ == _tokenizer_class(name)
    model = tf.AutoModel.from_pretrained(ckpt, dtype=torch.float32)
    assert model.config.model_type == config.model_type
    if name in SCORERS:
        lm = tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        tied = lm.get_output_embeddings().weight.data_ptr() == lm.get_input_embeddings().weight.data_ptr()
        text_config = config.get_text_config()
        assert tied == bool(text_config.tie_word_embeddings), name


def test_protbert_has_no_model_type_so_only_the_cards_classes_load_it(family_checkpoint):
    """Rostlab/prot_bert's config.json has no model_type; transformers 5 no longer guesses it from the
    repository name, so the Auto classes refuse it and the card's BertTokenizer/BertModel load it."""
    ckpt = family_checkpoint("prot_bert")
    with pytest.raises(ValueError, match="model_type"):
        tf.AutoConfig.from_pretrained(ckpt)
    assert type(tf.BertModel.from_pretrained(ckpt)).__name__ == "BertModel"
    assert type(tf.BertTokenizer.from_pretrained(ckpt)).__name__ == "BertTokenizer"


def test_t5_checkpoints_load_as_published(family_checkpoint):
    half = family_checkpoint("prot_t5_xl_half_enc")
    assert tf.T5EncoderModel.from_pretrained(half).dtype == torch.float16     # transformers 5 loads "auto"
    u50 = family_checkpoint("prot_t5_xl_u50")
    assert json.loads((u50 / "config.json").read_text())["architectures"] == ["T5ForConditionalGeneration"]
    tokens = tf.T5Tokenizer.from_pretrained(u50)("M K V", return_tensors="pt")
    with pytest.raises(ValueError, match="input_ids or inputs_embeds"):   # the U50 card's own call
        tf.T5Model.from_pretrained(u50)(**tokens, decoder_input_ids=None)
    ankh = tf.T5EncoderModel.from_pretrained(family_checkpoint("ankh_base")).config
    assert (ankh.is_gated_act, ankh.dense_act_fn, ankh.relative_attention_num_buckets) == (True, "gelu_new", 64)


def test_prott5_spiece_model_alone_needs_sentencepiece(family_checkpoint):
    """The half-precision encoder publishes spiece.model and no tokenizer.json; transformers 5 converts it only
    with the sentencepiece package installed, and without it fails with a message about tiktoken."""
    ckpt = build("prot_t5_xl_half_enc_spm_only", family_checkpoint("prot_t5_xl_half_enc").parent / "spm_only")
    assert not (ckpt / "tokenizer.json").exists()
    if importlib.util.find_spec("sentencepiece") is None:
        with pytest.raises(ValueError, match="tiktoken"):
            tf.AutoTokenizer.from_pretrained(ckpt)
    else:
        with_json = tf.AutoTokenizer.from_pretrained(family_checkpoint("prot_t5_xl_half_enc"))
        assert tf.AutoTokenizer.from_pretrained(ckpt)("M K V X").input_ids == with_json("M K V X").input_ids


def _ids(ckpt, text, **kwargs):
    tokenizer = tf.AutoTokenizer.from_pretrained(ckpt)
    return tokenizer.convert_ids_to_tokens(tokenizer(text, **kwargs).input_ids)


def test_protein_tokenizers_behave_as_published(family_checkpoint):
    prott5 = family_checkpoint("prot_t5_xl_half_enc")
    assert _ids(prott5, "M K U X") == ["▁M", "▁K", "▁U", "▁X", "</s>"]
    assert _ids(prott5, "MKUX") == ["▁M", "<unk>", "</s>"]                  # unspaced: the rest is one <unk>
    assert _ids(family_checkpoint("prostt5"), "<AA2fold> M K") == ["<AA2fold>", "▁M", "▁K", "</s>"]
    assert _ids(family_checkpoint("prostt5"), "<fold2AA> a c") == ["<fold2AA>", "a", "c", "</s>"]
    esm = family_checkpoint("esm2_t6_8m")
    assert _ids(esm, "MKVJ") == ["<cls>", "M", "K", "V", "<unk>", "<eos>"]
    assert _ids(esm, "mkv") == ["<cls>", "<unk>", "<eos>"]                  # lower case: one <unk> in all
    saprot = family_checkpoint("saprot")
    assert _ids(saprot, "A#") == ["<cls>", "A#", "<eos>"]
    assert _ids(saprot, "M#EvV#") == ["<cls>", "M#", "Ev", "V#", "<eos>"]
    assert _ids(saprot, "MEV") == ["<cls>", "<unk>", "<eos>"]               # residues alone: one <unk>
    protbert = tf.BertTokenizer.from_pretrained(family_checkpoint("prot_bert"), do_lower_case=False)
    assert protbert.convert_ids_to_tokens(protbert("M K V").input_ids) == ["[CLS]", "M", "K", "V", "[SEP]"]
    assert protbert.convert_ids_to_tokens(protbert("MKV").input_ids) == ["[CLS]", "[UNK]", "[SEP]"]


def test_ankh_tokenizer_file_splits_residues_but_transformers_5_adds_unknowns(family_checkpoint):
    """Ankh's tokenizer.json has no pre-tokenizer and no "▁" pieces; transformers 5's T5Tokenizer replaces
    the pre-tokenizer with Metaspace, so the card's is_split_into_words call puts <unk> before every residue."""
    ckpt = family_checkpoint("ankh_base")
    own = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    assert own.encode(list("MKV"), is_pretokenized=True).tokens == ["M", "K", "V", "</s>"]
    assert own.encode("MKV").tokens == ["M", "K", "V", "</s>"]
    tokenizer = tf.AutoTokenizer.from_pretrained(ckpt)
    literal = tokenizer.convert_ids_to_tokens(tokenizer(list("MKV"), is_split_into_words=True).input_ids)
    assert literal == ["<unk>", "M", "<unk>", "K", "<unk>", "V", "</s>"]


def test_saprot_card_refuses_residues_outside_its_twenty(family_checkpoint):
    """SaProt's vocabulary pairs only the 20 standard residues (and "#") with 3Di letters: "U#Z#" is one
    <unk>, so the card's form would shift every later residue; the reference refuses instead."""
    assert _ids(family_checkpoint("saprot"), "G#U#Z#L#") == ["<cls>", "G#", "<unk>", "L#", "<eos>"]
    with pytest.raises(ValueError, match="one token per residue"):
        card_usage.embed(family_checkpoint("saprot"), ["GUZL"])


def test_nucleotide_transformer_tokenizes_6mers_then_single_nucleotides(family_checkpoint):
    ckpt = family_checkpoint("nucleotide_transformer_v1")
    assert _ids(ckpt, "ATTCCGATTCCGA") == ["<cls>", "ATTCCG", "ATTCCG", "A"]        # no <eos>
    assert _ids(ckpt, "ATTCCGNTTCCGATT") == ["<cls>", "ATTCCG", "N", "TTCCGA", "T", "T"]
    assert _ids(ckpt, "attccg") == ["<cls>", "<unk>"]                               # soft-masked: one <unk>


@pytest.mark.parametrize("name", SCORERS)
def test_lm_tokenizers_frame_and_round_trip_as_published(family_checkpoint, name):
    ckpt = family_checkpoint(name)
    tokenizer = tf.AutoTokenizer.from_pretrained(ckpt)
    config = tf.AutoConfig.from_pretrained(ckpt).get_text_config()
    ids = tokenizer(SEQS[0]).input_ids
    first = {"llama3": "<|begin_of_text|>", "protgpt2": None}.get(name, None if "qwen" in name else "<s>")
    assert (tokenizer.convert_ids_to_tokens(ids[0]) if first else None) == first
    assert first is not None or ids[0] not in tokenizer.all_special_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == SEQS[0]
    assert max(ids) < config.vocab_size and tokenizer.convert_tokens_to_ids(tokenizer.eos_token) == (
        config.eos_token_id if isinstance(config.eos_token_id, int) else config.eos_token_id[0])
    if BY_NAME[name].tokenizer.__name__ == "llama2":                              # byte fallback, no <unk>
        assert "<0xE2>" in tokenizer.convert_ids_to_tokens(tokenizer("☃").input_ids)


@pytest.mark.parametrize("name,static", [("llama2", True), ("llama3", True), ("llama_rope_linear", True),
                                         ("llama_rope_yarn", True), ("llama_rope_dynamic", False),
                                         ("llama_rope_longrope", False)])
def test_rope_frequencies_static_or_length_dependent(family_checkpoint, name, static):
    """Whether the first positions' rotary angles change when the run holds positions past the pretraining
    length (4,096 here): the classification FAMILIES.md gives."""
    rotary = tf.AutoModelForCausalLM.from_pretrained(family_checkpoint(name), dtype=torch.float32).model.rotary_emb
    x = torch.zeros(1, 1)
    short, _ = rotary(x, torch.arange(4)[None])
    long, _ = rotary(x, torch.arange(5000)[None])
    assert torch.equal(short, long[:, :4]) == static


@pytest.mark.parametrize("name", REMOTE)
def test_remote_code_checkpoints_need_trust_remote_code(family_checkpoint, name):
    ckpt = family_checkpoint(name)
    model = tf.AutoModel.from_pretrained(ckpt, trust_remote_code=True)
    assert type(model).__module__.startswith("transformers_modules.")
    if json.loads((ckpt / "config.json").read_text())["model_type"] == "bert":
        # DNABERT-2's shape: transformers knows "bert", so without the flag it builds its own BertModel with
        # every weight missing (randomly initialised) and no error.
        silent = tf.AutoModel.from_pretrained(ckpt, trust_remote_code=False)
        assert type(silent).__module__ == "transformers.models.bert.modeling_bert"
    else:
        with pytest.raises(ValueError, match="custom code"):
            tf.AutoConfig.from_pretrained(ckpt, trust_remote_code=False)
    tokenizer = tf.AutoTokenizer.from_pretrained(ckpt, trust_remote_code=True)
    out = model(**tokenizer("ACGTN", return_tensors="pt")).last_hidden_state
    assert out.std() > 0.1


@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in REMOTE])
def test_recognised_from_files_not_from_the_path(family_checkpoint, tmp_path, name):
    assert recognise(family_checkpoint(name)) == _card(name)
    if name in ("prot_t5_xl_half_enc", "saprot", "qwen3"):
        copy = build(name, tmp_path / "unrelated-name")
        assert recognise(copy) == _card(name)
        same = filecmp.dircmp(family_checkpoint(name), copy)
        assert not same.diff_files and not same.left_only and not same.right_only    # deterministic


@pytest.mark.parametrize("name", EMBEDDERS + ["protgpt2", "llama3"])
def test_card_embedding_float32_is_as_accurate_as_float64_grounds(family_checkpoint, name):
    """A row per residue for every tokenizer (a 6-mer's or a BPE oligomer's state on each of its residues);
    the mean over the tokens, which is the rows' mean where each residue is a token."""
    seqs = {"nucleotide_transformer": DNA, "saprot": STANDARD}.get(_card(name), SEQS)
    if name == "protgpt2":
        seqs = seqs + [SEQS[0] * 3]   # over 60 residues: its card's text breaks the line
    exact = card_usage.embed(family_checkpoint(name), seqs, torch.float64)
    ours = card_usage.embed(family_checkpoint(name), seqs, torch.float32)
    one_per_residue = name in EMBEDDERS and _card(name) != "nucleotide_transformer"
    for seq, (rows, mean), (rows64, mean64) in zip(seqs, ours, exact):
        assert rows64.dtype == torch.float64 and rows.dtype == torch.float32
        assert rows.shape[0] == len(seq)                                          # residues only
        assert torch.allclose(mean64, rows64.mean(0)) == one_per_residue or len(seq) <= 2
        assert rows64.std() > 0.1
        assert relative_error(rows, rows64) <= BOUND and relative_error(mean, mean64) <= BOUND
    assert not torch.allclose(ours[0][1], ours[1][1])


@pytest.mark.parametrize("name", SCORERS)
def test_card_score_float32_is_as_accurate_as_float64_grounds(family_checkpoint, name):
    exact = card_usage.score(family_checkpoint(name), SEQS, torch.float64)
    ours = card_usage.score(family_checkpoint(name), SEQS, torch.float32)
    for (total, count), (total64, count64) in zip(ours, exact):
        assert count == count64 > 0 and total64 < 0
        assert abs(total - total64) <= BOUND * abs(total64)
