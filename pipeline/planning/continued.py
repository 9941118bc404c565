"""A command on a run directory that already holds a run: what it may change.

Settings that shape the result (config.RESULT) and the run's inputs must be the same, or the command is
refused with both ways out. The shard geometry (config.PLAN: the number of shards W, and so each shard's
sequences) was fixed when the run was planned: every later command computes exactly those shards, with
however many workers it has, and a --shards that contradicts it is refused before anything is touched.
How the shards are run (config.LAUNCH) may change: the command's own settings apply, are logged, and are
kept for later commands.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os

import numpy as np

from index import SequenceIndex
from index.sequence_index import RECORD_ARRAYS

from ..advice import MANY_FILES, command, files_shown
from ..config import RunConfig, option_name
from ..errors import RunDirError
from ..rundir.layout import RunDir, free_out
from ..tasks.earlier_rows import earlier_rows
from . import run_identity

log = logging.getLogger("run_shards")


def shard_count(config: RunConfig, old: dict | None, records: int, run: RunDir) -> int:
    """W for this command: the planned run's when `run` holds one (a --shards that contradicts it is
    refused), else --shards or one per GPU or CPU worker, at most one per record."""
    wanted = min(config.world, records)
    if wanted < config.world and old is None:   # a worker with an empty shard would load the model for nothing
        log.info("%d record(s): using %d shard(s), not %d", records, wanted, config.world)
    if old is None:
        return wanted
    planned = old["world"]
    if config.shards is not None and wanted != planned:
        raise RunDirError(
            f"--shards {config.shards}: {run.root} holds a run planned as {planned} shard(s), and which sequences "
            f"each shard computes was fixed with that number (its finished rows belong to those shards); nothing "
            f"was changed. Leave out --shards to continue it (any number of --workers runs its {planned} shard(s) "
            f"in turn), or start a run of {wanted} shard(s) in another directory: "
            f"`{config.as_command(free_out(run.root))}`")
    return planned


def reconcile(run: RunDir, old: dict, new: dict, config: RunConfig, index: SequenceIndex | None = None) -> dict:
    """The manifest a command continues `run` with: `old` (the run's) with this command's launch settings,
    after refusing other inputs, other result settings, or another kind of device. `new` is the manifest
    this command planned and `config` its settings as planned; `index` the FASTA's index it planned on. Settings
    are compared as they resolved (run_identity.py): `./ck/esm2/` and its absolute path, `--dtype float32` and
    `auto` on CPU are the same."""
    from ..models.checkpoint import identity_changes
    old_config = RunConfig.from_manifest(old)
    model_changes = identity_changes(old["model"], new["model"])
    inputs = [f"model checkpoint: {'; '.join(model_changes)}"] if model_changes else []
    if [os.path.abspath(f) for f in old_config.fasta] != [os.path.abspath(f) for f in config.fasta]:
        inputs.append(f"FASTA files ({_shown(old_config.fasta)} -> {_shown(config.fasta)})")
    fasta_content = (old.get("index") or {}).get("fingerprint") != (new.get("index") or {}).get("fingerprint")
    earlier_index = fasta_content and not inputs and _same_records(run, index)
    inputs += [what for what, key in (("FASTA content", "index"), ("variants file content", "variants"))
               if (old.get(key) or {}).get("fingerprint") != (new.get(key) or {}).get("fingerprint")
               and not (key == "index" and earlier_index)]
    # (a run planned before the input format was recorded had the model's one format: not a change to name)
    unrecorded = () if "input_format" in old["attrs"] or "resolved" in old["attrs"] else ("input_format",)
    changed = [f"{option} ({was} -> {now})" for option, was, now in run_identity.settings_changes(
        old_config, run_identity.resolved(old), config, run_identity.resolved(new), leave_out=unrecorded)]
    retry = f"`{config.as_command(free_out(run.root))}`"
    if earlier_index and not inputs:
        raise RunDirError(
            f"{run.root} holds a run planned by an earlier run_shards, whose index of the same FASTA (the run's "
            f"{run.index_path.name}) is fingerprinted another way than this version's"
            + (f"; this command also changes {', '.join(changed)}" if changed else "")
            + f". Continue it as it was planned, on its own index, with `{command('rerun', run.root)}`, or use "
            f"another --out: {retry}.")
    if inputs:   # `rerun` would refuse too: say how to get either run
        raise RunDirError(
            f"{run.root} already holds a run with other inputs (changed: {', '.join(inputs + changed)}). To run on "
            f"the inputs as they are now, use another --out: {retry}. To finish the run that is there, restore "
            f"its inputs as they were and run `{command('rerun', run.root)}`.")
    if old_config.on_gpu != config.on_gpu:   # (first: `auto` settings, the dtype, resolve otherwise on each)
        was = "GPUs" if old_config.on_gpu else "CPU workers"
        raise RunDirError(f"--gpus: {run.root} holds a run planned for {was}, and all of a run's rows come from "
                          f"one kind of device (its dtype and kernels depend on it). Continue it with "
                          f"{'--gpus N' if old_config.on_gpu else '--gpus 0'}, or use another --out: {retry}.")
    if changed:
        raise RunDirError(f"{run.root} already holds a run with other settings (changed: {', '.join(changed)}). "
                          f"Use another --out ({retry}), or `{command('rerun', run.root)}` to continue that run as "
                          "it was.")
    older = _older_rows(old, new, config)
    if older:
        raise RunDirError(f"{run.root} holds a run planned by an earlier run_shards, computed {older}; its rows "
                          f"and this version's cannot make one result. Use another --out: {retry}.")
    log.info("%s holds this same run: continuing from its checkpoints", run.root)
    launch = {k: getattr(config, k) for k in RunConfig.fields_with_role("launch")}
    manifest = with_launch_settings(old, launch, "this command's")
    if manifest["attrs"].get("batch_invariant") and not new["attrs"].get("batch_invariant"):
        # (a token budget below what keeps the property: the plan warned) rows from now on may differ in
        # their last bits from a run at another budget, and so may the result: its attribute says so
        manifest = dict(manifest, attrs=dict(manifest["attrs"], batch_invariant=False))
    return manifest


def _same_records(run: RunDir, index: SequenceIndex | None) -> bool:
    """Whether the run's own index (OUT/index.rsidx, as an earlier run_shards wrote it) holds the very records of
    `index` (this command's, of the same FASTA files unchanged since, on every stat field it recorded, and with the
    same record checksums where it kept them of the kind this version takes), so that only how an index is
    fingerprinted differs."""
    if index is None or not run.index_path.is_file():
        return False
    try:
        theirs = SequenceIndex.load(run.index_path)
    except Exception:   # (unreadable or damaged: the fingerprints' difference is said as it is)
        return False
    try:
        checksums = ("checksums",) if getattr(theirs, "checksums", None) is not None \
            and theirs.checksum_kind == index.checksum_kind else ()
        return len(theirs.inputs) == len(index.inputs) and len(theirs) == len(index) \
            and all(was.unchanged(now) for was, now in zip(theirs.inputs, index.inputs)) \
            and all(np.array_equal(getattr(theirs, name), getattr(index, name)) for name in RECORD_ARRAYS + checksums)
    finally:
        theirs.close()


def _older_rows(old: dict, new: dict, config: RunConfig) -> str | None:
    """How the rows of `old`, planned by an earlier run_shards with the same settings, differ from the rows
    this version computes, in words (tasks/earlier_rows.py; other columns), or None."""
    older = earlier_rows(config.task, old["attrs"], new["attrs"])
    if older:
        return older
    if "schema" not in old or "schema" not in new:
        return None
    digest = "sequence_digest"   # (a run planned before rows kept it continues without it: the worker's check)
    was = [c for c in old["schema"] if c[0] != digest]
    now = [c for c in new["schema"] if c[0] != digest]
    if was != now:
        added = [c[0] for c in now if c not in was]
        gone = [c[0] for c in was if c not in now]
        return "with other columns: " + "; ".join(
            [f"this version adds {', '.join(added)}"] * bool(added) + [f"without {', '.join(gone)}"] * bool(gone))
    return None


def with_launch_settings(manifest: dict, values: dict, whose: str) -> dict:
    """`manifest` with the launch settings in `values` (RunConfig field -> value); those that differ from
    the run's are logged, naming their options."""
    config = RunConfig.from_manifest(manifest)
    changed = {k: v for k, v in values.items() if getattr(config, k) != v}
    if not changed:
        return manifest
    now = dataclasses.replace(config, **changed)
    log.info("with %s %s", whose, ", ".join(f"{option_name(k)} {_launch_value(now, k)} (was {_launch_value(config, k)})"
                                          for k in changed))
    stored = json.loads(now.to_json())
    return dict(manifest, config=stored, attrs=dict(manifest["attrs"], config=stored))


def _launch_value(config: RunConfig, name: str) -> str:
    """A launch setting's value in a log line: an unset token budget as the default it stands for."""
    if name == "max_tokens_per_batch" and config.max_tokens_per_batch is None:
        return f"default {config.tokens_per_batch}"
    return repr(getattr(config, name))


def _shown(value) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value)) if len(value) <= MANY_FILES else files_shown(value)
    return str(value)
