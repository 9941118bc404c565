"""`--task score` on masked LMs (pseudo-log-likelihood, wild-type marginal, the per-residue table) and
causal LMs (per-residue log-probabilities) through the real CLI with 2 CPU workers, each number against
transformers computed by hand (tests/scoring_reference.py) with the float64-grounded bound of
tests/float64_reference.py; batch invariance and a resume after a kill give the same bits; the refusals.

The masked LM is an ESM-2-style checkpoint (EsmForMaskedLM: rotary positions, token dropout, 2 layers); the
causal one a tiny Llama with a token per residue; subword tokens are checked on the Llama 2 family checkpoint
(tests/families).
"""
from __future__ import annotations

import re

import h5py
import numpy as np
import pytest
import torch

from pipeline.config import RunConfig
from pipeline.engine import mkl_cnr
from pipeline.errors import UserError

from . import scoring_reference as ref
from .float64_reference import assert_as_accurate
from .run_helpers import raw_datasets, read, undocumented_files, undocumented_in_schema
from .slurm_helpers import html_cells
from .tiny_models import run_cli, save_esm, save_llama

pytestmark = pytest.mark.slow

SEQUENCES = {
    "P1 first": "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKALPDAQ",
    "P2": "ACDEFGHIKLMNPQRSTVWY",
    "P3 an unknown residue": "MSGKPVLHYFNJRGRMECIRWLLAAAG",
    "P4": "GSHMKT",
    "P5": "MVLSPADKTNVKAAWGKVGAHAGEYGAEALERMFLSFPTTKT",
}
COMMON = ("--gpus", "0", "--workers", "2", "--max-tokens-per-batch", "256", "--checkpoint-every", "1", "--no-progress")


@pytest.fixture(scope="module")
def fasta(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("scoring") / "proteins.fasta"
    path.write_text("".join(f">{name}\n{seq}\n" for name, seq in SEQUENCES.items()))
    return str(path)


@pytest.fixture(scope="module")
def esm(tmp_path_factory) -> str:
    return str(save_esm(tmp_path_factory.mktemp("esm") / "esm2_style"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return str(save_llama(tmp_path_factory.mktemp("llama") / "llama"))


def run(fasta: str, out, *args: str, env: dict | None = None) -> dict:
    res = run_cli(fasta, "--out", str(out), *args, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert undocumented_files(out) == [] and undocumented_in_schema(out / "result.h5") == []
    return read(out / "result.h5")


@pytest.fixture(scope="module")
def pll_run(fasta, esm, tmp_path_factory):
    out = tmp_path_factory.mktemp("pll") / "out"
    return run(fasta, out, "--model", esm, "--task", "score", "--per-residue", *COMMON), out


def claims_batch_invariance(out) -> bool:
    with h5py.File(out / "result.h5") as f:
        return bool(f.attrs["batch_invariant"])


def residues(got: dict, name: str, i: int) -> np.ndarray:
    a, b = got["per_residue/offsets"][i:i + 2]
    return got[name][a:b]


def assert_masked_scores(got: dict, model: str, method) -> None:
    """Sums, counts, means, each residue's term and the amino-acid table against the hand computation. P3's J,
    fed as the unknown token, is context but not scored: out of the sum and the count, NaN as a residue's term
    (before issue 37 its log p(<unk>) was summed)."""
    seqs = list(SEQUENCES.values())
    theirs = [method(model, s, exact=False) for s in seqs]
    exact = [method(model, s, exact=True) for s in seqs]
    assert got["score/num_scored"].tolist() == [len(s) - s.count("J") for s in seqs]
    assert_as_accurate(got["score/logprob_sum"], [t[0] for t in theirs], [e[0] for e in exact], "logprob_sum")
    np.testing.assert_array_equal(got["score/logprob_mean"], got["score/logprob_sum"] / got["score/num_scored"])
    assert np.array_equal(np.diff(got["per_residue/offsets"]), [len(s) for s in seqs])
    for name, k in (("per_residue/logprob", 1), ("per_residue/amino_acids", 2)):
        ours = np.concatenate([residues(got, name, i) for i in range(len(seqs))])
        assert ours.dtype == np.float32
        assert_as_accurate_where_finite(ours, np.concatenate([t[k] for t in theirs]),
                                        np.concatenate([e[k] for e in exact]), name, floor=2e-7 * 4)
        # (stored as float32: its own rounding, 2^-24 relative, comes on top)
    unknown = residues(got, "per_residue/logprob", 2)[SEQUENCES["P3 an unknown residue"].index("J")]
    assert np.isnan(unknown) and np.isfinite(residues(got, "per_residue/amino_acids", 2)).all()
    # the table's column for each standard residue is that residue's own term
    table, own = got["per_residue/amino_acids"], got["per_residue/logprob"]
    letters = "".join(seqs)
    standard = [i for i, c in enumerate(letters) if c in ref.AMINO_ACIDS]
    assert np.array_equal(table[standard, [ref.AMINO_ACIDS.index(letters[i]) for i in standard]], own[standard])


def assert_as_accurate_where_finite(ours, theirs, exact, what: str, floor: float) -> None:
    """NaN exactly where the exact values are NaN (residues not scored), and as accurate elsewhere."""
    ours, theirs, exact = (np.asarray(a, np.float64) for a in (ours, theirs, exact))
    assert np.array_equal(np.isnan(ours), np.isnan(exact)) and np.array_equal(np.isnan(theirs), np.isnan(exact))
    finite = ~np.isnan(exact)
    assert_as_accurate(ours[finite], theirs[finite], exact[finite], what, floor=floor)


def test_pll_and_its_per_residue_table_match_transformers_by_hand(pll_run, esm):
    got, out = pll_run
    assert_masked_scores(got, esm, ref.pll)
    assert got["status"].tolist() == [0, 0, 2, 0, 0]     # P3's J is no ESM token
    with h5py.File(out / "result.h5") as f:
        assert f.attrs["score_method"] == "pll" and f.attrs["engine"] == "native"
        assert f.attrs["per_residue_amino_acids"] == "ACDEFGHIKLMNPQRSTVWY"
    # every residue's masked copy was computed, and the logs count those tokens
    expected = sum((len(s) + 2) * len(s) for s in SEQUENCES.values())
    logged = [re.search(r"shard complete: \S+ \((\d+) sequences, (\d+) tokens", (out / "logs" / f"worker_{r}.log")
                        .read_text()) for r in (0, 1)]
    assert sum(int(m[1]) for m in logged) == len(SEQUENCES) and sum(int(m[2]) for m in logged) == expected


def test_wt_marginal_and_its_table_match_transformers_by_hand(fasta, esm, tmp_path):
    got = run(fasta, tmp_path / "wt", "--model", esm, "--task", "score", "--score-method", "wt-marginal",
              "--per-residue", *COMMON)
    assert_masked_scores(got, esm, ref.wt_marginal)


def test_pll_on_the_hf_engine_matches_transformers_by_hand(fasta, esm, tmp_path):
    """The hf engine scores a masked LM too (AutoModelForMaskedLM, its logits at the masks)."""
    got = run(fasta, tmp_path / "hf", "--model", esm, "--task", "score", "--per-residue", "--engine", "hf", *COMMON)
    assert_masked_scores(got, esm, ref.pll)
    with h5py.File(tmp_path / "hf" / "result.h5") as f:
        assert f.attrs["engine"] == "hf"


def test_pll_is_batch_invariant_where_claimed_and_a_killed_run_resumes_to_the_same_bits(pll_run, fasta, esm, tmp_path):
    """1 worker (2 threads) with a 64-token budget against 2 workers (1 thread each) with 256: the same bits
    exactly where the results claim it (`batch_invariant`), which is where this CPU's MKL runs in strict CNR
    mode and products check out (engine/mkl_cnr.py: Intel CPUs). On an AMD EPYC, MKL's default mode gave these
    scores other bits (issue 37), and the results now say they are not batch-invariant. A run killed and
    continued with the same settings gives the same bits on any CPU."""
    want = raw_datasets(pll_run[1] / "result.h5")
    claimed = claims_batch_invariance(pll_run[1])
    assert claimed == mkl_cnr.strict_matmuls().holds   # this process answers as a fresh worker does (conftest.py)
    one = tmp_path / "one_worker"
    res = run_cli(fasta, "--out", str(one), "--model", esm, "--task", "score", "--per-residue", "--gpus", "0",
                  "--workers", "1", "--max-tokens-per-batch", "64", "--no-progress")
    assert res.returncode == 0, res.stderr[-3000:]
    assert claims_batch_invariance(one) == claimed
    if claimed:
        assert raw_datasets(one / "result.h5") == want
    else:   # said on the terminal, with why
        assert "this run's values are not batch-invariant" in res.stderr and mkl_cnr.strict_matmuls().text in res.stderr
    killed = tmp_path / "killed"
    res = run_cli(fasta, "--out", str(killed), "--model", esm, "--task", "score", "--per-residue", *COMMON,
                  env={"RUN_SHARDS_FAULT_DIE_AT": "part-written", "RUN_SHARDS_FAULT_DIE_SHARD": "0",
                       "RUN_SHARDS_FAULT_DIE_AFTER": "1"})
    assert res.returncode == 1 and "killed by SIGKILL" in res.stderr, res.stderr[-2000:]
    assert len(list((killed / "shards" / "shard_0.parts").glob("part_*.h5"))) == 1   # one checkpoint kept
    res = run_cli("rerun", str(killed), "--no-progress")
    assert res.returncode == 0, res.stderr[-2000:]
    assert raw_datasets(killed / "result.h5") == want
    # report.html counts the tokens computed for each shard's rows (the masked copies, as the worker logs them),
    # across the killed attempt's checkpoint and the resumed one's: those of the run that was not killed.
    logged = [int(re.search(r"shard complete: \S+ \(\d+ sequences, (\d+) tokens", (pll_run[1] / "logs" /
                            f"worker_{r}.log").read_text())[1]) for r in (0, 1)]
    assert run_cli("report", str(killed)).returncode == 0
    shards = html_cells((killed / "report.html").read_text(), "shards")
    assert [int(row[5].replace(",", "")) for row in shards] == logged and [row[7] for row in shards] == ["2", "1"]


def test_on_a_cpu_without_strict_matmuls_a_pll_run_is_not_claimed_batch_invariant(fasta, esm, tmp_path):
    """MKL_ENABLE_INSTRUCTIONS=SSE4_2 makes MKL run its SSE4.2 code branch, which its strict mode does not cover,
    in its default mode, as an AMD EPYC's MKL runs: there this PLL path's rows changed with the budget and thread
    count (docs/engine.md, "MKL outside strict mode"), so the result must not claim batch invariance. Before
    issue 37 the default mode was claimed."""
    out = tmp_path / "sse42"
    res = run_cli(fasta, "--out", str(out), "--model", esm, "--task", "score", *COMMON,
                  env={"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert not claims_batch_invariance(out)
    said = "MKL in its default mode: its strict CNR mode does not apply to this CPU's code branch"
    assert "this run's values are not batch-invariant" in res.stderr and said in res.stderr
    assert all(f"matmuls: {said}" in (out / "logs" / f"worker_{r}.log").read_text() for r in (0, 1))


def test_causal_score_is_kept_and_per_residue_adds_each_residues_log_probability(fasta, llama, tmp_path):
    got = run(fasta, tmp_path / "causal", "--model", llama, "--task", "score", "--per-residue", *COMMON)
    seqs = list(SEQUENCES.values())
    assert sorted(k for k in got if k.startswith(("score", "per_residue"))) == [
        "per_residue/logprob", "per_residue/offsets", "score/eos_logprob", "score/logprob_sum", "score/num_scored"]
    assert_as_accurate(got["score/logprob_sum"], [ref.causal_score(llama, s, False) for s in seqs],
                       [ref.causal_score(llama, s, True) for s in seqs], "logprob_sum")
    assert got["score/num_scored"].tolist() == [len(s) - s.count("J") for s in seqs]   # P3's J: unknown, not scored
    # its tokenizer ends each sequence with </s>: that term is kept apart, log p(</s> | the sequence)
    assert_as_accurate(got["score/eos_logprob"], [ref.causal_token_logprobs(llama, s, False)[1][-1] for s in seqs],
                       [ref.causal_token_logprobs(llama, s, True)[1][-1] for s in seqs], "eos_logprob")

    def residue_terms(seq: str, exact: bool) -> np.ndarray:   # the residues' tokens; NaN for an unknown one
        return np.where(np.array(list(seq)) == "J", np.nan, ref.causal_token_logprobs(llama, seq, exact)[1][1:-1])
    ours = np.concatenate([residues(got, "per_residue/logprob", i) for i in range(len(seqs))])
    assert_as_accurate_where_finite(ours, np.concatenate([residue_terms(s, False) for s in seqs]),
                                    np.concatenate([residue_terms(s, True) for s in seqs]), "per-residue", floor=1e-6)
    for i in range(len(seqs)):   # a token per residue: the residues' terms are the score's
        assert np.nansum(residues(got, "per_residue/logprob", i).astype(np.float64)) == pytest.approx(
            got["score/logprob_sum"][i], rel=1e-6)


def test_subword_tokens_share_their_log_probability_among_their_residues(tmp_path):
    """A BPE tokenizer (the Llama 2 family checkpoint) groups residues: each residue of a token gets an equal
    share of the token's log-probability, computed by transformers here by hand."""
    from pipeline.engine.hf import HFEngine
    from pipeline.tasks.score import ScoreTask
    from pipeline.tasks.tokenization import SequenceTokenizer

    from .families import checkpoints
    path = str(checkpoints.build("llama2", tmp_path / "llama2"))
    engine = HFEngine(path, torch.device("cpu"), torch.float32, logprobs=True)
    tokenizer = SequenceTokenizer(engine.tokenizer)
    assert not tokenizer.char_level
    seqs = ["MKTAYIAKQRQISFVKSHFSRQ", "GSHMKTAAAA"]
    toks = tokenizer.encode(seqs)
    task = ScoreTask(RunConfig(fasta=["x"], task="score", per_residue=True), engine.info)
    task.prepare(tokenizer)
    out = task.run(engine, toks, np.arange(len(seqs)))
    values, lengths = out.values["per_residue/logprob"], out.lengths["per_residue"]
    assert lengths.tolist() == [len(s) for s in seqs]
    start = 0
    for seq, tok in zip(seqs, toks):
        ids, lp = ref.causal_token_logprobs(path, seq, exact=True)
        assert ids == tok.ids
        spans = tokenizer.content_spans(tok)
        assert (np.diff(spans, axis=1) > 1).any(), "no token of several residues: nothing is tested"
        content = np.flatnonzero(~tok.special)
        want = np.full(len(seq), np.nan)
        for (a, b), t in zip(spans, content):
            if b > a:
                want[a:b] = lp[t] / (b - a)
        np.testing.assert_allclose(values[start:start + len(seq)], want, rtol=1e-4, atol=1e-5)
        start += len(seq)


def test_residue_spans_follow_the_input_convention_line_breaks_and_all(tmp_path):
    """ProtGPT2's convention writes 60-residue FASTA lines between <|endoftext|>\\n and \\n<|endoftext|>: each
    token's residues come from offsets into that text, so every residue belongs to exactly one token, in
    order, each token's text is its residues', and the line breaks stand for none."""
    from pipeline.models import checkpoint
    from pipeline.tasks.tokenization import SequenceTokenizer

    from .families import checkpoints
    source = checkpoint.local_source(str(checkpoints.build_cached("protgpt2", tmp_path)))
    hf = checkpoint.read_tokenizer(source, checkpoint.read_config(source))
    assert source.family.convention.line_width == 60
    seq = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKALPDAQFEVVHSLAKWKRQTLGQHDFSAGEGLYTHMKAL" * 2
    tokenizer = SequenceTokenizer(hf, source.family.convention)
    (tok,) = tokenizer.encode([seq])
    spans = tokenizer.content_spans(tok)
    content = [hf.convert_tokens_to_string([t]) for t in hf.convert_ids_to_tokens(np.asarray(tok.ids)[~tok.special])]
    assert len(spans) == len(content)
    covered = np.concatenate([np.arange(a, b) for a, b in spans])
    assert covered.tolist() == list(range(len(seq)))
    breaks = 0
    for (a, b), text in zip(spans, content):
        if b == a:
            assert text.strip() == "", text
            breaks += text.count("\n")
        else:
            assert text == seq[a:b]
    assert breaks == 2 + (len(seq) - 1) // 60   # after the prefix, between lines, before the suffix


def plan_refusal(tmp_path, fasta: str, **options) -> str:
    from pipeline.planning.plan import plan
    with pytest.raises(UserError) as e:
        plan(RunConfig(fasta=[fasta], out=str(tmp_path / "o"), **options))
    return str(e.value)


def test_what_score_refuses_before_any_compute(fasta, esm, llama, tmp_path):
    from transformers import EsmModel
    assert "--score-method wt-marginal is for masked language models" in plan_refusal(
        tmp_path, fasta, model=llama, task="score", score_method="wt-marginal")
    assert "needs the whole sequence in one pass" in plan_refusal(tmp_path, fasta, model=esm, task="score",
                                                                   on_long="window")
    bare = tmp_path / "bare"   # an ESM checkpoint saved without its masked-LM head
    EsmModel.from_pretrained(esm, add_pooling_layer=False).save_pretrained(bare)
    __import__("shutil").copy(f"{esm}/vocab.txt", bare)
    __import__("shutil").copy(f"{esm}/tokenizer_config.json", bare)
    message = plan_refusal(tmp_path, fasta, model=str(bare), task="score")
    assert "*ForMaskedLM" in message and "EsmModel" in message
    res = run_cli(fasta, "--out", str(tmp_path / "cli"), "--model", esm, "--task", "score", "--pool", "cls")
    assert res.returncode == 2 and "--pool applies only to --task embed (this run's task is score)" in res.stderr
    res = run_cli(fasta, "--out", str(tmp_path / "cli"), "--model", esm, "--task", "embed", "--score-method", "pll")
    assert res.returncode == 2 and "--score-method applies only to --task score" in res.stderr


@pytest.mark.parametrize("kind", ("esm2", "esm1b"))
def test_the_engines_masked_lm_head_at_chosen_positions_matches_transformers(kind, tmp_path):
    """Engine.logprobs_at on ESM-2 (rotary, token dropout) and ESM-1b (learned positions): copies with one and
    with several masks, the native engine's torch path and its Triton path (compiled on a GPU, else the
    interpreter) each as accurate as transformers' EsmForMaskedLM in float32 against float64. The native last
    layer runs at the chosen rows only; the hf engine's logits come from every position."""
    from pipeline.engine.hf import HFEngine
    from pipeline.engine.native import NativeEngine

    from .float64_reference import float64_everywhere
    from .run_helpers import triton_test_device
    from .tiny_checkpoints import random_sequences, write_tiny
    path = str(write_tiny(kind, tmp_path / kind))
    batch = random_sequences([40, 9, 23], seed=3)
    chosen = [[5], [1, 2, 7], [22, 3]]
    copies = [[32 if i in c else t for i, t in enumerate(ids)] for ids, c in zip(batch, chosen)]
    positions = chosen + [[0, 4, 8]]   # and an unmasked sequence's own positions
    copies.append(batch[1])
    hf = HFEngine(path, torch.device("cpu"), torch.float32, logprobs=True).logprobs_at(copies, positions)
    with float64_everywhere():
        exact = HFEngine(path, torch.device("cpu"), torch.float64, logprobs=True).logprobs_at(copies, positions)
    engines = [NativeEngine.load(path, torch.device("cpu"), torch.float32, "", max_tokens_per_step=48)]
    device = triton_test_device()
    engines.append(NativeEngine.load(path, device, torch.float32, "", max_tokens_per_step=48, kernels="triton"))
    for engine in engines:
        ours = engine.logprobs_at(copies, positions)
        assert ours.shape == exact.shape == (9, 33) and ours.dtype == torch.float64
        assert_as_accurate(ours.cpu(), hf, exact, f"{kind} {'triton' if engine.runner.triton else 'torch'} path")


@pytest.mark.parametrize("kind", ("esm2", "esm1b"))
def test_pll_copies_share_their_first_layer_inputs_with_the_same_bits(kind, tmp_path, monkeypatch):
    """A pseudo-log-likelihood step holds a sequence's copies, each with one residue masked: their first layer's
    norm, projections and rotation run once per distinct (token, position, mask count, length) row, not once per
    copy. The log-probabilities are bit for bit those computed copy by copy, on the torch path and (ESM-2) the
    Triton path (a GPU, else the interpreter), with a budget that cuts a sequence's copies over several steps."""
    from pipeline.engine.native import NativeEngine
    from pipeline.models import esm

    from .run_helpers import triton_test_device
    from .tiny_checkpoints import random_sequences, write_tiny
    path = str(write_tiny(kind, tmp_path / kind))
    copies, where = [], []
    sequences = random_sequences([10, 5], seed=5)
    for ids in sequences:
        for p in range(1, len(ids) - 1):
            copies.append([32 if i == p else t for i, t in enumerate(ids)])
            where.append([p])
    seen = []
    shared = esm.EsmModel.repeated_inputs

    def counting(self, ctx):
        out = shared(self, ctx)
        seen.append((ctx.num_tokens, None if out is None else len(out[0])))
        return out

    paths = [(torch.device("cpu"), "auto")] + [(triton_test_device(), "triton")] * (kind == "esm2")
    for device, kernels in paths:
        engine = NativeEngine.load(path, device, torch.float32, "", max_tokens_per_step=100, kernels=kernels)
        monkeypatch.setattr(esm.EsmModel, "repeated_inputs", counting)
        together = engine.logprobs_at(copies, where)
        monkeypatch.setattr(esm.EsmModel, "repeated_inputs", lambda self, ctx: None)
        one_by_one = engine.logprobs_at(copies, where)
        assert torch.equal(together, one_by_one), kernels
    # every step shared rows: 8 copies of 12 tokens have 12 + 8 distinct inputs (with the 8 masks' own)
    assert seen and all(distinct is not None and 2 * distinct <= tokens for tokens, distinct in seen), seen
    assert (96, 20) in seen, seen
    seen.clear()   # steps without masks (an unmasked pass, as wt-marginal runs) do not look for repeats
    monkeypatch.setattr(esm.EsmModel, "repeated_inputs", counting)
    engine.logprobs_at([sequences[0]] * 6, [[1]] * 6)
    assert seen == [(72, None)], seen


def test_distinct_rows_is_numpys_row_unique_either_way():
    from pipeline.models.esm import distinct_rows
    rng = np.random.default_rng(0)
    # ranges 7 x 7 x 7 x 40: one packed int64 key per row; four columns of up to 2^40: too wide to pack (2^160)
    for highs in ((7, 7, 7, 40), (2 ** 40,) * 4):
        columns = [rng.integers(0, high, 500) for high in highs]
        for c in columns:
            c[250:] = c[:250]
        assert (np.prod([float(c.max()) + 1 for c in columns]) < 2.0 ** 62) == (highs[0] == 7)
        first, inverse = distinct_rows(columns)
        rows = np.stack(columns, axis=1)
        unique = np.unique(rows, axis=0)
        assert len(first) == len(unique) <= 250
        assert (rows[first][inverse] == rows).all()
        assert (first == np.array([np.flatnonzero((rows == r).all(1))[0] for r in rows[first]])).all()
