"""What OUT/report.html shows, gathered from the run directory, whichever launcher ran the shards (local
workers, SLURM array tasks and Ray tasks write the same files), and for a SLURM run from squeue.

Shard states come from `shard_state` (the reader `status` and `rerun` use) and rows from `h5io.Reader`; each
shard's history comes from its events (OUT/logs/events_N.jsonl: every attempt's start, model load,
checkpoints with their rows and tokens, end and why), the commands' from OUT/logs/events.jsonl. Logs are
for people; nothing here reads them. (Runs written before events existed show no attempts.)
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import numpy as np

from ..errors import RunDirError
from ..output import shard_state, status_codes
from ..output.h5io import CorruptFile, Reader
from ..rundir import events
from ..rundir.failure import FailureRecord
from ..rundir.layout import RunDir
from ..rundir.locks import ShardLock
from .task_summary import task_words, variant_statuses

# Why a worker was asked to stop, by the signal its parent (`run`, `rerun`, `work`) received.
STOP_CAUSES = {"SIGUSR1": "the time limit was near (SLURM's warning)",
               "SIGTERM": "stopped by a SIGTERM (preemption, scancel, or by hand)",
               "SIGINT": "interrupted (Ctrl-C)", "SIGHUP": "the terminal closed (SIGHUP)"}


@dataclass
class Attempt:
    """One worker's go at a shard: from its `start` event to its last event."""
    start: float
    device: str = ""
    host: str = ""
    slurm: str = ""            # the SLURM array task that ran it (`123_4`), if one did
    restarts: int = 0          # SLURM_RESTART_COUNT: how often SLURM had requeued that task before
    resumed_from: int = 0      # rows durable when it started (0: it started the shard from nothing)
    end: float = 0.0
    loaded: float | None = None
    checkpoints: list[tuple[float, int, int | None]] = field(default_factory=list)   # (time, rows, tokens)
    completed: float | None = None
    stopped_by: str = ""       # the signal its parent received, when it was asked to stop
    outcome: str = ""          # "complete", or why it stopped

    @property
    def finished(self) -> bool:
        return self.completed is not None


@dataclass
class ShardFacts:
    rank: int
    state: str                 # as `run_shards status` says (complete, running, partial, failed, ...)
    expected: int
    durable: int
    residues: int
    tokens: int                # tokens computed for the durable rows (computed_tokens)
    attempts: list[Attempt]
    failure: FailureRecord | None   # shard_N.failed.json: why the last attempt did not finish


@dataclass
class SlurmFacts:
    """A SLURM run's jobs: every submission (jobs.json), each shard's latest task as squeue sees it, and how
    the merge jobs ended (their `ended` events)."""
    submissions: list[dict]
    tasks: dict[int, object]           # shard -> slurm_queue.Task (only those squeue still knows)
    merge_state: str                   # squeue's word on the last merge job, "" when it cannot tell
    merges: list[dict]                 # `ended` events of merge commands run as SLURM jobs
    by_hand: list[str] = field(default_factory=list)   # slurm_queue.unrecorded_lines: live jobs of the
                                       # run's scripts no submission recorded (submitted by hand)


@dataclass
class RunFacts:
    root: str
    manifest: dict
    lengths: np.ndarray        # residues of every record
    budget: int                # tokens per batch
    shards: list[ShardFacts]
    statuses: dict[int, tuple[int, list[str]]]   # status code -> (rows, the first few ids)
    rows: int                  # rows of result.h5, or durable rows so far
    result: str                # "complete", "partial" (a --allow-partial merge), or "" (no result.h5)
    timings: list[float] | None   # prepare, start and load, compute, finish and merge (the last local split)
    timings_end: float | None     # when that split was recorded: the end of the run it describes
    error: str                 # what stopped the last command ("" if it finished, or once the result is complete)
    written: str
    slurm: SlurmFacts | None = None
    task: str = ""             # the task as `status` says it (task_summary.task_words: its method, its variants)
    variant_statuses: dict[int, int] = field(default_factory=dict)   # --task variants: status -> variants in result.h5


def gather(run: RunDir, error: str | None = None, example_ids: int = 3) -> RunFacts:
    """Everything the report shows; reads files (and, for a SLURM run, squeue once), so it works mid-run
    too. `error`: what ended the command asking (by default, the error of the last command recorded)."""
    from index import SequenceIndex
    from index.sequence_index import IndexCorrupt

    from ..config import RunConfig
    manifest = run.read_manifest()
    world = manifest["world"]
    try:
        index = SequenceIndex.load(run.index_path, verify=False)   # mapped: the report reads a few pages of it
    except (OSError, IndexCorrupt) as e:
        raise RunDirError(f"cannot read the run's index {run.index_path} ({e}); the run directory is damaged") from None
    stats = index.shard_stats(world)   # sequences and residues per shard, from the length histogram
    shards, rows_by_shard = [], []
    for r in range(world):
        state = shard_state.inspect(run, lambda r=r: index.stride_shard(r, world), r, verify_shard=False,
                                    count=int(stats.sequences[r]))
        if state.state not in ("complete", "corrupt") and ShardLock(run, r).held_elsewhere():
            state.state = "running"   # as `status` says; its durable rows are those checkpointed so far
        rows = durable_rows(run, r, state.state)
        rows_by_shard.append(rows)
        history = attempts(events.read(run.events_path(r)))
        shards.append(ShardFacts(
            rank=r, state=state.state, expected=state.expected, durable=state.durable,
            residues=int(stats.tokens[r]), tokens=computed_tokens(history, rows),
            attempts=history, failure=run.failure(r)))
    result, statuses, nrows = _result_statuses(run, example_ids)
    for shard in shards if result == "complete" else []:   # (as status says)
        if shard_state.every_row_durable(shard.state, shard.durable, shard.expected):
            shard.state = "complete"
    if not result:   # no result yet: the rows the shards hold so far
        index_col = np.concatenate([x["index"] for x in rows_by_shard])
        status_col = np.concatenate([x["status"] for x in rows_by_shard])
        order = np.argsort(index_col, kind="stable")
        index_col, status_col, nrows = index_col[order], status_col[order], len(index_col)
        for code in np.unique(status_col):
            where = index_col[status_col == code]
            statuses[int(code)] = (len(where), index.ids(where[:example_ids].tolist()))
    run_events = events.read(run.run_events_path)
    timings = events.last(run_events, "timings")
    ended = events.last(run_events, "ended")
    config = RunConfig.from_manifest(manifest)
    return RunFacts(
        root=str(run.root), manifest=manifest, lengths=index.lengths, budget=config.tokens_per_batch,
        shards=shards, statuses=statuses, rows=nrows, result=result,
        timings=[timings[k] for k in ("prepare", "start_and_load", "compute", "finish_and_merge")] if timings else None,
        timings_end=timings["t"] if timings else None,
        error=error if error is not None else "" if result == "complete" else ((ended or {}).get("error") or ""),
        written=datetime.datetime.now().isoformat(sep=" ", timespec="seconds"),
        slurm=_slurm_facts(run, world, run_events) if config.launcher == "slurm" else None,
        task=task_words(run, manifest), variant_statuses=_variant_statuses(run) if config.task == "variants" else {})


def _slurm_facts(run: RunDir, world: int, run_events: list[dict]) -> SlurmFacts:
    from ..launchers.slurm_queue import Queue, unrecorded_jobs, unrecorded_lines
    queue = Queue.read(run, world)
    tasks = {r: t for r in range(world) if (t := queue.task_of(r)) is not None}
    merges = [e for e in run_events if e["event"] == "ended" and e.get("command") == "merge" and e.get("slurm_job")]
    merge = queue.merge
    hand = unrecorded_jobs(run, queue.subs) if not run.result_path.exists() else None
    return SlurmFacts(queue.subs, tasks, merge.words() if merge is not None else "", merges,
                      unrecorded_lines(run, hand) if hand else [])


def computed_tokens(history: list[Attempt], rows: dict[str, np.ndarray]) -> int:
    """Tokens the engine computed for a shard's durable `rows` (durable_rows), as the run log counts them: a
    pseudo-log-likelihood's masked copies too. Those are in the checkpoint events since the shard last started
    from nothing, where those events account for exactly the durable rows; else (a damaged checkpoint dropped,
    events lost) the rows' own tokens, the same count for tasks that run each row once."""
    starts = [i for i, a in enumerate(history) if a.resumed_from == 0]
    since = [c for a in history[starts[-1]:] for c in a.checkpoints] if starts else []
    if since and all(tokens is not None for *_, tokens in since) and sum(n for _, n, _ in since) == len(rows["index"]):
        return sum(tokens for *_, tokens in since)
    return int(rows["num_tokens"].sum(dtype=np.int64))


def durable_rows(run: RunDir, rank: int, state: str) -> dict[str, np.ndarray]:
    """`index`, `status` and `num_tokens` of the rows shard `rank` holds: its finished file, else its intact
    checkpoints (a damaged file counts for nothing, as in `status`)."""
    if state == "complete":
        files = [run.shard_path(rank)]
    else:
        files = shard_state.part_files(run.parts_dir(rank))
    found = {"index": [np.zeros(0, np.int64)], "status": [np.zeros(0, np.int8)], "num_tokens": [np.zeros(0, np.int32)]}
    for path in files:
        try:
            with Reader(path) as r:
                for name, parts in found.items():
                    parts.append(r.file[name][:])
        except (CorruptFile, OSError, KeyError):
            continue   # as `status` counts it: a damaged or vanished checkpoint holds no rows
    return {name: np.concatenate(parts) for name, parts in found.items()}


def _result_statuses(run: RunDir, example_ids: int) -> tuple[str, dict, int]:
    if not run.result_path.exists():
        return "", {}, 0
    try:
        with Reader(run.result_path) as r:
            status, complete = r.file["status"][:], bool(r.attrs.get("complete"))
            statuses = {}
            for code in np.unique(status):
                where = np.flatnonzero(status == code)[:example_ids]
                statuses[int(code)] = (int((status == code).sum()),
                                       [x.decode() if isinstance(x, bytes) else str(x) for x in r.file["ids"][where]])
            return ("complete" if complete else "partial"), statuses, len(status)
    except CorruptFile:
        return "", {}, 0   # the shards' rows stand in; `status` and `merge` name the damage


def _variant_statuses(run: RunDir) -> dict[int, int]:
    if not run.result_path.exists():
        return {}
    try:
        with Reader(run.result_path) as r:
            return variant_statuses(r)
    except CorruptFile:
        return {}   # as for the rows: `status` and `merge` name the damage


# Rows by their status (status_codes.py) as `status` and the end of a run name them: what they hold, and
# whether to warn (False: an option asked for them).
ROW_STATUSES = {
    status_codes.UNKNOWN_RESIDUES: ("with characters outside the model's alphabet (status {code}, computed with its "
                                    "unknown token)", True),
    status_codes.SKIPPED_TOO_LONG: ("without values (status {code}: longer than the model's limit, skipped under "
                                    "--on-long skip)", False),
    status_codes.EMPTY: ("without values (status {code}: empty records kept under --skip-empty)", False),
    status_codes.OUT_OF_MEMORY: ("without values (status {code}: out of device memory even as a batch of one; the "
                                 "worker logs name them with their lengths)", True),
}


def row_status_lines(run: RunDir, example_ids: int = 3) -> list[tuple[bool, str]]:
    """(warn, line) for each status of the result's rows other than ok, with example ids: rows with unknown
    characters, rows kept without values. [] when every row is ok or there is no result."""
    _, statuses, _ = _result_statuses(run, example_ids)
    return [(ROW_STATUSES[code][1], f"{count:,} row(s) {ROW_STATUSES[code][0].format(code=code)}, e.g. "
                                    f"{', '.join(repr(i) for i in ids)}")
            for code, (count, ids) in sorted(statuses.items()) if code in ROW_STATUSES]


def attempts(shard_events: list[dict]) -> list[Attempt]:
    """Every attempt a shard's events record, oldest first: each `start` opens one, and its `loaded`,
    `checkpoint`, `stop` and `end` events (the worker's, or its parent's for a worker that was killed) fill it."""
    found: list[Attempt] = []
    for e in shard_events:
        kind, t = e["event"], e["t"]
        if kind == "start":
            found.append(Attempt(start=t, end=t, device=e.get("device", ""), host=e.get("host", ""),
                                 slurm=e.get("slurm", ""), restarts=int(e.get("restarts") or 0),
                                 resumed_from=int(e.get("durable") or 0)))
            continue
        if not found:
            continue
        a = found[-1]
        a.end = max(a.end, t)
        if kind == "loaded":
            a.loaded = t
        elif kind == "checkpoint":
            a.checkpoints.append((t, int(e["rows"]), e.get("tokens")))
        elif kind == "stop":
            a.stopped_by = a.stopped_by or e.get("signal", "")
        elif kind == "end" and not a.outcome:
            a.outcome = _outcome(e, a)
            a.completed = t if e.get("code") == 0 else None
    for a in found:
        a.outcome = a.outcome or "no end recorded: still running, or stopped without a trace"
    return found


def _outcome(end: dict, a: Attempt) -> str:
    if end.get("code") == 0:
        return "complete"
    words = end.get("explanation") or f"exit code {end.get('code')}"
    if a.stopped_by:
        words = f"{words}: {STOP_CAUSES.get(a.stopped_by, a.stopped_by)}"
    reason = end.get("reason") or ""
    return f"{words} - {reason}" if reason and reason not in words else words
