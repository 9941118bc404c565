"""The `run_shards` command line: parse options, call one function (run, rerun and merge in `pipeline.api`;
index, status, report and work in their rooms), print. `run`'s settings are RunConfig's fields (config.py).

    run_shards [run] FASTA... [options]     embed, score or generate for every sequence, into OUT/result.h5
    run_shards index FASTA...              build or refresh the index, print statistics
    run_shards status OUT                  per-shard state, progress and failures
    run_shards rerun OUT [--shards 1,3]    re-run failed or unfinished shards from their checkpoints
    run_shards merge OUT                   merge and validate (run automatically at the end of `run`)
    run_shards report OUT                  write OUT/report.html again
    run_shards work OUT [--shard K]        compute one shard of a planned run (what a SLURM / Ray task runs)
    run_shards get OUT ID [ID ...]         the rows of some ids (tsv, json or npy)
    run_shards export OUT --format F       the result as parquet or one dataset per id (per-id-h5)
"""
from __future__ import annotations

import errno
import logging
import re
import sys

import click

from . import __version__
from .config import LISTED_SHARDS, SHARDS_MAX, RunConfig, default_of, field_type, misplaced, option_of


class DefaultRunGroup(click.Group):
    """`run_shards input.fasta ...` means `run_shards run input.fasta ...`."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            self._refuse_a_misspelt_command(ctx, args[0])
            args = ["run"] + list(args)
        return super().parse_args(ctx, args)

    def _refuse_a_misspelt_command(self, ctx, word: str) -> None:
        """`run_shards statsu OUT` ran `run` on a FASTA 'statsu' ("file not found"): a first word that is no
        file but is close to a command's name is named as that command's misspelling."""
        import difflib
        import os
        if word.startswith("-") or "." in word or os.sep in word or os.path.lexists(word):
            return
        close = difflib.get_close_matches(word, self.commands, n=1)
        if close:
            raise click.UsageError(f"no such command {word!r} (and no FASTA file of that name). Did you mean "
                                   f"{close[0]!r}?", ctx)


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


def _fail(error: Exception | str, code: int | None = None, label: str = "error") -> None:
    import os

    from .errors import DiskFull
    from .exits import EXIT_COMMAND_USER_ERROR
    click.echo(f"{label}: {error}", err=True)
    code = EXIT_COMMAND_USER_ERROR if code is None else code
    if isinstance(error, DiskFull):   # HDF5 may be left damaged by the failed write: skip its teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


class Interrupted(KeyboardInterrupt):
    """SIGTERM, SIGHUP or SIGUSR1 (the SLURM batch script's word that the time limit is near) outside the
    supervisor (which handles them while workers run), raised like Ctrl-C."""


def _interrupted_before_work(signum, frame):
    """Ctrl-C while the command parses its options and imports what it runs, before its first step (_run_step):
    click would say "Aborted!" and exit 1; nothing was done yet, so the interrupted code, and no traceback."""
    from .exits import EXIT_CLI_INTERRUPTED
    sys.stderr.write("\ninterrupted: by SIGINT, before the command began; nothing was done: run it again\n")
    raise SystemExit(EXIT_CLI_INTERRUPTED)


def _raise_interrupted(signum, frame):
    import signal
    raise Interrupted(signal.Signals(signum).name)


def _run_step(fn, *args, **kwargs):
    """Run one step of a command with SIGTERM, SIGHUP and SIGUSR1 raised like Ctrl-C: user errors,
    interruptions, a full disk and a run directory gone or read-only become one clear line (no traceback)."""
    import signal

    from index import FastaError

    from .errors import (RunFailed, RunInterrupted, UserError, disk_full_reason, make_room, permission_reason,
                         too_many_files_reason)
    from .exits import EXIT_CLI_INTERRUPTED, EXIT_COMMAND_FAILED
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, _raise_interrupted)
    if signal.getsignal(signal.SIGINT) is _interrupted_before_work:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        result = fn(*args, **kwargs)
    except RunFailed as e:
        _fail(e, EXIT_COMMAND_FAILED, e.label)
    except RunInterrupted as e:   # (a KeyboardInterrupt that says where every shard stopped)
        _fail(e, EXIT_CLI_INTERRUPTED, e.label)
    except (UserError, FastaError) as e:
        _fail(e)
    except KeyboardInterrupt as e:
        name = str(e) if isinstance(e, Interrupted) else "SIGINT"
        _fail(f"by {name}; nothing written was lost (unfinished files are removed): run the same command "
              "again to continue", EXIT_CLI_INTERRUPTED, "interrupted")
    except OSError as e:
        reason = disk_full_reason(e)
        if reason:
            _fail(f"cannot write {e.filename or 'a file'}: {reason}. Nothing partial was kept; {make_room(reason)} and "
                  "run the same command again")
        many = too_many_files_reason(e)
        if many:
            remedy = ("Raise the limit (`ulimit -n`)" if e.errno == errno.EMFILE else
                      "Wait for other processes to close files (or ask the administrator to raise fs.file-max)")
            _fail(f"cannot open {e.filename or 'a file'}: {many}. {remedy} and run the same command again")
        if e.filename is None or e.errno not in UNREACHABLE_FILE_ERRNOS:
            raise
        denied = permission_reason(e)
        if denied:   # another user's file: neither a mount nor the command is at fault
            _fail(f"cannot use {e.filename}: {denied}")
        # A run directory that vanished or turned read-only under the command (an unmounted or remounted
        # shared file system): the path and the cause, not a traceback.
        _fail(f"cannot use {e.filename}: {e.strerror}. Run the command where the run directory is mounted "
              "read-write")
    return result


def _result_is_durable() -> None:
    """Called once a command's result is on disk: from then on stop signals are ignored, so a SIGTERM during
    the interpreter's teardown cannot turn a finished run into exit code 143."""
    import signal
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


# errnos of a file the command can no longer reach: gone, read-only, not permitted, a stale NFS handle.
UNREACHABLE_FILE_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ESTALE, errno.EIO}


class CommaList(click.ParamType):
    """A comma-separated list option (`--pool mean,cls`, `--layers -1,2`), repeats kept once."""
    name = "list"

    def __init__(self, item: type, choices: tuple[str, ...] = ()):
        self.item, self.choices = item, choices

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        try:
            items = [self.item(v) for v in str(value).replace(" ", "").split(",") if v]
        except ValueError:
            self.fail(f"expected comma-separated {self.item.__name__}s, got {value!r}", param, ctx)
        wrong = [v for v in items if self.choices and v not in self.choices]
        if wrong:
            self.fail(f"{wrong[0]!r} is not one of {', '.join(self.choices)}", param, ctx)
        return list(dict.fromkeys(items))


class Path(click.Path):
    """click's Path, refusing an empty one (an unset shell variable, `--out "$OUT"`), which was the current
    directory: a run written into it, or a message about a directory the user never named."""

    def convert(self, value, param, ctx):
        if value == "":
            self.fail(f"{value!r} is an empty path (an unset shell variable?): name a file or directory", param, ctx)
        return super().convert(value, param, ctx)


class NumberRange(click.FloatRange):
    """click's FloatRange, refusing NaN, which passes every bound (`--lock-wait nan` waited forever, and
    `--worker-timeout nan` would never stop a hung worker)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if number != number:
            self.fail(f"{value!r} is not a number", param, ctx)
        return number


def _click_type(name: str):
    """The click type of RunConfig field `name`, from its type, choices and bounds."""
    opt, kind = option_of(name), field_type(name)
    if isinstance(default_of(name), list):
        return CommaList(kind, opt.choices)
    if opt.choices:
        return click.Choice(opt.choices)
    if kind in (int, float) and (opt.minimum is not None or opt.maximum is not None):
        ranged = click.IntRange if kind is int else NumberRange
        extra = {"min_open": True} if opt.above_minimum else {}
        return ranged(min=opt.minimum, max=opt.maximum, **extra)
    return kind


def field_option(name: str, **overrides):
    """The click option that sets RunConfig field `name`: flags, type, default and help from the field
    (config.py); `overrides` for a command that uses it otherwise (`rerun`'s default None: keep the run's)."""
    opt = option_of(name)
    default = default_of(name)
    flags = [f"{opt.flags[0]}/{opt.off_flag}" if opt.off_flag else opt.flags[0], *opt.flags[1:]]
    if isinstance(default, list):
        default = ",".join(map(str, default))   # as typed: CommaList reads it
    kwargs = dict(default=default, help=opt.help, show_default=default not in (None, ""))
    if opt.repeat:   # (`--reuse A --reuse B`: click's tuple, as the field's list)
        kwargs.update(default=(), multiple=True, show_default=False, callback=lambda ctx, param, value: list(value))
    elif isinstance(default, bool):
        if not opt.off_flag:
            kwargs["is_flag"] = True
    else:
        kwargs["type"] = _click_type(name)
    kwargs.update(overrides)
    return click.option(*flags, name, **kwargs)


def config_options(command):
    """Every RunConfig setting the CLI does not set itself, as an option of `command`, in field order."""
    import dataclasses
    from .models.registry import families_help
    engine_help = families_help() + "; auto: native where it runs the checkpoint."   # the registry's families
    for f in reversed(dataclasses.fields(RunConfig)):
        if not f.metadata["option"].apart:
            command = field_option(f.name, **({"help": engine_help} if f.name == "engine" else {}))(command)
    return command


def progress_options(command):
    """--no-progress and --quiet, for commands that compute shards here."""
    command = click.option("--quiet", "-q", is_flag=True,
                           help="Only warnings and errors on the terminal (no progress bar).")(command)
    return click.option("--no-progress", is_flag=True, help="No progress bar (log lines only).")(command)


def scheduler_options(command):
    """--dry-run and --wait, for commands that may hand shards to SLURM."""
    command = click.option("--wait", is_flag=True,
                           help="slurm: after submitting, follow until merged (or a shard failed).")(command)
    return click.option("--dry-run", is_flag=True,
                        help="slurm: write OUT/slurm/*.sbatch and print the sbatch commands only.")(command)


def _given(ctx: click.Context) -> list[str]:
    """The parameters given on the command line (not defaults)."""
    from click.core import ParameterSource
    return [name for name in ctx.params if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE]


def _int_list(value: str | None, option: str) -> list[int]:
    if not value:
        return []
    try:
        return [int(v) for v in value.replace(" ", "").split(",") if v]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}", param_hint=option) from None


def _shard_list(value: str | None) -> list[range]:
    """`3,17,20-22` -> range(3, 4), range(17, 18), range(20, 23): what a failed run's `Continue with: run_shards
    rerun OUT --shards ...` names (120 failed shards of 300 in a row were 120 numbers). Ranges, not numbers: the
    run's shard count bounds them before they are counted out (`0-20000000` built 20 million numbers first)."""
    found = []
    for part in (value or "").replace(" ", "").split(","):
        if not part:
            continue
        numbers = re.fullmatch(r"(\d+)(?:-(\d+))?", part, re.ASCII)
        try:
            first, last = (int(numbers[1]), int(numbers[2] or numbers[1])) if numbers else (1, 0)
        except ValueError:   # (more digits than int() reads: 4,300)
            first, last = 1, 0
        if last < first:
            raise click.BadParameter(f"expected comma-separated shard numbers or ranges (3,17,20-22), got {value!r}",
                                     param_hint="--shards")
        found.append(range(first, last + 1))
    if value is not None and not found:   # (a script's `--shards "$FAILED"` with nothing in it: not every shard)
        raise click.BadParameter("no shard numbers given; leave --shards out for every unfinished shard",
                                 param_hint="--shards")
    return found


@click.group(cls=DefaultRunGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="run_shards")
def main():
    """Sharded inference for sequence models over FASTA: every sequence, one validated HDF5 file.

    `run_shards input.fasta` embeds every sequence with the bundled demo model on all visible GPUs (or
    on CPU) and writes run_shards_out/result.h5. Workers checkpoint as they go; if one fails, the others
    finish and `run_shards rerun OUT` continues from the checkpoints.
    """
    import os
    try:
        os.getcwd()
    except FileNotFoundError:   # (a relative path was a traceback; torch's import, MKL's "FATAL ERROR")
        _fail("the current directory no longer exists (it was deleted, or its file system unmounted): cd to an "
              "existing directory and run the command again")


@main.command("run")
@click.argument("fasta", nargs=-1, required=True, type=Path(dir_okay=False))
@field_option("out", type=Path(file_okay=False), show_default=True)
@click.option("--gpus", default="auto", show_default=True,
              help="GPUs to use, one worker each; 'auto' = all visible, else CPU workers; 0 = CPU. With --launcher "
                   "slurm or ray: whether each shard gets a GPU (slurm auto: when --sbatch asks for GPUs; ray auto: "
                   "CPU).")
@click.option("--workers", type=_click_type("workers"), default=None,
              help="CPU workers when running on CPU (default: one per core, at most 4, and at most one per 4 "
                   "batches of input; each loads the model).")
@click.option("--threads", type=_click_type("threads_per_worker"), default=None,
              help="torch threads per worker (default: the CPU cores divided between the workers; a container's "
                   "CPU quota counts).")
@config_options
@scheduler_options
@progress_options
def run_command(fasta, out, gpus, workers, threads, dry_run, wait, no_progress, quiet, **settings):
    """Run a model over every sequence of FASTA file(s) and merge the result into OUT/result.h5.

    \b
    Example:
        run_shards run seqs.fasta --out emb --model facebook/esm2_t33_650M_UR50D
    """
    from .api import run
    from .commands import run_config

    ctx = click.get_current_context()
    wrong = misplaced(_given(ctx), settings)
    if wrong:
        raise click.UsageError(wrong)
    _setup_logging(quiet)
    config = _run_step(run_config, list(fasta), out, gpus, workers, threads, **settings)
    _finish(_run_step(run, config, show_progress=not (no_progress or quiet), dry_run=dry_run, wait=wait), quiet)


def _finish(outcome, quiet: bool = False) -> None:
    """Print a command's outcome: the merged result (and, with -q, where its report is), what is left
    unmerged, or what a scheduler was handed (then follow it)."""
    from .api import NotMerged, report_path
    from .launchers.job import Submitted
    if isinstance(outcome, NotMerged):
        click.echo(outcome.text)
        return
    if isinstance(outcome, Submitted):
        click.echo(outcome.text)
        if outcome.follow is None:
            return
        outcome = _run_step(outcome.follow)
    _result_is_durable()
    click.echo(f"result: {outcome}")
    report = report_path(outcome)
    if quiet and report is not None:   # otherwise the log line said it
        click.echo(f"report: {report}")


@main.command("index")
@click.argument("fasta", nargs=-1, required=True, type=Path(dir_okay=False))
@click.option("--workers", type=_click_type("shards"), default=4, show_default=True,
              help="Worker count for the imbalance figures (the shards W they are split into).")
@click.option("--rebuild", is_flag=True,
              help="Index the files anew, whatever the cache holds: after an edit that kept a file's size and "
                   "modification time, which the cache takes for no change.")
def index_command(fasta, workers, rebuild):
    """Build (or reuse) the index of FASTA file(s) and print its statistics."""
    from .planning.index_stats import index_report
    _setup_logging(False)
    click.echo(_run_step(index_report, list(fasta), workers, rebuild))


@main.command("status")
@click.argument("out", type=Path(file_okay=False))
@click.option("--verify/--no-verify", default=None,
              help="Read back every finished shard and checkpoint against its checksums (default: when they "
                   "total at most 2 GB).")
@click.option("--all", "every_shard", is_flag=True,
              help=f"A row for every shard (by default, above {LISTED_SHARDS} shards, only those not complete and "
                   "not pending).")
def status_command(out, verify, every_shard):
    """Per-shard state, progress and failures of the run in OUT."""
    from .reporting.status import status
    click.echo(_run_step(status, out, verify, every_shard))


@main.command("rerun")
@click.argument("out", type=Path(file_okay=False))
@click.option("--shards", default=None,
              help="Comma-separated shard numbers or ranges, e.g. 3,17,20-22 (default: every unfinished shard).")
@field_option("worker_timeout", default=None, show_default=False,
              help="Replace the run's --worker-timeout (kept for later commands).")
@field_option("ray_address", default=None, help="ray runs: another address for the Ray cluster than the run's "
                                                "(kept for later commands).")
@field_option("sbatch", default=None,
              help="slurm runs: sbatch options replacing the run's (e.g. a longer --time), kept for later reruns.")
@field_option("merge_sbatch", default=None,
              help="slurm runs: the merge job's sbatch options, replacing the run's, kept for later reruns.")
@scheduler_options
@progress_options
def rerun_command(out, shards, worker_timeout, ray_address, sbatch, merge_sbatch, dry_run, wait, no_progress, quiet):
    """Re-run failed or unfinished shards of OUT from their checkpoints, then merge (for a SLURM run:
    resubmit them, and a new merge job).

    \b
    Example:
        run_shards rerun emb --shards 3     # only shard 3
        run_shards rerun emb                # the rest, then the merge
    """
    from .api import rerun
    _setup_logging(quiet)
    _finish(_run_step(rerun, out, _shard_list(shards) or None,
                      show_progress=not (no_progress or quiet),
                      dry_run=dry_run, wait=wait, worker_timeout=worker_timeout, ray_address=ray_address,
                      sbatch=sbatch, merge_sbatch=merge_sbatch), quiet)


@main.command("report")
@click.argument("out", type=Path(file_okay=False))
def report_command(out):
    """Write OUT/report.html: one self-contained page (open it in any browser; nothing is fetched) about a
    finished, partial, failed or running run: what stopped it, lengths against the token budget and the
    model's limit, shard balance, each worker's throughput over time, where the time went, row statuses
    with example ids, failed attempts and restarts with their reasons, config and model. Every run, rerun
    and merge writes it at its end; this writes it again (e.g. after SLURM tasks failed)."""
    from .reporting.report import write
    from .rundir.layout import RunDir
    _run_step(RunDir(out).read_manifest)   # a clear error for a directory that holds no run
    click.echo(f"report: {_run_step(write, out)}")


@main.command("merge")
@click.argument("out", type=Path(file_okay=False))
@click.option("--allow-partial", is_flag=True,
              help="Write the rows that exist plus the list of missing ids, marked incomplete.")
@click.option("--lock-wait", type=NumberRange(min=0), default=0, show_default=True, metavar="SECONDS",
              help="Wait up to this long for another command working in OUT and for shards still being computed, "
                   "instead of refusing at once (the SLURM merge job waits).")
def merge_command(out, allow_partial, lock_wait):
    """Merge the shards of OUT into OUT/result.h5 in FASTA order, with strict validation."""
    from .api import merge
    _setup_logging(False)
    path = _run_step(merge, out, allow_partial=allow_partial, lock_wait=lock_wait)
    _result_is_durable()
    click.echo(f"result: {path}")


@main.command("work")
@click.argument("out", type=Path(file_okay=False))
@click.option("--shard", type=click.IntRange(min=0, max=SHARDS_MAX - 1), default=None,
              help="The shard to compute (default: from the array task's index, e.g. SLURM_ARRAY_TASK_ID).")
@click.option("--shards-per-task", type=_click_type("shards_per_task"), default=None,
              help="Shards per array task (default: the run's).")
def work_command(out, shard, shards_per_task):
    """Compute shard(s) of the planned run in OUT with this node's devices; never merges. This is what SLURM
    array tasks and Ray tasks run; a complete shard is skipped, one another process computes is left to it
    (exit 0, saying so), and SIGTERM (or SIGUSR1) makes it checkpoint and stop."""
    from .launchers.work import work
    _setup_logging(False)
    summary = _run_step(work, out, shard, shards_per_task)
    _result_is_durable()
    click.echo(summary)


@main.command("get")
@click.argument("out", type=Path())
@click.argument("ids", nargs=-1)
@click.option("--ids-from", default=None, help="Also the ids in this file, one per line ('-': standard input); a FASTA header line "
                                          "('>id description') gives its id.")
@click.option("--format", "fmt", type=click.Choice(["tsv", "json", "npy"]), default="tsv", show_default=True,
              help="tsv: a line per id; json: a JSON object per line and id; npy: a numpy .npz archive (needs -o).")
@click.option("--output", "-o", default=None, type=Path(dir_okay=False), help="Write here instead of printing.")
def get_command(out, ids, ids_from, fmt, output):
    """The rows of ids in OUT (a run directory or a result.h5), found through its id index."""
    from .output.get import get, read_ids
    click.echo(_run_step(lambda: get(out, read_ids(ids, ids_from), fmt, output)))


@main.command("export")
@click.argument("out", type=Path())
@click.option("--format", "fmt", type=click.Choice(["parquet", "per-id-h5"]), required=True,
              help="parquet: a column per dataset; per-id-h5: a dataset per id, as UniProt's per-protein.h5.")
@click.option("--output", "-o", default=None, type=Path(dir_okay=False),
              help="Where to write (default: OUT/result.parquet or OUT/result.per-id.h5).")
@click.option("--column", default=None, help="per-id-h5: the column to write (default: the one pooled embedding).")
@click.option("--widen-float16", is_flag=True,
              help="parquet: float16 columns as float32, the same values, for readers that do not know Parquet's "
                   "FLOAT16 (pyarrow before 15 cannot open such a file).")
def export_command(out, fmt, output, column, widen_float16):
    """Export the result of OUT (a run directory or a result.h5) for downstream tools, streamed."""
    from .output.export import export
    click.echo(f"wrote {_run_step(export, out, fmt, output, column, widen_float16)}")


def entry() -> None:
    """The `run_shards` command (bin/run_shards, the installed script): `main`, then, once it has ended with
    an exit code, leave without the interpreter's teardown (exits.leave_without_teardown). transformers, where a
command imports it, reads its import structure from run_shards' cache (models/transformers_imports.py)."""
    import signal

    from .exits import leave_without_teardown
    from .models.transformers_imports import keep_import_structure
    from .processes import mark_command_start
    mark_command_start()
    keep_import_structure()
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:   # (not where it is ignored: `cmd &` in a script)
        signal.signal(signal.SIGINT, _interrupted_before_work)
    try:
        main()
    except SystemExit as end:
        if end.code is None or isinstance(end.code, int):
            leave_without_teardown(end.code or 0)
        raise


if __name__ == "__main__":
    entry()
