"""Fault injection for tests and drills, switched on by environment variables (off by default).

RUN_SHARDS_FAULT_OOM_TOKENS=N   a batch costing more than N tokens raises torch.OutOfMemoryError, the
                                exception a real CUDA out-of-memory raises, so the split-and-retry path
                                runs for real on CPU
RUN_SHARDS_FAULT_BATCH_SLEEP=S  sleep S seconds before every batch (lets a test kill a worker mid-run)
RUN_SHARDS_FAULT_HANG_SHARD=R   worker of shard R stops making progress after its first batch
"""
from __future__ import annotations

import os
import time

import torch


def torch_oom_type() -> type:
    return torch.OutOfMemoryError


def maybe_out_of_memory(batch: list[list[int]], padded: bool) -> None:
    limit = int(os.environ.get("RUN_SHARDS_FAULT_OOM_TOKENS", "0") or 0)
    if not limit:
        return
    cost = len(batch) * max(len(x) for x in batch) if padded else sum(len(x) for x in batch)
    if cost > limit:
        raise torch.OutOfMemoryError(f"injected out of memory: batch of {cost} tokens > {limit}")


def before_batch(rank: int, batches_done: int) -> None:
    pause = float(os.environ.get("RUN_SHARDS_FAULT_BATCH_SLEEP", "0") or 0)
    if pause:
        time.sleep(pause)
    hang = os.environ.get("RUN_SHARDS_FAULT_HANG_SHARD")
    if hang is not None and hang != "" and int(hang) == rank and batches_done >= 1:
        while True:
            time.sleep(3600)
