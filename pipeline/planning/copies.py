"""Never computing a sequence twice (#28): when a new run is planned, every record's sequence digest is
taken from the FASTA (index/residue_digest.py), and the records are matched by digest, among themselves
and against the rows of the `--reuse` results. Only the first record of each sequence that no earlier
result holds goes to a shard; the merge copies the others (output/copy_plan.py says how, and
output/result_rows.py does it), checking each row against the digest planned for its position.

The matching has bounded memory: digests are bucketed on disk by their top bits (index/spill.py), each
bucket sorted on its own; what each record gets is scattered back to FASTA order, and the copies are
sorted by the row they copy. A run whose rows may depend on more than the sequence copies nothing.
"""
from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from index import IndexCorrupt
from index.build import Column
from index.residue_digest import record_digests
from index.spill import HashBuckets, KeyedPairs, Scatter
from index.stride import Only

from ..advice import command
from ..config import RunConfig
from ..errors import RunDirError, UserError
from ..models.conventions import PLAIN, Convention
from ..output import copy_plan
from ..output.copy_plan import COMPUTED, DUPLICATE, CopyPlan, SourceFile
from ..output.h5io import Reader
from ..rundir.layout import RunDir, free_out
from .reuse import not_by_sequence, reuse_sources, usable_rows

log = logging.getLogger("run_shards")

_WINDOW = 1 << 21      # digests per bucket (about 56 MiB sorted at once)
_READ = 1 << 20        # rows of a reused result read at once
_SOURCE = np.dtype([("source", "<i2"), ("ref", "<i8")])


@dataclass
class Copies:
    """What a run copies: its counts (None: nothing, every record is computed) and reused results."""
    counts: dict | None = None
    sources: list[SourceFile] = field(default_factory=list)
    pending: Path | None = None   # a new run's copies.rsidx until the plan is recorded (in a .rs-copies-* folder)

    def place(self, run: RunDir) -> None:
        """Move a new run's plan into OUT (when the run's plan is recorded: planning writes nothing there)."""
        if self.pending is not None:
            shutil.move(str(self.pending), str(run.copies_path))
            self.discard()

    def discard(self) -> None:
        """Remove a plan that was never recorded (the run was refused after matching)."""
        if self.pending is not None:
            shutil.rmtree(self.pending.parent, ignore_errors=True)
            self.pending = None

    @property
    def computed(self) -> int | None:
        return None if self.counts is None else self.counts["computed"]

    def record(self) -> dict | None:
        """What the manifest keeps of it (`copy_plan.described` reads it back), with each reused result as it
        was planned (`files`), from which a lost plan is built again (`rebuild_plan`)."""
        if self.counts is None:
            return None
        return {"counts": self.counts, "sources": [s.given for s in self.sources],
                "files": [asdict(s) for s in self.sources]}

    def shards(self, wanted: int) -> int:
        """At most one shard per computed record (at least one)."""
        return wanted if self.counts is None else max(1, min(wanted, self.counts["computed"]))

    def only(self, run: RunDir) -> tuple[Only | None, CopyPlan | None]:
        """The records the run's shards hold (for its stride table) and the plan they come from (the caller
        closes it), or (None, None) when it computes every record."""
        if self.counts is None or self.counts["computed"] == self.counts["records"]:
            return None, None
        plan = CopyPlan(run.copies_path)

        def kept(positions: np.ndarray) -> np.ndarray:
            found = np.asarray(plan.source[positions]) == COMPUTED
            plan.release()
            return found
        return Only(self.counts["computed"], kept), plan


def plan_copies(config: RunConfig, model, schema, index, run: RunDir, old: dict | None, resolved: dict,
                task_attrs: dict) -> Copies:
    """For a new run: check `config.reuse` (against this run's settings as they `resolved`: run_identity.py, and
    its task's attributes `task_attrs`),
    match every record and write OUT/copies.rsidx. For a run planned before: what it copies, as planned (a
    --reuse that differs is refused)."""
    if old is not None:
        planned = RunConfig.from_manifest(old).reuse
        if config.reuse and config.reuse != planned:
            raise UserError(f"--reuse: {run.root} holds a run planned with "
                            f"{' '.join('--reuse ' + r for r in planned) or 'no --reuse'}; which rows it copies was "
                            "fixed then. Leave out --reuse to continue it, or start a run in another directory.")
        check_plan(run, old)
        if not run.copies_path.exists():   # (planned before runs copied rows)
            return Copies()
        plan = CopyPlan(run.copies_path)
        try:
            return Copies(dict(plan.counts), plan.sources)
        finally:
            plan.close()
    sources = reuse_sources(config, model, schema, resolved, task_attrs)   # (refuses --reuse where rows are not by sequence)
    if not_by_sequence(config):
        return Copies()
    counts, pending = _match(run, index, sources, model.convention.keeps_case)
    log.info("copies: %s", copy_plan.summary(counts, [s.given for s in sources], planned=True))
    return Copies(counts, sources, pending)


def plan_problem(run: RunDir, manifest: dict, verify: bool = True) -> str | None:
    """What is wrong with the run's copy plan where its manifest says it has one ("missing", "damaged (why)"),
    or None where it opens and, with `verify`, every byte reads back as written (its checksum: 26 bytes a
    record, a fraction of what the index holds)."""
    if not manifest.get("copies"):
        return None
    try:
        CopyPlan(run.copies_path, verify=verify).close()
    except (FileNotFoundError, IndexCorrupt) as e:
        return file_problem(run.copies_path, e)
    return None


def file_problem(path: Path, error: Exception) -> str:
    """A run file that failed to open (FileNotFoundError or IndexCorrupt), in words: "missing", "damaged (why)"."""
    if isinstance(error, FileNotFoundError):
        return "missing"
    return f"damaged ({str(error).removeprefix(f'{path}: ')})"


def check_plan(run: RunDir, manifest: dict) -> None:
    """Refuse (RunDirError, saying what to do) where the run's copy plan is missing or damaged (its checksum
    read)."""
    problem = plan_problem(run, manifest)
    if problem:
        raise RunDirError(plan_advice(run, manifest, problem))


def plan_advice(run: RunDir, manifest: dict, problem: str) -> str:
    """What to do when the run's copy plan is missing or damaged (`problem`): `rerun` builds it again (the rows
    computed so far are kept), except where a result it reuses rows of changed since (that file named), or the
    run was planned by a run_shards that kept those results' files in the plan alone (before 2026-12-07)."""
    said = f"the run's copy plan {run.copies_path} is {problem}"
    if not rebuildable(manifest):
        return (f"{said}, and only it records the results this run reuses rows of (--reuse) as they were planned: "
                f"{_restore_or_start_over(run, manifest)}")
    changed = [f"--reuse {s.given}: {why}" for s in _reused(manifest) if (why := s.problem())]
    if changed:
        return (f"{said}, and it cannot be built again: {'; '.join(changed)}. Put the file back as it was when the "
                f"run was planned and run `{command('rerun', run.root)}`, or restore {run.copies_path.name}; or "
                f"start a new run: `{RunConfig.from_manifest(manifest).as_command(free_out(run.root))}`")
    return f"{said}; `{command('rerun', run.root)}` builds it again and continues the run (its shards are kept)"


def rebuildable(manifest: dict) -> bool:
    """Whether a lost copy plan can be built again: it reuses no earlier result, or the manifest records the
    results it reuses as they were planned."""
    copies = manifest.get("copies") or {}
    return not copies.get("sources") or "files" in copies


def _reused(manifest: dict) -> list[SourceFile]:
    """The results a run reuses rows of, as its manifest records them when they were planned."""
    return [SourceFile(**f) for f in (manifest.get("copies") or {}).get("files", [])]


def _restore_or_start_over(run: RunDir, manifest: dict) -> str:
    return (f"restore {run.copies_path.name} from where it went (or a copy), then run "
            f"`{command('rerun', run.root)}`; or start a new run: "
            f"`{RunConfig.from_manifest(manifest).as_command(free_out(run.root))}`")


def rebuild_plan(run: RunDir, manifest: dict, index, problem: str, stride_table_lost: bool = False) -> None:
    """Write the run's missing or damaged (`problem`) copy plan again from `index`, the run's own (checked
    against the FASTA), matched as planning did, kept only where it copies exactly the records its shards leave
    out (their stride table) and counts as the manifest does; it replaces a damaged one atomically.
    `stride_table_lost`: the run's index is being built again too (`index` is the FASTA's, its fingerprint the
    planned one), so its stride table comes from this plan: the counts are the check. A run that reuses
    earlier results matches them as the manifest records them, each checked to be the result planned."""
    sources = _reused(manifest)
    if not rebuildable(manifest) or any(s.problem() for s in sources):
        raise RunDirError(plan_advice(run, manifest, problem))
    convention = Convention.from_json(manifest["input_format"]) if "input_format" in manifest else PLAIN
    counts, pending = _match(run, index, sources, convention.keeps_case)
    copies = Copies(counts, pending=pending)
    plan = CopyPlan(pending)
    try:
        computed = np.flatnonzero(np.asarray(plan.source) == COMPUTED)
    finally:
        plan.close()
    same = counts == manifest["copies"]["counts"]
    if same and not stride_table_lost:
        world = manifest["world"]
        same = np.array_equal(computed, np.sort(np.concatenate([index.stride_shard(r, world) for r in range(world)])))
    if not same:
        copies.discard()
        raise RunDirError(f"the run's copy plan {run.copies_path} is {problem}, and the plan built again from its "
                          f"index differs from the one the run was planned with: "
                          f"{_restore_or_start_over(run, manifest)}")
    copies.place(run)
    log.warning("the run's copy plan %s was %s: built again from its index", run.copies_path, problem)


def _match(run: RunDir, index, sources: list[SourceFile], keep_case: bool) -> tuple[dict, Path]:
    """The counts, and the plan written in a new `.rs-copies-*` folder (in OUT, or beside it while OUT does not
    exist yet) with the spill files, which are removed here; a killed command's folder the next one removes.
    `keep_case`: the input convention reads the text's case (structure input), so the digests keep it too."""
    n = len(index)
    where = next((d for d in (run.root, run.root.parent) if d.is_dir()), Path(tempfile.gettempdir()))
    folder = Path(tempfile.mkdtemp(prefix=".rs-copies-", dir=where))
    tmp = str(folder / "spill")
    Path(tmp).mkdir()
    try:
        digests = Column(tmp, "digests", "V16")
        total = n + sum(s.rows for s in sources)
        buckets = HashBuckets(total, tmp, window=_WINDOW, payload=[("lo", "<u8"), ("src", "<i4")])
        at = 0
        for chunk in record_digests(index, keep_case=keep_case):   # this run's records (src -1)
            digests.append(chunk.view("V16").reshape(-1))
            _add(buckets, chunk, np.arange(at, at + len(chunk), dtype=np.int64), -1)
            at += len(chunk)
        for k, s in enumerate(sources):        # the rows of each result that may be reused (src k)
            with Reader(s.path, cache_bytes=0) as reader:
                for a in range(0, reader.rows, _READ):
                    found, rows = usable_rows(reader, a, min(reader.rows, a + _READ))
                    _add(buckets, found, rows, k)
        place = Scatter(n, _SOURCE, tmp, window=1 << 22)
        dups = KeyedPairs(n, n, tmp)
        reused = [KeyedPairs(s.rows, min(n, s.rows), tmp) for s in sources]
        counts = {"records": n, "computed": 0, "duplicates": 0, "reused": [0] * len(sources)}
        for rec in buckets.records():
            _match_bucket(rec, place, dups, reused, counts)
        parts = [digests.part("digests")] + _placed(place, tmp) + _pairs(dups, tmp, "duplicates", ("first", "copy"))
        for k, pairs in enumerate(reused):
            parts += _pairs(pairs, tmp, f"reused_{k}", ("row", "position"))
        copy_plan.write(folder / run.copies_path.name, n, parts, sources, counts)
        return counts, folder / run.copies_path.name
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _add(buckets: HashBuckets, digests: np.ndarray, where: np.ndarray, src: int) -> None:
    """Digests ([k, 16] uint8) with their positions (src -1) or rows (src k), bucketed by their first 8 bytes."""
    words = np.ascontiguousarray(digests).view("<u8").reshape(-1, 2)
    buckets.add(words[:, 0], where, lo=words[:, 1], src=np.full(len(where), src, np.int32))


def _match_bucket(rec: np.ndarray, place: Scatter, dups: KeyedPairs, reused: list[KeyedPairs], counts: dict) -> None:
    """The records of one bucket: in each group of equal digests, this run's first record is computed or
    reused (from the first --reuse result that has it, its first such row), the run's later records copy it."""
    rec = rec[np.lexsort((rec["pos"], rec["src"], rec["lo"], rec["key"]))]   # this run's (src -1) first
    new_group = np.ones(len(rec), bool)
    new_group[1:] = (rec["key"][1:] != rec["key"][:-1]) | (rec["lo"][1:] != rec["lo"][:-1])
    starts = np.flatnonzero(new_group)
    ends = np.append(starts[1:], len(rec))
    mine = rec["src"] == -1
    n_mine = np.add.reduceat(mine.astype(np.int64), starts) if len(starts) else np.zeros(0, np.int64)
    starts, ends, n_mine = starts[n_mine > 0], ends[n_mine > 0], n_mine[n_mine > 0]   # groups with records of this run
    first = rec["pos"][starts]
    has_old = starts + n_mine < ends              # the best earlier row follows this run's records
    old_at = (starts + n_mine)[has_old]
    source = np.full(len(starts), COMPUTED, np.int16)
    ref = np.full(len(starts), -1, np.int64)
    source[has_old], ref[has_old] = rec["src"][old_at], rec["pos"][old_at]
    for k, pairs in enumerate(reused):
        chosen = np.flatnonzero(source == k)
        pairs.add(ref[chosen], first[chosen])
        counts["reused"][k] += len(chosen)
    counts["computed"] += int((source == COMPUTED).sum())
    later = np.flatnonzero(mine & ~new_group)     # this run's other records of each group
    group = np.searchsorted(starts, later, "right") - 1
    q, p = rec["pos"][starts[group]], rec["pos"][later]
    dups.add(q, p)
    counts["duplicates"] += len(p)
    out = np.empty(len(first) + len(p), _SOURCE)
    out["source"] = np.concatenate((source, np.full(len(p), DUPLICATE, np.int16)))
    out["ref"] = np.concatenate((ref, q))
    place.add(np.concatenate((first, p)), out)


def _placed(place: Scatter, tmp: str) -> list:
    source, ref = Column(tmp, "source", np.int16), Column(tmp, "ref", np.int64)
    for _, values, _, _ in place.chunks():
        source.append(values["source"])
        ref.append(values["ref"])
    return [source.part("source"), ref.part("ref")]


def _pairs(pairs: KeyedPairs, tmp: str, name: str, fields: tuple[str, str]) -> list:
    keys, values = Column(tmp, f"{name}_{fields[0]}", np.int64), Column(tmp, f"{name}_{fields[1]}", np.int64)
    for rec in pairs.chunks():
        keys.append(rec["key"])
        values.append(rec["value"])
    return [keys.part(f"{name}_{fields[0]}"), values.part(f"{name}_{fields[1]}")]
