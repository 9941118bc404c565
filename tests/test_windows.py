"""`--on-long window`: sequences over the limit run as overlapping windows and are stitched into one row.

The reference is transformers run directly on each window (a model we did not write), stitched here by
the rules README states (hidden states from the window where a residue sits farthest from an edge, ties to
the earlier; log-probabilities from the earliest window holding the token). The CLI's columns are held to
transformers' own float32 error against a float64 run, as every parity test is (tests/float64_reference.py).
Lengths: exactly the window (one window), one token more (two), three windows' worth, and others.
"""
from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch

from pipeline.engine.hf import HFEngine
from pipeline.engine.windowed import Windows, window_starts

from .float64_reference import Float64Transformers, assert_as_accurate
from .tiny_models import run_cli

WINDOW = 34          # tokens: ESM's <cls> + 32 residues + <eos>, and the demo tokenizer's <bos> ... <eos>
SIZE, OVERLAP = 32, 8   # residues per window; the default overlap is a quarter of them
LENGTHS = [32, 33, 100, 57, 150, 5]


def test_window_starts_cover_every_token_and_give_each_at_least_the_overlap_as_context():
    for n in range(1, 200):
        starts = window_starts(n, SIZE, OVERLAP)
        assert starts[0] == 0 and (len(starts) == 1 or starts[-1] == n - SIZE)
        assert all(b - a <= SIZE - OVERLAP for a, b in zip(starts, starts[1:]))
        w = Windows(SIZE + 2, OVERLAP, 1, 1)
        hidden, logprob = w.rows(n + 2, starts, 0)
        assert len(hidden) == len(logprob) == n + 2
        for j in range(n):
            k, offset = divmod(int(logprob[1 + j]) - 1, SIZE + 2)
            assert offset == j - starts[k] and (k == 0 or offset >= OVERLAP)   # context: the overlap at least


def _fasta(tmp_path, alphabet: str) -> str:
    rng = np.random.default_rng(3)
    path = tmp_path / "long.fasta"
    path.write_text("".join(f">s{i} len {n}\n{''.join(rng.choice(list(alphabet), n))}\n" for i, n in enumerate(LENGTHS)))
    return str(path)


def _expected_windows(n: int) -> int:
    return 1 if n <= SIZE else -(-(n - SIZE) // (SIZE - OVERLAP)) + 1


def _window_outputs(engine, text: str, tokenizer, layers, logprobs: bool):
    """Each window of one sequence through `engine`: [(start, hidden [tokens, d], logprobs [tokens])]."""
    starts = window_starts(len(text), SIZE, OVERLAP)
    batch = [tokenizer(text[s:s + SIZE])["input_ids"] for s in starts]
    out = engine.forward(batch, layers, logprobs)
    cu = out.cu_seqlens.tolist()
    return [(s, out.hidden[layers[0]][cu[k]:cu[k + 1]].double() if layers else None,
             out.token_logprobs[cu[k]:cu[k + 1]].double() if logprobs else None) for k, s in enumerate(starts)]


def _stitch_hidden(windows) -> torch.Tensor:
    """Per residue, the state from the window where it sits farthest from an edge (ties: the earlier)."""
    n = windows[-1][0] + SIZE if len(windows) > 1 else windows[0][1].shape[0] - 2
    rows = []
    for j in range(n):
        best = max((min(j - s, s + SIZE - 1 - j), -k) for k, (s, _, _) in enumerate(windows) if s <= j < s + SIZE)
        s, h, _ = windows[-best[1]]
        rows.append(h[1 + j - s])
    return torch.stack(rows)


def _stitch_logprob_sum(windows, n: int) -> float:
    """Sum over residues of log p from the earliest window holding each (the demo tokenizer's <bos> first, so
    every residue has a token before it)."""
    total = 0.0
    for j in range(n):
        s, _, lp = next(w for w in windows if w[0] <= j < w[0] + SIZE)
        total += float(lp[1 + j - s])
    return total


@pytest.mark.slow
def test_embeddings_of_windowed_sequences_equal_transformers_on_the_windows(models, tmp_path):
    from transformers import AutoTokenizer
    fasta = _fasta(tmp_path, "ACDEFGHIKLMNPQRSTVWY")
    out = tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), "--model", models["esm"], "--gpus", "0", "--workers", "1",
                  "--on-long", "window", "--window", str(WINDOW), "--per-residue", "--per-residue-dtype", "float32",
                  "--pool", "mean,cls,last", "--no-progress")
    assert res.returncode == 0, res.stderr
    assert "run as overlapping windows of 34 tokens (8 shared by neighbours)" in res.stderr
    tokenizer = AutoTokenizer.from_pretrained(models["esm"])
    exact = Float64Transformers(models["esm"], logprobs=False)
    theirs = HFEngine(models["esm"], torch.device("cpu"), torch.float32, False)
    final = theirs.info.num_layers
    with h5py.File(out / "result.h5") as f:
        ids = [i.decode() for i in f["ids"][:]]
        texts = {r.split()[0]: r.split("\n")[1] for r in open(fasta).read().split(">")[1:]}
        assert list(f["windows"][:]) == [_expected_windows(len(texts[i])) for i in ids]
        offsets = f["per_residue/offsets"][:]
        for row, seq_id in enumerate(ids):
            text = texts[seq_id]
            e = _window_outputs(exact, text, tokenizer, [final], False)
            t = _window_outputs(theirs, text, tokenizer, [final], False)
            ours = torch.from_numpy(f["per_residue/values"][offsets[row]:offsets[row + 1]])
            want, ref = _stitch_hidden(e), _stitch_hidden(t)
            assert ours.shape == want.shape, seq_id
            assert_as_accurate(ours, ref, want, f"{seq_id}: per-residue")
            assert_as_accurate(torch.from_numpy(f["embeddings/mean"][row]), ref.mean(0), want.mean(0),
                               f"{seq_id}: mean")
            assert_as_accurate(torch.from_numpy(f["embeddings/cls"][row]), t[0][1][0], e[0][1][0], f"{seq_id}: cls")
            assert_as_accurate(torch.from_numpy(f["embeddings/last"][row]), t[-1][1][-1], e[-1][1][-1],
                               f"{seq_id}: last")


@pytest.mark.slow
def test_scores_of_windowed_sequences_equal_transformers_on_the_windows(models, tmp_path):
    from transformers import AutoTokenizer
    fasta = _fasta(tmp_path, "ACDEFGHIKLMNPQRSTVWY")
    out = tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), "--model", models["llama"], "--task", "score", "--gpus", "0",
                  "--workers", "1", "--on-long", "window", "--window", str(WINDOW), "--no-progress")
    assert res.returncode == 0, res.stderr
    # no prompt is longer than a window: the KV cache is sized for one, not for the longest record
    assert json.loads((out / "manifest.json").read_text())["longest_prompt"] == WINDOW
    tokenizer = AutoTokenizer.from_pretrained(models["llama"])
    exact = Float64Transformers(models["llama"], logprobs=True)
    theirs = HFEngine(models["llama"], torch.device("cpu"), torch.float32, True)
    with h5py.File(out / "result.h5") as f:
        ids = [i.decode() for i in f["ids"][:]]
        texts = {r.split()[0]: r.split("\n")[1] for r in open(fasta).read().split(">")[1:]}
        assert list(f["windows"][:]) == [_expected_windows(len(texts[i])) for i in ids]
        assert list(f["score/num_scored"][:]) == [len(texts[i]) for i in ids]
        for row, seq_id in enumerate(ids):
            text = texts[seq_id]
            want = _stitch_logprob_sum(_window_outputs(exact, text, tokenizer, [], True), len(text))
            ref = _stitch_logprob_sum(_window_outputs(theirs, text, tokenizer, [], True), len(text))
            assert_as_accurate(torch.tensor([f["score/logprob_sum"][row]]), torch.tensor([ref]),
                               torch.tensor([want]), f"{seq_id}: logprob_sum")


def test_window_options_are_checked(models, tmp_path):
    """Through the CLI where the check needs the model (planning), directly where it does not."""
    from transformers import AutoTokenizer

    from pipeline.engine import windowed as windows
    from pipeline.config import RunConfig
    from pipeline.errors import UserError
    from pipeline.tasks.tokenization import SequenceTokenizer
    fasta = _fasta(tmp_path, "ACDEFGHIKLMNPQRSTVWY")
    for args, message in [
        (["--window", "20"], "--window and --overlap apply to --on-long window"),
        (["--on-long", "window", "--window", "34", "--overlap", "32"], "--overlap 32 must be below the 32"),
    ]:
        res = run_cli(fasta, "--out", str(tmp_path / "o"), "--model", models["esm"], "--gpus", "0", *args,
                      "--no-progress")
        assert res.returncode == 2 and message in res.stderr, (args, res.stderr)
        assert "Traceback" not in res.stderr and not (tmp_path / "o").exists()
    tokenizer = SequenceTokenizer(AutoTokenizer.from_pretrained(models["esm"]))
    config = RunConfig(fasta=[fasta], out="o", on_long="window", window=2000)
    with pytest.raises(UserError, match="--window 2000 is over the model's limit of 1024"):
        windows.plan(config, 1024, tokenizer)
    shorter = RunConfig(fasta=[fasta], out="o", on_long="window", window=200, max_length=100)
    with pytest.raises(UserError, match="--window 200 is over the --max-length limit of 100 tokens"):
        windows.plan(shorter, 100, tokenizer)   # (it said "the model's limit of 100", ESM's being 1024)
    with pytest.raises(UserError, match="this model has no token limit, so pass --window N"):
        windows.plan(RunConfig(fasta=[fasta], out="o", on_long="window"), None, tokenizer)
    planned = RunConfig(fasta=[fasta], out="o", on_long="window")
    assert windows.plan(planned, 1024, tokenizer) == Windows(1024, 255, 1, 1)      # default: a quarter of 1022
    assert (planned.window, planned.overlap) == (1024, 255)
    with pytest.raises(UserError, match="--on-long window is for embed and score"):
        RunConfig(fasta=[fasta], out="o", on_long="window", task="generate")


def test_a_model_without_bos_scores_every_windowed_token_with_a_token_before_it():
    """Qwen's tokenizer puts no <bos> before a sequence (head 0): a window's first token has nothing before it
    in that window. With --overlap 0 (given, or the default a quarter of a window of 2 or 3 tokens) the first
    token of every later window took log-probability 0 from its own window and was counted as scored (a run
    of 19 tokens in windows of 8: num_scored 18, the sum one token's log-probability short). A score now keeps
    at least one shared token, and refuses --overlap 0, naming the fix; embeddings need no context and keep it."""
    from types import SimpleNamespace

    from pipeline.config import RunConfig
    from pipeline.engine import windowed as windows
    from pipeline.errors import UserError
    no_bos = SimpleNamespace(head=0, tail=0)
    for window in (2, 3, 8):
        config = RunConfig(fasta=["x.fa"], out="o", task="score", on_long="window", window=window)
        w = windows.plan(config, None, no_bos)
        assert w.overlap >= 1 and config.overlap == w.overlap
        for n in range(window + 1, 40):
            starts = window_starts(n, w.size, w.overlap)
            _, logprob = w.rows(n, starts, 0)
            position = logprob % w.limit   # the token's place in the window its log-probability comes from
            assert (position[1:] >= 1).all(), (window, n, starts)
    with pytest.raises(UserError, match="--overlap 0 leaves the first token of every window after the first "
                                        "without a token before it.*use --overlap 1 or more"):
        windows.plan(RunConfig(fasta=["x.fa"], out="o", task="score", on_long="window", window=8, overlap=0),
                     None, no_bos)
    embed = RunConfig(fasta=["x.fa"], out="o", task="embed", on_long="window", window=3)
    assert windows.plan(embed, None, no_bos).overlap == 0
    with_bos = RunConfig(fasta=["x.fa"], out="o", task="score", on_long="window", window=8, overlap=0)
    assert windows.plan(with_bos, None, SimpleNamespace(head=1, tail=0)).overlap == 0   # <bos> is its context


def _rows_by_every_pair(w: Windows, num_tokens: int, starts: list[int], first_row: int):
    """Windows.rows by its definition, over every (token, window) pair: the farthest from an edge (ties: the
    earlier) and the earliest window holding each content token."""
    n, per = num_tokens - w.head - w.tail, w.limit
    hidden, logprob = list(range(first_row, first_row + w.head)), list(range(first_row, first_row + w.head))
    for j in range(n):
        holding = [(k, s) for k, s in enumerate(starts) if s <= j < s + w.size]
        k, s = max(holding, key=lambda ks: (min(j - ks[1], ks[1] + w.size - 1 - j), -ks[0]))
        hidden.append(first_row + k * per + w.head + j - s)
        k, s = holding[0]
        logprob.append(first_row + k * per + w.head + j - s)
    last = first_row + (len(starts) - 1) * per + w.head + w.size
    tail = list(range(last, last + w.tail))
    return hidden + tail, logprob + tail


def test_window_rows_equal_their_definition_and_stay_linear_in_the_record():
    """The rows each token takes its values from, against the definition over every (token, window) pair, for
    window sizes, overlaps (0 to size - 1), odd and even, heads and tails of 0 to 2 tokens. Then a record of
    20,000 residues in windows of 34 tokens (833 windows): the rows came from [tokens, windows] arrays, 400 MB
    here, and at 200,000 residues (1.7e9 cells, tens of GB) the kernel killed the worker; now a few arrays of one
    value per token."""
    import tracemalloc
    for head, tail in [(1, 1), (0, 0), (2, 1), (0, 1)]:
        for size in (2, 3, 5, 8):
            for overlap in range(size):
                w = Windows(size + head + tail, overlap, head, tail)
                for n in range(size + 1, 4 * size + 7):
                    starts = window_starts(n, size, overlap)
                    got = w.rows(n + head + tail, starts, 5)
                    want = _rows_by_every_pair(w, n + head + tail, starts, 5)
                    assert [g.tolist() for g in got] == list(want), (head, tail, size, overlap, n)
    w = Windows(SIZE + 2, OVERLAP, 1, 1)
    n = 20_000
    starts = window_starts(n, SIZE, OVERLAP)
    tracemalloc.start()
    try:
        hidden, logprob = w.rows(n + 2, starts, 0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(starts) == 833 and len(hidden) == len(logprob) == n + 2
    assert peak < 40 * 8 * n, peak   # a few int64 arrays of n values; was 50 times more


@pytest.mark.parametrize("name,logprobs", [("esm", False), ("llama", True)])
def test_a_sequence_of_many_windows_runs_in_calls_within_the_token_budget(models, name, logprobs):
    """The windows of one long sequence went to the engine in one call whatever --max-tokens-per-batch (the batch
    takes at least one sequence): with the hf engine, one padded tensor of every window and every layer's states,
    memory growing with the record without bound. Now in calls of at most the budget, and the stitched outputs
    are those of the one call (to float32's error: the calls batch the same windows differently)."""
    from transformers import AutoTokenizer

    from pipeline.engine.windowed import WindowedEngine

    class Calls(HFEngine):   # the real engine, its calls' sizes noted
        def forward(self, batch, layers, logprobs):
            self.calls.append(sum(len(ids) for ids in batch))
            return super().forward(batch, layers, logprobs)

    engine = Calls(models[name], torch.device("cpu"), torch.float32, logprobs)
    final = engine.info.num_layers
    rng = np.random.default_rng(5)
    tokenizer = AutoTokenizer.from_pretrained(models[name])
    batch = [tokenizer("".join(rng.choice(list("ACDEFGHIKLMNPQRSTVWY"), n)))["input_ids"] for n in (600, 20, 90)]
    cut = Windows(WINDOW, OVERLAP, 1, 1) if name == "esm" else Windows(WINDOW - 1, OVERLAP, 1, 0)   # llama: <bos>
    outputs = {}
    for budget in (None, 4 * WINDOW, 100):
        engine.calls, told = [], []
        outputs[budget] = WindowedEngine(engine, cut, budget, on_call=lambda *a: told.append(a)).forward(
            batch, [0, final], logprobs)
        windows = sum(cut.count(len(b)) if len(b) > cut.limit else 1 for b in batch)
        assert windows > 20 and len(engine.calls) == (1 if budget is None else -(-windows // (budget // cut.limit)))
        assert max(engine.calls) <= (budget or windows * cut.limit)
        # each call of several is told (the worker's progress before the batch's rows): windows done, of, tokens
        if budget is not None:
            assert [t[1] for t in told] == [windows] * len(engine.calls) and told[-1][0] == windows
            assert [t[0] for t in told] == sorted({t[0] for t in told}) and [t[2] for t in told] == engine.calls
        else:
            assert told == []
    one = outputs[None]
    assert one.cu_seqlens.diff().tolist() == [len(b) for b in batch]
    for budget in (4 * WINDOW, 100):
        got = outputs[budget]
        assert got.cu_seqlens.tolist() == one.cu_seqlens.tolist()
        for k in (0, final):
            torch.testing.assert_close(got.hidden[k], one.hidden[k])
        if logprobs:
            torch.testing.assert_close(got.token_logprobs, one.token_logprobs)


def test_a_window_too_small_names_the_option_that_set_it(models, tmp_path):
    """With --on-long window and no --window, the window is --max-length: `--max-length 3` was refused as
    "--window 3 leaves 1 residue token(s) ...; use a larger --window", and a larger --window is then over the
    --max-length limit, refused in turn. The message names --max-length and has it raised."""
    from types import SimpleNamespace

    from pipeline.config import RunConfig
    from pipeline.engine import windowed as windows
    from pipeline.errors import UserError
    fasta = _fasta(tmp_path, "ACDEFGHIKLMNPQRSTVWY")
    res = run_cli(fasta, "--out", str(tmp_path / "o"), "--gpus", "0", "--on-long", "window", "--max-length", "3",
                  "--no-progress")
    assert res.returncode == 2 and "Traceback" not in res.stderr and not (tmp_path / "o").exists(), res.stderr
    assert "error: --max-length 3 leaves 1 residue token(s) per window beside the 2 special token(s); use a larger " \
           "--max-length (the window when --window is not given)" in res.stderr, res.stderr
    assert "--window" not in res.stderr.replace("when --window is not given", "")
    res = run_cli(fasta, "--out", str(tmp_path / "o"), "--gpus", "0", "--on-long", "window", "--max-length", "4",
                  "--no-progress")
    assert res.returncode == 0, res.stderr   # the advice works
    tokenizer = SimpleNamespace(head=1, tail=1)
    with pytest.raises(UserError, match=r"must be below the 3 residue "
                                        r"tokens of a window \(--max-length 5 less 2 special token\(s\)\)"):
        windows.plan(RunConfig(fasta=[fasta], out="o", on_long="window", max_length=5, overlap=3), 5, tokenizer)
    with pytest.raises(UserError, match=r"^--window 3 leaves 1 residue token\(s\) .*; use a larger --window$"):
        windows.plan(RunConfig(fasta=[fasta], out="o", on_long="window", window=3), 1024, tokenizer)
    with pytest.raises(UserError, match=r"^the model's limit of 3 tokens leaves 1 residue token\(s\) .*; use "
                                        r"another model$"):
        windows.plan(RunConfig(fasta=[fasta], out="o", on_long="window"), 3, tokenizer)
