"""The `run_shards` command line's commands as Python functions of the same names taking the commands'
arguments (STYLE.md: everything the CLI does is also a Python function), where the function doing the work
takes others; run_shards/ names them all (docs/python.md).

`run` takes FASTA paths, `out`, `gpus`, `workers`, `threads` and every other option by its name
(`--max-tokens-per-batch 512` is `max_tokens_per_batch=512`, `--pool mean,cls` is `pool=["mean", "cls"]`),
resolves the devices as the command line does (`run_config`, which cli.py uses too), and pipeline.api.run
plans, launches and merges. `index`, `report`, `get` and `export` take their options' names and refuse what
the command line's option types refuse. (status, rerun, merge and work already take the commands' arguments
where they live.)
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from pathlib import Path
from typing import Sequence, Union

from index import lasting_path

from . import api
from .api import NotMerged
from .config import (DEFAULT_TOKENS_CPU, RunConfig, check_value, default_of, field_type, misplaced, option_name,
                     option_of)
from .errors import UserError
from .launchers.job import Submitted
from .planning import devices

Paths = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]


def run(fasta: Paths, out: str | os.PathLike = "run_shards_out", gpus: int | str = "auto", workers: int | None = None,
        threads: int | None = None, dry_run: bool = False, wait: bool = False, show_progress: bool = True,
        **options) -> Path | Submitted | NotMerged:
    """`run_shards run FASTA... [options]`: run a model over every sequence of `fasta` (a path or a list of
    paths) and merge the result into OUT/result.h5. Returns its path, or what a scheduler was handed (SLURM:
    `dry_run`, `wait`), or what is left unmerged. `show_progress`: the progress bar (`--no-progress`).
    A user mistake raises UserError (index.FastaError for the input files), with the message the command
    line prints."""
    given = dict(zip(_fields(options), options.values()))
    wrong = misplaced([*given, *(name for name, on in (("dry_run", dry_run), ("wait", wait)) if on)],
                      {**{name: default_of(name) for name in _FIELDS}, **given})
    if wrong:
        raise UserError(wrong)
    config = run_config(fasta, out, gpus, workers, threads, **options)
    return api.run(config, show_progress=show_progress, dry_run=dry_run, wait=wait)


def run_config(fasta: Paths, out: str | os.PathLike = "run_shards_out", gpus: int | str = "auto",
               workers: int | None = None, threads: int | None = None, **options) -> RunConfig:
    """The RunConfig of `run_shards run FASTA... [options]` on this machine: the devices, workers and threads
    that `gpus`, `workers` and `threads` resolve to (a cluster launcher's tasks use the devices their nodes
    give them), and the other options by name (the option's or RunConfig's field's)."""
    settings = {name: _plain(value) for name, value in zip(_fields(options), options.values())}
    for name, value in (("workers", workers), ("threads_per_worker", threads)):
        if value is not None:   # as --workers and --threads take them: workers=0 ran the default, "2" a TypeError
            check_value(name, value)
    if settings.get("launcher", default_of("launcher")) == "local":
        budget = settings.get("max_tokens_per_batch")   # (checked by RunConfig below: "512" is refused there)
        gpu_ids, workers, threads = devices.resolve(
            str(gpus), workers, threads, devices.input_size([os.fspath(p) for p in _paths(fasta)]),
            budget if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0 else DEFAULT_TOKENS_CPU)
    else:
        gpu_ids, workers = (["0"] if devices.tasks_get_gpu(str(gpus), settings.get("sbatch", "")) else []), 1
        threads = threads or 1
    for name, value in settings.items():   # a list option given as the command line takes it: "mean,cls"
        if isinstance(value, str) and isinstance(default_of(name), list):
            try:
                settings[name] = [value] if option_of(name).repeat else \
                    [field_type(name)(v) for v in value.replace(" ", "").split(",") if v]
            except ValueError:
                raise UserError(f"{option_name(name)} {value!r}: each comma-separated value must be "
                                f"{'a whole number' if field_type(name) is int else 'a number'}") from None
    return RunConfig(fasta=[lasting_path(p) for p in _paths(fasta)], out=str(out), devices=gpu_ids, workers=workers,
                     threads_per_worker=threads, **settings)


def index(fasta: Paths, workers: int = 4) -> str:
    """`run_shards index FASTA...`: build (or reuse) the index of `fasta` and describe it (records, residues,
    lengths, the stride split over `workers`), as the command prints it."""
    from .planning.index_stats import index_report
    check_value("shards", workers, "--workers")   # (the shards W whose split it describes: as `index --workers`)
    return index_report([os.fspath(p) for p in _paths(fasta)], workers)


def report(out: str | os.PathLike) -> Path:
    """`run_shards report OUT`: write OUT/report.html again; returns its path."""
    from .reporting.report import write
    from .rundir.layout import RunDir
    RunDir(out).read_manifest()   # a clear error for a directory that holds no run
    return write(out)


def get(out: str | os.PathLike, ids: str | Sequence[str] = (), ids_from: str | os.PathLike | None = None,
        format: str = "tsv", output: str | os.PathLike | None = None) -> str:
    """`run_shards get OUT ID... [--ids-from FILE] [--format F] [-o FILE]`: the rows of `ids` (and of the ids
    in `ids_from`, one per line) as the command prints them, or written to `output` (needed for npy). To read
    values into Python, open_result is the way."""
    from .output import get as rows
    _choose(format, GET_FORMATS, "--format")
    ids = [ids] if isinstance(ids, str) else list(ids)   # one id as text is that id, not its characters
    return rows.get(out, rows.read_ids(ids, None if ids_from is None else os.fspath(ids_from)), format, output)


def export(out: str | os.PathLike, format: str, output: str | os.PathLike | None = None,
           column: str | None = None, widen_float16: bool = False) -> Path:
    """`run_shards export OUT --format F [-o FILE] [--column C] [--widen-float16]`: the result as parquet or one
    dataset per id (per-id-h5), streamed; returns the file written."""
    from .output import export as exports
    _choose(format, tuple(exports.FORMATS), "--format")
    return exports.export(out, format, output, column, widen_float16)


GET_FORMATS = ("tsv", "json", "npy")


def _choose(value: str, choices: tuple[str, ...], option: str) -> None:
    if value not in choices:
        raise UserError(f"{option} {value!r}: not one of {', '.join(choices)}")


def _plain(value):
    """A path as its text (RunConfig is stored as JSON), in a list too."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def _paths(given: Paths) -> list:
    return [given] if isinstance(given, (str, os.PathLike)) else list(given)


_FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}
# option name (its flag without dashes) -> field, for the options whose field is named otherwise (--pool: pools)
_BY_OPTION = {option_of(name).flags[0].lstrip("-").replace("-", "_"): name for name in _FIELDS
              if option_of(name).flags and not option_of(name).apart}


def _fields(options: dict) -> list[str]:
    """The RunConfig field of each option name (an option's, or a field's), in order; UserError for others."""
    names = []
    for given in options:
        name = _BY_OPTION.get(given, given)
        if name not in _FIELDS or option_of(name).apart:
            close = difflib.get_close_matches(given, list(_BY_OPTION), n=1)
            raise UserError(f"run() has no option {given!r}" + (f"; did you mean {close[0]!r}?" if close else
                                                                  " (docs/python.md lists them)"))
        if name in names:
            raise UserError(f"run() was given {option_name(name)} twice (as {name!r} and as its option's name)")
        names.append(name)
    return names
