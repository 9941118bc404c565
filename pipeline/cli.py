"""The `run_shards` command line: parse options, call one function of `pipeline.api` (or of a room for index, status, work and report), print.

    run_shards [run] FASTA... [options]     embed or score every sequence, merged into OUT/result.h5
    run_shards index FASTA...              build or refresh the index, print statistics
    run_shards status OUT                  per-shard state, progress and failures
    run_shards rerun OUT [--shards 1,3]    re-run failed or unfinished shards from their checkpoints
    run_shards merge OUT                   merge and validate (run automatically at the end of `run`)
    run_shards work OUT [--shard K]        compute one shard of a planned run (what a SLURM / Ray task runs)
"""
from __future__ import annotations

import logging
import sys

import click

from . import __version__
from .models.registry import families_help

COMMANDS = ("run", "index", "status", "rerun", "merge", "work", "report")


class DefaultRunGroup(click.Group):
    """`run_shards input.fasta ...` means `run_shards run input.fasta ...`."""

    def parse_args(self, ctx, args):
        if args and args[0] not in COMMANDS and args[0] not in ("--help", "-h", "--version"):
            args = ["run"] + list(args)
        return super().parse_args(ctx, args)


class _TqdmHandler(logging.Handler):
    """Log lines printed above the progress bar instead of through it."""

    def emit(self, record):
        from tqdm import tqdm
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def _setup_logging(quiet: bool) -> None:
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("%(levelname).1s %(message)s"))
    handler.setLevel(logging.WARNING if quiet else logging.INFO)
    for name in ("run_shards", "index", "pipeline"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _fail(error: Exception | str, code: int = 2, label: str = "error") -> None:
    import os

    from .errors import DiskFull
    click.echo(f"{label}: {error}", err=True)
    if isinstance(error, DiskFull):   # HDF5 may be left damaged by the failed write: skip its teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP outside the supervisor (which handles them while workers run), raised like Ctrl-C."""


def _raise_interrupted(signum, frame):
    import signal
    raise Interrupted(signal.Signals(signum).name)


def _call(fn, *args, **kwargs):
    """Run one step of a command: user errors, interruptions and a full disk become one clear line (no
    traceback)."""
    import signal

    from index import FastaError

    from .errors import RunFailed, UserError, disk_full_reason
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupted)
    try:
        result = fn(*args, **kwargs)
    except RunFailed as e:
        _fail(e, e.exit_code, e.label)
    except (UserError, FastaError) as e:
        _fail(e)
    except KeyboardInterrupt as e:
        name = str(e) if isinstance(e, Interrupted) else "SIGINT"
        _fail(f"by {name}; nothing written was lost (unfinished files are removed): run the same command "
              "again to continue", 130, "interrupted")
    except OSError as e:
        reason = disk_full_reason(e)
        if not reason:
            raise
        _fail(f"cannot write {e.filename or 'a file'}: {reason}. Nothing partial was kept; free space and run "
              "the same command again")
    return result


def _result_is_durable() -> None:
    """Called once a command's result is on disk: from then on stop signals are ignored, so a SIGTERM during
    the interpreter's teardown cannot turn a finished run into exit code 143."""
    import signal
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


POSITIVE = click.FloatRange(min=0, min_open=True)

# Options that only mean something for some tasks: given explicitly with another task they are a mistake
# (e.g. --temperature without --task generate), not something to ignore.
TASK_OPTIONS = {"generate": ("max_new_tokens", "temperature", "top_p", "seed"),
                "embed": ("pools", "layers", "per_residue", "per_residue_dtype")}
LAUNCHER_OPTIONS = {"slurm": ("sbatch", "shards_per_task", "array_throttle", "dry_run", "wait"),
                    "ray": ("ray_address",)}


def _check_owned_options(ctx: click.Context, owners: dict, value: str, what: str) -> None:
    """Options that only mean something for one task (or launcher) are a mistake with another one."""
    from click.core import ParameterSource
    for owner, names in owners.items():
        given = [n for n in names if owner != value and ctx.get_parameter_source(n) == ParameterSource.COMMANDLINE]
        if given:
            opts = ", ".join(next(p.opts[0] for p in ctx.command.params if p.name == n) for n in given)
            verb = "applies" if len(given) == 1 else "apply"
            raise click.UsageError(f"{opts} {verb} only to --{what} {owner} (this run's {what} is {value})")


def _int_list(value: str | None, option: str) -> list[int]:
    if not value:
        return []
    try:
        return [int(v) for v in value.replace(" ", "").split(",") if v]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}", param_hint=option) from None


@click.group(cls=DefaultRunGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="run_shards")
def main():
    """Sharded inference for sequence models over FASTA: every sequence, one validated HDF5 file.

    `run_shards input.fasta` embeds every sequence with the bundled demo model on all visible GPUs (or
    on CPU) and writes run_shards_out/result.h5. Workers checkpoint as they go; if one fails, the others
    finish and `run_shards rerun OUT` continues from the checkpoints.
    """


@main.command("run")
@click.argument("fasta", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--out", "-o", default="run_shards_out", show_default=True, type=click.Path(file_okay=False),
              help="Run directory: shards, logs, manifest and the merged result.h5.")
@click.option("--model", "-m", default="demo", show_default=True,
              help="Checkpoint directory, Hugging Face hub id, or 'demo' (bundled; random weights).")
@click.option("--task", type=click.Choice(["embed", "score", "generate"]), default="embed", show_default=True,
              help="embed: pooled hidden states; score: log-likelihood under a causal LM; generate: continue "
                   "each sequence (native engine).")
@click.option("--gpus", default="auto", show_default=True,
              help="GPUs to use, one worker each; 'auto' = all visible, else CPU workers; 0 = CPU. With --launcher slurm "
                   "or ray: whether each shard gets a GPU (slurm auto: when --sbatch asks for GPUs; ray auto: CPU).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="CPU workers when running on CPU (default: one per core, at most 4; each loads the model).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="torch threads per worker (default: the CPU cores divided between the workers).")
@click.option("--engine", type=click.Choice(["auto", "native", "hf"]), default="auto", show_default=True,
              help=families_help() + "; auto: native where it runs the checkpoint.")
@click.option("--input-format", type=click.Choice(["auto", "plain", "spaced"]), default="auto", show_default=True,
              help="How residues are written for the tokenizer: auto = the model family's card (docs/models.md).")
@click.option("--trust-remote-code", is_flag=True, help="Let transformers run a checkpoint's own Python code (hf).")
@click.option("--max-tokens-per-batch", type=click.IntRange(min=1), default=None,
              help="Token budget per batch (padded tokens for hf). Default 4096 on CPU, 32768 on GPU.")
@click.option("--max-seqs", type=click.IntRange(min=1), default=256, show_default=True,
              help="Most sequences per batch.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
              show_default=True, help="Model dtype; auto = float32 on CPU, bfloat16 on GPU.")
@click.option("--pool", "pools", default="mean", show_default=True, help="Pooled embeddings: mean,cls,last.")
@click.option("--layers", default="-1", show_default=True,
              help="Hidden states to pool, comma-separated: 0 = token embeddings, -1 = final norm output.")
@click.option("--per-residue", is_flag=True, help="Also store every residue's hidden state (CSR layout).")
@click.option("--per-residue-dtype", type=click.Choice(["float16", "float32"]), default="float16", show_default=True)
@click.option("--on-long", type=click.Choice(["error", "truncate", "skip", "window"]), default="error",
              show_default=True,
              help="Sequences over the model's length limit: stop before any work, cut, keep as skipped rows, or "
                   "run as overlapping windows stitched into one row (embed, score).")
@click.option("--window", type=click.IntRange(min=2), default=None,
              help="--on-long window: tokens per window, special tokens included (default: the model's limit).")
@click.option("--overlap", type=click.IntRange(min=0), default=None,
              help="--on-long window: residue tokens neighbouring windows share (default: a quarter of a window).")
@click.option("--max-length", type=click.IntRange(min=1), default=None,
              help="Per-sequence token limit (special tokens included; default: the model's own limit, if any).")
@click.option("--on-duplicate-id", type=click.Choice(["error", "rename"]), default="error", show_default=True,
              help="rename: suffix repeated ids ('x.dup2') and keep the originals in the output.")
@click.option("--skip-empty", is_flag=True, help="Keep records without residues as rows with status 3.")
@click.option("--batch-invariant/--no-batch-invariant", default=True, show_default=True,
              help="native engine on CPU: every stored value the same bits whatever the number of workers, the "
                   "token budget and the other sequences of a batch (docs/engine.md); off: up to a few percent "
                   "faster, values may differ in the last bits.")
@click.option("--checkpoint-every", "checkpoint_sequences", type=click.IntRange(min=1), default=20000,
              show_default=True,
              help="Checkpoint at least every N sequences per worker.")
@click.option("--checkpoint-seconds", type=POSITIVE, default=60.0, show_default=True,
              help="...and at least every S seconds (bounds what a crash can lose).")
@click.option("--worker-timeout", type=POSITIVE, default=1800.0, show_default=True,
              help="Kill a worker that reports no progress for this many seconds.")
@click.option("--summary-seconds", type=POSITIVE, default=30.0, show_default=True,
              help="Summary line interval.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="generate: new tokens per sequence.")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="generate: 0 = greedy.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True,
              help="generate: nucleus sampling mass.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="generate: run seed; with the sequence's FASTA position it fixes what each sequence samples.")
@click.option("--launcher", type=click.Choice(["local", "slurm", "ray"]), default="local", show_default=True,
              help="local: workers on this machine; slurm: a job array plus a merge job; ray: one task per shard "
                   "on a Ray cluster.")
@click.option("--shards", type=click.IntRange(min=1), default=None,
              help="Number of shards W (default: one per GPU or CPU worker; required with slurm and ray).")
@click.option("--sbatch", default="", help="slurm: more sbatch options, e.g. \"--partition=gpu --time=12:00:00\".")
@click.option("--shards-per-task", type=click.IntRange(min=1), default=1, show_default=True,
              help="slurm: shards per array task, one worker per GPU of the task (for whole-node allocations).")
@click.option("--array-throttle", type=click.IntRange(min=0), default=0,
              help="slurm: at most N array tasks at once (sbatch --array=...%N).")
@click.option("--dry-run", is_flag=True, help="slurm: write OUT/slurm/*.sbatch and print the sbatch commands only.")
@click.option("--wait", is_flag=True, help="slurm: after submitting, follow until merged (or a shard failed).")
@click.option("--ray-address", default="",
              help="ray: the cluster's address (e.g. auto, or HOST:PORT); default: RAY_ADDRESS, a `ray start` "
                   "cluster on this machine, else a new local Ray. GPUs: pass --gpus 1 (one per shard).")
@click.option("--no-progress", is_flag=True, help="No progress bar (log lines only).")
@click.option("--quiet", "-q", is_flag=True, help="Only warnings and errors on the terminal.")
def run_command(fasta, out, model, task, gpus, workers, threads, engine, max_tokens_per_batch, max_seqs, dtype, pools,
                layers, per_residue, per_residue_dtype, on_long, window, overlap, max_length, on_duplicate_id,
                skip_empty, batch_invariant, input_format, trust_remote_code, checkpoint_sequences, checkpoint_seconds,
                worker_timeout, summary_seconds, max_new_tokens,
                temperature, top_p, seed, launcher, shards, sbatch, shards_per_task, array_throttle, dry_run, wait,
                ray_address, no_progress, quiet):
    """Run a model over every sequence of FASTA file(s) and merge the result into OUT/result.h5."""
    import os

    from .planning import devices
    from .config import RunConfig
    from .api import run

    ctx = click.get_current_context()
    _check_owned_options(ctx, TASK_OPTIONS, task, "task")
    _check_owned_options(ctx, LAUNCHER_OPTIONS, launcher, "launcher")
    if (window is not None or overlap is not None) and on_long != "window":
        raise click.UsageError("--window and --overlap apply to --on-long window")
    pools = list(dict.fromkeys(p for p in pools.replace(" ", "").split(",") if p))   # repeats once
    _setup_logging(quiet)
    if launcher == "local":
        gpu_ids, nworkers, threads = _call(devices.resolve, gpus, workers, threads)
    else:   # decided here for every shard; each task uses the devices its node gives it
        gpu_ids, nworkers = (["0"] if _call(devices.resolve_for_tasks, gpus, sbatch) else []), 1
        threads = threads or 1
    config = _call(RunConfig, fasta=[os.path.abspath(f) for f in fasta], out=out, model=model, task=task,
                   engine=engine, devices=gpu_ids, workers=nworkers, threads_per_worker=threads,
                   max_tokens_per_batch=max_tokens_per_batch or 0, max_seqs=max_seqs, dtype=dtype, pools=pools,
                   layers=_int_list(layers, "--layers") or [-1], per_residue=per_residue,
                   per_residue_dtype=per_residue_dtype, on_long=on_long, window=window or 0,
                   overlap=-1 if overlap is None else overlap, max_length=max_length or 0,
                   on_duplicate_id=on_duplicate_id, skip_empty=skip_empty, batch_invariant=batch_invariant,
                   input_format=input_format, trust_remote_code=trust_remote_code,
                   checkpoint_sequences=checkpoint_sequences, checkpoint_seconds=checkpoint_seconds,
                   worker_timeout=worker_timeout, summary_seconds=summary_seconds,
                   max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                   launcher=launcher, shards=shards or 0, shards_per_task=shards_per_task, sbatch=sbatch,
                   array_throttle=array_throttle, ray_address=ray_address)
    _finish(_call(run, config, show_progress=not no_progress, options={"dry_run": dry_run, "wait": wait}))


def _finish(outcome) -> None:
    """Print a command's outcome: the merged result, or what a scheduler was handed (then follow it)."""
    from .launchers.job import Submitted
    if isinstance(outcome, Submitted):
        click.echo(outcome.text)
        if outcome.follow is None:
            return
        outcome = _call(outcome.follow)
    _result_is_durable()
    click.echo(f"result: {outcome}")


@main.command("index")
@click.argument("fasta", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--workers", type=click.IntRange(min=1), default=4, show_default=True,
              help="Worker count for the imbalance figures.")
def index_command(fasta, workers):
    """Build (or reuse) the index of FASTA file(s) and print its statistics."""
    from .planning.index_stats import index_report
    _setup_logging(False)
    click.echo(_call(index_report, list(fasta), workers))


@main.command("status")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--verify/--no-verify", default=None,
              help="Read back every finished shard and checkpoint against its checksums (default: when they "
                   "total at most 2 GB).")
@click.option("--all", "every_shard", is_flag=True,
              help="A row for every shard (by default, above 40 shards, only those not complete and not pending).")
def status_command(out, verify, every_shard):
    """Per-shard state, progress and failures of the run in OUT."""
    from .reporting.status import status
    click.echo(_call(status, out, verify, every_shard))


@main.command("rerun")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--shards", default=None, help="Comma-separated shard numbers (default: every unfinished shard).")
@click.option("--worker-timeout", type=POSITIVE, default=None, help="Override the run's --worker-timeout.")
@click.option("--dry-run", is_flag=True, help="slurm runs: write the scripts and print the sbatch commands only.")
@click.option("--wait", is_flag=True, help="slurm runs: after resubmitting, follow until merged (or a shard failed).")
@click.option("--ray-address", default=None, help="ray runs: another address for the Ray cluster than the run's.")
@click.option("--sbatch", default=None,
              help="slurm runs: sbatch options replacing the run's (e.g. a longer --time), kept for later reruns.")
@click.option("--no-progress", is_flag=True, help="No progress bar (log lines only).")
@click.option("--quiet", "-q", is_flag=True, help="Only warnings and errors on the terminal.")
def rerun_command(out, shards, worker_timeout, dry_run, wait, ray_address, sbatch, no_progress, quiet):
    """Re-run failed or unfinished shards of OUT from their checkpoints, then merge (for a SLURM run:
    resubmit them, and a new merge job)."""
    from .api import rerun
    _setup_logging(quiet)
    _finish(_call(rerun, out, _int_list(shards, "--shards") or None, show_progress=not no_progress,
                  worker_timeout=worker_timeout, options={"dry_run": dry_run, "wait": wait},
                  ray_address=ray_address, sbatch=sbatch))


@main.command("report")
@click.argument("out", type=click.Path(file_okay=False))
def report_command(out):
    """Write OUT/report.html: one self-contained page (open it in any browser; nothing is fetched) about a
    finished, partial, failed or running run: what stopped it, lengths against the token budget and the
    model's limit, shard balance, each worker's throughput over time, where the time went, row statuses
    with example ids, failed attempts and restarts with their reasons, config and model. Every run, rerun
    and merge writes it at its end; this writes it again (e.g. after SLURM tasks failed)."""
    from .reporting.report import write
    from .rundir.layout import RunDir
    _call(RunDir(out).read_manifest)   # a clear error for a directory that holds no run
    click.echo(f"report: {_call(write, out)}")


@main.command("merge")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--allow-partial", is_flag=True,
              help="Write the rows that exist plus the list of missing ids, marked incomplete.")
def merge_command(out, allow_partial):
    """Merge the shards of OUT into OUT/result.h5 in FASTA order, with strict validation."""
    from .api import merge
    _setup_logging(False)
    path = _call(merge, out, allow_partial=allow_partial)
    _result_is_durable()
    click.echo(f"result: {path}")


@main.command("work")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--shard", type=click.IntRange(min=0), default=None,
              help="The shard to compute (default: from the array task's index, e.g. SLURM_ARRAY_TASK_ID).")
@click.option("--shards-per-task", type=click.IntRange(min=1), default=None,
              help="Shards per array task (default: the run's).")
def work_command(out, shard, shards_per_task):
    """Compute shard(s) of the planned run in OUT with this node's devices; never merges. This is what SLURM
    array tasks and Ray tasks run; a complete shard is skipped, and SIGTERM makes it checkpoint and stop."""
    from .launchers.work import work
    _setup_logging(False)
    summary = _call(work, out, shard, shards_per_task)
    _result_is_durable()
    click.echo(summary)


if __name__ == "__main__":
    main()
