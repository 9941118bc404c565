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
    try:
        run.logs_dir.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass   # the handler reports it at its first write
    handler = RunLogHandler(run.parent_log)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return handler


def detach(handler: RunLogHandler) -> None:
    log.removeHandler(handler)
    handler.close()
