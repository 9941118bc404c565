"""Spill folders in a directory that several commands share (the index cache), each locked by the process
that made it: a killed build's folder, whose lock the kernel freed with the process, is removed by the next
build there, while a live build's folder is left alone. (In a run directory the run lock does this.)
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time

OWNER = "owner"   # the file in a folder that its maker holds an exclusive flock on while it lives
_HELD: dict[str, int] = {}   # folder -> the descriptor holding its lock


def owned_folder(directory: str, prefix: str) -> str:
    """A new folder `directory/prefix*`, locked by this process until `release`; abandoned folders of the
    same prefix (their maker killed) are removed first."""
    remove_abandoned(directory, prefix)
    root = tempfile.mkdtemp(prefix=prefix, dir=directory)
    fd, tmp = tempfile.mkstemp(prefix=".owner-", dir=root)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(tmp, os.path.join(root, OWNER))   # (`owner` only ever exists locked, never half-made)
    _HELD[root] = fd
    return root


def release(root: str) -> None:
    """Remove a folder of `owned_folder` and drop its lock."""
    shutil.rmtree(root, ignore_errors=True)
    fd = _HELD.pop(root, None)
    if fd is not None:
        os.close(fd)


def remove_abandoned(directory: str, prefix: str, unowned_after_s: float = 600.0) -> list[str]:
    """Remove the folders `directory/prefix*` whose owner lock is free (their maker died), and those with
    no owner file (an older version's, or killed between making the folder and locking it) untouched for
    `unowned_after_s`; their names."""
    removed = []
    try:
        names = [n for n in os.listdir(directory) if n.startswith(prefix)]
    except FileNotFoundError:
        return removed
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(os.path.join(path, OWNER), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):   # no owner file, or not a folder
            try:
                stale = os.path.isdir(path) and time.time() - os.stat(path).st_mtime > unowned_after_s
            except FileNotFoundError:   # (another build removed it meanwhile)
                stale = False
            if stale:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(name)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(path, ignore_errors=True)   # its maker died: the kernel freed its lock
            removed.append(name)
        except BlockingIOError:
            pass   # its maker is alive and holds the lock
        finally:
            os.close(fd)
    return removed
