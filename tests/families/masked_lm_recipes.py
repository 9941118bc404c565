"""Pseudo-log-likelihoods of the masked-LM families as each family's own published usage computes them, the
reference for run_shards' `--task score` on those families: each residue masked in turn, one copy per forward,
the log-probability of the true residue at the mask in float64, summed over the residues.

- ESM-2 / ESM-1b / ESM-1v: AutoTokenizer + EsmForMaskedLM on the raw residues, the residue's token replaced by
  the tokenizer's mask token (https://huggingface.co/docs/transformers/model_doc/esm; ESM-1v's masked marginals,
  https://github.com/facebookresearch/esm, examples/variant-prediction).
- ProtBert: BertTokenizer(do_lower_case=False) + BertForMaskedLM on the card's spaced text with U/Z/O/B as X,
  the residue's word replaced by [MASK] (https://huggingface.co/Rostlab/prot_bert, its fill-mask example).
- SaProt: EsmTokenizer + EsmForMaskedLM on "M#E#V#..." (no structure: every 3Di letter the "#" placeholder);
  its mutation scoring (westlake-repl/SaProt, model/saprot/saprot_foldseek_mutation_model.py, predict_mut and
  predict_pos_prob) masks a residue by writing "#" for the amino acid and keeping the 3Di letter, and gives an
  amino acid the probability summed over its tokens with every 3Di letter.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from .card_usage import _precision, _rare_to_x
from .recognise import recognise
from .vocabularies import SAPROT_STRUC


def _masked_scores(model, ids: list[int], mask_id: int, token_sets: dict[int, list[int]]) -> float:
    """Sum over the residue tokens (all but the first and last) of log p(the residue) with its token masked;
    `token_sets` maps a residue's token to the tokens whose probabilities make up the residue's."""
    total = []
    for p in range(1, len(ids) - 1):
        copy = list(ids)
        copy[p] = mask_id
        logits = model(input_ids=torch.tensor([copy])).logits[0, p]
        logp = torch.log_softmax(logits.double(), dim=-1)
        total.append(torch.logsumexp(logp[token_sets.get(ids[p], [ids[p]])], dim=0).item())
    return float(torch.tensor(total, dtype=torch.float64).sum())


def pll(ckpt_dir: str | Path, sequences: Sequence[str], dtype: torch.dtype = torch.float32) -> list[tuple[float, int]]:
    """Per sequence (pseudo-log-likelihood, residues scored) as the checkpoint's family computes it."""
    from transformers import AutoTokenizer, BertForMaskedLM, BertTokenizer, EsmForMaskedLM
    ckpt = Path(ckpt_dir)
    card = recognise(ckpt)
    results = []
    with _precision(dtype):
        # ProtBert's config.json names no model_type: its card loads the class by name, as here.
        model = (BertForMaskedLM if card == "protbert" else EsmForMaskedLM).from_pretrained(ckpt, dtype=dtype).eval()
        if card == "esm":
            tokenizer = AutoTokenizer.from_pretrained(ckpt)
            texts, mask_id, token_sets = list(sequences), tokenizer.mask_token_id, {}
        elif card == "protbert":
            tokenizer = BertTokenizer.from_pretrained(ckpt, do_lower_case=False)
            texts, mask_id, token_sets = [_rare_to_x(" ".join(s)) for s in sequences], tokenizer.mask_token_id, {}
        elif card == "saprot":
            tokenizer = AutoTokenizer.from_pretrained(ckpt)
            vocab = tokenizer.get_vocab()
            texts, mask_id = ["".join(r + "#" for r in s) for s in sequences], vocab["##"]
            token_sets = {vocab[a + "#"]: [vocab[a + s] for s in SAPROT_STRUC] for a in "ACDEFGHIKLMNPQRSTVWY"}
        else:
            raise ValueError(f"{ckpt}: recognised as {card!r}, not a masked-LM family with a scoring recipe here")
        for s, text in zip(sequences, texts):
            ids = tokenizer(text)["input_ids"]
            assert len(ids) == len(s) + 2, f"{len(ids)} tokens for {len(s)} residues: not one token per residue"
            results.append((_masked_scores(model, ids, mask_id, token_sets), len(s)))
    return results
