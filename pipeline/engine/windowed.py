"""`--on-long window`: a sequence over the model's token limit runs as overlapping windows, and the windows'
outputs are stitched back into one sequence before any task sees them, so pooling and scoring are the
same code for every row.

A tokenized sequence is `head` special tokens (ESM's <cls>, Llama's <bos>), its content tokens, and `tail`
special tokens (ESM's <eos>). Each window is the same head, `size` consecutive content tokens, and the same
tail, so every window is a sequence the model was trained on (at most `window` tokens). Windows start every
`size - overlap` content tokens; the last one ends with the sequence (it may overlap its neighbour more).

Stitching, per token of the sequence:
- hidden states (per-residue values, and the pools computed from them): from the window where the token
  sits farthest from a window edge (ties: the earlier window); the head's special tokens come from the
  first window and the tail's from the last, so `cls` is the first window's <cls> state and `last` the
  last window's final token. `mean` averages the stitched residues.
- log-probabilities (score): from the earliest window that holds the token, which gives it every token
  of that window before it as context: at least `overlap` content tokens (plus the head), and as many as
  an unwindowed run would within the first window.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .interface import ForwardOutput, Stopped


def window_starts(n: int, size: int, overlap: int) -> list[int]:
    """Where each window's content starts, for n content tokens and windows of `size` content tokens."""
    if n <= size:
        return [0]
    step = size - overlap
    return list(range(0, n - size, step)) + [n - size]


@dataclass(frozen=True)
class Windows:
    """How sequences of one tokenizer are cut: at most `limit` tokens per window, `overlap` content tokens
    shared by neighbours, `head`/`tail` special tokens around the content of every sequence."""
    limit: int
    overlap: int
    head: int
    tail: int

    @property
    def size(self) -> int:
        return self.limit - self.head - self.tail

    def count(self, num_tokens: int) -> int:
        """Windows a sequence of `num_tokens` tokens (specials included) runs as."""
        return len(window_starts(num_tokens - self.head - self.tail, self.size, self.overlap))

    def split(self, ids: list[int]) -> tuple[list[list[int]], list[int]]:
        """The windows' token ids and their content starts (one window, the sequence itself, when it fits)."""
        if len(ids) <= self.limit:
            return [list(ids)], [0]
        head, content = ids[:self.head], ids[self.head:len(ids) - self.tail]
        tail = ids[len(ids) - self.tail:]
        starts = window_starts(len(content), self.size, self.overlap)
        return [head + content[s:s + self.size] + tail for s in starts], starts

    def rows(self, num_tokens: int, starts: list[int], first_row: int) -> tuple[np.ndarray, np.ndarray]:
        """For each token of a sequence, the row of the windows' output it takes its hidden state from and
        the row it takes its log-probability from (the windows' rows start at `first_row`, each window
        head + size + tail rows long)."""
        if len(starts) == 1:
            rows = np.arange(first_row, first_row + num_tokens)
            return rows, rows
        n, size, per = num_tokens - self.head - self.tail, self.size, self.limit
        s = np.asarray(starts, np.int64)   # increasing
        j = np.arange(n, dtype=np.int64)
        # Per token, not per (token, window) pair: a record of thousands of windows made [n, windows] arrays
        # (200,000 residues in windows of 34 tokens: 1.7e9 cells, tens of GB). The windows holding token j are
        # the consecutive first..last; from each, its distance to the nearer edge is min(j - s, s + size - 1 - j),
        # the first term falling and the second rising with s, so the farthest is `cross` (the first window whose
        # end is no nearer than its start) or the one before it (ties: the earlier).
        earliest = np.searchsorted(s + size, j, "right")           # first window ending after j
        latest = np.searchsorted(s, j, "right") - 1                # last window starting at or before j
        cross = np.clip(np.searchsorted(2 * s, 2 * j - size + 1, "left"), earliest, latest)
        before = np.maximum(cross - 1, earliest)

        def edge(k: np.ndarray) -> np.ndarray:
            return np.minimum(j - s[k], s[k] + size - 1 - j)
        farthest = np.where(edge(before) >= edge(cross), before, cross)

        def content_rows(k: np.ndarray) -> np.ndarray:
            return first_row + k * per + self.head + (j - s[k])

        head = np.arange(first_row, first_row + self.head)
        last = first_row + (len(starts) - 1) * per
        tail = np.arange(last + self.head + size, last + per)
        return (np.concatenate([head, content_rows(farthest), tail]),
                np.concatenate([head, content_rows(earliest), tail]))


class WindowedEngine:
    """An engine whose forward runs sequences over the limit as windows and returns stitched outputs, with
    the wrapped engine's cu_seqlens layout (one row per token of each sequence as given)."""

    def __init__(self, engine, windows: Windows, budget: int | None = None, on_call=None, alive=None):
        """`budget`: the most tokens (padded: windows x the longest) one call of the wrapped engine gets; the
        windows of a batch run in calls of at most that (at least one window each). `on_call(done, of, tokens)`,
        after each call of a batch run in several: its windows done so far, of how many, and the call's tokens
        (a sequence of 200,000 residues is thousands of windows in one batch: minutes without another sign).
        `alive(done, of)`, asked before each call after the first: False gives the batch up there (Stopped), so
        that a stop signal waits for one call of windows, not for all of a long record's (tens of minutes on a
        CPU for a million residues)."""
        self.engine, self.windows, self.budget, self.on_call, self.alive = engine, windows, budget, on_call, alive
        self.info, self.device = engine.info, engine.device

    def __getattr__(self, name):   # everything else (stats, tokenizer) is the wrapped engine's
        return getattr(self.engine, name)

    def forward(self, batch, layers, logprobs: bool) -> ForwardOutput:
        pieces, plans = [], []
        for ids in batch:
            split, starts = self.windows.split(list(ids))
            plans.append((len(ids), starts, len(pieces)))
            pieces += split
        if len(pieces) == len(batch):
            return self.engine.forward(batch, layers, logprobs)
        out = self._forward_in_calls(pieces, layers, logprobs)
        piece_starts = out.cu_seqlens[:-1].tolist()
        hidden_rows, logprob_rows = [], []
        for num_tokens, starts, first in plans:
            h, lp = self.windows.rows(num_tokens, starts, piece_starts[first])
            hidden_rows.append(h)
            logprob_rows.append(lp)
        device = out.cu_seqlens.device
        h_index = torch.from_numpy(np.concatenate(hidden_rows)).to(device)
        lengths = torch.tensor([0] + [n for n, _, _ in plans], dtype=out.cu_seqlens.dtype)
        stitched = ForwardOutput(cu_seqlens=torch.cumsum(lengths, 0).to(device),
                                 hidden={k: v[h_index] for k, v in out.hidden.items()})
        if out.token_logprobs is not None:
            stitched.token_logprobs = out.token_logprobs[torch.from_numpy(np.concatenate(logprob_rows)).to(device)]
        return stitched

    def _forward_in_calls(self, pieces: list[list[int]], layers, logprobs: bool) -> ForwardOutput:
        """The wrapped engine's forward over all the windows, in calls within the budget, joined: a batch's budget
        counts a long sequence's windows, but the batch takes at least one sequence, and a sequence of thousands
        of windows went to the engine in one call (the hf engine pads them into one tensor and keeps every
        layer's states of every window: memory without bound)."""
        calls, start = [], 0
        while start < len(pieces):
            end, longest = start + 1, len(pieces[start])
            while end < len(pieces) and self.budget \
                    and max(longest, len(pieces[end])) * (end + 1 - start) <= self.budget:
                longest = max(longest, len(pieces[end]))
                end += 1
            if not self.budget:
                end = len(pieces)
            calls.append((start, end))
            start = end
        if len(calls) == 1:
            return self.engine.forward(pieces, layers, logprobs)
        outs = []
        for a, b in calls:
            if a and self.alive is not None and not self.alive(a, len(pieces)):
                raise Stopped(f"given up after {a:,} of its {len(pieces):,} windows")
            outs.append(self.engine.forward(pieces[a:b], layers, logprobs))
            if self.on_call is not None:
                self.on_call(b, len(pieces), sum(len(p) for p in pieces[a:b]))
        lengths = torch.tensor([0] + [len(p) for p in pieces], dtype=outs[0].cu_seqlens.dtype)
        return ForwardOutput(cu_seqlens=torch.cumsum(lengths, 0).to(outs[0].cu_seqlens.device),
                             hidden={k: torch.cat([o.hidden[k] for o in outs]) for k in outs[0].hidden},
                             token_logprobs=None if outs[0].token_logprobs is None
                             else torch.cat([o.token_logprobs for o in outs]))


def plan(config, limit: int | None, tokenizer) -> Windows:
    """Fix the run's window size and overlap (written to its config, so workers and reruns use the same)."""
    from ..errors import UserError
    window = config.window or limit
    if not window:
        raise UserError("--on-long window needs a window size: this model has no token limit, so pass "
                        "--window N (tokens per window, special tokens included)")
    if limit and window > limit:
        whose = "the --max-length limit" if config.max_length == limit else "the model's limit"
        raise UserError(f"--window {window} is over {whose} of {limit} tokens; use at most {limit}")
    size = window - tokenizer.head - tokenizer.tail
    # (unless given, the window is the limit, and a larger --window would be over it: the limit is what to raise)
    what, fix = (f"--window {window}", "a larger --window") if config.window else \
        (f"--max-length {window}", "a larger --max-length (the window when --window is not given)") \
        if config.max_length == limit else (f"the model's limit of {window} tokens", "another model")
    if size < 2:
        raise UserError(f"{what} leaves {size} residue token(s) per window beside the "
                        f"{tokenizer.head + tokenizer.tail} special token(s); use {fix}")
    # A score needs a token before each scored one. Where the tokenizer puts none before the content (no BOS:
    # Qwen), a window's first token has no context of its own, so every later window must share at least one
    # token with the one before it, which then gives that token its log-probability.
    least = 1 if getattr(config, "task", None) == "score" and tokenizer.head == 0 else 0
    overlap = max(size // 4, least) if config.overlap is None else config.overlap
    if overlap < least:
        raise UserError(f"--overlap {overlap} leaves the first token of every window after the first without a "
                        f"token before it (this model's tokenizer puts no beginning-of-sequence token before a "
                        f"sequence), and --task score cannot score such a token; use --overlap {least} or more")
    if overlap >= size:
        raise UserError(f"--overlap {overlap} must be below the {size} residue tokens of a window "
                        f"({what} less {tokenizer.head + tokenizer.tail} special token(s))")
    config.window, config.overlap = window, overlap
    return Windows(window, overlap, tokenizer.head, tokenizer.tail)
