"""Budgets of the native engine, derived from the run's options and validated before any work starts.

Everything that can be too small for the work is checked here, with a message naming the option to
change: a KV cache that cannot hold one maximum-length sequence, state slots for fewer sequences than
decode together, device memory that cannot hold the caches.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from ..errors import SettingsRefused, UserError, human_bytes
from ..host_memory import available_ram
from ..models.base import ModelSpec
from .mkl_cnr import strict_matmuls

log = logging.getLogger(__name__)

PAGE_SIZE = 16
# Batch-invariant runs cut a prefill that spans steps at multiples of this many tokens, and causal
# attention on CPU runs in blocks ending there (a multiple of every delta-rule chunk size: 16 on CPU, 64
# with the kernels). Budgets below it cannot keep the property.
INVARIANT_SPLIT = 64
# A refusal names no --max-length below this many tokens: a run of windows this short would not be the run asked
# for, and no real model's memory comes to that.
SHORTEST_NAMED_LENGTH = 64
# A refusal's settings fit this share of what the check allows: free memory moves between one command and the next
# (a suggestion sized to the last byte was refused at once when 0.2 GB of 22.7 went elsewhere meanwhile).
SUGGESTED_SHARE = 0.95


def batch_invariance_holds(budget: int, on_cpu: bool, dtype: torch.dtype) -> bool:
    """Whether a batch-invariant run keeps the property: on CPU (on a GPU cuBLAS picks a matmul's
    algorithm by its shape), in float32, with a step budget of at least INVARIANT_SPLIT tokens, where this
    process's matmuls give each row the same bits whatever the row and thread count (mkl_cnr.strict_matmuls:
    MKL in strict CNR mode, which asking here sets if nothing in this process computed yet, and products
    checked on this CPU). 16-bit products on CPU run through oneDNN, which has no such mode: a 1,280 -> 5,120
    bfloat16 product's rows change with the row count and the thread count (docs/engine.md).

    The engine (in each worker) and the result's attribute (pipeline/engine/selection.py, in the parent)
    both ask here. The parent's answer is the one a fresh worker of the same CPU, torch and environment
    gets; a worker whose own answer is no (MKL used before its strict mode could be set, another
    environment, another CPU) refuses to compute the run's rows (worker/cpu_setup.py)."""
    return invariant_paths_apply(budget, on_cpu, dtype) and strict_matmuls().holds


def invariant_paths_apply(budget: int, on_cpu: bool, dtype: torch.dtype) -> bool:
    """Whether the engine's batch-invariant paths (cuts on the INVARIANT_SPLIT grid, causal attention in
    blocks, position-independent element-wise functions, fixed delta-rule chunks) make sense: on CPU, in
    float32, with a budget of at least INVARIANT_SPLIT tokens. They run there even where MKL's products keep
    no such property (batch_invariance_holds says no and the run does not claim it): everything else then
    still gives a row the same bits, and the outputs are those such a CPU always gave."""
    return on_cpu and budget >= INVARIANT_SPLIT and dtype == torch.float32


def not_invariant_reason(budget: int, dtype: torch.dtype) -> str:
    """Why batch_invariance_holds said no on CPU, and what keeps the property, for the warning at start."""
    if budget < INVARIANT_SPLIT:
        return (f"a step budget of {budget} tokens is below {INVARIANT_SPLIT}; raise --max-tokens-per-batch to "
                "keep them so")
    if dtype != torch.float32:
        return (f"{str(dtype).removeprefix('torch.')} products on CPU run through oneDNN, whose row results "
                "depend on the row and thread count; --dtype float32 keeps them batch-invariant")
    return strict_matmuls().text


class CachesTooLarge(SettingsRefused):
    """The engine's caches do not fit the free memory. `change`: the settings (RunConfig fields and their
    values) that make them fit, the first of: the largest --max-tokens-per-batch (a multiple of INVARIANT_SPLIT
    below the run's), the largest --max-seqs below the run's, both (the smallest budget that keeps the run
    batch-invariant, INVARIANT_SPLIT, and the largest --max-seqs with it) (these continue the run), or,
    generating, the largest --max-new-tokens below the run's (another run), else the largest --max-length below
    the run's longest prompt (the longest sequence alone is too much; another run), with the smallest budget
    if need be, and then a --max-seqs of that budget, or half that, ... if need be; None where none does (a
    limit under SHORTEST_NAMED_LENGTH tokens would be needed, or the cache's size was given).
    `fitting_budget`: the budget where the change is that budget alone, else None."""

    def __init__(self, message: str, change: dict[str, int] | None):
        super().__init__(message)
        self.change = change

    @property
    def fitting_budget(self) -> int | None:
        return self.change["max_tokens_per_batch"] if self.change and list(self.change) == ["max_tokens_per_batch"] \
            else None


@dataclass(frozen=True)
class EngineConfig:
    max_tokens_per_step: int            # --max-tokens-per-batch: tokens run through the model per step
    max_seqs: int                       # --max-seqs: sequences per step
    max_model_len: int                  # longest prompt the engine must hold (tokens, specials included)
    max_new_tokens: int = 0             # generate: tokens generated per sequence (0: embed / score)
    page_size: int = PAGE_SIZE
    num_pages: int = 0                  # 0: derived from the budgets (see `resolve`)
    num_state_slots: int = 0            # 0: derived
    memory_fraction: float = 0.9        # of the free device memory the caches may take (GPU)
    memory_shared_by: int = 1           # processes of the run taking their caches from that memory (CPU workers
                                        # of one machine: each may take its part of it)
    gdn_chunk_size: int = 0             # 0: 64 with the Triton kernels; on CPU by head size
    attention_launch: dict | None = None    # explicit paged-attention knobs; None: the kernel's rule per step
    gdn_launch: dict = field(default_factory=dict)   # extra knobs for the delta-rule kernels, by function name
    kernels: str = "auto"               # auto: Triton on CUDA, the kernels' torch code on CPU; "triton":
                                        # Triton everywhere (CPU only under TRITON_INTERPRET=1: tests)
    batch_invariant: bool = True        # run the batch-invariant paths (invariant_paths_apply; see `resolve`)

    def triton_kernels(self, device: torch.device) -> bool:
        return self.kernels == "triton" or (self.kernels == "auto" and device.type == "cuda")

    def resolve(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> "EngineConfig":
        """Fill in derived sizes and check every budget; raises UserError with what to change."""
        if self.max_tokens_per_step < 1 or self.max_seqs < 1:
            raise UserError("--max-tokens-per-batch and --max-seqs must be at least 1")
        if self.kernels not in ("auto", "triton"):
            raise ValueError(f"EngineConfig.kernels must be 'auto' or 'triton', got {self.kernels!r}")
        if self.page_size < 16 or self.page_size & (self.page_size - 1):
            raise UserError(f"KV page size must be a power of two >= 16, got {self.page_size}")
        if self.max_new_tokens and not spec.is_causal:
            raise UserError(f"--task generate needs a causal language model; {spec.architecture} is an encoder")
        pages = self.num_pages or self._derived_pages(spec)
        longest = self.max_model_len + max(0, self.max_new_tokens - 1)
        if pages * self.page_size < longest:
            raise UserError(
                f"the KV cache holds {pages} pages x {self.page_size} tokens = {pages * self.page_size} tokens, "
                f"fewer than one maximum-length sequence needs ({longest} tokens: max length "
                f"{self.max_model_len} + {max(0, self.max_new_tokens - 1)} generated); give more pages or "
                "lower --max-length")
        slots = self.num_state_slots or self._derived_slots(spec)
        if spec.delta is not None and self.max_new_tokens and slots < 1:
            raise UserError("generation on a delta-rule model needs at least one state slot")
        # The Triton kernels take chunks of 64 or 128; on CPU 0 leaves the choice to the layer
        # (models/layers/gated_deltanet.py: CPU_CHUNK_SIZE).
        chunk = self.gdn_chunk_size or (64 if self.triton_kernels(device) else 0)
        # Not asked for on a GPU, where it cannot hold: the kernels' own batch-invariant modes (no walk
        # segments) would only cost parallelism.
        on_cpu = not self.triton_kernels(device) and device.type == "cpu"
        budget = self.max_tokens_per_step
        paths = self.batch_invariant and invariant_paths_apply(budget, on_cpu, dtype)
        if self.batch_invariant and on_cpu and not (paths and batch_invariance_holds(budget, on_cpu, dtype)):
            log.warning("outputs are not batch-invariant (they may change in the last bits with the batch): %s",
                        not_invariant_reason(budget, dtype))
        resolved = replace(self, num_pages=pages, num_state_slots=slots if spec.delta else 0, gdn_chunk_size=chunk,
                           batch_invariant=paths)
        resolved._check_memory(spec, device, dtype, derived_pages=not self.num_pages)
        return resolved

    def _derived_pages(self, spec: ModelSpec) -> int:
        per = lambda tokens: -(-tokens // self.page_size)   # noqa: E731
        step = per(self.max_tokens_per_step) + self.max_seqs          # one step's tokens + a page of slack each
        if not spec.is_causal:
            return max(per(self.max_model_len), step)                 # a step holds whole sequences only
        if not self.max_new_tokens:
            return per(self.max_model_len) + step                     # one long sequence in flight + a step
        running = min(self.max_seqs, self.max_tokens_per_step)
        return per(self.max_model_len + self.max_new_tokens) + step + running * per(self.max_new_tokens)

    def _derived_slots(self, spec: ModelSpec) -> int:
        if spec.delta is None:
            return 0
        if self.max_new_tokens:
            return min(self.max_seqs, self.max_tokens_per_step)      # every running sequence decodes
        return 4   # embed / score: only sequences whose prefill spans steps keep state (one or two at a time)

    def cache_bytes(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> int:
        kv = self.num_pages * self.page_size * spec.kv_bytes_per_token(dtype, self.triton_kernels(device))
        state = self.num_state_slots * spec.delta.bytes_per_slot(dtype) if spec.delta else 0
        return kv + state

    def _check_memory(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype, derived_pages: bool) -> None:
        need = self.cache_bytes(spec, dtype, device)
        log.info("engine budgets: %d tokens and %d sequences per step; KV cache %d pages x %d tokens; "
                 "%d state slots; caches %.1f MiB", self.max_tokens_per_step, self.max_seqs, self.num_pages,
                 self.page_size, self.num_state_slots, need / 2**20)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            where = "GPU memory"
        else:   # (allocated and zeroed at once: a cache past the RAM met the OOM killer a minute later)
            free, where = available_ram()
            if free is None:
                return
        shared = self.memory_shared_by if device.type == "cpu" else 1
        allowed = self.memory_fraction * free / shared
        if need > allowed:
            change = self._fitting_change(spec, dtype, device, SUGGESTED_SHARE * allowed) if derived_pages else None
            among = f", shared by the run's {shared} workers" if shared > 1 else ""
            flags = {"max_tokens_per_batch": "--max-tokens-per-batch", "max_seqs": "--max-seqs",
                     "max_new_tokens": "--max-new-tokens", "max_length": "--max-length"}
            others = {"max_tokens_per_batch": ", or --max-seqs", "max_new_tokens": ", or --max-length",
                      "max_seqs": ", or --max-new-tokens" if self.max_new_tokens else "", "max_length": ""}
            raise CachesTooLarge(
                f"the engine's caches need {human_bytes(need)} but only {human_bytes(free)} of {where} is "
                f"free (using at most {self.memory_fraction:.0%}{among}); lower "
                + (" and ".join(", ".join(f"{flags[k]} to {v}" for k, v in change.items()).rsplit(", ", 1))
                   + " (or less)"
                   + others[list(change)[-1]] if change else
                   # (generating, each running sequence's cache holds its --max-new-tokens)
                   f"{'--max-new-tokens, ' if self.max_new_tokens else ''}--max-length, --max-tokens-per-batch or "
                   "--max-seqs"), change)

    def _fitting_change(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, allowed: float
                        ) -> dict[str, int] | None:
        """The settings (RunConfig fields) and values with which the derived caches take at most `allowed`
        bytes (see CachesTooLarge); None where none of the changes tried does."""
        fits = lambda **change: self._fits(spec, dtype, device, allowed, **change)   # noqa: E731
        budget = self._fitting_budget(spec, dtype, device, allowed)
        if budget is not None:
            return {"max_tokens_per_batch": budget}
        seqs = _largest(lambda n: fits(max_seqs=n), self.max_seqs - 1)
        if seqs is not None:
            return {"max_seqs": seqs}
        if self.max_tokens_per_step > INVARIANT_SPLIT:
            seqs = _largest(lambda n: fits(max_tokens_per_step=INVARIANT_SPLIT, max_seqs=n), self.max_seqs - 1)
            if seqs is not None:
                return {"max_tokens_per_batch": INVARIANT_SPLIT, "max_seqs": seqs}
        if self.max_new_tokens:
            new_tokens = _largest(lambda n: fits(max_new_tokens=n), self.max_new_tokens - 1)
            if new_tokens is not None:
                return {"max_new_tokens": new_tokens}
        # the run's longest prompt alone is too much: a lower --max-length (records over it run as windows,
        # truncated or skipped: worker/shard_run.py's caches_advice chooses), with the smallest budget if need be,
        # and then no more sequences than it has tokens (a step runs at most one sequence per token, and each
        # --max-seqs holds a page of slack: the default 256 took 4,096 tokens of cache, more than some memories
        # leave, and no --max-length was named where one fitted)
        # (generating, each running sequence holds its new tokens and a state slot: halved until one fits)
        small = {"max_tokens_per_batch": INVARIANT_SPLIT} if self.max_tokens_per_step > INVARIANT_SPLIT else {}
        changes = [{}, small] if small else [{}]   # (RunConfig fields)
        seqs = min(self.max_tokens_per_step, INVARIANT_SPLIT)
        while seqs >= 1:
            if seqs < self.max_seqs:
                changes.append({**small, "max_seqs": seqs})
            seqs //= 2
        for change in changes:
            step = dict(max_tokens_per_step=change.get("max_tokens_per_batch", self.max_tokens_per_step),
                        max_seqs=change.get("max_seqs", self.max_seqs))
            length = _largest(lambda n: fits(max_model_len=n, **step), self.max_model_len - 1)
            if length is not None and length >= SHORTEST_NAMED_LENGTH:
                return {**change, "max_length": length}
        # generating, where no --max-length does either: the largest --max-new-tokens with those smaller steps (the
        # refusal named no setting, and its rerun with a smaller step, as it said, was refused again before naming it)
        for change in changes[1:] if self.max_new_tokens else []:
            step = dict(max_tokens_per_step=change.get("max_tokens_per_batch", self.max_tokens_per_step),
                        max_seqs=change.get("max_seqs", self.max_seqs))
            new_tokens = _largest(lambda n: fits(max_new_tokens=n, **step), self.max_new_tokens - 1)
            if new_tokens is not None:
                return {**change, "max_new_tokens": new_tokens}
        return None

    def _fits(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, allowed: float, **change) -> bool:
        """Whether the caches derived with `change` (EngineConfig fields) take at most `allowed` bytes."""
        smaller = replace(self, num_pages=0, **change)
        slots = smaller._derived_slots(spec) if spec.delta else 0
        sized = replace(smaller, num_pages=smaller._derived_pages(spec), num_state_slots=slots)
        return sized.cache_bytes(spec, dtype, device) <= allowed

    def _fitting_budget(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, allowed: float) -> int | None:
        """The largest step budget below this one, a multiple of INVARIANT_SPLIT, whose derived caches take at
        most `allowed` bytes; None where even INVARIANT_SPLIT tokens do not fit."""
        units = _largest(lambda k: self._fits(spec, dtype, device, allowed, max_tokens_per_step=k * INVARIANT_SPLIT),
                         (self.max_tokens_per_step - 1) // INVARIANT_SPLIT)
        return units * INVARIANT_SPLIT if units is not None else None


def _largest(fits, high: int) -> int | None:
    """The largest n in 1..high for which fits(n), fits being true up to some n and false above; None where
    not even fits(1)."""
    low = 1
    if high < low or not fits(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low
