"""Tasks turn an engine's ragged output into output columns, with the definitions DESIGN.md fixes.

- embed, `mean`: mean over the sequence's non-special tokens of the chosen hidden state (the final one is
  the final norm's output), in float32. `cls`: the first token's state. `last`: the last token's state
  (a trailing special token such as <eos> included, when the tokenizer adds one).
- score: sum over non-special tokens with at least one token before them of log p(token | all tokens
  before it, special ones included), accumulated in float64; `num_scored` counts those tokens. A masked LM's
  score is its pseudo-log-likelihood or wild-type marginal (masked_score.py). A residue fed as the unknown
  token is context, never scored.
- variants: each variant of the run's variants file scored against its record (variants.py).

embed.py, score.py, masked_score.py, variants.py and generate.py hold one task each; task.py what they share;
residue_tokens.py the tokens a masked-LM score reads.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..config import RunConfig
from ..errors import UserError
from ..models.checkpoint import EngineInfo
from ..output.schema import BASE_COLUMNS, Schema


def make_task(config: RunConfig, info: EngineInfo, run_root: Path | None = None,
              alive: Callable[[int], bool] | None = None):
    """The task of a run. Its module is imported here, not at the top: they import torch, and the parent
    imports this package for the tokenizer and the schema. `run_root`: the run directory, where a worker's
    variants task reads the run's variants (planning, which only needs the columns, passes none); `alive`: a
    worker's, which a generate task's engine asks between its steps whether to go on (tasks/generate.py)."""
    if config.task == "embed":
        from .embed import EmbedTask
        return EmbedTask(config, info)
    if config.task == "score":
        from .score import score_task
        return score_task(config, info)
    if config.task == "variants":
        from .variants import VariantsTask
        return VariantsTask(config, info, run_root)
    if config.task == "generate":
        from .generate import GenerateTask
        return GenerateTask(config, info, alive)
    raise UserError(f"unknown task {config.task!r}")


def schema_for(task) -> Schema:
    return Schema(tuple(BASE_COLUMNS) + tuple(task.columns()))
