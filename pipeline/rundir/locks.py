"""The run directory's two locks: RunLock (one command at a time per run: run, rerun, merge) and ShardLock
(one writer per shard, whichever process, node or scheduler task computes it). Both are flock()s, which the
kernel releases when their holder dies, even by kill -9; each holder writes who it is into its lock file so
that refusals, `status` and the report can name it.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Callable

from ..advice import command
from ..errors import RunDirError
from ..processes import process_start
from .layout import RunDir, describe_holder, holder_lives, unwritable_reason

log = logging.getLogger("run_shards")

NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)
# A shard's lock is tried this long before another process is taken to hold it (status's brief shared
# try-lock must not read as a holder), and waited for this long while its holder writes its final checkpoint.
BUSY_RETRY_SECONDS = 2.0
STOPPING_WAIT_SECONDS = 300.0


def try_flock(fd: int, mode: int, path: Path) -> bool:
    """flock without waiting: True when taken, False when another process holds it; a clear RunDirError
    when the file system has no locks at all (Lustre mounted without -o flock, some NFS setups)."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in NO_LOCKS:
            raise RunDirError(f"cannot lock {path}: the file system does not support file locks ({e.strerror}). "
                              "run_shards needs them to keep one writer per run and per shard: on Lustre mount "
                              "with -o flock; on NFS enable locking (NFSv4, or lockd for v3); or use another "
                              "--out.") from None
        raise


def open_lock_file(path: Path, root: Path) -> int:
    """The lock file's descriptor; a RunDirError naming the path and the cause when the run directory cannot
    be written here (a read-only mount, a node without it, a directory removed meanwhile)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        why = unwritable_reason(root) or e.strerror or str(e)
        raise RunDirError(f"cannot lock {path}: {why}. run_shards writes its locks, checkpoints and logs there, "
                          f"so run this command where {root} is writable (a node that mounts it read-write)"
                          ) from None


def _holder_record(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (ValueError, OSError):
        return {}


def _current_holder(fd: int, patience: float = 1.0) -> dict:
    """The record of the command that holds OUT/.lock, called while the lock is held: read again, for up to
    `patience` seconds, while it is empty or names a process of this host that is gone. A command that has just
    taken over a dead run's lock writes its own record right after taking it (the record is truncated, then
    written), and a refusal read in between named the dead run, or nobody, as the holder."""
    deadline = time.monotonic() + patience
    while True:
        holder = _holder_record(fd)
        if holder_lives(holder) or time.monotonic() >= deadline:
            return holder
        time.sleep(0.05)


def _write_record(fd: int, record: dict) -> None:
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
    except OSError as e:   # a full disk: the lock holds all the same; only the holder's name is missing
        log.debug("could not write the lock holder's record: %s", e)


def _now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


class RunLock:
    """An exclusive lock on a run directory for the life of a command (OUT/.lock).

    A lock file left by a dead run is recognised as stale (the kernel released its flock) and taken over;
    a live holder is named in the refusal, or waited for (`wait_seconds`, as a SLURM merge job does).
    """

    def __init__(self, run: RunDir, purpose: str, wait_seconds: float = 0.0, again: str | None = None):
        self.root, self.path = run.root, run.root / ".lock"
        self.purpose, self.wait_seconds = purpose, wait_seconds
        self.again = again         # the command line that does this command's work again (a new run's)
        self.fd: int | None = None
        self.took_over: dict | None = None
        self.waited = False        # another command held it when this one came

    def acquire(self) -> "RunLock":
        fd = open_lock_file(self.path, self.root)
        try:
            self._wait_for(fd)
        except BaseException:
            os.close(fd)
            raise
        self.took_over = _holder_record(fd) or None
        _write_record(fd, {"pid": os.getpid(), "host": socket.gethostname(), "purpose": self.purpose,
                           "since": _now(), "start": process_start(),   # (a later process with its pid is not it)
                           "inode": os.fstat(fd).st_ino,   # (a copy's record is not its own)
                           **({"again": self.again} if self.again else {})})
        self.fd = fd
        return self

    def _wait_for(self, fd: int) -> None:
        """Take the lock, waiting up to wait_seconds (saying so once a minute) while another command holds it."""
        end, said = time.monotonic() + self.wait_seconds, float("-inf")
        while not try_flock(fd, fcntl.LOCK_EX, self.path):
            holder, self.waited = _current_holder(fd), True
            if time.monotonic() >= end:
                waited = f", still after waiting {self.wait_seconds:.0f} s" if self.wait_seconds else ""
                # (`rerun` and `merge` name OUT itself: another directory is no way on for them)
                other = ", or use another --out directory" if self.purpose == "run" else \
                    ", then run this command again"
                raise RunDirError(f"{self.root} is in use by another run_shards command ({describe_holder(holder)})"
                                  f"{waited}. Wait for it to finish (`{command('status', self.root)}` shows what "
                                  f"it does){other}.")
            if time.monotonic() - said >= 60:
                log.info("%s is in use by another run_shards command (%s); waiting for it (up to %.0f s more)",
                         self.root, describe_holder(holder), end - time.monotonic())
                said = time.monotonic()
            time.sleep(1.0)

    @staticmethod
    def active_holder(run: RunDir) -> dict | None:
        """Who holds the run's lock now, read without locking (RunDir.active_command)."""
        return run.active_command()

    def release(self) -> None:
        if self.fd is not None:
            try:
                os.ftruncate(self.fd, 0)
            except OSError as e:
                log.debug("could not clear %s: %s", self.path, e)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class ShardLock:
    """One writer per shard (OUT/shards/shard_N.lock), held by the worker computing it, wherever it runs.

    Another process that wants the shard steps aside at once when a worker computes it, and waits only while
    the holder is writing its final checkpoint (its record says `stopping`): a `rerun` right after a stop.
    """

    def __init__(self, run: RunDir, rank: int):
        self.run, self.rank = run, rank
        self.path = run.shards_dir / f"shard_{rank}.lock"
        self.fd: int | None = None

    def acquire(self, stop: Callable[[], bool] = lambda: False,
                stopping_wait: float = STOPPING_WAIT_SECONDS) -> dict | None:
        """Take the lock for this process: None once held; else the holder's record (the caller steps aside).
        Gives up (returns the record) when `stop()` turns true while waiting."""
        fd = open_lock_file(self.path, self.run.root)
        start = time.monotonic()
        while not try_flock(fd, fcntl.LOCK_EX, self.path):
            holder = _holder_record(fd)
            waited = time.monotonic() - start
            if stop() or (waited > BUSY_RETRY_SECONDS and not (holder.get("stopping") and waited < stopping_wait)):
                holder = holder if stop() else _current_holder(fd)   # (not the dead holder it just took over from)
                os.close(fd)
                return holder
            time.sleep(0.2)
        task = os.environ.get("SLURM_ARRAY_JOB_ID")
        _write_record(fd, {"pid": os.getpid(), "host": socket.gethostname(), "since": _now(),
                           "slurm": f"{task}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if task else ""})
        self.fd = fd
        return None

    def mark_stopping(self) -> None:
        """Say in the record that this holder is writing its final checkpoint: a successor waits for it."""
        if self.fd is not None:
            _write_record(self.fd, dict(_holder_record(self.fd), stopping=True))

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def held_elsewhere(self) -> bool:
        """Whether a worker holds the lock now (a brief shared try-lock; never creates the file)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return False
        try:
            if try_flock(fd, fcntl.LOCK_SH, self.path):
                fcntl.flock(fd, fcntl.LOCK_UN)
                return False
            return True
        except RunDirError:
            return False   # no locks on this file system: nothing can be seen running
        finally:
            os.close(fd)

    def holder(self) -> dict:
        """The holder's record as it wrote it (empty when none was written)."""
        try:
            return json.loads(self.path.read_bytes() or b"{}")
        except (OSError, ValueError):
            return {}

    def if_free(self, action: Callable[[], object]) -> bool:
        """Call `action()` while holding the lock, if no worker holds it now; False (nothing done) otherwise."""
        fd = open_lock_file(self.path, self.run.root)
        try:
            if not try_flock(fd, fcntl.LOCK_EX, self.path):
                return False
            try:
                action()
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            return True
        finally:
            os.close(fd)


def wait_for_running_shards(run: RunDir, world: int, seconds: float, *merge_options: str) -> None:
    """Unfinished shards whose lock a worker holds are being computed: wait up to `seconds` for them, then
    refuse to merge, naming them (a rerun would only step aside for them) and the merge to run then, with
    `merge_options` (--allow-partial: once they finish, other shards may still be unfinished)."""
    end, said = time.monotonic() + seconds, float("-inf")
    while True:
        running = {r: ShardLock(run, r) for r in range(world) if not run.shard_path(r).exists()}
        running = {r: lock.holder() for r, lock in running.items() if lock.held_elsewhere()}
        if not running:
            return
        if time.monotonic() >= end:
            who = "; ".join(f"shard {r} by {describe_holder(h)}" for r, h in sorted(running.items()))
            raise RunDirError(f"cannot merge yet: {len(running)} shard(s) are being computed now ({who}). Merge once "
                            f"they have finished (`{command('status', run.root)}` shows them):  "
                            f"{command('merge', run.root, *merge_options)}")
        if time.monotonic() - said >= 60:
            log.info("waiting for shard(s) %s, being computed now, before merging (up to %.0f s more)",
                     ", ".join(map(str, sorted(running))), end - time.monotonic())
            said = time.monotonic()
        time.sleep(2.0)
