"""What every task gives the worker: a TaskOutput of per-row columns and ragged values (or a PendingOutput: one
still on its way from the device), the hooks planning and the worker call (Task), and the ragged layout of an
engine's output (which token belongs to which sequence, which tokens are special)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..engine.interface import ForwardOutput
from ..models.transfers import HostCopy, to_device
from ..output.schema import Column
from .tokenization import SequenceTokenizer, Tokenized

# --on-long window: how many windows each row ran as (1 for a sequence within the limit; 0 for a row
# that was not computed).
WINDOWS_COLUMN = Column("windows", "int32")
# A causal LM's score: log p(<eos> | the sequence) where its tokens end with the tokenizer's <eos>, else NaN.
EOS_LOGPROB = Column("score/eos_logprob", "float64")
# score --per-residue: each residue's log-probability (causal and masked LMs alike).
RESIDUE_LOGPROB = Column("per_residue/logprob", "float32", ragged=True)


def layer_suffix(layer: int, num_layers: int) -> str:
    return "" if layer == num_layers else f"_layer{layer}"


@dataclass
class TaskOutput:
    columns: dict[str, np.ndarray]          # per-row arrays for the computed sequences
    values: dict[str, np.ndarray]           # ragged values
    lengths: dict[str, np.ndarray]          # per-row lengths of each ragged group
    computed_tokens: int | None = None      # tokens the engine ran, where not the rows' own (masked copies, generated)


class PendingOutput:
    """A batch's TaskOutput while its numbers are still being computed and copied: `result()` waits for the
    copies (HostCopy: the batch's one wait for the device) and builds the TaskOutput from the host arrays.
    The worker launches batch N + 1 before it asks for batch N's result."""

    def __init__(self, copies: HostCopy | None, build: Callable[[dict[str, np.ndarray]], TaskOutput]):
        self._copies, self._build = copies, build

    @classmethod
    def ready(cls, output: TaskOutput) -> "PendingOutput":
        return cls(None, lambda _: output)

    def result(self) -> TaskOutput:
        return self._build(self._copies.wait() if self._copies is not None else {})


class Task:
    """What planning and the worker ask of every task, beyond its columns and `run` (or `launch`)."""

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

    def runs(self, position: int) -> bool:
        """Whether the record at this FASTA position goes through the model at all: the length limit applies
        only to those that do (a variants task runs only the records that have variants)."""
        return True

    def launch(self, engine, toks: list, positions: np.ndarray) -> PendingOutput:
        """The batch's work queued on the device, its result to be taken later. Tasks that read results back
        as they go (generation, variants) compute it here and now."""
        return PendingOutput.ready(self.run(engine, toks, positions))


@dataclass
class Segments:
    """Which sequence each token of a ragged engine output belongs to, and whether it is special."""
    special: torch.Tensor    # bool [sum T]
    seg: torch.Tensor        # int64 [sum T]: the token's sequence
    lengths: torch.Tensor    # int64 [B]

    @classmethod
    def of(cls, out: ForwardOutput, toks: list[Tokenized]) -> "Segments":
        """Built on the host from the tokens (an engine returns every token of each sequence) and sent in one
        copy: a repeat_interleave by the device's lengths would wait for the device to learn its size."""
        special = np.concatenate([t.special for t in toks])
        seg = np.repeat(np.arange(len(toks)), [len(t.special) for t in toks])
        special_d, seg_d = to_device([special, seg], out.cu_seqlens.device)
        return cls(special_d, seg_d, out.cu_seqlens[1:] - out.cu_seqlens[:-1])


class ForwardTask(Task):
    """A task computed from one engine forward over the batch (embed, score)."""
    layers: list[int]
    logprobs: bool

    def run(self, engine, toks: list[Tokenized], positions: np.ndarray) -> TaskOutput:
        return self.launch(engine, toks, positions).result()

    def launch(self, engine, toks: list[Tokenized], positions: np.ndarray) -> PendingOutput:
        return self.launch_compute(engine.forward([t.ids for t in toks], self.layers, self.logprobs), toks)

    def compute(self, out: ForwardOutput, toks: list[Tokenized]) -> TaskOutput:
        return self.launch_compute(out, toks).result()

    def launch_compute(self, out: ForwardOutput, toks: list[Tokenized]) -> PendingOutput:
        """The task's columns from an engine output, queued on its device, their copies to the host started."""
        raise NotImplementedError
