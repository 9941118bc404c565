"""How the rows of a run planned by an earlier run_shards differ from the rows this version computes for the
same settings, told by the task attributes the run recorded when it was planned (its manifest's, or its
result's) against those this version's task gives (Task.attrs()). A command continuing a run, `rerun` and each
worker (so SLURM and Ray tasks too) refuse such a run, and --reuse such a result: their rows and this version's
cannot make one result.

- Before per-residue rows were residues (the attribute `per_residue_unit`), an embedding's per-residue rows
  were its non-special tokens: the same rows where the tokenizer gives one token per residue, others where its
  tokens group residues or are line breaks.
- Before a causal LM's variant `llr` counted each sequence's end term (the attribute `llr_end_term`), it left
  it out: the same values where the tokenizer adds no end-of-sequence token.
- Before generate/text wrote a generated unknown token and an id past the vocabulary as the unknown token (the
  attribute `generate_unknown_text`), it left both out: the same text where neither was generated.
"""
from __future__ import annotations

from ..output.schema import ONE_TOKEN_PER_RESIDUE


def earlier_rows(task: str, old_attrs: dict, new_attrs: dict) -> str | None:
    """In words, how the rows of a run whose recorded attributes are `old_attrs` differ from those this version
    computes with the task attributes `new_attrs` (the same task and settings), or None where they do not."""
    if (task == "embed" and "per_residue_unit" in new_attrs and "per_residue_unit" not in old_attrs
            and new_attrs.get("per_residue_tokens") != ONE_TOKEN_PER_RESIDUE):
        return ("with a per-residue row per token (an earlier run_shards), while this version's per-residue rows "
                "are residues and this model's tokens group residues")
    if new_attrs.get("llr_end_term") and "llr_end_term" not in old_attrs:
        return ("with each variant's llr leaving out the sequences' end-of-sequence term, while this version's llr "
                "includes it")
    if task == "generate" and "generate_unknown_text" in new_attrs and "generate_unknown_text" not in old_attrs:
        return ("with generated unknown tokens and ids past the vocabulary left out of generate/text, while this "
                f"version writes each as {new_attrs['generate_unknown_text']!r}")
    return None
