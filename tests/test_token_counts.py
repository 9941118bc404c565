"""A shard's batches are planned on its sequences' tokens, counted by encoding them, where the tokenizer is not one
token per residue (pipeline/worker/token_counts.py): a k-mer or subword tokenizer's batches fill their budget
instead of the fraction the residue count allowed, and a padded batch's cost is its longest sequence's, wherever
that sits (tests/test_units.py has plan_batches' own cases)."""
from __future__ import annotations

import re

import numpy as np

from index import load_or_build
from pipeline.models import checkpoint
from pipeline.models.structure_input import SAPROT_SA
from pipeline.tasks.tokenization import SequenceTokenizer
from pipeline.worker.token_counts import exact_tokens

from .family_runs import family_checkpoint, result, run, write_fasta  # noqa: F401

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


def test_the_count_tells_the_parent_and_stops_when_told(family_checkpoint, tmp_path, monkeypatch):
    """A chunk at a time, each followed by a message (the hang detector's); told to stop, the count ends and
    the rest keep their bounds (a stopped worker runs no batch)."""
    from pipeline.worker import token_counts
    monkeypatch.setattr(token_counts, "CHUNK", 2)
    source = checkpoint.local_source(str(family_checkpoint("nucleotide_transformer_v1")))
    hf = checkpoint.read_tokenizer(source, checkpoint.read_config(source, False), False)
    index, _ = load_or_build([str(write_fasta(tmp_path / "d.fa", {f"d{i}": "ACGTTG" * (10 + i) for i in range(5)}))])
    tokenizer = SequenceTokenizer(hf)
    positions = np.arange(len(index))
    bounds = tokenizer.tokens_for_residues(index.lengths[positions])
    heard = []
    every = exact_tokens(index, positions, tokenizer, bounds, alive=lambda n: heard.append(n) or True)
    assert heard == [2, 4, 5] and (every < bounds).all()
    heard.clear()
    stopped = exact_tokens(index, positions, tokenizer, bounds, alive=lambda n: heard.append(n) and False)
    assert heard == [2]
    assert (stopped[:2] == every[:2]).all() and (stopped[2:] == bounds[2:]).all()


def test_the_encodings_are_kept_for_the_batches_within_their_room(family_checkpoint, tmp_path):
    """What the count encoded is kept (compactly) for the batch that reads the record, as `encode` gave it, once;
    not for the records a resumed shard has done, and not past the room (those are encoded again)."""
    from pipeline.worker.token_counts import Encoded
    source = checkpoint.local_source(str(family_checkpoint("nucleotide_transformer_v1")))
    hf = checkpoint.read_tokenizer(source, checkpoint.read_config(source, False), False)
    records = {f"d{i}": "ACGTTGNCA" * (3 + i) for i in range(6)} | {"e": ""}
    index, _ = load_or_build([str(write_fasta(tmp_path / "d.fa", records))])
    tokenizer = SequenceTokenizer(hf, max_tokens=20)
    positions = np.arange(len(index))[::-1]   # any order: the encodings are found by position
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
    assert index.lengths[positions[0]] == 0   # (the empty record comes first here: nothing to keep)
    small = Encoded(room=int(counts[1] + counts[2] + counts[3] - 1))
    exact_tokens(index, positions, tokenizer, bounds, encoded=small)
    assert len(small) == 2 and small.take(int(positions[2]), "") is not None   # the third did not fit, nor any after
