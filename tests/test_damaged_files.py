"""Damaged files on disk: finished shards, checkpoints, the run's index and copy plan, the demo model cache, a
user's checkpoint.

What `status` reports it has verified (or it says it has not); counts never exceed totals and agree with
what the worker finds; one `rerun` recomputes every damaged shard, and builds a damaged index or copy plan
again; a damaged model is found before any worker loads it, and named.
"""
import os
import re
import shutil
from pathlib import Path

import h5py

from .run_helpers import (assert_same, log_text, raw_datasets, read, rerun_matches, status_rows, suggested_commands,
                          undocumented_files)
from .tiny_models import run_cli


def flip_a_value(path, dataset="embeddings/mean"):
    """Change one stored byte of `dataset` in place: the file still opens, only its checksum can tell."""
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_chunk_info(0).byte_offset
    with open(path, "r+b") as fh:
        fh.seek(offset + 5)
        byte = fh.read(1)
        fh.seek(offset + 5)
        fh.write(bytes([byte[0] ^ 0xFF]))


def test_damaged_finished_shards_are_reported_and_recomputed_in_one_rerun(reference_run, reference, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(reference_run, out)                         # a finished run of fasta with common
    (out / "result.h5").unlink()
    flip_a_value(out / "shards" / "shard_0.h5")                 # opens fine, fails its checksum
    shard = out / "shards" / "shard_1.h5"
    os.truncate(shard, shard.stat().st_size // 2)               # does not open

    rows = status_rows(out)
    assert [r["state"] for r in rows.values()] == ["corrupt", "corrupt"], rows
    assert "checksum mismatch" in rows[0]["detail"] and all(r["durable"] == 0 for r in rows.values())
    quick = run_cli("status", str(out), "--no-verify").stdout
    assert "checksums: NOT verified" in quick and f"run_shards status {out} --verify" in quick

    res = run_cli("merge", str(out))                            # names both, not only the truncated one
    assert res.returncode == 2 and "shard 1 is corrupt" in res.stderr and "shard_0.h5 is corrupt" in res.stderr
    res = rerun_matches(out, reference)                         # one round is enough
    assert "set aside as shard_0.h5.corrupt" in res.stderr and "set aside as shard_1.h5.corrupt" in res.stderr


def test_damaged_checkpoint_counts_for_nobody(fasta, common, reference, tmp_path):
    """A checkpoint whose data fails its checksums: status, the worker and the progress count the same rows,
    and never more than a shard holds."""
    out = tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), *common,
                  env={"RUN_SHARDS_FAULT_DIE_AT": "part-written", "RUN_SHARDS_FAULT_DIE_SHARD": "0",
                       "RUN_SHARDS_FAULT_DIE_AFTER": "3"})
    assert res.returncode == 1
    parts = sorted((out / "shards" / "shard_0.parts").glob("part_*.h5"))
    assert len(parts) == 3
    flip_a_value(parts[1])
    before = status_rows(out)[0]
    intact = 0
    for p in (parts[0], parts[2]):
        with h5py.File(p) as f:
            intact += len(f["index"])
    assert before["durable"] == intact and before["durable"] <= before["of"]
    assert f"corrupt checkpoint(s) {parts[1].name} will be recomputed" in before["detail"]

    rerun_matches(out, reference)
    resumed = log_text(out, 0).split("worker for shard 0 started")[-1]
    assert f"resuming: {intact} of {before['of']} sequences already durable" in resumed
    assert f"checkpoint {parts[1].name} is corrupt" in resumed
    summary = re.findall(r"\(([\d,]+) of ([\d,]+) sequences[,)]", (out / "logs" / "run.log").read_text())
    done, total = (int(x.replace(",", "")) for x in summary[-1])
    assert done == total == before["of"] - intact    # shard 1 was complete: the rerun computed only these
    assert (out / "shards" / "shard_0.h5").exists() and undocumented_files(out) == []


def flip_a_run_file_byte(path):
    """Change one byte of the first array of an index file (index.rsidx, copies.rsidx): its header still reads,
    only its checksum can tell."""
    data = bytearray(path.read_bytes())
    header = 16 + int.from_bytes(data[12:16], "little")
    at = header + (-header % 64) + 5
    data[at] ^= 0xFF
    path.write_bytes(data)


def test_a_damaged_index_or_copy_plan_is_built_again_by_the_rerun_status_suggests(fasta, common, tmp_path):
    """index.rsidx or copies.rsidx damaged (a full disk, a bad copy) in an unfinished run, or both: status
    showed a traceback for the index, merge and rerun either a traceback or "start a new run", which loses every
    row computed. Now status and merge name the damaged file and `rerun`, which builds it (or both: the plan from
    the FASTA's index, then the index's stride table from the plan) again as it was planned and continues from the
    rows durable, to the very result of a run never damaged. A byte changed inside the copy plan (its header
    intact) was found only by the merge, after the rerun had computed, as rows "whose sequence differs from the
    FASTA record's", with no way forward: status, merge and rerun now read the plan's checksum."""
    dups = tmp_path / "dups.fasta"   # records of the same sequence: the run copies rows, as its copy plan says
    text = Path(fasta).read_text()
    dups.write_text(text + "".join(">dup_" + record for record in text.split(">")[1:21]))
    clean, out = tmp_path / "clean", tmp_path / "out"
    assert run_cli(str(dups), "--out", str(clean), *common).returncode == 0
    die = {"RUN_SHARDS_FAULT_DIE_AT": "part-written", "RUN_SHARDS_FAULT_DIE_SHARD": "1"}
    res = run_cli(str(dups), "--out", str(out), *common, env=dict(die, RUN_SHARDS_FAULT_DIE_AFTER="2"))
    assert res.returncode == 1, res.stderr
    planned = {name: (out / name).read_bytes() for name in ("index.rsidx", "copies.rsidx")}

    # a byte of the index changed, then both truncated (it was "restore both or start a new run"), then a byte
    # of the copy plan changed; the first reruns stop again at shard 1's next checkpoint
    truncated = "unreadable header", lambda path: os.truncate(path, 100)
    flipped = "checksum mismatch", flip_a_run_file_byte
    for names, (why, damage), stop in ((["index.rsidx"], flipped, {**die, "RUN_SHARDS_FAULT_DIE_AFTER": "3"}),
                                       (["index.rsidx", "copies.rsidx"], truncated,
                                        {**die, "RUN_SHARDS_FAULT_DIE_AFTER": "4"}),
                                       (["copies.rsidx"], flipped, {})):
        durable = status_rows(out)[1]["durable"]   # shard 1's rows before the damage
        for name in names:
            damage(out / name)
        status = run_cli("status", str(out))
        assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
        assert f"{out / names[0]} is damaged ({why})" in status.stdout, status.stdout
        assert ["rerun", str(out)] in suggested_commands(status.stdout), status.stdout
        merge = run_cli("merge", str(out), "--allow-partial")
        assert merge.returncode == 2 and f"{out / names[0]} is damaged" in merge.stderr, merge.stderr
        assert suggested_commands(merge.stderr) == [["rerun", str(out)]], merge.stderr
        res = run_cli("rerun", str(out), "--no-progress", env=stop)
        assert res.returncode == (1 if stop else 0) and "Traceback" not in res.stderr, res.stderr
        for name in names:
            assert f"{out / name} was damaged ({why}): built again" in res.stderr, res.stderr
            assert (out / name).read_bytes() == planned[name]
        resumed = log_text(out, 1).split("worker for shard 1 started")[-1]
        assert durable > 0 and f"resuming: {durable} of" in resumed, resumed   # (not computed again)
    assert raw_datasets(out / "result.h5") == raw_datasets(clean / "result.h5")
    assert undocumented_files(out) == []


def test_damaged_demo_model_cache_is_rebuilt(fasta, common, reference, tmp_path):
    """A demo model whose weights were damaged in the cache (here between a failed run and its rerun) is
    found by its checksums and built again, bit for bit."""
    cache = tmp_path / "cache"
    env = {"RUN_SHARDS_CACHE": str(cache)}
    out = tmp_path / "out"
    assert common[0] == "--model"
    res = run_cli(fasta, "--out", str(out), *common[2:], env=dict(env, RUN_SHARDS_FAULT_DIE_AT="part-written",
                                                               RUN_SHARDS_FAULT_DIE_SHARD="1"))
    assert res.returncode == 1
    weights = cache / "models" / "demo-v1" / "model.safetensors"
    with open(weights, "r+b") as fh:      # the header's length field: safetensors cannot read it any more
        fh.write(b"\xff\xff\xff\xff")
    res = run_cli("rerun", str(out), "--no-progress", env=env)
    assert res.returncode == 0, res.stderr
    assert "the demo model in" in res.stderr and "is damaged" in res.stderr and "building it again" in res.stderr
    assert_same(read(out / "result.h5"), reference)
    fresh = tmp_path / "fresh"
    assert run_cli(fasta, "--out", str(fresh), *common[2:], env=env).returncode == 0
    assert not any(p.name != "demo-v1" for p in (cache / "models").iterdir())   # no half-built copies


def test_damaged_user_checkpoint_is_named_before_any_worker(fasta, common, models, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(models["llama"], model)
    weights = model / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 100)
    args = ["--model", str(model)] + common[2:]
    out = tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), *args)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"damaged weight file(s): {weights}" in res.stderr and "bytes where its header describes" in res.stderr
    assert not out.exists()

    # The same damage between a failed run and its rerun: `rerun` refuses before starting workers.
    shutil.rmtree(model)
    shutil.copytree(models["llama"], model)
    res = run_cli(fasta, "--out", str(out), *args, env={"RUN_SHARDS_FAULT_DIE_AT": "part-written"})
    assert res.returncode == 1
    with open(weights, "r+b") as fh:
        fh.write(b"\xff" * 8)
    res = run_cli("rerun", str(out), "--no-progress")
    assert res.returncode == 2 and f"damaged weight file(s): {weights}" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and "SafetensorError" not in res.stderr
