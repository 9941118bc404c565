"""The score task: per sequence, the sum over non-special tokens with at least one token before them of
log p(token | all tokens before it, special ones included), accumulated in float64 (DESIGN.md);
`num_scored` counts those tokens."""
from __future__ import annotations

import torch

from ..config import RunConfig
from ..engine.interface import ForwardOutput
from ..models.checkpoint import EngineInfo
from ..errors import UserError
from ..output.schema import Column
from .task import WINDOWS_COLUMN, ForwardTask, Segments, TaskOutput
from .tokenization import Tokenized


class ScoreTask(ForwardTask):
    name = "score"

    def __init__(self, config: RunConfig, info: EngineInfo):
        if not info.is_causal:
            raise UserError(f"--task score needs a causal language model; {info.architecture or 'this model'} "
                            "is not one (an encoder such as ESM-2 has no next-token probabilities). "
                            "Use --task embed, or pass a causal LM with --model.")
        self.info = info
        self.layers: list[int] = []
        self.windowed = config.on_long == "window"

    logprobs = True

    def columns(self) -> list[Column]:
        return [Column("score/logprob_sum", "float64"), Column("score/num_scored", "int32")] + (
            [WINDOWS_COLUMN] if self.windowed else [])

    def compute(self, out: ForwardOutput, toks: list[Tokenized]) -> TaskOutput:
        device = out.cu_seqlens.device
        s = Segments.of(out, toks)
        special, seg = s.special, s.seg
        position = torch.arange(len(seg), device=device) - out.cu_seqlens[:-1][seg]
        scored = (~special) & (position >= 1)
        lp = torch.where(scored, out.token_logprobs.double(), torch.zeros((), dtype=torch.float64, device=device))
        total = torch.zeros(len(toks), dtype=torch.float64, device=device).index_add_(0, seg, lp)
        n = torch.zeros(len(toks), dtype=torch.int64, device=device).index_add_(0, seg, scored.long())
        return TaskOutput({"score/logprob_sum": total.cpu().numpy(), "score/num_scored": n.int().cpu().numpy()},
                          {}, {})
