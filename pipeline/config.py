"""The one run configuration that flows from the CLI to the parent, the workers and the output files.

Each field says, in its metadata (`Option`), which `run` option sets it, its help, choices and bounds, and
what a later command on the same run may do with it (its role); the CLI builds its options from that.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import numbers
import typing
from dataclasses import dataclass, field

from .advice import command, files_words
from .errors import UserError

log = logging.getLogger(__name__)
_SAID_ABOVE_BOUND: set = set()   # (field, stored value): said once a process, however often the run's config is read

TASKS = ("embed", "score", "generate", "variants")
# --score-method: auto = pll for a masked LM; a causal LM has one score, its log-likelihood.
SCORE_METHODS = ("auto", "pll", "wt-marginal")
POOLS = ("mean", "cls", "last")
ENGINES = ("auto", "native", "hf")
DTYPES = ("auto", "float32", "bfloat16", "float16")
PER_RESIDUE_DTYPES = ("float16", "float32")
ON_LONG = ("error", "truncate", "skip", "window")
ON_DUPLICATE = ("error", "rename")
# How residues are written for the tokenizer (docs/models.md); aa, saprot-sa and 3di name the forms of a
# vocabulary that reads structure (models/structure_input.py).
INPUT_FORMATS = ("auto", "plain", "spaced", "aa", "saprot-sa", "3di")
LAUNCHERS = ("local", "slurm", "ray")
# Above this many shards, logs, `status` and report.html summarise the shards instead of a line each
# (10,000 lines of "pending" bury the two that failed).
LISTED_SHARDS = 40

# Token budgets per batch when --max-tokens-per-batch is not given: CPU batches stay cache-friendly,
# GPU batches are large enough to fill the device.
DEFAULT_TOKENS_CPU = 4096
DEFAULT_TOKENS_GPU = 32768
# --seed's range: the sampler's random streams are keyed by 64 bits (engine/sampler.py).
SEED_MAX = 2**64 - 1
# Counts that a command allocates something for, one per unit: bounded so that a mistyped number is refused
# before any work, not found by a parent building a slot per worker (--workers 10**21 filled memory), torch
# (--threads above 2**31-1 failed every worker) or a shard table (`index --workers 10**8` ended in MemoryError).
CORES_MAX = 4096        # --workers, --threads: processes, or threads each, on one machine: more than any has cores
SHARDS_MAX = 1_000_000  # --shards (and --shards-per-task, --array-throttle: shards and tasks): each shard is files in
                        # OUT/shards and OUT/logs (docs/cluster.md: 12,000 entries a directory at 4,000 shards)
# A run planned before these bounds (2026-12-07) may hold a larger value: a continued run reads a count of tokens,
# shards or tasks above its bound as the bound, which computes the same (no sequence, batch or array reaches it),
# and --workers or --threads above theirs (every worker had failed with them) as their defaults (from_dict).
# --max-new-tokens and --max-tokens-per-batch: the native engine counts a sequence's cached tokens and a step's
# tokens in 32 bits (engine/model_runner.py: kv_lens, cu_seqlens).
TOKENS_MAX = 2**31 - 1

# What a later command on the same run may do with a setting (every field has one role; tests hold it):
RESULT = "result"   # it shapes what is computed: a later command must give the same, or is refused
PLAN = "plan"       # fixed when the run is planned (the shard geometry): a later command may only repeat it
LAUNCH = "launch"   # how the shards are run: a later command's value applies from then on, and is logged


@dataclass(frozen=True)
class Option:
    """How a RunConfig field is set on the `run` command line, and its role in a continued run."""
    role: str
    flags: tuple[str, ...] = ()     # the option, then its short form; () for none
    help: str = ""
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    above_minimum: bool = False     # the value must be above `minimum`, not equal to it
    maximum: float | int | None = None
    off_flag: str = ""              # a flag on by default: the option that turns it off
    only_with: tuple[str, ...] | None = None   # ("task", "embed", "score"): meaningful only with those values
    needs: str = ""                 # a field it means something only with, on or above 0 (--per-residue-dtype:
                                    # per_residue; --seed: temperature, greedy decoding draws nothing)
    apart: bool = False             # the CLI sets it itself (the FASTA argument, --out, --gpus, --workers, --threads)
    repeat: bool = False            # a list given as the option repeated (`--reuse A --reuse B`), not comma-separated


def setting(role: str, *flags: str, default=dataclasses.MISSING, **option) -> typing.Any:
    """A RunConfig field with its Option (a list default is copied for every instance)."""
    meta = {"option": Option(role, flags, **option)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


_EMBED, _GENERATE = ("task", "embed"), ("task", "generate")
_SCORE, _VARIANTS, _PER_RESIDUE = ("task", "score"), ("task", "variants"), ("task", "embed", "score")
_SLURM, _RAY = ("launcher", "slurm"), ("launcher", "ray")

# Options of `run` and `rerun` that are not settings of the run, and the launcher they belong to.
COMMAND_ONLY_WITH = {"dry_run": _SLURM, "wait": _SLURM}


@dataclass
class RunConfig:
    fasta: list[str] = setting(RESULT, apart=True)
    out: str = setting(LAUNCH, "--out", "-o", default="run_shards_out", apart=True,
                       help="Run directory: shards, logs, manifest and the merged result.h5.")
    model: str = setting(RESULT, "--model", "-m", default="demo",
                         help="Checkpoint directory, Hugging Face hub id, or 'demo' (bundled; random weights).")
    task: str = setting(RESULT, "--task", default="embed", choices=TASKS,
                        help="embed: pooled hidden states; score: log-likelihood (a causal LM's, or a masked LM's "
                             "pseudo-log-likelihood); generate: continue each sequence (native engine); variants: "
                             "score the mutants of --variants.")
    engine: str = setting(RESULT, "--engine", default="auto", choices=ENGINES,
                          help="native: our engine (Qwen3.5, ESM-2, Llama, Qwen3); hf: transformers models (any "
                               "architecture); auto: native where supported.")
    devices: list[str] = setting(LAUNCH, "--gpus", default=[], apart=True)   # GPU ids, one worker each; [] = CPU
    workers: int = setting(LAUNCH, "--workers", default=1, minimum=1, maximum=CORES_MAX, apart=True)
    threads_per_worker: int = setting(LAUNCH, "--threads", default=1, minimum=1, maximum=CORES_MAX, apart=True)
    max_tokens_per_batch: int | None = setting(
        LAUNCH, "--max-tokens-per-batch", default=None, minimum=1, maximum=TOKENS_MAX,
        help=f"Token budget per batch (padded tokens for hf), at most 2**31-1. Default {DEFAULT_TOKENS_CPU} on "
             f"CPU, {DEFAULT_TOKENS_GPU} on GPU.")
    max_seqs: int = setting(LAUNCH, "--max-seqs", default=256, minimum=1, help="Most sequences per batch.")
    dtype: str = setting(RESULT, "--dtype", default="auto", choices=DTYPES,
                         help="Model dtype; auto = float32 on CPU, bfloat16 on GPU.")
    pools: list[str] = setting(RESULT, "--pool", default=["mean"], choices=POOLS, only_with=_EMBED,
                               help="Pooled embeddings, comma-separated: mean,cls,last.")
    layers: list[int] = setting(RESULT, "--layers", default=[-1], only_with=_EMBED,
                                help="Hidden states to pool, comma-separated: 0 = token embeddings, -1 = final "
                                     "norm output; a negative layer is stored under its number from the start.")
    per_residue: bool = setting(RESULT, "--per-residue", default=False, only_with=_PER_RESIDUE,
                                help="embed: also store every residue's hidden state; score: every residue's "
                                     "log-probability (and a masked LM's 20 amino acids' log-probabilities) "
                                     "(CSR layout).")
    per_residue_dtype: str = setting(RESULT, "--per-residue-dtype", default="float16", choices=PER_RESIDUE_DTYPES,
                                     only_with=_EMBED, needs="per_residue",
                                     help="embed --per-residue: how the residues' vectors are stored (float16: "
                                          "2 bytes per dimension, float32: 4).")
    score_method: str = setting(RESULT, "--score-method", default="auto", choices=SCORE_METHODS, only_with=_SCORE,
                                help="score with a masked LM: pll = pseudo-log-likelihood (each residue masked in "
                                     "turn; auto), wt-marginal = one unmasked pass. A causal LM's score is its "
                                     "log-likelihood.")
    variants: str | None = setting(RESULT, "--variants", default=None, only_with=_VARIANTS,
                                   help="variants: CSV or TSV with a header and columns id, mutant (e.g. A23V or "
                                        "A23V:G45D, positions 1-based in the FASTA record).")
    variants_out: str | None = setting(LAUNCH, "--variants-out", default=None, only_with=_VARIANTS,
                                       help="variants: also write the variant table as this CSV file.")
    on_long: str = setting(RESULT, "--on-long", default="error", choices=ON_LONG,
                           help="Sequences over the model's length limit: stop before any work, cut, keep as "
                                "skipped rows, or run as overlapping windows stitched into one row (embed, score).")
    window: int | None = setting(RESULT, "--window", default=None, minimum=2,
                                 help="--on-long window: tokens per window, special tokens included (default: the "
                                      "model's limit).")
    overlap: int | None = setting(RESULT, "--overlap", default=None, minimum=0,
                                  help="--on-long window: residue tokens neighbouring windows share (default: a "
                                       "quarter of a window).")
    max_length: int | None = setting(RESULT, "--max-length", default=None, minimum=1,
                                     help="Per-sequence token limit (special tokens included; default: the model's "
                                          "own limit, if any).")
    on_duplicate_id: str = setting(RESULT, "--on-duplicate-id", default="error", choices=ON_DUPLICATE,
                                   help="rename: suffix repeated ids ('x.dup2') and keep the originals in the output.")
    skip_empty: bool = setting(RESULT, "--skip-empty", default=False,
                               help="Keep records without residues as rows with status 3.")
    batch_invariant: bool = setting(
        RESULT, "--batch-invariant", default=True, off_flag="--no-batch-invariant",
        help="native engine on CPU: every stored value the same bits whatever the number of workers, the token "
             "budget (64 or more) and the other sequences of a batch (docs/engine.md); off: up to a few percent "
             "faster, values may differ in the last bits.")
    input_format: str = setting(RESULT, "--input-format", default="auto", choices=INPUT_FORMATS,
                                help="How residues are written for the tokenizer: auto = the model family's card "
                                     "(docs/models.md), or the structure form the input is written in; plain = as "
                                     "written; spaced = space-separated; for a vocabulary that reads structure: "
                                     "aa = amino acids, saprot-sa = SaProt's residue + 3Di pairs ('MdEvVp', "
                                     "'M#E#V#'), 3di = ProstT5's 3Di states (lower case, after <fold2AA>).")
    trust_remote_code: bool = setting(LAUNCH, "--trust-remote-code", default=False,
                                      help="Let transformers run a checkpoint's own Python code (hf engine).")
    checkpoint_sequences: int = setting(LAUNCH, "--checkpoint-every", default=20000, minimum=1,
                                        help="Checkpoint at the end of the batch that brings a worker to N sequences "
                                             "since its last checkpoint.")
    checkpoint_seconds: float = setting(LAUNCH, "--checkpoint-seconds", default=60.0, minimum=0, above_minimum=True,
                                        help="...or to S seconds since it (bounds what a crash can lose).")
    worker_timeout: float = setting(LAUNCH, "--worker-timeout", default=1800.0, minimum=0, above_minimum=True,
                                    help="Stop a worker that reports no progress for this many seconds of the "
                                         "machine running (SIGTERM, then SIGKILL 10 s later).")
    summary_seconds: float = setting(LAUNCH, "--summary-seconds", default=30.0, minimum=0, above_minimum=True,
                                     help="Summary line interval.")
    max_new_tokens: int = setting(RESULT, "--max-new-tokens", default=64, minimum=1, maximum=TOKENS_MAX,
                                  only_with=_GENERATE,
                                  help="generate: new tokens per sequence, 1 to 2**31-1 (the engine counts a "
                                       "sequence's tokens in 32 bits).")
    temperature: float = setting(RESULT, "--temperature", default=0.0, minimum=0, only_with=_GENERATE,
                                 help="generate: 0 = greedy.")
    top_p: float = setting(RESULT, "--top-p", default=1.0, minimum=0, above_minimum=True, maximum=1,
                           only_with=_GENERATE, needs="temperature",
                           help="generate: nucleus sampling mass (with --temperature above 0).")
    seed: int = setting(RESULT, "--seed", default=0, minimum=0, maximum=SEED_MAX, only_with=_GENERATE,
                        needs="temperature",
                        help="generate: run seed, 0 to 2**64-1 (with --temperature above 0); with the sequence's FASTA "
                             "position it fixes what each sequence samples.")
    reuse: list[str] = setting(PLAN, "--reuse", default=[], repeat=True,
                               help="An earlier result (its run directory or result.h5) whose rows are copied for "
                                    "the records of the same sequence, when its model and every output-affecting "
                                    "setting are this run's (else it is refused, saying why); repeat for more. "
                                    "Fixed when the run is planned.")
    launcher: str = setting(LAUNCH, "--launcher", default="local", choices=LAUNCHERS,
                            help="local: workers on this machine; slurm: a job array plus a merge job; ray: one "
                                 "task per shard on a Ray cluster.")
    shards: int | None = setting(PLAN, "--shards", default=None, minimum=1, maximum=SHARDS_MAX,
                                 help="Number of shards W, fixed when the run is planned (default: one per GPU or "
                                      "CPU worker; required with slurm and ray). A later command runs the same W "
                                      "shards with however many workers it has.")
    shards_per_task: int = setting(LAUNCH, "--shards-per-task", default=1, minimum=1, maximum=SHARDS_MAX,
                                   only_with=_SLURM,
                                   help="slurm: shards per array task, one worker per GPU of the task (for "
                                        "whole-node allocations).")
    sbatch: str = setting(LAUNCH, "--sbatch", default="", only_with=_SLURM,
                          help="slurm: more sbatch options for each array task, e.g. "
                               "\"--partition=gpu --time=12:00:00\".")
    merge_sbatch: str = setting(LAUNCH, "--merge-sbatch", default="", only_with=_SLURM,
                                help="slurm: the merge job's sbatch options (it keeps only --sbatch's account and "
                                     "QOS), e.g. \"--partition=cpu --mem=8G\"; its time limit, unless given, "
                                     "follows the data's size.")
    array_throttle: int = setting(LAUNCH, "--array-throttle", default=0, minimum=0, maximum=SHARDS_MAX,
                                  only_with=_SLURM,
                                  help="slurm: at most N array tasks at once (sbatch --array=...%N).")
    ray_address: str = setting(LAUNCH, "--ray-address", default="", only_with=_RAY,
                               help="ray: the cluster's address (e.g. auto, or HOST:PORT); default: RAY_ADDRESS, a "
                                    "`ray start` cluster on this machine, else a new local Ray. GPUs: pass --gpus 1 "
                                    "(one per shard).")

    def __post_init__(self) -> None:
        self.validate()

    @property
    def world(self) -> int:
        """Number of shards: --shards, else one per GPU, or one per CPU worker."""
        return self.shards or (len(self.devices) if self.devices else self.workers)

    @property
    def on_gpu(self) -> bool:
        return bool(self.devices)

    @property
    def keeping_on_long(self) -> str:
        """The --on-long policy this task takes that keeps the most of a record over the limit: window for embed
        and score (every residue), truncate when generating (window is for embed and score), skip for variants
        (which scores whole sequences)."""
        return {"generate": "truncate", "variants": "skip"}.get(self.task, "window")

    @property
    def tokens_per_batch(self) -> int:
        if self.max_tokens_per_batch:
            return self.max_tokens_per_batch
        return DEFAULT_TOKENS_GPU if self.on_gpu else DEFAULT_TOKENS_CPU

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.on_gpu else "float32"

    def validate(self) -> None:
        """What the CLI's option types cannot say (and the same checks for Python callers)."""
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name))
            _check_bounds(f.metadata["option"], getattr(self, f.name), option_name(f.name))
        if (self.window is not None or self.overlap is not None) and self.on_long != "window":
            raise UserError("--window and --overlap apply to --on-long window")
        if self.on_long == "window" and self.task == "generate":
            raise UserError("--on-long window is for embed and score; generation continues a whole sequence: "
                            "use --on-long truncate, skip or error with --task generate")
        if self.temperature == float("inf"):
            raise UserError("--temperature must be finite (got inf): the logits are divided by it, so an infinite "
                            "one leaves no distribution to sample; a large one (e.g. 100) samples nearly uniformly")
        if not self.pools or not self.layers:
            raise UserError("--pool needs at least one of mean, cls, last, and --layers at least one layer")
        if self.task == "variants" and not self.variants:
            raise UserError("--task variants needs --variants FILE: a CSV or TSV with a header and columns id and "
                            "mutant (e.g. A23V, or A23V:G45D for a multi-mutant)")
        if self.task == "variants" and self.on_long in ("truncate", "window"):
            raise UserError(f"--task variants scores whole sequences: --on-long {self.on_long} is not available; use "
                            "--on-long skip (too-long records' variants get status 1) or error")
        if self.launcher != "local" and not self.shards:
            raise UserError(f"--launcher {self.launcher} needs --shards W: the number of shards, fixed now, "
                            "whatever number of nodes later runs them (e.g. --shards 64)")

    # ------------------------------------------------------------------ the run directory's copy
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict) -> "RunConfig":
        """A configuration as stored; fields that earlier versions wrote as 0 or -1 for "the default" read
        as None, and fields they did not know take their defaults."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        for name, unset in _OLD_UNSET.items():
            if values.get(name) == unset:
                values[name] = None
        if isinstance(values.get("seed"), int) and not 0 <= values["seed"] <= SEED_MAX:
            values["seed"] &= SEED_MAX   # earlier versions took any seed and sampled with it modulo 2**64
        for f in dataclasses.fields(cls):
            value, bound = values.get(f.name), f.metadata["option"].maximum
            if f.name != "seed" and type(value) is int and bound is not None and value > bound:
                values[f.name] = _default(f) if bound == CORES_MAX else bound
                if (f.name, value) in _SAID_ABOVE_BOUND:
                    continue
                _SAID_ABOVE_BOUND.add((f.name, value))
                log.warning("this run was planned with %s %d, above what run_shards takes since 2026-12-07 (%d): "
                            "it continues with %s %s", option_name(f.name), value, bound, option_name(f.name),
                            values[f.name])
        return cls(**values)

    @classmethod
    def from_manifest(cls, manifest: dict) -> "RunConfig":
        """The run's configuration as planned. Its shard count is the manifest's: runs planned before the
        count was kept in the configuration derived it from --workers, which a continued run may change."""
        config = cls.from_dict(manifest["config"])
        config.shards = manifest["world"]
        return config

    # ------------------------------------------------------------------ roles and options
    @classmethod
    def fields_with_role(cls, role: str) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata["option"].role == role)

    def result_fields(self) -> dict:
        return {k: getattr(self, k) for k in self.fields_with_role(RESULT)}

    def ignored(self) -> set[str]:
        """The fields that mean nothing with this configuration's task, launcher and flags (misplaced's
        options: --per-residue-dtype without --per-residue, kept by a run planned before it was refused)."""
        return {name for name in _FIELDS if misplaced([name], vars(self))}

    def as_command(self, out: str | None = None) -> str:
        """The `run_shards run` command line for this configuration (options left at their defaults, or
        meaningless with it, are omitted: the command line refuses those), into `out` when given: what
        messages tell a user to run to start a run over."""
        ignored = self.ignored()
        words = ["run", *files_words(self.fasta), "--out", out or self.out]
        if self.devices:
            words += ["--gpus", str(len(self.devices)) if self.launcher == "local" else "1"]
        else:
            words += ["--gpus", "0", "--workers", str(self.workers)]
        words += ["--threads", str(self.threads_per_worker)]
        for f in dataclasses.fields(self):
            opt, value = f.metadata["option"], getattr(self, f.name)
            if opt.apart or value == _default(f) or f.name in ignored:
                continue
            if isinstance(value, bool):
                words.append(opt.flags[0] if value else opt.off_flag)
            elif opt.repeat:
                for v in value:
                    words += [opt.flags[0], str(v)]
            elif isinstance(value, list):
                words += [opt.flags[0], ",".join(map(str, value))]
            else:
                words += [opt.flags[0], f"{value:g}" if isinstance(value, float) else str(value)]
        return command(*words)


# Fields that earlier versions stored as a number meaning "the default", now None.
_OLD_UNSET = {"max_tokens_per_batch": 0, "window": 0, "overlap": -1, "max_length": 0, "shards": 0}


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


_KINDS = {bool: "True or False", int: "a whole number", float: "a number", str: "text"}
_LIST_KINDS = {int: "whole numbers", float: "numbers", str: "texts"}


def check_value(name: str, value, option: str = "") -> None:
    """UserError unless `value` suits field `name` as the command line's option would take it (type, bounds);
    `option`: the option named in the refusal, where another command's option takes the field's values."""
    _check_type(name, value, option)
    _check_bounds(option_of(name), value, option or option_name(name))


def _check_type(name: str, value, option: str = "") -> None:
    """A value of the field's type, as the command line's option types ensure: from Python, per_residue="no" was
    taken as true (and trust_remote_code="false" too), max_tokens_per_batch="512" failed with a TypeError."""
    hint = _HINTS[name]
    if value is None and type(None) in typing.get_args(hint):
        return
    kind = field_type(name)
    is_list = typing.get_origin(hint) is list or list in map(typing.get_origin, typing.get_args(hint))
    values = value if is_list and isinstance(value, list) else [value]
    if is_list and not isinstance(value, list):
        values = [_NOT_A_LIST]
    for v in values:
        truth = isinstance(v, bool) or type(v).__name__ == "bool_"   # (numpy's, not a subclass of bool)
        fits = {bool: truth, int: isinstance(v, numbers.Integral) and not truth,
                float: isinstance(v, numbers.Real) and not truth, str: isinstance(v, str)}.get(kind, True)
        if not fits:
            what = f"a list of {_LIST_KINDS.get(kind, kind.__name__)}" if is_list else _KINDS.get(kind, kind.__name__)
            raise UserError(f"{option or option_name(name)} must be {what} (got {value!r})")


_NOT_A_LIST = object()


def _check_bounds(opt: Option, value, name: str) -> None:
    values = value if isinstance(value, list) else [value]
    for v in values:
        if v is None:
            continue
        if opt.choices and v not in opt.choices:
            raise UserError(f"{name} must be one of {', '.join(opt.choices)} (got {v!r})")
        if isinstance(v, numbers.Real) and v != v:   # NaN passes every comparison: it would turn off a bound
            raise UserError(f"{name} must be a number, not NaN (got {v!r})")
        if opt.minimum is not None and (v < opt.minimum or (opt.above_minimum and v == opt.minimum)):
            bound = "positive" if opt.above_minimum and opt.minimum == 0 else \
                f"{'above' if opt.above_minimum else 'at least'} {_number(opt.minimum)}"
            raise UserError(f"{name} must be {bound} (got {v!r})")
        if opt.maximum is not None and v > opt.maximum:
            raise UserError(f"{name} must be at most {_number(opt.maximum)} (got {v!r})")


def _number(x) -> str:
    """A bound in words: 1e+06 for a float, every digit of a whole number (18446744073709551615, not 1.84467e+19)."""
    return str(x) if isinstance(x, numbers.Integral) else f"{x:g}"


def option_of(name: str) -> Option:
    """The Option of RunConfig field `name`."""
    return _FIELDS[name].metadata["option"]


def option_name(name: str) -> str:
    """The `run` option that sets RunConfig field `name` (the field's name where no option does)."""
    flags = option_of(name).flags
    return flags[0] if flags else name


def default_of(name: str):
    return _default(_FIELDS[name])


def field_type(name: str) -> type:
    """The field's value type: int for `int | None`, int for `list[int]`, and so on."""
    hint = _HINTS[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is list:
        return args[0]
    return args[0] if args else hint


def misplaced(given: typing.Iterable[str], values: typing.Mapping[str, typing.Any]) -> str | None:
    """Options given that only mean something with another task or launcher (e.g. --temperature without
    --task generate), or with a flag left off (--per-residue-dtype without --per-residue): the refusal, or
    None. `given` are field names (or COMMAND_ONLY_WITH's); `values` the run's task and launcher, and the
    flags that options need (a flag missing from `values` is off)."""
    given = list(given)
    owners = {n: option_of(n).only_with for n in _FIELDS if option_of(n).only_with}
    owners.update(COMMAND_ONLY_WITH)
    wrong: dict[tuple[str, ...], list[str]] = {}
    for name in given:
        owner = owners.get(name)
        if owner and values.get(owner[0]) not in owner[1:]:
            wrong.setdefault(owner, []).append(option_name(name) if name in _FIELDS else f"--{name.replace('_', '-')}")
    for (what, *allowed), names in wrong.items():
        verb = "applies" if len(names) == 1 else "apply"
        return (f"{', '.join(names)} {verb} only to {option_name(what)} {' or '.join(allowed)} (this run's "
                f"{option_name(what)[2:]} is {values.get(what)})")
    for name in given:
        flag = option_of(name).needs if name in _FIELDS else ""
        if flag and not values.get(flag):
            if field_type(flag) is bool:
                return (f"{option_name(name)} applies only with {option_name(flag)}: add {option_name(flag)}, or "
                        f"drop {option_name(name)}")
            return (f"{option_name(name)} applies only with {option_name(flag)} above 0 (at 0, greedy decoding, "
                    f"nothing is sampled): give {option_name(flag)} T, or drop {option_name(name)}")
    return None


_FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}
_HINTS = typing.get_type_hints(RunConfig)


def overlap_setting() -> bool | None:
    """RUN_SHARDS_OVERLAP: whether workers overlap their batches, 1 or 0; None where it is unset (each worker's
    default). Read by the workers, and checked by a local run's parent before any starts: a wrong value found
    by the workers failed every shard, and the `rerun` suggested failed the same way."""
    import os
    setting = os.environ.get("RUN_SHARDS_OVERLAP", "")
    if setting not in ("", "0", "1"):
        raise UserError(f"RUN_SHARDS_OVERLAP={setting!r}: set it to 1 (overlap batches) or 0 (one at a time), "
                        "or unset it")
    return None if setting == "" else setting == "1"
