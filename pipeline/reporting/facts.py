"""What OUT/report.html shows, gathered from the run directory alone, whichever launcher ran the shards
(local workers, SLURM array tasks and Ray tasks write the same files).

Shard states come from `shard_state` (the reader `status` and `rerun` use) and rows from `h5io.Reader`;
each worker's history comes from its own log, the one record every launcher keeps: every attempt's start,
model load, checkpoints (rows and tokens, which give throughput over time), end and why it ended.
"""
from __future__ import annotations

import datetime
import re
from dataclasses import dataclass, field

import numpy as np

from ..output import shard_state
from ..output.h5io import CorruptFile, Reader
from ..errors import RunDirError
from ..rundir.layout import RunDir, RunLock

# Worker log lines (written by worker/shard_run.py, output/shard_writer.py and launchers/supervisor.py for a killed worker):
# "2026-11-24 05:42:14,675 INFO pipeline.output.shard_writer: checkpoint part_000000.h5: 22 rows, 6600 tokens (...)"
_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:,(\d{3}))? (\w+) (\S+(?: \(parent\))?): (.*)$")
_STARTED = re.compile(r"worker for shard \d+ started \(pid \d+, ([^,]+),")
_LOADED = re.compile(r"model loaded on ")
_CHECKPOINT = re.compile(r"checkpoint part_\d+\.h5: (\d+) rows(?:, (\d+) tokens)? \((\d+) of \d+ durable\)")
_COMPLETE = re.compile(r"shard complete: ")
_EXITS = re.compile(r"worker for shard \d+ exits with code (-?\d+)")
_ENDED = re.compile(r"the worker \(pid \d+\) ended: (.*)")
_INTERRUPTED = re.compile(r"interrupted \((.*?)\): ")
# run.log: the parent's time split (runner.py) and its final failure report (the lines after "error:").
_TIMINGS_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) INFO timings: prepare ([\d.]+) s, "
                           r"start workers and load model ([\d.]+) s, compute ([\d.]+) s, "
                           r"finish shards and merge ([\d.]+) s", re.M)
_ERROR = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ERROR error: ", re.M)
_STAMPED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", re.M)


@dataclass
class Attempt:
    """One worker's go at a shard: from its start line to its last line."""
    start: float
    device: str = ""
    end: float = 0.0
    loaded: float | None = None
    checkpoints: list[tuple[float, int, int | None]] = field(default_factory=list)   # (time, rows, tokens)
    completed: float | None = None
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
    tokens: int                # tokens of the durable rows
    attempts: list[Attempt]
    failure: dict | None       # shard_N.failed.json: why the last attempt did not finish


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
    timings: list[float] | None   # prepare, start and load, compute, finish and merge (run.log's last)
    timings_end: float | None     # when that line was written: the end of the run it describes
    error: str                 # the last failure report in run.log ("" if none since the last result)
    written: str


def gather(run: RunDir, error: str | None = None, example_ids: int = 3) -> RunFacts:
    """Everything the report shows; reads files only (never a scheduler), so it works mid-run too.
    `error`: what ended the command asking (by default the last failure report in run.log)."""
    from index import SequenceIndex
    from index.sequence_index import IndexCorrupt

    from ..config import RunConfig
    manifest = run.read_manifest()
    world = manifest["world"]
    try:
        index = SequenceIndex.load(run.index_path)
    except (OSError, IndexCorrupt) as e:
        raise RunDirError(f"cannot read the run's index {run.index_path} ({e}); the run directory is damaged") from None
    shards, rows_by_shard = [], []
    for r in range(world):
        positions = index.stride_shard(r, world)
        state = shard_state.inspect(run, positions, r, verify_shard=False)
        if state.state not in ("complete", "corrupt") and RunLock.shard_running(run, r):
            state.state = "running"   # as `status` says; its durable rows are those checkpointed so far
        rows = durable_rows(run, r, state.state)
        rows_by_shard.append(rows)
        shards.append(ShardFacts(
            rank=r, state=state.state, expected=state.expected, durable=state.durable,
            residues=int(index.lengths[positions].sum(dtype=np.int64)),
            tokens=int(rows["num_tokens"].sum(dtype=np.int64)),
            attempts=attempts(run.worker_log(r)), failure=run.failure(r)))
    result, statuses, nrows = _result_statuses(run, example_ids)
    if not result:   # no result yet: the rows the shards hold so far
        index_col = np.concatenate([x["index"] for x in rows_by_shard])
        status_col = np.concatenate([x["status"] for x in rows_by_shard])
        order = np.argsort(index_col, kind="stable")
        index_col, status_col, nrows = index_col[order], status_col[order], len(index_col)
        for code in np.unique(status_col):
            where = index_col[status_col == code]
            statuses[int(code)] = (len(where), index.ids(where[:example_ids].tolist()))
    run_log = run.parent_log.read_text(errors="replace") if run.parent_log.exists() else ""
    timings = list(_TIMINGS_LINE.finditer(run_log))
    config = RunConfig.from_manifest(manifest)
    return RunFacts(
        root=str(run.root), manifest=manifest, lengths=index.lengths, budget=config.tokens_per_batch,
        shards=shards, statuses=statuses, rows=nrows, result=result,
        timings=[float(x) for x in timings[-1].groups()[2:]] if timings else None,
        timings_end=_time(timings[-1][1], timings[-1][2]) if timings else None,
        error=error if error is not None else "" if result == "complete" else last_error(run_log),
        written=datetime.datetime.now().isoformat(sep=" ", timespec="seconds"))


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
            continue
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


def unknown_residues_line(run: RunDir, example_ids: int = 3) -> str:
    """How many rows of the result hold characters outside the model's alphabet (status 2), with example ids;
    "" when none (for the end of a run and `status`)."""
    from ..output.status_codes import UNKNOWN_RESIDUES
    _, statuses, _ = _result_statuses(run, example_ids)
    count, ids = statuses.get(UNKNOWN_RESIDUES, (0, []))
    if not count:
        return ""
    return (f"{count:,} row(s) with characters outside the model's alphabet (status {UNKNOWN_RESIDUES}, computed "
            f"with its unknown token), e.g. {', '.join(repr(i) for i in ids)}")


def _time(stamp: str, millis: str | None) -> float:
    when = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S")
    return when.timestamp() + int(millis or 0) / 1000


def attempts(log_path) -> list[Attempt]:
    """Every attempt recorded in a worker log, oldest first (one that found its shard already complete is
    left out: it did no work)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return []
    found: list[Attempt] = []
    current: Attempt | None = None
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        t, level, message = _time(m[1], m[2]), m[3], m[5]
        started = _STARTED.match(message)
        if started:
            current = Attempt(start=t, device=started[1], end=t)
            found.append(current)
            continue
        if current is None:
            continue
        current.end = max(current.end, t)
        if _LOADED.match(message):
            current.loaded = t
        elif (c := _CHECKPOINT.match(message)):
            current.checkpoints.append((t, int(c[1]), int(c[2]) if c[2] else None))
        elif _COMPLETE.match(message):
            current.completed, current.outcome = t, "complete"
        elif message.endswith("is already complete"):
            found.remove(current)
            current = None
        elif (e := _ENDED.match(message)):
            current.outcome = e[1]
        elif (i := _INTERRUPTED.match(message)):
            current.outcome = current.outcome or f"interrupted: {i[1]}"
        elif level in ("ERROR", "CRITICAL") and not current.finished:
            current.outcome = current.outcome or message
        elif (x := _EXITS.match(message)) and not current.outcome:
            current.outcome = "complete" if x[1] == "0" else f"exit code {x[1]}"
    for a in found:
        a.outcome = a.outcome or "no end recorded: still running, or stopped without a trace"
    return found


def last_error(run_log: str) -> str:
    """The last failure report in run.log: its "error:" line and the lines after it, up to the next
    timestamped line (they name the failed shards and the command that continues)."""
    starts = list(_ERROR.finditer(run_log))
    if not starts:
        return ""
    body = run_log[starts[-1].end():]
    end = _STAMPED.search(body)
    return (body[:end.start()] if end else body).rstrip()
