"""The score task of a masked LM (ESM-2, ESM-1b, ESM-1v, SaProt, ProtBert, ...), over a sequence's residue
tokens (its non-special tokens):

- `pll` (pseudo-log-likelihood): each residue masked in turn, the sum of log p(true residue | the rest). The
  L masked copies of a sequence run as ragged batches on the engine, and the head runs only at each copy's
  masked position (Engine.logprobs_at).
- `wt-marginal`: one unmasked pass, the sum of log p(residue | the whole sequence).

Columns: `score/logprob_sum` (float64, log-softmax over the whole vocabulary in float64, summed exactly),
`score/num_scored` (residue tokens) and `score/logprob_mean` (the sum over num_scored). --per-residue adds,
ragged per residue, `per_residue/logprob` (the residue's own term) and `per_residue/amino_acids` (`[*, 20]`
float32: the log-probabilities of the 20 standard amino acids there, masked there for pll, unmasked for
wt-marginal, in the order of the `per_residue_amino_acids` attribute: ACDEFGHIKLMNPQRSTVWY). That table is a
complete single-substitution scan: a single mutant's masked marginal is table[p, mutant] - table[p, wild type].

A residue the tokenizer does not know (a row of status 2) is fed as the unknown token, the context of the
others, but is not scored: log p(<unk>) says nothing about a residue, so it is left out of `logprob_sum` and
`num_scored` (and so of `logprob_mean`, NaN when no residue is left), and its `per_residue/logprob` is NaN; its
`per_residue/amino_acids` row is still the model's prediction there.
"""
from __future__ import annotations

import math

import numpy as np

from ..config import RunConfig
from ..errors import UserError
from ..models.checkpoint import EngineInfo
from ..models.transfers import HostCopy
from ..output.schema import Column
from ..output.variant_list import AMINO_ACIDS
from .residue_tokens import ResidueTokens
from .task import RESIDUE_LOGPROB, PendingOutput, Task, TaskOutput
from .tokenization import SequenceTokenizer, Tokenized

AMINO_ACID_TABLE = Column("per_residue/amino_acids", "float32", len(AMINO_ACIDS), ragged=True)


def need_one_token_per_residue(tokenizer: SequenceTokenizer, what: str) -> None:
    """Masking a residue masks its token: refuse tokenizers whose tokens group residues."""
    if not tokenizer.char_level:
        raise UserError(f"{what} masks one residue at a time, which needs one token per residue; this model's "
                        "tokenizer groups residues into subword tokens")


class MaskedScoreTask(Task):
    name = "score"
    layers: list[int] = []
    logprobs = True

    def __init__(self, config: RunConfig, info: EngineInfo):
        if config.on_long == "window":
            raise UserError("--on-long window is for causal LMs and embeddings; a masked LM's score needs the "
                            "whole sequence in one pass: use --on-long truncate (scores the residues kept) or skip")
        self.info = info
        self.method = "pll" if config.score_method == "auto" else config.score_method
        self.per_residue = config.per_residue
        self._tokens: ResidueTokens | None = None
        self._unknown = -1   # the unknown token's id (prepare); -1: the tokenizer has none

    def columns(self) -> list[Column]:
        cols = [Column("score/logprob_sum", "float64"), Column("score/num_scored", "int32"),
                Column("score/logprob_mean", "float64")]
        return cols + ([RESIDUE_LOGPROB, AMINO_ACID_TABLE] if self.per_residue else [])

    def attrs(self) -> dict:
        return {"score_method": self.method, **({"per_residue_amino_acids": AMINO_ACIDS} if self.per_residue else {})}

    def prepare(self, tokenizer: SequenceTokenizer) -> None:
        need_one_token_per_residue(tokenizer, f"--score-method {self.method}" if self.method == "pll" else "scoring")
        self._tokens = ResidueTokens.of(tokenizer)
        self._unknown = -1 if tokenizer.unk_id is None else int(tokenizer.unk_id)

    def batch_tokens(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens, np.int64)
        return tokens * tokens if self.method == "pll" else tokens   # L + 2 copies at most, of L + 2 tokens

    def launch(self, engine, toks: list[Tokenized], positions: np.ndarray) -> PendingOutput:
        assert self._tokens is not None, "prepare() first: it reads the run's tokenizer"
        content = [np.flatnonzero(~t.special) for t in toks]
        if self.method == "pll":
            copies, where = masked_copies(toks, content, self._tokens.mask)
            lp = engine.logprobs_at(copies, where)
            computed = sum(len(t.ids) * len(c) for t, c in zip(toks, content))
        else:
            lp = engine.logprobs_at([t.ids for t in toks], [c.tolist() for c in content])
            computed = sum(len(t.ids) for t in toks)
        true = np.concatenate([np.asarray(t.ids, np.int64)[c] for t, c in zip(toks, content)])
        device = {"own": self._tokens.own(lp, true)}
        if self.per_residue:
            device["table"] = self._tokens.table(lp).float()
        counts = np.array([len(c) for c in content], np.int64)
        known = true != self._unknown   # (an unknown residue is context, not scored)
        scored = np.bincount(np.repeat(np.arange(len(toks)), counts)[known], minlength=len(toks)).astype(np.int64)

        def build(host: dict[str, np.ndarray]) -> TaskOutput:
            own = np.where(known, host["own"], np.nan)
            sums = row_sums(own[known], scored)
            mean = np.divide(sums, scored, out=np.full(len(sums), np.nan), where=scored > 0)
            out = TaskOutput({"score/logprob_sum": sums, "score/num_scored": scored.astype(np.int32),
                              "score/logprob_mean": mean}, {}, {}, computed_tokens=computed)
            if self.per_residue:
                out.values = {RESIDUE_LOGPROB.path: own.astype(np.float32), AMINO_ACID_TABLE.path: host["table"]}
                out.lengths = {"per_residue": counts}
            return out

        return PendingOutput(HostCopy(device), build)

    def run(self, engine, toks: list[Tokenized], positions: np.ndarray) -> TaskOutput:
        return self.launch(engine, toks, positions).result()


def masked_copies(toks: list[Tokenized], content: list[np.ndarray], mask: int) -> tuple[list[list[int]], list[list[int]]]:
    """One copy of each sequence per residue token with that token masked, and where each copy's mask is."""
    copies, where = [], []
    for t, c in zip(toks, content):
        for p in c.tolist():
            ids = list(t.ids)
            ids[p] = mask
            copies.append(ids)
            where.append([p])
    return copies, where


def row_sums(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """float64 sum of each row's values, exactly rounded (math.fsum): the same bits whatever else the batch
    holds or how the values were computed in order."""
    bounds = np.concatenate(([0], np.cumsum(counts)))
    return np.array([math.fsum(values[a:b].tolist()) for a, b in zip(bounds[:-1], bounds[1:])], np.float64)
