"""User-facing errors: the CLI prints these as one clear message, without a traceback."""


class UserError(Exception):
    """Something the user can fix (bad option, bad input, changed files); printed without a traceback."""


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


def ensure_space(directory, nbytes: int, what: str, remedy: str) -> None:
    """Refuse, before writing, a file whose data alone (`nbytes`, a lower bound of its size: output files are
    uncompressed) cannot fit on the disk holding `directory` or under RLIMIT_FSIZE.

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
                       f"{human_bytes(free)} free (no space left on the device). {remedy}")
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY and nbytes > soft:
        raise DiskFull(f"cannot write {what}: its data alone takes {human_bytes(nbytes)}, over this process's file "
                       f"size limit of {human_bytes(soft)} (the file size limit was reached; see ulimit -f). {remedy}")


def human_bytes(n: float) -> str:
    """A byte count as messages write it: 950 B, 1.2 KB, 3.4 GB (powers of 1000)."""
    if n < 1000:
        return f"{n:.0f} B"
    for unit in ("KB", "MB", "GB"):
        n /= 1000
        if n < 1000:
            return f"{n:.1f} {unit}"
    return f"{n / 1000:.1f} TB"
