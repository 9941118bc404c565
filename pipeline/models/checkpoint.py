"""Resolve `--model` to a local checkpoint directory once, in the parent, and describe it: `describe` is the
one place an EngineInfo is made, for planning and both engines.

`demo` is the bundled demo model (materialised offline on first use); an existing directory is used as
it is; anything else is a Hugging Face hub id, downloaded once by the parent so workers never race to
fetch it.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from index.cache import cache_dir

from . import demo as demo_model
from . import file_digest
from ..errors import UserError
from .checkpoint_facts import TOKENIZER_FILES, CheckpointFacts, read_facts, read_json, safetensors_header, weight_files
from .hf_config import is_causal_lm, is_masked_lm
from .registry import Family, recognise

log = logging.getLogger("run_shards")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
# Files of a checkpoint directory that nothing reads to compute: its documentation and hidden files
# (.gitattributes). Every other file beside config.json and the weights is part of the model's identity.
NOT_READ = ("README", "LICENSE", "LICENCE", "NOTICE", "CITATION", ".")
NOT_READ_SUFFIXES = (".md", ".png", ".jpg", ".jpeg", ".gif", ".svg", ".pdf", ".html")
WHOLE_FILE_BYTES = 64 << 20   # a larger file beside the weights is digested like a weight file
READ_AHEAD_CHUNK = 128 << 10   # Linux's default readahead window (read_ahead_kb)


@dataclass
class EngineInfo:
    """What the tasks and planning need to know of a model, whichever engine runs it."""
    name: str                 # "hf" or "native"
    hidden_size: int
    num_layers: int           # hidden_states has num_layers + 1 entries; index num_layers = final norm output
    is_causal: bool
    max_tokens: int | None    # the MODEL's hard limit on tokens per sequence, None if none (a run's
    #                           --max-length cap travels apart from it: the manifest's max_tokens)
    architecture: str = ""
    masked_lm: bool = False   # a masked language model with its head (score and variants by masking)
    model_fingerprint: str = ""
    family: str = ""          # models/registry.py key
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "EngineInfo":
        return cls(**data)


@dataclass
class ModelSource:
    name: str          # what the user passed
    path: str          # local directory
    model_type: str
    architectures: list[str]
    fingerprint: str   # changes when config.json or a weight file changes
    facts: CheckpointFacts | None = None
    family: Family | None = None
    files: dict[str, str] = field(default_factory=dict)   # every other file it reads -> digest (file_digests)

    @property
    def is_causal(self) -> bool:
        if self.family is not None and self.family.causal is not None:
            return self.family.causal
        return is_causal_lm(self.model_type, self.architectures)

    @property
    def is_masked_lm(self) -> bool:
        return not self.is_causal and is_masked_lm(self.architectures)

    def identity(self) -> dict:
        """What the run directory keeps of the model: later commands check the checkpoint against it
        (`check_unchanged`, `identity_changes`)."""
        return {"name": self.name, "path": self.path, "model_type": self.model_type, "fingerprint": self.fingerprint,
                "files": self.files}


def resolve(name: str, cache_root: Path) -> ModelSource:
    local = os.path.expanduser(name)   # (`--model=~/ck` reaches us with its ~: the shell expands only `~/ck`)
    if name == demo_model.NAME:
        path = demo_model.ensure(cache_root)
    elif os.path.isdir(local):
        path = _snapshot(name, Path(local).resolve())
    elif os.path.exists(local):
        folder = Path(local).resolve().parent
        instead = f"--model {folder}" if (folder / "config.json").exists() else "the checkpoint's directory (with config.json)"
        raise UserError(f"--model {name}: is a file; pass {instead}")
    else:
        path = _download(name)
    config_file = Path(path) / "config.json"
    if not config_file.exists():
        raise UserError(f"--model {name}: {path} has no config.json; pass a Hugging Face checkpoint directory")
    _refuse_weightless(name, Path(path))
    _refuse_missing(name, Path(path))
    _refuse_damaged(name, Path(path))
    try:
        facts = read_facts(path)
    except (OSError, ValueError) as e:
        raise UserError(f"--model {name}: cannot read {config_file} ({e}); replace it with an intact copy") from None
    return ModelSource(name=name, path=str(path), model_type=facts.model_type, architectures=list(facts.architectures),
                       fingerprint=fingerprint(Path(path)), facts=facts, family=recognise(facts),
                       files=file_digests(Path(path)))


def _snapshot(name: str, path: Path) -> Path:
    """The checkpoint a local directory holds: itself, or where it is a model's folder of the Hugging Face cache
    (models--ORG--NAME, with snapshots/HASH/ and refs/main), the snapshot refs/main names, as the hub id would
    load it offline (else its only snapshot)."""
    snapshots = path / "snapshots"
    if (path / "config.json").exists() or not snapshots.is_dir():
        return path
    ref = path / "refs" / "main"
    main = snapshots / ref.read_text().strip() if ref.is_file() else None
    found = sorted(d for d in snapshots.iterdir() if (d / "config.json").exists())
    chosen = main if main is not None and (main / "config.json").exists() else found[0] if len(found) == 1 else None
    if chosen is None:
        listed = ", ".join(d.name for d in found) or "none with a config.json"
        raise UserError(f"--model {name}: {path} is a model's folder of the Hugging Face cache, and its "
                        f"refs/main names no snapshot with a config.json (snapshots: {listed}). Pass one snapshot, "
                        f"--model {snapshots}/HASH")
    log.info("--model %s: the Hugging Face cache's snapshot %s%s", name, chosen.name,
             " (refs/main)" if chosen == main else "")
    return chosen


def local_source(path: str, fingerprint_: str = "") -> ModelSource:
    """The ModelSource of a checkpoint directory already resolved (a worker's, a test's)."""
    facts = read_facts(path)
    return ModelSource(name=str(path), path=str(path), model_type=facts.model_type,
                       architectures=list(facts.architectures), fingerprint=fingerprint_, facts=facts,
                       family=recognise(facts))


def refuse_remote_code(source: ModelSource, trusted: bool) -> None:
    """A checkpoint that asks transformers to run its own Python code runs only with --trust-remote-code."""
    if source.facts.remote_code and not trusted:
        raise UserError(f"--model {source.name}: this checkpoint runs its own Python code, which transformers "
                        f"loads only when told to trust it ({'; '.join(source.facts.remote_code)}). Read that "
                        "code; if you trust it, run again with --trust-remote-code (the hf engine then runs it, "
                        "and run.log says so).")


def weight_problems(path: Path) -> list[str]:
    """Safetensors files of the checkpoint at `path` that cannot be whole, judged from their headers and sizes
    alone (a cheap check before any worker loads them): a truncated file, a damaged header."""
    problems = []
    for f in sorted(path.glob("*.safetensors")):
        if f.is_symlink() and not f.exists():
            continue   # a link whose target is gone: missing, not damaged (missing_weights names it)
        try:
            size = f.stat().st_size
            n, header = safetensors_header(f)
            ends = [int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"]
            if 8 + n + max(ends, default=0) != size:
                raise ValueError(f"{size:,} bytes where its header describes {8 + n + max(ends, default=0):,}")
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            problems.append(f"{f} ({e})")
    return problems


# The weight files transformers and the native engine read (models/layers/loader.py): one file, or the files of a
# sharded set (model-00001-of-00002.safetensors, pytorch_model-00001-of-00002.bin).
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


def has_weights(path: Path) -> bool:
    """The checkpoint folder holds weight files of a kind transformers and the native engine read."""
    return any(next(path.glob(pattern), None) for pattern in WEIGHT_FILES)


def _refuse_weightless(name: str, path: Path) -> None:
    """A checkpoint without weights (config and tokenizer alone, or weights under another name) is refused
    while planning: a worker could only fail on it, and `rerun` again."""
    if not has_weights(path):
        raise UserError(f"--model {name}: {path} has no weights: no .safetensors file nor pytorch_model.bin (one "
                        "file, or a sharded set). Pass the directory that holds the checkpoint's "
                        "weights beside its config.json, or save the model there with transformers' "
                        "save_pretrained.")


def missing_weights(path: Path) -> list[str]:
    """The weight files a load of the checkpoint at `path` would read that are not there, each named with the
    index that lists it (a shard of a sharded set left out of a download or copy, or a dangling link of a
    Hugging Face cache whose blob is gone), or its index if that cannot be read."""
    try:
        files, _, index = weight_files(path)
    except (OSError, ValueError, AttributeError) as e:
        return [f"its index cannot be read ({type(e).__name__}: {_first_line(e)})"]
    return [_missing(path / f, index) for f in files if not (path / f).is_file()]


def _missing(file: Path, index: str) -> str:
    """A weight file a load would read that is not there: named with the index listing it, and where it is a
    link (a Hugging Face cache's snapshot links into blobs/), with the target that is gone."""
    where = [f"listed in {index}"] if index else []
    if file.is_symlink():
        where.append(f"a link to {os.path.join(file.parent, os.readlink(file))}, which is gone")
    return f"{file} ({'; '.join(where)})" if where else str(file)


def _refuse_missing(name: str, path: Path, again: str = "run the same command again") -> None:
    """A sharded set missing a shard is refused while planning: a worker could only fail on it, after the run
    was planned with the fingerprint of the files that are there, which the complete set no longer matches."""
    missing = missing_weights(path)
    if missing:
        raise UserError(f"--model {name}: missing weight file(s): {'; '.join(missing)}. Download or copy the "
                        f"checkpoint again, whole (every file its index lists), and {again}.")


def _refuse_damaged(name: str, path: Path) -> None:
    problems = weight_problems(path)
    if problems:
        raise UserError(f"--model {name}: damaged weight file(s): {'; '.join(problems)}. Replace them with an "
                        "intact copy of the checkpoint.")


def load_failure(error: BaseException, path: str) -> str | None:
    """What is wrong with the checkpoint's files when loading it failed with `error`: a weight file that fails
    its header check, or a file that fails to read; None when the files are not the cause (an unsupported
    config value says so itself as a UserError; anything else is a bug or the environment)."""
    import pickle
    if isinstance(error, UserError):
        return None
    missing = missing_weights(Path(path))
    if missing:
        return f"missing weight file(s): {'; '.join(missing)}"
    problems = weight_problems(Path(path))
    if problems:
        return f"damaged weight file(s): {'; '.join(problems)}"
    unreadable = [OSError, EOFError, pickle.UnpicklingError]
    try:
        from safetensors import SafetensorError
        unreadable.append(SafetensorError)
    except ImportError:
        pass
    if isinstance(error, tuple(unreadable)):
        return f"a file fails to read ({type(error).__name__}: {_first_line(error)})"
    return None


def check_unchanged(identity: dict, start_over: str = "start a new run with another --out",
                    again: str = "run the same command again") -> None:
    """Before workers of an existing run load its model (and in each worker, before and after its load: a
    SLURM or Ray task may start hours after the run was planned): the demo model is verified (rebuilt if
    damaged); any other checkpoint must still be there, unchanged and whole (weight headers). Unchanged:
    config.json and the weights (fingerprint) and, for a run that recorded them, every other file
    (`file_digests`: the tokenizer's). `again`: what to do once the checkpoint is restored; `start_over`: the
    refusal's other way out."""
    path = Path(identity["path"])
    if identity["name"] == demo_model.NAME:
        demo_model.ensure(path.parents[1])
        return
    if not (path / "config.json").exists():
        raise UserError(f"the model checkpoint of this run, {path}, is gone (no config.json there). Restore it and "
                        f"{again}.")
    _refuse_missing(identity["name"], path, again)
    _refuse_damaged(identity["name"], path)
    if "files" not in identity:
        log.info("this run was planned before run_shards recorded a checkpoint's tokenizer files: only its "
                 "config.json and weights are compared")
    changes = identity_changes(identity, {"fingerprint": fingerprint(path, like=identity.get("fingerprint")),
                                          "files": file_digests(path)})
    if changes:
        raise UserError(f"the model checkpoint of this run, {path}, changed since the run started "
                        f"({'; '.join(changes)}), so new rows would not match the ones computed. Restore it as it "
                        f"was and {again}, or {start_over}.")


def identity_changes(old: dict, new: dict) -> list[str]:
    """How the checkpoint `new` differs from `old` (identities as `ModelSource.identity` writes them, or the
    same keys from a result's attributes), each file named: [] when it is the same model. Where `old`
    recorded no files (an older run_shards), only config.json and the weights are compared; where it recorded a
    fingerprint taken the earlier way (each weight file's size and first MiB), `new`'s is taken so from its
    `path` to compare."""
    changes = []
    now = new.get("fingerprint")
    if now is not None and old.get("fingerprint") is not None and "path" in new \
            and not old["fingerprint"].startswith(WHOLE_FILES):
        log.info("this run was planned before run_shards digested whole weight files: the checkpoint's weights are "
                 "compared by their size and first MiB")
        now = fingerprint(Path(new["path"]), like=old["fingerprint"])
    if old.get("fingerprint") != now:
        changes.append("config.json or the weight files differ")
    if "files" in old and "files" in new:
        was, now = old["files"], new["files"]
        changes += [f"{name} {'changed' if name in now else 'removed'}" for name in sorted(was)
                    if now.get(name) != was[name]]
        changes += [f"{name} added" for name in sorted(set(now) - set(was))]
    return changes


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        path = Path(snapshot_download(repo_id, allow_patterns=[
            "*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "tokenizer*",
            "*.py"]))   # (a remote-code checkpoint's own code: run only with --trust-remote-code)
        if not has_weights(path):   # (published as .bin only)
            path = Path(snapshot_download(repo_id, allow_patterns=["pytorch_model*.bin"]))
        return path
    except Exception as e:  # offline, unknown repo, gated: one clear message either way
        if type(e).__name__ == "HFValidationError":   # (no hub id: '/abs/dir', './dir', 'a/b/c')
            where = Path(os.path.abspath(Path(repo_id).expanduser()))
            missing = next((p for p in [where, *where.parents] if p.exists()), None)
            raise UserError(f"--model {repo_id}: no such directory"
                            f"{f' ({missing} holds no {where.relative_to(missing).parts[0]!r})' if missing else ''}, "
                            "and not a Hugging Face hub id (ORG/NAME). Pass the checkpoint's directory, or a hub "
                            "id.") from None
        raise UserError(f"--model {repo_id}: not a local directory, and the Hugging Face hub could not "
                        f"provide it ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
                        "Pass a local checkpoint directory, or check the id and your network.") from None


def read_ahead(path: str | Path) -> threading.Thread:
    """Have the kernel read the checkpoint's weight files into the page cache, from a background thread, so
    that a load soon after, here or by a worker on this machine, finds them in memory instead of waiting on
    the disk; returns the thread (a daemon: nothing waits for it). The caller goes on with its imports and
    planning meanwhile.

    posix_fadvise(WILLNEED) queues the reads without copying anything into this process, but the kernel
    reads at most its readahead window per call (a 1.3 GB file in one call: 0.6% of it cached), hence one
    call per READ_AHEAD_CHUNK: the whole file cached within ~1 s here, for 0.1 CPU s (docs/BENCHMARKS.md).
    Without posix_fadvise (macOS) the thread reads the files. An unreadable file is left to the load."""
    def read_all() -> None:
        try:
            for f in sorted(f for f in Path(path).iterdir() if f.suffix in WEIGHT_SUFFIXES):
                with open(f, "rb", buffering=0) as fh:
                    if hasattr(os, "posix_fadvise"):
                        size = os.fstat(fh.fileno()).st_size
                        for offset in range(0, size, READ_AHEAD_CHUNK):
                            os.posix_fadvise(fh.fileno(), offset, READ_AHEAD_CHUNK, os.POSIX_FADV_WILLNEED)
                    else:
                        buffer = memoryview(bytearray(4 << 20))
                        while fh.readinto(buffer):
                            pass
        except OSError as e:   # the load reads the files again and says what is wrong with them
            log.debug("read-ahead of %s stopped: %s", path, e)
    thread = threading.Thread(target=read_all, name="read-ahead", daemon=True)
    thread.start()
    return thread


# The mark of a fingerprint over whole weight files; runs planned before 2026-12-07 kept 16 hex digits over each
# weight file's size and first MiB, and are checked that way (`fingerprint`'s `like`).
WHOLE_FILES = "w1-"


def fingerprint(path: Path, like: str | None = None) -> str:
    """sha256 over config.json and, per weight file, its name and the digest of its whole content (kept between
    commands: file_digest.py). `like`: a fingerprint a run recorded, which an earlier run_shards took over each
    weight file's size and first MiB: the checkpoint's is then taken that way, to compare with it."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    whole = like is None or like.startswith(WHOLE_FILES)
    cache = cache_dir() / "digests" if whole else None
    for f in sorted(path.iterdir()):
        if f.suffix in WEIGHT_SUFFIXES:
            h.update(f.name.encode())
            if whole:
                h.update(file_digest.digest(f, cache).encode())
                continue
            h.update(str(f.stat().st_size).encode())
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 20))
    return (WHOLE_FILES if whole else "") + h.hexdigest()[:16]


def file_digests(path: Path) -> dict[str, str]:
    """sha256 (16 hex digits) of each file of the checkpoint beside config.json and the weights, by name:
    whatever its tokenizer reads (vocab.txt, tokenizer.json, tokenizer_config.json, special_tokens_map.json,
    spiece.model, merges.txt, added_tokens.json, ..., whichever its tokenizer class names) and anything else
    transformers may read (generation_config.json, a chat template, remote code), so that no file that
    decides a run's bits can change unnoticed, and a refusal names the file. Documentation and hidden files
    (NOT_READ) are left out; a file over WHOLE_FILE_BYTES is digested by its size and first MiB."""
    digests = {}
    for f in sorted(path.iterdir()):
        if (not f.is_file() or f.name == "config.json" or f.suffix in WEIGHT_SUFFIXES
                or f.name.upper().startswith(NOT_READ) or f.suffix.lower() in NOT_READ_SUFFIXES):
            continue
        size = f.stat().st_size
        h = hashlib.sha256(str(size).encode() if size > WHOLE_FILE_BYTES else b"")
        with open(f, "rb") as fh:
            if size > WHOLE_FILE_BYTES:
                h.update(fh.read(1 << 20))
            else:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
        digests[f.name] = h.hexdigest()[:16]
    return digests


def describe(source: ModelSource, engine: str, tokenizer=None, trust_remote_code: bool = False,
             config=None) -> EngineInfo:
    """EngineInfo from the checkpoint's config and tokenizer alone (no weights, no device); `tokenizer` and
    `config` the checkpoint's where already read (read_tokenizer, read_config)."""
    from .hf_config import model_max_tokens, model_shape, quiet_transformers, text_config

    quiet_transformers()
    config = config if config is not None else read_config(source, trust_remote_code)
    if tokenizer is None:
        tokenizer = read_tokenizer(source, config, trust_remote_code)
    text = text_config(config)
    hidden_size, num_layers = model_shape(text)
    info = EngineInfo(name=engine, hidden_size=hidden_size, num_layers=num_layers,
                      is_causal=source.is_causal, masked_lm=source.is_masked_lm,
                      max_tokens=model_max_tokens(text, tokenizer, source.family.position_table),
                      architecture=source.facts.architecture, model_fingerprint=source.fingerprint,
                      family=source.family.key)
    trained = getattr(text, "max_position_embeddings", None)
    if isinstance(trained, int) and 0 < trained < (info.max_tokens or float("inf")):
        info.extra["trained_context"] = trained   # a soft limit: relative positions run past it
    return info


def read_config(source: ModelSource, trust_remote_code: bool = False):
    """The checkpoint's transformers config; a config transformers cannot read is a clear error."""
    from .hf_config import load_config
    try:
        config = load_config(source.facts, trust_remote_code)
    except Exception as e:   # noqa: BLE001 - whatever transformers raises (huggingface_hub's validation of a field's
        # type, a ValueError, a KeyError of an unknown model_type ...) is the checkpoint's config it cannot read
        if trust_remote_code:   # (transformers: "... does not appear to have a file named X. Checkout '...'")
            _refuse_missing_code(source)
        raise UserError(f"--model {source.name}: transformers cannot read its config.json ({type(e).__name__}: "
                        f"{_first_line(e)}); is its model_type one this transformers version knows?") from None
    if trust_remote_code:   # (a config class of transformers' own, the model's code named in auto_map: a worker's
        _refuse_missing_code(source)   # load would fail on the missing file, and no rerun could mend it)
    return config


def missing_code(path: Path, config: dict) -> list[str]:
    """The Python files of the checkpoint at `path` that the auto_map of its config.json or
    tokenizer_config.json names (`bert_layers.BertModel`: bert_layers.py) and that are not there; code named
    in another repository (`org/repo--module.Class`) is transformers' to fetch."""
    refs = []
    for auto_map in (config.get("auto_map"), read_json(path / "tokenizer_config.json").get("auto_map")):
        for v in (auto_map.values() if isinstance(auto_map, dict) else auto_map or []):
            refs += v if isinstance(v, (list, tuple)) else [v]
    files = {str(r).rsplit(".", 1)[0].replace(".", "/") + ".py" for r in refs if r and "--" not in str(r)}
    return sorted(f for f in files if not (path / f).is_file())


def _refuse_missing_code(source: ModelSource) -> None:
    """A remote-code checkpoint whose Python files are not beside its config.json, named (transformers' own
    error points at a hub address made of the folder's path)."""
    missing = missing_code(Path(source.path), source.facts.config)
    if missing:
        raise UserError(f"--model {source.name}: the code its auto_map names is not in {source.path}: "
                        f"{', '.join(missing)}. Put the checkpoint's Python files beside its config.json "
                        "(they come with it: its hub id downloads them)")


def read_tokenizer(source: ModelSource, config, trust_remote_code: bool = False):
    """The checkpoint's tokenizer as its family reads it; a tokenizer that cannot be built says why."""
    from .hf_config import load_tokenizer
    files = source.facts.tokenizer_files
    missing = _missing_tokenizer_files(Path(source.path), source.facts.model_type)
    if not files and not missing:   # (transformers: "Couldn't instantiate the backend tokenizer from one of: ")
        missing = f"{source.path} holds none of its files ({', '.join(TOKENIZER_FILES)})"
    if missing:   # (transformers fails with a TypeError about a None path, or builds a tokenizer of no tokens)
        raise UserError(f"--model {source.name}: cannot build its tokenizer: {missing}. Put the checkpoint's "
                        "tokenizer files beside its config.json (they come with the checkpoint)")
    try:
        return load_tokenizer(source.facts, source.family, config, trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError) as e:
        if trust_remote_code:
            _refuse_missing_code(source)
        if not set(files) - {"spiece.model", "tokenizer_config.json", "added_tokens.json"} and "spiece.model" in files:
            raise UserError(f"--model {source.name}: its tokenizer is a SentencePiece model only (spiece.model, "
                            "no tokenizer.json), which transformers reads with the `sentencepiece` package: "
                            "`pip install sentencepiece`, then run the same command again") from None
        listed = ", ".join(files) or "no tokenizer files"
        raise UserError(f"--model {source.name}: cannot build its tokenizer from {listed} "
                        f"({type(e).__name__}: {_first_line(e)})") from None


def _missing_tokenizer_files(path: Path, model_type: str) -> str:
    """Where the checkpoint's tokenizer class (tokenizer_config.json's, else its model type's) finds none of its
    files (EsmTokenizer without vocab.txt, ProtBert's BertTokenizer without vocab.txt or tokenizer.json), which
    class and the files it reads; else "". (tokenizer.json alone builds any tokenizer.)"""
    import transformers
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES
    name = read_json(path / "tokenizer_config.json").get("tokenizer_class") or TOKENIZER_MAPPING_NAMES.get(model_type)
    name = name[0] if isinstance(name, (tuple, list)) else name   # (transformers 4: (slow, fast) names)
    wanted = getattr(getattr(transformers, str(name), None), "vocab_files_names", None) if name else None
    if not isinstance(wanted, dict) or not wanted or (path / "tokenizer.json").exists() \
            or any((path / f).exists() for f in wanted.values()):
        return ""
    files = sorted(set(wanted.values()))
    return (f"its tokenizer, {name}, reads {' or '.join(files)}, "
            f"{'not' if len(files) == 1 else 'none of them'} in {path}")


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else ""
