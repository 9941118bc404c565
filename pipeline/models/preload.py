"""A native model loaded before its shard was known. A local run's workers start while the parent plans
(launchers/early_workers.py); as soon as the parent has chosen the checkpoint, the engine and the dtype, it
tells them, and each loads the weights onto its device while the parent finishes planning (the tokenizer
check, the storage estimate, the manifest). The shard's engine then takes that model instead of reading the
weights again, when it asks for the same checkpoint (directory and fingerprint, the fingerprint checked
before and after the load), device and dtype; anything else loads as usual, so a model loaded ahead never
decides what a run computes, only when its weights were read.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("run_shards.worker")


@dataclass(frozen=True)
class Wanted:
    """A native model as a run asks for it."""
    path: str
    fingerprint: str
    device: str    # torch.device's text: "cuda:0", "cpu"
    dtype: str     # torch dtype name: "bfloat16"

    @classmethod
    def of(cls, path, fingerprint: str, device, dtype) -> "Wanted":
        return cls(str(Path(path)), fingerprint, str(device), str(dtype).removeprefix("torch."))


_held: dict[Wanted, tuple[object, float]] = {}   # the model, and the seconds its load took


def load(wanted: Wanted) -> bool:
    """Load the native model `wanted` names and keep it for `take`; True when kept. Nothing is kept when the
    checkpoint is not the one the parent fingerprinted (changed before or during the load)."""
    import torch

    from .checkpoint import fingerprint
    from .registry import load_model
    began = time.time()
    if fingerprint(Path(wanted.path)) != wanted.fingerprint:
        log.info("not loading the model ahead: %s changed since the run was planned", wanted.path)
        return False
    model = load_model(wanted.path, torch.device(wanted.device), getattr(torch, wanted.dtype))
    if fingerprint(Path(wanted.path)) != wanted.fingerprint:
        log.info("the model loaded ahead is not kept: %s changed while it loaded", wanted.path)
        return False
    seconds = time.time() - began
    _held[wanted] = (model, seconds)
    log.info("model loaded ahead on %s (%s) in %.1f s, while the run was planned", wanted.device, wanted.dtype,
             seconds)
    return True


def take(wanted: Wanted):
    """The model loaded ahead for exactly `wanted` (given up: a second call gets None), or None. Any other model
    held is dropped: this process computes one shard of one run."""
    found = _held.pop(wanted, None)
    _held.clear()
    if found is None:
        return None
    log.info("using the model loaded ahead (%.1f s of loading done while the run was planned)", found[1])
    return found[0]
