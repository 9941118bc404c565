"""transformers' T5EncoderModel used the way ProtT5's and Ankh's model cards use it (token ids and an
attention mask of a right-padded batch, hidden states of every layer), in the engines' forward contract,
in float32 and in float64 throughout (tests/float64_reference.py).

The hf engine cannot be the reference here: it builds AutoModel, the whole encoder-decoder, which wants
decoder inputs (issue 25); that is mended elsewhere.
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from pipeline.engine.interface import ForwardOutput
from tests.float64_reference import float64_everywhere


class T5EncoderReference:
    def __init__(self, path: str, dtype: torch.dtype):
        from transformers import T5EncoderModel
        self.exact = dtype == torch.float64
        with self._precision():
            self.model = T5EncoderModel.from_pretrained(path, dtype=dtype).eval()
        self.pad_id = self.model.config.pad_token_id

    def _precision(self):
        return float64_everywhere() if self.exact else contextlib.nullcontext()

    @torch.inference_mode()
    def forward(self, batch: Sequence[Sequence[int]], layers: Sequence[int], logprobs: bool = False) -> ForwardOutput:
        assert not logprobs, "an encoder has no next-token log-probabilities"
        lengths = torch.tensor([len(ids) for ids in batch])
        ids = torch.full((len(batch), int(lengths.max())), self.pad_id, dtype=torch.int64)
        for i, seq in enumerate(batch):
            ids[i, :len(seq)] = torch.tensor(seq)
        mask = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        with self._precision():
            out = self.model(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True)
        cu = torch.zeros(len(batch) + 1, dtype=torch.int64)
        cu[1:] = lengths.cumsum(0)
        return ForwardOutput(cu_seqlens=cu, hidden={k: out.hidden_states[k][mask] for k in layers}, token_logprobs=None)
