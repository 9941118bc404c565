"""`run_shards --engine native` through the real CLI and workers, against `--engine hf` and transformers.

Tolerances as in test_models_parity.py: both runs' columns (float32 on CPU) are measured against the
same columns computed by transformers in float64, and native's error must be at most FACTOR times hf's
plus FLOOR (tests/float64_reference.py).
"""
from __future__ import annotations

import re

import h5py
import numpy as np
import pytest
import torch

from index import SequenceIndex
from pipeline.engine import selection as engines
from pipeline.config import RunConfig
from pipeline.errors import UserError
from pipeline.tasks import make_task
from pipeline.tasks.tokenization import SequenceTokenizer

from .conftest import SHARED_DATA
from .float64_reference import Float64Transformers, assert_as_accurate, float64_everywhere
from .tiny_models import run_cli

FASTA = [str(SHARED_DATA / "protein_lib.fa"), str(SHARED_DATA / "ncbi_standard_aa.fasta")]


def read(path):
    with h5py.File(path) as f:
        data = {}
        f.visit(lambda n: data.__setitem__(n, f[n][:]) if isinstance(f[n], h5py.Dataset) else None)
        return data, dict(f.attrs)


def run(tmp_path, name, *args):
    out = tmp_path / name
    res = run_cli(*FASTA, "--out", str(out), "--gpus", "0", "--no-progress", *args)
    assert res.returncode == 0, res.stderr
    return (*read(out / "result.h5"), out)


def exact_columns(model: str, task: str, **options) -> dict[str, np.ndarray]:
    """The run's columns (FASTA order) from the task code on transformers in float64 throughout."""
    from transformers import AutoTokenizer
    index = SequenceIndex.build(FASTA)
    tokenizer = SequenceTokenizer(AutoTokenizer.from_pretrained(model))
    toks = tokenizer.encode([index.sequence(i) for i in range(len(index))])
    exact = Float64Transformers(model, logprobs=task == "score")
    with float64_everywhere():
        return make_task(RunConfig(fasta=FASTA, out="o", task=task, **options), exact.info).run(
            exact, toks, np.arange(len(toks))).columns


def test_native_equals_hf_on_the_demo_model_with_chunked_prefill(models, tmp_path):
    """Embed with two workers and a 96-token step budget (sequences up to ~6x longer run in chunks)."""
    args = ("--model", models["demo"], "--pool", "mean,cls,last", "--layers", "-1,2")
    native, attrs, out = run(tmp_path, "native", *args, "--engine", "native", "--workers", "2",
                             "--max-tokens-per-batch", "96")
    hf, hf_attrs, _ = run(tmp_path, "hf", *args, "--engine", "hf")
    assert attrs["engine"] == "native" and hf_attrs["engine"] == "hf"
    assert SequenceIndex.build(FASTA).lengths.max() + 2 > 5 * 96
    for key in ("ids", "index", "lengths", "num_tokens", "status", "truncated"):
        assert np.array_equal(native[key], hf[key]), key
    exact = exact_columns(models["demo"], "embed", pools=["mean", "cls", "last"], layers=[-1, 2])
    for pool in ("mean", "cls", "last"):
        for sfx in ("", "_layer2"):
            name = f"embeddings/{pool}{sfx}"
            assert_as_accurate(native[name], hf[name], exact[name], name)
    # The workers' last engine lines count every token of the computed rows once (chunks never recompute a
    # token; a repeated sequence is computed once and copied: computed_at), in steps within the budget.
    steps = tokens = 0
    for rank in (0, 1):
        log = (out / "logs" / f"worker_{rank}.log").read_text()
        line = re.findall(r"native engine: (\d+) steps, (\d+) tokens \(ragged, no padding\), step fill", log)[-1]
        steps, tokens = steps + int(line[0]), tokens + int(line[1])
    computed = native["computed_at"] == native["index"]
    assert not computed.all()                 # the input repeats a sequence, which was computed once
    assert tokens == int(native["num_tokens"][computed].sum()) and steps >= -(-tokens // 96)


def test_demo_model_runs_on_native_by_default_and_scores_like_hf(models, tmp_path):
    native, attrs, _ = run(tmp_path, "auto", "--model", models["demo"], "--task", "score")
    hf, _, _ = run(tmp_path, "hf", "--model", models["demo"], "--task", "score", "--engine", "hf")
    assert attrs["engine"] == "native"
    exact = exact_columns(models["demo"], "score")
    assert np.array_equal(native["score/num_scored"], hf["score/num_scored"])
    assert np.array_equal(native["score/num_scored"], exact["score/num_scored"])
    assert_as_accurate(native["score/logprob_sum"], hf["score/logprob_sum"], exact["score/logprob_sum"], "logprob_sum")


def test_generate_columns_greedy_reference_and_sampling(models, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    common = ("--model", models["demo"], "--task", "generate", "--max-new-tokens", "6")
    greedy, attrs, _ = run(tmp_path, "greedy", *common)
    assert attrs["task"] == "generate" and attrs["engine"] == "native"
    offsets, ids = greedy["generate/offsets"], greedy["generate/token_ids"]
    n = len(greedy["index"])
    assert offsets[0] == 0 and len(offsets) == n + 1 and np.all(np.diff(offsets) >= 1)
    assert set(r.decode() for r in greedy["generate/finish_reason"]) <= {"stop", "length"}
    tok = AutoTokenizer.from_pretrained(models["demo"])
    model = AutoModelForCausalLM.from_pretrained(models["demo"]).eval()
    index = SequenceIndex.build(FASTA)
    for i in (0, 5, n - 1):
        prompt = tok(index.sequence(i))["input_ids"][:-1]          # without the trailing <eos>
        want = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=2,
                              pad_token_id=0)[0, len(prompt):].tolist()
        got = ids[offsets[i]:offsets[i + 1]].tolist()
        assert got == want
        assert greedy["generate/text"][i].decode() == "".join(
            t for t in tok.convert_ids_to_tokens(got) if t not in tok.all_special_tokens)

    # Sampling: tokens follow the seed, not greedy search (that they do not depend on the worker count or
    # the budget is tests/test_batch_invariance.py's).
    sampled = ("--temperature", "1.5", "--top-p", "0.95", "--seed", "7")
    one, _, _ = run(tmp_path, "one", *common, *sampled, "--workers", "1")
    assert not np.array_equal(one["generate/token_ids"], greedy["generate/token_ids"])


def test_engine_choice_and_unsupported_architectures(models, tmp_path):
    from pipeline.models.checkpoint import local_source
    from .tiny_models import save_gpt2
    demo, gpt2 = local_source(models["demo"]), local_source(str(save_gpt2(tmp_path / "gpt2")))
    assert engines.choose("auto", demo, "embed") == "native"
    assert engines.choose("auto", gpt2, "embed") == "hf"
    with pytest.raises(UserError, match="--engine hf"):
        engines.choose("native", gpt2, "embed")
    with pytest.raises(UserError, match="native engine"):
        engines.choose("auto", gpt2, "generate")


def test_float32_on_a_gpu_is_refused_for_the_native_engine_with_what_to_use():
    """Its Triton kernels spill registers in float32 (issue 20): a clear refusal, not a slow run."""
    with pytest.raises(UserError, match="--dtype bfloat16") as refused:
        engines.check_dtype("native", "float32", on_gpu=True)
    assert "--engine hf" in str(refused.value)
    for allowed in (("native", "bfloat16", True), ("native", "float16", True), ("native", "float32", False),
                    ("hf", "float32", True)):
        engines.check_dtype(*allowed)


def test_gpus_older_than_the_native_kernels_are_refused_by_name_with_what_to_use():
    """Compute capability below 8.0 (T4, V100): the native engine's Triton kernels are compiled and checked for
    8.0 and newer, so a run there is refused naming the GPU and the options that run it (transformers, float16:
    those GPUs have no bfloat16); consumer and workstation GPUs (sm_86, sm_89, sm_120) and B200 run."""
    from pipeline.engine import gpu_support
    old = [("0", "Tesla T4", (7, 5)), ("GPU-5f3c", "Tesla V100-SXM2-32GB", (7, 0))]
    with pytest.raises(UserError, match="--engine hf --dtype float16") as refused:
        gpu_support.check_gpus("native", old)
    text = str(refused.value)
    assert "GPU 0 (Tesla T4, compute capability 7.5)" in text and "GPU GPU-5f3c (Tesla V100-SXM2-32GB" in text
    # a machine mixing old and new GPUs: NVML's and CUDA's numbering may differ there, so each worker decides
    gpu_support.check_gpus("native", [("1", "NVIDIA L40S", (8, 9))] + old)
    assert "GPU 1" not in gpu_support.native_gpu_problem([("1", "NVIDIA L40S", (8, 9))] + old)
    gpu_support.check_gpus("hf", old)   # transformers runs there
    for gpu in (("0", "NVIDIA A10", (8, 6)), ("0", "NVIDIA GeForce RTX 5090", (12, 0)), ("0", "NVIDIA B200", (10, 0))):
        gpu_support.check_gpus("native", [gpu])
    gpu_support.check_native_device(torch.device("cpu"))   # a CPU worker: nothing to check


def test_a_native_gpu_worker_without_triton_says_what_to_install_or_run(monkeypatch):
    """A GPU machine without triton (setup.cfg installs it on Linux only): the native engine's load refuses, naming
    the install and --engine hf, instead of a worker dying at its first kernel."""
    import sys

    from pipeline.engine import gpu_support
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    try:
        import triton   # noqa: F401
    except ImportError:   # (the suite run without triton: the refusal below is all there is to see)
        pass
    else:
        gpu_support.check_native_device(torch.device("cuda", 0))   # triton installed: nothing to say
    monkeypatch.setitem(sys.modules, "triton", None)   # `import triton` raises ImportError
    with pytest.raises(UserError, match=r"cannot import triton .*-m pip install triton`\), or run with --engine hf"):
        gpu_support.check_native_device(torch.device("cuda", 0))


def test_a_gpu_worker_says_which_launch_table_row_its_gpu_takes():
    """What a native GPU worker's log says of its GPU: the row at or below its compute capability."""
    from pipeline.engine.gpu_support import describe_gpu
    assert describe_gpu("NVIDIA L40S", (8, 9), 142) == ("GPU NVIDIA L40S, compute capability 8.9, 142 SMs: the native "
                                                        "engine's Triton kernels take the launch table's sm_86 row")
    assert describe_gpu("NVIDIA H200", (9, 0), 132).endswith("sm_90 row")
    assert describe_gpu("NVIDIA B300", (10, 3), 148).endswith("sm_100 row")


def test_gpu_models_are_read_without_cuda_or_torch():
    """The parent reads its GPUs' names and compute capabilities through NVML, as it counts them: no torch, no
    CUDA. Where NVML cannot say (no driver, as on a CPU machine) the answer is empty and the workers check."""
    import subprocess
    import sys
    from pathlib import Path
    probe = ("import sys; sys.path.insert(0, %r); from pipeline.planning import devices; "
             "found = devices.gpu_models(devices.visible_gpus()); assert 'torch' not in sys.modules; print(found)"
             % str(Path(__file__).resolve().parents[1]))
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    found = eval(res.stdout)
    if torch.cuda.is_available():
        assert found and all(cap >= (3, 0) and name for _, name, cap in found)
    else:
        assert found == []
