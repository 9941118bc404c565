"""The embed task: pooled embeddings (`mean`, `cls`, `last`) of chosen hidden states, and optionally every
residue's vector. `mean` is over the sequence's non-special tokens, in float32 (DESIGN.md); `cls` is the
first token's state, `last` the last token's (a trailing special token such as <eos> included)."""
from __future__ import annotations

import numpy as np
import torch

from ..config import RunConfig
from ..engine.interface import ForwardOutput, resolve_layers
from ..models.checkpoint import EngineInfo
from ..models.transfers import HostCopy, to_device
from ..output.schema import Column
from .task import WINDOWS_COLUMN, ForwardTask, PendingOutput, Segments, TaskOutput, layer_suffix
from .tokenization import Tokenized


class EmbedTask(ForwardTask):
    name = "embed"

    def __init__(self, config: RunConfig, info: EngineInfo):
        self.info = info
        self.pools = list(config.pools)
        self.layers = resolve_layers(config.layers, info.num_layers)
        self.per_residue = config.per_residue
        self.per_residue_dtype = config.per_residue_dtype
        self.windowed = config.on_long == "window"

    logprobs = False

    def columns(self) -> list[Column]:
        d, cols = self.info.hidden_size, []
        for layer in self.layers:
            sfx = layer_suffix(layer, self.info.num_layers)
            cols += [Column(f"embeddings/{pool}{sfx}", "float32", d) for pool in self.pools]
            if self.per_residue:
                cols.append(Column(f"per_residue/values{sfx}", self.per_residue_dtype, d, ragged=True))
        return cols + ([WINDOWS_COLUMN] if self.windowed else [])

    def launch_compute(self, out: ForwardOutput, toks: list[Tokenized]) -> PendingOutput:
        device = out.cu_seqlens.device
        s = Segments.of(out, toks)
        special, seg = s.special, s.seg
        keep = (~special).to(torch.float32)
        count = torch.zeros(len(toks), device=device).index_add_(0, seg, keep)
        content = None   # rows of the non-special tokens (per-residue values), known on the host
        if self.per_residue:
            content = to_device([np.flatnonzero(~np.concatenate([t.special for t in toks]))], device)[0]
        results = {}
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
                results[f"embeddings/{pool}{sfx}"] = pooled
            if self.per_residue:
                dtype = torch.float16 if self.per_residue_dtype == "float16" else torch.float32
                results[f"per_residue/values{sfx}"] = h.index_select(0, content).to(dtype)
        lengths = {"per_residue": np.array([int((~t.special).sum()) for t in toks], np.int64)} if self.per_residue else {}

        def build(host: dict[str, np.ndarray]) -> TaskOutput:
            columns = {k: v for k, v in host.items() if k.startswith("embeddings/")}
            values = {k: v for k, v in host.items() if k.startswith("per_residue/")}
            return TaskOutput(columns, values, lengths)

        return PendingOutput(HostCopy(results), build)
