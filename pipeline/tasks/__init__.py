"""Tasks turn an engine's ragged output into output columns, with the definitions DESIGN.md fixes.

- embed, `mean`: mean over the sequence's non-special tokens of the chosen hidden state (the final one is
  the final norm's output), in float32. `cls`: the first token's state. `last`: the last token's state
  (a trailing special token such as <eos> included, when the tokenizer adds one).
- score: sum over non-special tokens with at least one token before them of log p(token | all tokens
  before it, special ones included), accumulated in float64; `num_scored` counts those tokens.
"""
from __future__ import annotations

from ..config import RunConfig
from ..engine.interface import EngineInfo
from ..errors import UserError
from ..output.schema import BASE_COLUMNS, Schema
from .embed import EmbedTask
from .generate import GenerateTask
from .score import ScoreTask


def make_task(config: RunConfig, info: EngineInfo):
    if config.task == "embed":
        return EmbedTask(config, info)
    if config.task == "score":
        return ScoreTask(config, info)
    if config.task == "generate":
        return GenerateTask(config, info)
    raise UserError(f"unknown task {config.task!r}")


def schema_for(task) -> Schema:
    return Schema(tuple(BASE_COLUMNS) + tuple(task.columns()))
