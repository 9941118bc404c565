"""A model loaded before its shard was known. A local run's workers start while the parent plans
(launchers/early_workers.py); as soon as the parent has chosen the checkpoint, the engine and the dtype, it
tells them, and each loads the model onto its device while the parent finishes planning (the config and
tokenizer checks, the storage estimate, the manifest). The shard's engine then takes what was loaded instead of
reading the weights again, when it asks for exactly the same (`Wanted`: engine, checkpoint directory and
fingerprint, the fingerprint checked before and after the load, device, dtype, and for the hf engine the head
and --trust-remote-code); anything else loads as usual, so a model loaded ahead never decides what a run
computes, only when its weights were read.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

log = logging.getLogger("run_shards.worker")


@dataclass(frozen=True)
class Wanted:
    """A model as a run asks for it."""
    engine: str    # "native" (the native model) or "hf" (the hf engine, built whole)
    path: str
    fingerprint: str
    device: str    # torch.device's text: "cuda:0", "cpu"
    dtype: str     # torch dtype name: "bfloat16"
    logprobs: bool = False            # hf: with the LM head (score, variants); the native model is the same either way
    trust_remote_code: bool = False   # hf

    @classmethod
    def of(cls, engine: str, path, fingerprint: str, device, dtype, logprobs: bool = False,
           trust_remote_code: bool = False) -> "Wanted":
        return cls(engine, str(Path(path)), fingerprint, str(device), str(dtype).removeprefix("torch."),
                   logprobs and engine == "hf", trust_remote_code)


_held: dict[Wanted, tuple[object, str]] = {}   # what was loaded, and how (for the log line of `take`)


def load(wanted: Wanted, build: Callable[[], object]) -> bool:
    """`build()` the model `wanted` names and keep it for `take`; True when kept. Nothing is kept when the
    checkpoint is not the one the parent fingerprinted (changed before or during the load)."""
    from .checkpoint import fingerprint
    began = time.monotonic()
    if fingerprint(Path(wanted.path), like=wanted.fingerprint) != wanted.fingerprint:
        log.info("not loading the model ahead: %s changed since the run was planned", wanted.path)
        return False
    built = build()
    if fingerprint(Path(wanted.path), like=wanted.fingerprint) != wanted.fingerprint:
        log.info("the model loaded ahead is not kept: %s changed while it loaded", wanted.path)
        return False
    seconds = time.monotonic() - began
    _held[wanted] = (built, f"the model loaded ahead ({seconds:.1f} s of loading done while the run was planned)")
    log.info("model loaded ahead on %s (%s, engine %s) in %.1f s, while the run was planned", wanted.device,
             wanted.dtype, wanted.engine, seconds)
    return True


def keep(wanted: Wanted, built, shard: int) -> None:
    """Keep the model this process loaded for shard `shard`, for its next shard of the same run to `take`
    (worker/entry.py: a worker that finished its shard is given the next one waiting). Its checkpoint was
    fingerprinted before and after that load; the next shard checks the checkpoint against the run's record
    again before it asks for the model."""
    _held.clear()
    _held[wanted] = (built, f"the model loaded for shard {shard} in this process")


def holding() -> bool:
    """Whether a model loaded ahead waits here (its weights are read: nothing to read ahead for the load)."""
    return bool(_held)


def take(wanted: Wanted):
    """What was loaded ahead (or kept) for exactly `wanted` (given up: a second call gets None), or None.
    Anything else held is dropped: this process computes shards of one run, one at a time."""
    found = _held.pop(wanted, None)
    _held.clear()
    if found is None:
        return None
    log.info("using %s", found[1])
    return found[0]
