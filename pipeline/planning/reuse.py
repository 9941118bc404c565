"""`--reuse OLD_OUT`: earlier results whose rows a new run copies instead of computing them, checked before
anything is computed. A result is accepted only when each of its rows is what this run would compute for
the same sequence: the same model (config.json, weights and every file its tokenizer reads, wherever the
checkpoint lies), the same task, every output-affecting setting (config.RESULT) equal as it resolved
(run_identity.py: engine, dtype, input format, token limit, score method), the same kind of device and
batch invariance, the same columns. Otherwise it is refused, each difference named; nothing is reused from it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os

import numpy as np

from ..advice import command
from ..config import RunConfig
from ..errors import UserError
from ..output import status_codes
from ..output.copy_plan import SourceFile
from ..output.h5io import CorruptFile, Reader
from ..output.result_reader import result_path
from ..output.schema import Schema
from ..rundir.layout import RunDir, free_out
from ..tasks.earlier_rows import earlier_rows
from . import run_identity

log = logging.getLogger("run_shards")


def not_by_sequence(config: RunConfig) -> str | None:
    """Why a run's rows may depend on more than each record's sequence (then nothing is copied), or None."""
    if config.task == "generate" and config.temperature > 0:
        return ("--task generate with --temperature above 0 samples each record with a random stream keyed by "
                "its FASTA position, so two records of the same sequence may get different rows")
    if config.task not in ("embed", "score", "generate"):
        return f"--task {config.task}: its rows may depend on more than the sequence"
    return None


def reuse_sources(config: RunConfig, model, schema: Schema, resolved: dict, task_attrs: dict) -> list[SourceFile]:
    """The results of `config.reuse`, each checked against this run, whose settings resolved to `resolved`
    (run_identity.py) and whose task has the attributes `task_attrs` (UserError naming every difference)."""
    if not config.reuse:
        return []
    why = not_by_sequence(config)
    if why:
        raise UserError(f"--reuse: {why}; rows are not reused for such a run (leave out --reuse)")
    found, refused, refused_given = [], [], []
    for given in config.reuse:
        try:
            path = result_path(given)   # a run directory or a result.h5
        except UserError as e:
            raise UserError(f"--reuse {given}: {e}") from None
        try:
            with Reader(path) as reader:
                problems = _differences(reader, config, model, schema, resolved, task_attrs)
                complete = bool(reader.attrs.get("complete"))
                source = SourceFile(path=str(path.resolve()), given=given, rows=reader.rows,
                                    checksums=str(reader.attrs.get("crc32")), size=path.stat().st_size,
                                    mtime_ns=path.stat().st_mtime_ns)
        except CorruptFile as e:
            raise UserError(f"--reuse {given}: {path} is not a finished, readable result ({e})") from None
        if not problems and not complete:
            completing = f"`{command('rerun', path.parent)}`" if RunDir(path.parent).exists() else "its run's rerun"
            log.warning("--reuse %s: %s is a partial result (`merge --allow-partial`): this run copies the rows it "
                        "holds now. Completing it later (%s) writes it again, and this run could then no longer "
                        "take them from it: finish this run first, or reuse it once it is complete", given, path,
                        completing)
        if problems:
            refused.append(f"--reuse {given} ({path}) is refused: its rows were computed {'; '.join(problems)}")
            refused_given.append(given)
        elif any(os.path.samefile(s.path, source.path) for s in found):
            continue   # given twice
        else:
            found.append(source)
    if refused:
        without = dataclasses.replace(config, reuse=[r for r in config.reuse if r not in refused_given])
        out = free_out(config.out) if RunDir(config.out).exists() else config.out   # (a planned run keeps its own)
        raise UserError(". ".join(refused) + ". Nothing was computed. Leave it out (or give a result computed "
                        f"with this run's model and settings): `{without.as_command(out)}`")
    return found


def _differences(reader: Reader, config: RunConfig, model, schema: Schema, resolved: dict,
                 task_attrs: dict) -> list[str]:
    """How the rows of `reader` were computed otherwise than this run would, in words. Settings are compared
    as they resolved (run_identity.py), the model by its files, wherever it lies (not by its path)."""
    from ..engine import selection as engines
    from ..models.checkpoint import identity_changes
    attrs = reader.attrs
    if "sequence_digest" not in {c.path for c in reader.schema.columns}:
        return ["before results kept a sequence digest per row (they cannot be matched by sequence)"]
    try:
        old = RunConfig.from_dict(json.loads(attrs["config"]))
        old_resolved, recorded = run_identity.of_result(attrs)
    except (KeyError, ValueError, UserError) as e:
        return [f"by a run whose settings cannot be read ({type(e).__name__}: {e})"]
    found = []
    made_with = {"fingerprint": attrs.get("model_fingerprint")}
    if "model_files" in attrs:
        made_with["files"] = json.loads(attrs["model_files"])
    else:
        log.warning("--reuse %s: written before results recorded the model's tokenizer files: only its config.json "
                    "and weights are compared%s", reader.path, "" if recorded else ", and --max-length as given")
    changes = identity_changes(made_with, {"fingerprint": model.source.fingerprint, "files": model.source.files,
                                          "path": model.source.path})
    if changes:
        found.append(f"with another model ({attrs.get('model')!r}; this run's {config.model!r}: "
                     f"{'; '.join(changes)})")
    if attrs.get("task") != config.task:
        found.append(f"with --task {attrs.get('task')} (this run: {config.task})")
    if not recorded:   # (a token limit it did not record: --max-length compared as given)
        resolved = dict(resolved, max_length=config.max_length)
    found += [f"with {option} {was} (this run: {now})" for option, was, now in
              run_identity.settings_changes(old, old_resolved, config, resolved, leave_out=("task", "model"))]
    if bool(old.devices) != config.on_gpu:
        found.append(f"on {'GPUs' if old.devices else 'CPU workers'} (this run: {'GPUs' if config.on_gpu else 'CPU workers'}), "
                     "whose kernels give other bits")
    invariant = engines.batch_invariant(model.engine, config)
    if bool(attrs.get("batch_invariant")) != invariant:
        cause = (f"this run's are not: {run_identity.why_not_invariant(model.engine, config)}" if not invariant else
                 f"the earlier run's were not: {run_identity.why_not_invariant(attrs.get('engine'), old)}")
        found.append(f"{'with' if attrs.get('batch_invariant') else 'without'} batch-invariant outputs ({cause}), "
                     "so its rows may differ in their last bits from what this run computes")
    older = earlier_rows(config.task, attrs, task_attrs)
    if older:
        found.append(older)
    if reader.schema.without_result_columns() != schema and not found:
        found.append("with other columns or dimensions")
    return found


def usable_rows(reader: Reader, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """(digests [k, 16] uint8, rows) of rows a .. b - 1 that can be reused: those with values or a final
    status; not a row that ran out of memory (another run may fit it), nor one without a digest."""
    digests = reader.file["sequence_digest"][a:b]
    status = reader.file["status"][a:b]
    good = (status != status_codes.OUT_OF_MEMORY) & digests.any(axis=1)
    return digests[good], a + np.flatnonzero(good)
