"""Tasks turn an engine's ragged output into output columns, with the definitions DESIGN.md fixes.

- embed, `mean`: mean over the sequence's non-special tokens of the chosen hidden state (the final one is
  the final norm's output), in float32. `cls`: the first token's state. `last`: the last token's state
  (a trailing special token such as <eos> included, when the tokenizer adds one).
- score: sum over non-special tokens with at least one token before them of log p(token | all tokens
  before it, special ones included), accumulated in float64; `num_scored` counts those tokens.

embed.py, score.py and generate.py hold one task each; task.py what they share.
"""
from __future__ import annotations

from ..config import RunConfig
from ..errors import UserError
from ..models.checkpoint import EngineInfo
from ..output.schema import BASE_COLUMNS, Schema


def make_task(config: RunConfig, info: EngineInfo):
    """The task of a run. Its module is imported here, not at the top: they import torch, and the parent
    imports this package for the tokenizer and the schema."""
    if config.task == "embed":
        from .embed import EmbedTask
        return EmbedTask(config, info)
    if config.task == "score":
        from .score import ScoreTask
        return ScoreTask(config, info)
    if config.task == "generate":
        from .generate import GenerateTask
        return GenerateTask(config, info)
    raise UserError(f"unknown task {config.task!r}")


def schema_for(task) -> Schema:
    return Schema(tuple(BASE_COLUMNS) + tuple(task.columns()))
