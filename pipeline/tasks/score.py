"""The score task. A causal LM's score (this module): per sequence, the sum over non-special tokens with at
least one token before them of log p(token | all tokens before it, special ones included), accumulated in
float64 (DESIGN.md); `num_scored` counts those tokens. A masked LM's (pseudo-log-likelihood or wild-type
marginal) is masked_score.py's; `score_task` picks the one the model has.

`score/eos_logprob` keeps the end-of-sequence term apart: log p(<eos> | every token before it) where the
sequence's tokens end with the tokenizer's end-of-sequence token (ProtGPT2's card text ends with
<|endoftext|>), NaN where they end with none (Llama, Mistral, Qwen: their tokenizers add no <eos>). With it the
card's perplexity, `exp(model(input_ids, labels=input_ids).loss)`, which averages every token after the first
(the <eos> included), is `exp(-(logprob_sum + eos_logprob) / (num_scored + 1))`.

With --per-residue a causal LM stores each residue's log-probability, `per_residue/logprob`: its token's, for a
tokenizer with a token per residue; where a token stands for several residues (subword tokenizers), each of
them gets an equal share of the token's log-probability, so a sequence's residues still sum to its score's
residue tokens. A residue whose token has no token before it (no BOS) is NaN.

A residue the tokenizer does not know (a row of status 2) is fed as the unknown token, context for the tokens
after it, but is not scored: its log p(<unk>) is left out of the sum and the count, and its per-residue value is NaN.
"""
from __future__ import annotations

import numpy as np
import torch

from ..config import RunConfig
from ..engine.interface import ForwardOutput
from ..errors import UserError
from ..models.checkpoint import EngineInfo
from ..output.schema import ONE_TOKEN_PER_RESIDUE, PER_RESIDUE_UNIT, TOKEN_LOGPROB_SHARED, Column
from ..models.transfers import HostCopy, to_device
from .residue_spans import refuse_unplaced_tokens
from .task import EOS_LOGPROB, RESIDUE_LOGPROB, WINDOWS_COLUMN, ForwardTask, PendingOutput, Segments, TaskOutput
from .tokenization import SequenceTokenizer, Tokenized

def score_task(config: RunConfig, info: EngineInfo):
    """The score task of the model: a causal LM's log-likelihood, or a masked LM's (pseudo-)likelihood."""
    if info.is_causal:
        if config.score_method != "auto":
            raise UserError(f"--score-method {config.score_method} is for masked language models; a causal LM's "
                            "score is its log-likelihood (leave out --score-method)")
        return ScoreTask(config, info)
    if info.masked_lm:
        from .masked_score import MaskedScoreTask
        return MaskedScoreTask(config, info)
    raise UserError(f"--task score needs a language model with its head: a causal LM, or a masked LM whose "
                    f"config.json names a *ForMaskedLM class (ESM-2's EsmForMaskedLM); "
                    f"{info.architecture or 'this model'} is neither (a bare encoder has no token "
                    "probabilities). Use --task embed, or pass such a checkpoint with --model.")


def log_likelihoods_on_device(out: ForwardOutput, toks: list[Tokenized], unknown: int | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sequence, on the engine's device: the float64 sum of the scored tokens' log-probabilities, their
    count, and which tokens are scored (bool [sum T]: non-special, not the `unknown` token's id, with a token
    before them)."""
    device = out.cu_seqlens.device
    s = Segments.of(out, toks)
    position = torch.arange(len(s.seg), device=device) - out.cu_seqlens[:-1][s.seg]
    scored = (~s.special) & (position >= 1)
    if unknown is not None and any(t.unknown for t in toks):   # an unknown residue is context, not scored
        residue = np.concatenate([np.asarray(t.ids, np.int64) != unknown for t in toks])
        scored = scored & to_device([residue], device)[0]
    lp = torch.where(scored, out.token_logprobs.double(), torch.zeros((), dtype=torch.float64, device=device))
    total = torch.zeros(len(toks), dtype=torch.float64, device=device).index_add_(0, s.seg, lp)
    n = torch.zeros(len(toks), dtype=torch.int64, device=device).index_add_(0, s.seg, scored.long())
    return total, n, scored


def end_token(tokenizer: SequenceTokenizer) -> int | None:
    """The tokenizer's end-of-sequence token id, or None where it has none."""
    return getattr(tokenizer.tokenizer, "eos_token_id", None)


def ends_with_eos(tok: Tokenized, eos_id: int | None) -> bool:
    """The sequence's tokens end with the end-of-sequence token (special, with a token before it)."""
    return eos_id is not None and len(tok.ids) > 1 and bool(tok.special[-1]) and tok.ids[-1] == eos_id


def eos_logprobs(out: ForwardOutput, toks: list[Tokenized], eos_id: int | None) -> torch.Tensor:
    """float64 [B] on the engine's device: each sequence's last token's log-probability where the sequence ends
    with the end-of-sequence token `eos_id` (ends_with_eos); NaN for the others."""
    last = out.cu_seqlens[1:] - 1
    if eos_id is None:   # a tokenizer without an end-of-sequence token: nothing to copy to the device
        return torch.full(last.shape, float("nan"), dtype=torch.float64, device=last.device)
    ends = np.array([ends_with_eos(t, eos_id) for t in toks])
    lp = out.token_logprobs.double()[last]
    has = to_device([ends], lp.device)[0]
    return torch.where(has, lp, torch.full_like(lp, float("nan")))


class ScoreTask(ForwardTask):
    name = "score"

    def __init__(self, config: RunConfig, info: EngineInfo):
        self.info = info
        self.layers: list[int] = []
        self.windowed = config.on_long == "window"
        self.per_residue = config.per_residue
        self.tokenizer: SequenceTokenizer | None = None   # the run's (prepare): residue spans of subword tokens
        self.eos_id: int | None = None                      # its end-of-sequence token

    logprobs = True

    def columns(self) -> list[Column]:
        return [Column("score/logprob_sum", "float64"), Column("score/num_scored", "int32"), EOS_LOGPROB] + (
            [RESIDUE_LOGPROB] if self.per_residue else []) + ([WINDOWS_COLUMN] if self.windowed else [])

    def attrs(self) -> dict:
        if not self.per_residue:
            return {"score_method": "causal"}
        one = self.tokenizer is not None and self.tokenizer.one_token_per_residue
        spread = ONE_TOKEN_PER_RESIDUE if one else TOKEN_LOGPROB_SHARED
        return {"score_method": "causal", "per_residue_unit": PER_RESIDUE_UNIT, "per_residue_tokens": spread}

    def prepare(self, tokenizer: SequenceTokenizer) -> None:
        if self.per_residue:
            refuse_unplaced_tokens(tokenizer)
        self.tokenizer = tokenizer
        self.eos_id = end_token(tokenizer)

    def launch_compute(self, out: ForwardOutput, toks: list[Tokenized]) -> PendingOutput:
        total, n, scored = log_likelihoods_on_device(out, toks, self.tokenizer.unk_id if self.tokenizer else None)
        device = {"total": total, "n": n, "eos": eos_logprobs(out, toks, self.eos_id)}
        if self.per_residue:
            device.update(token_logprobs=out.token_logprobs.double(), scored=scored)
        bounds = np.concatenate(([0], np.cumsum([len(t.special) for t in toks]))).astype(np.int64)

        def build(host: dict[str, np.ndarray]) -> TaskOutput:
            columns = {"score/logprob_sum": host["total"], "score/num_scored": host["n"].astype(np.int32),
                       EOS_LOGPROB.path: host["eos"]}
            result = TaskOutput(columns, {}, {})
            if self.per_residue:
                values, lengths = self._per_residue(host["token_logprobs"], host["scored"], bounds, toks)
                result.values[RESIDUE_LOGPROB.path] = values
                result.lengths["per_residue"] = lengths
            return result

        return PendingOutput(HostCopy(device), build)

    def _per_residue(self, lp: np.ndarray, ok: np.ndarray, bounds: np.ndarray, toks: list[Tokenized]):
        """Each sequence's residues' log-probabilities (float32) and how many residues each has, from every
        token's log-probability `lp`, whether it is scored (`ok`) and where each sequence starts (`bounds`)."""
        rows, lengths = [], []
        all_spans = self.tokenizer.content_spans_of(toks)
        for i, tok in enumerate(toks):
            content = np.flatnonzero(~tok.special)
            token_lp = np.where(ok[bounds[i]:bounds[i + 1]][content], lp[bounds[i]:bounds[i + 1]][content], np.nan)
            spans = all_spans[i]
            count = int(spans[:, 1].max()) if len(spans) else 0
            residue = np.full(count, np.nan)
            for (a, b), value in zip(spans, token_lp):
                if b > a:
                    residue[a:b] = value / (b - a)
            rows.append(residue.astype(np.float32))
            lengths.append(count)
        return np.concatenate(rows) if rows else np.zeros(0, np.float32), np.asarray(lengths, np.int64)
