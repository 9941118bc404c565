"""The variants task: every variant of the run's variants file scored against its record, all of a record's
variants computed together in the record's shard (OUT/variants.npz, output/variant_list.py).

Masked LMs (log-softmax over the whole vocabulary in float64, terms summed exactly):
- `masked_marginal` (ESM-1v's): the variant's mutated positions masked together in one copy of the wild type,
  the sum over them of log p(mutant) - log p(wild type) there. Variants mutated at the same positions share
  one masked pass (a single-substitution scan costs one pass per position, however many mutants).
- `wt_marginal`: the same sum read from one unmasked pass of the wild type.
Causal LMs:
- `llr`: the log-likelihood of the mutant sequence minus the wild type's (one pass each; variants giving the
  same sequence share it). A sequence's log-likelihood is --task score's `logprob_sum` plus its end term
  `eos_logprob` where its tokens end with the tokenizer's end-of-sequence token (ProtGPT2's card text), as the
  card's `model(input_ids, labels=input_ids)` counts every token after the first; the root attribute
  `llr_end_term` says whether the run's tokenizer adds that token.

Stored per record, ragged: `variant_scores/row` (the variant's place in the file, 0-based) and a float64
column per score; the merge turns them into the `variants` table in file order (output/variants.py).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..config import RunConfig
from ..errors import UserError
from ..models.checkpoint import EngineInfo
from ..models.transfers import HostCopy
from ..output.schema import Column
from ..output.variant_list import AMINO_ACIDS, Substitution, VariantList, parse_mutant
from .masked_score import need_one_token_per_residue
from .residue_tokens import ResidueTokens
from .score import end_token, ends_with_eos, eos_logprobs, log_likelihoods_on_device
from .task import Task, TaskOutput
from .tokenization import SequenceTokenizer, Tokenized

GROUP = "variant_scores"
_AA = {a: i for i, a in enumerate(AMINO_ACIDS)}


class VariantsTask(Task):
    name = "variants"
    layers: list[int] = []
    logprobs = True

    def __init__(self, config: RunConfig, info: EngineInfo, run_root: Path | None = None):
        if info.masked_lm:
            self.scores = ("masked_marginal", "wt_marginal")
        elif info.is_causal:
            self.scores = ("llr",)
        else:
            raise UserError(f"--task variants needs a language model with its head: a masked LM whose config.json "
                            f"names a *ForMaskedLM class (ESM-1v's EsmForMaskedLM), or a causal LM; "
                            f"{info.architecture or 'this model'} is neither")
        self.masked = info.masked_lm
        self.run_root = run_root
        self._rows: dict[int, np.ndarray] | None = None
        self._mutants: list[str] = []
        self._tokens: ResidueTokens | None = None
        self._tokenizer: SequenceTokenizer | None = None
        self._eos_id: int | None = None      # a causal LM's end-of-sequence token (prepare)
        self._end_term = False                # its tokenizer ends each sequence with it

    def columns(self) -> list[Column]:
        return [Column(f"{GROUP}/row", "int64", ragged=True)] + [
            Column(f"{GROUP}/{s}", "float64", ragged=True) for s in self.scores]

    def attrs(self) -> dict:
        if self.masked:
            return {"variant_scores": list(self.scores)}
        return {"variant_scores": list(self.scores), "llr_end_term": self._end_term}

    def prepare(self, tokenizer: SequenceTokenizer) -> None:
        if self.masked:
            need_one_token_per_residue(tokenizer, "masked-LM variant scoring")
            self._tokens = ResidueTokens.of(tokenizer)
        self._tokenizer = tokenizer   # a causal LM's mutant sequences are tokenized as the run's
        if not self.masked:
            self._eos_id = end_token(tokenizer)
            self._end_term = ends_with_eos(tokenizer.encode(["A"])[0], self._eos_id)

    def _variants(self) -> dict[int, np.ndarray]:
        """record -> its variants' rows in file order (read from the run directory once)."""
        if self._rows is None:
            assert self.run_root is not None, "a variants task computes only with its run directory"
            variants = VariantList.load(Path(self.run_root) / "variants.npz")
            self._rows, self._mutants = variants.rows_by_record(), variants.mutant
        return self._rows

    def _passes(self, rows: np.ndarray) -> int:
        """Engine passes besides the wild type's: distinct mutated position sets, or distinct mutants."""
        keys = {tuple(s.position for s in parse_mutant(self._mutants[r])) if self.masked else self._mutants[r]
                for r in rows}
        return len(keys)

    def runs(self, position: int) -> bool:
        return int(position) in self._variants()   # a record without variants has nothing to score

    def batch_tokens(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        by_record = self._variants()
        empty = np.zeros(0, np.int64)
        passes = np.array([self._passes(by_record.get(int(p), empty)) for p in positions], np.int64)
        return np.where(passes > 0, np.asarray(tokens, np.int64) * (1 + passes), 0)

    def run(self, engine, toks: list[Tokenized], positions: np.ndarray) -> TaskOutput:
        by_record = self._variants()
        empty = np.zeros(0, np.int64)
        rows = [by_record.get(int(p), empty) for p in positions]
        subs = [[parse_mutant(self._mutants[r]) for r in rr] for rr in rows]
        todo = [i for i, rr in enumerate(rows) if len(rr)]
        scores, computed = {name: [] for name in self.scores}, 0
        if todo:
            compute = self._masked if self.masked else self._causal
            scores, computed = compute(engine, [toks[i] for i in todo], [subs[i] for i in todo])
        # records without variants add no values, so the todo records' values in order are the rows' in order
        values = {f"{GROUP}/row": np.concatenate(rows).astype(np.int64) if rows else empty}
        for name in self.scores:
            values[f"{GROUP}/{name}"] = np.array([x for per_record in scores[name] for x in per_record], np.float64)
        return TaskOutput({}, values, {GROUP: np.array([len(rr) for rr in rows], np.int64)},
                          computed_tokens=computed)

    def _masked(self, engine, toks: list[Tokenized], subs: list[list[tuple[Substitution, ...]]]):
        """masked_marginal and wt_marginal of each record's variants: one engine call for the wild types and
        every masked copy."""
        assert self._tokens is not None, "prepare() first: it reads the run's tokenizer"
        batch, where, plans, n = [], [], [], 0
        for tok, variants in zip(toks, subs):
            content = np.flatnonzero(~tok.special)
            assert len(content) == len(tok.residues), "one token per residue (checked while planning)"
            changed = sorted({s.position for v in variants for s in v})
            wt_row = {p: n + k for k, p in enumerate(changed)}
            batch.append(list(tok.ids))
            where.append([int(content[p - 1]) for p in changed])
            n += len(changed)
            masked_row = {}
            for key in dict.fromkeys(tuple(s.position for s in v) for v in variants):
                copy = list(tok.ids)
                for p in key:
                    copy[content[p - 1]] = self._tokens.mask
                batch.append(copy)
                where.append([int(content[p - 1]) for p in key])
                masked_row[key] = {p: n + k for k, p in enumerate(key)}
                n += len(key)
            plans.append((wt_row, masked_row))
        table = self._tokens.table(engine.logprobs_at(batch, where)).cpu().numpy()
        out = {"masked_marginal": [], "wt_marginal": []}
        for (wt_row, masked_row), variants in zip(plans, subs):
            mm, wm = [], []
            for v in variants:
                rows = masked_row[tuple(s.position for s in v)]
                mm.append(_marginal(table, [rows[s.position] for s in v], v))
                wm.append(_marginal(table, [wt_row[s.position] for s in v], v))
            out["masked_marginal"].append(mm)
            out["wt_marginal"].append(wm)
        return out, sum(len(ids) for ids in batch)

    def _causal(self, engine, toks: list[Tokenized], subs: list[list[tuple[Substitution, ...]]]):
        """llr of each record's variants: the wild types and every distinct mutant sequence in one forward."""
        assert self._tokenizer is not None, "prepare() first: it keeps the run's tokenizer"
        texts, index = [t.residues for t in toks], {}
        for tok, variants in zip(toks, subs):
            for v in variants:
                index.setdefault(mutated(tok.residues, v), len(texts) + len(index))
        mutant_toks = self._tokenizer.encode(list(index)) if index else []
        batch = list(toks) + mutant_toks
        out = engine.forward([t.ids for t in batch], [], True)
        total = log_likelihoods_on_device(out, batch, self._tokenizer.unk_id)[0]   # (unknown residues: context)
        host = HostCopy({"total": total, "eos": eos_logprobs(out, batch, self._eos_id)}).wait()
        ll = host["total"] + np.nan_to_num(host["eos"], nan=0.0)   # each sequence's, its end term included
        llr = [[float(ll[index[mutated(tok.residues, v)]] - ll[i]) for v in variants]
               for i, (tok, variants) in enumerate(zip(toks, subs))]
        return {"llr": llr}, sum(len(t.ids) for t in batch)


def mutated(sequence: str, variant: tuple[Substitution, ...]) -> str:
    """The sequence with the variant's substitutions made."""
    chars = list(sequence)
    for s in variant:
        chars[s.position - 1] = s.mutant
    return "".join(chars)


def _marginal(table: np.ndarray, rows: list[int], variant: tuple[Substitution, ...]) -> float:
    """Sum over the substitutions of log p(mutant) - log p(wild type), each read from its row of the amino-acid
    table `[rows, 20]` (ResidueTokens.table)."""
    terms = []
    for r, s in zip(rows, variant):
        terms += [table[r, _AA[s.mutant]], -table[r, _AA[s.wild_type]]]
    return math.fsum(terms)
