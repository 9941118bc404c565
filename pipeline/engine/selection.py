"""Choose and load the engine a worker runs: `native` for the families and configs it runs
(models/registry.py says which), else `hf`."""
from __future__ import annotations

import logging

import torch

from ..errors import UserError
from ..models.registry import tasks

log = logging.getLogger("run_shards")


def choose(engine: str, source, task: str) -> str:
    """The engine for --engine `engine` on checkpoint `source` (a ModelSource: its facts and family), said in
    run.log when auto picks hf for a family the native engine runs."""
    family, facts = source.family, source.facts
    native, why = family.supports_native(facts)
    if engine == "native" and not native:
        raise UserError(f"--engine native does not run this checkpoint ({family.name}): {why}. Use --engine hf "
                        "(or auto).")
    chosen = "native" if engine == "native" or (engine == "auto" and native) else "hf"
    supported = tasks(source.is_causal, chosen, source.is_masked_lm)
    if task == "generate" and source.is_causal and chosen != "native":
        if native:   # only --engine hf kept it from the native engine
            raise UserError(f"--task generate runs on the native engine, and --engine hf was given: drop it (or "
                            f"give --engine auto or native) for this {family.name} checkpoint")
        raise UserError(f"--task generate runs on the native engine, which does not run this checkpoint "
                        f"({family.name}): {why}. On the hf engine it supports --task {' and '.join(supported)}.")
    if task in ("score", "variants") and task not in supported:
        raise UserError(f"--task {task} needs a language model with its head: a causal LM, or a masked LM whose "
                        f"config.json names a *ForMaskedLM class (ESM-2's EsmForMaskedLM); this {family.name} "
                        f"checkpoint ({source.facts.architecture}) is neither: it supports --task "
                        f"{' and '.join(supported)}. Pass such a checkpoint with --model.")
    if task not in supported:
        raise UserError(f"--task {task} needs a causal language model; this {family.name} checkpoint "
                        f"({source.facts.architecture}) is not one: it supports --task {' and '.join(supported)}. "
                        "Pass a causal LM with --model for scores or continuations.")
    if engine == "auto" and family.native and not native:
        log.info("engine: hf, not native, for this %s checkpoint: %s", family.name, why)
    return chosen


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


def load(name: str, model_path: str, device: torch.device, dtype: torch.dtype, logprobs: bool, info=None,
         config=None, longest_prompt: int | None = None, fingerprint: str = ""):
    """The engine. `info`: the run's EngineInfo (models/checkpoint.describe, made once by the parent; None:
    described here); `longest_prompt`: the most tokens a prompt of the run has (its longest record's, at most the
    run's limit: --max-length, else the model's), for which the native engine sizes its caches;
    `fingerprint`: the checkpoint's, as the run recorded it (the native engine then uses a model loaded ahead
    for it: models/preload.py)."""
    trust = bool(config is not None and getattr(config, "trust_remote_code", False))
    if name == "hf":
        from ..models import preload
        from .hf import HFEngine
        budget = {"tokens_per_batch": config.tokens_per_batch} if config is not None else {}
        ahead = preload.take(preload.Wanted.of("hf", model_path, fingerprint, device, dtype, logprobs, trust)) \
            if fingerprint else None
        if ahead is not None:
            if ahead.adopt(info, **budget):
                return ahead
            del ahead   # (its memory freed before another model is built)
        return HFEngine(model_path, device, dtype, logprobs, info=info, trust_remote_code=trust, **budget)
    if name == "native":
        from .native import NativeEngine
        return NativeEngine.load(model_path, device, dtype, fingerprint, run_config=config, info=info,
                                 longest_prompt=longest_prompt)
    raise UserError(f"engine {name!r} is not available in this build")


def keep(engine, name: str, model_path: str, fingerprint: str, device: torch.device, dtype: torch.dtype,
         logprobs: bool, trust_remote_code: bool, shard: int) -> None:
    """Keep what `engine` (engine `name`, loaded by `load` with these arguments for shard `shard`) holds of
    its checkpoint, for this process's next shard to `load` (models/preload.py): the native model, or the hf
    engine whole."""
    from ..models import preload
    wanted = preload.Wanted.of(name, model_path, fingerprint, device, dtype, logprobs, trust_remote_code)
    preload.keep(wanted, engine.model if name == "native" else engine, shard)


def load_ahead(name: str, model_path: str, fingerprint: str, device: torch.device, dtype: torch.dtype,
               logprobs: bool, trust_remote_code: bool) -> bool:
    """Load engine `name`'s model for a run not yet planned to the end, for `load` to take (models/preload.py):
    the native model, or the hf engine whole (the run's budget and description adopted when `load` takes it).
    True when it is held."""
    from ..models import preload
    wanted = preload.Wanted.of(name, model_path, fingerprint, device, dtype, logprobs, trust_remote_code)
    if name == "native":
        from ..models.registry import load_model
        return preload.load(wanted, lambda: load_model(model_path, device, dtype))
    if name == "hf":
        from .hf import HFEngine
        return preload.load(wanted, lambda: HFEngine(model_path, device, dtype, logprobs, fingerprint,
                                                     trust_remote_code=trust_remote_code))
    return False
