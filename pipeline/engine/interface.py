"""What an inference engine gives the tasks, whichever engine it is (`hf` or `native`).

An engine takes a batch of token-id lists and returns, per requested layer, the hidden states of every
real token as one ragged tensor (`[sum of lengths, D]` plus `cu_seqlens`), and optionally each token's
log-probability given all tokens before it. Tasks (pooling, scoring) only ever see this ragged form.
`logprobs_at` gives the language-model head's whole distribution at chosen positions of each sequence (a
masked LM's at its masked positions), computing the head there only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from ..models.checkpoint import EngineInfo

# Logits are computed a slice of rows at a time, at most this many float32 values (256 MiB) at once.
LOGITS_CHUNK_ELEMENTS = 1 << 26


def logits_rows(vocab_size: int, copies: int = 1) -> int:
    """Rows of logits to compute at once over a vocabulary of `vocab_size`, with `copies` float32-sized
    copies of them alive at a time (a float64 copy counts 2)."""
    return max(1, LOGITS_CHUNK_ELEMENTS // vocab_size // copies)


@dataclass
class ForwardOutput:
    cu_seqlens: torch.Tensor                    # int64 [B+1] on the engine's device
    hidden: dict[int, torch.Tensor]             # layer (non-negative) -> [sum T, D]
    token_logprobs: torch.Tensor | None = None  # float64 [sum T]: log p(token_t | tokens < t); 0 at t = 0


class Engine(Protocol):
    info: EngineInfo
    device: torch.device

    def forward(self, batch: Sequence[Sequence[int]], layers: Sequence[int], logprobs: bool) -> ForwardOutput:
        ...

    def logprobs_at(self, batch: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]) -> torch.Tensor:
        """float64 `[sum of len(positions[i]), V]` on the engine's device: the log-softmax over the whole
        vocabulary of the head's logits at token positions[i][j] of sequence i, rows in batch order and, per
        sequence, in the order given (a masked LM: p(token there | the sequence as given); a causal LM: p(next
        token | the tokens up to there)). The logits are the model's (its dtype); the log-softmax is float64."""
        ...


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """float64 log p(target) per row: the log-softmax of the logits taken in float64, so that sums and
    differences of scores (a variant's llr) carry no float32 rounding of each term."""
    logits = logits.double()
    return logits.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)


class OutOfMemory(RuntimeError):
    """A batch did not fit in device memory (raised by engines for torch.OutOfMemoryError)."""


class Stopped(Exception):
    """A call given up because its caller's `alive` said so: a generate batch between two engine steps (its steps
    are unbounded), a batch run as windows between two calls of its windows (engine/windowed.py). It returns
    nothing, and what it computed is dropped."""


def resolve_layers(layers: Sequence[int], num_layers: int) -> list[int]:
    """Map user layer numbers (negative counts from the end; -1 = final norm output) to 0..num_layers."""
    out = []
    for layer in layers:
        k = layer + num_layers + 1 if layer < 0 else layer
        if not 0 <= k <= num_layers:
            from ..errors import UserError
            raise UserError(f"--layers {layer} is out of range: the model has hidden states 0..{num_layers} "
                            f"(or -1..-{num_layers + 1})")
        if k not in out:
            out.append(k)
    return out


def same_layers(layers: Sequence[int], num_layers: int) -> list[list[int]]:
    """Groups of `--layers` values that name one hidden state of a model of `num_layers` layers (-1 and 2 of a
    2-layer model), each stored once, under its number from the start (resolve_layers)."""
    groups: dict[int, list[int]] = {}
    for layer in layers:
        groups.setdefault(layer + num_layers + 1 if layer < 0 else layer, []).append(layer)
    return [g for g in groups.values() if len(g) > 1]
