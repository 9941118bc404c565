"""Planning a run, before any worker starts: the index and the input policies, the shard geometry, the
model and its engine, the token limit and what happens to longer sequences, the disk it will need, and
the manifest that fixes all of it for every later command. `plan` never changes the caller's RunConfig:
what it decides is in the Plan's own.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from index import InputChanged, SequenceIndex, load_or_build
from index.cache import cache_dir

from .. import __version__, faults
from ..config import LISTED_SHARDS, RunConfig
from ..errors import UserError
from ..models import structure_input, vocabulary_fit
from ..output import run_inputs, status_codes
from ..output.schema import BASE_COLUMNS, Schema
from ..output.variant_list import VariantList
from ..rundir.layout import RunDir
from . import run_identity, run_index
from .continued import reconcile, shard_count
from .copies import Copies, plan_copies
from .input_policies import apply_input_policies
from .length_limit import check_long, longest_prompt, token_limit, warn_beyond_training, warn_generation_beyond
from .model_copies import check_model_copies
from .storage import check_storage
from .variants_file import check_variants_out, read_variants
from .tokenization_check import decide_and_check

log = logging.getLogger("run_shards")

_BASE = {c.path for c in BASE_COLUMNS}


@dataclass
class Plan:
    """A planned run: its settings as fixed (the shard count, the window), its index (the caller closes
    it: `with plan.index:`) and the manifest every later command reads."""
    config: RunConfig
    index: SequenceIndex
    manifest: dict
    continued: bool         # the run directory already held this run
    variants: VariantList | None = None   # --task variants: the variants file as read and checked
    copies: Copies = dataclasses.field(default_factory=Copies)   # what the run copies instead of computing

    def record(self, run: RunDir) -> dict:
        """Write the plan into `run` (a new run's index, variants and manifest; a continued run's manifest, with
        this command's launch settings) and return the manifest as stored."""
        if not self.continued:   # the run's copy holds the stride table its workers read (index/stride.py)
            self.copies.place(run)
            only, copy_plan = self.copies.only(run)   # (of the records it computes)
            try:
                self.index.save(run.index_path, world=self.manifest["world"], only=only)
            finally:
                if copy_plan is not None:
                    copy_plan.close()
            self.index.adopt_stride(run.index_path)
            if self.variants is not None:
                self.variants.save(run.variants_path)
            faults.maybe_crash_planning()
        elif problem := run_index.index_problem(run):   # deleted or damaged: this command's index is the run's
            run_index.save_again(run, self.manifest, self.index, problem)   # (`reconcile` checked)
        if not run.exists() or run.read_manifest() != self.manifest:
            run.write_manifest(self.manifest)
        return run.read_manifest()


@dataclass
class Model:
    """The model a run uses, as planning found it."""
    source: object          # models.checkpoint.ModelSource
    engine: str             # "native" or "hf"
    info: object            # models.checkpoint.EngineInfo
    hf_tokenizer: object
    convention: object = None   # models.conventions.Convention: how residues are written (tokenization_check)


def plan(config: RunConfig, on_model=None, progress: bool = True) -> Plan:
    """Plan the run `config` describes in `config.out` (or check that a later command continues the run
    there consistently); UserError, naming what to change, for anything that would fail later. For a new run,
    `on_model(order)` is told the model as soon as it is chosen, before its config and tokenizer are read, for
    workers to load it meanwhile (`choose_model`). `progress`: a bar while a gzip input is decompressed (off with
    --no-progress and -q)."""
    run = RunDir(config.out)
    old = run.read_manifest() if run.exists() else None
    index, reused = read_inputs(config, progress=progress)
    try:
        return _plan(config, run, old, index, on_model)
    except InputChanged as e:
        index.close()
        if old is not None or not reused:   # (a planned run's own index: its refusal says what to do)
            raise
        # An edit that kept the file's size and modification time: the cached index looked current, and a
        # record's checksum told otherwise. A new run indexes the files anew and plans on them as they are.
        log.warning("the cached index of %s is stale (%s, though the file's size and modification time are as "
                    "they were): indexing the input anew", e.path, e.message)
        index, _ = read_inputs(config, rebuild=True, progress=progress)
    except BaseException:
        index.close()
        raise
    try:
        return _plan(config, run, old, index, on_model)
    except BaseException:
        index.close()
        raise


def read_inputs(config: RunConfig, rebuild: bool = False, progress: bool = True) -> tuple[SequenceIndex, bool]:
    """The FASTA files' index (built, or reused from the cache unless `rebuild`), with the input policies
    applied, and whether it came from the cache."""
    cache = cache_dir()
    if cache.exists() and not cache.is_dir():
        variable = "RUN_SHARDS_CACHE" if os.environ.get("RUN_SHARDS_CACHE") else "the cache path"
        raise UserError(f"{variable} {cache} is a file, not a directory: point RUN_SHARDS_CACHE at a directory "
                        "(run_shards keeps its index and model caches there)")
    index, reused = load_or_build(config.fasta, rebuild=rebuild, progress=progress)
    log.info("index %s: %d records, %d residues, %d file(s)", "reused from cache" if reused else "built",
             len(index), index.total_residues, len(index.inputs))
    try:
        return apply_input_policies(index, config), reused
    except BaseException:
        index.close()
        raise


def _plan(config: RunConfig, run: RunDir, old: dict | None, index: SequenceIndex, on_model=None) -> Plan:
    shards = shard_count(config, old, len(index), run)   # first: a contradicting --shards costs nothing
    planned = dataclasses.replace(config, out=str(run.root), shards=shards, **_absolute(config, "variants",
                                                                                        "variants_out"))
    variants = read_variants(planned.variants, index) if planned.task == "variants" else None
    model = choose_model(planned, on_model if old is None else None, continuing=old is not None)
    if planned.variants_out:
        check_variants_out(planned.variants_out, run_inputs.of_run(run.root, planned.fasta, planned.variants,
                                                                   model.source.path))
    model.convention = decide_and_check(index, model.source, model.hf_tokenizer, planned.input_format)
    structure_input.check_task(model.convention, planned.task)
    limit = token_limit(model.info.max_tokens, planned.max_length)
    planned = _fit_lengths(planned, index, model, limit, None if variants is None else variants.record)
    from ..tasks import make_task, schema_for
    from ..tasks.embed import cls_caveat
    from ..tasks.tokenization import SequenceTokenizer
    task = make_task(planned, model.info)
    tokenizer = SequenceTokenizer(model.hf_tokenizer, model.convention)
    task.prepare(tokenizer)
    schema = schema_for(task)
    log.info("columns: %s", ", ".join(c.path for c in schema.columns if c.path not in _BASE))   # e.g. _layer5 for -2
    if planned.task == "embed":
        from ..engine.interface import same_layers
        for group in same_layers(planned.layers, model.info.num_layers):
            log.warning("--layers %s name the same hidden state of this %d-layer model: one column holds it",
                        " and ".join(map(str, group)), model.info.num_layers)
    if planned.task == "embed" and "cls" in planned.pools and (caveat := cls_caveat(model.info, tokenizer)):
        log.warning("--pool cls with %s: %s", model.source.model_type, caveat)
    resolved = run_identity.of_plan(planned, model, limit, task.attrs())
    copies = plan_copies(planned, model, schema, index, run, old, resolved, task.attrs())   # duplicates, --reuse
    try:
        planned = dataclasses.replace(planned, shards=copies.shards(shards))
        check_storage(schema, index, planned.shards, run.root, planned.task, planned.max_new_tokens)
        _log_shards(index, planned.shards, copies.computed)
        manifest = _manifest(planned, model, schema, limit, index)
        runs = None if variants is None else variants.record   # (--task variants runs the records with variants)
        manifest["longest_prompt"] = longest_prompt(index, tokenizer, limit, planned, runs)
        manifest["attrs"].update(task.attrs())
        manifest["attrs"]["resolved"] = resolved   # (what a continued run and --reuse of its result compare)
        if variants is not None:
            manifest["variants"] = {"file": variants.source, "fingerprint": variants.sha256, "count": len(variants)}
            log.info("variants: %d in %s, for %d record(s)", len(variants), variants.source,
                     len(set(variants.record.tolist())))
        if copies.counts is not None:
            manifest["copies"] = copies.record()
        if old is not None:
            manifest = reconcile(run, old, manifest, planned, index)
        return Plan(planned, index, manifest, continued=old is not None, variants=variants, copies=copies)
    except BaseException:
        copies.discard()
        raise


def _absolute(config: RunConfig, *names: str) -> dict:
    """File options as absolute paths: workers, a merge job and later commands may start elsewhere (and
    the commands messages suggest work from there). --model is one where it names a local directory."""
    found = {n: os.path.abspath(getattr(config, n)) for n in names if getattr(config, n)}
    model = os.path.expanduser(config.model)   # (`--model=~/ck`: the shell leaves that ~ alone)
    if config.model != "demo" and os.path.isdir(model):
        found["model"] = os.path.abspath(model)
    return found


def choose_model(config: RunConfig, on_model=None, continuing: bool = False) -> Model:
    """The checkpoint, the engine that runs it and what it is (its config and tokenizer; no weights).
    `on_model`: told, as soon as they are known, what a worker's engine load asks for: engine, path,
    fingerprint, dtype, batch_invariant, logprobs and trust_remote_code (models/preload.py). `continuing`: the
    run exists (a command continuing it)."""
    from ..engine import selection as engines
    from ..models import checkpoint
    _settle_matmul_mode(config)
    cache = cache_dir()
    try:
        source = checkpoint.resolve(config.model, cache)
    except OSError as e:   # the demo model or a download goes into the cache: a HOME that cannot be written
        where = Path(e.filename) if e.filename else None
        if where is None or not (where == cache or cache in where.parents or where in cache.parents):
            raise
        raise UserError(f"--model {config.model} is kept in run_shards' cache, and {e.filename} cannot be "
                        f"written ({e.strerror}): point RUN_SHARDS_CACHE at a folder you can write, e.g. "
                        f"`export RUN_SHARDS_CACHE=/tmp/run_shards_cache`, and run the command again") from None
    if config.launcher == "local":   # its workers, on this machine, then find the weights in memory
        checkpoint.read_ahead(source.path)
    checkpoint.refuse_remote_code(source, config.trust_remote_code)
    engine = engines.choose(config.engine, source, config.task)
    engines.check_dtype(engine, config.torch_dtype_name, config.on_gpu)
    check_model_copies(config, source.path, planned=continuing)   # (before a worker is told to load it)
    if config.launcher == "local" and config.devices:
        from ..engine import gpu_support
        from . import devices
        gpu_support.check_gpus(engine, devices.gpu_models(config.devices))
    if on_model is not None:
        on_model({"engine": engine, "path": source.path, "fingerprint": source.fingerprint,
                  "dtype": config.torch_dtype_name, "batch_invariant": engines.batch_invariant(engine, config),
                  "logprobs": config.task in ("score", "variants"), "trust_remote_code": config.trust_remote_code})
    hf_config = checkpoint.read_config(source, config.trust_remote_code)
    hf_tokenizer = checkpoint.read_tokenizer(source, hf_config, config.trust_remote_code)
    vocabulary_fit.check(source.name, source.path, hf_config, hf_tokenizer)
    info = checkpoint.describe(source, engine, hf_tokenizer, config.trust_remote_code, hf_config)
    if source.facts.remote_code:
        log.warning("--trust-remote-code: the hf engine runs this checkpoint's own Python code (%s)",
                    "; ".join(source.facts.remote_code))
    if engine == "native" and config.batch_invariant and not config.on_gpu \
            and not engines.batch_invariant(engine, config):
        log.warning("this run's values are not batch-invariant (they may differ in their last bits with another "
                    "budget or number of workers; the result's `batch_invariant` attribute says so): %s",
                    engines.why_not_batch_invariant(config))
    return Model(source, engine, info, hf_tokenizer)


def _settle_matmul_mode(config: RunConfig) -> None:
    """Put this process's MKL in the mode a fresh worker of a batch-invariant CPU run puts its own in, before
    anything here computes: materialising the demo model builds it with transformers (its initialisers
    use MKL), after which MKL refuses strict mode, and this process's answer to "is the run batch-invariant"
    (written into the manifest and the result) would be no, though every worker's is yes."""
    if config.batch_invariant and not config.on_gpu:
        from ..engine import mkl_cnr
        mkl_cnr.strict_matmuls()


def _fit_lengths(config: RunConfig, index: SequenceIndex, model: Model, limit: int | None,
                 runs: np.ndarray | None = None) -> RunConfig:
    """Check the sequences against the model (alphabet, length limit) and fix the window size for
    --on-long window; returns the settings with the window fixed. `runs`: the records the model runs, where
    not all (--task variants: those with variants; only they must fit the limit)."""
    from index.alphabet import alphabet_mismatch

    from ..tasks.tokenization import SequenceTokenizer
    tokenizer = SequenceTokenizer(model.hf_tokenizer, model.convention)
    mismatch = alphabet_mismatch(index, model.hf_tokenizer.get_vocab())   # DNA given to a protein model, or the reverse
    if mismatch:
        log.warning("%s", mismatch)
    if config.on_long == "window":
        from ..engine import windowed
        config = dataclasses.replace(config)
        windowed.plan(config, limit, tokenizer)   # fixes the copy's window and overlap
    check_long(index, tokenizer, limit, config, runs)
    warn_beyond_training(index, tokenizer, limit, model.info.extra.get("trained_context"))
    if config.task == "generate":
        warn_generation_beyond(index, tokenizer, limit, config.on_long, model.info.max_tokens,
                               model.info.extra.get("trained_context"), config.max_new_tokens)
        from ..tasks.generate import generation_config_note
        note = generation_config_note(model.source.path, config)
        if note:
            log.warning("%s", note)
    return config


def _log_shards(index: SequenceIndex, shards: int, computed: int | None) -> None:
    if computed is not None and computed < len(index):   # (the table of the records computed is written later)
        log.info("shards: %d, %d records computed in all", shards, computed)
        return
    stats = index.shard_stats(shards)
    log.info("shards: %d, sequences per shard %d..%d, residues max/mean %.4f", shards,
             int(stats.sequences.min()), int(stats.sequences.max()), stats.imbalance)
    for r in range(shards) if shards <= LISTED_SHARDS else ():   # else the line above says it
        log.info("  shard %d: %d sequences, %d residues", r, int(stats.sequences[r]), int(stats.tokens[r]))


def _manifest(config: RunConfig, model: Model, schema: Schema, limit: int | None, index: SequenceIndex) -> dict:
    from ..engine import selection as engines
    stored = json.loads(config.to_json())
    attrs = {
        "task": config.task, "model": config.model, "model_fingerprint": model.source.fingerprint,
        "model_files": model.source.files,
        "model_type": model.source.model_type, "model_family": model.source.family.key,
        "input_format": model.convention.words(), "dtype": config.torch_dtype_name, "engine": model.engine,
        "batch_invariant": engines.batch_invariant(model.engine, config), "config": stored,
        "software_version": __version__, "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "index_fingerprint": index.fingerprint(), "fasta_files": config.fasta,
        "status_codes": {str(k): v for k, v in status_codes.DESCRIPTIONS.items()},
    }
    return {"config": stored, "model": model.source.identity(), "engine": model.engine, "schema": schema.to_json(),
            "max_tokens": limit, "world": config.shards, "info": model.info.to_json(),
            "input_format": model.convention.to_json(),
            "index": {"fingerprint": index.fingerprint(), "count": len(index)}, "attrs": attrs}
