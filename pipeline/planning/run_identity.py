"""A run's identity: what decides its bits, compared by a command that continues a run, by `rerun` (the
model's files: models/checkpoint.check_unchanged) and by `--reuse` (planning/reuse.py).

- Its inputs, by content: the FASTA (the index's fingerprint), the variants file, the model (config.json
  and the weights, and every other file of the checkpoint, its tokenizer's above all, each by its own
  digest so that a refusal names the file).
- Its settings as they resolved, not as they were spelled: the model as a resolved path ("demo" for the
  bundled one), and the engine, dtype, input format, per-sequence token limit and score method that
  `auto` or a default became; every other option that shapes the result (config.RESULT) as given.

A planned run records its resolved settings in its attributes (`resolved`, kept in the manifest and in
result.h5) with its model's files (`model_files`). A run directory planned before they were recorded is
compared on what its manifest kept, which resolves the same values (its model path, engine, dtype, input
format, token limit and score method); an older result, on what its attributes kept: there the token
limit is compared as --max-length was given, and the tokenizer's files are not compared (a warning says so).
"""
from __future__ import annotations

import json

from ..config import RESULT, RunConfig, option_name

# The settings compared as they resolved; the other RESULT options are compared as given.
RESOLVED = ("model", "engine", "dtype", "input_format", "max_length", "score_method")
# RESULT options compared as inputs, by content: the FASTA files (the index's fingerprint), the variants file.
BY_CONTENT = ("fasta", "variants")


def of_plan(config: RunConfig, model, limit: int | None, task_attrs: dict) -> dict:
    """The resolved settings of the run being planned: `model` is planning's Model (its source, engine and
    input convention), `limit` the per-sequence token limit, `task_attrs` its task's attributes."""
    source = model.source
    return {"model": "demo" if source.name == "demo" else source.path, "engine": model.engine,
            "dtype": config.torch_dtype_name, "input_format": model.convention.words(), "max_length": limit,
            "score_method": task_attrs.get("score_method", config.score_method)}


def resolved(manifest: dict) -> dict:
    """The resolved settings of a planned run, from its manifest (as recorded, or as an older run_shards's
    manifest keeps them)."""
    attrs = manifest["attrs"]
    if "resolved" in attrs:
        return attrs["resolved"]
    config = RunConfig.from_dict(manifest["config"])
    model = manifest["model"]
    return {"model": "demo" if model.get("name") == "demo" else model.get("path", config.model),
            "engine": manifest.get("engine", config.engine), "dtype": attrs.get("dtype", config.torch_dtype_name),
            "input_format": attrs.get("input_format", config.input_format),
            "max_length": manifest.get("max_tokens", config.max_length),
            "score_method": attrs.get("score_method", config.score_method)}


def of_result(attrs: dict) -> tuple[dict, bool]:
    """(the resolved settings of a result, from its attributes; whether it recorded them): a result written
    before they were recorded gives its --max-length as given, and no model path."""
    if "resolved" in attrs:
        return json.loads(attrs["resolved"]), True
    config = RunConfig.from_dict(json.loads(attrs["config"]))
    return {"model": None, "engine": attrs.get("engine"), "dtype": attrs.get("dtype"),
            "input_format": attrs.get("input_format", config.input_format), "max_length": config.max_length,
            "score_method": attrs.get("score_method", config.score_method)}, False


def settings_changes(old: RunConfig, old_resolved: dict, new: RunConfig, new_resolved: dict,
                     leave_out: tuple[str, ...] = ()) -> list[tuple[str, str, str]]:
    """Each setting of `new` that gives other bits than `old`'s, as (option, old value, new value) in words:
    the resolved ones compared resolved, the other RESULT options as given, unless meaningless to both
    (--per-residue-dtype without --per-residue: a run planned before that was refused kept it); `leave_out`:
    not compared."""
    changes = []
    ignored = old.ignored() & new.ignored()
    for name in RunConfig.fields_with_role(RESULT):
        if name in BY_CONTENT or name in leave_out:
            continue
        if name in RESOLVED:
            was, now = old_resolved.get(name), new_resolved.get(name)
        elif name in ignored:
            continue
        else:
            was, now = getattr(old, name), getattr(new, name)
        if was != now:
            changes.append((option_name(name), shown(name, was), shown(name, now)))
    return changes


def shown(name: str, value) -> str:
    """A setting's value in a message (a resolved token limit of None is 'no limit')."""
    if isinstance(value, list):
        return ",".join(map(str, value))
    if value is None:
        return "no limit" if name == "max_length" else "not given"
    return str(value)


def why_not_invariant(engine: str, config: RunConfig) -> str:
    """Why a run's values are not batch-invariant (engines.batch_invariant said no), naming the option."""
    if engine != "native":
        return f"--engine {engine} (transformers pads each batch to its longest sequence)"
    if not config.batch_invariant:
        return "--no-batch-invariant"
    if config.on_gpu:
        return "GPUs (cuBLAS picks a matmul's algorithm by its shape)"
    from ..engine import selection as engines
    return engines.why_not_batch_invariant(config)
