"""What every task gives the worker: a TaskOutput of per-row columns and ragged values, the hooks planning and
the worker call (Task), and the ragged layout of an engine's output (which token belongs to which sequence,
which tokens are special)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..engine.interface import ForwardOutput
from ..output.schema import Column
from .tokenization import SequenceTokenizer, Tokenized

# --on-long window: how many windows each row ran as (1 for a sequence within the limit; 0 for a row
# that was not computed).
WINDOWS_COLUMN = Column("windows", "int32")
# score --per-residue: each residue's log-probability (causal and masked LMs alike).
RESIDUE_LOGPROB = Column("per_residue/logprob", "float32", ragged=True)


def layer_suffix(layer: int, num_layers: int) -> str:
    return "" if layer == num_layers else f"_layer{layer}"


@dataclass
class TaskOutput:
    columns: dict[str, np.ndarray]          # per-row arrays for the computed sequences
    values: dict[str, np.ndarray]           # ragged values
    lengths: dict[str, np.ndarray]          # per-row lengths of each ragged group
    computed_tokens: int | None = None      # tokens the engine ran, where not the rows' own (masked copies)


class Task:
    """What planning and the worker ask of every task, beyond its columns and `run`."""

    def attrs(self) -> dict:
        """Root attributes of the output files (e.g. the order of a table's columns)."""
        return {}

    def prepare(self, tokenizer: SequenceTokenizer) -> None:
        """Refuse (UserError) what this task cannot do with the run's tokenizer, and keep what it needs of it:
        planning calls it before any compute, each worker before its first batch."""

    def batch_tokens(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """What each row costs the engine, in tokens (rows of `tokens` tokens at FASTA `positions`): batches
        are planned on it."""
        return tokens


@dataclass
class Segments:
    """Which sequence each token of a ragged engine output belongs to, and whether it is special."""
    special: torch.Tensor    # bool [sum T]
    seg: torch.Tensor        # int64 [sum T]: the token's sequence
    lengths: torch.Tensor    # int64 [B]

    @classmethod
    def of(cls, out: ForwardOutput, toks: list[Tokenized]) -> "Segments":
        device = out.cu_seqlens.device
        special = torch.from_numpy(np.concatenate([t.special for t in toks])).to(device)
        lengths = out.cu_seqlens[1:] - out.cu_seqlens[:-1]
        seg = torch.repeat_interleave(torch.arange(len(toks), device=device), lengths)
        return cls(special, seg, lengths)


class ForwardTask(Task):
    """A task computed from one engine forward over the batch (embed, score)."""
    layers: list[int]
    logprobs: bool

    def run(self, engine, toks: list[Tokenized], positions: np.ndarray) -> TaskOutput:
        return self.compute(engine.forward([t.ids for t in toks], self.layers, self.logprobs), toks)

    def compute(self, out: ForwardOutput, toks: list[Tokenized]) -> TaskOutput:
        raise NotImplementedError
