"""Batch-invariant outputs (issue #19 part 1): on the native engine on CPU, every stored value is the same
bits whatever the number of workers, the token budget (chunked prefill), torch's thread count and the
other sequences of a batch.

Three levels: the CPU matmul property the design leans on, under MKL's strict CNR mode as workers set it
(tests/conftest.py sets it the same way for this process; checked on the machine that runs the tests),
and what is reported where it cannot be set; the engine's hidden states, log-probabilities and generated
tokens for every native model type under budgets 4,096 / 1,024 / 256, 1 / 2 / 3 threads and other
neighbours, and one ESM-2 650M-sized layer; and the real CLI on the demo model in 1, 2 and 3 shards (on 1, 1
and 2 workers), every task, the result files' datasets compared as raw bytes, with what the workers' logs say.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import torch
import torch.nn.functional as F

from pipeline.engine import mkl_cnr
from pipeline.engine.native import NativeEngine, SamplingParams
from pipeline.models.layers.linear import MIN_ROWS, linear

from .tiny_checkpoints import random_sequences, write_tiny
from .tiny_models import run_cli

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[1]
ENCODERS = ("esm2", "esm1b", "prott5", "ankh")
KINDS = ENCODERS + ("llama", "llama-bias", "qwen3", "qwen3_5")
# Lengths (residues; two special tokens are added) around the 64-token split grid, a few of one to three
# residues, and sequences several budgets long.
LENGTHS = [1, 2, 3, 13, 61, 62, 63, 64, 65, 126, 127, 128, 190, 255, 256, 300, 447, 511, 700, 900, 1000]
# (token budget, torch threads, which sequences in which order): the first is the reference.
CONFIGS = [(4096, 1, "all"), (1024, 2, "reversed"), (256, 3, "odd"), (256, 1, "alone")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariance")
    return {kind: write_tiny(kind, root / kind) for kind in KINDS}


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# The property is claimed only where MKL runs in strict CNR mode and products check out on this CPU
# (engine/mkl_cnr.py); elsewhere (an AMD EPYC, whose MKL stays in its default mode) runs say they are not
# batch-invariant, which tests/test_scoring.py checks, and these tests have no property to hold.
needs_strict_matmuls = pytest.mark.skipif(not mkl_cnr.strict_matmuls().holds, reason=mkl_cnr.strict_matmuls().text)


def _orders(n: int) -> dict[str, list[list[int]]]:
    """Batches of sequence numbers per neighbourhood: all at once, reversed, every other one (twice, so
    each is seen), each alone."""
    every = list(range(n))
    return {"all": [every], "reversed": [every[::-1]], "odd": [every[1::2], every[0::2]],
            "alone": [[i] for i in every]}


@needs_strict_matmuls
def test_cpu_matmul_rows_do_not_depend_on_the_row_count_or_threads(restore_threads):
    """What the engine relies on, in the mode workers run MKL in (set for this process by conftest.py
    through the workers' own call): from MIN_ROWS rows up, each output row of F.linear is the same bits for
    any row count and 1-3 threads, for the tiny models' shapes and real ones (hidden 1,024 and an ESM-2
    650M MLP); fewer rows are padded (MKL's default mode takes another path for them). Without strict
    mode on an Intel CPU, a 1,024 -> 256 product's rows with 2 threads differ from 1 thread's for every
    row count up to 100."""
    mode = mkl_cnr.current()
    assert mode.holds, mode.text
    gen = torch.Generator().manual_seed(0)
    for k, n in ((64, 96), (64, 192), (96, 64), (256, 1024), (1024, 256), (1280, 5120), (5120, 1280)):
        w, x = torch.randn(n, k, generator=gen), torch.randn(600 if k * n < 1 << 20 else 333, k, generator=gen)
        torch.set_num_threads(1)
        reference = F.linear(x, w)
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for m in (m for m in (MIN_ROWS, MIN_ROWS + 1, 23, 64, 100, 333, 600) if m <= len(x)):
                assert torch.equal(F.linear(x[:m], w), reference[:m]), (k, n, threads, m)
            for m in (1, 2, 3, 5, 7, 11):   # padded: the same bits as in a full product
                assert torch.equal(linear(x[:m], w), reference[:m]), (k, n, threads, m)


def test_cpu_element_wise_functions_do_not_depend_on_the_slice_or_threads(restore_threads):
    """triton_kernels/pointwise.py under batch_invariant: every element of a prefix of x is the bits it has
    in x's whole result, at 1-3 threads (aten's tanh GELU splits calls over 16,384 elements its own way)."""
    from triton_kernels import pointwise
    x = 3 * torch.randn(70_001, generator=torch.Generator().manual_seed(1))
    for fn in (pointwise.gelu_tanh, pointwise.gelu, pointwise.silu, pointwise.sigmoid):
        with pointwise.batch_invariant():
            torch.set_num_threads(1)
            reference = fn(x)
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                for n in (63, 16_448, 33_000, 70_001):
                    assert torch.equal(fn(x[:n]), reference[:n]), (fn.__name__, threads, n)


def _forward_rows(path, dtype, budget, threads, batches, batch, layers, logprobs):
    torch.set_num_threads(threads)
    engine = NativeEngine.load(str(path), CPU, dtype, "", max_tokens_per_step=budget, max_seqs=256)
    assert engine.config.batch_invariant
    rows = {}
    for members in batches:
        out = engine.forward([batch[i] for i in members], layers, logprobs)
        cu = out.cu_seqlens.tolist()
        for j, i in enumerate(members):
            a, b = cu[j], cu[j + 1]
            rows[i] = [out.hidden[k][a:b].float().numpy().tobytes() for k in layers]
            if logprobs:
                rows[i].append(out.token_logprobs[a:b].numpy().tobytes())
    return rows


@needs_strict_matmuls
@pytest.mark.parametrize("kind", KINDS)
def test_hidden_states_and_logprobs_are_bitwise_batch_invariant(checkpoints, kind, restore_threads):
    dtype = torch.float32
    causal = kind not in ENCODERS
    lengths = [n for n in LENGTHS if n <= 1000]
    batch = random_sequences(lengths, seed=3)
    layers = [0, 1, 3 if kind != "llama-bias" else 2]
    orders = _orders(len(batch))
    results = {cfg: _forward_rows(checkpoints[kind], dtype, cfg[0], cfg[1], orders[cfg[2]], batch, layers, causal)
               for cfg in CONFIGS}
    reference = results[CONFIGS[0]]
    for cfg, rows in results.items():
        differ = [lengths[i] for i in range(len(batch)) if rows[i] != reference[i]]
        assert not differ, f"{kind} {dtype}: budget {cfg[0]}, {cfg[1]} thread(s), {cfg[2]}: sequences of {differ} residues differ"


@pytest.fixture(scope="module")
def esm2_650m_layer(tmp_path_factory):
    """One ESM-2 650M-sized layer (hidden 1,280, MLP 5,120, 20 heads): the tiny models' products (hidden
    64) never showed MKL's row-count and thread-count dependence; products of this size do."""
    from transformers import EsmConfig, EsmForMaskedLM

    from pipeline.models import demo as demo_model
    path = tmp_path_factory.mktemp("esm2-650m-layer")
    torch.manual_seed(0)
    EsmForMaskedLM(EsmConfig(vocab_size=33, hidden_size=1280, intermediate_size=5120, num_hidden_layers=1,
                             num_attention_heads=20, pad_token_id=0, mask_token_id=32, token_dropout=True,
                             position_embedding_type="rotary", max_position_embeddings=1026)).save_pretrained(path)
    demo_model.build_tokenizer().save_pretrained(path)
    return path


@needs_strict_matmuls
def test_a_real_sized_layer_is_bitwise_batch_invariant(esm2_650m_layer, restore_threads):
    """All at once on 1 thread against each sequence alone on 2 threads (rows of 16-300: the products that
    differed on Intel without strict mode) and every other one on 3."""
    lengths = [1, 3, 13, 64, 130, 300]
    batch = random_sequences(lengths, seed=3)
    orders = _orders(len(batch))
    results = [_forward_rows(esm2_650m_layer, torch.float32, budget, threads, orders[order], batch, [0, 1], False)
               for budget, threads, order in ((4096, 1, "all"), (256, 2, "alone"), (1024, 3, "odd"))]
    for rows in results[1:]:
        assert [lengths[i] for i in range(len(batch)) if rows[i] != results[0][i]] == []


@needs_strict_matmuls
@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_generated_tokens_are_batch_invariant(checkpoints, kind, temperature, restore_threads):
    lengths = [1, 5, 63, 64, 65, 130, 300]
    prompts = [ids[:-1] for ids in random_sequences(lengths, seed=4)]
    params = SamplingParams(max_new_tokens=12, temperature=temperature, top_p=0.9, seed=5)
    results = {}
    for budget, threads, order in CONFIGS:
        torch.set_num_threads(threads)
        engine = NativeEngine.load(str(checkpoints[kind]), CPU, torch.float32, "", max_tokens_per_step=budget,
                                   max_seqs=256, max_new_tokens=12)
        tokens = {}
        for members in _orders(len(prompts))[order]:
            out = engine.generate([prompts[i] for i in members], members, params)
            tokens.update({i: g.token_ids for i, g in zip(members, out)})
        results[(budget, threads, order)] = tokens
    reference = results[CONFIGS[0]]
    assert any(len(t) > 1 for t in reference.values())
    for cfg, tokens in results.items():
        assert tokens == reference, f"{kind}: {cfg}"


def test_budget_below_the_split_grid_turns_the_property_off_with_a_warning(checkpoints, caplog):
    engine = NativeEngine.load(str(checkpoints["llama"]), CPU, torch.float32, "", max_tokens_per_step=48,
                               max_seqs=8)
    assert not engine.config.batch_invariant
    assert "outputs are not batch-invariant" in caplog.text and "a step budget of 48 tokens is below 64" in caplog.text
    assert "--max-tokens-per-batch" in caplog.text
    off = NativeEngine.load(str(checkpoints["llama"]), CPU, torch.float32, "", max_tokens_per_step=4096,
                            max_seqs=8, batch_invariant=False)
    assert not off.config.batch_invariant


def test_16_bit_runs_on_cpu_are_not_claimed_batch_invariant(checkpoints, caplog):
    """bfloat16 products run through oneDNN, not MKL: on an Intel CPU with AMX the rows of a 1,280 -> 5,120
    product changed with the row count even on 1 thread, and strict CNR mode does not reach them."""
    engine = NativeEngine.load(str(checkpoints["llama"]), CPU, torch.bfloat16, "", max_tokens_per_step=4096,
                               max_seqs=8)
    assert not engine.config.batch_invariant
    assert "bfloat16 products on CPU run through oneDNN" in caplog.text and "--dtype float32" in caplog.text


# A process whose MKL computed before a worker's setup ran: what cpu_setup and the engine then report.
MKL_USED_FIRST = """
import logging, sys
sys.path.insert(0, {repo!r})
import torch
torch.ones(8, 8) @ torch.ones(8, 8)
from pipeline.engine.native import NativeEngine
from pipeline.errors import UserError
from pipeline.worker.cpu_setup import set_strict_matmuls
logging.basicConfig(level=logging.WARNING, format="%(message)s")
mode = set_strict_matmuls()
print("mode:", mode.holds, mode.text)
engine = NativeEngine.load({model!r}, torch.device("cpu"), torch.float32, "", max_tokens_per_step=4096, max_seqs=8)
print("engine:", engine.config.batch_invariant)
try:
    set_strict_matmuls(run_dir="OUT")
except UserError as e:
    print("refused:", e)
"""


@pytest.mark.skipif(not mkl_cnr.strict_supported(), reason="MKL's strict mode does not apply to this CPU")
def test_mkl_used_before_the_setup_turns_the_property_off_and_is_said(checkpoints):
    code = MKL_USED_FIRST.format(repo=str(REPO), model=str(checkpoints["llama"]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "MKL_CBWR"})
    assert done.returncode == 0, done.stderr
    out = done.stdout + done.stderr
    assert "mode: False MKL computed in this process before its strict CNR mode could be set" in out
    assert "engine: True" in out   # its batch-invariant paths still run (engine/config.invariant_paths_apply)
    assert "outputs are not batch-invariant (they may change in the last bits with the batch): MKL computed" in out
    assert ("refused: this worker cannot compute the run's rows batch-invariant, as its result file will say they "
            "are: MKL computed") in out and "`run_shards rerun OUT`" in out


# ---- the real CLI ------------------------------------------------------------------------------------

def _datasets(path: Path) -> tuple[dict[str, bytes], dict]:
    with h5py.File(path) as f:
        data = {}
        f.visititems(lambda name, obj: data.__setitem__(name, obj[()].tobytes() if obj.dtype.kind != "O"
                                                        else repr(obj[()].tolist()).encode())
                     if isinstance(obj, h5py.Dataset) else None)
        return data, dict(f.attrs)


@pytest.fixture(scope="module")
def demo_subset(tmp_path_factory):
    """Every 20th record of examples/demo.fasta: 50 sequences of 65-1,045 residues (26 over 256)."""
    records = (REPO / "examples" / "demo.fasta").read_text().split(">")[1:]
    path = tmp_path_factory.mktemp("fasta") / "subset.fasta"
    path.write_text("".join(">" + r for r in records[::20]))
    return path


@pytest.fixture(scope="module")
def demo_ten(demo_subset):
    """The first 10 records of demo_subset: for what a run's result says, not its batches."""
    path = demo_subset.parent / "ten.fasta"
    path.write_text("".join(">" + r for r in demo_subset.read_text().split(">")[1:11]))
    return path


TASKS = {
    "embed": ("--pool", "mean,cls,last", "--layers", "-1,1", "--per-residue", "--per-residue-dtype", "float32"),
    "score": ("--task", "score"),
    "generate": ("--task", "generate", "--max-new-tokens", "5", "--temperature", "1.2", "--top-p", "0.9"),
}


# The other native model types through the CLI, a task each (the engine tests above run every task's
# inputs for every type): ESM-2 with long sequences as windows, Llama scoring, Qwen3 generating.
OTHER_TYPES = {
    "esm": ("--pool", "mean,cls", "--per-residue", "--on-long", "window", "--window", "300"),
    "llama": ("--task", "score"),
    "qwen3": ("--task", "generate", "--max-new-tokens", "4"),
}


@needs_strict_matmuls
@pytest.mark.parametrize("model,task", [("demo", task) for task in TASKS] + [(m, m) for m in OTHER_TYPES])
def test_result_files_are_byte_identical_across_workers_and_budgets(models, demo_subset, tmp_path, model, task):
    """1 shard on 1 worker (both cores' threads) with a 4,096-token budget; 2 shards on 1 worker of 1 thread with
    1,024 (one process computes both, in turn); 3 shards on 2 workers with 256 (chunked prefill): the batches,
    budgets, threads and processes all differ."""
    results = []
    for shards, workers, threads, budget in ((1, 1, 2, 4096), (2, 1, 1, 1024), (3, 2, 1, 256)):
        out = tmp_path / f"s{shards}"
        res = run_cli(str(demo_subset), "--out", str(out), "--model", models[model], "--gpus", "0",
                      "--shards", str(shards), "--workers", str(workers), "--threads", str(threads),
                      "--max-tokens-per-batch", str(budget), "--no-progress", "-q",
                      *(TASKS[task] if model == "demo" else OTHER_TYPES[model]))
        assert res.returncode == 0, res.stderr
        results.append(_datasets(out / "result.h5"))
        for rank in range(shards):   # each shard's log states the mode its worker runs MKL in: this process's
            assert f"matmuls: {mkl_cnr.current().text}" in (out / "logs" / f"worker_{rank}.log").read_text()
    (reference, attrs), others = results[0], results[1:]
    assert attrs["batch_invariant"] and attrs["engine"] == "native"
    assert any(name.startswith(("embeddings", "score", "generate")) for name in reference)
    for data, other_attrs in others:
        assert other_attrs["batch_invariant"]
        assert data.keys() == reference.keys()
        differ = [name for name in reference if data[name] != reference[name]]
        assert not differ, f"{model} {task}: datasets differ: {differ}"


def test_the_result_says_when_a_run_is_not_batch_invariant(models, demo_ten, tmp_path):
    """Asked not to be, the hf engine, bfloat16, and a user's MKL_CBWR that is not strict (kept as it is)."""
    cases = (("off", ("--no-batch-invariant",), {}), ("hf", ("--engine", "hf"), {}),
             ("bf16", ("--dtype", "bfloat16"), {}), ("mkl_cbwr", (), {"MKL_CBWR": "COMPATIBLE"}))
    for name, args, env in cases:
        out = tmp_path / name
        res = run_cli(str(demo_ten), "--out", str(out), "--model", models["demo"], "--gpus", "0", "--no-progress",
                      "-q", *args, env=env)
        assert res.returncode == 0, res.stderr
        _, attrs = _datasets(out / "result.h5")
        assert attrs["batch_invariant"] == False, name   # noqa: E712 (numpy bool)
    log = (tmp_path / "mkl_cbwr" / "logs" / "worker_0.log").read_text()
    assert "matmuls: MKL_CBWR=COMPATIBLE from the environment is kept, and is not MKL's strict CNR mode" in log
    assert "outputs are not batch-invariant" in log and "unset MKL_CBWR" in log


@pytest.mark.skipif(not mkl_cnr.strict_supported(), reason="MKL's strict mode does not apply to this CPU")
def test_a_first_run_that_materialises_the_demo_model_is_batch_invariant(demo_ten, tmp_path):
    """The Quickstart's first run: no --model, an empty cache, so the parent builds the demo model (with
    transformers, whose initialisers use MKL) before it answers whether the run is batch-invariant. Its
    answer must be the workers' own: yes, with no warning."""
    out = tmp_path / "out"
    res = run_cli(str(demo_ten), "--out", str(out), "--gpus", "0", "--no-progress", "-q",
                  env={"RUN_SHARDS_CACHE": str(tmp_path / "fresh_cache")})
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "fresh_cache" / "models").is_dir()   # this run's parent materialised it
    _, attrs = _datasets(out / "result.h5")
    assert attrs["batch_invariant"] and "not batch-invariant" not in res.stderr


@needs_strict_matmuls
@pytest.mark.parametrize("kind", ["esm", "demo"])
def test_an_engines_first_forward_equals_its_later_ones_with_two_threads(models, kind):
    """A worker's first batch must compute what its later ones do: aten's cos (the rotary tables) went through
    MKL's VML, which with 2 threads gave other bits at a process's first call than later (the upper half of
    the table), so a 2-thread worker's first batch differed from a 1-thread worker's
    (tools/repro_first_forward.py). Runs in a fresh process: the first call is what it is about."""
    code = f"""
import torch
from pipeline.worker.cpu_setup import set_cpu_threads, set_strict_matmuls
set_strict_matmuls(); set_cpu_threads(2)
from pipeline.engine.native import NativeEngine
from tests.tiny_checkpoints import random_sequences
engine = NativeEngine.load({models[kind]!r}, torch.device("cpu"), torch.float32, "", max_tokens_per_step=4096,
                           max_seqs=256)
batch = random_sequences([298, 298, 298, 150, 60, 298, 298], seed=3)
outs = [engine.forward(batch, [1], False).hidden[1] for _ in range(3)]
print(all(torch.equal(outs[0], o) for o in outs[1:]))
"""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "True"
