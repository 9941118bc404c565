"""The sync audit (pipeline/engine/sync_audit.py) and the budget it holds the engine to.

First the audit itself: on purpose-made snippets it flags each kind of op that makes the host wait for a GPU,
and nothing for the copies that do not (pinned, non-blocking) nor for work that stays on one side. Then the
budget, on the native engine with tiny checkpoints, after one warm-up batch (a steady state: caches
allocated): one embed batch and one pseudo-log-likelihood batch launch with no sync at all, their results are
taken with one wait, and their device->host copies are the batch's last events; a generate step reads back
only its sampled tokens. Each on the engine's CPU path (the kernels' torch implementations) and on its GPU path
(the Triton kernels: compiled on a GPU, else the interpreter), whose kernel wrappers' host code is audited too.
"""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from pipeline.config import RunConfig
from pipeline.engine.native import NativeEngine, SamplingParams
from pipeline.engine.sync_audit import SYNC_KINDS, SyncAudit, describe
from pipeline.models.transfers import HostCopy, is_pinned, pinned_empty, to_device
from pipeline.tasks import make_task
from pipeline.tasks.tokenization import SequenceTokenizer

from .tiny_models import save_esm, save_llama

DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


def _events(device: torch.device, work, **audit) -> list[tuple[str, str]]:
    with SyncAudit(device, **audit) as a:
        work()
    return [(e.kind, e.op) for e in a.events]


def _offenders(dev: torch.device) -> dict:
    x = torch.arange(6.0, device=dev)   # made before the audit, like the model's weights: on the device
    idx = np.array([0, 2])
    return {
        "item": (lambda: x.sum().item(), "item"),
        "int": (lambda: int(x[1]), "item"),
        "bool": (lambda: bool(x[1] > 0), "item"),
        "tolist": (lambda: x.tolist(), "tolist"),
        "cpu": (lambda: x.cpu(), "cpu"),
        "numpy": (lambda: x.numpy() if dev.type == "cpu" else x.cpu().numpy(), "numpy" if dev.type == "cpu" else "cpu"),
        "nonzero": (lambda: x.nonzero(), "nonzero"),
        "where one argument": (lambda: torch.where(x > 2), "nonzero"),
        "unique": (lambda: torch.unique(x), "unique"),
        "bincount": (lambda: torch.bincount(x.long()), "bincount"),
        "masked_select": (lambda: x.masked_select(x > 2), "masked_select"),
        "repeat_interleave by a tensor": (lambda: torch.repeat_interleave(x, x.long()), "repeat_interleave"),
        "boolean index": (lambda: x[x > 2], "bool_index"),
        "boolean index_put": (lambda: x.clone().__setitem__(x > 2, 0.0), "bool_index"),
        "equal": (lambda: torch.equal(x, x), "equal"),
        "blocking host->device": (lambda: torch.from_numpy(idx).to(dev), "to_device_blocking"),
        "pageable host->device": (lambda: torch.from_numpy(idx).to(dev, non_blocking=True), "to_device_pageable"),
        "host index of a device tensor": (lambda: x[torch.from_numpy(idx)], "implicit_copy"),
        "device->host into pageable memory": (lambda: torch.from_numpy(np.empty(6, np.float32)).copy_(x, non_blocking=True),
                                               "to_host"),
    }


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_the_audit_flags_each_kind_of_sync(device):
    for name, (work, kind) in _offenders(device).items():
        events = _events(device, work)
        assert [k for k, _ in events] == [kind], f"{name}: {events}"


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_the_audit_passes_what_does_not_wait(device):
    x = torch.arange(6.0, device=device)
    idx = np.array([0, 2])
    quiet = {
        "repeat_interleave with an output size": lambda: torch.repeat_interleave(x, x.long(), output_size=15),
        "repeat_interleave by a number": lambda: torch.repeat_interleave(x, 2),
        "host arithmetic": lambda: torch.from_numpy(idx).sum().item(),
        "device arithmetic and conversions": lambda: (x.to(torch.float64), x.to(device), torch.zeros(3, device=device) + x[:3]),
    }
    for name, work in quiet.items():
        assert _events(device, work) == [], name
    assert _events(device, lambda: x[to_device([idx], device)[0]]) == [("to_device_async", "Tensor.to")]
    got = {}
    assert _events(device, lambda: got.update(HostCopy({"a": x * 2}).wait())) == [("to_host_async", "copy_"),
                                                                                   ("wait", "HostCopy.wait")]
    assert got["a"].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]


def test_kernel_internals_are_skipped_only_where_asked():
    """The kernels' torch implementations (triton_kernels/) stand for GPU kernels on the engine's CPU path: a
    read-back inside one is not the engine's; outside triton_kernels/ the same op is."""
    from triton_kernels.gated_delta_rule.layout import SequenceLayout
    cu = torch.tensor([0, 3, 5])
    cu = cu + 0   # made on the "device"
    read = lambda: SequenceLayout.from_inputs(types.SimpleNamespace(batch=1, seq_len=5), cu)   # noqa: E731
    cpu = torch.device("cpu")
    assert [k for k, _ in _events(cpu, read)] == ["tolist"]
    assert _events(cpu, read, torch_kernels=True) == []
    assert [k for k, _ in _events(cpu, lambda: cu.tolist(), torch_kernels=True)] == ["tolist"]


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_transfers_keep_values_dtypes_and_shapes(device):
    arrays = [np.array([True, False, True]), np.arange(7, dtype=np.int32), np.arange(12, dtype=np.int64).reshape(3, 4),
              np.zeros(0, np.int64), np.linspace(0, 1, 5, dtype=np.float32), np.arange(4, dtype=np.float64)[::2]]
    sent = to_device(arrays, device)
    for a, t in zip(arrays, sent):
        assert t.device.type == device.type and tuple(t.shape) == a.shape and t.is_contiguous()
        assert torch.from_numpy(np.ascontiguousarray(a)).to(device).equal(t), a
    back = HostCopy({str(i): t for i, t in enumerate(sent)}).wait()
    for i, a in enumerate(arrays):
        assert back[str(i)].dtype == a.dtype and np.array_equal(back[str(i)], a)
    buffer = pinned_empty(4, torch.float32, device)
    assert is_pinned(buffer) and is_pinned(buffer[1:]) and not is_pinned(torch.empty(4))


# ---- the engine's budget ---------------------------------------------------------------------------------

PATHS = [("cpu", torch.device("cpu"), None)]
if torch.cuda.is_available():
    PATHS.append(("gpu", torch.device("cuda"), "triton"))
else:
    import os
    if os.environ.get("TRITON_INTERPRET") == "1":
        PATHS.append(("triton-interpreter", torch.device("cpu"), "triton"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit")
    return {"esm": str(save_esm(root / "esm")), "llama": str(save_llama(root / "llama"))}


def _engine(path: str, device: torch.device, kernels: str | None, **options) -> NativeEngine:
    extra = {"kernels": kernels} if kernels else {}
    return NativeEngine.load(path, device, torch.float32, "", max_tokens_per_step=64, **extra, **options)


SEQUENCES = ["MKTAYIAKQR", "GSHM", "ACDEFGHIKLMNPQ"]


def _audited_batch(engine: NativeEngine, options: dict, device: torch.device, kernels: str | None):
    """(a warm-up batch's result, the audited batch's result, the events until its launch returned, the events
    of taking its result): one batch of SEQUENCES for the task `options` describe."""
    task = make_task(RunConfig(fasta=["x"], out="o", **options), engine.info, None)
    tokenizer = SequenceTokenizer(engine.tokenizer)
    task.prepare(tokenizer)
    toks = tokenizer.encode(SEQUENCES)
    keys = np.arange(len(toks))
    want = task.run(engine, toks, keys)   # the warm-up batch: caches allocated, kernels compiled
    with SyncAudit(device, torch_kernels=kernels is None) as audit:
        pending = task.launch(engine, toks, keys)
        launched = audit.take()
        got = pending.result()
        finished = audit.take()
    return want, got, launched, finished


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
@pytest.mark.parametrize("task_options, copies", [
    # 3 pools and per-residue values of 2 layers; a pseudo-log-likelihood's own terms and amino-acid table
    (dict(task="embed", pools=["mean", "cls", "last"], layers=[-1, 1], per_residue=True), 8),
    (dict(task="score", per_residue=True), 2),   # masked copies, the last layer at the masked rows only
], ids=["embed", "pll"])
def test_a_steady_batch_launches_without_a_sync_and_waits_once(checkpoints, path, task_options, copies):
    _, device, kernels = path
    want, got, launched, finished = _audited_batch(_engine(checkpoints["esm"], device, kernels), task_options, device,
                                                   kernels)
    assert [e for e in launched if e.kind in SYNC_KINDS] == [], describe(launched)
    assert [e.kind for e in finished] == ["wait"], describe(finished)
    # the results go to the host in copies that do not wait, queued last: nothing of the batch after them
    kinds = [e.kind for e in launched]
    first_out = kinds.index("to_host_async")
    assert set(kinds[first_out:]) == {"to_host_async"} and "to_device_async" in kinds[:first_out]
    assert kinds.count("to_host_async") == copies
    # and the numbers of a batch taken at once: the same bits on a CPU; on a GPU the mean pool's index_add_
    # adds in any order (atomics), so to float32 rounding
    same = np.array_equal if device.type == "cpu" else (lambda a, b: np.allclose(a, b, rtol=1e-5, atol=1e-6))
    for name, value in want.columns.items():
        assert same(value, got.columns[name]), name
    for name, value in want.values.items():
        assert same(value, got.values[name]), name


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.8, top_p=0.9, seed=3)], ids=["greedy", "top-p"])
def test_a_generate_step_reads_back_its_tokens_only(checkpoints, path, sampling):
    _, device, kernels = path
    engine = _engine(checkpoints["llama"], device, kernels, max_new_tokens=4)
    prompts, keys = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 4]], [0, 1, 2]
    params = SamplingParams(max_new_tokens=4, **sampling)
    want = engine.generate(prompts, keys, params)
    steps = engine.stats.steps
    with SyncAudit(device, torch_kernels=kernels is None) as audit:   # (a worker's heartbeat and stop between steps)
        got = engine.generate(prompts, keys, params, alive=lambda computed: True)
    steps = engine.stats.steps - steps
    assert steps >= 4
    assert [(e.kind, e.where.split(":")[0]) for e in audit.syncs] == [("tolist", "pipeline/engine/sampler.py")] * steps, \
        describe(audit.syncs)
    assert [(g.token_ids, g.finish_reason) for g in got] == [(g.token_ids, g.finish_reason) for g in want]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
def test_a_qwen35_step_runs_the_delta_rule_without_a_sync(tmp_path, monkeypatch, path):
    """A Qwen3.5 embed batch (delta-rule layers and gated attention), steps of at most 128 tokens so that the
    200-token sequence is prefilled in two steps, the second from its stored state; the walk cut into
    segments of 64 tokens (forced), so the segment chaining runs on the device: no sync from the batch's
    first copy to the device to its last copy back. On the Triton path the delta rule reads the sequences'
    bounds from the host's copy (cu_seqlens_cpu). The causal conv reads its tables back on purpose when its
    tensors are on the CPU (its checks, which a GPU call skips: triton_kernels/causal_conv/op.py), so
    on a CPU device those reads are left out of the count."""
    from tests.tiny_checkpoints import write_tiny
    from triton_kernels.gated_delta_rule import chunk as chunk_module, walk_layout

    _, device, kernels = path
    monkeypatch.setattr(walk_layout, "walk_segment_tokens", lambda *args: 64)
    segmented, continued = [], []
    walk = chunk_module._segmented_walk
    monkeypatch.setattr(chunk_module, "_segmented_walk", lambda *a, **k: segmented.append(1) or walk(*a, **k))
    import pipeline.models.layers.gated_deltanet as gdn
    chunked = gdn.chunk_gated_delta_rule
    monkeypatch.setattr(gdn, "chunk_gated_delta_rule",
                        lambda *a, **k: continued.append(k["initial_state"] is not None) or chunked(*a, **k))
    engine = NativeEngine.load(str(write_tiny("qwen3_5", tmp_path / "q")), device, torch.float32, "",
                               max_tokens_per_step=128, **({"kernels": kernels} if kernels else {}))
    task = make_task(RunConfig(fasta=["x"], out="o", task="embed", pools=["mean"]), engine.info, None)
    tokenizer = SequenceTokenizer(engine.tokenizer)
    task.prepare(tokenizer)
    residues = np.random.default_rng(5).choice(list("ACDEFGHIKLMNPQRSTVWY"), 280)
    toks = tokenizer.encode(["".join(residues[:198]), "".join(residues[198:258]), "".join(residues[258:])])
    keys = np.arange(len(toks))
    want = task.run(engine, toks, keys)   # the warm-up batch
    segmented.clear()
    continued.clear()
    with SyncAudit(device, torch_kernels=kernels is None) as audit:
        pending = task.launch(engine, toks, keys)
        launched = audit.take()
        got = pending.result()
        finished = audit.take()
    cpu_checks = "triton_kernels/causal_conv/layout.py" if device.type == "cpu" else None
    syncs = [e for e in launched if e.kind in SYNC_KINDS and not (cpu_checks and e.where.startswith(cpu_checks))]
    assert syncs == [], describe(syncs)
    assert [e.kind for e in finished] == ["wait"], describe(finished)
    assert any(continued) and not all(continued)   # a step continued a stored state, another started afresh
    assert bool(segmented) == (kernels == "triton")   # the Triton path walked in segments, chained on the device
    for name, value in want.columns.items():
        assert np.allclose(value, got.columns[name], rtol=1e-5, atol=1e-6), name


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
def test_a_t5_batch_launches_without_a_sync(tmp_path, path):
    """A T5 embed batch (Ankh: relative-position bias, gated-gelu feed-forward): on the Triton path its layers run
    fused (attention from the projection with the bias, add + RMS norm, gelu_tanh_mul), with no sync from the
    batch's first copy to the device to its last copy back, and one wait for the results."""
    from tests.tiny_checkpoints import write_tiny

    _, device, kernels = path
    engine = _engine(str(write_tiny("ankh", tmp_path / "ankh")), device, kernels)
    want, got, launched, finished = _audited_batch(engine, dict(task="embed", pools=["mean"], per_residue=True),
                                                   device, kernels)
    assert [e for e in launched if e.kind in SYNC_KINDS] == [], describe(launched)
    assert [e.kind for e in finished] == ["wait"], describe(finished)
    same = np.array_equal if device.type == "cpu" else (lambda a, b: np.allclose(a, b, rtol=1e-5, atol=1e-6))
    for name, value in want.values.items():
        assert same(value, got.values[name]), name
