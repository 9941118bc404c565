"""Fast unit tests: options, device choice, batching, tokenization, pooling, the demo model."""
import dataclasses
import json
import os
import sys
import types
from pathlib import Path

import click
import numpy as np
import pytest
import torch

import run_shards
from pipeline.models import demo as demo_model
from pipeline.planning import devices
from pipeline.worker.batching import plan_batches
from pipeline.config import RunConfig
from pipeline.engine.interface import ForwardOutput, resolve_layers, same_layers
from pipeline.models.checkpoint import EngineInfo
from pipeline.errors import UserError
from index.spill import ragged_arange
from pipeline.tasks.embed import EmbedTask
from pipeline.tasks.score import ScoreTask, score_task
from pipeline.tasks.tokenization import SequenceTokenizer


@pytest.mark.parametrize("kwargs,message", [
    ({"task": "fold"}, "--task must be one of"),
    ({"pools": ["max"]}, "--pool must be one of"),
    ({"on_long": "ignore"}, "--on-long must be one of"),
    ({"workers": 0}, "--workers must be at least 1"),
    ({"checkpoint_seconds": 0}, "--checkpoint-seconds must be positive"),
    ({"worker_timeout": float("nan")}, "--worker-timeout must be a number, not NaN"),   # (never timed out)
    ({"top_p": float("nan"), "task": "generate", "temperature": 1.0}, "--top-p must be a number, not NaN"),
    ({"seed": -1, "task": "generate", "temperature": 1.0}, "--seed must be at least 0"),
    ({"seed": 2**64, "task": "generate", "temperature": 1.0}, "--seed must be at most 18446744073709551615"),
    # Counts something is allocated for, one per unit, or that overflowed: a slot list per worker filled memory,
    # torch refused the threads in every worker, int64 sums wrapped.
    ({"workers": 1180591620717411303424}, "--workers must be at most 4096"),
    ({"threads_per_worker": 2**63}, "--threads must be at most 4096"),
    ({"shards": 10**6 + 1}, "--shards must be at most 1000000"),
    ({"max_new_tokens": 2**63, "task": "generate"}, "--max-new-tokens must be at most 2147483647"),
    ({"max_tokens_per_batch": 2**31}, "--max-tokens-per-batch must be at most 2147483647"),
    ({"launcher": "slurm", "shards": 2, "shards_per_task": 2**64}, "--shards-per-task must be at most 1000000"),
    ({"launcher": "slurm", "shards": 2, "array_throttle": 2**64}, "--array-throttle must be at most 1000000"),
])
def test_config_rejects_bad_options(kwargs, message):
    with pytest.raises(UserError, match=message):
        RunConfig(fasta=["x"], out="o", **kwargs)


def test_config_roundtrip_and_defaults():
    c = RunConfig(fasta=["a.fa"], out="o", devices=["0", "1"], workers=2)
    assert RunConfig.from_json(c.to_json()) == c
    assert c.world == 2 and c.on_gpu and c.torch_dtype_name == "bfloat16" and c.tokens_per_batch == 32768
    cpu = RunConfig(fasta=["a.fa"], out="o", workers=3)
    assert cpu.world == 3 and cpu.torch_dtype_name == "float32" and cpu.tokens_per_batch == 4096


def test_a_seed_stored_outside_64_bits_reads_as_the_seed_it_sampled_with():
    """Earlier versions took any --seed and sampled with it modulo 2**64; their runs continue with that seed."""
    from pipeline.engine.sampler import uniforms
    stored = json.loads(RunConfig(fasta=["a.fa"], out="o", task="generate", temperature=1.0).to_json())
    keys, steps = np.arange(5, dtype=np.uint64), np.arange(5, dtype=np.uint64)
    for old, now in ((-1, 2**64 - 1), (2**64 + 5, 5), (-(2**64) + 3, 3)):
        assert RunConfig.from_dict({**stored, "seed": old}).seed == now
        assert np.array_equal(uniforms(old, keys, steps), uniforms(now, keys, steps))


def test_counts_stored_above_todays_bounds_read_as_what_they_computed():
    """A run planned before the bounds (2026-12-07) continues: token, shard and task counts above theirs read as the
    bound (no sequence, batch or array reaches it), --workers and --threads above theirs as their defaults."""
    stored = json.loads(RunConfig(fasta=["a.fa"], out="o", task="generate", launcher="slurm", shards=4).to_json())
    old = {**stored, "max_new_tokens": 10**12, "max_tokens_per_batch": 2**40, "shards_per_task": 10**7,
           "array_throttle": 2**63, "threads_per_worker": 2**63, "workers": 10**6}
    config = RunConfig.from_dict(old)
    assert (config.max_new_tokens, config.max_tokens_per_batch) == (2**31 - 1, 2**31 - 1)
    assert (config.shards_per_task, config.array_throttle) == (1_000_000, 1_000_000)
    assert (config.threads_per_worker, config.workers) == (1, 1)
    within = {**stored, "max_new_tokens": 2**31 - 1, "threads_per_worker": 4096}
    assert (RunConfig.from_dict(within).max_new_tokens, RunConfig.from_dict(within).threads_per_worker) == \
        (2**31 - 1, 4096)


@pytest.mark.parametrize("new_tokens", [8, 12, 2**31 - 1, 2**63 - 1, 2**64])
def test_generation_past_the_models_positions_is_counted_exactly(caplog, new_tokens):
    """Prompts of 17 and 6 tokens on 24 positions: 8 new tokens keep within them, more reach past for the
    longest. The reach was summed in int64: 2**63-1 wrapped (no warning) and 2**64 raised an OverflowError."""
    from pipeline.planning.length_limit import warn_generation_beyond
    index = types.SimpleNamespace(length_values=np.array([4, 15]), length_counts=np.array([1, 1]))
    tokenizer = types.SimpleNamespace(tokens_for_residues=lambda lengths: lengths + 2)
    with caplog.at_level("WARNING", logger="run_shards"):
        warn_generation_beyond(index, tokenizer, None, "error", None, 24, new_tokens)
    if new_tokens == 8:
        assert not caplog.records
        return
    [record] = caplog.records
    assert record.getMessage().startswith(f"{1 + (new_tokens > 19)} sequence(s) may be continued past the model's 24 "
                                          f"positions (max_position_embeddings): their tokens and --max-new-tokens "
                                          f"{new_tokens} reach up to {17 + new_tokens - 1}; "), record.getMessage()
    assert "--max-new-tokens 8 keeps the longest within them" in record.getMessage()


def test_devices_honour_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert devices.visible_gpus() == ["3", "5"]
    assert devices.resolve("2", None)[0] == ["3", "5"]
    assert devices.resolve("auto", None)[0] == ["3", "5"]
    with pytest.raises(UserError, match=r"--gpus 4: only 2 GPU\(s\) visible \(CUDA_VISIBLE_DEVICES='3,5'\)"):
        devices.resolve("4", None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,-1,2")   # CUDA stops at the first invalid id
    assert devices.visible_gpus() == ["1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    gpus, workers, threads = devices.resolve("auto", 2, 3)
    assert gpus == [] and workers == 2 and threads == 3
    with pytest.raises(UserError, match="--gpus takes a number or 'auto'"):
        devices.resolve("many", None)


def test_default_cpu_workers_follow_the_input_size(monkeypatch, tmp_path):
    """With no --workers, a CPU run starts one worker per core (at most 4) but no more than one per 4 batches of
    input: a worker is a process, its imports and a model copy, which a smaller share of the work does not repay.
    The input's size is told from the files' sizes (a gzip file's times 5), before anything is read."""
    import gzip
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "cpu_count", lambda: 4)
    monkeypatch.setattr(devices, "physical_gpu_count", lambda: 0)
    per_worker = devices.BATCHES_PER_CPU_WORKER * 4096
    assert [devices.resolve("auto", None, None, n)[1:] for n in (None, 10, per_worker, per_worker + 1,
                                                                  3 * per_worker, 100 * per_worker)] == \
        [(4, 1), (1, 1), (1, 1), (2, 1), (3, 1), (4, 1)]
    assert devices.resolve("0", None, None, 100, tokens_per_batch=25)[1] == 1     # 100 tokens = 4 batches of 25
    assert devices.resolve("0", None, None, 101, tokens_per_batch=25)[1] == 2
    assert devices.resolve("auto", 3, None, 10)[1:] == (3, 1)      # --workers is obeyed
    plain, packed = tmp_path / "a.fa", tmp_path / "b.fa.gz"
    plain.write_text(">a\nMKV\n")
    packed.write_bytes(gzip.compress(b">b\n" + b"M" * 5000 + b"\n"))
    assert devices.input_size([str(plain)]) == 7
    assert devices.input_size([str(plain), str(packed)]) == 7 + 5 * packed.stat().st_size
    os.mkfifo(tmp_path / "pipe")
    assert devices.input_size([str(plain), str(tmp_path / "pipe")]) is None    # a pipe's size is not its text's
    assert devices.input_size([str(tmp_path / "missing.fa")]) is None
    # Through run_config, as `run` and the Python API resolve them: 3 residues run on one worker, with the threads
    # a worker has when there are four (its idle threads would spin on a busy machine's cores)
    small = run_shards.run_config(str(plain), tmp_path / "o", gpus=0)
    assert (small.workers, small.threads_per_worker) == (1, 1)
    assert run_shards.run_config(str(plain), tmp_path / "o", gpus=0, threads=3).threads_per_worker == 3
    big = tmp_path / "big.fa"
    big.write_text("".join(f">s{i}\n{'MKV' * 100}\n" for i in range(200)))   # ~62k bytes: 4 workers' worth
    assert run_shards.run_config(str(big), tmp_path / "o", gpus=0).workers == 4
    assert run_shards.run_config(str(big), tmp_path / "o", gpus=0, max_tokens_per_batch=8192).workers == 2


def test_counting_gpus_imports_no_torch():
    """The parent counts GPUs through the driver's NVML library (or /proc where there is none), never through torch:
    importing torch alone took 3.4 s of a run's start on an H100 machine. Without a driver the count is /proc's."""
    import glob
    import subprocess
    probe = ("import sys; sys.path.insert(0, %r); from pipeline.planning import devices; "
             "n = devices.physical_gpu_count(); assert 'torch' not in sys.modules, 'torch imported'; print(n)"
             % str(Path(__file__).resolve().parents[1]))
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    if torch.cuda.is_available():
        assert int(res.stdout) >= 1
    else:
        assert int(res.stdout) == len(glob.glob("/proc/driver/nvidia/gpus/*"))


FLUSH_PROBE = """
import sys, torch
sys.path.insert(0, {repo!r})
from pipeline.worker.cpu_setup import set_cpu_threads
{before}
ok = set_cpu_threads(2, {flush})
# a denormal result computed on every thread: 1e-30 * 1e-10 is below float32's smallest normal (1.2e-38)
print(ok, int(((torch.full((1 << 20,), 1e-30) * 1e-10) != 0).sum()))
"""


@pytest.mark.parametrize("before, flush, flushed", [
    ("", True, True),   # as a worker: set before any multi-threaded op, so every thread flushes
    # a pool started before the flush keeps denormals on its other thread, and the check says so
    ("torch.set_num_threads(2); (torch.ones(1 << 20) * 2).sum()", True, False),
    ("", False, False),   # what benchmarks' --keep-denormals asks for
])
def test_cpu_threads_flush_denormals_on_every_thread(before, flush, flushed):
    import subprocess
    import sys
    from pathlib import Path
    code = FLUSH_PROBE.format(repo=str(Path(__file__).resolve().parents[1]), before=before, flush=flush)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    ok, kept = out.split()
    assert ok == str(flushed) and (int(kept) == 0) == flushed


MALLOC_PROBE = """
import ctypes, sys
sys.path.insert(0, {repo!r})
from pipeline.worker.cpu_setup import keep_freed_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
ok = keep_freed_memory() if {keep} else False
before = libc.mallinfo2().hblks
block = libc.malloc(8 << 20)                   # a tensor-sized block: 8 MiB
mmapped = libc.mallinfo2().hblks - before      # served by its own mmap?
libc.free(block)
print(ok, mmapped, libc.mallinfo2().arena >= 8 << 20)   # ... and still held by malloc after the free?
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("keep", [True, False])
def test_keep_freed_memory_serves_tensor_sized_blocks_from_a_kept_heap(keep):
    """With keep_freed_memory an 8 MiB block comes from malloc's heap and stays there after free, so the
    next tensor reuses its pages instead of faulting in new ones; glibc's defaults mmap it and unmap it."""
    import subprocess
    from pathlib import Path
    code = MALLOC_PROBE.format(repo=str(Path(__file__).resolve().parents[1]), keep=keep)
    ok, mmapped, kept = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True).stdout.split()
    assert (ok, mmapped, kept) == (("True", "0", "True") if keep else ("False", "1", "False"))


def test_plan_batches_padded_and_ragged():
    tokens = np.array([100, 90, 50, 50, 10, 10, 10])
    padded = plan_batches(tokens, 200, 8, padded=True)
    assert padded == [(0, 2), (2, 6), (6, 7)]          # 2 x 100, 4 x 50, then 1 x 10
    ragged = plan_batches(tokens, 200, 8, padded=False)
    assert ragged == [(0, 2), (2, 7)]                  # 190, then 130
    assert plan_batches(np.array([500, 10]), 100, 8, padded=True) == [(0, 1), (1, 2)]   # too long: alone
    assert plan_batches(np.array([1] * 10), 100, 3, padded=False) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert sum(b - a for a, b in plan_batches(np.sort(np.random.default_rng(0).integers(1, 99, 500))[::-1],
                                              300, 16, padded=True)) == 500
    # Counted tokens need not fall where residues do (a subword token covers several): a padded batch costs its
    # longest sequence, wherever it sits, times its size.
    assert plan_batches(np.array([10, 100, 10, 10]), 200, 8, padded=True) == [(0, 2), (2, 4)]
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 120, 400)
    batches = plan_batches(tokens, 300, 16, padded=True)
    assert [a for a, _ in batches[1:]] == [b for _, b in batches[:-1]] and batches[-1][1] == 400
    assert all(tokens[a:b].max() * (b - a) <= 300 for a, b in batches)


def test_tokenizer_truncation_keeps_special_tokens():
    tok = SequenceTokenizer(demo_model.build_tokenizer(), max_tokens=6)
    assert tok.char_level and tok.num_special == 2
    full, cut, odd = tok.encode(["MKV", "MKVLAAG", "MKJ"])
    assert full.ids == [1, 14, 12, 21, 2] and not full.truncated            # <bos> M K V <eos>
    assert cut.ids == [1, 14, 12, 21, 13, 2] and cut.truncated              # <bos> M K V L <eos>
    assert cut.special.tolist() == [True] + [False] * 4 + [True]
    assert odd.unknown and not full.unknown
    assert tok.tokens_for_residues(np.array([3, 7])).tolist() == [5, 9]


def test_char_level_tokenizers_give_one_token_per_residue(tmp_path):
    """ESM's tokenizer turns a run of unknown characters into one <unk>, which would shift every later
    residue's per-residue row: each unknown character gets its own unknown token."""
    from transformers import EsmTokenizer

    from .tiny_models import ESM_VOCAB
    (tmp_path / "vocab.txt").write_text("\n".join(ESM_VOCAB) + "\n")
    esm = EsmTokenizer(str(tmp_path / "vocab.txt"))
    assert len(esm("ACDJJK")["input_ids"]) == 7          # the merging this guards against
    tok = SequenceTokenizer(esm)
    odd, plain = tok.encode(["ACDJJK", "ACD"])
    unk, A, K = esm.unk_token_id, esm.convert_tokens_to_ids("A"), esm.convert_tokens_to_ids("K")
    assert odd.ids[0] == esm.cls_token_id and odd.ids[-1] == esm.eos_token_id and len(odd.ids) == 8
    assert odd.ids[1] == A and odd.ids[4:7] == [unk, unk, K] and odd.unknown
    assert odd.special.tolist() == [True] + [False] * 6 + [True]
    assert plain.ids == esm("ACD")["input_ids"] and not plain.unknown


def test_ragged_gather_index():
    assert ragged_arange(np.array([5, 0, 2]), np.array([2, 0, 3])).tolist() == [5, 6, 2, 3, 4]


def test_pooling_and_scoring_definitions():
    """Hand-made ragged output: two sequences <s> a b </s> and <s> c </s>."""
    info = EngineInfo("test", hidden_size=2, num_layers=1, is_causal=True, max_tokens=None)
    config = RunConfig(fasta=["x"], out="o", pools=["mean", "cls", "last"], layers=[-1, 0], per_residue=True,
                       per_residue_dtype="float32")
    hidden = torch.tensor([[1., 1.], [2., 4.], [4., 8.], [9., 9.], [3., 3.], [5., 7.], [6., 6.]])
    out = ForwardOutput(cu_seqlens=torch.tensor([0, 4, 7]), hidden={1: hidden, 0: -hidden},
                        token_logprobs=torch.tensor([0., -1., -2., -4., 0., -0.5, -8.]))

    class T:
        def __init__(self, special):
            self.special = np.array(special)
    toks = [T([True, False, False, True]), T([True, False, True])]
    embed = EmbedTask(config, info)
    embed.tokenizer = types.SimpleNamespace(one_token_per_residue=True)   # as prepare() finds for a residue vocabulary
    res = embed.compute(out, toks)
    assert res.columns["embeddings/mean"].tolist() == [[3., 6.], [5., 7.]]
    assert res.columns["embeddings/cls"].tolist() == [[1., 1.], [3., 3.]]
    assert res.columns["embeddings/last"].tolist() == [[9., 9.], [6., 6.]]
    assert res.columns["embeddings/mean_layer0"].tolist() == [[-3., -6.], [-5., -7.]]
    assert res.values["per_residue/values"].tolist() == [[2., 4.], [4., 8.], [5., 7.]]
    assert res.lengths["per_residue"].tolist() == [2, 1]
    score = ScoreTask(dataclasses.replace(config, per_residue=False), info).compute(out, toks)
    assert score.columns["score/logprob_sum"].tolist() == [-3.0, -0.5]   # specials and first token excluded
    assert score.columns["score/num_scored"].tolist() == [2, 1]
    with pytest.raises(UserError, match="a causal LM, or a masked LM"):   # an encoder without its masked-LM head
        score_task(config, EngineInfo("test", 2, 1, is_causal=False, max_tokens=None))


def test_resolve_layers():
    assert resolve_layers([-1, 0, 2, -1], 4) == [4, 0, 2]
    assert same_layers([-1, 0, 2, -1, 4, -5], 4) == [[-1, -1, 4], [0, -5]] and same_layers([-1, 1], 4) == []
    with pytest.raises(UserError, match="--layers 5 is out of range"):
        resolve_layers([5], 4)


def test_demo_model_weights_are_fixed():
    """Every machine must materialise bit-identical demo weights: pin their digest."""
    model = demo_model.build_model()
    assert demo_model.weights_digest(model) == demo_model.WEIGHTS_DIGEST
    assert sum(p.numel() for p in model.parameters()) < 300_000
    assert model.config.layer_types.count("linear_attention") == 3


@pytest.mark.parametrize("args,message", [
    (["--workers", "0"], "'--workers': 0 is not in the range 1<=x<=4096"),
    (["--max-tokens-per-batch", "0"], "'--max-tokens-per-batch': 0 is not in the range 1<=x<=2147483647"),
    (["--max-seqs", "0"], "'--max-seqs': 0 is not in the range x>=1"),
    (["--worker-timeout", "0"], "'--worker-timeout': 0.0 is not in the range x>0"),
    (["--max-length", "-3"], "'--max-length': -3 is not in the range x>=1"),
    (["--top-p", "0"], "'--top-p': 0.0 is not in the range 0<x<=1"),
    (["--seed", "-1"], "'--seed': -1 is not in the range 0<=x<=18446744073709551615"),   # (-1 is not "random")
    (["--workers", "1180591620717411303424"], "'--workers': 1180591620717411303424 is not in the range 1<=x<=4096"),
    (["--threads", "9223372036854775808"], "'--threads': 9223372036854775808 is not in the range 1<=x<=4096"),
    (["--shards", "1000001"], "'--shards': 1000001 is not in the range 1<=x<=1000000"),
    (["--task", "generate", "--max-new-tokens", "9223372036854775808"],
     "'--max-new-tokens': 9223372036854775808 is not in the range 1<=x<=2147483647"),
    (["--max-tokens-per-batch", "2147483648"],
     "'--max-tokens-per-batch': 2147483648 is not in the range 1<=x<=2147483647"),
    (["--worker-timeout", "nan"], "'--worker-timeout': 'nan' is not a number"),   # NaN passes every bound
    (["--checkpoint-seconds", "-NaN"], "'--checkpoint-seconds': '-NaN' is not a number"),
    (["--temperature", "0.7"], "--temperature applies only to --task generate (this run's task is embed)"),
    (["--task", "score", "--pool", "cls", "--layers", "1"], "--pool, --layers apply only to --task embed"),
    (["--task", "generate", "--per-residue"], "--per-residue applies only to --task embed"),
])
def test_cli_rejects_option_mistakes_before_any_work(tmp_path, args, message):
    from click.testing import CliRunner

    from pipeline import cli
    result = CliRunner().invoke(cli.main, ["run", "x.fasta", "--out", str(tmp_path / "o"), *args])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "o").exists()


def test_run_directory_never_overwrites_foreign_files(tmp_path):
    from pipeline.errors import RunDirError
    from pipeline.rundir.layout import RunDir

    (tmp_path / "afile").write_text("x")
    with pytest.raises(RunDirError, match="is a file, not a directory"):
        RunDir(tmp_path / "afile").create()
    with pytest.raises(RunDirError, match="cannot create the output directory .*afile/sub: Not a directory"):
        RunDir(tmp_path / "afile" / "sub").create()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "result.h5").write_text("precious")
    with pytest.raises(RunDirError, match=r"already holds files that are not a run_shards run \(result.h5\)"):
        RunDir(foreign).create()
    assert (foreign / "result.h5").read_text() == "precious" and sorted(foreign.iterdir()) == [foreign / "result.h5"]
    early = tmp_path / "early"   # a run stopped before its manifest was written: reusable
    for d in ("shards", "logs"):
        (early / d).mkdir(parents=True)
    (early / ".lock").write_text("")
    (early / "index.rsidx").write_text("")
    RunDir(early).create()


def test_a_misspelt_command_is_named_as_one(tmp_path, monkeypatch):
    """`run_shards statsu OUT` ran `run` on a FASTA named 'statsu' and said "file not found"; a file of that
    name is still a FASTA (the default command), and so is a missing path that looks like one."""
    from click.testing import CliRunner

    from pipeline import cli
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli.main, ["statsu", "OUT"])
    assert result.exit_code == 2, result.output
    assert "no such command 'statsu' (and no FASTA file of that name). Did you mean 'status'?" in result.output
    assert "Did you mean 'merge'?" in CliRunner().invoke(cli.main, ["merg", "OUT"]).output
    (tmp_path / "merg").write_text(">a\nMKV\n")
    for fasta in (["merg"], ["status.fa"]):
        result = CliRunner().invoke(cli.main, [*fasta, "--out", "o", "--task", "generate", "--pool", "cls"])
        assert result.exit_code == 2 and "--pool applies only to --task embed" in result.output, result.output


@pytest.mark.parametrize("args,named", [
    (["run", "x.fasta", "--out", ""], "'--out' / '-o'"),   # (was the current directory: the run written there)
    (["run", ""], "'FASTA...'"),                           # (was "CWD: is a directory, not a FASTA file")
    (["status", ""], "'OUT'"),
    (["get", "o", "a", "-o", ""], "'--output' / '-o'"),
])
def test_an_empty_path_is_named_as_one(tmp_path, monkeypatch, args, named):
    from click.testing import CliRunner

    from pipeline import cli
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for {named}: '' is an empty path (an unset shell variable?)" in result.output
    assert list(tmp_path.iterdir()) == []


def test_merge_refuses_a_lock_wait_of_nan(tmp_path):
    """`merge --lock-wait nan` waited forever for a run another command held: no time is >= now + NaN."""
    from click.testing import CliRunner

    from pipeline import cli
    result = CliRunner().invoke(cli.main, ["merge", str(tmp_path / "o"), "--lock-wait", "nan"])
    assert result.exit_code == 2 and "'--lock-wait': 'nan' is not a number" in result.output, result.output


@pytest.mark.parametrize("args,message", [
    (["index", "x.fasta", "--workers", "9223372036854775808"],   # (a shard table of that many: MemoryError)
     "'--workers': 9223372036854775808 is not in the range 1<=x<=1000000"),
    (["work", "o", "--shard", "1000000"], "'--shard': 1000000 is not in the range 0<=x<=999999"),
    (["work", "o", "--shards-per-task", "2000000"],
     "'--shards-per-task': 2000000 is not in the range 1<=x<=1000000"),
    (["rerun", "o", "--shards", "1-2,\u00b2"], "expected comma-separated shard numbers or ranges"),   # (a digit)
    (["rerun", "o", "--shards", "5-3"], "expected comma-separated shard numbers or ranges"),
    (["rerun", "o", "--shards", "1-" + "9" * 5000], "expected comma-separated shard numbers or ranges"),
])
def test_commands_refuse_counts_past_their_bounds(tmp_path, monkeypatch, args, message):
    from click.testing import CliRunner

    from pipeline import cli
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert sorted(tmp_path.iterdir()) == []


def test_rerun_refuses_shard_ranges_past_the_run_before_counting_them_out(tmp_path):
    """`rerun --shards 0-9223372036854775808` failed with an OverflowError, and `0-20000000` of a 1-shard run
    built 20 million numbers (27 s, 1.8 GB) before saying the run has one shard: ranges are checked whole."""
    from click.testing import CliRunner

    from pipeline import cli
    from pipeline.rundir.layout import RunDir
    run = RunDir(tmp_path / "o")
    run.create()
    run.write_manifest({"config": json.loads(RunConfig(fasta=["x.fa"], out=str(run.root)).to_json()), "world": 2})
    for shards, bad in [("0-9223372036854775808", "2-9223372036854775808"),
                        (f"5,1-{10**18},7-9,3", f"2-{10**18}"), ("0,4", "4")]:
        result = CliRunner().invoke(cli.main, ["rerun", str(run.root), "--shards", shards])
        assert result.exit_code == 2 and f"error: --shards {bad}: this run has shards 0..1" in result.output, \
            result.output


def test_shard_lists_and_array_ranges_keep_ranges_whole():
    from pipeline.cli import _shard_list
    from pipeline.launchers.sbatch_scripts import array_ranges, merged_ranges
    assert _shard_list("3, 17,20-22,") == [range(3, 4), range(17, 18), range(20, 23)]
    assert _shard_list(f"0-{2**64}") == [range(0, 2**64 + 1)]
    assert _shard_list(None) == []   # no --shards: every unfinished shard
    for nothing in ("", " , "):   # a script's `--shards "$FAILED"` with nothing in it: not every shard either
        with pytest.raises(click.BadParameter, match="no shard numbers given; leave --shards out"):
            _shard_list(nothing)
    assert merged_ranges([range(20, 23), 3, 17, range(21, 25), 2, range(4, 4)]) == \
        [range(2, 4), range(17, 18), range(20, 25)]
    assert array_ranges([range(1, 2**63 + 1), 0, 5]) == "0-9223372036854775808"


def test_index_workers_are_bounded_as_shards_and_summarised(tmp_path):
    """`index --workers` is the shard count W it describes the split of: bounded as --shards (10**8 ran 157 s
    and ended in MemoryError), and above LISTED_SHARDS summarised in one line, as a run's log does."""
    from pipeline import commands
    fasta = tmp_path / "a.fasta"
    fasta.write_text(">a\nMKV\n>b\nMK\n")
    with pytest.raises(UserError, match="--workers must be at most 1000000"):
        commands.index(fasta, 10**6 + 1)
    text = commands.index(fasta, 1000)
    assert "stride split over 1000 worker(s): max/mean tokens" in text and "sequences per worker 0..1" in text
    assert "worker 0:" not in text
    assert "  worker 1: 1 sequences, 2 residues" in commands.index(fasta, 2)


@pytest.mark.parametrize("make", [lambda p: None, lambda p: p.mkdir()])
def test_rerun_of_a_directory_that_is_not_a_run(tmp_path, make):
    from click.testing import CliRunner

    from pipeline import cli
    make(tmp_path / "o")
    result = CliRunner().invoke(cli.main, ["rerun", str(tmp_path / "o")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "no such run directory" in result.output or "not a run_shards output directory" in result.output
    assert not (tmp_path / "o" / ".lock").exists()


def test_cpu_norm_blocks_cover_every_row_and_empty_inputs():
    """CPU norms go a block of rows at a time (norms.CPU_BLOCK_BYTES): blocks tile the rows exactly, a
    tensor of one block or none is normalised whole, and the result equals the whole-tensor form's."""
    from pipeline.models.layers import norms

    x = torch.randn(300, 4, 128).bfloat16()     # 2 KiB of float32 a row: 256 rows a block
    blocks = norms.cpu_row_blocks(x)
    assert [(b.start, b.stop) for b in blocks] == [(0, 256), (256, 512)]
    assert norms.cpu_row_blocks(x[:256]) is None and norms.cpu_row_blocks(x[:0]) is None
    norm = norms.RMSNorm(128, 1e-6, zero_centred=True)
    norm.weight.normal_()
    assert norm(x[:0]).shape == (0, 4, 128)
    whole = norms.rms_normalise(x, 1e-6, 1.0 + norm.weight.float()).to(x.dtype)
    assert torch.equal(norm(x), whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_in_place_equals_the_concatenated_form(dtype):
    """Qwen3.5 rotates a quarter of each head, in place over its norm's output: the same values as the
    concatenating form, written into x, the unrotated channels untouched; a full rotation is unchanged."""
    from pipeline.models.layers.rotary import Rotary

    torch.manual_seed(0)
    rotary = Rotary(1.0 / 10000 ** (torch.arange(0, 32, 2).float() / 32))   # rotary_dim 32 of 128
    cos, sin = rotary.cos_sin(torch.arange(50) * 7 % 300, dtype)
    x = torch.randn(50, 3, 128, dtype=dtype)
    expected = rotary.apply(x, cos, sin)
    assert not torch.equal(expected[..., :32], x[..., :32])   # the rotation does something
    given = x.clone()
    out = rotary.apply(given, cos, sin, in_place=True)
    assert out.data_ptr() == given.data_ptr() and torch.equal(out, expected)
    assert torch.equal(out[..., 32:], x[..., 32:])
    full = Rotary(1.0 / 10000 ** (torch.arange(0, 128, 2).float() / 128))
    cos, sin = full.cos_sin(torch.arange(50), dtype)
    y = x.clone()
    assert torch.equal(full.apply(y, cos, sin, in_place=True), full.apply(x, cos, sin)) and torch.equal(y, x)


@pytest.mark.parametrize("dtype,float32_math", [(torch.float32, False), (torch.bfloat16, False),
                                                (torch.bfloat16, True), (torch.float16, True)])
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_rotary_is_transformers_rotate_half_bit_for_bit(dtype, float32_math, rotary_dim):
    """Rotary.apply writes x * cos + rotate_half(x) * sin half by half: the same bits as transformers'
    apply_rotary_pos_emb (the rotate_half form, computed here as its modeling code spells it), in the model
    dtype or in float32 as ESM rotates, for full and partial rotations."""
    from pipeline.models.layers.rotary import Rotary

    torch.manual_seed(0)
    rotary = Rotary(1.0 / 10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim), float32_math=float32_math)
    cos, sin = rotary.cos_sin(torch.arange(300) * 5 % 1000, dtype)
    x = torch.randn(300, 4, 16, dtype=dtype)
    rot = x[..., :rotary_dim].float() if float32_math else x[..., :rotary_dim]
    half = rotary_dim // 2
    rotate_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    expected = torch.cat(((rot * cos + rotate_half * sin).to(dtype), x[..., rotary_dim:]), dim=-1)
    assert torch.equal(rotary.apply(x, cos, sin), expected)
    assert torch.equal(rotary.apply(x[:, :2], cos, sin), expected[:, :2])   # a strided view (ESM's k of qkv)


def test_registry_position_tables_agree_with_building_the_model():
    """The planning shortcut (a registry family's position_table reads the learned table's size off the config,
    without building the model) agrees with building the model on the meta device, for every family that has
    one: rotary and relative-position families have none, ESM's depends on its position type and pad id; and a
    learned table is still found by building."""
    from transformers import (EsmConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3_5TextConfig,
                              Qwen3Config, T5Config)

    from pipeline.models import hf_config, registry
    small = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    esm = dict(vocab_size=33, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
               max_position_embeddings=1026)
    t5 = dict(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    esm_configs = [EsmConfig(**esm, position_embedding_type="rotary", pad_token_id=1),
                   EsmConfig(**esm, position_embedding_type="absolute", pad_token_id=1),   # ESM-1b: 1024
                   EsmConfig(**esm, pad_token_id=0), EsmConfig(**esm, pad_token_id=None)]
    configs = {"llama": [LlamaConfig(**small)], "qwen3": [Qwen3Config(head_dim=8, **small)],
               "qwen3_5": [Qwen3_5TextConfig(head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2,
                                             linear_key_head_dim=8, linear_value_head_dim=8, **small)],
               "mistral": [MistralConfig(**small)], "qwen2": [Qwen2Config(**small)],
               "esm": esm_configs, "saprot": esm_configs, "nucleotide_transformer": esm_configs,
               "prott5": [T5Config(**t5)], "prostt5": [T5Config(**t5)],
               "ankh": [T5Config(**t5, tie_word_embeddings=False)]}
    families = {f.key: f for f in registry.FAMILIES}
    assert set(configs) == {k for k, f in families.items() if f.position_table is not None}
    answers = set()
    for name, cases in configs.items():
        for config in cases:
            answers.add(families[name].position_table(config))
            assert families[name].position_table(config) == hf_config.position_table_tokens(config), (name, config)
    assert answers == {None, 1024, 1025, 1026}   # each ESM case differs, so each was really compared
    assert hf_config.position_table_tokens(GPT2Config(n_positions=64, n_embd=32, n_layer=1, n_head=4)) == 64


@pytest.mark.parametrize("kind", ["esm2", "llama"])
def test_checkpoint_loads_to_the_same_bits_without_a_sentinel_fill(kind, tmp_path, monkeypatch):
    """The loader allocates parameters without filling them first (materialize) and knows which it wrote by
    their version counters (check_loaded): the model loads to exactly the bits it loaded to when every
    parameter was NaN-filled first, and its embedding table is the checkpoint's."""
    from safetensors import safe_open

    from pipeline.models import registry
    from pipeline.models.layers import loader
    from tests.tiny_checkpoints import write_tiny
    path = write_tiny(kind, tmp_path / kind)
    model = registry.load_model(str(path), torch.device("cpu"), torch.float32)
    fast = {k: v.clone() for k, v in model.state_dict().items()}
    materialize = loader.materialize

    def filled_first(module, device, dtype):   # the sentinel pass the loader used to make
        materialize(module, device, dtype)
        with torch.no_grad():
            for p in module.parameters():
                p.fill_(float("nan"))
    for owner in (loader, sys.modules[type(model).__module__]):
        if hasattr(owner, "materialize"):
            monkeypatch.setattr(owner, "materialize", filled_first)
    slow = registry.load_model(str(path), torch.device("cpu"), torch.float32).state_dict()
    assert fast.keys() == slow.keys()
    assert all(torch.equal(fast[k], slow[k]) for k in fast), [k for k in fast if not torch.equal(fast[k], slow[k])]
    assert not any(torch.isnan(v).any() for v in fast.values() if v.is_floating_point())
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        name = next(n for n in f.keys() if n.endswith("embed_tokens.weight") or n.endswith("word_embeddings.weight"))
        table = next(v for k, v in fast.items() if k.endswith(("embed_tokens.weight", "word_embeddings.weight")))
        assert torch.equal(table, f.get_tensor(name))


def test_check_loaded_names_a_parameter_the_loader_did_not_write():
    """A parameter never written (still as materialize allocated it) is named; one written in place, or replaced
    by a written one (a tied embedding), is not."""
    from pipeline.models.layers.loader import check_loaded, materialize
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 4))
    materialize(model, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        model[0].weight.copy_(torch.ones(4, 4))
        model[0].bias.copy_(torch.zeros(4))
        model[1].weight.copy_(torch.ones(4))
        model[2].weight = model[0].weight   # tied to a written parameter
    with pytest.raises(AssertionError, match=r"parameters not loaded from the checkpoint: \['1.bias', '2.bias'\]"):
        check_loaded(model, "tiny")
    with torch.no_grad():
        model[1].bias.zero_()
        model[2].bias.copy_(torch.ones(4))
    check_loaded(model, "tiny")


def test_gpu_workers_keep_triton_kernels_in_the_run_shards_cache(tmp_path, monkeypatch):
    """TRITON_CACHE_DIR: run_shards' cache folder's triton/ when the user set none; theirs when they did; Triton's
    own default when the folder cannot be made."""
    import os

    from pipeline.worker.process_setup import use_kernel_cache
    monkeypatch.setenv("RUN_SHARDS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    use_kernel_cache()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "cache" / "triton")
    assert (tmp_path / "cache" / "triton").is_dir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    use_kernel_cache()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    monkeypatch.delenv("TRITON_CACHE_DIR")
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("RUN_SHARDS_CACHE", str(tmp_path / "file"))   # triton/ cannot be made below a file
    use_kernel_cache()
    assert "TRITON_CACHE_DIR" not in os.environ


def test_read_ahead_reads_the_weights_and_leaves_errors_to_the_load(tmp_path):
    """The read-ahead thread ends after reading every weight file; a checkpoint that is not there (or not
    readable) raises nothing in the caller, whose load then says what is wrong."""
    from pipeline.models.checkpoint import read_ahead
    (tmp_path / "model.safetensors").write_bytes(b"x" * (9 << 20))
    (tmp_path / "config.json").write_text("{}")
    thread = read_ahead(tmp_path)
    thread.join(30)
    assert not thread.is_alive()
    gone = read_ahead(tmp_path / "missing")
    gone.join(30)
    assert not gone.is_alive()


def test_weight_values_counts_what_a_load_holds_from_the_headers_alone(models):
    """planning/model_copies.py sizes a CPU worker's copy of the model from its safetensors headers: the values
    of the checkpoint's parameters (and saved float buffers, e.g. ESM's rotary frequencies), none of its integer
    buffers, counted without reading a tensor; against the model transformers loads from the same folder."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    from pipeline.models.checkpoint_facts import weight_values
    for name, cls in (("esm", AutoModelForMaskedLM), ("llama", AutoModelForCausalLM), ("qwen3", AutoModelForCausalLM)):
        model = cls.from_pretrained(models[name])
        parameters = sum(p.numel() for p in model.parameters())
        floats = sum(b.numel() for b in model.buffers() if b.is_floating_point())
        assert parameters <= weight_values(Path(models[name])) <= parameters + floats, name


def test_a_run_planned_before_its_longest_prompt_was_recorded_holds_its_limit_in_the_cache():
    """Workers size the KV cache for the longest prompt the plan recorded; a run planned before the plan
    recorded it (and continued by this version) sizes it for the run's limit, as it was planned."""
    from pipeline.worker.shard_run import longest_prompt_of
    assert longest_prompt_of({"max_tokens": 1026, "longest_prompt": 300}) == 300
    assert longest_prompt_of({"max_tokens": 1026}) == 1026
    assert longest_prompt_of({"max_tokens": None, "longest_prompt": 5002}) == 5002


@pytest.mark.parametrize("task, extra, policy", [("embed", {}, "window"), ("score", {}, "window"),
                                                 ("generate", {}, "truncate"), ("variants", {"variants": "v.csv"}, "skip"),
                                                 ("embed", {"on_long": "window", "window": 5000, "overlap": 100}, "window"),
                                                 ("embed", {"on_long": "truncate"}, "truncate")])
def test_a_lower_max_length_in_a_caches_refusal_comes_with_a_policy_the_task_allows(tmp_path, task, extra, policy):
    """The new run a caches refusal names with a lower --max-length keeps every record the task can: the records
    over it as windows for embed and score, truncated when generating, skipped for variants (the policies each
    task allows), where the run had --on-long error; a policy the run chose stays; a window planned for the old
    limit gives way to the new one. The command it names is one the CLI accepts (RunConfig.validate)."""
    from pipeline.engine.config import CachesTooLarge
    from pipeline.worker.shard_run import _within_length, caches_advice
    config = RunConfig(fasta=["in.fa"], out=str(tmp_path / "out"), task=task, **extra)
    config.validate()
    advice = caches_advice(CachesTooLarge("the engine's caches need more", {"max_length": 2080}), config, tmp_path / "out")
    command = advice.split("`")[1].split()
    assert command[command.index("--max-length") + 1] == "2080" and command[command.index("--on-long") + 1] == policy
    assert command[command.index("--out") + 1] != str(tmp_path / "out")   # another run, in another --out
    assert "--window" not in command and "--overlap" not in command
    assert (f"--on-long {policy})" in advice) == ("on_long" not in extra)
    changed, _ = _within_length(dataclasses.replace(config, max_length=2080), config)
    changed.validate()   # what the CLI refuses (a policy the task does not allow, a window over the limit)
    assert changed.as_command(command[command.index("--out") + 1]).split() == command


def test_ensure_space_gives_the_remedy_its_reason(tmp_path):
    """The check before a write says what lifts it for the reason it found: a file size limit is not lifted by
    freeing space (its message said "see ulimit -f" and then the callers' "free space and run ...")."""
    import resource
    from pipeline.errors import DiskFull, ensure_space, make_room
    remedy = lambda reason: f"{make_room(reason)} and run it again"  # noqa: E731
    with pytest.raises(DiskFull, match=r"\(no space left on the device\)\. free space and run it again"):
        ensure_space(tmp_path, 1 << 62, "x", remedy)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))
    try:
        with pytest.raises(DiskFull, match=r"\(the file size limit was reached\)\. raise the file size limit "
                                           r"\(`ulimit -f`\) and run it again"):
            ensure_space(tmp_path, 5000, "x", remedy)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_refused_command_names_the_live_holder_that_just_took_over_a_dead_runs_lock(tmp_path):
    """A command that takes over a dead run's OUT/.lock writes its own record right after taking the flock; a
    second command refused in between read the dead run's record and named it as the holder (a chaos red team's
    finding). The refusal now reads the record again while it names a process that is gone."""
    import fcntl
    import json
    import socket
    import threading

    from pipeline.errors import RunDirError
    from pipeline.processes import process_start
    from pipeline.rundir.layout import RunDir
    from pipeline.rundir.locks import RunLock

    out = tmp_path / "out"
    out.mkdir()
    lock = out / ".lock"
    lock.write_text(json.dumps({"pid": 999999, "host": socket.gethostname(), "purpose": "run", "since": "then"}))
    taker = os.open(lock, os.O_RDWR)   # the command taking over: its flock first, its record 0.3 s later
    fcntl.flock(taker, fcntl.LOCK_EX)
    live = {"pid": os.getpid(), "host": socket.gethostname(), "purpose": "rerun", "since": "now",
            "start": process_start(), "inode": os.fstat(taker).st_ino}
    writer = threading.Timer(0.3, lambda: (os.ftruncate(taker, 0), os.pwrite(taker, json.dumps(live).encode(), 0)))
    writer.start()
    try:
        with pytest.raises(RunDirError) as refused:
            RunLock(RunDir(out), "run").acquire()
    finally:
        writer.join()
        os.close(taker)
    assert f"pid {os.getpid()} on {socket.gethostname()}, `rerun`" in str(refused.value), refused.value
    assert "999999" not in str(refused.value)
