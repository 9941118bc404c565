"""Resolve `--model` to a local checkpoint directory once, in the parent, and describe it.

`demo` is the bundled demo model (materialised offline on first use); an existing directory is used as
it is; anything else is a Hugging Face hub id, downloaded once by the parent so workers never race to
fetch it.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from . import demo as demo_model
from ..errors import UserError
from .hf_config import is_causal_lm, is_masked_lm

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


@dataclass
class EngineInfo:
    """What the tasks and planning need to know of a model, whichever engine runs it."""
    name: str                 # "hf" or "native"
    hidden_size: int
    num_layers: int           # hidden_states has num_layers + 1 entries; index num_layers = final norm output
    is_causal: bool
    max_tokens: int | None    # hard limit on tokens per sequence (absolute positions), None if none
    architecture: str = ""
    masked_lm: bool = False   # a masked language model with its head (score and variants by masking)
    model_fingerprint: str = ""
    extra: dict = field(default_factory=dict)


@dataclass
class ModelSource:
    name: str          # what the user passed
    path: str          # local directory
    model_type: str
    architectures: list[str]
    fingerprint: str   # changes when the checkpoint changes

    @property
    def is_causal(self) -> bool:
        return is_causal_lm(self.model_type, self.architectures)

    @property
    def is_masked_lm(self) -> bool:
        return not self.is_causal and is_masked_lm(self.architectures)

    def identity(self) -> dict:
        return {"name": self.name, "path": self.path, "model_type": self.model_type, "fingerprint": self.fingerprint}


def resolve(name: str, cache_root: Path) -> ModelSource:
    if name == demo_model.NAME:
        path = demo_model.ensure(cache_root)
    elif os.path.isdir(name):
        path = Path(name).resolve()
    elif os.path.exists(name):
        raise UserError(f"--model {name}: is a file; pass the checkpoint's directory (with config.json)")
    else:
        path = _download(name)
    config_file = Path(path) / "config.json"
    if not config_file.exists():
        raise UserError(f"--model {name}: {path} has no config.json; pass a Hugging Face checkpoint directory")
    _refuse_damaged(name, Path(path))
    config = json.loads(config_file.read_text())
    return ModelSource(name=name, path=str(path), model_type=config.get("model_type", ""),
                       architectures=list(config.get("architectures") or []), fingerprint=fingerprint(Path(path)))


def weight_problems(path: Path) -> list[str]:
    """Safetensors files of the checkpoint at `path` that cannot be whole, judged from their headers and sizes
    alone (a cheap check before any worker loads them): a truncated file, a damaged header."""
    problems = []
    for f in sorted(path.glob("*.safetensors")):
        try:
            size = f.stat().st_size
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if not 2 <= n <= size - 8:
                    raise ValueError(f"header length {n} in a file of {size} bytes")
                header = json.loads(fh.read(n))
            ends = [int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"]
            if 8 + n + max(ends, default=0) != size:
                raise ValueError(f"{size:,} bytes where its header describes {8 + n + max(ends, default=0):,}")
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            problems.append(f"{f} ({e})")
    return problems


def _refuse_damaged(name: str, path: Path) -> None:
    problems = weight_problems(path)
    if problems:
        raise UserError(f"--model {name}: damaged weight file(s): {'; '.join(problems)}. Replace them with an "
                        "intact copy of the checkpoint.")


def check_unchanged(identity: dict) -> None:
    """Before workers of an existing run load its model: the demo model is verified (rebuilt if damaged);
    any other checkpoint must still be there, unchanged (fingerprint) and whole (weight headers)."""
    path = Path(identity["path"])
    if identity["name"] == demo_model.NAME:
        demo_model.ensure(path.parents[1])
        return
    if not (path / "config.json").exists():
        raise UserError(f"the model checkpoint of this run, {path}, is gone (no config.json there). Restore it and "
                        "run the same command again.")
    _refuse_damaged(identity["name"], path)
    if fingerprint(path) != identity["fingerprint"]:
        raise UserError(f"the model checkpoint of this run, {path}, changed since the run started (its config or "
                        "weight files differ), so new rows would not match the ones computed. Restore it as it was "
                        "and run the same command again, or start a new run with another --out.")


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(repo_id, allow_patterns=[
            "*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "tokenizer*"]))
    except Exception as e:  # offline, unknown repo, gated: one clear message either way
        raise UserError(f"--model {repo_id}: not a local directory, and the Hugging Face hub could not "
                        f"provide it ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
                        "Pass a local checkpoint directory, or check the id and your network.") from None


def fingerprint(path: Path) -> str:
    """sha256 over config.json and, per weight file, its name, size and first MiB (fast on huge files)."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.iterdir()):
        if f.suffix in WEIGHT_SUFFIXES:
            h.update(f.name.encode())
            h.update(str(f.stat().st_size).encode())
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def describe(source: ModelSource, engine: str):
    """EngineInfo from the checkpoint's config and tokenizer alone (no weights, no device), and the tokenizer."""
    from transformers import AutoConfig, AutoTokenizer

    from .hf_config import model_max_tokens, quiet_transformers, text_config

    quiet_transformers()
    try:
        config = AutoConfig.from_pretrained(source.path)
        tokenizer = AutoTokenizer.from_pretrained(source.path)
    except Exception as e:
        raise UserError(f"--model {source.name}: cannot read the checkpoint's config or tokenizer "
                        f"({type(e).__name__}: {e})") from None
    text = text_config(config)
    info = EngineInfo(name=engine, hidden_size=text.hidden_size, num_layers=text.num_hidden_layers,
                      is_causal=source.is_causal, max_tokens=model_max_tokens(text, tokenizer),
                      masked_lm=source.is_masked_lm,
                      architecture=(source.architectures[0] if source.architectures else source.model_type),
                      model_fingerprint=source.fingerprint)
    trained = getattr(text, "max_position_embeddings", None)
    if isinstance(trained, int) and 0 < trained < (info.max_tokens or float("inf")):
        info.extra["trained_context"] = trained   # a soft limit: relative positions run past it
    return info, tokenizer
