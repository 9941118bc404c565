"""The run directory: everything `status`, `rerun` and `merge` need, and nothing else.

    OUT/manifest.json          config, model identity, index fingerprint, schema, number of shards
    OUT/index.rsidx            the run's own copy of the sequence index (fixed for the run's life)
    OUT/copies.rsidx           which rows are copied instead of computed (duplicates, --reuse; output/copy_plan.py)
    OUT/shards/shard_N.h5      finished shard N (rows sorted by FASTA position)
    OUT/shards/shard_N.parts/  checkpoints of an unfinished shard N (each a sorted, finished file)
    OUT/shards/shard_N.failed.json   why shard N failed last time (exit code, last log lines)
    OUT/shards/shard_N.lock    held by the worker computing shard N (locks.py); OUT/.lock by a command
    OUT/logs/worker_N.log, OUT/logs/run.log       what the worker and the commands said, for people
    OUT/logs/events_N.jsonl, OUT/logs/events.jsonl    the same history as data (events.py)
    OUT/result.h5              the merged, validated result
    OUT/variants.npz           --task variants: the variants file as planning read and checked it
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .. import __version__
from ..advice import command
from ..errors import RunDirError
from ..processes import process_alive, process_stopped
from .failure import FailureRecord

# The spill folders commands make in OUT (`.rs-NAME-` and tempfile.mkdtemp's random suffix): index/stride.py, planning/copies.py,
# output/result.py; removed when left by a killed command.
SPILL_FOLDERS = ("stride", "merge", "copies")

log = logging.getLogger("run_shards")

MANIFEST_FORMAT = 1


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's data, or a directory's entries (a rename or a new file in it), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unwritable_reason(path: Path) -> str | None:
    """Why run_shards cannot write in the directory `path` here (gone, a read-only mount, no permission), or
    None when it can: a cluster node may lack the shared mount, or have it read-only."""
    if not path.is_dir():
        return "no such directory here (removed, or not mounted on this node)"
    if os.access(path, os.W_OK):
        return None
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError as e:
        return e.strerror or str(e)
    return "a read-only file system here" if read_only else "permission denied"


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside `path` for the block to write; when the block ends it is flushed to disk and
    renamed over `path`, and if the block raises (a full disk, Ctrl-C) it is removed: `path` is never
    half-written, and keeps its old content on any failure. A `path` that is a symbolic link is written
    where it points (the rename would put a file in place of the link, leaving the file it names as it was)."""
    path = Path(os.path.realpath(path))
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:   # a write to an open file names none: the message
            e.filename = str(path)                           # says which file could not be written
        raise
    fsync_path(path.parent)


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write `data` (text, or bytes as they are) to `path` through a temporary file (atomic_path)."""
    with atomic_path(path) as tmp, open(tmp, "wb" if isinstance(data, bytes) else "w") as fh:
        fh.write(data)


def free_out(root: Path) -> str:
    """A sibling of `root` that does not exist yet (`OUT-2`, `OUT-3`, ...), for messages that suggest one; where
    OUT's name is as long as a name may be (NAME_MAX), the end of the name gives way to the number."""
    root = Path(root)
    try:
        longest = os.pathconf(root.parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = 255
    k = 2
    while True:
        suffix = f"-{k}".encode()
        name = root.name.encode()[:longest - len(suffix)].decode(errors="ignore")   # (whole characters only)
        candidate = root.with_name(name + suffix.decode())
        if not candidate.exists():
            return str(candidate)
        k += 1


def describe_holder(holder: dict) -> str:
    """`pid 12 on n1, SLURM task 77_1, since 2026-...` (or "another process" when it left no record)."""
    if not holder.get("pid"):
        return "another process"
    slurm = f", SLURM task {holder['slurm']}" if holder.get("slurm") else ""
    purpose = f", `{holder['purpose']}`" if holder.get("purpose") else ""
    stopped = ""
    if holder.get("host") == socket.gethostname() and process_stopped(int(holder["pid"])):
        stopped = (f", STOPPED (SIGSTOP or Ctrl-Z): it does nothing until `kill -CONT {holder['pid']}` continues it "
                   f"(or `kill {holder['pid']}` ends it)")
    return f"pid {holder.get('pid')} on {holder.get('host')}{purpose}{slurm}, since {holder.get('since')}{stopped}"


def holder_lives(holder: dict) -> bool:
    """Whether the process a lock record names lives: one of this host by its pid and the start time it recorded
    (a later process with its pid is not it); one of another host is taken to (nothing here can tell)."""
    if not holder.get("pid"):
        return False
    if holder.get("host") != socket.gethostname():
        return True
    return process_alive(int(holder["pid"]), start=holder.get("start"))


@dataclass
class RunDir:
    root: Path

    def __post_init__(self):
        self.root = Path(self.root).resolve()

    manifest_path = property(lambda self: self.root / "manifest.json")
    index_path = property(lambda self: self.root / "index.rsidx")
    shards_dir = property(lambda self: self.root / "shards")
    logs_dir = property(lambda self: self.root / "logs")
    result_path = property(lambda self: self.root / "result.h5")
    problems_path = property(lambda self: self.root / "merge_problems.tsv")
    variants_path = property(lambda self: self.root / "variants.npz")
    copies_path = property(lambda self: self.root / "copies.rsidx")

    def shard_path(self, rank: int) -> Path:
        return self.shards_dir / f"shard_{rank}.h5"

    def parts_dir(self, rank: int) -> Path:
        return self.shards_dir / f"shard_{rank}.parts"

    def failed_path(self, rank: int) -> Path:
        return self.shards_dir / f"shard_{rank}.failed.json"

    def worker_log(self, rank: int) -> Path:
        return self.logs_dir / f"worker_{rank}.log"

    def events_path(self, rank: int) -> Path:
        """Shard `rank`'s structured events (rundir/events.py): every attempt's start, load, checkpoints, end."""
        return self.logs_dir / f"events_{rank}.jsonl"

    @property
    def run_events_path(self) -> Path:
        """The commands' structured events: time splits, submissions, how each command ended."""
        return self.logs_dir / "events.jsonl"

    @property
    def parent_log(self) -> Path:
        return self.logs_dir / "run.log"

    # What a run leaves in OUT before its manifest exists (it stopped before or while writing it): reusable.
    EARLY_ENTRIES = {".lock", "shards", "logs", "index.rsidx", "variants.npz", "copies.rsidx"}

    def _early_entry(self, name: str) -> bool:
        return name in self.EARLY_ENTRIES or name.startswith(("index.rsidx.tmp", ".manifest.json.tmp",
                                                              "copies.rsidx.tmp", ".rs-"))

    # The run directory's own files (besides what is under shards/ and logs/): no output option may name one.
    OWN_FILES = EARLY_ENTRIES | {"manifest.json", "result.h5", "report.html", "merge_problems.tsv"}

    def owns(self, path: str | os.PathLike) -> bool:
        """Whether `path` is one of the run directory's own files, or lies under its shards/ or logs/."""
        path = Path(os.path.realpath(path))
        if path.parent == self.root:
            return path.name in self.OWN_FILES or self._early_entry(path.name)
        return self.root in path.parents and path.relative_to(self.root).parts[0] in ("shards", "logs")

    def create(self) -> None:
        """Create the run directory, or check that an existing one is a run's (never overwrite other files)."""
        self._refuse_inside_another_run()
        if self.root.exists() and not self.root.is_dir():
            raise RunDirError(f"--out {self.root} is a file, not a directory; choose another --out")
        if self.root.is_dir() and not self.exists():
            foreign = sorted(p.name for p in self.root.iterdir() if not self._early_entry(p.name))
            if foreign:
                shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
                raise RunDirError(f"--out {self.root} already holds files that are not a run_shards run ({shown}); "
                                  "run_shards writes result.h5, manifest.json, shards/ and logs/ there, so give it "
                                  "a new or empty directory")
        for d in (self.root, self.shards_dir, self.logs_dir):
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise RunDirError(f"cannot create the output directory {d}: {e.strerror}; "
                                  "choose another --out") from None

    def gone(self) -> str | None:
        """Why this run is no longer where its command found it (the directory moved, copied and removed, or
        deleted while the run computed), or None while it is there. Nothing may be written at the old place:
        its folders made anew would hold rows no run reads."""
        if self.manifest_path.exists():
            return None
        return (f"the run directory {self.root} is gone (moved or removed while this run computed), so nothing "
                f"more is written there. Where it is now, `{command('rerun', 'DIR')}` continues it from its "
                "checkpoints")

    def restore_folders(self) -> None:
        """Make shards/ and logs/ again where they were removed (shards/ may be deleted once result.h5 is
        written): a command that computes shards puts their locks, checkpoints and logs there."""
        for d in (self.shards_dir, self.logs_dir):
            try:
                d.mkdir(exist_ok=True)
            except OSError:
                pass   # a read-only or vanished run directory: the shard's lock names the cause

    def discard_unstarted(self, remove_root: bool) -> None:
        """Undo `create` for a run that never started (refused before its manifest was written): remove what
        run_shards put there, and the directory itself when `remove_root` (this command created it)."""
        assert not self.exists(), "a run with a manifest is never discarded"
        for name in self.EARLY_ENTRIES:
            path = self.root / name
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        self.remove_stale_temporaries()
        if remove_root:
            try:
                self.root.rmdir()
            except OSError:
                pass   # something else was put there meanwhile: leave it

    # ------------------------------------------------------------------ manifest
    def exists(self) -> bool:
        return self.manifest_path.exists()

    def _refuse_inside_another_run(self) -> None:
        """An --out among another run directory's own entries (its shards/ or logs/, or a name its commands
        use, such as the `.rs-*` spill folders they remove) would be removed or replaced by that run's
        commands: refused, naming both."""
        target = Path(os.path.realpath(self.root))
        for folder in target.parents:
            other = RunDir(folder)
            if other.exists() and other.owns(target):
                entry = target.relative_to(folder).parts[0]
                raise RunDirError(f"--out {self.root} lies in the run directory {folder}, under its own {entry!r}, "
                                  "which that run's commands remove or replace; choose an --out outside it, e.g. "
                                  f"{folder.parent / (folder.name + '-' + target.name.lstrip('.'))}")

    def read_manifest(self) -> dict:
        if not self.root.is_dir():
            raise RunDirError(f"{self.root}: no such run directory")
        if not self.manifest_path.exists():
            planner = self.active_command()
            if planner:   # a run that has not written its manifest yet: indexing, checking the input and model
                raise RunDirError(f"{self.root}: a run is being planned there now ({describe_holder(planner)}); it "
                                  f"has no manifest.json until its plan is made. Once it has, "
                                  f"`{command('status', self.root)}` shows its shards")
            if any(True for _ in self.root.iterdir()) and all(self._early_entry(p.name) for p in self.root.iterdir()):
                again = self._lock_record()[0].get("again")
                raise RunDirError(f"{self.root}: a run stopped there while it was planned (killed before its "
                                  "manifest.json was written): " + (f"`{again}` starts it again" if again else
                                                                     "the `run_shards run` command that made it "
                                                                     "starts it again"))
            raise RunDirError(f"{self.root}: not a run_shards output directory (no manifest.json)")
        try:
            manifest = json.loads(self.manifest_path.read_text())
        except ValueError as e:
            raise RunDirError(f"{self.manifest_path}: unreadable ({e}); the run directory is damaged") from None
        if manifest.get("format") != MANIFEST_FORMAT:
            raise RunDirError(f"{self.manifest_path}: written by another run_shards version")
        return manifest

    def write_manifest(self, manifest: dict) -> None:
        manifest = dict(manifest, format=MANIFEST_FORMAT, software=__version__)
        write_atomic(self.manifest_path, json.dumps(manifest, indent=1, sort_keys=True))

    def _lock_record(self) -> tuple[dict, int | None]:
        """What OUT/.lock says of the command that last held it, alive or not ({} if nothing readable), and the
        lock file's inode."""
        try:
            with open(self.root / ".lock", "rb") as fh:
                record, inode = json.loads(fh.read() or b"{}"), os.fstat(fh.fileno()).st_ino
        except (OSError, ValueError):
            return {}, None
        return (record if isinstance(record, dict) else {}), inode

    def active_command(self) -> dict | None:
        """Who holds the run's lock (OUT/.lock, locks.py) now, read without locking (so `status` never gets in a
        run's way): the holder record, if its process is alive on this host or it runs on another host; else None.
        A record copied with the run directory (cp -a, rsync of a running or killed run) names the original's
        holder: its lock file is another file (inode) than the one the record was written into."""
        holder, inode = self._lock_record()
        if holder.get("inode", inode) != inode:
            return None
        return holder if holder_lives(holder) else None

    # ------------------------------------------------------------------ entries of the wrong kind
    # What run_shards keeps in OUT as a file or a folder, by name (glob patterns under shards/ and logs/).
    # (report.html is left out: a report that cannot be written is a warning, never a reason to stop)
    FILE_ENTRIES = ("manifest.json", "result.h5", "index.rsidx", "copies.rsidx", "variants.npz",
                    "merge_problems.tsv", "shards/shard_*.h5", "shards/shard_*.failed.json", "logs/run.log",
                    "logs/events.jsonl", "logs/worker_*.log", "logs/events_*.jsonl")
    FOLDER_ENTRIES = ("shards", "logs", "shards/shard_*.parts")

    def check_entry_kinds(self, ranks: list[int] | None = None) -> None:
        """Refuse (RunDirError) where one of the run's own entries is a folder where run_shards keeps a file
        (a `mkdir` by hand, a copy gone wrong), or the other way round: a command would fail on it each time,
        after computing (a merge's result renamed onto a folder, a worker's checkpoint folder a file). `ranks`:
        only those shards' entries (a cluster task's, which need not list a folder of thousands of shards)."""
        def found(pattern: str) -> list[Path]:
            if "*" not in pattern:
                return [self.root / pattern]
            if ranks is None:
                return list(self.root.glob(pattern))
            return [self.root / pattern.replace("*", str(k)) for k in ranks]
        wrong = [(p, "a folder", "file") for pattern in self.FILE_ENTRIES for p in found(pattern) if p.is_dir()]
        wrong += [(p, "not a folder", "folder") for pattern in self.FOLDER_ENTRIES for p in found(pattern)
                  if p.exists() and not p.is_dir()]
        if wrong:
            named = "; ".join(f"{p} is {what}, where run_shards keeps a {kind}" for p, what, kind in wrong)
            it = "it" if len(wrong) == 1 else "them"
            raise RunDirError(f"{named}. Move {it} out of {self.root} (or remove {it}): no command computes or merges "
                              f"there until then")

    # ------------------------------------------------------------------ temporaries
    def remove_stale_temporaries(self) -> list[str]:
        """Remove what an interrupted command of the parent left half-written (`.result.h5.tmp`,
        `.manifest.json.tmpN`, `index.rsidx.tmpN`, `copies.rsidx.tmpN`, `.shard_N.failed.json.tmpN`) and the
        spill folders of its planning or merge (`.rs-stride-*`, `.rs-merge-*`, ...). Call only while holding
        the run lock: no other command writes these then. Shard temporaries belong to the shard's worker.

        Commands that take no lock write in OUT too (`export`'s and `get --output`'s files, `report`'s page):
        their temporaries (`.NAME.tmp<pid>`) are removed only when left by a dead process, untouched for an
        hour (an `export` of another user, or of another node, writing now keeps its file)."""
        stale = [p for p in self.root.glob(".*.tmp*") if p.is_file() and self._stale_temporary(p)]
        stale += [p for p in self.root.glob("index.rsidx.tmp*") if p.is_file()]
        stale += [p for p in self.root.glob("copies.rsidx.tmp*") if p.is_file()]
        stale += [p for p in self.shards_dir.glob(".shard_*.failed.json.tmp*") if p.is_file()]
        for p in stale:
            p.unlink(missing_ok=True)
        folders = [p for p in self.root.glob(".rs-*-*") if p.is_dir() and p.name.split("-")[1] in SPILL_FOLDERS
                   and not (p / "manifest.json").exists()]   # spill folders of planning and the merge (never a run
        # directory someone put there: `--out` there is refused, since 2026-12-07)
        for p in folders:
            shutil.rmtree(p, ignore_errors=True)
        return [p.name for p in stale + folders]

    # The temporaries in OUT that only a command holding the run lock writes (the merge's result, planning's
    # manifest and variants list, a refused merge's problems): whatever is there when the lock is taken is stale.
    LOCKED_TEMPORARIES = (".result.h5.tmp", ".manifest.json.tmp", ".variants.npz.tmp", ".merge_problems.tsv.tmp")
    UNLOCKED_TEMPORARY_AGE = 3600.0

    def _stale_temporary(self, path: Path) -> bool:
        if path.name.startswith(self.LOCKED_TEMPORARIES):
            return True
        pid = path.name.rpartition(".tmp")[2]
        try:
            idle = time.time() - path.stat().st_mtime
        except OSError:
            return False
        return (not pid.isdigit() or not process_alive(int(pid))) and idle > self.UNLOCKED_TEMPORARY_AGE

    def remove_shard_temporaries(self, rank: int) -> list[str]:
        """Files a killed writer of shard `rank` left half-written (`.shard_N.h5.tmp`, `.part_*.h5.tmp`). Only
        for whoever may write the shard now: its worker, holding the shard lock, or the parent of a worker it
        has just seen die."""
        stale = [self.shards_dir / f".shard_{rank}.h5.tmp"]
        stale += list(self.parts_dir(rank).glob(".part_*.h5.tmp")) if self.parts_dir(rank).is_dir() else []
        removed = []
        for path in stale:
            if path.exists():
                path.unlink(missing_ok=True)
                removed.append(path.name)
        return removed

    # ------------------------------------------------------------------ failures
    def record_failure(self, rank: int, record: FailureRecord) -> bool:
        """Keep why shard `rank` did not finish (shown by `status`); False if it could not be written (a full
        disk, a read-only mount): the reason is then still on the terminal and in the shard's events."""
        try:
            write_atomic(self.failed_path(rank), record.to_json())
            return True
        except OSError as e:
            log.warning("could not record why shard %d stopped in %s: %s", rank, self.failed_path(rank),
                        e.strerror or e)
            return False

    def settings_refused(self, ranks) -> bool:
        """Whether every one of these shards last failed refusing the run's settings (errors.SettingsRefused): a
        rerun, or their tasks again, stops the same way; their failure's message names the command to run."""
        ranks = list(ranks)
        return bool(ranks) and all(getattr(self.failure(r), "rerun_repeats", False) for r in ranks)

    def new_failure(self, rank: int, code: int | None, reason: str = "", killed_for: str = "",
                    interrupted: bool | None = None, explanation: str = "", rerun_repeats: bool = False
                    ) -> FailureRecord:
        """Shard `rank`'s failure record for exit code `code`, with its worker log's path and last lines."""
        return FailureRecord.of_exit(code, reason, killed_for, interrupted, str(self.worker_log(rank)),
                                     self.log_tail(rank), explanation, rerun_repeats)

    def clear_failure(self, rank: int) -> None:
        """Forget shard `rank`'s failure: an attempt finished it (its events keep the history)."""
        self.failed_path(rank).unlink(missing_ok=True)

    def failure(self, rank: int) -> FailureRecord | None:
        try:
            return FailureRecord.from_json(self.failed_path(rank).read_text())
        except (OSError, ValueError, TypeError):
            return None

    def log_tail(self, rank: int, lines: int = 12) -> list[str]:
        try:
            with open(self.worker_log(rank), "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 64 * 1024))
                return fh.read().decode("utf-8", "replace").splitlines()[-lines:]
        except OSError:
            return []
