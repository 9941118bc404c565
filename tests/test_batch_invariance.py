"""Batch-invariant outputs (issue #19 part 1): on the native engine on CPU, every stored value is the same
bits whatever the number of workers, the token budget (chunked prefill), torch's thread count and the
other sequences of a batch.

Three levels: the CPU matmul property the design leans on (checked on the machine that runs the tests);
the engine's hidden states, log-probabilities and generated tokens for every native model type under
budgets 4,096 / 1,024 / 256, 1 / 2 / 3 threads and other neighbours; and the real CLI on the demo model
with 1, 2 and 3 workers, every task, the result files' datasets compared as raw bytes.
"""
from __future__ import annotations

from pathlib import Path

import h5py
import pytest
import torch
import torch.nn.functional as F

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


def _orders(n: int) -> dict[str, list[list[int]]]:
    """Batches of sequence numbers per neighbourhood: all at once, reversed, every other one (twice, so
    each is seen), each alone."""
    every = list(range(n))
    return {"all": [every], "reversed": [every[::-1]], "odd": [every[1::2], every[0::2]],
            "alone": [[i] for i in every]}


def test_cpu_matmul_rows_do_not_depend_on_the_row_count_or_threads(restore_threads):
    """What linear.py's padding relies on: from MIN_ROWS rows up, each output row of F.linear is the same
    bits for any row count and 1-3 threads (MKL takes another path for fewer rows: padded)."""
    gen = torch.Generator().manual_seed(0)
    for k, n in ((64, 96), (64, 192), (96, 64), (256, 1024), (1024, 256)):
        w, x = torch.randn(n, k, generator=gen), torch.randn(600, k, generator=gen)
        torch.set_num_threads(1)
        reference = F.linear(x, w)
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for m in (MIN_ROWS, MIN_ROWS + 1, 23, 64, 100, 333, 600):
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


@pytest.mark.parametrize("kind,dtype", [(kind, torch.float32) for kind in KINDS]
                         + [("llama", torch.bfloat16), ("qwen3_5", torch.bfloat16)])
def test_hidden_states_and_logprobs_are_bitwise_batch_invariant(checkpoints, kind, dtype, restore_threads):
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
    assert "below 64: outputs are not batch-invariant" in caplog.text and "--max-tokens-per-batch" in caplog.text
    off = NativeEngine.load(str(checkpoints["llama"]), CPU, torch.float32, "", max_tokens_per_step=4096,
                            max_seqs=8, batch_invariant=False)
    assert not off.config.batch_invariant


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


@pytest.mark.parametrize("model,task", [("demo", task) for task in TASKS] + [(m, m) for m in OTHER_TYPES])
def test_result_files_are_byte_identical_across_workers_and_budgets(models, demo_subset, tmp_path, model, task):
    """1 worker (both cores) with a 4,096-token budget, 2 workers with 1,024, 3 with 256 (chunked prefill)."""
    results = []
    for workers, budget in ((1, 4096), (2, 1024), (3, 256)):
        out = tmp_path / f"w{workers}"
        res = run_cli(str(demo_subset), "--out", str(out), "--model", models[model], "--gpus", "0",
                      "--workers", str(workers), "--max-tokens-per-batch", str(budget), "--no-progress", "-q",
                      *(TASKS[task] if model == "demo" else OTHER_TYPES[model]))
        assert res.returncode == 0, res.stderr
        results.append(_datasets(out / "result.h5"))
    (reference, attrs), others = results[0], results[1:]
    assert attrs["batch_invariant"] and attrs["engine"] == "native"
    assert any(name.startswith(("embeddings", "score", "generate")) for name in reference)
    for data, other_attrs in others:
        assert other_attrs["batch_invariant"]
        assert data.keys() == reference.keys()
        differ = [name for name in reference if data[name] != reference[name]]
        assert not differ, f"{model} {task}: datasets differ: {differ}"


def test_the_result_says_when_a_run_is_not_batch_invariant(models, demo_subset, tmp_path):
    for name, args in (("off", ("--no-batch-invariant",)), ("hf", ("--engine", "hf"))):
        out = tmp_path / name
        res = run_cli(str(demo_subset), "--out", str(out), "--model", models["demo"], "--gpus", "0", "--no-progress",
                      "-q", *args)
        assert res.returncode == 0, res.stderr
        _, attrs = _datasets(out / "result.h5")
        assert attrs["batch_invariant"] == False, name   # noqa: E712 (numpy bool)
