"""Scores computed by hand with transformers, for tests/test_scoring.py and tests/test_variants.py: the model
classes as their cards use them (AutoTokenizer, *ForMaskedLM, *ForCausalLM), masked copies built here, the
log-softmax of the logits in float64, sums in float64. Each comes in float32 (the reference, whose own error
bounds ours: tests/float64_reference.py) and float64 throughout (the exact values)."""
from __future__ import annotations

import contextlib
import functools

import numpy as np
import torch

from .float64_reference import float64_everywhere

AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWY"


@functools.lru_cache(maxsize=8)
def model_and_tokenizer(path: str, exact: bool, causal: bool):
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer
    cls = AutoModelForCausalLM if causal else AutoModelForMaskedLM
    with float64_everywhere() if exact else contextlib.nullcontext():
        model = cls.from_pretrained(path, dtype=torch.float64 if exact else torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def masked_logprobs(path: str, ids: list[int], masked: list[list[int]], exact: bool) -> list[np.ndarray]:
    """For each set of positions in `masked`: a copy of `ids` with those tokens masked, and the float64
    log-softmax `[len(set), V]` of the model's logits at them."""
    model, tok = model_and_tokenizer(path, exact, causal=False)
    copies = torch.tensor([[tok.mask_token_id if i in m else t for i, t in enumerate(ids)] for m in masked])
    with torch.inference_mode(), float64_everywhere() if exact else contextlib.nullcontext():
        logits = model(input_ids=copies).logits
    return [torch.log_softmax(logits[k, m].double(), dim=-1).numpy() for k, m in enumerate(masked)]


def unmasked_logprobs(path: str, ids: list[int], exact: bool) -> np.ndarray:
    """float64 log-softmax `[T, V]` of the masked LM's logits on the sequence as it is."""
    model, _ = model_and_tokenizer(path, exact, causal=False)
    with torch.inference_mode(), float64_everywhere() if exact else contextlib.nullcontext():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1).numpy()


def pll(path: str, seq: str, exact: bool) -> tuple[float, np.ndarray, np.ndarray]:
    """Pseudo-log-likelihood of `seq`: (sum, each residue's own term, the 20 amino acids' table `[L, 20]`). A
    residue that is the unknown token is masked in turn like the others but not scored: its term is NaN and
    the sum leaves it out."""
    _, tok = model_and_tokenizer(path, exact, causal=False)
    ids = tok(seq)["input_ids"]
    residues = list(range(1, len(ids) - 1))          # <cls> residues <eos>
    rows = np.stack([lp[0] for lp in masked_logprobs(path, ids, [[p] for p in residues], exact)])
    own = _unknown_as_nan(tok, rows[np.arange(len(residues)), [ids[p] for p in residues]], ids[1:-1])
    return float(own[~np.isnan(own)].sum()), own, rows[:, tok.convert_tokens_to_ids(list(AMINO_ACIDS))]


def wt_marginal(path: str, seq: str, exact: bool) -> tuple[float, np.ndarray, np.ndarray]:
    """One unmasked pass: (sum of log p(residue), each residue's term, the 20 amino acids' table `[L, 20]`); an
    unknown residue's term is NaN, left out of the sum."""
    _, tok = model_and_tokenizer(path, exact, causal=False)
    ids = tok(seq)["input_ids"]
    rows = unmasked_logprobs(path, ids, exact)[1:len(ids) - 1]
    own = _unknown_as_nan(tok, rows[np.arange(len(rows)), ids[1:len(ids) - 1]], ids[1:-1])
    return float(own[~np.isnan(own)].sum()), own, rows[:, tok.convert_tokens_to_ids(list(AMINO_ACIDS))]


def _unknown_as_nan(tok, terms: np.ndarray, ids: list[int]) -> np.ndarray:
    """`terms` with NaN where the token is the tokenizer's unknown token (a residue outside its alphabet)."""
    return np.where(np.asarray(ids) == tok.unk_token_id, np.nan, terms)


def causal_token_logprobs(path: str, seq: str, exact: bool) -> tuple[list[int], np.ndarray]:
    """The causal LM's tokens of `seq` and log p(token t | tokens < t) in float64 (NaN at t = 0)."""
    model, tok = model_and_tokenizer(path, exact, causal=True)
    ids = tok(seq)["input_ids"]
    with torch.inference_mode(), float64_everywhere() if exact else contextlib.nullcontext():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    lp = torch.log_softmax(logits.double(), dim=-1).numpy()
    return ids, np.concatenate([[np.nan], lp[np.arange(len(ids) - 1), ids[1:]]])


def causal_score(path: str, seq: str, exact: bool) -> float:
    """--task score's definition: the sum over non-special tokens after the first of log p(token | before),
    leaving out an unknown residue's <unk> (fed to the model as context, but not a residue's probability)."""
    _, tok = model_and_tokenizer(path, exact, causal=True)
    ids, lp = causal_token_logprobs(path, seq, exact)
    special = set(tok.all_special_ids) | {tok.unk_token_id}
    return float(sum(lp[t] for t in range(1, len(ids)) if ids[t] not in special))


def causal_log_likelihood(path: str, seq: str, exact: bool) -> float:
    """A variant's llr's term: causal_score plus the end term, log p(<eos> | before), where the tokens end
    with the tokenizer's end-of-sequence token."""
    _, tok = model_and_tokenizer(path, exact, causal=True)
    ids, lp = causal_token_logprobs(path, seq, exact)
    end = lp[-1] if len(ids) > 1 and ids[-1] == tok.eos_token_id else 0.0
    return causal_score(path, seq, exact) + float(end)


def mutated(seq: str, mutant: str) -> str:
    chars = list(seq)
    for part in mutant.split(":"):
        assert chars[int(part[1:-1]) - 1] == part[0], part
        chars[int(part[1:-1]) - 1] = part[-1]
    return "".join(chars)


def marginals(path: str, seq: str, mutant: str, exact: bool) -> tuple[float, float]:
    """ESM-1v's masked marginal (every mutated position masked at once) and the wild-type marginal."""
    _, tok = model_and_tokenizer(path, exact, causal=False)
    ids = tok(seq)["input_ids"]
    subs = [(p[0], int(p[1:-1]), p[-1]) for p in mutant.split(":")]
    positions = [pos for _, pos, _ in subs]              # token index = residue position (after <cls>)
    masked = masked_logprobs(path, ids, [positions], exact)[0]
    unmasked = unmasked_logprobs(path, ids, exact)[positions]
    aa = {a: tok.convert_tokens_to_ids(a) for a in AMINO_ACIDS}
    mm = sum(masked[k, aa[m]] - masked[k, aa[w]] for k, (w, _, m) in enumerate(subs))
    wm = sum(unmasked[k, aa[m]] - unmasked[k, aa[w]] for k, (w, _, m) in enumerate(subs))
    return float(mm), float(wm)
