"""The run's own index, as later commands reopen it: checked against the FASTA files as they are now, with
both ways out when they changed (restore them and `rerun`, or start a new run on them as they are), and built
again from them when it was deleted by hand or damaged (as its copy plan, copies.py, is from it)."""
from __future__ import annotations

import logging
from pathlib import Path

from index import IndexCorrupt, SequenceIndex, load_or_build, records_changed

from ..advice import MANY_FILES, command, files_shown
from ..config import RunConfig
from ..errors import RunDirError, UserError
from ..rundir.layout import RunDir, free_out
from .copies import Copies, file_problem, plan_problem, rebuild_plan
from .copies import rebuildable as plan_rebuildable
from .input_policies import apply_input_policies

log = logging.getLogger("run_shards")


def start_over_advice(run: RunDir, manifest: dict) -> str:
    """Advice when a run's inputs changed: both ways out, each with a command that works (a new run on a FASTA
    that is gone cannot be named: its new place is the user's to give)."""
    config = RunConfig.from_manifest(manifest)
    gone = [f for f in config.fasta if not Path(f).exists()]
    if gone:
        named = ", ".join(gone) if len(gone) <= MANY_FILES else files_shown(gone)   # (3,000 paths: a 100 KB line)
        return (f"Put {named} back where {'it was' if len(gone) == 1 else 'they were'} (moved or renamed, "
                f"the run no longer finds {'it' if len(gone) == 1 else 'them'}) and run `{command('rerun', run.root)}` "
                "again, or start a new run on the file where it is now, with another --out.")
    return (f"Restore the original file and run `{command('rerun', run.root)}` again, or start a new run on the "
            f"file as it is now: `{config.as_command(free_out(run.root))}`.")


def load_run_index(run: RunDir, manifest: dict, refresh_copies: bool = False, verify: bool = True,
                   progress: bool = True) -> SequenceIndex:
    """The run's index (memory-mapped), after checking that the FASTA files still match it (refusing with
    what changed). `refresh_copies` (only where no worker of the run can be reading them, under the run's
    lock): decompress again the .gz inputs that changed, so a restored .gz lets the run continue, and build
    the index and the copy plan again where they were deleted or damaged. `verify`: read the whole file (and the
    copy plan) for its checksum first (array tasks, which read a few pages of it, do not; nor `status` of a run
    too large to read back quickly). `progress`: a bar while a .gz is decompressed again."""
    try:
        index = SequenceIndex.load(run.index_path, verify=verify)
    except (FileNotFoundError, IndexCorrupt) as e:
        problem = file_problem(run.index_path, e)
        if not (refresh_copies and _rebuildable(run, manifest)):
            raise RunDirError(missing_index(run, manifest, problem)) from None
        _rebuild(run, manifest, progress, problem)   # (the very index planned, or a refusal saying why)
        index = SequenceIndex.load(run.index_path, verify=verify)
    except OSError as e:
        raise RunDirError(f"cannot read the run's index {run.index_path} ({e.strerror or e}); check the file "
                          "system, then run the same command again") from None
    if refresh_copies:
        from index.compressed import refresh
        refresh([f.path for f in index.inputs], progress)
    changed = records_changed(index)
    if not changed:   # a .gz whose decompressed copy the run reads
        from index.compressed import source_changes
        changed = "; ".join(source_changes([f.path for f in index.inputs])) or None
    if changed:
        index.close()
        raise UserError(f"the input FASTA no longer matches this run ({changed}). {start_over_advice(run, manifest)}")
    if refresh_copies and (problem := plan_problem(run, manifest, verify=verify)):
        try:
            rebuild_plan(run, manifest, index, problem)
        except BaseException:
            index.close()
            raise
    return index


def missing_index(run: RunDir, manifest: dict, problem: str = "missing") -> str:
    """What to do when the run's index file is gone (deleted or moved by hand), or `problem` (damaged: a full
    disk, a bad copy)."""
    gone = _gone(run, problem)
    if _rebuildable(run, manifest):
        return (f"{gone}; `{command('rerun', run.root)}` builds it again from the FASTA and continues the run "
                "(its shards are kept)" + (f", unless {_EARLIER_INDEX}: then restore {run.index_path.name} from where "
                                          "it went" if _planned_before_identity(manifest) else ""))
    return (f"{gone}, and so is {run.copies_path}, which says which of its records are copied instead of "
            f"computed: restore both from where they went, then run `{command('rerun', run.root)}`; or start a new "
            f"run: `{RunConfig.from_manifest(manifest).as_command(free_out(run.root))}`")


# A run planned before 2026-11-27 (no settings recorded as they resolved) may have its index fingerprinted the way
# an earlier run_shards did (over fewer arrays): an index built again by this version cannot match it.
_EARLIER_INDEX = "the run_shards that planned it (one from before 2026-11-27) fingerprinted its index another way"


def _planned_before_identity(manifest: dict) -> bool:
    return "resolved" not in (manifest.get("attrs") or {})


def _gone(run: RunDir, problem: str = "missing") -> str:
    return f"the run's index {run.index_path} is {problem}" + (" (deleted or moved)" if problem == "missing" else "")


def index_problem(run: RunDir) -> str | None:
    """What is wrong with the run's index ("missing", "damaged (why)"), or None where it opens (its checksum is
    not read: a command that reads it whole finds a damage this does not)."""
    try:
        SequenceIndex.load(run.index_path, verify=False).close()
    except (FileNotFoundError, IndexCorrupt) as e:
        return file_problem(run.index_path, e)
    return None


def _rebuildable(run: RunDir, manifest: dict) -> bool:
    """Whether the index can be built again: every record computed, or the copy plan still there and readable,
    or the plan itself can be built again from the index (copies.rebuild_plan)."""
    counts = (manifest.get("copies") or {}).get("counts")
    return (counts is None or counts["computed"] == counts["records"] or plan_rebuildable(manifest)
            or not plan_problem(run, manifest))   # (the manifest first: a plan's checksum reads it whole)


def _rebuild(run: RunDir, manifest: dict, progress: bool = True, problem: str = "missing") -> None:
    """The run's index built again from its FASTA files as planning built it (the same input policies and
    stride table), kept only where it is the very index the run was planned with (its fingerprint): it replaces
    a damaged one (`problem`) atomically."""
    config = RunConfig.from_manifest(manifest)
    index = None
    try:
        built, _ = load_or_build(config.fasta, progress=progress)
    except (OSError, UserError) as e:
        raise RunDirError(f"{_gone(run, problem)}, and it cannot be built again from the "
                          f"FASTA ({e}). {start_over_advice(run, manifest)}") from None
    try:
        index = apply_input_policies(built, config)
        if index.fingerprint() != manifest["index"]["fingerprint"]:
            if _planned_before_identity(manifest):
                raise UserError(f"{_gone(run, problem)}, and the index built again from the "
                                f"FASTA differs from the one the run was planned with: the FASTA changed since, or "
                                f"{_EARLIER_INDEX}. Restore {run.index_path.name} from where it went (or "
                                f"the FASTA as it was) and run `{command('rerun', run.root)}` again, or start a new "
                                f"run: `{RunConfig.from_manifest(manifest).as_command(free_out(run.root))}`")
            raise UserError(f"{_gone(run, problem)}, and the input FASTA no longer matches "
                            f"this run (its index built again differs). {start_over_advice(run, manifest)}")
        if plan_damage := plan_problem(run, manifest):   # (both lost: the plan first, for the stride table)
            rebuild_plan(run, manifest, index, plan_damage, stride_table_lost=True)
        save_again(run, manifest, index, problem)
    finally:
        built.close()
        if index is not None and index is not built:
            index.close()


def save_again(run: RunDir, manifest: dict, index: SequenceIndex, problem: str = "missing") -> None:
    """Write a run's deleted or damaged (`problem`) index again from `index`, the one it was planned with (the
    caller checked), with the stride table its workers read (of the records it computes, by its copy plan)."""
    if not _rebuildable(run, manifest):
        raise RunDirError(missing_index(run, manifest, problem))
    only, plan = Copies((manifest.get("copies") or {}).get("counts")).only(run)
    try:
        index.save(run.index_path, world=manifest["world"], only=only)
    finally:
        if plan is not None:
            plan.close()
    log.warning("the run's index %s was %s: built again from the FASTA", run.index_path, problem)
