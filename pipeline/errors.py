"""User-facing errors: the CLI prints these as one clear message, without a traceback."""
from __future__ import annotations

from collections.abc import Callable


class UserError(Exception):
    """Something the user can fix (bad option, bad input, changed files); printed without a traceback."""


class SettingsRefused(UserError):
    """The run's settings cannot work here (a worker's caches past the free memory): running the shard again
    stops the same way, so the run's advice suggests no `rerun`; the message says which setting to change."""


class MergeError(UserError):
    """Shards do not add up to the index (missing, duplicate, extra or mismatched rows)."""


class RunDirError(UserError):
    """The output directory is missing, belongs to another run, or is in use."""


class RunFailed(UserError):
    """Some shards did not finish (failed); nothing was merged. The CLI exits with exits.EXIT_COMMAND_FAILED."""
    interrupted = False
    label = "error"


class RunInterrupted(KeyboardInterrupt):
    """A stop signal (Ctrl-C, SIGTERM) ended the run before its shards finished; everything checkpointed is
    kept and nothing was merged. The message says where each shard stopped and the command that continues. A
    KeyboardInterrupt, not a RunFailed, so that a script's `except RunFailed` (or `except Exception`) going on to
    its next input does not swallow the user's Ctrl-C. The CLI exits with exits.EXIT_CLI_INTERRUPTED."""
    interrupted = True
    label = "interrupted"


def run_stopped(message: str, interrupted: bool) -> RunFailed | RunInterrupted:
    """The error that ends a run whose shards did not all finish: RunInterrupted where a stop signal did it."""
    return RunInterrupted(message) if interrupted else RunFailed(message)


class DiskFull(UserError):
    """Writing output failed for lack of space (or a file size limit); nothing partial is left behind."""


_FULL_ERRNOS = {28: "no space left on the device", 27: "the file size limit was reached",
                122: "the disk quota is exceeded"}
_FULL_TEXTS = {"No space left on device": 28, "File too large": 27, "Disk quota exceeded": 122,
               "errno = 28": 28, "errno = 27": 27, "errno = 122": 122}


def make_room(reason: str | None) -> str:
    """What frees a write that failed for `reason` (disk_full_reason's): "free space", or for a file size
    limit (EFBIG), which no free space lifts, raising it."""
    return "raise the file size limit (`ulimit -f`)" if reason == _FULL_ERRNOS[27] else "free space"


def disk_full_reason(error: BaseException) -> str | None:
    """Why a write failed, if it failed for space (h5py reports errno only inside its message)."""
    code = getattr(error, "errno", None)
    if code in _FULL_ERRNOS:
        return _FULL_ERRNOS[code]
    text = str(error)
    for needle, code in _FULL_TEXTS.items():
        if needle in text:
            return _FULL_ERRNOS[code]
    return None


def permission_reason(error: BaseException) -> str | None:
    """For a file refused by its permissions (EACCES, EPERM): whose it is, its mode, who asks and what to do;
    else None. Another user's run directory made under `umask 077` (files rw-------) is read by status, get
    or report only after its owner opens it to others, whatever file system holds it."""
    import errno
    import os
    import pwd
    import shlex
    import stat
    if getattr(error, "errno", None) not in (errno.EACCES, errno.EPERM) or not getattr(error, "filename", None):
        return None
    path = os.path.abspath(os.fspath(error.filename))
    while not os.path.lexists(path) and os.path.dirname(path) != path:   # a file it could not create
        path = os.path.dirname(path)

    def user(uid: int) -> str:
        try:
            return pwd.getpwuid(uid).pw_name
        except KeyError:
            return f"uid {uid}"
    try:
        info = os.stat(path)
    except OSError:   # (a folder above it cannot be searched: say what the system said)
        return f"permission denied, and {path} cannot be examined by {user(os.geteuid())}"
    owner, me = user(info.st_uid), user(os.geteuid())
    what = "folder" if stat.S_ISDIR(info.st_mode) else "file"
    mode = stat.filemode(info.st_mode)[1:]
    if info.st_uid == os.geteuid():   # (asking its owner to open it, or to run as its owner, would be this user)
        return (f"permission denied: the {what} {path} is {me}'s own (mode {mode}), yet closed to this command: "
                f"give yourself access (`chmod u+rwX {shlex.quote(path)}`); where its mode allows it already, "
                "the file system refuses it (a read-only export, an NFS server that maps this user to another, "
                "an immutable flag): run the command where it may write there")
    return (f"permission denied: the {what} {path} belongs to {owner} (mode {mode}) "
            f"and this command runs as {me}. Ask {owner} to open it to you (`chmod -R a+rX` on a run "
            f"directory lets others read it), or run the command as {owner}")


def ensure_space(directory, nbytes: int, what: str, remedy: Callable[[str], str]) -> None:
    """Refuse, before writing, a file whose data alone (`nbytes`, a lower bound of its size: output files are
    uncompressed) cannot fit on the disk holding `directory` or under RLIMIT_FSIZE. `remedy(reason)`: what to do,
    for the reason found (disk_full_reason's words), as the caller says it after a write that failed.

    Only what certainly cannot fit is refused here: any write that might fit is tried, and a real write
    failure is reported by the caller (`disk_full_reason`). Refusing early keeps HDF5 out of a write that
    must fail, which leaves its library state damaged.
    """
    import os
    import resource
    stat = os.statvfs(directory)
    free = stat.f_bavail * stat.f_frsize
    if nbytes > free:
        raise DiskFull(f"cannot write {what}: its data alone takes {human_bytes(nbytes)} and {directory} has "
                       f"{human_bytes(free)} free ({_FULL_ERRNOS[28]}). {remedy(_FULL_ERRNOS[28])}")
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY and nbytes > soft:
        raise DiskFull(f"cannot write {what}: its data alone takes {human_bytes(nbytes)}, over this process's file "
                       f"size limit of {human_bytes(soft)} ({_FULL_ERRNOS[27]}). {remedy(_FULL_ERRNOS[27])}")


# Descriptors a step opens besides the files it holds many of (a merge: its result, spill files, the index).
OPEN_FILES_BESIDES = 16


def ensure_open_files(count: int, what: str, remedy: str) -> None:
    """Make room to hold `count` files open at once (a merge holds every shard open) besides the command's
    own: the soft limit on open files (`ulimit -n`, often 1024 where the hard one is far higher) is raised to
    the hard limit when it is too low; past the hard limit, a clear error instead of opens that fail midway,
    which called every shard that could not be opened corrupt."""
    import os
    import resource
    try:   # those open now: its log, locks, the index maps, pipes (Linux lists them; elsewhere a guess)
        now = len(os.listdir("/proc/self/fd"))
    except OSError:
        now = 32
    needed = now + count + OPEN_FILES_BESIDES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or needed <= soft:
        return
    if hard == resource.RLIM_INFINITY or needed <= hard:   # (all the hard limit allows: the margin is a guess)
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed if hard == resource.RLIM_INFINITY else hard, hard))
        return
    raise UserError(f"cannot open {what}: {count:,} files at once, and this process may hold at most {hard:,} "
                    f"(the hard limit on open files, `ulimit -Hn`). {remedy}")


def too_many_files_reason(error: BaseException) -> str | None:
    """For an open refused by the limit on open files (EMFILE, or the system's ENFILE): the limit and what to
    do; else None."""
    import errno
    import resource
    code = getattr(error, "errno", None)
    if code == errno.ENFILE:
        return "the system's table of open files is full (other processes hold them)"
    if code != errno.EMFILE:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (f"too many open files (this process's limit, `ulimit -n`, is {soft:,}; its hard limit is "
            f"{'unlimited' if hard == resource.RLIM_INFINITY else f'{hard:,}'})")


def human_bytes(n: float) -> str:
    """A byte count as messages write it: 950 B, 1.2 KB, 3.4 GB (powers of 1000)."""
    if n < 1000:
        return f"{n:.0f} B"
    for unit in ("KB", "MB", "GB"):
        n /= 1000
        if n < 1000:
            return f"{n:.1f} {unit}"
    return f"{n / 1000:.1f} TB"
