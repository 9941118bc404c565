"""A worker: one shard on one device, from the run directory alone.

Started by `torch.multiprocessing.spawn`; it pins itself to its GPU with CUDA_VISIBLE_DEVICES before
anything touches CUDA (CPU workers hide every GPU), logs to its own `worker_N.log`, reports progress to
the parent over its own pipe, and stops cleanly (final checkpoint, exit code 75) on SIGTERM / SIGINT /
SIGHUP or when the parent goes away.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

import numpy as np

from ..exits import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_USER_ERROR, explain_exit

log = logging.getLogger("run_shards.worker")


class StopFlag:
    def __init__(self):
        self.reason: str | None = None

    def set(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            log.warning("stopping after the current batch: %s", reason)

    def __bool__(self) -> bool:
        return self.reason is not None


class Reporter:
    """Messages to the parent; a broken pipe means the parent is gone, so the worker stops."""

    def __init__(self, conn, rank: int, stop: StopFlag):
        self.conn, self.rank, self.stop = conn, rank, stop

    def send(self, kind: str, **data) -> None:
        try:
            self.conn.send((kind, self.rank, time.time(), data))
        except (BrokenPipeError, EOFError, OSError):
            self.stop.set("lost contact with the parent process")


def worker_entry(i: int, root: str, ranks: list[int], conns: list, devices: list[str], threads: int,
                 parent: int) -> None:
    """Entry point for torch.multiprocessing.spawn (process i runs shard ranks[i]; `parent` is the pid of
    the process that started it, which the worker watches)."""
    rank = ranks[i]
    os.environ["CUDA_VISIBLE_DEVICES"] = devices[i] if devices else ""   # before anything touches CUDA
    from ..rundir.layout import RunDir
    run = RunDir(root)
    _setup_logging(run.worker_log(rank))
    stop = StopFlag()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, f: stop.set(f"received {signal.Signals(s).name}"))
    _on_parent_death(parent, lambda: stop.set(PARENT_GONE))
    reporter = Reporter(conns[i], rank, stop)
    log.info("worker for shard %d started (pid %d, %s, %d threads)", rank, os.getpid(),
             f"GPU {devices[i]}" if devices else "CPU", threads)
    code, message = EXIT_ERROR, ""
    try:
        from ..errors import UserError
        from index import FastaError
        try:
            code = ShardRun(run, rank, reporter, stop, threads, parent).run()
        except (UserError, FastaError) as e:
            log.error("%s", e)
            code, message = EXIT_USER_ERROR, str(e)
            reporter.send("error", message=message)
    except Exception as e:
        log.exception("worker failed")
        code, message = EXIT_ERROR, f"{type(e).__name__}: {e}"
        reporter.send("error", message=message)
    finally:
        log.info("worker for shard %d exits with code %d", rank, code)
        if code != EXIT_OK:
            _record_outcome(run, rank, code, message or (stop.reason or ""))
        logging.shutdown()
    # Leave without interpreter teardown: everything is durable or reported by now, and after a failed
    # write HDF5's exit-time cleanup can crash, which would turn a clear exit code into a segfault.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


PARENT_GONE = "the parent process is gone (killed, or its terminal closed)"


def _on_parent_death(parent: int, stop) -> None:
    """Call `stop` when the parent dies. torch's spawn asks the kernel for SIGINT then (PR_SET_PDEATHSIG),
    which reads like a Ctrl-C, and arrives while the parent's other threads still hold its pid; SIGUSR2 says
    only this. The batch loop also compares getppid() with `parent`, for a death before this point."""
    import ctypes
    signal.signal(signal.SIGUSR2, lambda s, f: stop())
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGUSR2))   # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        stop()


def _record_outcome(run, rank: int, code: int, reason: str) -> None:
    """Why this shard did not finish, in `shard_N.failed.json`, for `status` (the parent, when there is one,
    adds what only it saw, such as a kill). Not fatal when the disk is full."""
    run.record_failure(rank, {"exit_code": code, "explanation": explain_exit(code), "reason": reason,
                              "interrupted": code == EXIT_INTERRUPTED, "log": str(run.worker_log(rank)),
                              "log_tail": run.log_tail(rank)})


def _setup_logging(path) -> None:
    """Everything the worker prints goes to its own log: Python logging, and (through file descriptor 2)
    what native libraries such as HDF5 write to stderr, so the user's terminal shows only the parent."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stderr.flush()
    os.dup2(fd, 2)
    os.close(fd)
    handler = logging.FileHandler(path, mode="a")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    # After a failed write (disk full), h5py objects can fail again while being freed; that is already
    # reported, so such late errors get one log line instead of a traceback in the log's tail.
    sys.unraisablehook = lambda u: log.warning("ignored during cleanup: %s: %s", type(u.exc_value).__name__,
                                               str(u.exc_value).splitlines()[0] if str(u.exc_value) else "")


class ShardRun:
    def __init__(self, run, rank: int, reporter: Reporter, stop: StopFlag, threads: int, parent: int):
        self.run_dir, self.rank, self.reporter, self.stop, self.threads = run, rank, reporter, stop, threads
        self.parent_pid = parent

    def run(self) -> int:
        import torch

        from index import InputChanged, SequenceIndex
        from ..engine import selection as engines
        from .. import faults
        from ..errors import UserError
        from .batching import plan_batches
        from ..config import RunConfig
        from ..output.schema import Schema
        from ..output.shard_writer import ShardWriter
        from ..tasks import make_task, schema_for
        from ..tasks.tokenization import SequenceTokenizer

        manifest = self.run_dir.read_manifest()
        config = RunConfig.from_json(json.dumps(manifest["config"]))
        schema = Schema.from_json(manifest["schema"])
        index = SequenceIndex.load(self.run_dir.index_path)
        self._lock_shard()
        positions = index.stride_shard(self.rank, config.world)
        attrs = dict(manifest["attrs"], shard=self.rank, world=config.world)
        writer = ShardWriter(self.run_dir, self.rank, schema, attrs, positions,
                             config.checkpoint_sequences, config.checkpoint_seconds)
        if writer.complete:
            log.info("shard %d is already complete", self.rank)
            self.reporter.send("done", sequences=0, tokens=0, seconds=0.0, compute_seconds=0.0)
            return EXIT_OK
        done_mask = writer.is_done(positions)
        todo_tokens = int(index.lengths[positions[~done_mask]].sum())
        self.reporter.send("start", sequences=int((~done_mask).sum()), residues=todo_tokens)
        log.info("shard %d: %d sequences, %d to do (%d residues)", self.rank, len(positions),
                 int((~done_mask).sum()), todo_tokens)

        t0 = time.time()
        from .cpu_setup import keep_freed_memory, set_cpu_threads
        flushing = set_cpu_threads(self.threads)
        log.info("%d CPU thread(s); float denormals %s", self.threads,
                 "flushed to zero" if flushing else
                 "NOT flushed on every thread (unsupported, or torch's thread pool started first); CPU math on "
                 "tiny values may run slower, results are unaffected")
        if not config.on_gpu:
            log.info("malloc %s", "keeps freed memory for reuse" if keep_freed_memory() else
                     "left at its defaults (not glibc); CPU runs may spend more time in page faults")
        device = torch.device("cuda:0" if config.on_gpu else "cpu")
        dtype = getattr(torch, config.torch_dtype_name)
        model = manifest["model"]
        try:
            engine = engines.load(manifest["engine"], model["path"], device, dtype,
                                  logprobs=config.task == "score", fingerprint=model["fingerprint"], config=config,
                                  max_tokens=manifest["max_tokens"])
        except Exception as e:   # unreadable or damaged files (safetensors raises its own error type)
            if isinstance(e, torch.OutOfMemoryError):
                raise
            log.exception("loading the model failed")   # the traceback stays in the log
            raise UserError(f"cannot load the model from {model['path']} ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}); its files may be damaged: replace them "
                            f"with an intact copy, then run `run_shards rerun {self.run_dir.root}`") from None
        task = make_task(config, engine.info)
        if schema_for(task).to_json() != schema.to_json():
            raise RuntimeError("the model loaded in the worker does not match the run's schema")
        limit = manifest["max_tokens"]
        tokenizer = SequenceTokenizer(engine.tokenizer, max_tokens=limit if config.on_long == "truncate" else None)
        load_seconds = time.time() - t0
        self.reporter.send("loaded", seconds=load_seconds)
        log.info("model loaded on %s (%s, engine %s) in %.1f s", device, config.torch_dtype_name,
                 engine.info.name, load_seconds)

        tokens = tokenizer.tokens_for_residues(index.lengths[positions])
        cut = None
        if config.on_long == "window":   # long sequences run as windows: the engine sees (and budgets) those
            from ..engine.windowed import Windows, WindowedEngine
            cut = Windows(config.window, config.overlap, tokenizer.head, tokenizer.tail)
            engine = WindowedEngine(engine, cut)
            tokens = np.array([t if t <= cut.limit else cut.count(int(t)) * cut.limit for t in tokens], np.int64)
        computer = BatchComputer(index, engine, task, tokenizer, schema, config, limit, cut)
        if config.task == "generate":
            from .batching import plan_generate_batches
            batches = plan_generate_batches(tokens, config.max_seqs)
        else:
            batches = plan_batches(tokens, config.tokens_per_batch, config.max_seqs, padded=engine.info.name == "hf")
        stats = {"sequences": 0, "tokens": 0, "compute_seconds": 0.0}
        for k, (a, b) in enumerate(batches):
            if os.getppid() != self.parent_pid:
                self.stop.set(PARENT_GONE)
            if self.stop:
                break
            todo = positions[a:b][~done_mask[a:b]]
            if len(todo) == 0:
                continue
            faults.before_batch(self.rank, k)
            tc = time.time()
            try:
                block, ntokens = computer.rows(todo)
            except InputChanged as e:   # a record read differs from its checksum: nothing of it is kept
                raise UserError(f"shard {self.rank} stopped: {e}. Its rows up to its last checkpoint, each checked "
                                "when it was read, are kept; none computed since") from None
            stats["compute_seconds"] += time.time() - tc
            writer.add(block)
            stats["sequences"] += len(todo)
            stats["tokens"] += ntokens
            self.reporter.send("progress", sequences=len(todo), tokens=ntokens)
            if writer.due():
                _inputs_still_match(index)
                writer.checkpoint()
                self.reporter.send("checkpoint", durable=writer.durable_rows)
        if self.stop:
            _inputs_still_match(index)
            writer.checkpoint()
            self.reporter.send("checkpoint", durable=writer.durable_rows)
            log.warning("interrupted (%s): %d of %d sequences durable; `run_shards rerun` continues",
                        self.stop.reason, writer.durable_rows, len(positions))
            return EXIT_INTERRUPTED
        if hasattr(engine, "stats_line"):
            log.info("%s", engine.stats_line())
        row_bytes = computer.row_bytes(np.sort(positions))
        _inputs_still_match(index)
        path = writer.finalize(row_bytes)
        stats["seconds"] = time.time() - t0
        log.info("shard complete: %s (%d sequences, %d tokens, %.1f s, %.0f tok/s)", path, stats["sequences"],
                 stats["tokens"], stats["seconds"], stats["tokens"] / max(stats["seconds"], 1e-9))
        self.reporter.send("done", **stats)
        return EXIT_OK


    def _lock_shard(self, wait_seconds: float = 60.0) -> None:
        """One writer per shard, even if a worker of an earlier run (or a duplicate array task) still holds
        it: wait a while for it to finish its last checkpoint, then refuse, naming the holder."""
        import datetime
        import fcntl
        import socket

        from ..errors import RunDirError
        from ..rundir.layout import try_flock
        path = self.run_dir.shards_dir / f"shard_{self.rank}.lock"
        self._lock_fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        end = time.time() + wait_seconds
        while not try_flock(self._lock_fd, fcntl.LOCK_EX, path):
            if time.time() > end:
                try:
                    holder = json.loads(os.pread(self._lock_fd, 4096, 0) or b"{}")
                except ValueError:
                    holder = {}
                who = (f"pid {holder.get('pid')} on {holder.get('host')}" + (f", SLURM task {holder['slurm']}"
                       if holder.get("slurm") else "") + f", since {holder.get('since')}") if holder else "another process"
                raise RunDirError(f"shard {self.rank} is being computed by {who}, still after {wait_seconds:.0f} s; "
                                  "it is not computed twice. If that process is gone or hung, stop it, then "
                                  f"`run_shards rerun {self.run_dir.root}`") from None
            time.sleep(0.5)
        task = os.environ.get("SLURM_ARRAY_JOB_ID")
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "since": datetime.datetime.now().isoformat(timespec="seconds"),
                  "slurm": f"{task}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if task else ""}
        try:
            os.ftruncate(self._lock_fd, 0)
            os.pwrite(self._lock_fd, json.dumps(holder).encode(), 0)
        except OSError:
            pass   # a full disk: the lock holds all the same


class BatchComputer:
    """Rows for a batch of positions: statuses, tokenization, the engine (split on OOM), the task."""

    def __init__(self, index, engine, task, tokenizer, schema, config, limit: int | None, windows=None):
        self.index, self.engine, self.task, self.tokenizer = index, engine, task, tokenizer
        self.schema, self.config, self.limit, self.windows = schema, config, limit, windows

    def row_bytes(self, positions: np.ndarray) -> np.ndarray:
        fixed = sum(c.row_bytes() for c in self.schema.row_columns)
        per_token = sum(c.row_bytes() for c in self.schema.ragged_columns)
        return fixed + per_token * self.tokenizer.tokens_for_residues(self.index.lengths[positions])

    def rows(self, todo: np.ndarray):
        from ..output import status_codes as sc
        from ..errors import UserError
        from ..output.schema import RowBlock

        n = len(todo)
        lengths = self.index.lengths[todo].astype(np.int32)
        status = np.zeros(n, np.int8)
        truncated = np.zeros(n, bool)
        num_tokens = np.zeros(n, np.int32)
        status[lengths == 0] = sc.EMPTY
        candidates = np.flatnonzero(lengths > 0)
        # (A batch of empty records only has nothing to tokenize: tokenizers fail on an empty list.)
        toks = self.tokenizer.encode([self.index.sequence(int(todo[i])) for i in candidates]) if len(candidates) else []
        compute = []
        for i, t in zip(candidates, toks):
            if self.limit and len(t.ids) > self.limit and not self.windows:   # only when not truncating
                if self.config.on_long == "skip":
                    status[i] = sc.SKIPPED_TOO_LONG
                    continue
                raise UserError(f"sequence '{self.index.id(int(todo[i]))}' has {len(t.ids)} tokens, over the "
                                f"model's limit of {self.limit}; choose --on-long truncate or skip")
            truncated[i] = t.truncated
            if t.unknown:
                status[i] = sc.UNKNOWN_RESIDUES
            compute.append((int(i), t))
        results = self._run(compute, todo) if compute else []
        columns = {c.path: c.empty(n) for c in self.schema.row_columns if c.path not in _BASE}
        ragged_lengths = {g: np.zeros(n, np.int64) for g in self.schema.ragged_groups}
        values = {c.path: [] for c in self.schema.ragged_columns}
        for items, out in results:
            rows = np.array([i for i, _ in items])
            if out is None:
                status[rows] = sc.OUT_OF_MEMORY
                continue
            num_tokens[rows] = [len(t.ids) for _, t in items]
            if self.windows:
                columns["windows"][rows] = [self.windows.count(len(t.ids)) for _, t in items]
            for k, v in out.columns.items():
                columns[k][rows] = v
            for g, lens in out.lengths.items():
                ragged_lengths[g][rows] = lens
            for k, v in out.values.items():
                values[k].append(v)
        columns.update({
            "ids": np.array([self.index.id_bytes(int(p)) for p in todo], dtype=object),
            "index": todo.astype(np.int64), "lengths": lengths, "num_tokens": num_tokens,
            "truncated": truncated, "status": status,
        })
        values = {c.path: np.concatenate(values[c.path]) if values[c.path] else c.empty(0)
                  for c in self.schema.ragged_columns}
        return RowBlock(self.schema, columns, values, ragged_lengths), int(num_tokens.sum())

    def _run(self, items: list, todo: np.ndarray):
        """[(items, TaskOutput or None)] in item order; an out-of-memory batch is halved until it fits."""
        import torch

        from ..engine.interface import OutOfMemory
        from .. import faults
        try:
            batch = [t.ids for _, t in items]
            faults.maybe_out_of_memory(batch, padded=self.engine.info.name == "hf")
            return [(items, self.task.run(self.engine, [t for _, t in items], todo[[i for i, _ in items]]))]
        except (OutOfMemory, torch.OutOfMemoryError) as e:
            _release_memory()
            if len(items) == 1:
                log.warning("out of memory on a single sequence of %d tokens (%s); marking it",
                            len(items[0][1].ids), str(e).splitlines()[0] if str(e) else "OOM")
                return [(items, None)]
            half = len(items) // 2
            log.info("out of memory on a batch of %d sequences; splitting it in two", len(items))
            return self._run(items[:half], todo) + self._run(items[half:], todo)


_BASE = {"ids", "index", "lengths", "num_tokens", "truncated", "status"}


def _inputs_still_match(index) -> None:
    """For a run whose index predates record checksums (format 2 and older), before rows become durable:
    the FASTA files still hold what the index describes (a stat of each file; on a change, a re-read and its
    checksum), else the shard stops without keeping the rows computed since its last checkpoint, which may
    come from the edited text. With record checksums, every sequence is checked as it is read instead
    (`SequenceIndex.sequence`), which also catches an edit undone before the next checkpoint."""
    if index.checksums is not None or not index.stat_changes():
        return
    from ..errors import UserError
    changed = index.records_changed()
    if changed:
        raise UserError(f"the input FASTA changed while this shard was computed ({changed}); the rows computed "
                        "since its last checkpoint were not kept, as they may come from the edited text")


def _release_memory() -> None:
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
