"""What an inference engine gives the tasks, whichever engine it is (`hf` or `native`).

An engine takes a batch of token-id lists and returns, per requested layer, the hidden states of every
real token as one ragged tensor (`[sum of lengths, D]` plus `cu_seqlens`), and optionally each token's
log-probability given all tokens before it. Tasks (pooling, scoring) only ever see this ragged form.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from ..models.checkpoint import EngineInfo


@dataclass
class ForwardOutput:
    cu_seqlens: torch.Tensor                    # int64 [B+1] on the engine's device
    hidden: dict[int, torch.Tensor]             # layer (non-negative) -> [sum T, D]
    token_logprobs: torch.Tensor | None = None  # float32 [sum T]: log p(token_t | tokens < t); 0 at t = 0


class Engine(Protocol):
    info: EngineInfo
    device: torch.device

    def forward(self, batch: Sequence[Sequence[int]], layers: Sequence[int], logprobs: bool) -> ForwardOutput:
        ...


class OutOfMemory(RuntimeError):
    """A batch did not fit in device memory (raised by engines for torch.OutOfMemoryError)."""


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
