"""A run continued by a later command (issue 30): the shard geometry fixed when the run was planned, any
number of workers, launch settings applied and logged, result settings and a contradicting --shards refused
before anything is touched, and a run directory that an older run_shards broke repaired by what `status`
advises. Every continued run's result is byte-identical to a clean run's (the native engine on CPU is
batch-invariant: docs/engine.md).
"""
import copy
import dataclasses
import json
import shutil

import numpy as np
import pytest

from pipeline.config import LAUNCH, PLAN, RESULT, RunConfig, option_of
from pipeline.errors import RunDirError

from .run_helpers import raw_datasets, status_rows, suggested_commands, undocumented_files
from .tiny_models import run_cli


@pytest.fixture(scope="module")
def args(models):
    return ["--model", models["demo"], "--gpus", "0", "--max-tokens-per-batch", "1000", "--checkpoint-every", "4",
            "--no-progress"]


@pytest.fixture(scope="module")
def clean(small_fasta, args, tmp_path_factory) -> dict:
    """The datasets of a clean run in 2 shards (one worker computing both in turn)."""
    out = tmp_path_factory.mktemp("clean") / "out"
    res = run_cli(small_fasta, "--out", str(out), *args, "--workers", "1", "--shards", "2", "-q")
    assert res.returncode == 0, res.stderr
    return raw_datasets(out / "result.h5")


@pytest.fixture(scope="module")
def stopped(small_fasta, args, tmp_path_factory):
    """A run of 2 shards (2 workers) whose workers were both killed while writing their second checkpoint:
    each shard has one durable checkpoint, and `status` shows both failed."""
    out = tmp_path_factory.mktemp("stopped") / "out"
    res = run_cli(small_fasta, "--out", str(out), *args, "--workers", "2",
                  env={"RUN_SHARDS_FAULT_DIE_AT": "part-written", "RUN_SHARDS_FAULT_DIE_AFTER": "1"})
    assert res.returncode == 1, res.stderr
    rows = status_rows(out)
    assert [r["state"] for r in rows.values()] == ["failed", "failed"] and all(r["durable"] > 0 for r in rows.values())
    return out


def _copy(run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(run, out)
    return out


@pytest.mark.parametrize("workers,shards,extra", [
    (1, None, ()), (1, "2", ()), (2, None, ()), (2, "2", ()), (3, "2", ()),
    (3, None, ("--max-tokens-per-batch", "300", "--max-seqs", "3")),
])
def test_continued_with_any_number_of_workers_computes_the_planned_shards(small_fasta, args, clean, stopped,
                                                                          tmp_path, workers, shards, extra):
    """The same `run` with 1, 2 or 3 workers, with or without the plan's --shards, finishes the 2 planned
    shards (K workers take them in turn), sets nothing aside, and writes the clean run's bytes. Changed launch
    settings (here the batch budget) apply and are logged, naming their options."""
    out = _copy(stopped, tmp_path)
    res = run_cli(small_fasta, "--out", str(out), *args, "--workers", str(workers),
                  *(("--shards", shards) if shards else ()), *extra)
    assert res.returncode == 0, res.stderr
    assert "holds this same run: continuing from its checkpoints" in res.stderr
    if workers != 2:
        assert f"--workers {workers} (was 2)" in res.stderr
    if extra:
        assert "--max-tokens-per-batch 300 (was 1000), --max-seqs 3 (was 256)" in res.stderr
        config = json.loads((out / "manifest.json").read_text())["config"]
        assert (config["max_tokens_per_batch"], config["max_seqs"]) == (300, 3)   # kept for later commands
    assert "set aside" not in res.stderr and not list((out / "shards").glob("*.corrupt*"))
    assert json.loads((out / "manifest.json").read_text())["world"] == 2
    assert raw_datasets(out / "result.h5") == clean
    assert undocumented_files(out) == []


def test_shards_that_contradict_the_plan_are_refused_and_nothing_is_touched(small_fasta, args, clean, stopped,
                                                                            tmp_path):
    out = _copy(stopped, tmp_path)
    before = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    res = run_cli(small_fasta, "--out", str(out), *args, "--workers", "1", "--shards", "3")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"--shards 3: {out} holds a run planned as 2 shard(s)" in res.stderr
    assert "Leave out --shards to continue it" in res.stderr
    after = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()
             if p.name != "run.log"}
    assert after == {k: v for k, v in before.items() if k.name != "run.log"}
    (command,) = suggested_commands(res.stderr)            # a run of 3 shards elsewhere: the same bytes
    assert command[command.index("--shards") + 1] == "3"
    res = run_cli(*command, "-q", env={"RUN_SHARDS_REPORT": "1"})
    assert res.returncode == 0, res.stderr
    new = command[command.index("--out") + 1]
    assert raw_datasets(new + "/result.h5") == clean
    assert f"report: {new}/report.html" in res.stdout      # -q keeps the terminal quiet, not the outcome


def test_a_changed_result_setting_is_refused_naming_the_option(small_fasta, args, stopped, tmp_path):
    out = _copy(stopped, tmp_path)
    res = run_cli(small_fasta, "--out", str(out), *args, "--workers", "2", "--pool", "cls")
    assert res.returncode == 2 and "already holds a run with other settings (changed: --pool (mean -> cls))" \
        in res.stderr, res.stderr


def test_a_run_directory_broken_by_an_older_version_is_repaired_by_what_status_advises(small_fasta, args, clean,
                                                                                        stopped, tmp_path):
    """Before issue 30, `run --workers 1` on a run planned with 2 workers derived 1 shard from the changed
    worker count: it set good shard 0 aside as shard_0.h5.corrupt, wrote a shard 0 of all 40 rows, and
    every merge refused the duplicates. The same state built by hand: status shows shard 0 corrupt, and the
    command it gives puts the good shard back and merges the clean run's bytes."""
    one = tmp_path / "one"                                 # a finished 1-shard run: its shard 0 holds every row
    assert run_cli(small_fasta, "--out", str(one), *args, "--workers", "1", "-q").returncode == 0
    out = tmp_path / "out"
    assert run_cli(small_fasta, "--out", str(out), *args, "--workers", "2", "-q").returncode == 0
    (out / "result.h5").unlink()
    shards = out / "shards"
    (shards / "shard_0.h5").rename(shards / "shard_0.h5.corrupt")
    shutil.copy(one / "shards" / "shard_0.h5", shards / "shard_0.h5")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["config"].update(workers=1, shards=0)        # as the older version left it
    (out / "manifest.json").write_text(json.dumps(manifest))
    res = run_cli("merge", str(out))
    assert res.returncode == 2 and "present more than once" in res.stderr

    status = run_cli("status", str(out)).stdout
    rows = status_rows(out)
    assert rows[0]["state"] == "corrupt" and "40 rows, not this shard's 20" in rows[0]["detail"]
    assert {tuple(c) for c in suggested_commands(status)} >= {("rerun", str(out))}
    res = run_cli("rerun", str(out), "--no-progress")
    assert res.returncode == 0, res.stderr
    assert "shard 0: shard_0.h5.corrupt holds exactly this shard's rows and reads back intact" in res.stderr
    assert raw_datasets(out / "result.h5") == clean
    assert (shards / "shard_0.h5.corrupt.2").exists()     # the 40-row file, kept for inspection
    assert undocumented_files(out) == []


def test_status_advice_finishes_a_stopped_run(stopped, clean, tmp_path):
    out = _copy(stopped, tmp_path)
    status = run_cli("status", str(out)).stdout
    commands = suggested_commands(status)
    assert ["rerun", str(out)] in commands, status
    res = run_cli("rerun", str(out), "--no-progress")
    assert res.returncode == 0, res.stderr
    assert raw_datasets(out / "result.h5") == clean


def test_rerun_of_some_shards_succeeds_and_says_what_is_left(stopped, clean, tmp_path):
    """`rerun --shards 1` computes shard 1 and exits 0 (it did what was asked), saying that shard 0 is left
    and the command that finishes the run; that command does."""
    out = _copy(stopped, tmp_path)
    res = run_cli("rerun", str(out), "--shards", "1", "--no-progress")
    assert res.returncode == 0, res.stderr
    assert "shard(s) 1 complete; shard(s) 0 not finished, so nothing was merged" in res.stdout
    assert not (out / "result.h5").exists()
    (command,) = suggested_commands(res.stdout)
    assert run_cli(*command, "--no-progress").returncode == 0
    assert raw_datasets(out / "result.h5") == clean


def test_every_setting_has_a_role():
    """RESULT settings must match to continue a run, PLAN (the shard count, the --reuse results the plan
    copies rows from) may only be repeated, LAUNCH
    settings apply from the command that gives them: every RunConfig field is exactly one of them, and
    the batch budget, the batch's sequences and the devices are launch settings (issue 29: they were
    none, and a continued run kept the old ones without a word)."""
    names = [f.name for f in dataclasses.fields(RunConfig)]
    roles = {name: option_of(name).role for name in names}
    assert set(roles.values()) == {RESULT, PLAN, LAUNCH}
    assert sorted(RunConfig.fields_with_role(RESULT) + RunConfig.fields_with_role(PLAN)
                  + RunConfig.fields_with_role(LAUNCH)) == sorted(names)
    assert set(RunConfig.fields_with_role(PLAN)) == {"shards", "reuse"}
    assert {"max_tokens_per_batch", "max_seqs", "devices", "workers"} <= set(RunConfig.fields_with_role(LAUNCH))


def test_switching_between_cpu_and_gpu_is_refused_naming_the_option(tmp_path):
    from pipeline.planning.continued import reconcile
    from pipeline.rundir.layout import RunDir
    cpu = RunConfig(fasta=["/x.fasta"], out=str(tmp_path), workers=2, shards=2)
    gpu = dataclasses.replace(cpu, devices=["0", "1"])

    def manifest(config):
        stored = json.loads(config.to_json())
        return {"config": stored, "world": 2, "model": {"fingerprint": "m"}, "index": {"fingerprint": "i"},
                "attrs": {"config": stored, "batch_invariant": True}}
    with pytest.raises(RunDirError, match="--gpus: .* holds a run planned for CPU workers"):
        reconcile(RunDir(tmp_path), manifest(cpu), manifest(gpu), gpu)
    kept = reconcile(RunDir(tmp_path), manifest(cpu), manifest(cpu), dataclasses.replace(cpu, workers=1))
    assert kept["config"]["workers"] == 1 and kept["attrs"]["config"]["workers"] == 1


def test_plan_decides_in_its_own_config(models, small_fasta, tmp_path):
    """plan() fixes the shard count and the window in the Plan's RunConfig, never in the caller's, and
    writes nothing until the Plan is recorded."""
    from pipeline.planning.plan import plan
    config = RunConfig(fasta=[small_fasta], out=str(tmp_path / "o"), model=models["demo"], workers=3,
                       on_long="window", window=64)
    before = copy.deepcopy(config)
    planned = plan(config)
    with planned.index:
        assert config == before
        assert planned.config.shards == 3 == planned.manifest["world"]
        assert planned.config.window == 64 and planned.config.overlap is not None
        assert planned.manifest["config"]["overlap"] == planned.config.overlap
        assert not (tmp_path / "o").exists()


def test_a_cache_path_that_is_a_file_is_refused_and_out_is_left_as_it_was(small_fasta, args, tmp_path):
    cache = tmp_path / "cache"
    cache.write_text("")
    res = run_cli(small_fasta, "--out", str(tmp_path / "o"), *args, env={"RUN_SHARDS_CACHE": str(cache)})
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"RUN_SHARDS_CACHE {cache} is a file, not a directory" in res.stderr
    assert not (tmp_path / "o").exists()


def test_a_run_whose_index_holds_the_earlier_record_checksums_is_checked_with_them(small_fasta, args, clean,
                                                                                   stopped, tmp_path, monkeypatch):
    """A run planned before 2026-12-07 holds an index of format 4, whose record checksums are of kind 1
    (index/record_checksum.py). Its workers check what they read with that kind; the same `run` command says
    the index is fingerprinted another way (not that the FASTA changed) and names `rerun`, which finishes the
    run with the clean run's bytes (an edited record read with the earlier kind: tests/test_index.py)."""
    from index import sequence_index
    from index.record_checksum import checksum
    out = _copy(stopped, tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    index = sequence_index.SequenceIndex.load(out / "index.rsidx")
    text = open(small_fasta, "rb").read()
    index.checksums = np.array([checksum(text[o:o + n], o, kind=1) for o, n in zip(index.offsets.tolist(),
                                                                                  index.nbytes.tolist())], np.uint64)
    index.meta = {**index.meta, "checksum_kind": 1}
    monkeypatch.setattr(sequence_index, "FORMAT_VERSION", 4)
    index.save(out / "index.rsidx.new", world=manifest["world"])
    monkeypatch.undo()
    index.close()
    (out / "index.rsidx.new").replace(out / "index.rsidx")
    earlier = sequence_index.SequenceIndex.load(out / "index.rsidx")
    assert earlier.checksum_kind == 1 and earlier.stride is not None
    manifest["index"]["fingerprint"] = manifest["attrs"]["index_fingerprint"] = earlier.fingerprint()
    earlier.close()
    (out / "manifest.json").write_text(json.dumps(manifest))
    res = run_cli(small_fasta, "--out", str(out), *args, "--workers", "2")
    assert res.returncode == 2 and "planned by an earlier run_shards" in res.stderr, res.stderr
    assert "FASTA content" not in res.stderr and ["rerun", str(out)] in suggested_commands(res.stderr)
    res = run_cli("rerun", str(out), "--no-progress")
    assert res.returncode == 0, res.stderr
    assert raw_datasets(out / "result.h5") == clean


def test_a_run_planned_by_an_earlier_version_is_continued_by_rerun_not_called_changed(small_fasta, args, clean,
                                                                                         stopped, tmp_path):
    """A run directory an earlier run_shards planned (before 2026-11-27: its index fingerprinted over fewer
    arrays, no input format or resolved settings recorded), met by the same run command: the FASTA is the same,
    so the refusal says the index is fingerprinted another way (not 'FASTA content' or '--input-format'
    changed) and names `rerun`, which finishes it with the clean run's bytes."""
    out = _copy(stopped, tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["index"]["fingerprint"] = manifest["attrs"]["index_fingerprint"] = "b608e871-40"   # as 09d72db's
    for name in ("resolved", "input_format"):
        del manifest["attrs"][name]
    (out / "manifest.json").write_text(json.dumps(manifest))
    res = run_cli(small_fasta, "--out", str(out), *args, "--workers", "2")
    assert res.returncode == 2, res.stderr
    assert "planned by an earlier run_shards" in res.stderr and "FASTA content" not in res.stderr \
        and "--input-format" not in res.stderr, res.stderr
    assert ["rerun", str(out)] in suggested_commands(res.stderr)
    res = run_cli("rerun", str(out), "--no-progress")
    assert res.returncode == 0, res.stderr
    assert raw_datasets(out / "result.h5") == clean


def test_a_run_planned_with_counts_above_todays_bounds_is_continued_by_rerun(small_fasta, args, clean, stopped,
                                                                             tmp_path):
    """Runs planned before the bounds of 2026-12-07 could hold --threads 2**63 (every worker failed with it) or
    --max-new-tokens 10**12 (a user's "no limit"): rerun refused them, naming options rerun lacks. They continue
    with --threads at its default and the count at its bound (no sequence reaches it), said once in a warning, to
    the clean run's bytes."""
    out = _copy(stopped, tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["config"].update(threads_per_worker=2**63, max_new_tokens=10**12)
    (out / "manifest.json").write_text(json.dumps(manifest))
    res = run_cli("rerun", str(out), "--no-progress")
    assert res.returncode == 0, res.stderr
    assert "planned with --threads 9223372036854775808, above what run_shards takes since 2026-12-07 (4096): it " \
           "continues with --threads 1" in res.stderr, res.stderr
    assert res.stderr.count("planned with --max-new-tokens 1000000000000") == 1, res.stderr
    assert raw_datasets(out / "result.h5") == clean
