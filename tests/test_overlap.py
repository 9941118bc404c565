"""Overlapped batches (docs/engine.md, "Host and device overlap"): a worker that launches batch k+1 before it
takes batch k's results writes the same bits as one that takes each batch at once, keeps kill -9 / rerun
semantics (a checkpoint holds finished rows only), and meets an input error as the serial loop does, with
the same message. CPU workers run serial by default; RUN_SHARDS_OVERLAP=1 runs the GPU workers' loop here.
"""
from __future__ import annotations

import os
import shutil
import signal

import pytest

from .run_helpers import (assert_same, log_text, raw_datasets, read, start, undocumented_files, wait_for,
                          worker_pid)
from .test_advice import _edit_shortest_record, _rows_of_shards
from .tiny_models import run_cli

pytestmark = pytest.mark.slow

OVERLAP = {"RUN_SHARDS_OVERLAP": "1"}


def test_overlapped_batches_write_the_serial_bits(fasta, common, reference_run, tmp_path):
    out = tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), *common, env=OVERLAP)
    assert res.returncode == 0, res.stderr
    assert raw_datasets(out / "result.h5") == raw_datasets(reference_run / "result.h5")
    assert undocumented_files(out) == []


def test_overlapped_pseudo_log_likelihood_writes_the_serial_bits(models, tmp_path):
    """Masked copies over several engine steps per batch, the per-residue table, checkpoints every 3 rows."""
    fasta = tmp_path / "in.fasta"
    fasta.write_text("".join(f">s{i}\n{'MKTAYIAKQRQISFVKSHFSRQ'[:n]}\n" for i, n in enumerate([22, 5, 17, 9, 3, 12, 8, 20])))
    runs = {}
    for name, env in (("serial", {"RUN_SHARDS_OVERLAP": "0"}), ("overlapped", OVERLAP)):
        out = tmp_path / name
        res = run_cli(str(fasta), "--out", str(out), "--model", models["esm"], "--task", "score", "--per-residue",
                      "--gpus", "0", "--workers", "2", "--max-tokens-per-batch", "300", "--checkpoint-every", "3",
                      "--no-progress", env=env)
        assert res.returncode == 0, res.stderr
        runs[name] = raw_datasets(out / "result.h5")
    assert runs["overlapped"] == runs["serial"]
    assert "per_residue/amino_acids" in runs["serial"]


def test_kill_9_mid_run_then_rerun_gives_the_clean_result(fasta, common, reference, tmp_path):
    out = tmp_path / "out"
    proc = start(fasta, "--out", str(out), *common, env={**OVERLAP, "RUN_SHARDS_FAULT_BATCH_SLEEP": "0.3"})
    wait_for(lambda: "checkpoint part_000000" in log_text(out, 1), what="a first checkpoint")
    os.kill(worker_pid(out, 1), signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "shard 1 failed: killed by SIGKILL" in stderr, stderr
    res = run_cli("rerun", str(out), "--no-progress", env=OVERLAP)
    assert res.returncode == 0, res.stderr
    assert "resuming: " in log_text(out, 1).split("worker for shard 1 started")[-1]
    assert_same(read(out / "result.h5"), reference)


def test_an_edited_record_stops_the_shard_with_the_serial_message(fasta, common, tmp_path):
    """The edited record is read one batch ahead of its turn; the error comes at its turn, after the batch
    before it was taken, with the words a serial worker says, and no row of the edited text is kept."""
    original = tmp_path / "in.fasta"
    shutil.copy(fasta, original)
    out = tmp_path / "out"
    proc = start(str(original), "--out", str(out), *common, env={**OVERLAP, "RUN_SHARDS_FAULT_BATCH_SLEEP": "0.3"})
    wait_for(lambda: all("checkpoint part_000000" in log_text(out, r) for r in (0, 1)), what="first checkpoints")
    position, seq_id, shard = _edit_shortest_record(original)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "Traceback" not in stderr, stderr
    assert (f"shard {shard} stopped: {original}: the file changed after it was indexed: record {position + 1:,} "
            in stderr and "no longer holds the text the index describes" in stderr and f"(record '{seq_id}')" in stderr)
    assert "Its rows up to its last checkpoint, each checked when it was read, are kept" in stderr
    assert not (out / "result.h5").exists() and position not in _rows_of_shards(out)


def test_a_wrong_overlap_setting_is_refused_before_any_worker_starts(tmp_path):
    """RUN_SHARDS_OVERLAP=yes was found by each worker, after planning: every shard failed, and the
    `run_shards rerun` the failure suggested failed the same way. A local run (and rerun) refuses it first."""
    fasta = tmp_path / "in.fasta"
    fasta.write_text(">a\nMKV\n>b\nMKVL\n")
    out = tmp_path / "out"
    wrong = {"RUN_SHARDS_OVERLAP": "yes", "RUN_SHARDS_REPORT": "0"}
    res = run_cli(str(fasta), "--out", str(out), "--gpus", "0", "--workers", "1", env=wrong)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == ("error: RUN_SHARDS_OVERLAP='yes': set it to 1 (overlap batches) or 0 (one at a "
                                  "time), or unset it")
    assert not out.exists()
    assert run_cli(str(fasta), "--out", str(out), "--gpus", "0", "--workers", "1", env=OVERLAP).returncode == 0
    res = run_cli("rerun", str(out), env=wrong)
    assert res.returncode == 2 and "RUN_SHARDS_OVERLAP='yes'" in res.stderr, res.stderr
