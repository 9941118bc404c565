"""Choose and load the engine a worker runs: `native` for the architectures it supports, else `hf`."""
from __future__ import annotations

import torch

from .errors import UserError
from .models import SUPPORTED_MODEL_TYPES

# Model types --engine native runs (pipeline.models); --engine auto picks native for these.
NATIVE_MODEL_TYPES: frozenset[str] = frozenset(SUPPORTED_MODEL_TYPES)


def choose(engine: str, model_type: str, task: str) -> str:
    if engine == "hf":
        return "hf"
    supported = model_type in NATIVE_MODEL_TYPES
    if engine == "native":
        if not supported:
            raise UserError(f"--engine native does not support model type '{model_type}'; use --engine hf")
        return "native"
    if task == "generate" and not supported:
        raise UserError(f"--task generate runs on the native engine, which does not support '{model_type}'")
    return "native" if supported else "hf"


def load(name: str, model_path: str, device: torch.device, dtype: torch.dtype, logprobs: bool,
         fingerprint: str, config=None):
    if name == "hf":
        from .hf_engine import HFEngine
        return HFEngine(model_path, device, dtype, logprobs, fingerprint)
    if name == "native":
        from .engine.engine import NativeEngine
        return NativeEngine.load(model_path, device, dtype, fingerprint, run_config=config)
    raise UserError(f"engine {name!r} is not available in this build")
