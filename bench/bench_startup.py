#!/usr/bin/env python3
"""A run's fixed costs: the parent's planning ("prepare") and a worker's start up to its first batch.

    python bench/bench_startup.py CHECKPOINT FASTA [--gpus 1] [--runs 3] [--cold] [--out bench/out/startup.md]

CHECKPOINT and FASTA are made where missing: an ESM-2 650M-shaped checkpoint with random bfloat16 weights
and the ESM tokenizer (1.3 GB), and 10,000 `tools/make_fasta.py --seed 1` sequences (3.45M residues).

Three measurements, each in fresh processes (imports and caches as a user's run sees them; the index cache
is warmed once first, as a second run on the same file finds it):

- `run`: the real CLI (`run_shards FASTA --model CHECKPOINT --on-long truncate`, one worker) until its worker
  says it is loaded (events_0.jsonl), then stopped. Prepare = the command's start to its first worker spawned;
  worker ready = that spawn to the worker's `loaded` event. Read from run.log and the events, as a user sees
  them (milliseconds).
- `prepare phases`: the parent's steps in one process, each timed where the real code calls it (the
  planning functions wrapped with a timer), wall and CPU seconds, up to the launcher (not called).
- `worker phases`: what a worker does before its first batch, in one process, on the run the phases
  planned: imports, open the shard, device set-up, the engine's parts (model build, weights, tokenizer,
  caches), the task; `--first-batch` adds the first batch (on a GPU: CUDA kernels' and Triton's first-use
  costs).

`--cold` drops the checkpoint's weight files from the page cache before each run (posix_fadvise), as on a
machine that has not read them since it started. Times are medians over `--runs`; on a shared machine read
the CPU seconds beside the wall seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


# ---------------------------------------------------------------------------------------------------------
# In a child process: the parent's phases, or a worker's.

class _Clock:
    """Phases in order, each (name, wall seconds, CPU seconds); `wrap` times a function where the code calls it."""

    def __init__(self):
        self.phases: list[tuple[str, float, float]] = []
        self.depth = 0

    def wrap(self, owner, name: str, label: str) -> None:
        fn = getattr(owner, name)
        clock = self

        def timed(*args, **kwargs):
            if clock.depth:   # a phase inside another is the outer one's time
                return fn(*args, **kwargs)
            clock.depth += 1
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.depth -= 1
                clock.phases.append((label, time.perf_counter() - wall, time.process_time() - cpu))
        setattr(owner, name, timed)

    def span(self, label: str, wall: float, cpu: float) -> None:
        self.phases.append((label, time.perf_counter() - wall, time.process_time() - cpu))

    def dump(self) -> None:
        print("PHASES " + json.dumps(self.phases), flush=True)


class _LaunchReached(Exception):
    pass


def _child_parent(argv: list[str]) -> None:
    """Plan the run as `run_shards` does, each step timed; stop where the launcher would start workers."""
    wall, cpu = time.perf_counter(), time.process_time()
    clock = _Clock()
    sys.path.insert(0, str(REPO))
    from pipeline.models.transformers_imports import keep_import_structure
    keep_import_structure()   # as cli.entry does, before anything imports transformers
    from pipeline import api, cli, launchers
    from pipeline.models import checkpoint
    from pipeline.planning import devices, plan as plan_mod
    clock.span("import run_shards' CLI and api", wall, cpu)
    w, c = time.perf_counter(), time.process_time()
    import torch  # noqa: F401 - the CLI imports it first for the GPU count (planning/devices.py)
    clock.span("import torch", w, c)
    clock.wrap(devices, "resolve", "devices")
    clock.wrap(plan_mod, "read_inputs", "index (build or reuse) and input policies")
    for name, label in (("resolve", "model: resolve, fingerprint, header check"),
                        ("read_config", "model: config (imports transformers)"),
                        ("read_tokenizer", "model: tokenizer"), ("describe", "model: describe (token limit)")):
        clock.wrap(checkpoint, name, label)
    clock.wrap(plan_mod, "decide_and_check", "tokenization check on a sample")
    clock.wrap(plan_mod, "_fit_lengths", "lengths against the limit")
    clock.wrap(plan_mod, "plan_copies", "copies (duplicates, --reuse)")
    clock.wrap(plan_mod, "check_storage", "storage estimate")
    clock.wrap(plan_mod.Plan, "record", "write index and manifest")
    clock.wrap(checkpoint, "check_unchanged", "model unchanged (before launch)")
    clock.wrap(api, "_settled_states", "shard states")
    try:
        from pipeline.launchers import early_workers   # (not in runs before workers started while planning)
        clock.wrap(early_workers, "start_early", "spawn the workers that start while planning")
    except ImportError:
        pass
    started = {}

    def launch(job):
        started["t"] = (time.perf_counter(), time.process_time())
        raise _LaunchReached()
    launchers.launch = launch
    sys.argv = ["run_shards", *argv]
    try:
        cli.entry()
    except (_LaunchReached, SystemExit):
        pass
    if "t" not in started:
        raise SystemExit("planning did not reach the launcher (see the output above)")
    total_wall, total_cpu = started["t"][0] - wall, started["t"][1] - cpu
    named_wall, named_cpu = sum(p[1] for p in clock.phases), sum(p[2] for p in clock.phases)
    clock.phases.append(("the rest (task, schema, logs, lock, ...)", total_wall - named_wall, total_cpu - named_cpu))
    clock.dump()


def _child_worker(root: str, device: str | None, threads: int, first_batch: bool) -> None:
    """What a spawned worker does before its first batch (worker/entry.py, ShardRun), each part timed."""
    wall, cpu = time.perf_counter(), time.process_time()
    os.environ["CUDA_VISIBLE_DEVICES"] = device if device is not None else ""
    clock = _Clock()
    sys.path.insert(0, str(REPO))
    from pipeline.worker import entry   # what the spawned process imports to find worker_entry
    entry.keep_import_structure()   # as worker_entry does first
    clock.span("imports (torch, transformers' first parts, run_shards)", wall, cpu)
    from pipeline.engine import native
    from pipeline.models import checkpoint, registry
    from pipeline.rundir.layout import RunDir
    from pipeline.rundir.locks import ShardLock
    from pipeline.worker import shard_run
    from pipeline.worker.shard_run import Reporter, ShardRun, StopFlag
    clock.wrap(ShardRun, "_open", "open the shard (manifest, index, writer)")
    clock.wrap(registry, "load_model", "model: build and load weights")
    clock.wrap(checkpoint, "read_config", "engine: config")
    clock.wrap(checkpoint, "read_tokenizer", "engine: tokenizer")
    init = native.NativeEngine.__init__
    clock.wrap(native.NativeEngine, "__init__", "engine: caches and runner on the device")
    clock.wrap(shard_run, "make_task", "task")
    w, c = time.perf_counter(), time.process_time()
    if hasattr(entry, "prepare_worker"):   # what a worker started while planning does before its shard is known
        entry.prepare_worker(device is not None)
        clock.span("prepare: transformers and engine imports" + (", CUDA context" if device else ""), w, c)
    elif device is not None:   # (runs before that: the CUDA context alone, which the load would create)
        import torch
        torch.zeros(1, device="cuda")
        clock.span("CUDA context", w, c)

    class Pipe:
        def send(self, message):
            pass
    run = RunDir(root)
    lock = ShardLock(run, 0)
    lock.acquire()
    shard = ShardRun(run, 0, Reporter(Pipe(), 0, StopFlag()), StopFlag(), threads, os.getppid(), lock,
                     f"GPU {device}" if device is not None else "CPU")
    try:
        opened = shard._open()
        w, c = time.perf_counter(), time.process_time()
        engine, task, tokenizer = shard._load_engine(opened)
        total = (time.perf_counter() - w, time.process_time() - c)
        inner = [p for p in clock.phases if p[0].startswith(("model", "engine", "task"))]
        clock.phases.append(("the rest of the load (threads, checks, ...)", total[0] - sum(p[1] for p in inner),
                             total[1] - sum(p[2] for p in inner)))
        if first_batch:
            w, c = time.perf_counter(), time.process_time()
            _, computer, batches, _ = shard._plan(opened, engine, task, tokenizer)
            a, b = batches[0]
            computer.rows(opened.positions[a:b])
            if device is not None:
                import torch
                torch.cuda.synchronize()
            clock.span(f"first batch ({b - a} sequences)", w, c)
    finally:
        native.NativeEngine.__init__ = init
        lock.release()
    clock.dump()


# ---------------------------------------------------------------------------------------------------------
# In the bench's own process.

def _make_inputs(checkpoint: Path, fasta: Path) -> None:
    """Where missing: an ESM-2 650M-shaped checkpoint (EsmForMaskedLM, random bfloat16 weights, the ESM
    tokenizer; as bench/bench_pll.py writes one) and 10,000 `make_fasta.py --seed 1` sequences, the issue's
    run without a download. Built on the CPU, in a child process: this one never touches the GPU."""
    if not (checkpoint / "config.json").exists():
        code = (f"import sys, torch; sys.path.insert(0, {str(REPO / 'bench')!r}); sys.path.insert(0, {str(REPO)!r})\n"
                "from pathlib import Path\n"
                "from bench_pll import ESM2_COMMON, ESM_VOCAB, SHAPES\n"
                "from transformers import EsmConfig, EsmForMaskedLM, EsmTokenizer\n"
                f"path = Path({str(checkpoint)!r}); path.mkdir(parents=True, exist_ok=True)\n"
                "(path / 'vocab.txt').write_text('\\n'.join(ESM_VOCAB) + '\\n')\n"
                "EsmTokenizer(str(path / 'vocab.txt'), model_max_length=1024).save_pretrained(path)\n"
                "torch.manual_seed(0); torch.set_default_dtype(torch.bfloat16)\n"
                "config = EsmConfig(**SHAPES['esm2-650m'], **ESM2_COMMON, dtype='bfloat16')\n"
                "EsmForMaskedLM(config).save_pretrained(path)\n")
        subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    if not fasta.exists():
        subprocess.run([sys.executable, str(REPO / "tools" / "make_fasta.py"), "--n", "10000", "--seed", "1",
                        str(fasta)], check=True, capture_output=True)


def _evict(checkpoint: Path) -> None:
    """Drop the checkpoint's weight files from the page cache (clean pages only; no root needed)."""
    for f in checkpoint.iterdir():
        if f.suffix in (".safetensors", ".bin", ".pt"):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _phases(args: list[str], env: dict) -> list[tuple[str, float, float]]:
    done = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True)
    line = next((x for x in done.stdout.splitlines() if x.startswith("PHASES ")), None)
    if done.returncode or line is None:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"{args[0]} failed ({done.returncode})")
    return [tuple(p) for p in json.loads(line[len("PHASES "):])]


def _log_times(path: Path) -> list[tuple[float, str]]:
    out = []
    for line in path.read_text().splitlines():
        m = LOG_TIME.match(line)
        if m:
            t = time.mktime(time.strptime(m.group(1)[:19], "%Y-%m-%d %H:%M:%S")) + int(m.group(1)[20:]) / 1000
            out.append((t, line[m.end():]))
    return out


def _events(path: Path) -> list[dict]:
    """The whole lines of an events file being written."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(x) for x in text[:text.rfind("\n") + 1].splitlines() if x.strip()]


def _real_run(cli_args: list[str], out: Path, env: dict, limit: float = 600.0) -> dict:
    """The CLI until its worker is loaded: (prepare, worker ready) and their parts, from its own logs."""
    shutil.rmtree(out, ignore_errors=True)
    began = time.time()
    proc = subprocess.Popen([sys.executable, str(REPO / "bin" / "run_shards"), *cli_args, "--out", str(out),
                             "--no-progress"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    events = out / "logs" / "events_0.jsonl"
    loaded = None
    while loaded is None and proc.poll() is None and time.time() - began < limit:
        time.sleep(0.05)
        loaded = next((e for e in _events(events) if e.get("event") == "loaded"), None)
    cpu = _cpu_seconds(proc.pid)   # the command's and its workers', up to the load (within 50 ms)
    proc.send_signal(signal.SIGINT)   # twice: the second kills the worker at once, mid-batch (nothing to keep)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if loaded is None:
        raise SystemExit(f"the run ended before its worker loaded:\n{proc.stderr.read()[-3000:]}")
    lines = _log_times(out / "logs" / "run.log")
    first = lines[0][0]
    spawned = next(t for t, text in lines if "started shard 0" in text)
    start = next(e for e in _events(events) if e.get("event") == "start")
    return {"before planning (python, imports, devices)": (first - began, None), "planning": (spawned - first, None),
            "prepare (command start to its worker given the shard)": (spawned - began, None),
            "worker: shard given to shard opened (imports, lock)": (start["t"] - spawned, None),
            "worker: opened to loaded": (loaded["t"] - start["t"], None),
            "worker ready (shard given to loaded)": (loaded["t"] - spawned, None),
            "command start to worker loaded (CPU: the command's and its workers')": (loaded["t"] - began, cpu)}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` and its live children (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry) == pid or int(fields[1]) == pid:   # fields[1]: the parent's pid; [11], [12]: utime, stime
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _table(title: str, rows: list[tuple[str, list[float], list[float] | None]]) -> list[str]:
    lines = [f"**{title}**", "", "| phase | wall s (median) | CPU s (median) |", "| --- | ---: | ---: |"]
    for name, walls, cpus in rows:
        cpu = f"{statistics.median(cpus):.2f}" if cpus else ""
        lines.append(f"| {name} | {statistics.median(walls):.2f} | {cpu} |")
    return lines + [""]


def _collect(runs: list[list[tuple[str, float, float]]]) -> list[tuple[str, list[float], list[float]]]:
    names: list[str] = []
    for r in runs:
        names += [p[0] for p in r if p[0] not in names]
    rows = []
    for n in names:
        walls = [sum(p[1] for p in r if p[0] == n) for r in runs]
        cpus = [sum(p[2] for p in r if p[0] == n) for r in runs]
        rows.append((n, walls, cpus))
    rows.append(("total", [sum(p[1] for p in r) for r in runs], [sum(p[2] for p in r) for r in runs]))
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_parent":
        return _child_parent(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        device = None if sys.argv[3] == "cpu" else sys.argv[3]
        return _child_worker(sys.argv[2], device, int(sys.argv[4]), sys.argv[5] == "1")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("fasta", type=Path)
    ap.add_argument("--gpus", type=int, default=0, help="0: one CPU worker; 1: one GPU worker")
    ap.add_argument("--threads", type=int, default=0, help="CPU worker threads (0: run_shards' default)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="evict the weights from the page cache before each run")
    ap.add_argument("--first-batch", action="store_true", help="worker phases: time the first batch too")
    ap.add_argument("--skip", default="", help="comma-separated: run, phases")
    ap.add_argument("--out", type=Path, default=None, help="also write the tables here (markdown)")
    ap.add_argument("extra", nargs="*", help="more run_shards options, after --")
    args = ap.parse_args()
    _make_inputs(args.checkpoint, args.fasta)
    work = Path(tempfile.mkdtemp(prefix="bench_startup_"))
    env = dict(os.environ, RUN_SHARDS_REPORT="0", RUN_SHARDS_CACHE=str(work / "cache"))
    env.pop("TRITON_INTERPRET", None)
    where = ["--gpus", "1"] if args.gpus else ["--gpus", "0", "--workers", "1"]
    if args.threads:
        where += ["--threads", str(args.threads)]
    cli_args = [str(args.fasta.resolve()), "--model", str(args.checkpoint.resolve()), "--on-long", "truncate",
                *where, *args.extra]
    skip = set(filter(None, args.skip.split(",")))
    _phases(["_parent", *cli_args, "--out", str(work / "warm")], env)   # the index cache, as a second run finds it
    size = sum(f.stat().st_size for f in args.checkpoint.iterdir()) / 1e9
    header = [f"bench_startup: {args.checkpoint.name} ({size:.2f} GB), "
              f"{args.fasta.name}, {'1 GPU' if args.gpus else '1 CPU worker'}, {args.runs} run(s), "
              f"{'cold' if args.cold else 'warm'} page cache, {os.cpu_count()} CPU cores, load average "
              f"{os.getloadavg()[0]:.1f}", ""]
    lines = list(header)
    if "run" not in skip:
        real = []
        for k in range(args.runs):
            if args.cold:
                _evict(args.checkpoint)
            real.append(_real_run(cli_args, work / f"run{k}", env))
        rows = [(name, [r[name][0] for r in real], None if real[0][name][1] is None else [r[name][1] for r in real])
                for name in real[0]]
        lines += _table("run_shards as a user runs it (from its logs)", rows)
    if "phases" not in skip:
        parents, workers = [], []
        threads = str(args.threads or 1)
        for k in range(args.runs):
            out = work / f"phases{k}"
            shutil.rmtree(out, ignore_errors=True)
            parents.append(_phases(["_parent", *cli_args, "--out", str(out)], env))
            if args.cold:
                _evict(args.checkpoint)
            workers.append(_phases(["_worker", str(out), "0" if args.gpus else "cpu", threads,
                                    "1" if args.first_batch else "0"], env))
        lines += _table("prepare, by phase (one process, up to the launcher)", _collect(parents))
        lines += _table("worker ready, by phase (one process, on the run planned above)", _collect(workers))
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
