"""The run's token limit per sequence (the model's own, or --max-length below it) and what happens to the
sequences over it, decided before any model runs: refused with their ids, or truncated, skipped or run as
windows (--on-long), with warnings for lengths the model was not trained on."""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

from index import SequenceIndex

from ..config import RunConfig
from ..errors import UserError
from ..output import status_codes
from ..tasks.tokenization import SequenceTokenizer
from .input_policies import MAX_LISTED, listing

log = logging.getLogger("run_shards")


def token_limit(model_limit: int | None, max_length: int | None) -> int | None:
    """The run's limit in tokens (special tokens included): --max-length, at most the model's own."""
    if not max_length:
        return model_limit
    if model_limit and max_length > model_limit:
        log.warning("--max-length %d is above the model's own limit of %d tokens; using %d", max_length,
                    model_limit, model_limit)
        return model_limit
    return max_length


def _held_to(limit: int | None, config: RunConfig) -> int | None:
    """The most tokens a prompt runs as: the run's limit, or under --on-long window its window (a record over
    the window runs as windows; `config` as planned, its window fixed)."""
    return config.window if config.on_long == "window" else limit


def longest_prompt(index: SequenceIndex, tokenizer: SequenceTokenizer, limit: int | None, config: RunConfig,
                   runs: np.ndarray | None = None) -> int:
    """The most tokens (special tokens included) any prompt of the run can have: its longest record's count
    (exact for one token per residue, an upper bound otherwise), at most the run's limit, or the window (longer
    records are refused, truncated, skipped, or run as windows within it). The native engine sizes its KV cache
    for it rather than for the limit: protein records are a few hundred tokens, and a long-context model's limit
    (Qwen3.5's 262,144, the demo model's 65,536) reserved gigabytes of it for a sequence no run had. `runs`:
    the FASTA positions of the records the model runs, where not all (--task variants: those with variants)."""
    residues = index.max_length if runs is None else int(index.lengths[np.asarray(runs)].max(initial=0))
    longest = int(tokenizer.tokens_for_residues(np.array([residues]))[0])
    held = _held_to(limit, config)
    return min(longest, held) if held else longest


def check_long(index: SequenceIndex, tokenizer: SequenceTokenizer, limit: int | None, config: RunConfig,
               runs: np.ndarray | None = None) -> None:
    """Refuse, before any work, sequences over the limit unless --on-long says what to do with them
    (`config` as planned: with --on-long window, its window is fixed). `runs`: the FASTA positions of the
    records the model runs, where not all (--task variants: those with variants); the others may be any length."""
    limit = _held_to(limit, config)
    if not limit:
        return
    if limit <= tokenizer.num_special:
        where = "--max-length" if config.max_length == limit else "the model's length limit"
        raise UserError(f"{where} of {limit} tokens leaves no room for residues: the model adds "
                        f"{tokenizer.num_special} special token(s) to every sequence. Give a larger --max-length.")
    if int(tokenizer.tokens_for_residues(np.array([index.max_length]))[0]) <= limit:
        return   # (the longest record fits: nothing to read)
    long = index.positions_where(lambda lengths: tokenizer.tokens_for_residues(lengths) > limit)
    if runs is not None:
        long = long[np.isin(long, runs)]
    if len(long) and not tokenizer.exact_counts:  # the residue estimate is an upper bound: count exactly
        keep_case = tokenizer.convention.keeps_case
        exact = tokenizer.encode([index.sequence(int(i), keep_case) for i in long])
        long = long[[len(t.ids) > limit for t in exact]]
    if len(long) == 0:
        return
    what = "the --max-length limit" if config.max_length == limit else "the model's limit"
    which = "sequence(s)" if runs is None else "sequence(s) with variants"
    if config.on_long == "error":
        longest = int(long[np.argmax(index.lengths[long])])
        shown = listing([f"'{index.id(int(i))}' ({index.lengths[i]} residues)" for i in long[:MAX_LISTED]], len(long))
        skip = f"--on-long skip (kept as rows with status {status_codes.SKIPPED_TOO_LONG})"
        if config.task == "variants":   # (it scores whole sequences: skip is the one policy it takes)
            choices = f"Choose {skip}"
        else:
            window = "" if config.task == "generate" else (
                ", or --on-long window (run as overlapping windows stitched into one row)")
            choices = (f"Choose --on-long truncate (cut to the limit; recorded in `truncated` and `num_tokens`), "
                       f"{skip}{window}")
        raise UserError(
            f"{len(long)} {which} exceed {what} of {limit} tokens ({tokenizer.num_special} of them "
            f"special), the longest '{index.id(longest)}' with {index.lengths[longest]} residues: {shown}. "
            f"{choices}: e.g. `{dataclasses.replace(config, on_long=config.keeping_on_long).as_command()}`")
    if config.on_long == "window":
        log.info("%d sequence(s) are over %d tokens and run as overlapping windows of %d tokens (%d shared by "
                 "neighbours), stitched into one row each (the `windows` column counts them)", len(long), limit,
                 config.window, config.overlap)
        return
    log.warning("%d %s exceed %s of %d tokens and will be %s (--on-long %s)", len(long), which, what,
                limit, "truncated" if config.on_long == "truncate" else "skipped", config.on_long)


def warn_beyond_training(index: SequenceIndex, tokenizer: SequenceTokenizer, limit: int | None,
                         trained: int | None) -> None:
    """Sequences longer than the context the model was trained on run, but say so."""
    if not trained or trained >= (limit or float("inf")):
        return
    over = int(index.length_counts[tokenizer.tokens_for_residues(index.length_values) > trained].sum())
    if over:
        log.warning("%d sequence(s) are longer than the model's trained context of %d tokens "
                    "(max_position_embeddings); they run, but the model was not trained on such lengths. "
                    "--max-length %d with --on-long truncate or skip keeps within it.", over, trained, trained)


def warn_generation_beyond(index: SequenceIndex, tokenizer: SequenceTokenizer, limit: int | None, on_long: str,
                           model_limit: int | None, trained: int | None, max_new_tokens: int) -> None:
    """--task generate: prompts whose continuation of --max-new-tokens may reach past the model's positions
    (its length limit, or the context it was trained on) run, as transformers' generate runs them, but say so
    (from the prompts' token counts, an upper bound for subword tokenizers: "may")."""
    context = min([n for n in (model_limit, trained) if n] or [0])
    if not context:
        return
    prompts = tokenizer.tokens_for_residues(index.length_values)
    counts = index.length_counts
    if limit:
        if on_long == "skip":   # (those over the limit are not run)
            prompts, counts = prompts[prompts <= limit], counts[prompts <= limit]
        prompts = np.minimum(prompts, limit)
    if not len(prompts):
        return
    # Reaching past `context` in Python's integers: `prompts + max_new_tokens` in int64 wrapped (no warning).
    over = int(counts[prompts > max(context + 1 - max_new_tokens, -1)].sum())
    if over:
        room = context + 1 - int(prompts.max())
        log.warning("%d sequence(s) may be continued past the model's %d positions (%s): their tokens and "
                    "--max-new-tokens %d reach up to %d; generation runs on, but the model was not trained "
                    "on such positions. %s", over, context,
                    "max_position_embeddings" if context == trained else "its length limit", max_new_tokens,
                    int(prompts.max()) + max_new_tokens - 1,
                    f"--max-new-tokens {room} keeps the longest within them." if room >= 1 else
                    "A lower --max-length with --on-long truncate or skip, and fewer new tokens, keep within them.")
