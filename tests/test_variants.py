"""`--task variants`: masked marginals (single and multi-mutants) and wild-type marginals on an ESM-2-style
masked LM, llr on a causal LM, through the real CLI with 2 CPU workers against transformers by hand
(tests/scoring_reference.py, float64-grounded bounds); the variants table in file order and its CSV; a single
mutant's masked marginal as one subtraction from the pseudo-log-likelihood's per-residue table; every bad
variants file refused before any compute, naming file and line; the merge's strictness; the SLURM and Ray
launchers giving the local runs' bits (variants with their CSV, and the pll with its per-residue table), and
`status` and report.html saying what such a run computed."""
from __future__ import annotations

import csv
import html
import re
import shutil

import h5py
import numpy as np
import pytest
import torch

from index import SequenceIndex
from pipeline.config import RunConfig
from pipeline.errors import MergeError, UserError
from pipeline.output import variants as variants_table
from pipeline.output.variant_list import VariantList
from pipeline.planning.variants_file import read_variants

from . import scoring_reference as ref
from .float64_reference import assert_as_accurate
from .run_helpers import raw_datasets, skip_or_fail, status_rows, undocumented_files, undocumented_in_schema
from .slurm_helpers import SLURM_LAYOUT, html_cells, job_ids, wait_finished
from .tiny_models import run_cli, save_esm, save_llama

pytestmark = pytest.mark.slow

SEQUENCES = {
    "P1": "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQ",
    "P2": "ACDEFGHIKLMNPQRSTVWY",
    "P3": "MSGKPVLHYFNJRGRMECIRWLLAAAG",     # J: no ESM token (status 2)
    "P4": "GSHMKT",
    "P5": "MVLSPADKTNVKAAWGKVGAHAGEYGAEALERMFLSFPTTKTYFPHFDLSHGSAQVKGHGKKVADALTNAVAHVD",   # over --max-length
}
VARIANTS = """id,mutant,score
P2,A1C,0.1
P1,M1A,0.2
P2,C2W:D3E,0.3
P1,K2R,
P2,A1G,0.5
P1,K2A:T3S:A4G,0.6
P5,M1A,0.7
P2,D3E:C2W,0.8
P3,M1K,0.9
P1,K2W,1.0
"""
ROWS = [line.split(",")[:2] for line in VARIANTS.strip().splitlines()[1:]]
COMMON = ("--gpus", "0", "--workers", "2", "--max-tokens-per-batch", "256", "--on-long", "skip", "--max-length", "64",
          "--no-progress")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    (root / "proteins.fasta").write_text("".join(f">{k}\n{v}\n" for k, v in SEQUENCES.items()))
    (root / "variants.csv").write_text(VARIANTS)
    return root


@pytest.fixture(scope="module")
def esm(tmp_path_factory) -> str:
    return str(save_esm(tmp_path_factory.mktemp("esm") / "esm2_style"))


def run(inputs, out, model: str, *extra: str, env: dict | None = None):
    res = run_cli(str(inputs / "proteins.fasta"), "--out", str(out), "--model", model, "--task", "variants",
                  "--variants", str(inputs / "variants.csv"), *COMMON, *extra, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def table(result) -> dict:
    with h5py.File(result) as f:
        g = f["variants"]
        return {k: (g[k].asstr()[:] if g[k].dtype.kind == "O" else g[k][:]) for k in g}


@pytest.fixture(scope="module")
def masked_run(inputs, esm, tmp_path_factory):
    out = tmp_path_factory.mktemp("masked") / "out"
    csv_out = out.parent / "scores.csv"
    run(inputs, out, esm, "--variants-out", str(csv_out))
    return out, csv_out


def test_masked_and_wt_marginals_match_transformers_by_hand_in_file_order(masked_run, esm):
    out, csv_out = masked_run
    got = table(out / "result.h5")
    assert got["row"].tolist() == list(range(len(ROWS)))
    assert got["id"].tolist() == [r[0] for r in ROWS] and got["mutant"].tolist() == [r[1] for r in ROWS]
    assert got["status"].tolist() == [2 if i == "P3" else 1 if i == "P5" else 0 for i, _ in ROWS]
    scored = [k for k, (i, _) in enumerate(ROWS) if i != "P5"]
    assert np.isnan(got["masked_marginal"][[ROWS.index(["P5", "M1A"])]]).all()
    theirs = [ref.marginals(esm, SEQUENCES[i], m, exact=False) for i, m in np.array(ROWS)[scored]]
    exact = [ref.marginals(esm, SEQUENCES[i], m, exact=True) for i, m in np.array(ROWS)[scored]]
    for k, name in enumerate(("masked_marginal", "wt_marginal")):
        assert_as_accurate(got[name][scored], [t[k] for t in theirs], [e[k] for e in exact], name)
    # the same position set written in another order is the same pass, and the same number
    assert got["masked_marginal"][2] == got["masked_marginal"][7]
    with open(csv_out, newline="") as fh:
        lines = list(csv.reader(fh))
    assert lines[0] == ["id", "mutant", "masked_marginal", "wt_marginal", "status"]
    for k, line in enumerate(lines[1:]):
        assert line[:2] == ROWS[k] and int(line[4]) == got["status"][k]
        assert (line[2] == "") if np.isnan(got["masked_marginal"][k]) else float(line[2]) == got["masked_marginal"][k]
    # One wild-type pass per record with variants, and one masked pass per distinct set of positions.
    passes = {"P1": 1 + 3, "P2": 1 + 2, "P3": 1 + 1}   # P1: {1} {2} {2,3,4}; P2: {1} {2,3}; P3: {1}
    expected = sum((len(SEQUENCES[i]) + 2) * n for i, n in passes.items())
    logged = [re.search(r"shard complete: \S+ \(\d+ sequences, (\d+) tokens", (out / "logs" / f"worker_{r}.log")
                        .read_text()) for r in (0, 1)]
    assert sum(int(m[1]) for m in logged) == expected
    assert undocumented_files(out) == [] and undocumented_in_schema(out / "result.h5") == []


def test_a_changed_variants_file_is_refused_when_the_run_continues(masked_run, inputs, esm, tmp_path):
    out, _ = masked_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    edited = tmp_path / "variants.csv"
    edited.write_text(VARIANTS.replace("P1,K2R,", "P1,K2E,"))
    manifest = (copy / "manifest.json").read_text().replace(str(inputs / "variants.csv"), str(edited))
    (copy / "manifest.json").write_text(manifest)
    res = run_cli(str(inputs / "proteins.fasta"), "--out", str(copy), "--model", esm, "--task", "variants",
                  "--variants", str(edited), "--variants-out", str(out.parent / "scores.csv"), *COMMON)
    assert res.returncode == 2 and "variants file content" in res.stderr, res.stderr[-2000:]


def test_llr_on_a_causal_lm_matches_transformers_by_hand(inputs, tmp_path):
    llama = str(save_llama(tmp_path / "llama"))
    run(inputs, tmp_path / "out", llama)
    got = table(tmp_path / "out" / "result.h5")
    assert sorted(got) == ["id", "llr", "mutant", "row", "status"]
    scored = [k for k, (i, _) in enumerate(ROWS) if i != "P5"]

    def llr(i, m, exact):
        return (ref.causal_log_likelihood(llama, ref.mutated(SEQUENCES[i], m), exact)
                - ref.causal_log_likelihood(llama, SEQUENCES[i], exact))
    assert_as_accurate(got["llr"][scored], [llr(i, m, False) for i, m in np.array(ROWS)[scored]],
                       [llr(i, m, True) for i, m in np.array(ROWS)[scored]], "llr")


def test_a_single_mutants_masked_marginal_is_one_subtraction_from_the_pll_table(esm, tmp_path):
    """The pseudo-log-likelihood's per-residue table holds, at each position, the masked copy's log-probabilities
    of the 20 amino acids: table[p, mutant] - table[p, wild type] is the single mutant's masked marginal (up to
    the table's float32 rounding)."""
    from pipeline.engine.native import NativeEngine
    from pipeline.tasks import make_task
    from pipeline.tasks.tokenization import SequenceTokenizer

    seq = SEQUENCES["P2"]
    fasta = tmp_path / "p2.fasta"
    fasta.write_text(f">P2\n{seq}\n")
    singles = [f"{w}{p}{m}" for p, w in enumerate(seq, 1) for m in ref.AMINO_ACIDS]
    VariantList(np.zeros(len(singles), np.int64), singles).save(tmp_path / "variants.npz")
    engine = NativeEngine.load(esm, torch.device("cpu"), torch.float32, "x")
    tokenizer = SequenceTokenizer(engine.tokenizer)
    toks = tokenizer.encode([seq])
    pll = make_task(RunConfig(fasta=[str(fasta)], task="score", per_residue=True), engine.info)
    variants = make_task(RunConfig(fasta=[str(fasta)], task="variants", variants="v.csv"), engine.info, tmp_path)
    pll.prepare(tokenizer)
    variants.prepare(tokenizer)
    scan = pll.run(engine, toks, np.zeros(1, np.int64)).values["per_residue/amino_acids"]
    mm = variants.run(engine, toks, np.zeros(1, np.int64)).values["variant_scores/masked_marginal"]
    col = {a: i for i, a in enumerate(ref.AMINO_ACIDS)}
    subtraction = np.array([scan[int(v[1:-1]) - 1, col[v[-1]]].astype(np.float64) - scan[int(v[1:-1]) - 1, col[v[0]]]
                            for v in singles])
    np.testing.assert_allclose(subtraction, mm, rtol=0, atol=4 * 2.0 ** -24 * np.abs(scan).max())
    assert np.abs(mm).max() > 0.01


BAD_FILES = {
    "wt.csv": ("id,mutant\nP2,A1C\nP2,C1A\n", "line 3: C1A: wild type C does not match 'P2', whose residue 1 is A"),
    "outside.csv": ("id,mutant\nP4,M4A:G7A\n", "line 2: G7A: position 7 is outside 'P4', which has 6 residue(s)"),
    "unknown.tsv": ("mutant\tid\nA1C\tP2\nA1C\tQ9\n", "line 3: id 'Q9' is not in the FASTA input"),
    "malformed.csv": ("id,mutant\nP2,A1\n", "line 2: malformed mutant: 'A1' is not a substitution"),
    "zero.csv": ("id,mutant\nP2,A0C\n", "line 2: malformed mutant: 'A0C': positions start at 1"),
    "twice.csv": ("id,mutant\nP2,A1C:A1D\n", "line 2: malformed mutant: 'A1C:A1D' changes position 1 twice"),
    "letter.csv": ("id,mutant\nP2,A1B\n", "line 2: malformed mutant: 'A1B': B is not one of the 20 standard"),
    "emptymut.csv": ("id,mutant\nP2,\n", "line 2: malformed mutant: the mutant is empty"),
    "short.csv": ("id,x,mutant\nP2\n", "line 2: 1 field(s), fewer than the header's id and mutant columns"),
    "empty.csv": ("", "the file is empty"),
    "header.csv": ("id,mutant\n\n", "no variants (only a header)"),
    "columns.csv": ("name,mutation\nP2,A1C\n", "line 1: the header has no id or mutant column"),
    # a header naming a column twice (read before: the last of them, silently)
    "twice_named.csv": ("id,Mutant,mutant \nP2,A1C,A1D\n", "line 1: the header names the mutant column more than once"),
    # lines numbered as an editor numbers them: a quoted field across two lines, a form feed inside a line
    "quoted_note.csv": ('id,mutant,note\nP2,A1C,"two\nlines"\nP2,C1A,x\n',
                        "line 4: C1A: wild type C does not match 'P2', whose residue 1 is A"),
    "form_feed.csv": ("id,mutant,note\nP2,A1C,page\fbreak\nP2,C1A,x\n",
                      "line 3: C1A: wild type C does not match 'P2', whose residue 1 is A"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_every_bad_variants_file_is_refused_naming_file_and_line(name, inputs, tmp_path):
    text, message = BAD_FILES[name]
    path = tmp_path / name
    path.write_text(text)
    with SequenceIndex.build([inputs / "proteins.fasta"]) as index, pytest.raises(UserError) as e:
        read_variants(str(path), index)
    assert str(path) in str(e.value) and message in str(e.value), str(e.value)


def test_bad_input_stops_the_cli_before_any_compute(inputs, esm, tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_bytes(b"id,mutant\nP2,A1C\nP9,A1C\nP2,\xff1C\n")
    out = tmp_path / "out"
    res = run_cli(str(inputs / "proteins.fasta"), "--out", str(out), "--model", esm, "--task", "variants",
                  "--variants", str(bad), "--gpus", "0")
    assert res.returncode == 2 and "not UTF-8 text" in res.stderr and str(bad) in res.stderr
    assert not out.exists()   # refused while planning: --out left as it was
    bad.write_text("id,mutant\nP2,A1C\nP9,A1C\nP2,K1C\n")
    res = run_cli(str(inputs / "proteins.fasta"), "--out", str(out), "--model", esm, "--task", "variants",
                  "--variants", str(bad), "--gpus", "0")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"{bad}, line 3: id 'P9'" in res.stderr and f"{bad}, line 4: K1C" in res.stderr
    for args, message in (((), "--task variants needs --variants FILE"),
                          (("--variants", str(bad), "--on-long", "truncate"), "--on-long truncate is not available"),
                          (("--variants", str(inputs / "variants.csv"), "--variants-out", str(tmp_path / "no" / "x.csv")),
                           "does not exist")):
        res = run_cli(str(inputs / "proteins.fasta"), "--out", str(out), "--model", esm, "--task", "variants", *args)
        assert res.returncode == 2 and message in res.stderr, res.stderr[-2000:]


def test_the_merge_refuses_variants_that_are_not_the_files_each_exactly_once(tmp_path):
    variants = VariantList(np.array([1, 0, 1, 1], np.int64), ["A1C", "A1D", "A1E", "A1F"])
    positions, status = np.array([0, 1]), np.array([0, 0], np.int8)
    offsets = np.array([0, 1, 4])
    variants_table._check(variants, positions, status, offsets, np.array([1, 0, 2, 3]))   # as the file has them
    with pytest.raises(MergeError, match="exactly once, in file order"):
        variants_table._check(variants, positions, status, offsets, np.array([1, 2, 0, 3]))
    with pytest.raises(MergeError, match="another number of variants"):
        variants_table._check(variants, positions, status, np.array([0, 1, 3]), np.array([1, 0, 2]))
    # a record without values (skipped) holds none, and its variants are not expected among the values
    variants_table._check(variants, positions, np.array([0, 1], np.int8), np.array([0, 1, 1]), np.array([1]))


# On the cluster launchers: the same bits as the local runs (the variants table and its CSV, the pll and its
# per-residue table), and `status` and report.html saying what ran: the task and its method, the rows and the
# variants by status, and the tokens the engine computed (a pll's masked copies).
VARIANT_STATUSES = {0: 8, 1: 1, 2: 1}   # P5's variant skipped (too long), P3's computed with J unknown
ROW_STATUSES = {0: 3, 1: 1, 2: 1}


def score(inputs, out, esm: str, *extra: str, env: dict | None = None):
    res = run_cli(str(inputs / "proteins.fasta"), "--out", str(out), "--model", esm, "--task", "score",
                  "--per-residue", *COMMON, *extra, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


@pytest.fixture(scope="module")
def pll_local(inputs, esm, tmp_path_factory):
    out = tmp_path_factory.mktemp("pll") / "out"
    score(inputs, out, esm)
    return out


def assert_launched_like_local(out, local, launcher_extra: set[str] = frozenset()) -> None:
    """result.h5 bitwise the local run's; the run directory holds only what the layout names."""
    assert raw_datasets(out / "result.h5") == raw_datasets(local / "result.h5")
    assert {p for p in undocumented_files(out) if not SLURM_LAYOUT.fullmatch(p)} == set()


def computed_tokens(out) -> list[int]:
    """Each shard's tokens as its worker logged them when it finished (masked copies included)."""
    return [int(re.search(r"shard complete: \S+ \(\d+ sequences, (\d+) tokens", (out / "logs" / f"worker_{r}.log")
                          .read_text())[1]) for r in (0, 1)]


def assert_status_and_report_say_what_ran(out, task_words: str, variants: bool, env: dict) -> None:
    status = run_cli("status", str(out), env=env)
    assert status.returncode == 0, status.stderr
    assert f"\ntask: {task_words}  model: " in status.stdout, status.stdout
    count = f", {sum(VARIANT_STATUSES.values())} variants" if variants else ""
    assert f"result: {out / 'result.h5'} (5 rows{count}, checksums verified)" in status.stdout, status.stdout
    assert {r: row["state"] for r, row in status_rows(out).items()} == {0: "complete", 1: "complete"}
    report = run_cli("report", str(out), env=env)
    assert report.returncode == 0, report.stderr
    page = (out / "report.html").read_text()
    text = re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", page)))
    assert f"task {task_words}, model " in text
    held = f"5 rows and {sum(VARIANT_STATUSES.values())} variants" if variants else "5 rows"
    assert f"finished: {out}/result.h5 holds {held} 5 sequences in 2 shard(s)" in text, text[:600]
    assert {int(row[0]): int(row[2]) for row in html_cells(page, "statuses")} == ROW_STATUSES
    if variants:
        assert {int(row[0]): int(row[2]) for row in html_cells(page, "variant_statuses")} == VARIANT_STATUSES
    else:
        assert "variant_statuses" not in page
    shards = {int(row[0]): row for row in html_cells(page, "shards")}
    assert [int(shards[r][5].replace(",", "")) for r in (0, 1)] == computed_tokens(out)


def test_variants_and_pll_on_slurm_give_the_local_runs_bits_and_status_and_report_say_what_ran(
        masked_run, pll_local, inputs, esm, slurm_cluster, tmp_path):
    """One SLURM submission per task, both queued at once: the merge job writes the variants table and its
    --variants-out CSV from variants.npz, and the pll's per-residue table, as the local runs did."""
    variants_out, pll_out = tmp_path / "variants", tmp_path / "pll"
    slurm = ("--launcher", "slurm", "--shards", "2")
    submitted = [run(inputs, variants_out, esm, "--variants-out", str(tmp_path / "scores.csv"), *slurm,
                     env=slurm_cluster.env),
                 score(inputs, pll_out, esm, *slurm, env=slurm_cluster.env)]
    for res in submitted:
        (array,), merge = job_ids(res.stdout)
        assert wait_finished(slurm_cluster, merge)[merge][0] == "COMPLETED", res.stdout
    assert_launched_like_local(variants_out, masked_run[0])
    assert (tmp_path / "scores.csv").read_bytes() == masked_run[1].read_bytes()
    assert_launched_like_local(pll_out, pll_local)
    assert_status_and_report_say_what_ran(variants_out, f"variants ({sum(VARIANT_STATUSES.values())} from "
                                          f"{inputs / 'variants.csv'}: masked_marginal, wt_marginal)", True,
                                          slurm_cluster.env)
    assert_status_and_report_say_what_ran(pll_out, "score (pll, per residue)", False, slurm_cluster.env)


def test_variants_and_pll_as_ray_tasks_give_the_local_runs_bits(masked_run, pll_local, inputs, esm, tmp_path):
    try:
        import ray  # noqa: F401
    except ImportError as e:
        skip_or_fail(f"ray is not installed ({e}); install the extra: .venv/bin/pip install -e '.[ray]'")
    ray_ = ("--launcher", "ray", "--shards", "2")
    run(inputs, tmp_path / "variants", esm, "--variants-out", str(tmp_path / "scores.csv"), *ray_)
    assert_launched_like_local(tmp_path / "variants", masked_run[0])
    assert (tmp_path / "scores.csv").read_bytes() == masked_run[1].read_bytes()
    score(inputs, tmp_path / "pll", esm, *ray_)
    assert_launched_like_local(tmp_path / "pll", pll_local)
    assert_status_and_report_say_what_ran(tmp_path / "pll", "score (pll, per residue)", False, {})
