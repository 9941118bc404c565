"""The run directory: everything `status`, `rerun` and `merge` need, and nothing else.

    OUT/manifest.json          config, model identity, index fingerprint, schema, number of shards
    OUT/index.rsidx            the run's own copy of the sequence index (fixed for the run's life)
    OUT/copies.rsidx           which rows are copied instead of computed (duplicates, --reuse; output/copy_plan.py)
    OUT/shards/shard_N.h5      finished shard N (rows sorted by FASTA position)
    OUT/shards/shard_N.parts/  checkpoints of an unfinished shard N (each a sorted, finished file)
    OUT/shards/shard_N.failed.json   why shard N failed last time (exit code, last log lines)
    OUT/logs/worker_N.log, OUT/logs/run.log
    OUT/result.h5              the merged, validated result
    OUT/variants.npz           --task variants: the variants file as planning read and checked it
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..errors import RunDirError
from ..processes import process_alive

MANIFEST_FORMAT = 1


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file (fsync, rename, fsync of the directory); on any
    failure (a full disk) the temporary is removed and `path` keeps its old content."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


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

    @property
    def parent_log(self) -> Path:
        return self.logs_dir / "run.log"

    # What a run leaves in OUT before its manifest exists (it stopped before or while writing it): reusable.
    EARLY_ENTRIES = {".lock", "shards", "logs", "index.rsidx", "variants.npz", "copies.rsidx"}

    def _early_entry(self, name: str) -> bool:
        return name in self.EARLY_ENTRIES or name.startswith(("index.rsidx.tmp", ".manifest.json.tmp",
                                                              "copies.rsidx.tmp", ".rs-"))

    def create(self) -> None:
        """Create the run directory, or check that an existing one is a run's (never overwrite other files)."""
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

    def read_manifest(self) -> dict:
        if not self.root.is_dir():
            raise RunDirError(f"{self.root}: no such run directory")
        if not self.manifest_path.exists():
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

    # ------------------------------------------------------------------ temporaries
    def remove_stale_temporaries(self) -> list[str]:
        """Remove what an interrupted command of the parent left half-written (`.result.h5.tmp`,
        `.manifest.json.tmpN`, `index.rsidx.tmpN`, `copies.rsidx.tmpN`, `.shard_N.failed.json.tmpN`) and the
        spill folders of its planning or merge (`.rs-stride-*`, `.rs-merge-*`, ...). Call only while holding
        the run lock: no other command writes these then. Shard temporaries belong to the shard's worker."""
        stale = [p for p in self.root.glob(".*.tmp*") if p.is_file()]
        stale += [p for p in self.root.glob("index.rsidx.tmp*") if p.is_file()]
        stale += [p for p in self.root.glob("copies.rsidx.tmp*") if p.is_file()]
        stale += [p for p in self.shards_dir.glob(".shard_*.failed.json.tmp*") if p.is_file()]
        for p in stale:
            p.unlink(missing_ok=True)
        folders = [p for p in self.root.glob(".rs-*") if p.is_dir()]   # spill folders of planning and the merge
        for p in folders:
            shutil.rmtree(p, ignore_errors=True)
        return [p.name for p in stale + folders]

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
    def record_failure(self, rank: int, info: dict) -> bool:
        """Keep why shard `rank` did not finish (shown by `status`); False if it could not be written (a full
        disk): the reason is then still on the terminal, and `status` reports the disk's free space."""
        try:
            write_atomic(self.failed_path(rank), json.dumps(info, indent=1))
            return True
        except OSError:
            return False

    def clear_failure(self, rank: int) -> None:
        self.failed_path(rank).unlink(missing_ok=True)

    def failure(self, rank: int) -> dict | None:
        try:
            return json.loads(self.failed_path(rank).read_text())
        except (OSError, ValueError):
            return None

    def log_tail(self, rank: int, lines: int = 12) -> list[str]:
        try:
            with open(self.worker_log(rank), "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 64 * 1024))
                return fh.read().decode("utf-8", "replace").splitlines()[-lines:]
        except OSError:
            return []


NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


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


class RunLock:
    """An exclusive lock on a run directory for the life of a command.

    flock is released by the kernel when its holder dies, even by kill -9, so a lock file left by a
    dead run is recognised as stale and taken over; a live holder is named in the refusal.
    """

    def __init__(self, run: RunDir, purpose: str):
        self.path = run.root / ".lock"
        self.purpose = purpose
        self.fd: int | None = None
        self.took_over: dict | None = None

    def acquire(self) -> "RunLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            taken = try_flock(fd, fcntl.LOCK_EX, self.path)
        except RunDirError:
            os.close(fd)
            raise
        if not taken:
            holder = self._holder(fd)
            os.close(fd)
            who = f"pid {holder.get('pid')} on {holder.get('host')}, `{holder.get('purpose')}` since " \
                  f"{holder.get('since')}" if holder else "another process"
            raise RunDirError(f"{self.path.parent} is in use by another run_shards command ({who}). "
                              "Wait for it to finish, or use another --out directory.") from None
        self.took_over = self._holder(fd) or None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "purpose": self.purpose,
                "since": datetime.datetime.now().isoformat(timespec="seconds")}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
        except OSError:
            pass   # a full disk: the lock holds all the same; only the holder's name is missing from messages
        self.fd = fd
        return self

    @staticmethod
    def active_holder(run: RunDir) -> dict | None:
        """Who holds the run's lock now, read without locking (so `status` never gets in a run's way):
        the holder record, if its process is alive on this host or it runs on another host; else None."""
        try:
            holder = json.loads((run.root / ".lock").read_bytes() or b"{}")
        except (OSError, ValueError):
            return None
        if not holder.get("pid"):
            return None
        if holder.get("host") != socket.gethostname():
            return holder
        return holder if process_alive(int(holder["pid"])) else None

    @staticmethod
    def if_shard_free(run: RunDir, rank: int, action) -> None:
        """Call `action()` while holding shard `rank`'s lock, if no worker holds it now; else do nothing."""
        path = run.shards_dir / f"shard_{rank}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            taken = try_flock(fd, fcntl.LOCK_EX, path)
        except RunDirError:
            os.close(fd)
            raise
        if not taken:
            os.close(fd)
            return
        try:
            action()
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    @staticmethod
    def shard_running(run: RunDir, rank: int) -> bool:
        """Whether a worker holds shard `rank`'s lock now (a brief shared try-lock; a worker that wants the lock
        at that instant retries)."""
        try:
            fd = os.open(run.shards_dir / f"shard_{rank}.lock", os.O_RDONLY)
        except OSError:
            return False
        try:
            if try_flock(fd, fcntl.LOCK_SH, run.shards_dir / f"shard_{rank}.lock"):
                fcntl.flock(fd, fcntl.LOCK_UN)
                return False
            return True
        except RunDirError:
            return False   # no locks on this file system: nothing can be seen running
        finally:
            os.close(fd)

    @staticmethod
    def _holder(fd: int) -> dict:
        try:
            return json.loads(os.pread(fd, 4096, 0) or b"{}")
        except ValueError:
            return {}

    def release(self) -> None:
        if self.fd is not None:
            try:
                os.ftruncate(self.fd, 0)
            except OSError:
                pass
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
