"""The one run configuration that flows from the CLI to the parent, the workers and the output files."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from .errors import UserError

TASKS = ("embed", "score", "generate")
POOLS = ("mean", "cls", "last")
ENGINES = ("auto", "native", "hf")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ON_LONG = ("error", "truncate", "skip", "window")
ON_DUPLICATE = ("error", "rename")
INPUT_FORMATS = ("auto", "plain", "spaced")   # how residues are written for the tokenizer (docs/models.md)
LAUNCHERS = ("local", "slurm", "ray")

# Token budgets per batch when --max-tokens-per-batch is not given: CPU batches stay cache-friendly,
# GPU batches are large enough to fill the device.
DEFAULT_TOKENS_CPU = 4096
DEFAULT_TOKENS_GPU = 32768


@dataclass
class RunConfig:
    fasta: list[str]
    out: str
    model: str = "demo"
    task: str = "embed"
    engine: str = "auto"
    devices: list[str] = field(default_factory=list)   # GPU ids, one worker each; empty = CPU workers
    workers: int = 1
    threads_per_worker: int = 1
    max_tokens_per_batch: int = 0                        # 0 = default for the device
    max_seqs: int = 256
    dtype: str = "auto"
    pools: list[str] = field(default_factory=lambda: ["mean"])
    layers: list[int] = field(default_factory=lambda: [-1])
    per_residue: bool = False
    per_residue_dtype: str = "float16"
    on_long: str = "error"
    window: int = 0                                      # --on-long window: tokens per window (0 = the limit)
    overlap: int = -1                                    # content tokens shared by neighbours (-1 = window/4)
    max_length: int = 0                                  # 0 = the model's own limit (if any)
    on_duplicate_id: str = "error"
    skip_empty: bool = False
    batch_invariant: bool = True                         # native engine: the same bits whatever the batch
    input_format: str = "auto"                           # auto: the model family's convention (models/registry.py)
    trust_remote_code: bool = False                      # let transformers run a checkpoint's own Python code
    checkpoint_sequences: int = 20000
    checkpoint_seconds: float = 60.0
    worker_timeout: float = 1800.0
    summary_seconds: float = 30.0
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    launcher: str = "local"                              # local, slurm or ray (pipeline/launchers)
    shards: int = 0                                      # W; 0 = one shard per GPU or CPU worker
    shards_per_task: int = 1                             # slurm: shards per array task, one worker per GPU
    sbatch: str = ""                                     # slurm: more sbatch options
    array_throttle: int = 0                              # slurm: at most N array tasks at once (0 = no limit)
    ray_address: str = ""                                # ray: the cluster's address ("" = a local Ray)

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
        def check(value, allowed, option):
            if value not in allowed:
                raise UserError(f"{option} must be one of {', '.join(allowed)} (got {value!r})")
        check(self.task, TASKS, "--task")
        check(self.engine, ENGINES, "--engine")
        check(self.dtype, DTYPES, "--dtype")
        check(self.on_long, ON_LONG, "--on-long")
        if self.on_long == "window" and self.task == "generate":
            raise UserError("--on-long window is for embed and score; generation continues a whole sequence: "
                            "use --on-long truncate, skip or error with --task generate")
        if self.window < 0 or self.overlap < -1:
            raise UserError("--window and --overlap must not be negative")
        check(self.on_duplicate_id, ON_DUPLICATE, "--on-duplicate-id")
        check(self.input_format, INPUT_FORMATS, "--input-format")
        check(self.per_residue_dtype, ("float16", "float32"), "--per-residue-dtype")
        for pool in self.pools:
            check(pool, POOLS, "--pool")
        if not self.pools:
            raise UserError("--pool needs at least one of mean, cls, last")
        if self.workers < 1:
            raise UserError("--workers must be at least 1")
        check(self.launcher, LAUNCHERS, "--launcher")
        if self.shards < 0 or self.shards_per_task < 1 or self.array_throttle < 0:
            raise UserError("--shards and --shards-per-task must be at least 1, --array-throttle 0 or more")
        if self.launcher != "local" and not self.shards:
            raise UserError(f"--launcher {self.launcher} needs --shards W: the number of shards, fixed now, "
                            "whatever number of nodes later runs them (e.g. --shards 64)")
        if self.max_tokens_per_batch < 0 or self.max_seqs < 1:
            raise UserError("--max-tokens-per-batch must be positive and --max-seqs at least 1")
        if self.checkpoint_sequences < 1 or self.checkpoint_seconds <= 0:
            raise UserError("--checkpoint-every and --checkpoint-seconds must be positive")
        if self.max_length < 0:
            raise UserError("--max-length must be positive")
        if self.task == "generate" and self.max_new_tokens < 1:
            raise UserError("--max-new-tokens must be at least 1")
        if not 0 < self.top_p <= 1 or self.temperature < 0:
            raise UserError("--top-p must be in (0, 1] and --temperature >= 0")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    # What must be equal between the run that wrote shards and the run that resumes or merges them.
    RESULT_FIELDS = ("fasta", "model", "task", "engine", "dtype", "pools", "layers", "per_residue",
                     "per_residue_dtype", "on_long", "window", "overlap", "max_length", "on_duplicate_id", "skip_empty",
                     "batch_invariant", "input_format", "max_new_tokens", "temperature", "top_p", "seed")

    # How the shards are run, not what they compute: a later `run` of the same run may change these.
    LAUNCH_FIELDS = ("workers", "threads_per_worker", "checkpoint_sequences", "checkpoint_seconds",
                     "worker_timeout", "summary_seconds", "launcher", "shards_per_task", "sbatch", "array_throttle",
                     "ray_address", "trust_remote_code")

    @staticmethod
    def option_name(field_name: str) -> str:
        """The `run` option that sets a field."""
        return {"workers": "--workers", "threads_per_worker": "--threads", "devices": "--gpus"}.get(
            field_name, _OPTIONS.get(field_name, field_name))

    def result_fields(self) -> dict:
        return {k: getattr(self, k) for k in self.RESULT_FIELDS}

    def as_command(self, out: str | None = None) -> str:
        """The `run_shards run` command line for this configuration (options left at their defaults are
        omitted), into `out` when given: what messages tell a user to run to start a run over."""
        import shlex
        defaults = RunConfig(fasta=["x"], out="x")
        words = ["run_shards", "run", *self.fasta, "--out", out or self.out]
        if self.devices:
            words += ["--gpus", str(len(self.devices)) if self.launcher == "local" else "1"]
        else:
            words += ["--gpus", "0", "--workers", str(self.workers)]
        words += ["--threads", str(self.threads_per_worker)]
        for name, option in _OPTIONS.items():
            value = getattr(self, name)
            if value == getattr(defaults, name):
                continue
            if isinstance(value, bool):
                words.append(option)
            elif isinstance(value, list):
                words += [option, ",".join(map(str, value))]
            else:
                words += [option, f"{value:g}" if isinstance(value, float) else str(value)]
        return " ".join(shlex.quote(w) for w in words)


# RunConfig fields and the `run` options that set them (devices, workers and threads are written apart).
_OPTIONS = {
    "model": "--model", "task": "--task", "engine": "--engine", "max_tokens_per_batch": "--max-tokens-per-batch",
    "max_seqs": "--max-seqs", "dtype": "--dtype", "pools": "--pool", "layers": "--layers",
    "per_residue": "--per-residue", "per_residue_dtype": "--per-residue-dtype", "on_long": "--on-long",
    "window": "--window", "overlap": "--overlap", "max_length": "--max-length", "on_duplicate_id": "--on-duplicate-id", "skip_empty": "--skip-empty",
    "batch_invariant": "--no-batch-invariant",   # on by default: as_command writes the flag only when it is off
    "input_format": "--input-format", "trust_remote_code": "--trust-remote-code",
    "checkpoint_sequences": "--checkpoint-every", "checkpoint_seconds": "--checkpoint-seconds",
    "worker_timeout": "--worker-timeout", "summary_seconds": "--summary-seconds",
    "max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p", "seed": "--seed",
    "launcher": "--launcher", "shards": "--shards", "shards_per_task": "--shards-per-task", "sbatch": "--sbatch",
    "array_throttle": "--array-throttle", "ray_address": "--ray-address",
}
