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
