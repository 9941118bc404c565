"""The native engine against transformers (the hf engine) on tiny random models of every architecture.

float32 on CPU. Both engines are measured against transformers in float64 on the same checkpoint
(tests/float64_reference.py): per checked layer and for token log-probabilities, native's error (the
largest difference over the tensor's largest value) must be at most FACTOR = 4 times transformers' own
float32 error plus FLOOR = 1e-6. Comparing the two float32 results with each other measured both
roundings, which depend on the CPU's kernels: on an AMD EPYC (AVX2) Qwen3.5's chunked prefill differed by
1.6e-4 of the scale where a 1e-4 bound held elsewhere, while its errors against float64 are 5.7e-5
(native) and 1.1e-4 (transformers).

Errors measured here (AMD EPYC, torch's AVX2 kernels and its scalar ones, ATEN_CPU_CAPABILITY=default),
native / transformers float32 over every check: Qwen3.5 1.5e-6..5.7e-5 / 2.2e-6..1.1e-4 (the delta-rule
layers; the most after 640 tokens of chunked prefill), Llama with and without biases and Qwen3
2e-7..2e-6 / 1.2e-7..2.1e-6, ESM-2 and ESM-1b 8e-8..4.6e-7 / 8e-8..4.6e-7, the tasks' pooled embeddings
and log-likelihood sums 1.4e-8..4.1e-6 / 3.7e-8..4.4e-6. The ratio spans 0.13..1.83; it exceeds 1.5 only
where a maximum over a few hundred tokens is noisy (1.76: 4.6e-6 / 2.6e-6) or at 1-2 ulps (1.83:
2.3e-7 / 1.2e-7), which FLOOR (8 ulps of the scale) covers. FACTOR = 4 leaves twice the largest ratio:
no check uses more than 0.40 of its bound. Real mistakes exceed it by far: a dropped delta-rule state or
conv window, a rotary position off by one in continuation chunks, a dropped bias, ESM-2's mask ratio off
by one give 1e-3..1 of the scale (450x..90,000x the bound); scaling every MLP output, the attention
scale, the delta-rule gates or the conv taps by 1.001 gives 5e-4..4e-3 (40x..300x); log-softmax at
temperature 1.001, 4e-4..5e-4 (4x on Qwen3.5's chunked prefill, whose bound is the loosest; 20x..300x
elsewhere).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.engine.native import NativeEngine
from pipeline.engine.hf import HFEngine
from tests.float64_reference import (Float64Transformers, assert_as_accurate, assert_rows_as_accurate,
                                     float64_everywhere)
from tests.tiny_checkpoints import random_sequences, write_tiny

CPU = torch.device("cpu")
CAUSAL = ("qwen3_5", "llama", "qwen3")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {kind: write_tiny(kind, root / kind) for kind in CAUSAL + ("esm2", "esm1b")}


def engines(path, logprobs: bool, **budgets):
    """Native in float32, and transformers in float32 and in float64 (the exact values)."""
    native = NativeEngine.load(str(path), CPU, torch.float32, "", **budgets)
    return native, HFEngine(str(path), CPU, torch.float32, logprobs=logprobs), Float64Transformers(str(path), logprobs)


def assert_as_accurate_as_transformers(native, hf, exact, batch, layers, logprobs: bool):
    """Native's rows of `batch` are as accurate as transformers' float32 ones; returns native's."""
    out = native.forward(batch, layers, logprobs)
    assert_rows_as_accurate(out, hf.forward(batch, layers, logprobs), exact.forward(batch, layers, logprobs),
                            layers, logprobs)
    return out


@pytest.mark.parametrize("kind", CAUSAL)
def test_causal_hidden_states_and_logprobs_match_transformers(checkpoints, kind):
    native, hf, exact = engines(checkpoints[kind], logprobs=True)
    batch = random_sequences([5, 37, 200, 0, 64, 1], seed=1)
    layers = [0, 1, native.info.num_layers - 1, native.info.num_layers]
    assert_as_accurate_as_transformers(native, hf, exact, batch, layers, True)


@pytest.mark.parametrize("split", [True, False], ids=["cpu-split-mlp", "fused-mlp"])
def test_projection_and_mlp_biases_match_transformers(tmp_path, monkeypatch, split):
    """Biases on every attention and MLP projection, through both forms of the MLP: the CPU's two matmuls
    on the halves of the fused gate/up weight (and bias), and the GPU's one matmul."""
    import pipeline.models.layers.mlp as mlp
    monkeypatch.setattr(mlp, "CPU_SPLIT_GATE_UP", split)
    native, hf, exact = engines(write_tiny("llama-bias", tmp_path / "llama-bias"), logprobs=True)
    batch = random_sequences([5, 37, 90, 1], seed=3)
    layers = [0, 1, native.info.num_layers]
    assert_as_accurate_as_transformers(native, hf, exact, batch, layers, True)


@pytest.mark.parametrize("kind", CAUSAL)
def test_cpu_norm_row_blocks_match_transformers(checkpoints, monkeypatch, kind):
    """On CPU the norms go a block of rows at a time; tiny blocks here (1-3 rows) so that blocks end
    inside sequences."""
    import pipeline.models.layers.norms as norms
    monkeypatch.setattr(norms, "CPU_BLOCK_BYTES", 1000)
    native, hf, exact = engines(checkpoints[kind], logprobs=True)
    batch = random_sequences([5, 37, 200, 64, 1], seed=6)
    layers = [1, native.info.num_layers]
    assert_as_accurate_as_transformers(native, hf, exact, batch, layers, True)


@pytest.mark.parametrize("kind", CAUSAL)
def test_chunked_prefill_of_sequences_longer_than_the_budget(checkpoints, kind):
    """A 16-token step budget: sequences of up to 40x the budget, mixed with short ones, carried across
    steps by their KV pages and delta-rule state."""
    native, hf, exact = engines(checkpoints[kind], logprobs=True, max_tokens_per_step=16, max_seqs=3)
    batch = random_sequences([640, 3, 100, 17, 15, 1, 300], seed=2)
    layers = [2, native.info.num_layers]
    assert_as_accurate_as_transformers(native, hf, exact, batch, layers, True)
    assert native.stats.steps >= sum(map(len, batch)) // 16


@pytest.mark.parametrize("kind", ("esm2", "esm1b"))
def test_esm_matches_transformers_including_masked_tokens(checkpoints, kind):
    native, hf, exact = engines(checkpoints[kind], logprobs=False, max_tokens_per_step=256)
    batch = random_sequences([300, 40, 5, 1, 120, 250], seed=3)
    batch[1][5] = batch[1][9] = 32      # <mask> tokens: ESM-2's token dropout rescales the embeddings
    batch[4][3] = 32
    layers = [0, 2, native.info.num_layers]
    assert_as_accurate_as_transformers(native, hf, exact, batch, layers, False)
    # whole sequences per step (bidirectional): the 300-token one, over the budget, ran alone
    assert native.stats.steps == 3


def test_sharded_checkpoint_loads_the_same_model(checkpoints, tmp_path):
    sharded = write_tiny("qwen3_5", tmp_path / "sharded", max_shard_size="50KB")
    assert (sharded / "model.safetensors.index.json").exists()
    batch = random_sequences([30, 7], seed=4)
    a = NativeEngine.load(str(sharded), CPU, torch.float32, "").forward(batch, [4], True)
    b = NativeEngine.load(str(checkpoints["qwen3_5"]), CPU, torch.float32, "").forward(batch, [4], True)
    assert torch.equal(a.hidden[4], b.hidden[4]) and torch.equal(a.token_logprobs, b.token_logprobs)


def test_pytorch_weight_files_load_the_same_model(checkpoints, tmp_path):
    """Checkpoints published with PyTorch's pytorch_model.bin only (ProtT5's, older ESM and ProtBert uploads):
    one file, a sharded set with its index, and the pre-zip format of torch < 1.6 load the model the
    safetensors hold; the native engine refused them once its worker had started (--engine auto chose it)."""
    import json
    import shutil

    from safetensors.torch import load_file
    source = checkpoints["esm2"]
    tensors = load_file(source / "model.safetensors")
    names = sorted(tensors)
    written = {}
    for name in ("bin", "bin_sharded", "bin_legacy"):   # (transformers 5 saves safetensors only: written here)
        d = written[name] = tmp_path / name
        shutil.copytree(source, d, ignore=shutil.ignore_patterns("*.safetensors*"))
        if name == "bin_sharded":   # as transformers 4 wrote a sharded .bin set
            files = {f"pytorch_model-0000{i + 1}-of-00002.bin": names[i::2] for i in range(2)}
            for file, part in files.items():
                torch.save({n: tensors[n] for n in part}, d / file)
            (d / "pytorch_model.bin.index.json").write_text(json.dumps(
                {"metadata": {}, "weight_map": {n: f for f, part in files.items() for n in part}}))
        else:
            torch.save(tensors, d / "pytorch_model.bin", _use_new_zipfile_serialization=name == "bin")
    assert (written["bin_sharded"] / "pytorch_model.bin.index.json").exists()
    batch = random_sequences([30, 7], seed=4)
    want = NativeEngine.load(str(source), CPU, torch.float32, "").forward(batch, [3], True)
    for name, d in written.items():
        assert not list(d.glob("*.safetensors")), name
        got = NativeEngine.load(str(d), CPU, torch.float32, "").forward(batch, [3], True)
        assert torch.equal(got.hidden[3], want.hidden[3]) and torch.equal(got.token_logprobs, want.token_logprobs), name


def test_a_single_weight_file_beside_a_sharded_set_is_read_as_transformers_reads_it(checkpoints, tmp_path):
    """A folder holding model.safetensors and a sharded set of other weights (left by an earlier save):
    transformers reads the single file; the native engine read the set, so the engines computed different
    models from one folder (embeddings 1.6 apart on this tiny ESM-2)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import EsmForMaskedLM
    source = checkpoints["esm2"]
    both = tmp_path / "both"
    shutil.copytree(source, both)
    tensors = load_file(source / "model.safetensors")
    names = sorted(tensors)
    files = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    for file, part in files.items():   # the stale set: every weight scaled
        save_file({n: tensors[n] * 1.5 for n in part}, both / file, metadata={"format": "pt"})
    (both / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in files.items() for n in part}}))
    embedding = "esm.embeddings.word_embeddings.weight"
    read = EsmForMaskedLM.from_pretrained(both).state_dict()[embedding]
    assert torch.equal(read, tensors[embedding])   # transformers: the single file
    batch = random_sequences([30, 7], seed=4)
    want = NativeEngine.load(str(source), CPU, torch.float32, "").forward(batch, [3], True)
    got = NativeEngine.load(str(both), CPU, torch.float32, "").forward(batch, [3], True)
    assert torch.equal(got.hidden[3], want.hidden[3]) and torch.equal(got.token_logprobs, want.token_logprobs)


def test_tasks_give_the_same_rows_on_both_engines(checkpoints):
    """embed (mean/cls/last pools) and score through pipeline.tasks, row by row."""
    from pipeline.config import RunConfig
    from pipeline.tasks.embed import EmbedTask
    from pipeline.tasks.score import ScoreTask
    from pipeline.tasks.tokenization import Tokenized

    native, hf, exact = engines(checkpoints["qwen3_5"], logprobs=True, max_tokens_per_step=64)
    batch = random_sequences([150, 9, 60], seed=5)
    toks = [Tokenized(ids, np.array([i in (0, len(ids) - 1) for i in range(len(ids))]), False, False) for ids in batch]
    config = RunConfig(fasta=["x"], out="o", pools=["mean", "cls", "last"], task="score")
    for task in (EmbedTask(config, native.info), ScoreTask(config, native.info)):
        a, b = task.run(native, toks, np.arange(3)), task.run(hf, toks, np.arange(3))
        with float64_everywhere():      # the task's own float32 pooling too
            c = task.run(exact, toks, np.arange(3))
        for name in a.columns:
            if name == "score/num_scored":
                assert a.columns[name].tolist() == c.columns[name].tolist() == [150, 9, 60]
            elif name == "score/eos_logprob":   # no tokenizer was prepared: no end-of-sequence token to score
                assert all(np.isnan(x.columns[name]).all() for x in (a, b, c))
            else:
                assert_as_accurate(a.columns[name], b.columns[name], c.columns[name], name)


def test_text_model_of_a_multimodal_qwen3_5_checkpoint(checkpoints, tmp_path):
    """Qwen3.5 releases are Qwen3_5ForConditionalGeneration: the text model under model.language_model,
    vision weights beside it. The native engine loads the text model and ignores the rest."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, Qwen3_5Config

    text_dir, mm = checkpoints["qwen3_5"], tmp_path / "multimodal"
    shutil.copytree(text_dir, mm)
    weights = load_file(str(mm / "model.safetensors"))
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in weights.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)     # present, ignored
    save_file(renamed, str(mm / "model.safetensors"))
    text_config = AutoConfig.from_pretrained(text_dir).to_dict()
    config = Qwen3_5Config(text_config=text_config).to_dict()
    config["architectures"] = ["Qwen3_5ForConditionalGeneration"]
    (mm / "config.json").write_text(json.dumps(config))
    batch = random_sequences([30, 7], seed=6)
    a = NativeEngine.load(str(mm), CPU, torch.float32, "").forward(batch, [4], True)
    b = NativeEngine.load(str(text_dir), CPU, torch.float32, "").forward(batch, [4], True)
    assert torch.equal(a.hidden[4], b.hidden[4]) and torch.equal(a.token_logprobs, b.token_logprobs)


@pytest.mark.parametrize("kind", CAUSAL + ("esm2",))
def test_bfloat16_on_cpu_is_as_close_to_float32_as_transformers_own(checkpoints, kind):
    """`--dtype bfloat16` on CPU (fast on CPUs with AMX): the native engine in bfloat16 against
    transformers in float64, beside transformers' own bfloat16 error on the same rows. bfloat16 keeps 8
    significant bits (rounding 2^-9 ~ 2e-3 per operation); on these tiny random models both engines land
    at 7e-3 (ESM-2) to 5e-2 (Qwen3.5) relative RMS, native never 1% above transformers. The bound is 2x
    transformers' error plus 1e-2, while a real mistake (a lost state, a wrong position) gives errors of
    order 1. Causal models run with a 16-token step budget, so chunked
    prefill carries bfloat16 conv windows and float32 delta-rule states across steps."""
    budgets = dict(max_tokens_per_step=16, max_seqs=3) if kind in CAUSAL else dict(max_tokens_per_step=512)
    native = NativeEngine.load(str(checkpoints[kind]), CPU, torch.bfloat16, "", **budgets)
    hf16 = HFEngine(str(checkpoints[kind]), CPU, torch.bfloat16, logprobs=False)
    exact = Float64Transformers(str(checkpoints[kind]), logprobs=False)
    batch = random_sequences([200, 3, 64, 17, 1], seed=7)
    final = native.info.num_layers
    ref = exact.forward(batch, [final], False).hidden[final]

    def rel_rms(out):
        return ((out.hidden[final].double() - ref).norm() / ref.norm()).item()

    ours, theirs = rel_rms(native.forward(batch, [final], False)), rel_rms(hf16.forward(batch, [final], False))
    assert ours <= 2 * theirs + 1e-2, f"native bfloat16 {ours:.3g} vs transformers bfloat16 {theirs:.3g}"
