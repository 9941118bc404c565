"""Input that carries structure (issue 37, point 3; pipeline/models/structure_input.py), on the tiny SaProt and
ProstT5 checkpoints (tests/families: published configs, their real tokenizers):

- SaProt's structure-aware sequences ('MdEvVp...', its card's main input) and its no-structure form
  ('M#E#V#...') are tokenized as SaProt's card does (EsmTokenizer on `"".join(seq + struc)` pairs), one row per
  pair, and embedded as EsmForMaskedLM does; amino acids alone get the card's '#' per residue;
- ProstT5's 3Di strings (lower case) go in after '<fold2AA>', spaced, as its card writes them;
- the form is told by the checkpoint's vocabulary and the sample (`auto`), or by `--input-format aa|saprot-sa|3di`;
  an input of both forms, and an option the vocabulary does not read, are refused naming the option;
- a residue the form does not read (a lone letter, an upper-case letter in 3Di) gets status 2 and a warning, as
  an unknown character does on ESM-2; the form is part of the run's identity.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from index import load_or_build
from pipeline.errors import UserError
from pipeline.models import checkpoint
from pipeline.models.conventions import PLAIN, PROSTT5_AA, SAPROT_NO_STRUCTURE
from pipeline.planning.tokenization_check import decide_and_check
from pipeline.tasks.tokenization import SequenceTokenizer
from tests.families import card_usage

from .family_runs import (assert_embeddings_as_accurate, family_checkpoint, per_residue_rows, result,  # noqa: F401
                          write_fasta)
from .tiny_models import run_cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# SaProt's card example and others: residue (upper case, '#' unknown) + 3Di letter (lower case, '#' none).
SA = {"S1": "MdEvVpQpL#VyQdYaKv", "S2": "M#E#V#Q#L#", "S3": "KtTpRgAdWlCc#pHs"}
# Odd: an odd length (a residue without its 3Di letter), a lone lower-case letter, and S1 with its case lost.
ODD = {"O1": "MdEvV", "O2": "MdvEpQp", "O3": "MDEVVPQPL#VYQDYAKV"}
THREE_DI = {"T1": "dvvlvvllpdp", "T2": "acdefghiklmnpqrstvwy", "T3": "dpvvsvvcs"}


def _pairs(text: str) -> int:
    return len(text) // 2


def _saprot_card(ckpt: Path, texts: list[str], dtype: torch.dtype) -> list:
    # https://huggingface.co/westlake-repl/SaProt_650M_AF2: EsmTokenizer + EsmForMaskedLM on the structure-aware
    # sequence "".join(seq + struc) (e.g. "M#EvVpQpL#VyQdYaKv"); per residue the rows after <cls>, one per pair.
    from transformers import EsmForMaskedLM, EsmTokenizer
    tokenizer = EsmTokenizer.from_pretrained(ckpt)
    model = EsmForMaskedLM.from_pretrained(ckpt, dtype=dtype).eval()
    with card_usage._precision(dtype):
        return [tuple(x.to(dtype) for x in card_usage._residues(
            model.esm(**tokenizer(t, return_tensors="pt")).last_hidden_state, 1, _pairs(t))) for t in texts]


def _prostt5_card(ckpt: Path, texts: list[str], dtype: torch.dtype) -> list:
    # https://huggingface.co/Rostlab/ProstT5: 3Di in lower case, " ".join(list(s)), "<fold2AA>" + " " + s;
    # T5EncoderModel, per residue last_hidden_state[0, 1:L+1] (the prefix and </s> left out).
    from transformers import T5EncoderModel, T5Tokenizer
    tokenizer = T5Tokenizer.from_pretrained(ckpt, do_lower_case=False)
    model = T5EncoderModel.from_pretrained(ckpt, dtype=dtype).eval()
    with card_usage._precision(dtype):
        return [tuple(x.to(dtype) for x in card_usage._residues(
            model(**tokenizer("<fold2AA>" + " " + " ".join(list(s)), return_tensors="pt")).last_hidden_state, 1,
            len(s))) for s in texts]


def _planned(path: Path, records: dict[str, str], tmp_path: Path, input_format: str = "auto"):
    """(the convention the parent's check decides, the index, the checkpoint's tokenizer)."""
    source = checkpoint.local_source(str(path))
    tokenizer = checkpoint.read_tokenizer(source, checkpoint.read_config(source, False), False)
    fasta = write_fasta(tmp_path / f"in-{len(list(tmp_path.glob('in-*.fa')))}.fa", records)   # (a new file each)
    index, _ = load_or_build([str(fasta)])
    return decide_and_check(index, source, tokenizer, input_format), index, tokenizer


# ---------------------------------------------------------------------------------------------------- SaProt
def test_saprot_structure_aware_input_is_embedded_as_its_card_does(family_checkpoint, tmp_path):
    """Through the CLI: SA strings and the '#' form equal EsmTokenizer + EsmForMaskedLM on the pairs, one row
    (and `lengths` 1) per pair; odd ones get status 2, named at planning and at the end; S1 with its case lost
    is not taken for S1 (no copy); another --input-format is another run."""
    path = family_checkpoint("saprot")
    records = SA | ODD
    fasta = write_fasta(tmp_path / "sa.fa", records)
    out = tmp_path / "out"
    common = ("--model", str(path), "--gpus", "0", "--workers", "1", "--no-progress", "--per-residue",
              "--per-residue-dtype", "float32")
    res = run_cli("run", str(fasta), "--out", str(out), *common)
    assert res.returncode == 0, res.stderr
    data = result(out)
    assert data["status"].tolist() == [0, 0, 0, 2, 2, 2]
    assert data["lengths"][:3].tolist() == [_pairs(s) for s in SA.values()]
    assert data["lengths"][3:].tolist() == [3, 4, 17]   # each lone letter a residue of its own
    texts = list(SA.values())
    rows = per_residue_rows(data)
    assert_embeddings_as_accurate(data["embeddings/mean"][:3], rows[:3], _saprot_card(path, texts, torch.float64),
                                  _saprot_card(path, texts, torch.float32))
    assert "input format: each residue a residue letter and its 3Di letter as written" in res.stderr
    assert "3 of 6 sampled sequences contain residues this input format" in res.stderr
    assert "3 row(s) with characters outside the model's alphabet (status 2" in res.stderr
    assert "copies: 6 records: 6 to compute" in res.stderr   # (O3 upper-cased is S1: the digests keep the case)
    again = run_cli("run", str(fasta), "--out", str(out), *common, "--input-format", "aa")
    assert again.returncode == 2 and "other settings (changed: --input-format (each residue a residue letter and " \
        "its 3Di letter as written" in again.stderr, again.stderr


def test_saprot_forms_tokenize_as_its_card(family_checkpoint, tmp_path):
    """Tokens: SA strings are EsmTokenizer's ids of the text as written; the '#' form equals amino acids alone,
    which `auto` writes with '#' as the card does; no table lookup guesses at pairs."""
    from transformers import EsmTokenizer

    from pipeline.models.structure_input import SAPROT_SA
    path = family_checkpoint("saprot")
    card = EsmTokenizer.from_pretrained(path)
    ours = SequenceTokenizer(card, SAPROT_SA)
    assert not ours.looks_up
    for text, tok in zip(SA.values(), ours.encode(list(SA.values()))):
        assert tok.ids == card(text)["input_ids"] and not tok.unknown
        assert int((~tok.special).sum()) == _pairs(text)
    hashed, = ours.encode([SA["S2"]])
    plain, = SequenceTokenizer(card, SAPROT_NO_STRUCTURE).encode(["MEVQL"])
    assert hashed.ids == plain.ids
    convention, _, _ = _planned(path, {"A1": "MEVQL", "A2": "KTRAW"}, tmp_path)
    assert convention == SAPROT_NO_STRUCTURE
    convention, index, _ = _planned(path, SA, tmp_path)
    assert convention == SAPROT_SA
    assert index.sequence(0, keep_case=True) == SA["S1"] and index.sequence(0) == SA["S1"].upper()
    from index.residue_digest import record_digests

    from pipeline.output.sequence_digest import digests
    kept = np.concatenate(list(record_digests(index, keep_case=True)))
    assert np.array_equal(kept, digests(list(SA.values())))   # what the workers store for each row


def test_odd_structure_input_is_flagged_as_on_esm2(family_checkpoint, tmp_path, caplog):
    """A residue the form does not read makes its row status 2 (Tokenized.unknown), with a warning naming it;
    mostly odd input is refused naming the form that reads it."""
    from pipeline.models.structure_input import SAPROT_SA
    path = family_checkpoint("saprot")
    with caplog.at_level(logging.WARNING, logger="run_shards"):
        convention, _, tokenizer = _planned(path, SA | {"O1": ODD["O1"]}, tmp_path)
    assert convention == SAPROT_SA
    assert "1 of 4 sampled sequences contain residues this input format" in caplog.text and "'O1'" in caplog.text
    toks = SequenceTokenizer(tokenizer, SAPROT_SA).encode(list(ODD.values()))
    assert [t.num_unknown for t in toks] == [1, 1, 16]
    with pytest.raises(UserError, match="--input-format aa"):   # amino acids named as SA pairs: all lone letters
        _planned(path, {"A1": "MEVQLKTRAW", "A2": "KTRAWMEVQL"}, tmp_path, "saprot-sa")
    with pytest.raises(UserError, match=r"lower-case its sequence lines first .*awk"):   # Foldseek's upper case
        _planned(family_checkpoint("prostt5"), {"T1": "DVVLVVLLPDP", "T2": "DPVVSVVCS"}, tmp_path, "3di")


# --------------------------------------------------------------------------------------------------- ProstT5
def test_prostt5_3di_is_embedded_after_fold2aa_as_its_card_does(family_checkpoint, tmp_path):
    from pipeline.config import RunConfig
    from pipeline.engine import selection
    from pipeline.models.structure_input import PROSTT5_3DI
    from pipeline.tasks import make_task
    path = family_checkpoint("prostt5")
    convention, index, _ = _planned(path, THREE_DI, tmp_path)
    assert convention == PROSTT5_3DI
    assert _planned(path, {k: v.upper() for k, v in THREE_DI.items()}, tmp_path)[0] == PROSTT5_AA
    texts = [index.sequence(i, convention.keeps_case) for i in range(len(index))]
    assert texts == list(THREE_DI.values())
    source = checkpoint.local_source(str(path))
    config = RunConfig(fasta=["x.fa"], out="x", model=str(path), per_residue=True, per_residue_dtype="float32")
    hf_tokenizer = checkpoint.read_tokenizer(source, checkpoint.read_config(source, False), False)
    info = checkpoint.describe(source, "native", hf_tokenizer, False)
    engine = selection.load("native", str(path), torch.device("cpu"), torch.float32, logprobs=False, info=info,
                            config=config)
    tokenizer = SequenceTokenizer(engine.tokenizer, convention)
    toks = tokenizer.encode(texts)
    from transformers import T5Tokenizer
    card = T5Tokenizer.from_pretrained(path, do_lower_case=False)
    assert [t.ids for t in toks] == [card("<fold2AA>" + " " + " ".join(list(s)))["input_ids"] for s in texts]
    task = make_task(config, engine.info)
    task.prepare(tokenizer)
    out = task.run(engine, toks, np.arange(len(texts)))
    offsets = np.concatenate([[0], np.cumsum(out.lengths["per_residue"])])
    rows = [out.values["per_residue/values"][offsets[i]:offsets[i + 1]] for i in range(len(texts))]
    assert_embeddings_as_accurate(out.columns["embeddings/mean"], rows, _prostt5_card(path, texts, torch.float64),
                                  _prostt5_card(path, texts, torch.float32))
    odd = tokenizer.encode(["dvVl", "dvbl"])   # an upper-case letter (an amino acid), a letter of no 3Di state
    assert [t.num_unknown for t in odd] == [1, 1]


# ------------------------------------------------------------------------------------------------ the option
def test_input_format_names_the_form_and_refusals_name_the_option(family_checkpoint, tmp_path):
    from pipeline.config import INPUT_FORMATS
    from pipeline.models import structure_input
    from pipeline.models.structure_input import PROSTT5_3DI, SAPROT_SA
    assert set(structure_input.OPTIONS) <= set(INPUT_FORMATS)
    saprot, prostt5, esm = (family_checkpoint(n) for n in ("saprot", "prostt5", "esm2_t6_8m"))
    assert _planned(saprot, SA, tmp_path, "saprot-sa")[0] == SAPROT_SA
    assert _planned(saprot, {"A1": "MEVQL"}, tmp_path, "aa")[0] == SAPROT_NO_STRUCTURE
    assert _planned(prostt5, THREE_DI, tmp_path, "3di")[0] == PROSTT5_3DI
    assert _planned(prostt5, {"A1": "MEVQL"}, tmp_path, "aa")[0] == PROSTT5_AA
    assert _planned(esm, SA, tmp_path)[0] == PLAIN   # no structure vocabulary: as before (odd rows, status 2)
    with pytest.raises(UserError) as e:   # both forms in one input
        _planned(saprot, SA | {"A1": "MEVQLKTRAW"}, tmp_path)
    assert "--input-format saprot-sa" in str(e.value) and "--input-format aa" in str(e.value) and "'A1'" in str(e.value)
    with pytest.raises(UserError) as e:
        _planned(prostt5, THREE_DI | {"A1": "MEVQLKTRAW"}, tmp_path)
    assert "--input-format 3di" in str(e.value) and "--input-format aa" in str(e.value)
    with pytest.raises(UserError, match=r"--input-format 3di is for .* give --input-format saprot-sa"):
        _planned(saprot, SA, tmp_path, "3di")
    with pytest.raises(UserError, match=r"--input-format saprot-sa is for .* give --input-format 3di"):
        _planned(prostt5, THREE_DI, tmp_path, "saprot-sa")
    for option in ("saprot-sa", "3di", "aa"):
        with pytest.raises(UserError, match=f"--input-format {option}: .* leave out --input-format"):
            _planned(esm, {"A1": "MEVQL"}, tmp_path, option)
    with pytest.raises(UserError, match="--task score on structure input .*--input-format aa"):
        structure_input.check_task(SAPROT_SA, "score")
    from pipeline.config import RunConfig
    from pipeline.planning.plan import plan
    config = RunConfig(fasta=[str(write_fasta(tmp_path / "sa.fa", SA))], out=str(tmp_path / "scored"),
                       model=str(saprot), task="score")   # (auto: SA)
    with pytest.raises(UserError, match="--task score on structure input"):
        plan(config)
    assert not (tmp_path / "scored").exists()
