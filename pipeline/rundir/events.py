"""A run's history as data: one JSON object per line, appended, never rewritten.

    OUT/logs/events_N.jsonl   shard N: every attempt's `start`, `loaded`, `checkpoint` {rows, tokens, durable}
                              and `end` {code, explanation, reason} (by the worker, or by the parent that saw
                              it die); written only by the holder of the shard's lock, or after it died
    OUT/logs/events.jsonl     the commands: `timings` (a local run's time split), `submitted`, `dry_run` and
                              `refused` (SLURM), `cancelled` {submission, shards} (Ray: read by `work`),
                              `ended` {command, error, seconds}

report.html, `status` and the Ray launcher read these; the logs are for people and free to change wording.
Each event is one write() with O_APPEND, so writers on one host never interleave within a line.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("run_shards")


def append(path: Path, event: str, **fields) -> bool:
    """Append one event (with its time, `t`); False, after a warning, when it could not be written (a full
    disk, a read-only mount): events are the run's history, never a reason to stop computing."""
    line = json.dumps({"t": round(time.time(), 3), "event": event, **fields}, default=str) + "\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
        return True
    except OSError as e:
        log.warning("could not record the event %r in %s: %s", event, path, e.strerror or e)
        return False


def read(path: Path) -> list[dict]:
    """Every event of the file, oldest first ([] when there is none). A line a killed writer left torn is
    skipped: it can only be the last one, and every event before it stands."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    events = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            event = json.loads(line)
        except ValueError:
            log.debug("%s:%d is not a whole event (a writer was killed while writing it)", path, number)
            continue
        if isinstance(event, dict) and "event" in event:
            events.append(event)
    return events


def last(events: list[dict], kind: str) -> dict | None:
    """The latest event of this kind, or None."""
    return next((e for e in reversed(events) if e["event"] == kind), None)
