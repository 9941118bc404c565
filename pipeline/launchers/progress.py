"""The parent's view of progress: one aggregate bar, a periodic summary line, a final per-worker table."""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field

from tqdm import tqdm

log = logging.getLogger("run_shards")


def human(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.2g}" if abs(x) < 10 else f"{x:.0f}"   # (one 200,000-residue record a minute: 0.017 seq/s, not 0)


def duration(seconds: float) -> str:
    """`1 h 05 min`, `4 min 09 s`, `12 s`: a time left, as a log line says it."""
    s = int(round(seconds))
    hours, rest = divmod(s, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours:,} h {minutes:02d} min"
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


@dataclass
class WorkerStats:
    rank: int
    device: str
    sequences: int = 0
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    load_seconds: float = 0.0
    compute_seconds: float = 0.0
    last_event: float = field(default_factory=time.monotonic)
    loaded_at: float | None = None
    last_batch_at: float | None = None
    batch_tokens: int = 0        # tokens of the batch it computes now (0: between batches)
    batch_budget: int = 1        # the run's tokens per batch, which a long sequence's batch exceeds
    durable_start: int | None = None   # the shard's durable rows when this attempt started (its `start`)
    durable: int = 0             # ... and at its latest checkpoint
    windows: tuple[int, int] | None = None   # windows done, of how many, in the batch it computes now
    window_tokens: int = 0       # tokens of those windows (or of a generate batch so far), counted in `tokens`
                                 # until the batch's own count comes
    generating: bool = False     # a generate batch runs its steps (its tokens so far: window_tokens)

    @property
    def seconds(self) -> float:
        return (self.finished or time.monotonic()) - self.started


class ProgressBoard:
    def __init__(self, total_sequences: int, where: str, summary_seconds: float, show_bar: bool = True):
        self.where = where
        self.summary_seconds = summary_seconds
        self.workers: dict[int, WorkerStats] = {}
        self.expected: dict[int, int] = {}
        self.start = time.monotonic()
        self.last_summary = self.start
        self.bar = tqdm(total=total_sequences, unit="seq", desc="run_shards", file=sys.stderr,
                        dynamic_ncols=True, mininterval=0.5, smoothing=0.05,
                        disable=not show_bar or not sys.stderr.isatty())   # no \r redraws into log files

    def expect(self, rank: int, sequences: int) -> None:
        """The parent's estimate of what shard `rank` has left to do (its worker's `start` message corrects it)."""
        self.expected[rank] = sequences

    def add_worker(self, rank: int, device: str) -> None:
        self.workers[rank] = WorkerStats(rank, device)

    def message(self, kind: str, rank: int, data: dict) -> None:
        w = self.workers[rank]
        w.last_event = time.monotonic()
        if kind == "start":   # the worker's own count (it rejects damaged checkpoints the parent counted)
            self.expected[rank] = data["sequences"]
            w.durable_start = w.durable = data.get("durable", 0)
            self.bar.total = max(sum(self.expected.values()), self.bar.n)
            self.bar.refresh()
        elif kind == "batch":   # a batch begins: the hang detector allows it time for its tokens
            w.batch_tokens, w.batch_budget = data["tokens"], max(1, data["budget"])
        elif kind == "windows":   # a long sequence's windows, in calls of a batch: tokens before its rows
            w.windows = data["done"], data["of"]
            w.tokens += data["tokens"]
            w.window_tokens += data["tokens"]
            self.bar.set_postfix_str(self._postfix())
        elif kind == "generating":   # a generate batch between its steps: the tokens it ran so far, before its rows
            w.tokens += data["tokens"] - w.window_tokens
            w.window_tokens, w.generating = data["tokens"], True
            self.bar.set_postfix_str(self._postfix())
        elif kind == "progress":
            w.batch_tokens = 0
            w.last_batch_at = w.last_event
            w.sequences += data["sequences"]
            w.tokens += data["tokens"] - w.window_tokens   # (the batch's count replaces its windows')
            w.windows, w.window_tokens, w.generating = None, 0, False
            self.bar.update(data["sequences"])
            self.bar.set_postfix_str(self._postfix(), refresh=False)
        elif kind == "checkpoint":
            w.durable = data["durable"]
        elif kind == "loaded":
            w.load_seconds = data["seconds"]
            w.loaded_at = w.last_event
        elif kind == "done":
            w.finished = time.monotonic()
            w.compute_seconds = data.get("compute_seconds", 0.0)

    def lost(self, rank: int) -> int:
        """A worker that ended without its final checkpoint: take the sequences it computed after its last
        checkpoint (lost with it; a rerun computes them again) off its count and the bar, which then say what its
        shard holds. Returns how many."""
        w = self.workers.get(rank)
        if w is not None:
            w.windows, w.generating = None, False   # (no longer computing them)
        if w is None or w.durable_start is None:
            return 0
        lost = max(0, w.sequences - (w.durable - w.durable_start))
        if lost:
            w.sequences -= lost
            self.bar.update(-lost)
            self.bar.refresh()
        return lost

    def _postfix(self) -> str:
        return ", ".join([f"{human(self.tokens_per_second())} tok/s", *self._in_windows()])

    def _in_windows(self) -> list[str]:
        """`shard 0: 1,234 of 9,280 windows` for each worker in a batch of windows, `shard 1: generating, 52,100
        tokens run in this batch` for each in a generate batch (the bar counts sequences: one long sequence, or
        a batch of thousands of new tokens each, is minutes without a move)."""
        said = []
        for r, w in sorted(self.workers.items()):
            if w.finished is not None:
                continue
            if w.windows is not None:
                said.append(f"shard {r}: {w.windows[0]:,} of {w.windows[1]:,} windows")
            elif w.generating:
                said.append(f"shard {r}: generating, {w.window_tokens:,} tokens run in this batch")
        return said

    def tokens_per_second(self) -> float:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        return sum(w.tokens for w in self.workers.values()) / elapsed

    def maybe_summary(self) -> None:
        now = time.monotonic()
        if now - self.last_summary >= self.summary_seconds:
            self.last_summary = now
            self.note(self.summary_line())

    def summary_line(self) -> str:
        """The rates since this command started, and (in a log, where no bar shows one) the share done and
        the time left at that rate."""
        elapsed = max(time.monotonic() - self.start, 1e-9)
        seqs = sum(w.sequences for w in self.workers.values())
        toks = sum(w.tokens for w in self.workers.values())
        total = sum(self.expected.values()) or self.bar.total or 0
        done = f", {100.0 * seqs / total:.0f}%" if total else ""
        left = total - seqs
        eta = f", about {duration(left * elapsed / seqs)} left at this rate" if seqs and left > 0 else ""
        windows = "".join(f"; {text}" for text in self._in_windows())
        return (f"Total: {human(seqs / elapsed)} seq/s, {human(toks / elapsed)} tok/s across {self.where} "
                f"({seqs:,} of {total:,} sequences{done}{eta}{windows})")

    def note(self, text: str, level: int = logging.INFO) -> None:
        """A line for the run's log (the CLI shows run_shards log lines above the bar)."""
        log.log(level, text)

    def close(self) -> None:
        self.bar.close()

    def table(self, most: int = 20) -> str:
        """A row per shard; above `most` shards (300 shards on 2 workers printed 300 rows), the `most` // 2
        slowest by tok/s, then a line for them all."""
        rate = {r: w.tokens / max(w.seconds, 1e-9) for r, w in self.workers.items()}
        shown = sorted(self.workers) if len(self.workers) <= most else sorted(sorted(rate, key=rate.get)[:most // 2])
        rows = [("shard", "device", "sequences", "tokens", "seconds", "tok/s")]
        for r in shown:
            w = self.workers[r]
            rows.append((str(r), w.device, f"{w.sequences:,}", f"{w.tokens:,}", f"{w.seconds:.1f}", human(rate[r])))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.rjust(wd) for c, wd in zip(row, widths)) for row in rows]
        if len(shown) < len(self.workers):
            rates, seconds = sorted(rate.values()), sorted(w.seconds for w in self.workers.values())
            lines[0] += f"   (the {len(shown)} slowest of {len(self.workers):,} shards)"
            lines.append(f"all {len(self.workers):,} shards: {sum(w.sequences for w in self.workers.values()):,} "
                         f"sequences, {sum(w.tokens for w in self.workers.values()):,} tokens; seconds "
                         f"{seconds[0]:.1f}..{seconds[-1]:.1f} (median {seconds[len(seconds) // 2]:.1f}), tok/s "
                         f"{human(rates[0])}..{human(rates[-1])} (median {human(rates[len(rates) // 2])})")
        return "\n".join(lines)

    def compute_window(self) -> tuple[float, float] | None:
        """From the first worker ready to compute to the last batch of any worker."""
        starts = [w.loaded_at for w in self.workers.values() if w.loaded_at]
        ends = [w.last_batch_at for w in self.workers.values() if w.last_batch_at]
        return (min(starts), max(ends)) if starts and ends else None
