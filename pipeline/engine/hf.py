"""The `hf` engine: transformers models on padded, length-sorted batches.

It runs any architecture transformers knows and is the baseline every speed claim is measured against.
Batches are right-padded (real tokens of a causal model never see the padding) and the outputs are
unpadded into the ragged form the tasks expect. For scoring with a masked LM it builds the checkpoint's
*ForMaskedLM model, whose logits `logprobs_at` reads at the chosen positions (transformers computes them at
every position: the straightforward recipe the native engine is measured against).
"""
from __future__ import annotations

import importlib.util
import logging
import sys
from dataclasses import replace
from typing import Sequence

import torch

from ..models.checkpoint import EngineInfo
from .interface import ForwardOutput, OutOfMemory, logits_rows, target_logprobs
from ..errors import UserError

log = logging.getLogger("run_shards.worker")


def keep_transformers_torch_kernels() -> None:
    """For an hf engine on the CPU: make fla-core unimportable in this process before transformers imports a
    model's module. transformers 5 replaces Qwen3.5's gated delta rule with fla-core's Triton kernels whenever
    fla imports, at that import and whatever the device, and on CPU tensors they fail ("Pointer argument (at 0)
    cannot be accessed from Triton (cpu tensor?)", seen with fla-core 0.6.0 and transformers 5.24); hidden, fla
    is "not installed" and transformers keeps its torch path. sys.modules[name] = None is Python's documented
    way to make `import name` raise ImportError."""
    module = sys.modules.get("fla", "absent")
    if module is None:
        return
    if module != "absent":
        log.warning("fla-core was imported before the hf engine was built on the CPU: a Qwen3.5-style model may "
                    "send its delta rule to fla's GPU kernels and fail; run it with --engine native")
        return
    if importlib.util.find_spec("fla") is not None:
        sys.modules["fla"] = None
        log.info("fla-core is installed, but its kernels need a GPU: hidden from transformers in this CPU process")



class HFEngine:
    def __init__(self, model_path: str, device: torch.device, dtype: torch.dtype, logprobs: bool,
                 fingerprint: str = "", info: EngineInfo | None = None, trust_remote_code: bool = False,
                 tokens_per_batch: int = 4096):
        from ..models import checkpoint
        from ..models.hf_config import quiet_transformers, text_config as text_of
        quiet_transformers()
        if device.type == "cpu":
            keep_transformers_torch_kernels()
        self.device = device
        source = checkpoint.local_source(model_path, fingerprint)
        config = checkpoint.read_config(source, trust_remote_code)
        self.tokenizer = checkpoint.read_tokenizer(source, config, trust_remote_code)
        self.info = replace(info or checkpoint.describe(source, "hf", self.tokenizer, trust_remote_code, config),
                            name="hf")
        text_config = text_of(config)
        if trust_remote_code and source.facts.remote_code:
            log.warning("running the checkpoint's own Python code (--trust-remote-code): %s",
                        "; ".join(source.facts.remote_code))
        self.lm, self.head, self.base = None, None, None
        self.tokens_per_batch = tokens_per_batch   # padded tokens per batch of logprobs_at
        if logprobs and self.info.is_causal:
            for attr in ("final_logit_softcapping", "logit_scale"):
                if getattr(text_config, attr, None):  # the head alone would not give the model's logits
                    raise UserError(f"--task score is not supported for models with {attr} (their logits are "
                                    "not the head's output alone); embed works")
            self.lm = self._build("AutoModelForCausalLM", model_path, config, dtype, {}, trust_remote_code)
            self.base = self.lm.base_model
            self.head = self.lm.get_output_embeddings()
        elif logprobs and self.info.masked_lm:
            self.lm = self._build("AutoModelForMaskedLM", model_path, config, dtype, {}, trust_remote_code)
            self.base, self.head = self.lm.base_model, None
        else:
            family = source.family
            self.base = self._build(family.hf_class, model_path, config, dtype, family.hf_kwargs, trust_remote_code)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.real_tokens = self.computed_tokens = 0   # packing efficiency = real / computed (padded) tokens

    def adopt(self, info: EngineInfo | None, tokens_per_batch: int | None = None) -> bool:
        """For an engine loaded before its run was planned to the end, or kept from this process's shard before
        (models/preload.py): take the run's description and budget; False (nothing changed) where the run's
        description is not the one this engine found itself, which chose its model class."""
        if info is not None and replace(info, name="hf") != self.info:
            return False
        if tokens_per_batch is not None:
            self.tokens_per_batch = tokens_per_batch
        self.real_tokens = self.computed_tokens = 0   # (one kept from a shard before counts this shard's alone)
        return True

    def _build(self, class_name: str, path: str, config, dtype, kwargs: dict, trust_remote_code: bool):
        """transformers' `class_name` (AutoModel, T5EncoderModel, ...) from the checkpoint, on the device."""
        import transformers
        cls = getattr(transformers, class_name)
        extra = {"trust_remote_code": True} if trust_remote_code and class_name.startswith("Auto") else {}
        model = cls.from_pretrained(path, config=config, dtype=dtype, **kwargs, **extra)
        return model.to(self.device).eval()

    def _padded(self, batch: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, attention mask) `[B, width]` on the device, right-padded, and the lengths (on the CPU);
        counted in the engine's real and computed (padded) tokens."""
        lengths = torch.tensor([len(x) for x in batch], dtype=torch.int64)
        width = int(lengths.max())
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.int64)
        for i, seq in enumerate(batch):
            ids[i, :len(seq)] = torch.as_tensor(seq, dtype=torch.int64)
        mask = (torch.arange(width)[None, :] < lengths[:, None]).to(torch.int64)
        self.real_tokens += int(lengths.sum())
        self.computed_tokens += ids.numel()
        return ids.to(self.device), mask.to(self.device), lengths

    @torch.inference_mode()
    def forward(self, batch: Sequence[Sequence[int]], layers: Sequence[int], logprobs: bool) -> ForwardOutput:
        ids, mask, lengths = self._padded(batch)
        final = self.info.num_layers
        need_all = any(k != final for k in layers)
        try:
            real = mask.bool()
            if logprobs and self.head is None:   # no output embeddings to apply in chunks: the model's logits
                return self._from_logits(ids, mask, lengths, real)
            out = self.base(input_ids=ids, attention_mask=mask, output_hidden_states=need_all)
            hidden = {k: (out.last_hidden_state if k == final else out.hidden_states[k])[real] for k in layers}
            token_logprobs = self._token_logprobs(out.last_hidden_state, ids)[real] if logprobs else None
        except torch.OutOfMemoryError as e:
            raise OutOfMemory(str(e)) from e
        cu = torch.zeros(len(batch) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=cu[1:])
        return ForwardOutput(cu_seqlens=cu.to(self.device), hidden=hidden, token_logprobs=token_logprobs)

    @torch.inference_mode()
    def logprobs_at(self, batch: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]) -> torch.Tensor:
        """The head's log-softmax at chosen positions (interface.Engine.logprobs_at), from the whole model's
        logits on padded, length-sorted batches of at most tokens_per_batch padded tokens."""
        assert self.lm is not None, "logprobs_at needs the engine built with logprobs=True"
        first = [0]
        for p in positions:
            first.append(first[-1] + len(p))
        out = None
        order = sorted(range(len(batch)), key=lambda i: -len(batch[i]))
        start = 0
        while start < len(order):
            k = max(1, self.tokens_per_batch // len(batch[order[start]]))
            chunk = order[start:start + k]
            start += k
            logits = self._logits([batch[i] for i in chunk])
            rows = torch.tensor([r for r, i in enumerate(chunk) for _ in positions[i]], device=logits.device)
            cols = torch.tensor([p for i in chunk for p in positions[i]], dtype=torch.int64, device=logits.device)
            dest = torch.tensor([first[i] + j for i in chunk for j in range(len(positions[i]))], device=logits.device)
            lp = torch.log_softmax(logits[rows, cols].double(), dim=-1)
            if out is None:
                out = torch.empty(first[-1], lp.shape[1], dtype=torch.float64, device=lp.device)
            out[dest] = lp
        return out if out is not None else torch.empty(0, 0, dtype=torch.float64)

    def _logits(self, batch: Sequence[Sequence[int]]) -> torch.Tensor:
        """The model's logits `[B, T, V]` for one padded batch (every position, as transformers computes them)."""
        ids, mask, _ = self._padded(batch)
        try:
            return self.lm(input_ids=ids, attention_mask=mask).logits
        except torch.OutOfMemoryError as e:
            raise OutOfMemory(str(e)) from e

    def _from_logits(self, ids: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, real: torch.Tensor):
        """Token log-probabilities from the whole model's logits, for a causal LM whose head transformers
        cannot hand out (get_output_embeddings is None: remote code with a head of its own name)."""
        logits = self.lm(input_ids=ids, attention_mask=mask).logits
        logp = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
        logp[:, 1:] = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=cu[1:])
        return ForwardOutput(cu_seqlens=cu.to(self.device), hidden={}, token_logprobs=logp[real])

    def stats_line(self) -> str:
        return (f"hf engine: {self.real_tokens} tokens, packing efficiency "
                f"{self.real_tokens / max(self.computed_tokens, 1):.1%} (real / computed tokens, padding included)")

    def _token_logprobs(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """log p(ids[:, t] | ids[:, :t]) for t >= 1 (0 at t = 0), the log-softmax in float64, the vocab in
        bounded chunks."""
        b, t = ids.shape
        out = torch.zeros(b, t, dtype=torch.float64, device=ids.device)
        if t < 2:
            return out
        vocab = self.head.weight.shape[0]
        h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        target = ids[:, 1:].reshape(-1)
        flat = torch.empty(len(target), dtype=torch.float64, device=ids.device)
        step = logits_rows(vocab, copies=2)
        for s in range(0, len(target), step):
            flat[s:s + step] = target_logprobs(self.head(h[s:s + step]), target[s:s + step])
        out[:, 1:] = flat.view(b, t - 1)
        return out
