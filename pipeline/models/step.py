"""What one engine step hands the model: the step's tokens and where each sequence's state lives.

Built by the model runner on the host, moved to the device once, read by the layers. Tensors that
several layers derive from it (the conv-window gather of the delta-rule layers) are memoised here so
they are built once per step, not once per layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .transfers import to_device


@dataclass
class StepContext:
    input_ids: torch.Tensor           # int64 [T]: the step's tokens, sequence after sequence
    positions: torch.Tensor           # int64 [T]: each token's position in its sequence
    cu_seqlens: torch.Tensor          # int32 [S+1]: where each sequence's tokens start in the step
    kv_lens: torch.Tensor             # int32 [S]: context length after this step (prior tokens + new)
    block_tables: torch.Tensor        # int32 [S, max pages]: each sequence's KV pages in order
    slot_mapping: torch.Tensor        # int64 [T]: KV cache slot (page * page_size + offset) per token
    q_lens: np.ndarray                # int64 [S] (host): new tokens per sequence
    prior_lens: np.ndarray            # int64 [S] (host): tokens each sequence had before this step
    # Delta-rule state slots, host arrays: (rows of the step's sequences, their state slots)
    state_read: tuple[np.ndarray, np.ndarray] | None    # sequences that continue a stored state
    state_write: tuple[np.ndarray, np.ndarray] | None   # sequences whose state is kept after the step
    triton_kernels: bool = False       # run the kernels' Triton implementations (else their torch ones)
    attention_launch: dict = field(default_factory=dict)  # explicit paged-attention launch knobs
    invariant_block: int = 0           # batch-invariant: prefills are cut at multiples of this (0: not)
    decoding: np.ndarray | None = None  # bool [S] (host): the sequence feeds back a generated token
    host_ids: np.ndarray | None = None        # int64 [T] (host): input_ids as the runner built them
    host_positions: np.ndarray | None = None  # int64 [T] (host): positions likewise
    # With `rows` (a step whose output is read at some rows only): int64 [S] (host), how many of those rows
    # each sequence holds, known on the host so the model needs no read-back to lay out their attention.
    row_counts: np.ndarray | None = None
    memo: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def all_decode(self) -> bool:
        """Every sequence adds one token to a context it already has (a pure decode step)."""
        return bool((self.q_lens == 1).all() and (self.prior_lens > 0).all())

    def delta_rule_form(self) -> str:
        """How the delta-rule layers run this step: "recurrent" (one token per sequence onto its state),
        "chunked", or "mixed". Batch-invariant steps choose per token, so that a token takes the same form
        in any step: recurrent for generated tokens, chunked for prompt tokens, mixed when a step has both;
        other steps run recurrent whenever every sequence adds one token to a state it has."""
        if not self.invariant_block or self.decoding is None:
            return "recurrent" if self.all_decode else "chunked"
        return "recurrent" if self.decoding.all() else "mixed" if self.decoding.any() else "chunked"

    def cached(self, key: str, build: Callable[[], object]):
        if key not in self.memo:
            self.memo[key] = build()
        return self.memo[key]

    def on_device(self, key: str, array: np.ndarray, dtype=np.int64) -> torch.Tensor:
        """A host index array as a device tensor (int64 unless `dtype` says otherwise), built once per step and
        sent without waiting (transfers.to_device)."""
        return self.cached(key, lambda: to_device([np.asarray(array, dtype)], self.device)[0])

    def host_segment_ids(self) -> np.ndarray:
        """int64 [T] (host): segment_ids as the host knows them."""
        return np.repeat(np.arange(self.num_seqs), self.q_lens)

    def segment_ids(self) -> torch.Tensor:
        """int64 [T]: the sequence (0..S-1) each token belongs to (built on the host: a repeat_interleave
        with repeats on the device would wait for it to learn the output size)."""
        return self.on_device("segment_ids", self.host_segment_ids())
