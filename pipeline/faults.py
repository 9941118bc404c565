"""Fault injection for tests and drills, switched on by environment variables (off by default).

RUN_SHARDS_FAULT_OOM_TOKENS=N   a batch costing more than N tokens raises torch.OutOfMemoryError, the
                                exception a real CUDA out-of-memory raises, so the split-and-retry path
                                runs for real on CPU
RUN_SHARDS_FAULT_BATCH_SLEEP=S  sleep S seconds before every batch (lets a test kill a worker mid-run)
RUN_SHARDS_FAULT_BATCH_SLEEP_SHARD=R  ...only the worker of shard R (default: every one)
RUN_SHARDS_FAULT_STEP_SLEEP=S   sleep S seconds before every step of a generate batch (a slow generation: lets a
                                test stop a worker mid-batch, or see its hang detector told of a long batch)
RUN_SHARDS_FAULT_WINDOW_SLEEP=S sleep S seconds before every call of a batch's windows after the first (a slow
                                windowed record: lets a test stop a worker within it)
RUN_SHARDS_FAULT_HANG_SHARD=R   worker of shard R stops making progress after its first batch
RUN_SHARDS_FAULT_DIE_AT=POINT   the worker kills itself with SIGKILL at POINT of writing its output:
                                part-written (checkpoint data written, file not finished),
                                part-finished (checkpoint finished, not yet renamed into place),
                                shard-written (final shard written, not yet renamed into place)
RUN_SHARDS_FAULT_DIE_SHARD=R    ...only the worker of shard R (default: any)
RUN_SHARDS_FAULT_DIE_AFTER=K    ...only from its K-th checkpoint on (default 0, the first)
RUN_SHARDS_FAULT_FREE_RAM=B      B bytes of free RAM stand for what host_memory.available_ram reads: the native
                                engine's refusal of CPU caches, and planning's of CPU workers' model copies, that
                                do not fit run without filling the machine
RUN_SHARDS_FAULT_PLAN_CRASH=1   the parent raises RuntimeError (a bug's traceback) while recording a new run's
                                plan: its index and copy plan written into OUT, its manifest not yet
                                (=kill: it kills itself with SIGKILL there, leaving them)
"""
from __future__ import annotations

import os
import signal
import time


def maybe_out_of_memory(batch: list[list[int]], padded: bool) -> None:
    limit = int(os.environ.get("RUN_SHARDS_FAULT_OOM_TOKENS", "0") or 0)
    if not limit:
        return
    cost = len(batch) * max(len(x) for x in batch) if padded else sum(len(x) for x in batch)
    if cost > limit:
        import torch   # (this module is imported by the torch-free output room)
        raise torch.OutOfMemoryError(f"injected out of memory: batch of {cost} tokens > {limit}")


def before_batch(rank: int, batches_done: int) -> None:
    pause = float(os.environ.get("RUN_SHARDS_FAULT_BATCH_SLEEP", "0") or 0)
    only = os.environ.get("RUN_SHARDS_FAULT_BATCH_SLEEP_SHARD", "")
    if pause and (only == "" or int(only) == rank):
        time.sleep(pause)
    hang = os.environ.get("RUN_SHARDS_FAULT_HANG_SHARD")
    if hang is not None and hang != "" and int(hang) == rank and batches_done >= 1:
        while True:
            time.sleep(3600)


def before_window_call() -> None:
    pause = float(os.environ.get("RUN_SHARDS_FAULT_WINDOW_SLEEP", "0") or 0)
    if pause:
        time.sleep(pause)


def before_generate_step() -> None:
    pause = float(os.environ.get("RUN_SHARDS_FAULT_STEP_SLEEP", "0") or 0)
    if pause:
        time.sleep(pause)


def maybe_die(point: str, rank: int, number: int) -> None:
    if os.environ.get("RUN_SHARDS_FAULT_DIE_AT") != point:
        return
    only = os.environ.get("RUN_SHARDS_FAULT_DIE_SHARD", "")
    after = int(os.environ.get("RUN_SHARDS_FAULT_DIE_AFTER", "0") or 0)
    if (only == "" or int(only) == rank) and number >= after:
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_crash_planning() -> None:
    crash = os.environ.get("RUN_SHARDS_FAULT_PLAN_CRASH")
    if crash == "1":
        raise RuntimeError("injected crash while recording the plan (RUN_SHARDS_FAULT_PLAN_CRASH=1)")
    if crash == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


def free_ram() -> int | None:
    """The free RAM RUN_SHARDS_FAULT_FREE_RAM stands for, or None (read the machine's)."""
    value = os.environ.get("RUN_SHARDS_FAULT_FREE_RAM", "")
    return int(value) if value else None
