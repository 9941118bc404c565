"""The real CLI on real FASTA with real worker processes, checked against transformers computed directly.

Tolerances: the reference runs one unpadded sequence at a time, in float64 throughout (the exact values)
and in float32. The CLI's float32 columns must be as accurate as transformers' float32 ones: at most
FACTOR times their error against float64 plus FLOOR (tests/float64_reference.py). Comparing two float32
results directly would measure both roundings, which depend on the CPU's kernels.
"""
import datetime
import os
import re
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
import torch

from index import SequenceIndex

from .conftest import SHARED_DATA
from .float64_reference import assert_as_accurate, float64_everywhere
from .run_helpers import suggested_commands
from .tiny_models import REPO, run_cli, save_esm, save_gpt2

FASTA = [str(SHARED_DATA / "protein_lib.fa"), str(SHARED_DATA / "ncbi_standard_aa.fasta")]


def direct(model_dir: str, sequences: list[str], layers=(-1,), pools=("mean",), causal_scores=False,
           dtype=torch.float32):
    """Per-sequence transformers outputs, one unpadded sequence at a time."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = (AutoModelForCausalLM if causal_scores else AutoModel).from_pretrained(model_dir, dtype=dtype).eval()
    rows = []
    for seq in sequences:
        enc = tok(seq, return_tensors="pt", return_special_tokens_mask=True)
        ids, special = enc["input_ids"], enc["special_tokens_mask"][0].bool()
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
        row = {"num_tokens": ids.shape[1]}
        if causal_scores:
            logp = torch.log_softmax(out.logits[0].double(), -1)
            tl = logp[:-1].gather(-1, ids[0, 1:, None])[:, 0]
            scored = ~special[1:]
            row["logprob_sum"] = float(tl[scored].sum())
            row["num_scored"] = int(scored.sum())
        else:
            for layer in layers:
                h = out.last_hidden_state[0] if layer == -1 else out.hidden_states[layer][0]
                for pool in pools:
                    v = {"mean": h[~special].mean(0), "cls": h[0], "last": h[-1]}[pool]
                    row[(pool, layer)] = v.numpy()
                if layer == -1:
                    row["per_residue"] = h[~special].numpy()
        rows.append(row)
    return rows


def exact_and_float32(model_dir: str, sequences: list[str], **kwargs):
    """direct()'s rows in float64 throughout (the exact values) and in float32 (the error to match)."""
    with float64_everywhere():
        exact = direct(model_dir, sequences, dtype=torch.float64, **kwargs)
    return exact, direct(model_dir, sequences, **kwargs)


def column(rows, key) -> np.ndarray:
    return np.stack([r[key] for r in rows])


def read(path):
    with h5py.File(path) as f:
        return {k: f[k][:] for k in _datasets(f)}, dict(f.attrs)


def _datasets(f):
    names = []
    f.visit(lambda n: names.append(n) if isinstance(f[n], h5py.Dataset) else None)
    return names


def check_base_columns(data, index: SequenceIndex, num_tokens):
    assert [i.decode() for i in data["ids"]] == index.ids()
    assert data["index"].tolist() == list(range(len(index)))
    assert data["lengths"].tolist() == index.lengths.tolist()
    assert data["num_tokens"].tolist() == num_tokens
    assert not data["truncated"].any() and not data["status"].any()


@pytest.mark.parametrize("name", ["demo", "llama", "qwen3"])
def test_embed_two_workers_matches_transformers(models, tmp_path, name):
    out = tmp_path / "out"
    began = time.time()
    res = run_cli(*FASTA, "--out", str(out), "--model", models[name], "--gpus", "0", "--workers", "2",
                  "--max-tokens-per-batch", "1500", "--no-progress")
    assert res.returncode == 0, res.stderr
    # The time split counts from the command's start: Python's and torch's imports before run.log's first line
    # (seconds on a GPU machine) are the command's too, so its total is what the user waited until that line.
    line = [x for x in (out / "logs" / "run.log").read_text().splitlines() if " INFO timings: " in x][-1]
    logged = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    total = float(re.search(r"; total ([\d.]+) s,", line)[1])
    assert logged - began - 0.5 <= total <= logged - began + 0.1, line
    assert f"result: {out / 'result.h5'}" in res.stdout
    index = SequenceIndex.build(FASTA)
    data, attrs = read(out / "result.h5")
    ref, ref32 = exact_and_float32(models[name], [index.sequence(i) for i in range(len(index))])
    check_base_columns(data, index, [r["num_tokens"] for r in ref])
    assert_as_accurate(data["embeddings/mean"], column(ref32, ("mean", -1)), column(ref, ("mean", -1)), "mean")
    assert attrs["complete"] and attrs["task"] == "embed" and attrs["num_sequences"] == len(index)
    for rank in (0, 1):
        log = (out / "logs" / f"worker_{rank}.log").read_text()
        assert "shard complete" in log
        assert "float denormals flushed to zero" in log   # set before the worker's first torch op
        assert "malloc keeps freed memory for reuse" in log
    assert (out / "logs" / "run.log").exists()


def test_esm_pools_layers_and_per_residue(models, tmp_path):
    out = tmp_path / "out"
    res = run_cli(*FASTA, "--out", str(out), "--model", models["esm"], "--gpus", "0", "--workers", "2",
                  "--pool", "mean,cls,last", "--layers", "-1,1,2", "--per-residue", "--per-residue-dtype", "float32",
                  "--no-progress")
    assert res.returncode == 0, res.stderr
    assert "--pool cls with" not in res.stderr   # an encoder's first token, <cls>, sees the whole sequence
    # -1 and 2 of this 2-layer model are one hidden state: one column, and the user told so
    assert "--layers -1 and 2 name the same hidden state of this 2-layer model: one column holds it" in res.stderr
    index = SequenceIndex.build(FASTA)
    data, _ = read(out / "result.h5")
    ref, ref32 = exact_and_float32(models["esm"], [index.sequence(i) for i in range(len(index))], layers=(-1, 1),
                                   pools=("mean", "cls", "last"))
    check_base_columns(data, index, [r["num_tokens"] for r in ref])
    for pool in ("mean", "cls", "last"):
        assert_as_accurate(data[f"embeddings/{pool}"], column(ref32, (pool, -1)), column(ref, (pool, -1)), pool)
        assert_as_accurate(data[f"embeddings/{pool}_layer1"], column(ref32, (pool, 1)), column(ref, (pool, 1)),
                           f"{pool}_layer1")
    offsets = data["per_residue/offsets"]
    assert offsets[0] == 0 and np.array_equal(np.diff(offsets), index.lengths)
    assert_as_accurate(data["per_residue/values"], np.concatenate([r["per_residue"] for r in ref32]),
                       np.concatenate([r["per_residue"] for r in ref]), "per_residue")


@pytest.mark.parametrize("name", ["demo", "qwen3"])
def test_cls_of_a_causal_lm_is_told_to_be_its_first_token_alone(models, tmp_path, name):
    """A causal LM's first token attends to itself only: `cls` is the same vector for every sequence where the
    tokenizer puts <bos> first (the demo model, as README's first example ran it) and for every sequence beginning
    with the same residue where it puts none (Qwen3). It was stored without a word; planning now warns, once."""
    out = tmp_path / "out"
    res = run_cli(FASTA[0], "--out", str(out), "--model", models[name], "--gpus", "0", "--workers", "1",
                  "--pool", "mean,cls,last", "--layers", "0,-1", "--no-progress")
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("--pool cls with") == 1 and "a causal LM computes the first token" in res.stderr, res.stderr
    assert "`last` (the final token's state, computed from the whole sequence) or `mean`" in res.stderr
    data, _ = read(out / "result.h5")
    index = SequenceIndex.build(FASTA[:1])
    first = np.array([index.sequence(i)[0] for i in range(len(index))])
    for column in ("embeddings/cls", "embeddings/cls_layer0"):
        cls = data[column]
        # the same vector wherever the first token is: every row, or (Qwen3) the rows beginning with M
        same = first == "M" if name == "qwen3" else np.ones(len(first), bool)
        assert 1 < same.sum() < len(first) + (name == "demo") and (cls[same] == cls[same][0]).all(), column
    assert len(np.unique(data["embeddings/last"], axis=0)) == len(first)


@pytest.mark.parametrize("name", ["demo", "llama"])
def test_score_matches_transformers(models, tmp_path, name):
    out = tmp_path / "out"
    res = run_cli(*FASTA, "--out", str(out), "--model", models[name], "--task", "score", "--gpus", "0",
                  "--workers", "2", "--no-progress")
    assert res.returncode == 0, res.stderr
    index = SequenceIndex.build(FASTA)
    data, attrs = read(out / "result.h5")
    ref, ref32 = exact_and_float32(models[name], [index.sequence(i) for i in range(len(index))], causal_scores=True)
    assert attrs["task"] == "score"
    assert data["score/num_scored"].tolist() == [r["num_scored"] for r in ref] == index.lengths.tolist()
    assert_as_accurate(data["score/logprob_sum"], column(ref32, "logprob_sum"), column(ref, "logprob_sum"),
                       "logprob_sum")


def test_score_with_a_bare_encoder_is_a_clear_error(models, tmp_path):
    """A masked LM scores (tests/test_scoring.py); an encoder saved without its LM head cannot: refused
    before any work, once, naming what would score, with no --out left behind."""
    from transformers import AutoConfig, EsmModel, EsmTokenizer
    bare = tmp_path / "esm_bare"
    EsmModel(AutoConfig.from_pretrained(models["esm"])).eval().save_pretrained(bare)
    EsmTokenizer.from_pretrained(models["esm"]).save_pretrained(bare)
    res = run_cli(FASTA[0], "--out", str(tmp_path / "o"), "--model", str(bare), "--task", "score",
                  "--gpus", "0", "--no-progress")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.count("--task score needs a language model with its head") == 1
    assert "(EsmModel) is neither" in res.stderr and "EsmForMaskedLM" in res.stderr
    assert not (tmp_path / "o").exists()


def test_long_sequence_policies(tmp_path):
    model = save_esm(tmp_path / "esm_short", model_max_length=40)   # 38 residues + <cls> + <eos>
    fasta = FASTA[1]
    index = SequenceIndex.build([fasta])
    long = [index.id(i) for i in range(len(index)) if index.lengths[i] > 38]
    assert long
    res = run_cli(fasta, "--out", str(tmp_path / "e"), "--model", str(model), "--gpus", "0", "--no-progress")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"{len(long)} sequence(s) exceed the model's limit of 40 tokens" in res.stderr
    assert all(i in res.stderr for i in long) and "--on-long truncate" in res.stderr
    assert not (tmp_path / "e" / "shards").exists() or not any((tmp_path / "e" / "shards").iterdir())

    res = run_cli(fasta, "--out", str(tmp_path / "t"), "--model", str(model), "--gpus", "0", "--on-long",
                  "truncate", "--no-progress")
    assert res.returncode == 0, res.stderr
    data, _ = read(tmp_path / "t" / "result.h5")
    cut = index.lengths > 38
    assert data["truncated"].tolist() == cut.tolist()
    assert (data["num_tokens"][cut] == 40).all()
    ref, ref32 = exact_and_float32(str(model), [index.sequence(i)[:38] for i in range(len(index))])
    assert_as_accurate(data["embeddings/mean"], column(ref32, ("mean", -1)), column(ref, ("mean", -1)), "mean")

    res = run_cli(fasta, "--out", str(tmp_path / "s"), "--model", str(model), "--gpus", "0", "--on-long",
                  "skip", "--no-progress")
    assert res.returncode == 0, res.stderr
    data, _ = read(tmp_path / "s" / "result.h5")
    assert data["status"].tolist() == [1 if c else 0 for c in cut]
    assert np.isnan(data["embeddings/mean"][cut]).all() and not np.isnan(data["embeddings/mean"][~cut]).any()
    assert (data["num_tokens"][cut] == 0).all()

    res = run_cli(fasta, "--out", str(tmp_path / "n"), "--model", str(model), "--gpus", "0", "--on-long",
                  "truncate", "--max-length", "2", "--no-progress")   # <cls> + <eos> and no residue
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--max-length of 2 tokens leaves no room for residues" in res.stderr


def test_gpt2_learned_positions_limit_and_score(tmp_path):
    """GPT-2 on the hf engine: its 128-position table is a hard limit found before any work (transformers 5
    configs no longer say `position_embedding_type`), and it scores as the causal LM it is."""
    model = save_gpt2(tmp_path / "gpt2", n_positions=128)
    fasta = FASTA[0]
    index = SequenceIndex.build([fasta])
    long = [index.id(i) for i in range(len(index)) if index.lengths[i] + 2 > 128]
    assert long and len(long) < len(index)
    res = run_cli(fasta, "--out", str(tmp_path / "e"), "--model", str(model), "--gpus", "0", "--no-progress")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"{len(long)} sequence(s) exceed the model's limit of 128 tokens" in res.stderr
    res = run_cli(fasta, "--out", str(tmp_path / "s"), "--model", str(model), "--gpus", "0", "--task", "score",
                  "--on-long", "skip", "--no-progress")
    assert res.returncode == 0, res.stderr
    data, attrs = read(tmp_path / "s" / "result.h5")
    assert attrs["engine"] == "hf"
    fits = index.lengths + 2 <= 128
    ref, ref32 = exact_and_float32(str(model), [index.sequence(i) for i in np.flatnonzero(fits)], causal_scores=True)
    assert_as_accurate(data["score/logprob_sum"][fits], column(ref32, "logprob_sum"), column(ref, "logprob_sum"),
                       "logprob_sum")
    assert data["status"].tolist() == [0 if f else 1 for f in fits]


def test_duplicate_ids_refused_then_renamed(tmp_path, models):
    dups = str(SHARED_DATA / "dups.fasta")
    res = run_cli(dups, "--out", str(tmp_path / "a"), "--model", models["demo"], "--gpus", "0", "--no-progress")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "duplicate sequence id" in res.stderr and "'alpha'" in res.stderr and "dups.fasta:1" in res.stderr \
        and "dups.fasta:10" in res.stderr
    (suggested,) = suggested_commands(res.stderr)               # the same run with --on-duplicate-id rename
    assert suggested[suggested.index("--on-duplicate-id") + 1] == "rename", suggested
    res = run_cli(*suggested)
    assert res.returncode == 0, res.stderr
    data, _ = read(tmp_path / "a" / "result.h5")
    assert [i.decode() for i in data["ids"]] == ["alpha", "beta", "gamma", "alpha.dup2", "delta"]
    assert data["original_ids/index"].tolist() == [3] and data["original_ids/ids"].tolist() == [b"alpha"]
    # Duplicates and an empty record: the command suggested for the duplicates handles both (it named only
    # --on-duplicate-id rename, and then stopped at the empty record, suggesting a third command)
    both = tmp_path / "both.fasta"
    both.write_bytes(b">a\nMKV\n>b\n>a\nMKVL\n>a\nMK\n")
    res = run_cli(str(both), "--out", str(tmp_path / "b"), "--model", models["demo"], "--gpus", "0", "--no-progress")
    assert res.returncode == 2 and f"1 record(s) have no residues as well ({both}:3 'b')" in res.stderr, res.stderr
    assert "1 duplicate sequence id(s) in the input, on 3 records: 'a' at" in res.stderr   # (ids, not repeats)
    (suggested,) = suggested_commands(res.stderr)
    assert "--skip-empty" in suggested and "rename" in suggested, suggested
    res = run_cli(*suggested)
    assert res.returncode == 0, res.stderr
    data, _ = read(tmp_path / "b" / "result.h5")
    assert [i.decode() for i in data["ids"]] == ["a", "b", "a.dup2", "a.dup3"]
    assert data["status"].tolist() == [0, 3, 0, 0]


def test_bad_fasta_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.fasta"
    bad.write_bytes(b"MKV\n>a\nAC\n")
    res = run_cli(str(bad), "--out", str(tmp_path / "o"), "--gpus", "0", "--no-progress")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"{bad}:1: sequence data before the first header" in res.stderr
    res = run_cli(str(tmp_path / "missing.fasta"), "--out", str(tmp_path / "o2"), "--gpus", "0")
    assert res.returncode == 2 and "file not found" in res.stderr and "Traceback" not in res.stderr


def test_index_and_status_commands(models, tmp_path):
    res = run_cli("index", *FASTA, "--workers", "3")
    assert res.returncode == 0, res.stderr
    index = SequenceIndex.build(FASTA)
    assert f"records: {len(index):,}" in res.stdout and f"residues: {index.total_residues:,}" in res.stdout
    assert "max/mean tokens" in res.stdout and "worker 2:" in res.stdout
    out = tmp_path / "o"
    assert run_cli(FASTA[1], "--out", str(out), "--model", models["demo"], "--gpus", "0", "--no-progress").returncode == 0
    res = run_cli("status", str(out))
    assert res.returncode == 0 and "complete" in res.stdout and "result:" in res.stdout
    res = run_cli("status", str(tmp_path / "nothing"))
    assert res.returncode == 2 and "no such run directory" in res.stderr


def test_parent_never_initialises_cuda(tmp_path, models):
    """Any CUDA initialisation in the parent raises; the workers are fresh processes and unaffected."""
    script = tmp_path / "guard.py"
    script.write_text(f"""
import sys
sys.path.insert(0, {str(REPO)!r})
import torch, torch.cuda
def refuse(*a, **k):
    raise AssertionError("the parent initialised CUDA")
torch.cuda._lazy_init = refuse
torch.cuda.init = refuse
torch._C._cuda_init = refuse
if __name__ == "__main__":   # spawned workers re-import this module; only the parent runs the CLI
    sys.argv = ["run_shards", {FASTA[1]!r}, "--out", {str(tmp_path / 'o')!r}, "--model", {models['demo']!r},
                "--gpus", "auto", "--no-progress"]
    from pipeline.cli import main
    try:
        main()
    except SystemExit:
        assert not torch.cuda.is_initialized()
        print("cuda initialised:", torch.cuda.is_initialized())
        raise
""")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "cuda initialised: False" in res.stdout and "result:" in res.stdout


def _wait_for(predicate, timeout=120.0):
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_killed_worker_others_finish_and_rerun_equals_uninterrupted(fasta, common, reference, tmp_path):
    from .run_helpers import assert_same, read as read_all
    # Worker 1 is SIGKILLed while writing its second checkpoint (the fault hook kills it from inside at that
    # instant, which no outside timing can hit reliably; test_interruptions kills workers from outside).
    out = tmp_path / "killed"
    res = run_cli(fasta, "--out", str(out), *common, env={"RUN_SHARDS_FAULT_DIE_AT": "part-written",
                                                           "RUN_SHARDS_FAULT_DIE_SHARD": "1",
                                                           "RUN_SHARDS_FAULT_DIE_AFTER": "1"})
    stderr = res.stderr
    log1 = out / "logs" / "worker_1.log"
    assert res.returncode == 1
    assert "shard 1 failed: killed by SIGKILL" in stderr and f"run_shards rerun {out} --shards 1" in stderr
    assert (out / "shards" / "shard_0.h5").exists() and not (out / "result.h5").exists()
    status = run_cli("status", str(out)).stdout
    assert "failed" in status and "complete" in status
    # Reading it before it is merged names the commands that merge it; each works (a plain `merge` was named,
    # which refuses while a shard is unfinished).
    got = run_cli("get", str(out), "anything")
    assert got.returncode == 2 and f"{out} holds no result.h5 yet" in got.stderr, got.stderr
    suggested = suggested_commands(got.stderr)
    assert suggested == [["status", str(out)], ["rerun", str(out)], ["merge", str(out), "--allow-partial"]]
    partial = run_cli(*suggested[2])
    assert partial.returncode == 0 and "partial result" in partial.stderr, partial.stderr

    res = run_cli(*suggested[1], "--no-progress")
    assert res.returncode == 0, res.stderr
    assert "resuming:" in log1.read_text()
    assert_same(read_all(out / "result.h5"), reference)    # the other shard and the resumed one: as uninterrupted


def test_readme_example_reads_what_the_run_wrote(models, tmp_path):
    """The README's h5py snippet, run as written (path and id substituted), finds the right row."""
    out = tmp_path / "out"
    res = run_cli(FASTA[0], "--out", str(out), "--model", models["demo"], "--gpus", "0", "--per-residue",
                  "--no-progress")
    assert res.returncode == 0, res.stderr
    readme = (REPO / "README.md").read_text()
    (snippet,) = [b.split("```", 1)[0] for b in readme.split("```python\n")[1:] if "np.flatnonzero(ids ==" in b]
    assert 'h5py.File("demo_out/result.h5")' in snippet and '"SYN000000042"' in snippet
    assert ">SYN000000042 " in (REPO / "examples" / "demo.fasta").read_text()   # make demo's output has it
    index = SequenceIndex.build([FASTA[0]])
    wanted = index.id(5)
    scope = {}
    exec(snippet.replace("demo_out/result.h5", str(out / "result.h5")).replace("SYN000000042", wanted), scope)
    data, _ = read(out / "result.h5")
    assert scope["row"] == 5
    assert np.array_equal(scope["vector"], data["embeddings/mean"][5])
    assert scope["residues"].shape == (index.lengths[5], data["embeddings/mean"].shape[1])


def test_unknown_hub_model_is_a_clear_error(tmp_path):
    res = run_cli(FASTA[0], "--out", str(tmp_path / "o"), "--model", "no-such-org/no-such-model", "--gpus", "0",
                  env={"HF_HUB_OFFLINE": "1"})
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--model no-such-org/no-such-model: not a local directory" in res.stderr


def test_model_limits_read_from_checkpoints(models, tmp_path):
    """Hard limits (a learned position table, the tokenizer's maximum) and the soft trained context of
    rotary models, as the parent reads them from config and tokenizer alone."""
    from pipeline.models import checkpoint as model_source
    from index.cache import cache_dir

    def describe(path):
        return model_source.describe(model_source.resolve(str(path), cache_dir()), "hf")

    llama = describe(models["llama"])            # rotary, 4096 trained positions, tokenizer max 100000
    assert llama.max_tokens == 100000 and llama.extra["trained_context"] == 4096 and llama.is_causal
    esm = describe(models["esm"])                # rotary; the tokenizer's 1024 is the hard limit
    assert esm.max_tokens == 1024 and "trained_context" not in esm.extra and not esm.is_causal
    gpt2 = describe(save_gpt2(tmp_path / "gpt2", n_positions=96))
    assert gpt2.max_tokens == 96 and gpt2.is_causal
