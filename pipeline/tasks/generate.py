"""The generate task: continue each sequence with the native engine's continuous batching.

The prompt is the tokenized sequence without its trailing special tokens (EOS / separator); a leading
BOS / CLS stays. Output per row: `generate/token_ids` (the new tokens, CSR with `generate/offsets`; an
EOS that stopped generation is included, as transformers' `generate` returns it), `generate/text` (the
new tokens decoded, special tokens dropped; residues joined without spaces for character-level
tokenizers; a NUL character, which a byte-level tokenizer decodes from its byte-0 token, as U+FFFD: HDF5
strings end at NUL, and the token ids keep it) and `generate/finish_reason` ("stop" at EOS, "length" at
--max-new-tokens).

Sampling is reproducible per sequence: its random stream is keyed by the run seed and the sequence's
FASTA position (see pipeline/engine/sampler.py), so results do not depend on worker count or batching.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..config import RunConfig
from ..models.checkpoint import EngineInfo
from ..errors import UserError
from ..output.schema import STR, Column
from .task import Task, TaskOutput
from .tokenization import SequenceTokenizer, Tokenized, special_ids


def generation_config_note(checkpoint_dir: str, config: RunConfig) -> str | None:
    """What the checkpoint's generation_config.json asks of transformers' `generate`, which applies it by default,
    that this run does not do (None if nothing): run_shards decodes as its own options say (greedy unless
    --temperature), so a model whose card samples (Qwen3's and Llama 3's files: do_sample, temperature, top_p,
    top_k) or penalises repeats gets other tokens than a plain `model.generate(input_ids)`."""
    import json
    from pathlib import Path

    path = Path(checkpoint_dir) / "generation_config.json"
    try:
        gen = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(gen, dict):
        return None

    def number(key: str):   # (a positive number, else None: a null or a 0 sets nothing)
        value = gen.get(key)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None

    sampling = gen.get("do_sample") is True
    top_k = number("top_k")
    unused = [f"{key} {gen[key]}" for key, neutral in (("repetition_penalty", 1.0), ("no_repeat_ngram_size", 0),
                                                      ("min_new_tokens", 0)) if gen.get(key) not in (None, neutral)]
    if sampling and config.temperature == 0:
        settings = ["do_sample true"] + [f"{k} {gen[k]}" for k in ("temperature", "top_p") if number(k)]
        settings += [f"top_k {top_k}"] * bool(top_k) + unused
        options = " ".join(f"--{k.replace('_', '-')} {gen[k]}" for k in ("temperature", "top_p")
                           if number(k) and (k != "top_p" or gen[k] <= 1))
        return (f"the checkpoint's generation_config.json sets {', '.join(settings)}: transformers' generate samples "
                f"by default; this run decodes greedily (--temperature 0), as transformers' generate with "
                f"do_sample=False{' and ' + ', '.join(unused) + ' left out' if unused else ''} does"
                + (f"; {options} samples as those settings do" if "--temperature" in options else "")
                + (", but without top_k (run_shards has no top-k)" if top_k else ""))
    if top_k and (sampling or config.temperature > 0):
        unused.append(f"top_k {top_k} (run_shards has no top-k: the nucleus of --top-p is drawn from all tokens)")
    if not unused:
        return None
    return (f"the checkpoint's generation_config.json sets {', '.join(unused)}, which transformers' generate applies "
            f"by default and this run does not")


def unknown_text(tokenizer) -> str:
    """What generate/text writes for a generated unknown token or an id past the vocabulary (`generate_unknown_text`):
    the tokenizer's unknown token, `?` where it has none (Llama 3's and Qwen's byte-level BPEs)."""
    return tokenizer.unk_token or "?"


def prompt_ids(tok: Tokenized) -> list[int]:
    """Token ids without trailing special tokens."""
    n = len(tok.ids)
    while n > 1 and tok.special[n - 1]:
        n -= 1
    return list(tok.ids[:n])


class GenerateTask(Task):
    name = "generate"
    layers: list[int] = []
    logprobs = False

    def __init__(self, config: RunConfig, info: EngineInfo, alive: Callable[[int], bool] | None = None):
        """`alive(tokens)`: the engine asks it between its steps (engine/native.py `generate`); False gives the batch
        up (engine.interface.Stopped), a worker's stop, which a batch of thousands of new tokens per sequence would
        otherwise hear of only minutes later."""
        if not info.is_causal:
            raise UserError(f"--task generate needs a causal language model; {info.architecture} is not one")
        self.config, self.alive = config, alive
        self._char_level: bool | None = None
        self._unknown = "?"   # (the tokenizer's unknown token, from prepare)

    def prepare(self, tokenizer: SequenceTokenizer) -> None:
        self._unknown = unknown_text(tokenizer.tokenizer)

    def attrs(self) -> dict:
        # what generate/text writes for a generated unknown token or an id past the vocabulary (earlier versions
        # left both out: tasks/earlier_rows.py)
        return {"generate_unknown_text": self._unknown}

    def columns(self) -> list[Column]:
        return [Column("generate/token_ids", "int32", ragged=True), Column("generate/text", STR),
                Column("generate/finish_reason", STR)]

    def run(self, engine, toks: list[Tokenized], positions: np.ndarray):
        from ..engine.native import SamplingParams

        c = self.config
        params = SamplingParams(max_new_tokens=c.max_new_tokens, temperature=c.temperature, top_p=c.top_p, seed=c.seed)
        prompts = [prompt_ids(t) for t in toks]
        results = engine.generate(prompts, [int(p) for p in positions], params, alive=self.alive)
        ids = [r.token_ids for r in results]
        text = np.array([self._decode(engine.tokenizer, x) for x in ids], dtype=object)
        reasons = np.array([r.finish_reason for r in results], dtype=object)
        lengths = np.array([len(x) for x in ids], np.int64)
        values = np.concatenate([np.asarray(x, np.int32) for x in ids]) if ids else np.zeros(0, np.int32)
        # the tokens the engine ran: each prompt, then the new tokens (the throughput lines' `tokens` counted the
        # rows' own tokens, the prompts alone, and a run's decoding looked as fast as its prefill was)
        ran = sum(map(len, prompts)) + int(lengths.sum())
        return TaskOutput({"generate/text": text, "generate/finish_reason": reasons},
                          {"generate/token_ids": values}, {"generate": lengths}, computed_tokens=ran)

    def _decode(self, tokenizer, ids: list[int]) -> str:
        """The new tokens' text, with no NUL: an HDF5 string cannot hold one (h5py refused the checkpoint holding
        it, and the shard stopped with its rows since the last checkpoint), so it reads as U+FFFD."""
        if self._char_level is None:
            self._char_level = SequenceTokenizer(tokenizer).char_level
            self._special = special_ids(tokenizer)   # (the unknown token left out: it stands for residues)
        # The unknown token, and an id with no token (a padded vocabulary row, which greedy search can pick),
        # read as the unknown token (`?` for a tokenizer without one, as Llama 3's and Qwen's): decode, skipping
        # special tokens, dropped both without a trace, as if nothing had been generated there.
        unknown = unknown_text(tokenizer)
        if not self._char_level:
            runs, n = [[]], len(tokenizer)
            for i in ids:
                if i < n and (i != tokenizer.unk_token_id or i in self._special):
                    runs[-1].append(i)
                else:
                    runs.append([])
            return unknown.join(tokenizer.decode(run, skip_special_tokens=True) for run in runs).replace("\0", "\ufffd")
        tokens = tokenizer.convert_ids_to_tokens([i for i in ids if i not in self._special])
        return "".join(t if t is not None else unknown for t in tokens).replace("\0", "\ufffd")
