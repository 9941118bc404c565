"""Workers started while the parent plans (pipeline/launchers/early_workers.py): they load the run's model
while it plans and compute the same rows as workers started after the plan; a model loaded ahead is used only
for exactly the checkpoint, device and dtype the shard asks for; a worker no shard needs is gone without having
written anything."""
import dataclasses
import json
import os
import shutil
import uuid
from pathlib import Path

import pytest
import torch

from pipeline.config import RunConfig
from pipeline.engine import selection as engines
from pipeline.engine.native import NativeEngine
from pipeline.models import checkpoint, preload
from pipeline.models.checkpoint import EngineInfo, fingerprint
from pipeline.worker import process_setup

from pipeline.launchers.waiting_workers import WaitingWorkers
from pipeline.launchers.supervisor import spawn_worker
from pipeline.rundir.layout import RunDir

from .run_helpers import log_text, raw_datasets, wait_for
from .tiny_models import run_cli

FASTA = ">a\nMKVLAAGLLW\n>b\nMKKLLAAGG\n>c\nMQ\n>d\nMSTNPKPQRKTKRNTNRRPQDVKFPGG\n>e\nMAAAAAAAA\n"


def _processes_tagged(tag: str) -> list[int]:
    """Live worker processes (spawned by multiprocessing, not its resource tracker) whose environment holds
    RUN_SHARDS_TEST_TAG=tag, which a command's workers inherit."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                environ = open(f"/proc/{entry}/environ", "rb").read()
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
                state = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if f"RUN_SHARDS_TEST_TAG={tag}".encode() in environ.split(b"\0") and b"spawn_main" in cmdline \
                    and state != "Z":
                found.append(int(entry))
    return found


def test_workers_started_while_planning_compute_the_rows_of_workers_started_after(models, tmp_path):
    fasta = tmp_path / "in.fasta"
    fasta.write_text(FASTA)
    common = [str(fasta), "--model", models["demo"], "--gpus", "0", "--workers", "2", "--no-progress"]
    early = run_cli(*common, "--out", str(tmp_path / "early"))
    late = run_cli(*common, "--out", str(tmp_path / "late"), env={"RUN_SHARDS_EARLY_WORKERS": "0"})
    assert early.returncode == 0 and late.returncode == 0, early.stderr + late.stderr
    for r in (0, 1):
        assert f"started shard {r} on CPU (pid" in early.stderr
        assert "before its shard was known, while the run was planned" in log_text(tmp_path / "early", r)
        assert "before its shard was known" not in log_text(tmp_path / "late", r)
        assert "using the model loaded ahead" in log_text(tmp_path / "early", r)   # weights read while planning
        assert "loaded ahead" not in log_text(tmp_path / "late", r)
    assert early.stderr.count("a worker started while planning") == 2
    assert "a worker started while planning" not in late.stderr
    assert raw_datasets(tmp_path / "early" / "result.h5") == raw_datasets(tmp_path / "late" / "result.h5")


def test_the_same_command_on_a_finished_run_starts_no_worker(models, tmp_path, monkeypatch):
    """Its result stands and nothing is computed: workers started while it planned were only killed unused (a
    second of every core's time, on a 2-core laptop the planning's own)."""
    import run_shards
    from pipeline.launchers import early_workers
    fasta = tmp_path / "in.fasta"
    fasta.write_text(FASTA)
    out = tmp_path / "out"
    args = dict(model=models["demo"], gpus=0, workers=2, show_progress=False)
    spawned = []
    real_spawn = early_workers.spawn_worker
    monkeypatch.setattr(early_workers, "spawn_worker", lambda *a, **k: spawned.append(a) or real_spawn(*a, **k))
    first = run_shards.run(str(fasta), out=str(out), **args)
    assert len(spawned) == 2
    assert run_shards.run(str(fasta), out=str(out), **args) == first and len(spawned) == 2


def test_a_refused_plan_stops_the_workers_it_started_and_leaves_no_directory(models, tmp_path):
    fasta = tmp_path / "in.fasta"
    fasta.write_text("MKV\n" + FASTA)   # sequence data before the first header: the index refuses it
    tag = uuid.uuid4().hex
    out = tmp_path / "out"
    res = run_cli(str(fasta), "--model", models["demo"], "--gpus", "0", "--workers", "2", "--out", str(out),
                  "--no-progress", env={"RUN_SHARDS_TEST_TAG": tag})
    assert res.returncode == 2 and "sequence data before the first header" in res.stderr, res.stderr
    assert not out.exists()
    assert _processes_tagged(tag) == []


def test_waiting_workers_are_killed_unused_and_a_dead_one_is_not_handed_a_shard(tmp_path, monkeypatch):
    """Two workers started for slots no shard came to: `take` of one that died returns None (its slot gets a
    worker started the usual way), `close` ends the other; neither wrote anything into the run directory."""
    tag = uuid.uuid4().hex
    monkeypatch.setenv("RUN_SHARDS_TEST_TAG", tag)
    run = RunDir(tmp_path / "out")
    run.root.mkdir()
    early = WaitingWorkers({slot: spawn_worker(run, None, slot, False, 1) for slot in ("0", "1")})
    wait_for(lambda: len(_processes_tagged(tag)) == 2, timeout=30, what="both workers' processes")   # (exec'd)
    died = early.waiting["0"].context.processes[0]
    os.kill(died.pid, 9)
    died.join(30)
    assert early.take("0", 0) is None and "0" not in early.waiting
    assert early.take("2", 0) is None   # no worker was started for that slot
    early.close()
    assert early.waiting == {}
    assert _processes_tagged(tag) == []
    assert list(run.root.iterdir()) == []


def test_a_model_loaded_ahead_serves_only_the_checkpoint_device_and_dtype_it_was_loaded_for(models, tmp_path):
    path = tmp_path / "esm"
    shutil.copytree(models["esm"], path)
    print_ = fingerprint(path)
    cpu = torch.device("cpu")
    wanted = preload.Wanted.of("native", path, print_, cpu, torch.float32)
    assert engines.load_ahead("native", str(path), print_, cpu, torch.float32, logprobs=False, trust_remote_code=False)
    for other in (preload.Wanted.of("native", path, print_, "cpu", torch.bfloat16),
                  preload.Wanted.of("native", path, "0" * 16, "cpu", "float32"),
                  preload.Wanted.of("hf", path, print_, "cpu", "float32")):
        assert preload.take(other) is None   # another dtype, checkpoint or engine: loaded as usual
    assert preload.take(wanted) is None      # (a take drops what it does not use)

    assert engines.load_ahead("native", str(path), print_, cpu, torch.float32, logprobs=False, trust_remote_code=False)
    held = preload._held[wanted][0]
    assert preload.holding()   # (the shard's load then reads no weights ahead: they are read)
    engine = NativeEngine.load(str(path), torch.device("cpu"), torch.float32, print_)
    usual = NativeEngine.load(str(path), torch.device("cpu"), torch.float32, print_)   # nothing held any more
    assert engine.model is held and usual.model is not held and not preload.holding()
    assert all(torch.equal(a, b) for a, b in zip(engine.model.state_dict().values(), usual.model.state_dict().values()))

    (path / "config.json").write_text((path / "config.json").read_text().replace("{", '{"note": 1, ', 1))
    assert not preload.load(wanted, lambda: 1 / 0)   # the checkpoint changed since it was planned: nothing built
    assert preload.take(wanted) is None


def test_an_hf_engine_loaded_ahead_is_the_one_the_shard_uses_with_the_runs_description_and_budget(models):
    path, cpu = models["esm"], torch.device("cpu")
    print_ = fingerprint(Path(path))
    source = checkpoint.local_source(path, print_)
    info = checkpoint.describe(source, "hf", trust_remote_code=False)
    run_info = EngineInfo.from_json(json.loads(json.dumps(info.to_json())))   # as the manifest gives it back
    config = RunConfig(fasta=["x"], out="o", max_tokens_per_batch=1234)
    assert engines.load_ahead("hf", path, print_, cpu, torch.float32, logprobs=True, trust_remote_code=False)
    held = preload._held[preload.Wanted.of("hf", path, print_, cpu, torch.float32, True)][0]
    engine = engines.load("hf", path, cpu, torch.float32, True, info=run_info, config=config, fingerprint=print_)
    assert engine is held and engine.tokens_per_batch == 1234 and engine.lm is not None
    assert engines.load_ahead("hf", path, print_, cpu, torch.float32, logprobs=True, trust_remote_code=False)
    other = dataclasses.replace(run_info, max_tokens=run_info.max_tokens - 1)   # not what it found: built anew
    assert engines.load("hf", path, cpu, torch.float32, True, info=other, config=config, fingerprint=print_) is not held
    assert engines.load_ahead("hf", path, print_, cpu, torch.float32, logprobs=False, trust_remote_code=False)
    assert engines.load("hf", path, cpu, torch.float32, True, info=run_info, fingerprint=print_).lm is not None


def test_a_worker_is_set_up_once_and_never_for_another_run_setting(tmp_path, monkeypatch):
    """The load ahead sets the process up (threads, MKL's mode) for the run the parent named; the shard's own load
    with the same settings finds it done, and any other settings are a bug, not a silent second set-up."""
    monkeypatch.setattr(process_setup, "_done", (False, True, str(tmp_path), 1))
    process_setup.set_up(False, True, tmp_path, 1)   # done already: nothing computes or changes
    with pytest.raises(RuntimeError, match="set up for"):
        process_setup.set_up(False, False, tmp_path, 1)
