"""Tasks turn an engine's ragged output into output columns, with the definitions DESIGN.md fixes.

- embed, `mean`: mean over the sequence's non-special tokens of the chosen hidden state (the final one is
  the final norm's output), in float32. `cls`: the first token's state. `last`: the last token's state
  (a trailing special token such as <eos> included, when the tokenizer adds one).
- score: sum over non-special tokens with at least one token before them of log p(token | all tokens
  before it, special ones included), accumulated in float64; `num_scored` counts those tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..config import RunConfig
from ..engine.interface import EngineInfo, ForwardOutput, resolve_layers
from ..errors import UserError
from ..output.schema import Column, Schema, BASE_COLUMNS
from .tokenization import Tokenized


# --on-long window: how many windows each row ran as (1 for a sequence within the limit; 0 for a row
# that was not computed).
WINDOWS_COLUMN = Column("windows", "int32")


def layer_suffix(layer: int, num_layers: int) -> str:
    return "" if layer == num_layers else f"_layer{layer}"


@dataclass
class TaskOutput:
    columns: dict[str, np.ndarray]          # per-row arrays for the computed sequences
    values: dict[str, np.ndarray]           # ragged values
    lengths: dict[str, np.ndarray]          # per-row lengths of each ragged group


class EmbedTask:
    name = "embed"

    def __init__(self, config: RunConfig, info: EngineInfo):
        self.info = info
        self.pools = list(config.pools)
        self.layers = resolve_layers(config.layers, info.num_layers)
        self.per_residue = config.per_residue
        self.per_residue_dtype = config.per_residue_dtype
        self.windowed = config.on_long == "window"

    @property
    def logprobs(self) -> bool:
        return False

    def run(self, engine, toks: list[Tokenized], positions: np.ndarray) -> TaskOutput:
        return self.compute(engine.forward([t.ids for t in toks], self.layers, self.logprobs), toks)

    def columns(self) -> list[Column]:
        d, cols = self.info.hidden_size, []
        for layer in self.layers:
            sfx = layer_suffix(layer, self.info.num_layers)
            cols += [Column(f"embeddings/{pool}{sfx}", "float32", d) for pool in self.pools]
            if self.per_residue:
                cols.append(Column(f"per_residue/values{sfx}", self.per_residue_dtype, d, ragged=True))
        return cols + ([WINDOWS_COLUMN] if self.windowed else [])

    def compute(self, out: ForwardOutput, toks: list[Tokenized]) -> TaskOutput:
        device = out.cu_seqlens.device
        special = torch.from_numpy(np.concatenate([t.special for t in toks])).to(device)
        lengths = out.cu_seqlens[1:] - out.cu_seqlens[:-1]
        seg = torch.repeat_interleave(torch.arange(len(toks), device=device), lengths)
        keep = (~special).to(torch.float32)
        count = torch.zeros(len(toks), device=device).index_add_(0, seg, keep)
        columns, values, ragged_lengths = {}, {}, {}
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
                columns[f"embeddings/{pool}{sfx}"] = pooled.cpu().numpy()
            if self.per_residue:
                dtype = torch.float16 if self.per_residue_dtype == "float16" else torch.float32
                values[f"per_residue/values{sfx}"] = h[~special].to(dtype).cpu().numpy()
        if self.per_residue:
            ragged_lengths["per_residue"] = count.round().to(torch.int64).cpu().numpy()
        return TaskOutput(columns, values, ragged_lengths)


class ScoreTask:
    name = "score"

    def __init__(self, config: RunConfig, info: EngineInfo):
        if not info.is_causal:
            raise UserError(f"--task score needs a causal language model; {info.architecture or 'this model'} "
                            "is not one (an encoder such as ESM-2 has no next-token probabilities). "
                            "Use --task embed, or pass a causal LM with --model.")
        self.info = info
        self.layers: list[int] = []
        self.windowed = config.on_long == "window"

    @property
    def logprobs(self) -> bool:
        return True

    def run(self, engine, toks: list[Tokenized], positions: np.ndarray) -> TaskOutput:
        return self.compute(engine.forward([t.ids for t in toks], self.layers, self.logprobs), toks)

    def columns(self) -> list[Column]:
        return [Column("score/logprob_sum", "float64"), Column("score/num_scored", "int32")] + (
            [WINDOWS_COLUMN] if self.windowed else [])

    def compute(self, out: ForwardOutput, toks: list[Tokenized]) -> TaskOutput:
        device = out.cu_seqlens.device
        special = torch.from_numpy(np.concatenate([t.special for t in toks])).to(device)
        lengths = out.cu_seqlens[1:] - out.cu_seqlens[:-1]
        seg = torch.repeat_interleave(torch.arange(len(toks), device=device), lengths)
        position = torch.arange(len(seg), device=device) - out.cu_seqlens[:-1][seg]
        scored = (~special) & (position >= 1)
        lp = torch.where(scored, out.token_logprobs.double(), torch.zeros((), dtype=torch.float64, device=device))
        total = torch.zeros(len(toks), dtype=torch.float64, device=device).index_add_(0, seg, lp)
        n = torch.zeros(len(toks), dtype=torch.int64, device=device).index_add_(0, seg, scored.long())
        return TaskOutput({"score/logprob_sum": total.cpu().numpy(), "score/num_scored": n.int().cpu().numpy()},
                          {}, {})


def make_task(config: RunConfig, info: EngineInfo):
    if config.task == "embed":
        return EmbedTask(config, info)
    if config.task == "score":
        return ScoreTask(config, info)
    if config.task == "generate":
        from .generate import GenerateTask
        return GenerateTask(config, info)
    raise UserError(f"unknown task {config.task!r}")


def schema_for(task) -> Schema:
    return Schema(tuple(BASE_COLUMNS) + tuple(task.columns()))
