"""What runs in each step: decodes first, then prefill continuations, then new sequences, under the
token budget (`max_tokens_per_step`) and the sequence budget (`max_seqs`).

Causal models prefill a sequence longer than the remaining budget in chunks, its KV pages and delta-rule
state carrying it from one step to the next. With `split_unit` > 1 (batch-invariant runs) a chunk that
leaves part of its sequence for a later step ends at a multiple of that many tokens, so every sequence is
cut at the same places whatever the budget and its neighbours. Encoders (bidirectional) need a whole
sequence per step: one that does not fit what is left waits for the next step, and one longer than the
whole budget runs alone in a step of its own.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .block_manager import BlockManager
from .sequence import Sequence, Status
from .state_slots import StateSlots


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int          # first token of this step (= tokens already computed)
    num_tokens: int     # tokens computed in this step

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def completes_known_tokens(self) -> bool:
        """After this step every token of the sequence so far is computed (its last logits are ready)."""
        return self.end == len(self.seq)


class Scheduler:
    def __init__(self, max_tokens_per_step: int, max_seqs: int, causal: bool, blocks: BlockManager,
                 slots: StateSlots | None, split_unit: int = 1):
        self.max_tokens, self.max_seqs, self.causal = max_tokens_per_step, max_seqs, causal
        self.split_unit = split_unit
        self.blocks, self.slots = blocks, slots
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        assert seq.status == Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _needs_slot(self, seq: Sequence, num_tokens: int) -> bool:
        """A sequence keeps a state slot if it goes on after this step (delta-rule models only)."""
        return self.slots is not None and (seq.generates or num_tokens < seq.num_pending)

    def schedule(self) -> list[ScheduledSeq]:
        budget, step = self.max_tokens, []
        decoding = [s for s in self.running if s.is_decoding]
        prefilling = [s for s in self.running if not s.is_decoding]
        for seq in decoding + prefilling:
            if len(step) == self.max_seqs or budget == 0:
                break
            n = seq.num_pending if seq.is_decoding else self._chunk(seq, budget)
            if n > budget or n == 0:
                continue
            # A running sequence that continues after this step already holds its slot (taken at admission).
            assert not self._needs_slot(seq, n) or seq.slot >= 0, f"{seq} continues without a state slot"
            step.append(ScheduledSeq(seq, seq.num_computed, n))
            budget -= n
        while self.waiting and len(step) < self.max_seqs and budget > 0:
            seq = self.waiting[0]
            if self.causal:
                n = self._chunk(seq, budget)
                if n == 0:
                    break   # its first chunk would end off the split grid: the next step starts it
            else:
                n = seq.num_pending
                if n > budget and step:
                    break   # an encoder sequence runs whole: wait for a step with room (alone if need be)
            needs_slot = self._needs_slot(seq, n)
            if needs_slot and not self.slots.num_free:
                break
            if not self.blocks.can_allocate(seq):
                break
            if seq.generates and len(self.running) >= min(self.max_seqs, self.max_tokens):
                break       # every running sequence must be able to decode in one step
            self.waiting.popleft()
            self.blocks.allocate(seq)
            if needs_slot:
                self.slots.allocate(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            step.append(ScheduledSeq(seq, seq.num_computed, n))
            budget -= n
        assert step or not self.has_work(), (
            f"nothing schedulable: {len(self.waiting)} waiting, {len(self.running)} running, "
            f"{self.blocks.num_free} free pages")
        return step

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Prefill tokens of `seq` in this step: all it has pending if they fit, else as many as fit, cut
        down to a multiple of split_unit tokens (maybe none)."""
        if seq.num_pending <= budget:
            return seq.num_pending
        return budget - budget % self.split_unit

    def after_step(self, step: list[ScheduledSeq]) -> None:
        """Advance the computed counts; release whatever a finished sequence holds."""
        for s in step:
            assert s.seq.num_computed == s.start
            s.seq.num_computed = s.end
            if not s.seq.generates and s.seq.num_pending == 0:
                self.finish(s.seq, "done")

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.blocks.free(seq)
        if self.slots is not None:
            self.slots.free(seq)
        self.running.remove(seq)

    def abort_all(self) -> None:
        """Drop every sequence and return its resources (after a failed step)."""
        for seq in list(self.running):
            self.finish(seq, "aborted")
        self.waiting.clear()
