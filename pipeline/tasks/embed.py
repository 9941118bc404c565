"""The embed task: pooled embeddings (`mean`, `cls`, `last`) of chosen hidden states, and optionally every
residue's vector. `mean` is over the sequence's non-special tokens, in float32 (DESIGN.md); `cls` is the
first token's state, `last` the last token's (a trailing special token such as <eos> included).

Per-residue rows are residues for every tokenizer: with a token per residue, each non-special token's state;
where a token stands for several residues (subword and k-mer tokenizers: ProtGPT2, Llama, Nucleotide
Transformer), its state on every residue it covers, and a token that covers none (a line break) gives no row
(residue_spans.py). The result says so (`per_residue_tokens`, output/schema.py)."""
from __future__ import annotations

import logging

import numpy as np
import torch

from ..config import RunConfig
from ..engine.interface import ForwardOutput, resolve_layers
from ..models.checkpoint import EngineInfo
from ..models.transfers import HostCopy, to_device
from ..output.schema import ONE_TOKEN_PER_RESIDUE, PER_RESIDUE_UNIT, TOKEN_STATE_ON_ITS_RESIDUES, Column
from .residue_spans import refuse_unplaced_tokens, token_of_residue
from .task import WINDOWS_COLUMN, ForwardTask, PendingOutput, Segments, TaskOutput, layer_suffix
from .tokenization import SequenceTokenizer, Tokenized

log = logging.getLogger("run_shards")


def cls_caveat(info: EngineInfo, tokenizer: SequenceTokenizer) -> str | None:
    """Why `--pool cls` does not describe the sequence with this model and tokenizer, where it does not (a
    warning at planning): the first token's state is a summary only where a bidirectional model reads a special
    token there (ESM's <cls>, BERT's [CLS])."""
    if info.is_causal:   # its first token attends to itself alone: that token's state, whatever follows
        return ("a causal LM computes the first token's state from that token alone, so embeddings/cls is the "
                "same vector for every sequence that begins with the same token (every sequence, where the "
                "tokenizer puts a beginning-of-sequence token first); `last` (the final token's state, computed "
                "from the whole sequence) or `mean` describe the sequence")
    if tokenizer.head == 0:
        return ("the tokenizer puts no special token before the residues (no <cls>), so embeddings/cls is the "
                "first residue's state, not a summary of the sequence; `mean` describes the sequence")
    return None


class EmbedTask(ForwardTask):
    name = "embed"

    def __init__(self, config: RunConfig, info: EngineInfo):
        self.info = info
        self.pools = list(config.pools)
        self.layers = resolve_layers(config.layers, info.num_layers)
        self.per_residue = config.per_residue
        self.per_residue_dtype = config.per_residue_dtype
        self.windowed = config.on_long == "window"
        self.tokenizer: SequenceTokenizer | None = None   # the run's (prepare): residue spans of its tokens

    logprobs = False

    def prepare(self, tokenizer: SequenceTokenizer) -> None:
        if self.per_residue:
            refuse_unplaced_tokens(tokenizer)
        self.tokenizer = tokenizer

    def attrs(self) -> dict:
        if not self.per_residue:
            return {}
        return {"per_residue_unit": PER_RESIDUE_UNIT, "per_residue_tokens": per_residue_tokens(self.tokenizer)}

    def columns(self) -> list[Column]:
        d, cols = self.info.hidden_size, []
        for layer in self.layers:
            sfx = layer_suffix(layer, self.info.num_layers)
            cols += [Column(f"embeddings/{pool}{sfx}", "float32", d) for pool in self.pools]
            if self.per_residue:
                cols.append(Column(f"per_residue/values{sfx}", self.per_residue_dtype, d, ragged=True))
        return cols + ([WINDOWS_COLUMN] if self.windowed else [])

    def launch_compute(self, out: ForwardOutput, toks: list[Tokenized]) -> PendingOutput:
        device = out.cu_seqlens.device
        s = Segments.of(out, toks)
        special, seg = s.special, s.seg
        keep = (~special).to(torch.float32)
        count = torch.zeros(len(toks), device=device).index_add_(0, seg, keep)
        rows = lengths = missing = None   # per residue: the token row it takes, known on the host
        if self.per_residue:
            host_rows, host_missing, lengths = self._residue_rows(toks)
            rows = to_device([host_rows], device)[0]
            missing = None if host_missing is None else to_device([host_missing], device)[0]
        results = {}
        for layer in self.layers:
            h = out.hidden[layer].float()
            sfx = layer_suffix(layer, self.info.num_layers)
            for pool in self.pools:
                if pool == "mean":
                    sums = torch.zeros(len(toks), h.shape[1], device=device).index_add_(0, seg, h * keep[:, None])
                    pooled = sums / count[:, None]   # no residue tokens -> NaN, never a silent zero
                elif pool == "cls":
                    pooled = h[out.cu_seqlens[:-1]]
                else:
                    pooled = h[out.cu_seqlens[1:] - 1]
                results[f"embeddings/{pool}{sfx}"] = pooled
            if self.per_residue:
                dtype = torch.float16 if self.per_residue_dtype == "float16" else torch.float32
                values = h.index_select(0, rows)
                if missing is not None:   # a residue no token covers (a character the tokenizer dropped)
                    values = values.index_fill(0, missing, float("nan"))
                results[f"per_residue/values{sfx}"] = values.to(dtype)
        lengths = {"per_residue": lengths} if self.per_residue else {}

        def build(host: dict[str, np.ndarray]) -> TaskOutput:
            columns = {k: v for k, v in host.items() if k.startswith("embeddings/")}
            values = {k: v for k, v in host.items() if k.startswith("per_residue/")}
            if self.per_residue_dtype == "float16":
                warn_past_float16(values)
            return TaskOutput(columns, values, lengths)

        return PendingOutput(HostCopy(results), build)

    def _residue_rows(self, toks: list[Tokenized]) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """(for each residue of the batch, the row of the engine output it takes its state from; the residues no
        token covers, None if there are none; each sequence's residue count)."""
        if self.tokenizer is None:
            raise RuntimeError("EmbedTask.prepare(tokenizer) must be called before per-residue rows are computed")
        starts = np.concatenate(([0], np.cumsum([len(t.special) for t in toks])[:-1])).astype(np.int64)
        if self.tokenizer.one_token_per_residue:
            special = np.concatenate([t.special for t in toks])
            counts = np.array([int((~t.special).sum()) for t in toks], np.int64)
            return np.flatnonzero(~special), None, counts
        rows, counts = [], []
        for start, tok, spans in zip(starts, toks, self.tokenizer.content_spans_of(toks)):
            token = token_of_residue(spans)
            content = start + np.flatnonzero(~tok.special)
            rows.append(np.where(token >= 0, content[token.clip(min=0)], -1))
            counts.append(len(token))
        flat = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        missing = np.flatnonzero(flat < 0)
        return flat.clip(min=0), (missing if len(missing) else None), np.asarray(counts, np.int64)


def per_residue_tokens(tokenizer: SequenceTokenizer | None) -> str:
    """How an embedding's per-residue rows come from the tokens, in words (the result's attribute)."""
    if tokenizer is not None and tokenizer.one_token_per_residue:
        return ONE_TOKEN_PER_RESIDUE
    return TOKEN_STATE_ON_ITS_RESIDUES


def warn_past_float16(values: dict[str, np.ndarray]) -> None:
    """Warn (the worker's log) where float16 per-residue values overflowed: a state past float16's range,
    +-65,504 (the residual stream of an intermediate layer of a large LLM can reach it), is stored as +-inf."""
    for path, v in values.items():
        over = int(np.isinf(v).any(axis=-1).sum()) if v.size else 0
        if over:
            log.warning("%s: %d residue(s) of this batch have values past float16's range (+-65,504), stored as "
                        "+-inf; --per-residue-dtype float32 keeps them (a setting of the result: a new run in "
                        "another --out)", path, over)
