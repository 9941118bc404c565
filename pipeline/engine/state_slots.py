"""Slots of the delta-rule state (conv window + recurrent matrix per layer), one per sequence that
carries state from one step to the next: a sequence whose prefill spans steps, or one being decoded."""
from __future__ import annotations

from .sequence import Sequence


class StateSlots:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))   # pop() hands out 0, 1, 2, ...
        self.owner = [-1] * num_slots

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def allocate(self, seq: Sequence) -> None:
        assert seq.slot == -1, f"{seq} already holds slot {seq.slot}"
        assert self.free_slots, "no free state slot"
        slot = self.free_slots.pop()
        assert self.owner[slot] == -1
        self.owner[slot] = seq.seq_id
        seq.slot = slot

    def free(self, seq: Sequence) -> None:
        if seq.slot == -1:
            return
        assert self.owner[seq.slot] == seq.seq_id, f"{seq} frees slot {seq.slot} owned by {self.owner[seq.slot]}"
        self.owner[seq.slot] = -1
        self.free_slots.append(seq.slot)
        seq.slot = -1
