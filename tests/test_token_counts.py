"""A shard's batches are planned on its sequences' tokens, counted by encoding them, where the tokenizer is not one
token per residue (pipeline/worker/token_counts.py): a k-mer or subword tokenizer's batches fill their budget
instead of the fraction the residue count allowed, and a padded batch's cost is its longest sequence's, wherever
that sits (tests/test_units.py has plan_batches' own cases)."""
from __future__ import annotations

import re
import time

import numpy as np

from index import load_or_build
from pipeline.models import checkpoint
from pipeline.models.structure_input import SAPROT_SA
from pipeline.tasks.tokenization import SequenceTokenizer
from pipeline.worker.token_counts import TokenCounter

from .family_runs import family_checkpoint, result, run, write_fasta  # noqa: F401

def exact_tokens(index, positions, tokenizer, bounds, encoded=None) -> np.ndarray:
    """Every count at once: a TokenCounter waited for."""
    counter = TokenCounter(index, positions, tokenizer, bounds, encoded)
    try:
        assert counter.wait_for(len(counter.positions))
    finally:
        counter.close()
    return counter.tokens


STEPS = re.compile(r"native engine: (\d+) steps, (\d+) tokens .*step fill ([\d.]+)% of (\d+) tokens")


def test_six_mer_batches_fill_their_budget(family_checkpoint, tmp_path):
    """Nucleotide Transformer (6-mers, a token for about six nucleotides): 60 sequences of 300-600 nt with a
    512-token budget. Planned on residues, each batch held one sequence (60 steps, 16% full); counted, about
    six (11 steps, 88%)."""
    rng = np.random.default_rng(3)
    records = {f"d{i}": "".join(rng.choice(list("ACGT"), int(rng.integers(300, 600)))) for i in range(60)}
    res, out = run(tmp_path, family_checkpoint("nucleotide_transformer_v1"), records, "--max-tokens-per-batch", "512")
    assert res.returncode == 0, res.stderr
    steps, tokens = 0, 0
    for rank in (0, 1):
        log = (out / "logs" / f"worker_{rank}.log").read_text()
        assert "counted by encoding them" in log
        found = STEPS.search(log)
        assert found, log
        n, t, fill, budget = int(found[1]), int(found[2]), float(found[3]), int(found[4])
        assert budget == 512 and fill >= 70, found[0]
        steps, tokens = steps + n, tokens + t
    assert tokens == int(result(out)["num_tokens"].sum())
    assert steps <= tokens // 512 + 4   # full batches but each worker's last (the 16% plan: 60 steps)


def test_counts_are_what_encoding_gives(family_checkpoint, tmp_path):
    """SaProt's structure-aware input (a token per residue letter + 3Di letter pair, two characters; a lone
    letter one): the counts equal the encoded tokens, cut to the run's limit where it truncates, and an empty
    record keeps its bound."""
    source = checkpoint.local_source(str(family_checkpoint("saprot")))
    hf = checkpoint.read_tokenizer(source, checkpoint.read_config(source, False), False)
    records = {"S1": "MdEvVpQpL#VyQdYaKv" * 3, "S2": "M#E#V#Q#L#", "O1": "MdEvV", "E": "", "S3": "KtTpRgAdWlCc#pHs"}
    index, _ = load_or_build([str(write_fasta(tmp_path / "sa.fa", records))])
    positions = np.arange(len(index))
    for limit in (None, 12):
        tokenizer = SequenceTokenizer(hf, SAPROT_SA, max_tokens=limit)
        assert not tokenizer.exact_counts
        bounds = tokenizer.tokens_for_residues(index.lengths[positions])
        counts = exact_tokens(index, positions, tokenizer, bounds)
        for i in positions:
            text = index.sequence(int(i), keep_case=True)
            want = len(tokenizer.encode([text])[0].ids) if text else bounds[i]
            assert counts[i] == want, (index.id(int(i)), counts[i], want)
            assert counts[i] <= bounds[i]
        assert (counts < bounds).sum() == 4   # the pairs' sequences: about half their characters
        if limit:
            assert counts.max() == limit


def test_the_plan_waits_for_counts_telling_the_parent_and_stops_when_told(family_checkpoint, tmp_path, monkeypatch):
    """Batches planned as the counts arrive are plan_batches' on every count; while the plan waits for counts it
    calls `alive` (the worker's message for the hang detector), and it ends when that says stop."""
    import threading

    from pipeline.worker import token_counts
    from pipeline.worker.batching import LazyPlan, plan_batches
    monkeypatch.setattr(token_counts, "CHUNK", 2)
    monkeypatch.setattr(token_counts, "HEARTBEAT_SECONDS", 0.01)
    source = checkpoint.local_source(str(family_checkpoint("nucleotide_transformer_v1")))
    hf = checkpoint.read_tokenizer(source, checkpoint.read_config(source, False), False)
    index, _ = load_or_build([str(write_fasta(tmp_path / "d.fa", {f"d{i}": "ACGTTG" * (10 + i) for i in range(9)}))])
    tokenizer = SequenceTokenizer(hf)
    positions = np.arange(len(index))
    bounds = tokenizer.tokens_for_residues(index.lengths[positions])
    every = exact_tokens(index, positions, tokenizer, bounds)
    assert (every < bounds).all()
    for padded in (False, True):
        counter = TokenCounter(index, positions, tokenizer, bounds)
        plan = LazyPlan(counter, lambda t, a, b: t, 40, 3, padded)
        got = [(a, b) for _, a, b, _ in plan]
        counter.close()
        assert got == plan_batches(every, 40, 3, padded)
    # generate: no counts needed, calls of GENERATE_QUEUE_FACTOR x max_seqs sequences whatever their tokens
    from pipeline.worker.batching import GENERATE_QUEUE_FACTOR
    counter = TokenCounter(index, positions, tokenizer, bounds, count=False)
    got = [(a, b) for _, a, b, _ in LazyPlan(counter, lambda t, a, b: t, 40, 2, False, generate=True)]
    step = 2 * GENERATE_QUEUE_FACTOR
    assert got == [(a, min(a + step, len(positions))) for a in range(0, len(positions), step)]
    # A counter held back (its encoder blocked), the plan waits, says so, and stops when told.
    release = threading.Event()
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda texts: release.wait() and encode(texts))
    counter = TokenCounter(index, positions, tokenizer, bounds)
    heard = []
    plan = LazyPlan(counter, lambda t, a, b: t, 40, 3, False, alive=lambda n: heard.append(n) or len(heard) < 3)
    assert list(plan) == [] and heard == [0, 0, 0]
    release.set()
    counter.close()


def test_the_encodings_are_kept_for_the_batches_within_their_room(family_checkpoint, tmp_path, monkeypatch):
    """What the count encoded is kept (compactly) for the batch that reads the record, as `encode` gave it, once;
    not for the records a resumed shard has done. Ahead of the batches, the counter stops once what it keeps
    fills the room, until a batch takes some or the batches wait for more counts."""
    from pipeline.worker import token_counts
    from pipeline.worker.token_counts import Encoded
    source = checkpoint.local_source(str(family_checkpoint("nucleotide_transformer_v1")))
    hf = checkpoint.read_tokenizer(source, checkpoint.read_config(source, False), False)
    records = {f"d{i}": "ACGTTGNCA" * (3 + i) for i in range(6)} | {"e": ""}
    index, _ = load_or_build([str(write_fasta(tmp_path / "d.fa", records))])
    tokenizer = SequenceTokenizer(hf, max_tokens=20)
    positions = np.arange(len(index))[::-1]   # any order: the encodings are found by position
    assert index.lengths[positions[0]] == 0   # (the empty record comes first here: nothing to keep)
    bounds = tokenizer.tokens_for_residues(index.lengths[positions])
    wanted = np.array([True, False, True, True, True, True, True])
    encoded = Encoded(wanted=wanted)
    counts = exact_tokens(index, positions, tokenizer, bounds, encoded=encoded)
    assert len(encoded) == 5   # not the done record, not the empty one
    for nth, p in enumerate(positions):
        text = index.sequence(int(p))
        kept = encoded.take(int(p), text)
        if not wanted[nth] or not text:
            assert kept is None
            continue
        want, = tokenizer.encode([text])
        assert (kept.ids, kept.special.tolist(), kept.truncated, kept.num_unknown, kept.residues) == \
            (want.ids, want.special.tolist(), want.truncated, want.num_unknown, text)
        assert len(kept.ids) == counts[nth] and encoded.take(int(p), text) is None   # taken once
    assert encoded.held == 0
    monkeypatch.setattr(token_counts, "CHUNK", 1)
    small = Encoded(room=1)
    counter = TokenCounter(index, positions, tokenizer, bounds, small)
    try:
        with small.changed:
            while counter.counted < 2:
                small.changed.wait(1)
        time.sleep(0.2)
        assert counter.counted == 2 and len(small) == 1   # one kept, past the room: the counter waits
        assert small.take(int(positions[1]), "") is not None
        assert counter.wait_for(4) and counter.counted >= 4   # the batches need more: counted past the room
        assert counter.wait_for(len(positions)) and (counter.tokens == counts).all()
    finally:
        counter.close()
