"""Choose and load the engine a worker runs: `native` for the architectures it supports, else `hf`."""
from __future__ import annotations

import torch

from ..errors import UserError
from ..models.registry import SUPPORTED_MODEL_TYPES

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


def batch_invariant(engine: str, config) -> bool:
    """Whether a run's stored values are the same bits whatever its number of workers, token budget and
    the other sequences of each batch: the native engine with --batch-invariant (the default) where
    batch_invariance_holds (on CPU in float32, a budget of at least 64 tokens, MKL in strict mode;
    docs/engine.md). Not the hf engine (transformers pads a batch to its longest sequence and runs each
    shape's own kernels)."""
    from .config import batch_invariance_holds
    dtype = getattr(torch, config.torch_dtype_name)
    return (engine == "native" and config.batch_invariant
            and batch_invariance_holds(config.tokens_per_batch, not config.on_gpu, dtype))


def why_not_batch_invariant(config) -> str:
    """Why `batch_invariant` says no for a native CPU run that asked for the property, and what keeps it."""
    from .config import not_invariant_reason
    return not_invariant_reason(config.tokens_per_batch, getattr(torch, config.torch_dtype_name))


def check_dtype(engine: str, dtype: str, on_gpu: bool) -> None:
    """Refuse float32 for the native engine on a GPU, before any work.

    Its Triton kernels are tuned for 16-bit inputs; in float32 (full-precision products) all but the
    decode kernel spill 3-67 KB of registers per thread to local memory (tests/kernels/compile_matrix.py,
    issue 20), so a run would be many times slower than it should, silently."""
    if engine == "native" and on_gpu and dtype == "float32":
        raise UserError("--dtype float32 is not supported by the native engine on a GPU: its Triton kernels "
                        "spill registers in float32 and would run many times slower. Use --dtype bfloat16 (the "
                        "GPU default; float16 works too), or --engine hf for a float32 run on a GPU.")


def load(name: str, model_path: str, device: torch.device, dtype: torch.dtype, logprobs: bool,
         fingerprint: str, config=None, max_tokens=...):
    """The engine. `max_tokens`: the model's token limit as the run's plan found it (None: no limit), so
    that workers need not find it again (that builds the transformers model on the meta device, about
    1.5 s); `...` finds it here."""
    if name == "hf":
        from .hf import HFEngine
        budget = {"tokens_per_batch": config.tokens_per_batch} if config is not None else {}
        return HFEngine(model_path, device, dtype, logprobs, fingerprint, max_tokens=max_tokens, **budget)
    if name == "native":
        from .native import NativeEngine
        return NativeEngine.load(model_path, device, dtype, fingerprint, run_config=config, max_tokens=max_tokens)
    raise UserError(f"engine {name!r} is not available in this build")
