"""ShardRun: one shard computed from the run directory alone (open it, load the engine, plan batches,
compute them with checkpoints, finish), wherever the process runs. StopFlag and Reporter are how it hears
of a stop and tells the parent of its progress."""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from index import InputChanged, SequenceIndex, records_changed
from index.shard_view import open_stride

from ..advice import command
from .. import faults
from ..config import LAUNCH, RunConfig, overlap_setting
from ..engine import selection as engines
from ..engine.config import CachesTooLarge
from ..engine.interface import Stopped
from ..models import preload
from ..models.checkpoint import EngineInfo, check_unchanged, load_failure, read_ahead
from ..models.conventions import PLAIN, Convention
from ..errors import SettingsRefused, UserError
from ..exits import EXIT_INTERRUPTED, EXIT_OK
from ..output import status_codes
from ..output.schema import Schema
from ..output.shard_writer import ShardWriter
from ..rundir import events
from ..rundir.layout import RunDir, free_out
from ..rundir.locks import ShardLock
from ..tasks import make_task, schema_for
from ..tasks.earlier_rows import earlier_rows
from ..tasks.tokenization import SequenceTokenizer
from .batch_rows import BatchComputer, LaunchedBatch
from .batching import LazyPlan
from .process_setup import set_up
from .token_counts import HEARTBEAT_SECONDS, Encoded, TokenCounter

log = logging.getLogger("run_shards.worker")

PARENT_GONE = "the parent process is gone (killed, or its terminal closed)"


def longest_prompt_of(manifest: dict) -> int | None:
    """The most tokens a prompt of the run has, which the engine's caches must hold: recorded by the plan
    (planning/length_limit.py); a run planned before it was (2026-12-06) holds the run's limit."""
    recorded = manifest.get("longest_prompt")
    return recorded if recorded is not None else manifest["max_tokens"]


def caches_advice(refused: CachesTooLarge, config: RunConfig, root) -> str:
    """The refusal of caches too large for the memory, with the `run` command that gets past it: the same run
    continued with a lower --max-tokens-per-batch or --max-seqs (how the shards run), or a new run in another
    --out with a lower --max-new-tokens or --max-length (what is computed); where none was found, which
    settings continue the run and which make another."""
    if refused.change is None:
        return (f"{refused}. A rerun stops the same way: a lower --max-tokens-per-batch or --max-seqs continues "
                "this run (its run command again, with the same --out), a lower --max-new-tokens or --max-length "
                "makes a new run, in another --out")
    changed = replace(config, **refused.change)
    if set(refused.change) <= set(RunConfig.fields_with_role(LAUNCH)):
        return f"{refused}. This command continues the run with that: `{changed.as_command(root)}`"
    said = ""
    if "max_length" in refused.change:
        changed, said = _within_length(changed, config)
    return (f"{refused}. That changes what is computed, so it is a new run, in another --out{said}: "
            f"`{changed.as_command(free_out(root))}`")


def _within_length(changed: RunConfig, config: RunConfig) -> tuple[RunConfig, str]:
    """The run with a lower --max-length (`changed`) and a policy for the records over it, where the run had
    none (--on-long error would refuse them): as windows for embed and score (every residue kept), truncated
    when generating, skipped for variants (the two options those tasks allow); a window planned for the
    old limit gives way to the new one. Returns it and the words that say so."""
    on_long = config.keeping_on_long if config.on_long == "error" else config.on_long
    if on_long == "window" and config.window and config.window > changed.max_length:
        changed = replace(changed, window=None, overlap=None)
    changed = replace(changed, on_long=on_long)
    if on_long == config.on_long:
        return changed, ""
    how = {"window": "run as overlapping windows stitched into one row", "truncate": "cut to it",
           "skip": f"kept as rows with status {status_codes.SKIPPED_TOO_LONG}, no values"}[on_long]
    return changed, f" (records over {changed.max_length} tokens {how}: --on-long {on_long})"


class StopFlag:
    def __init__(self):
        self.reason: str | None = None
        self.at = "the current batch"   # where the work stops: a generate batch's next step gives it up

    def set(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            log.warning("stopping after %s: %s", self.at, reason)

    def __bool__(self) -> bool:
        return self.reason is not None


class Reporter:
    """Messages to the parent; a broken pipe means the parent is gone, so the worker stops."""

    def __init__(self, conn, rank: int, stop: StopFlag):
        self.conn, self.rank, self.stop = conn, rank, stop

    def send(self, kind: str, **data) -> None:
        try:
            self.conn.send((kind, self.rank, time.monotonic(), data))
        except (BrokenPipeError, EOFError, OSError):
            self.stop.set("lost contact with the parent process")


@dataclass
class Opened:
    """A shard's inputs as read from the run directory, and what is left of it."""
    config: RunConfig
    manifest: dict
    schema: Schema
    index: SequenceIndex
    positions: np.ndarray    # the shard's sequences (FASTA positions), longest first
    done: np.ndarray         # bool per position: durable already
    writer: ShardWriter


class ShardRun:
    """Shard `rank` of the run in `run`, computed by this process, which holds the shard's `lock`."""

    def __init__(self, run: RunDir, rank: int, reporter: Reporter, stop: StopFlag, threads: int, parent: int,
                 lock: ShardLock, device: str):
        self.run_dir, self.rank, self.reporter, self.stop, self.threads = run, rank, reporter, stop, threads
        self.parent_pid, self.lock, self.device = parent, lock, device
        self.stats: dict = {}     # what `done` reports: sequences, tokens, seconds, compute_seconds
        self.unsaved_tokens = 0   # tokens the engine ran for the buffered rows (a pll's masked copies too)
        self.loaded: tuple | None = None   # the engine and the arguments of its load (for `keep_model`)
        self.last_heartbeat = 0.0           # when `_generating` last told the parent

    def run(self) -> int:
        shard = self._open()
        try:
            return self._run(shard)
        finally:
            shard.index.close()   # (its files: the process may compute another shard next, worker/entry.py)

    def _run(self, shard: Opened) -> int:
        if shard.writer.complete:
            log.info("shard %d is already complete", self.rank)
            # (another process finished it since the parent counted it: nothing left to wait for on the board)
            self.reporter.send("start", sequences=0, residues=0, durable=0)
            self.reporter.send("done", sequences=0, tokens=0, seconds=0.0, compute_seconds=0.0)
            return EXIT_OK
        t0 = time.monotonic()
        engine, task, tokenizer = self._load_engine(shard)
        engine, computer, plan, counter = self._plan(shard, engine, task, tokenizer)
        try:
            stats = self._compute(shard, computer, plan)
        finally:
            counter.close()
        if self.stop:
            self.lock.mark_stopping()   # a task that wants the shard now waits for this checkpoint
            _inputs_still_match(shard.index)
            self._checkpoint(shard)
            log.warning("interrupted (%s): %d of %d sequences durable; `%s` continues",
                        self.stop.reason, shard.writer.durable_rows, len(shard.positions),
                        command("rerun", self.run_dir.root))
            return EXIT_INTERRUPTED
        self._finish(shard, engine, computer, stats, t0)
        return EXIT_OK

    def _open(self) -> Opened:
        manifest = self.run_dir.read_manifest()
        config = RunConfig.from_manifest(manifest)
        schema = Schema.from_json(manifest["schema"])
        index = open_stride(self.run_dir.index_path, self.rank, config.world)   # this shard's rows only
        positions = index.positions
        attrs = dict(manifest["attrs"], shard=self.rank, world=config.world)
        writer = ShardWriter(self.run_dir, self.rank, schema, attrs, positions,
                             config.checkpoint_sequences, config.checkpoint_seconds)
        shard = Opened(config, manifest, schema, index, positions, np.zeros(len(positions), bool), writer)
        if not writer.complete:
            shard.done = writer.is_done(positions)
            todo_tokens = int(index.lengths[positions[~shard.done]].sum())
            todo = int((~shard.done).sum())
            self.reporter.send("start", sequences=todo, residues=todo_tokens, durable=writer.durable_rows)
            log.info("shard %d: %d sequences, %d to do (%d residues)", self.rank, len(positions), todo, todo_tokens)
            events.append(self.run_dir.events_path(self.rank), "start", **self._who(),
                          sequences=len(positions), durable=writer.durable_rows, todo=todo)
        return shard

    def _who(self) -> dict:
        """Where this attempt runs: process, host, device and the scheduler's task (for the report)."""
        slurm = os.environ.get("SLURM_ARRAY_JOB_ID")
        host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()   # the node as the scheduler names it
        return {"pid": os.getpid(), "host": host, "device": self.device, "threads": self.threads,
                "slurm": f"{slurm}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if slurm else "",
                "restarts": int(os.environ.get("SLURM_RESTART_COUNT") or 0)}

    def _load_engine(self, shard: Opened):
        """The engine (with this process's CPU threads set up first), the task and the tokenizer."""
        config, manifest, t0 = shard.config, shard.manifest, time.monotonic()
        if not preload.holding():   # (a model loaded ahead has read them)
            read_ahead(manifest["model"]["path"])   # the weights come off the disk while transformers imports
        set_up(config.on_gpu, bool(manifest["attrs"].get("batch_invariant")), self.run_dir.root, self.threads)
        device = torch.device("cuda:0" if config.on_gpu else "cpu")
        dtype = getattr(torch, config.torch_dtype_name)
        model = manifest["model"]
        info = EngineInfo.from_json(manifest["info"]) if "info" in manifest else None   # runs planned before it: described here
        self._check_model(config, model)   # (a SLURM or Ray task may start long after the run was planned)
        logprobs = config.task in ("score", "variants")
        try:
            engine = engines.load(manifest["engine"], model["path"], device, dtype, logprobs=logprobs, info=info,
                                  config=config, longest_prompt=longest_prompt_of(manifest),
                                  fingerprint=model.get("fingerprint", ""))
        except CachesTooLarge as e:   # (a rerun stops the same way: a setting must change)
            raise SettingsRefused(caches_advice(e, config, self.run_dir.root)) from None
        except Exception as e:
            problem = load_failure(e, model["path"])
            if problem is None:
                raise   # not the files, not a config value: a bug or the environment; exit 1, traceback logged
            log.exception("loading the model failed")   # the traceback stays in the log
            raise UserError(f"cannot load the model from {model['path']}: {problem}; replace the damaged files with "
                            f"an intact copy, then run `{command('rerun', self.run_dir.root)}`") from None
        self._check_model(config, model)   # (nor while it loaded)
        self.loaded = (engine, manifest["engine"], model["path"], model.get("fingerprint", ""), device, dtype,
                       logprobs, config.trust_remote_code)
        task = make_task(config, engine.info, self.run_dir.root, alive=self._generating)
        if config.task == "generate":   # (its batch is given up between two steps: `_generating`)
            self.stop.at = "the current step of the generate batch"
        digest = ["sequence_digest", "uint8", 16, False]   # (a run planned before the column has none)
        if [c for c in schema_for(task).to_json() if c != digest] != [c for c in shard.schema.to_json() if c != digest]:
            raise RuntimeError("the model loaded in the worker does not match the run's schema")
        limit = manifest["max_tokens"]
        convention = Convention.from_json(manifest["input_format"]) if "input_format" in manifest else PLAIN
        tokenizer = SequenceTokenizer(engine.tokenizer, convention,
                                      max_tokens=limit if config.on_long == "truncate" else None)
        task.prepare(tokenizer)
        older = earlier_rows(config.task, manifest["attrs"], task.attrs())
        if older:   # (`rerun`, SLURM and Ray tasks: a command continuing the run refused it while planning)
            raise UserError(f"{self.run_dir.root} holds a run planned by an earlier run_shards, computed {older}; its "
                            f"rows and this version's cannot make one result. Use another --out: "
                            f"`{config.as_command(free_out(self.run_dir.root))}`")
        load_seconds = time.monotonic() - t0
        self.reporter.send("loaded", seconds=load_seconds)
        events.append(self.run_dir.events_path(self.rank), "loaded", seconds=round(load_seconds, 3))
        log.info("model loaded on %s (%s, engine %s) in %.1f s", device, config.torch_dtype_name,
                 engine.info.name, load_seconds)
        if device.type == "cuda" and engine.info.name == "native":
            from ..engine.gpu_support import describe_gpu
            p = torch.cuda.get_device_properties(device)
            log.info("%s", describe_gpu(p.name, (p.major, p.minor), p.multi_processor_count))
        return engine, task, tokenizer

    def keep_model(self) -> None:
        """Keep the model this shard loaded for the process's next shard of the run (worker/entry.py), which
        then takes it instead of reading the checkpoint again (models/preload.py). Nothing without a recorded
        fingerprint (a run planned before them: the next shard loads as usual)."""
        if self.loaded is not None and self.loaded[3]:
            engine, *wanted = self.loaded
            engines.keep(engine, *wanted, shard=self.rank)

    def _check_model(self, config: RunConfig, model: dict) -> None:
        """The checkpoint is the one the run was planned with (config.json, weights, tokenizer files), or this
        shard's rows would come from another model than the one its result names."""
        check_unchanged(model, "start a new run on the checkpoint as it is now: "
                        f"`{config.as_command(free_out(self.run_dir.root))}`",
                        again=f"run `{command('rerun', self.run_dir.root)}`")

    def _plan(self, shard: Opened, engine, task, tokenizer):
        """The batches, in order (a pure function of the shard and the budget, so a resumed shard runs the
        batches an uninterrupted one would), planned as its tokens are counted (worker/token_counts.py), and what
        computes their rows. Long sequences run as windows with --on-long window: the engine sees and budgets
        those."""
        config, index, positions = shard.config, shard.index, shard.positions
        generate = config.task == "generate"
        # (a resumed shard counts its done records too: the same batches; generate's batches do not need counts)
        counter = TokenCounter(index, positions, tokenizer, tokenizer.tokens_for_residues(index.lengths[positions]),
                               Encoded(wanted=~shard.done), count=not generate)
        cut = None
        if config.on_long == "window":
            from ..engine.windowed import Windows, WindowedEngine
            cut = Windows(config.window, config.overlap, tokenizer.head, tokenizer.tail)
            engine = WindowedEngine(engine, cut, config.tokens_per_batch, on_call=self._windows_done,
                                    alive=self._windowing)
            self.stop.at = "the current batch, or its current call of windows where it runs as windows"

        def cost(tokens: np.ndarray, start: int, end: int) -> np.ndarray:
            if cut is not None:
                tokens = np.array([t if t <= cut.limit else cut.count(int(t)) * cut.limit for t in tokens], np.int64)
            return task.batch_tokens(tokens, positions[start:end])   # e.g. a pseudo-log-likelihood's masked copies
        computer = BatchComputer(index, engine, task, tokenizer, shard.schema, config, shard.manifest["max_tokens"], cut,
                                 counter.encoded)
        plan = LazyPlan(counter, cost, config.tokens_per_batch, config.max_seqs, padded=engine.info.name == "hf",
                        generate=generate, alive=self._counting)
        return engine, computer, plan, counter

    def _windows_done(self, done: int, of: int, tokens: int) -> None:
        """A batch of windows goes on: the parent's bar, summary lines and hang detector see it move."""
        self.reporter.send("windows", done=done, of=of, tokens=tokens)

    def _windowing(self, done: int, of: int) -> bool:
        """Between two calls of a batch's windows: whether to go on (not told to stop: the batch is given up, and a
        rerun computes its records again)."""
        faults.before_window_call()
        return not self.stop

    def _generating(self, tokens: int) -> bool:
        """Between the steps of a generate batch (minutes of them with many new tokens per sequence): a message for
        the hang detector every HEARTBEAT_SECONDS; whether to go on (not told to stop: the batch is given up)."""
        faults.before_generate_step()
        now = time.monotonic()
        if now - self.last_heartbeat >= HEARTBEAT_SECONDS:
            self.last_heartbeat = now
            self.reporter.send("generating", tokens=tokens)
        return not self.stop

    def _counting(self, counted: int) -> bool:
        """While the batches wait for token counts: a message for the hang detector; whether to go on (not told
        to stop)."""
        self.reporter.send("counting", sequences=counted)
        return not self.stop

    def _compute(self, shard: Opened, computer: BatchComputer, plan: LazyPlan) -> dict:
        """Run the batches not yet durable, checkpointing when due, until done or told to stop.

        Overlapped (GPU workers, see `overlaps`), batch k is launched (its device work queued), then batch k-1's
        results are taken (the one wait), its rows handed to the writer and a due checkpoint written, then batch
        k+1 is read and tokenized, all while batch k computes. Otherwise each batch is taken right after its
        launch. Either way the rows, the checkpoints' contents and any error are those of a serial loop.
        compute_seconds counts the loop's time in reading, tokenizing, launching, waiting for results and
        assembling rows (not in checkpoints or messages): overlapped, the host's share hides behind the device's."""
        stats = {"sequences": 0, "tokens": 0, "compute_seconds": 0.0}
        overlap = overlaps(shard.config.on_gpu)
        positions, done = shard.positions, shard.done
        work = _Ahead((k, positions[a:b][~done[a:b]], int(cost[~done[a:b]].sum()))
                      for k, a, b, cost in plan if not done[a:b].all())
        inflight: _InFlight | None = None   # launched, its rows not yet taken
        ahead = None                         # the next batch read ahead: a PreparedBatch or _ReadFailed
        while True:
            try:
                k, todo, batch_tokens = next(work)
            except StopIteration:
                break
            except BaseException:   # planning it (its token counts) failed: as a read would
                self._settle(shard, computer, inflight, stats)
                raise
            if os.getppid() != self.parent_pid:
                self.stop.set(PARENT_GONE)
            if self.stop:
                break
            # (the hang detector allows a batch time for its tokens: those of the batch in flight count too)
            self.reporter.send("batch", tokens=batch_tokens + (inflight.tokens if inflight else 0),
                               budget=shard.config.tokens_per_batch)
            faults.before_batch(self.rank, k)
            tc = time.monotonic()
            try:
                batch = ahead if ahead is not None else _read(computer, todo)
                ahead = None
                if isinstance(batch, _ReadFailed):
                    raise batch.error
                launched = _InFlight(computer.launch(batch), len(todo), batch_tokens)
            except Stopped as e:   # told to stop while it generated (a rerun computes the same rows: tasks/generate.py)
                if shard.config.task == "generate":   # or between two calls of a batch's windows
                    log.warning("the %d sequences being generated were given up unfinished; a rerun computes them",
                                len(todo))
                else:
                    log.warning("the batch of %d sequence(s) run as windows was %s; a rerun computes it", len(todo), e)
                break
            except InputChanged as e:   # a record read differs from its checksum: nothing of it is kept
                self._settle(shard, computer, inflight, stats)
                raise UserError(f"shard {self.rank} stopped: {e}. Its rows up to its last checkpoint, each checked "
                                "when it was read, are kept; none computed since") from None
            except BaseException:
                self._settle(shard, computer, inflight, stats)
                raise
            stats["compute_seconds"] += time.monotonic() - tc
            if inflight is not None:
                self._take(shard, computer, inflight, stats)
            inflight = launched
            if not overlap:
                self._take(shard, computer, inflight, stats)
                inflight = None
            elif (following := work.peek()) is not None:
                tc = time.monotonic()
                ahead = _read(computer, following[1], deferred=True)
                stats["compute_seconds"] += time.monotonic() - tc
        if inflight is not None:
            self._take(shard, computer, inflight, stats)
        return stats

    def _take(self, shard: Opened, computer: BatchComputer, inflight: "_InFlight", stats: dict) -> None:
        """A launched batch's rows (waiting for its results) to the writer, and a checkpoint if one is due."""
        tc = time.monotonic()
        block, ntokens = computer.finish(inflight.batch)
        stats["compute_seconds"] += time.monotonic() - tc
        shard.writer.add(block)
        self.unsaved_tokens += ntokens
        stats["sequences"] += inflight.sequences
        stats["tokens"] += ntokens
        self.reporter.send("progress", sequences=inflight.sequences, tokens=ntokens)
        if shard.writer.due():
            _inputs_still_match(shard.index)
            self._checkpoint(shard)

    def _settle(self, shard: Opened, computer: BatchComputer, inflight: "_InFlight | None", stats: dict) -> None:
        """Before an error leaves the loop: the batch in flight taken, as a serial loop would have taken it before
        meeting the error (its rows, and a checkpoint then due); a failure in doing so leaves the first error."""
        if inflight is None:
            return
        try:
            self._take(shard, computer, inflight, stats)
        except Exception:
            log.exception("the batch in flight could not be finished after an error in the next one")

    def _checkpoint(self, shard: Opened) -> None:
        """Make the buffered rows durable, and say so: to the parent, and as a `checkpoint` event with the
        rows it holds and the tokens computed for them (the report's throughput and tokens, the same count as the
        run log's: a pseudo-log-likelihood's masked copies, not only the rows' own tokens)."""
        writer = shard.writer
        rows = writer.buffered_rows
        tokens, self.unsaved_tokens = self.unsaved_tokens, 0
        writer.checkpoint()
        self.reporter.send("checkpoint", durable=writer.durable_rows)
        if rows:
            events.append(self.run_dir.events_path(self.rank), "checkpoint", rows=rows, tokens=tokens,
                          durable=writer.durable_rows)

    def _finish(self, shard: Opened, engine, computer: BatchComputer, stats: dict, t0: float) -> None:
        if hasattr(engine, "stats_line"):
            log.info("%s", engine.stats_line())
        row_bytes = computer.row_bytes(np.sort(shard.positions))
        _inputs_still_match(shard.index)
        self._checkpoint(shard)   # the last rows, as an event too (finalize would checkpoint them silently)
        earlier, held = int(shard.done.sum()), len(shard.positions)
        path = shard.writer.finalize(row_bytes)
        stats["seconds"] = time.monotonic() - t0
        self.stats = stats
        # (the counts are this attempt's: a resumed shard's file also holds the rows of earlier attempts)
        log.info("shard complete: %s (%d sequences, %d tokens, %.1f s, %.0f tok/s; computing %.1f s, %.0f tok/s)%s",
                 path, stats["sequences"], stats["tokens"], stats["seconds"], stats["tokens"] / max(stats["seconds"], 1e-9),
                 stats["compute_seconds"], stats["tokens"] / max(stats["compute_seconds"], 1e-9),
                 f"; with the {earlier:,} rows of earlier attempts it holds all {held:,}" if earlier > 0 else "")
        self.reporter.send("done", **stats)


def overlaps(on_gpu: bool) -> bool:
    """Whether batches overlap (batch k+1 read and launched before batch k's results are taken): on GPU workers,
    where the device computes while the host works; RUN_SHARDS_OVERLAP=1 or 0 says otherwise (the results are
    the same bits either way; a CPU worker computes at launch, so it has nothing to overlap)."""
    setting = overlap_setting()
    return on_gpu if setting is None else setting


@dataclass
class _InFlight:
    batch: LaunchedBatch
    sequences: int   # rows of the batch
    tokens: int      # tokens the batch was planned at


class _Ahead:
    """An iterator that can look one item ahead (`peek`: None at the end, or when producing the item failed: the
    error is raised by `next` then, in its turn)."""

    def __init__(self, items):
        self._items, self._next, self._error = iter(items), None, None

    def __iter__(self):
        return self

    def __next__(self):
        if self._next is None and self._error is None:
            self.peek()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        item, self._next = self._next, None
        if item is None:
            raise StopIteration
        return item

    def peek(self):
        if self._next is None and self._error is None:
            try:
                self._next = next(self._items)
            except StopIteration:
                return None
            except Exception as e:
                self._error = e
        return self._next


@dataclass
class _ReadFailed:
    """Reading a batch ahead failed: the error is raised when that batch's turn comes (it may never come: a stop
    first), after the batch before it is taken, as a serial loop would have met it."""
    error: BaseException


def _read(computer: BatchComputer, todo: np.ndarray, deferred: bool = False):
    """computer.prepare(todo); with `deferred`, an Exception is returned (as _ReadFailed) rather than raised."""
    if not deferred:
        return computer.prepare(todo)
    try:
        return computer.prepare(todo)
    except Exception as e:
        return _ReadFailed(e)


def _inputs_still_match(index) -> None:
    """For a run whose index predates record checksums (format 2 and older), before rows become durable:
    the FASTA files still hold what the index describes (a stat of each file; on a change, a re-read and its
    checksum), else the shard stops without keeping the rows computed since its last checkpoint, which may
    come from the edited text. With record checksums, every sequence is checked as it is read instead
    (`SequenceIndex.sequence`), which also catches an edit undone before the next checkpoint."""
    if index.checksums is not None or not index.stat_changes():
        return
    changed = records_changed(index)
    if changed:
        raise UserError(f"the input FASTA changed while this shard was computed ({changed}); the rows computed "
                        "since its last checkpoint were not kept, as they may come from the edited text")
