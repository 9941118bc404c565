"""The parent's log file, OUT/logs/run.log: every message the parent prints, plus what only the file
keeps (refusals, the final failure report with its "Continue with" line).

A log file on a full disk must never turn into a traceback on the terminal: the first failed write is
said once, in one line, and the file is left alone for the rest of the command.
"""
from __future__ import annotations

import logging
import sys

from ..errors import disk_full_reason
from .layout import RunDir

log = logging.getLogger("run_shards")


class RunLogHandler(logging.FileHandler):
    def __init__(self, path):
        super().__init__(path, mode="a", delay=True)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        self.broken = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.broken:
            super().emit(record)

    def handleError(self, record: logging.LogRecord | None) -> None:
        if self.broken:
            return
        self.broken = True
        error = sys.exc_info()[1]
        why = disk_full_reason(error) if error else None
        sys.stderr.write(f"warning: cannot write {self.baseFilename} ({why or error}); the rest of this "
                         "command's messages are on the terminal only\n")

    def close(self) -> None:
        """Flush and close the file; a flush that fails there (the disk filled since the last write) is said
        like a failed write, once, instead of ending the command in a traceback."""
        try:
            super().close()
        except OSError:
            self.handleError(None)

    def write_only_here(self, level: int, text: str) -> None:
        """A message for the file alone (the terminal shows it another way)."""
        self.handle(log.makeRecord(log.name, level, __file__, 0, "%s", (text,), None))


def attach(run: RunDir) -> RunLogHandler:
    """Keep the `run_shards` logger's INFO lines in run.log for the command's duration, showing the caller's
    own handlers only what the caller's logging let through before: from Python, `logging.basicConfig()`
    (WARNING) printed every INFO line of `run_shards.run(...)`, and the logger stayed at INFO after it."""
    try:
        run.logs_dir.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass   # the handler reports it at its first write
    handler = RunLogHandler(run.parent_log)
    handler.previous_level = log.level
    handler.muted = []
    shown = log.getEffectiveLevel()
    if shown > logging.INFO:
        quieter = _Below(shown)
        for other in _handlers_reached():
            other.addFilter(quieter)
            handler.muted.append((other, quieter))
        log.setLevel(logging.INFO)
    log.addHandler(handler)
    return handler


def detach(handler: RunLogHandler) -> None:
    log.removeHandler(handler)
    for other, quieter in handler.muted:
        other.removeFilter(quieter)
    log.setLevel(handler.previous_level)
    handler.close()


class _Below(logging.Filter):
    """Drops the `run_shards` records below the level the caller's logging showed."""

    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        ours = record.name == log.name or record.name.startswith(log.name + ".")
        return record.levelno >= self.level or not ours


def _handlers_reached() -> list[logging.Handler]:
    """The handlers a `run_shards` record reaches: the logger's own and, while it propagates, its parents'."""
    found, logger = [], log
    while logger is not None:
        found += logger.handlers
        logger = logger.parent if logger.propagate else None
    return found
