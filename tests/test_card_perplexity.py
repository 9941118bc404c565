"""A causal LM's score keeps the end-of-sequence term apart (issue 37, point 7): `score/eos_logprob`, log p(<eos> |
the sequence) where the tokens end with the tokenizer's <eos> (ProtGPT2's card text ends with <|endoftext|>), NaN
where they end with none (Llama 3). With it the README's one line of Python gives each card's perplexity,
`math.exp(model(input_ids, labels=input_ids).loss)` as ProtGPT2's card computes it, from the stored values; the
line is read from the README itself."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tests.families import card_usage

from .family_runs import PROTEIN, family_checkpoint, in_process  # noqa: F401
from .float64_reference import assert_as_accurate
from .scoring_reference import mutated
from .tiny_models import REPO

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LONG = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKALPDAQFEVVHSLAKWKRQTLGQHDFSAGEGLYTHMKAL"
SEQUENCES = [LONG, PROTEIN["P2"], PROTEIN["P3"], PROTEIN["P6"], "MA"]


def readme_perplexity() -> str:
    """The README's line `perplexity = ...` (in a python block), its expression."""
    blocks = re.findall(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), re.M | re.S)
    (line,) = [line for block in blocks for line in block.splitlines() if line.startswith("perplexity = ")]
    return line.split("=", 1)[1].split("#", 1)[0].strip()


@pytest.mark.parametrize("name", ["protgpt2", "llama3"])
def test_the_readme_line_gives_the_cards_perplexity_from_the_stored_values(name, family_checkpoint):
    path = family_checkpoint(name)
    out, _ = in_process(path, "score", SEQUENCES)
    total, n, eos = (out.columns[k] for k in ("score/logprob_sum", "score/num_scored", "score/eos_logprob"))
    assert eos.dtype == np.float64
    if name == "protgpt2":   # its card's text ends with <|endoftext|>: an end term for every sequence
        assert (eos < 0).all()
    else:                    # Llama 3's tokenizer adds no end token
        assert np.isnan(eos).all()
    ours = eval(readme_perplexity(), {"np": np}, {"total": total, "n": n, "eos": eos})
    exact = np.array(card_usage.perplexity(path, SEQUENCES, torch.float64))
    theirs = np.array(card_usage.perplexity(path, SEQUENCES, torch.float32))
    assert ours.shape == exact.shape and (ours > 1).all()
    assert_as_accurate(ours, theirs, exact, f"{name} perplexity")
    if name == "protgpt2":   # without the end term it is not the card's
        without = np.exp(-total / n)
        assert np.abs(without - exact).max() > 100 * np.abs(theirs - exact).max()


@pytest.mark.parametrize("name", ["protgpt2", "llama3"])
def test_a_variants_llr_is_the_cards_log_likelihood_ratio(name, family_checkpoint, tmp_path):
    """A causal LM's `llr` is log p(mutant) - log p(wild type), each as the card's `model(input_ids,
    labels=input_ids)` counts it: every token after the first, ProtGPT2's end token included (the attribute
    `llr_end_term` says so; without that term the values are not the card's), Llama 3 with no end token."""
    from pipeline.output.variant_list import VariantList
    wild = [LONG, PROTEIN["P2"]]
    variants = [(0, "K2R"), (0, f"L{len(LONG)}W"), (0, "M1A:K2W"), (1, "S2W"), (1, "P64A")]
    assert PROTEIN["P2"][63] == "P"
    VariantList(np.array([r for r, _ in variants], np.int64), [m for _, m in variants]).save(tmp_path / "variants.npz")
    path = family_checkpoint(name)
    out, _ = in_process(path, "variants", wild, run_root=tmp_path)
    ours = out.values["variant_scores/llr"]

    def card_llr(dtype):
        mutants = [mutated(wild[r], m) for r, m in variants]
        ll_wild = card_usage.log_likelihood(path, wild, dtype)
        return np.array(card_usage.log_likelihood(path, mutants, dtype)) - np.array([ll_wild[r] for r, _ in variants])
    exact, theirs = card_llr(torch.float64), card_llr(torch.float32)
    assert_as_accurate(ours, theirs, exact, f"{name} llr")
    assert planned_attrs(path, tmp_path)["llr_end_term"] is (name == "protgpt2")
    if name == "protgpt2":   # the end term differs between the sequences: leaving it out is not the card's llr
        scores = in_process(path, "score", [wild[0], mutated(wild[0], f"L{len(LONG)}W")])[0].columns
        without = scores["score/logprob_sum"][1] - scores["score/logprob_sum"][0]
        assert abs(without - exact[1]) > 100 * abs(theirs[1] - exact[1])


def planned_attrs(path, run_root) -> dict:
    """The variants task's attributes for the checkpoint at `path`, as planning records them."""
    from pipeline.config import RunConfig
    from pipeline.models import checkpoint
    from pipeline.tasks import make_task
    from pipeline.tasks.tokenization import SequenceTokenizer
    source = checkpoint.local_source(str(path))
    hf_config = checkpoint.read_config(source)
    tokenizer = checkpoint.read_tokenizer(source, hf_config)
    info = checkpoint.describe(source, "native", tokenizer, False, hf_config)
    task = make_task(RunConfig(fasta=["x.fa"], out="x", task="variants", variants="v.csv"), info, run_root)
    task.prepare(SequenceTokenizer(tokenizer, source.family.convention))
    return task.attrs()
