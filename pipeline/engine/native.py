"""The native engine as the pipeline sees it (pipeline.engine.interface.Engine), plus `generate`.

`forward` runs a batch to completion step by step (chunked prefill where a sequence exceeds the step
budget) and returns the ragged hidden states and token log-probabilities in batch order. `generate`
runs prompts with continuous batching: every step mixes the decode tokens of running sequences with
prefill chunks of new ones, and a sequence that stops frees its pages for the next one at once.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence as Seq

import numpy as np
import torch

from ..models.checkpoint import EngineInfo
from ..models.transfers import to_device
from .interface import ForwardOutput, OutOfMemory, Stopped, logits_rows, target_logprobs
from .block_manager import BlockManager
from .config import INVARIANT_SPLIT, EngineConfig
from .model_runner import ModelRunner
from .sampler import Sampler, uniforms
from .scheduler import ScheduledSeq, Scheduler
from .sequence import Sequence
from .state_slots import StateSlots

log = logging.getLogger(__name__)

STATS_SECONDS = 60.0


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Generation:
    token_ids: list[int]      # new tokens only (an EOS that stopped generation included)
    finish_reason: str        # "stop" (EOS) or "length" (max_new_tokens)


class StepStats:
    """Packing of the steps run so far: tokens computed (ragged steps pad nothing, so every one is a real
    token) and how full each step was against the token budget."""

    def __init__(self, budget: int):
        self.budget = budget
        self.steps = self.tokens = self.sequences = 0
        self.last_log = time.monotonic()

    def add(self, step: list[ScheduledSeq]) -> None:
        n = sum(s.num_tokens for s in step)
        self.steps += 1
        self.tokens += n
        self.sequences += len(step)

    def line(self) -> str:
        steps = max(self.steps, 1)
        return (f"native engine: {self.steps} steps, {self.tokens} tokens (ragged, no padding), step fill "
                f"{self.tokens / (steps * self.budget):.1%} of {self.budget} tokens, "
                f"{self.sequences / steps:.1f} sequences per step")

    def maybe_log(self) -> None:
        if time.monotonic() - self.last_log >= STATS_SECONDS:
            self.last_log = time.monotonic()
            log.info("%s", self.line())


def _budgets(run_config, longest_prompt: int | None, spec, text_config) -> dict:
    """EngineConfig fields from the run's options: the step budgets, and the longest prompt to hold (the
    run's longest, else its token limit: the model's own or --max-length's, else the model's position table,
    else one step)."""
    budget = run_config.tokens_per_batch if run_config is not None else 4096
    limit = longest_prompt or spec.max_tokens or getattr(text_config, "max_position_embeddings", None) or budget
    generate = run_config is not None and run_config.task == "generate"
    # CPU workers of a local run share one machine's RAM (a cluster's tasks each have their own node)
    neighbours = run_config is not None and not run_config.on_gpu and run_config.launcher == "local"
    return dict(max_tokens_per_step=budget, max_seqs=run_config.max_seqs if run_config is not None else 256,
                max_model_len=int(limit), max_new_tokens=run_config.max_new_tokens if generate else 0,
                batch_invariant=run_config.batch_invariant if run_config is not None else True,
                memory_shared_by=run_config.workers if neighbours else 1)


class NativeEngine:
    def __init__(self, model, tokenizer, info: EngineInfo, config: EngineConfig, device: torch.device,
                 dtype: torch.dtype):
        self.model, self.tokenizer, self.info, self.device, self.dtype = model, tokenizer, info, device, dtype
        self.spec = model.spec
        self.config = config.resolve(self.spec, device, dtype)
        self.runner = ModelRunner(model, self.config, device, dtype)
        self.stats = StepStats(self.config.max_tokens_per_step)

    @classmethod
    def load(cls, model_path: str, device: torch.device, dtype: torch.dtype, fingerprint: str = "", run_config=None,
             info: EngineInfo | None = None, longest_prompt: int | None = None, **overrides) -> "NativeEngine":
        """The engine for a checkpoint directory, its budgets from the run's options (RunConfig). `info`: the
        run's EngineInfo (None: described here); `longest_prompt`: the most tokens a prompt of the run has, which
        the KV cache must hold (None: the model's limit, from `info`). With the checkpoint's `fingerprint`, a
        model this process loaded ahead of its shard for the same checkpoint, device and dtype is used
        (models/preload.py)."""
        from dataclasses import replace

        from ..models import checkpoint, preload
        from ..models.hf_config import quiet_transformers, text_config
        from ..models.registry import load_model

        from .gpu_support import check_native_device
        check_native_device(device)
        quiet_transformers()
        source = checkpoint.local_source(model_path, fingerprint)
        ahead = preload.take(preload.Wanted.of("native", model_path, fingerprint, device, dtype)) if fingerprint else None
        model = ahead if ahead is not None else load_model(model_path, device, dtype, source.family)
        config = checkpoint.read_config(source)
        tokenizer = checkpoint.read_tokenizer(source, config)
        info = replace(info or checkpoint.describe(source, "native", tokenizer, config=config), name="native")
        spec = model.spec
        if (info.hidden_size, info.num_layers, info.is_causal) != (spec.hidden_size, spec.num_layers, spec.is_causal):
            raise RuntimeError(f"the native model ({spec}) does not match the checkpoint's description ({info})")
        longest = longest_prompt if longest_prompt is not None else info.max_tokens
        config = EngineConfig(**dict(_budgets(run_config, longest, spec, text_config(config)), **overrides))
        return cls(model, tokenizer, info, config, device, dtype)

    def stats_line(self) -> str:
        return self.stats.line()

    def _scheduler(self) -> Scheduler:
        c = self.config
        blocks = BlockManager(c.num_pages, c.page_size)
        slots = StateSlots(c.num_state_slots) if self.spec.delta is not None else None
        return Scheduler(c.max_tokens_per_step, c.max_seqs, self.spec.is_causal, blocks, slots,
                         split_unit=INVARIANT_SPLIT if c.batch_invariant else 1)

    def _check_fits(self, seqs: list[Sequence]) -> None:
        capacity = self.config.num_pages * self.config.page_size
        for seq in seqs:
            if seq.reserve_tokens > capacity:
                from ..errors import UserError
                raise UserError(f"a sequence of {seq.num_prompt} tokens (+{max(0, seq.max_new_tokens - 1)} to "
                                f"generate) exceeds the engine's KV cache of {capacity} tokens; set --max-length")

    def _run(self, seqs: list[Sequence], capture: frozenset[int], on_step, select=None,
             alive: Callable[[int], bool] | None = None) -> None:
        """Run `seqs` to completion, one engine step at a time.

        Once a step has run, its tokens count as computed (a finished encoder-style sequence gives its
        pages back) and on_step(scheduler, step, ctx, final hidden, captured layers) reads the outputs,
        appending or finishing generated tokens. Running out of device memory anywhere in a step releases
        every sequence and raises OutOfMemory. With `select(step)` (rows of the step, grouped by sequence: a
        host array) the final hidden on_step gets holds those rows only. With `alive(tokens)` (the tokens its
        steps have computed so far), asked before each step: False releases every sequence and raises Stopped.

        Nothing here reads the device back (tests/test_sync_audit.py): a step's host arrays go over in pinned
        copies, so the host runs ahead and queues the next step, or the next batch, while this one computes.
        """
        self._check_fits(seqs)
        scheduler = self._scheduler()
        for seq in seqs:
            scheduler.add(seq)
        try:
            first = self.stats.tokens
            while scheduler.has_work():
                if alive is not None and not alive(self.stats.tokens - first):
                    scheduler.abort_all()
                    raise Stopped(f"given up after {self.stats.tokens - first} tokens")
                step = scheduler.schedule()
                ctx = self.runner.prepare(step, scheduler.blocks)
                rows = select(step) if select is not None else None
                if rows is not None and not len(rows) and not self.spec.is_causal:
                    out, captured = None, {}   # an encoder step none of whose outputs is read: nothing to run
                else:
                    out, captured = self.runner.run(ctx, capture, rows)
                scheduler.after_step(step)
                self.stats.add(step)
                on_step(scheduler, step, ctx, out, captured)
        except torch.OutOfMemoryError as e:
            scheduler.abort_all()
            raise OutOfMemory(str(e)) from e
        self.stats.maybe_log()

    # ---- embed / score ----------------------------------------------------------------------------

    def forward(self, batch: Seq[Seq[int]], layers: Seq[int], logprobs: bool) -> ForwardOutput:
        seqs = [Sequence(i, list(ids)) for i, ids in enumerate(batch)]
        lengths = np.array([len(s) for s in seqs], np.int64)
        offsets = np.zeros(len(seqs) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        total, final = int(offsets[-1]), self.spec.num_layers
        hidden = {k: torch.empty(total, self.spec.hidden_size, dtype=self.dtype, device=self.device) for k in layers}
        token_logprobs = torch.zeros(total, dtype=torch.float64, device=self.device) if logprobs else None
        capture = frozenset(k for k in layers if k != final)

        def on_step(scheduler, step, ctx, out, captured):
            rows = ctx.on_device("output_offsets", offsets[[s.seq.seq_id for s in step]])
            rows = rows[ctx.segment_ids()] + ctx.positions
            with torch.inference_mode():
                for k in layers:
                    hidden[k].index_copy_(0, rows, out if k == final else captured[k])
                if logprobs:
                    self._step_logprobs(step, ctx, out, rows, token_logprobs)

        self._run(seqs, capture, on_step)
        return ForwardOutput(cu_seqlens=to_device([offsets], self.device)[0], hidden=hidden,
                             token_logprobs=token_logprobs)

    def logprobs_at(self, batch: Seq[Seq[int]], positions: Seq[Seq[int]]) -> torch.Tensor:
        """The head's log-softmax at chosen positions (interface.Engine.logprobs_at): each step's rows at the
        chosen positions go through the head; no other row does."""
        seqs = [Sequence(i, list(ids)) for i, ids in enumerate(batch)]
        wanted = [np.asarray(p, np.int64) for p in positions]
        first = np.zeros(len(seqs) + 1, np.int64)
        np.cumsum([len(p) for p in wanted], out=first[1:])
        out = torch.empty(int(first[-1]), self.spec.vocab_size, dtype=torch.float64, device=self.device)

        chosen = {}

        def select(step):   # host arrays: the runner and on_step send them to the device
            rows, chosen["dest"] = _chosen_rows(step, wanted, first)
            return rows

        def on_step(scheduler, step, ctx, hidden, captured):   # hidden: the chosen rows' final states only
            if hidden is None or not len(hidden):
                return
            dest, chunk = ctx.on_device("logprobs_dest", chosen["dest"]), logits_rows(self.spec.vocab_size)
            with torch.inference_mode():
                for a in range(0, len(dest), chunk):
                    logits = self.model.logits(hidden[a:a + chunk])
                    out[dest[a:a + chunk]] = torch.log_softmax(logits.double(), dim=-1)

        self._run(seqs, frozenset(), on_step, select)
        return out

    def _step_logprobs(self, step: list[ScheduledSeq], ctx, out: torch.Tensor, rows: torch.Tensor,
                       token_logprobs: torch.Tensor) -> None:
        """log p(next token) for every step token that has a next token in its sequence."""
        nxt = np.concatenate([np.asarray(s.seq.token_ids[s.start + 1:s.end + 1] + [-1] * (s.end == len(s.seq)),
                                         np.int64) for s in step])
        has_next = np.flatnonzero(nxt >= 0)
        if not len(has_next):
            return
        sel, targets = to_device([has_next, nxt[has_next]], self.device)
        dest = rows[sel] + 1
        step_rows = logits_rows(self.spec.vocab_size, copies=2)   # float64 copies: half the rows
        for a in range(0, len(has_next), step_rows):
            token_logprobs[dest[a:a + step_rows]] = target_logprobs(self.model.logits(out[sel[a:a + step_rows]]),
                                                                    targets[a:a + step_rows])

    # ---- generate ---------------------------------------------------------------------------------

    def generate(self, prompts: Seq[Seq[int]], keys: Seq[int], params: SamplingParams,
                 alive: Callable[[int], bool] | None = None) -> list[Generation]:
        """New tokens for each prompt; `keys` (the FASTA positions) select each sequence's random stream.
        `alive(tokens)`, asked before each step with the tokens computed so far: False gives the call up there
        (Stopped, no result): its steps have no bound (a call of thousands of new tokens per sequence runs for
        minutes), so its caller hears of it and may stop it between them."""
        if not 0 < params.max_new_tokens <= self.config.max_new_tokens:
            raise ValueError(f"this engine was sized for 1..{self.config.max_new_tokens} new tokens per sequence, "
                             f"asked for {params.max_new_tokens}")
        seqs = [Sequence(i, list(p), params.max_new_tokens, int(k)) for i, (p, k) in enumerate(zip(prompts, keys))]
        eos = set(self.spec.eos_token_ids)
        sampler = Sampler(params.temperature, params.top_p)

        def on_step(scheduler, step, ctx, out, captured):
            ready = [i for i, s in enumerate(step) if s.completes_known_tokens]
            if not ready:
                return
            last = ctx.on_device("last_rows", np.cumsum(ctx.q_lens)[ready] - 1)
            with torch.inference_mode():
                logits = self.model.logits(out[last]).float()
                if params.temperature > 0 and logits.shape[1] > len(self.tokenizer):
                    # Rows past the tokenizer's vocabulary (padded embedding matrices) are not tokens:
                    # never sample them. Greedy keeps them, to stay exactly transformers' greedy search.
                    logits[:, len(self.tokenizer):] = float("-inf")
            ready_seqs = [step[i].seq for i in ready]
            u = uniforms(params.seed, np.array([s.key for s in ready_seqs], np.uint64),
                         np.array([s.num_generated for s in ready_seqs], np.uint64))
            tokens = sampler(logits, u)   # the step's one wait for the device
            for seq, token in zip(ready_seqs, tokens):
                seq.append(token)
                if token in eos:
                    scheduler.finish(seq, "stop")
                elif seq.num_generated >= seq.max_new_tokens:
                    scheduler.finish(seq, "length")

        self._run(seqs, frozenset(), on_step, alive=alive)
        return [Generation(s.generated, s.finish_reason) for s in seqs]


def _chosen_rows(step: list[ScheduledSeq], wanted: list[np.ndarray], first: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows of the step's output, rows of logprobs_at's result) of the chosen positions this step computed."""
    rows, dest, offset = [], [], 0
    for s in step:
        p = wanted[s.seq.seq_id]
        here = np.flatnonzero((p >= s.start) & (p < s.end))
        if len(here):
            rows.append(offset + p[here] - s.start)
            dest.append(first[s.seq.seq_id] + here)
        offset += s.num_tokens
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(rows), np.concatenate(dest)
