"""Every message that suggests a command names one that works, and refusals leave nothing behind.

The FASTA changing under a run once sent users in circles (the worker said "run again", the parent
"rerun", `rerun` refused, `run` pointed back to `rerun`); here each suggested command is run.
"""
import json
import re
import shutil
from pathlib import Path

import pytest

from index import SequenceIndex

from .run_helpers import (assert_same, log_text, read, rerun_matches, start, suggested_commands,
                          undocumented_files, wait_for)
from .tiny_models import run_cli


def test_fasta_changed_during_the_run_leads_to_commands_that_work(fasta, common, reference, tmp_path):
    original = tmp_path / "in.fasta"
    shutil.copy(fasta, original)
    saved = original.read_bytes()
    out = tmp_path / "out"
    proc = start(str(original), "--out", str(out), *common, env={"RUN_SHARDS_FAULT_BATCH_SLEEP": "0.3"})
    wait_for(lambda: all("checkpoint part_000000" in log_text(out, r) for r in (0, 1)), what="first checkpoints")
    original.write_bytes(b">inserted\nMKVLA\n" + saved)      # every record moves
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "Traceback" not in stderr, stderr
    # Found by whichever comes first: a worker reading a moved record, or its check before a checkpoint.
    assert "the file changed after it was indexed" in stderr or "changed while this shard was computed" in stderr
    assert "The input FASTA changed since this run started" in stderr and "Continue with" not in stderr
    commands = suggested_commands(stderr)
    assert [c[0] for c in commands] == ["rerun", "run"], commands

    # `run` into the same directory refuses, and says how to get either run
    res = run_cli(str(original), "--out", str(out), *common)
    assert res.returncode == 2 and "already holds a run with other inputs" in res.stderr, res.stderr
    assert {c[0] for c in suggested_commands(res.stderr)} == {"run", "rerun"}
    res = run_cli("rerun", str(out))
    assert res.returncode == 2 and "the input FASTA no longer matches this run" in res.stderr
    assert {c[0] for c in suggested_commands(res.stderr)} == {"run", "rerun"}

    start_over = commands[1]               # on the file as it is now, into a new directory
    res = run_cli(*start_over)
    assert res.returncode == 0, res.stderr
    new = read(start_over[start_over.index("--out") + 1] + "/result.h5")
    assert new["ids"][0] == b"inserted" and len(new["ids"]) == len(reference["ids"]) + 1

    original.write_bytes(saved)            # restored: the suggested rerun finishes the original run
    assert commands[0] == ["rerun", str(out)]
    rerun_matches(out, reference)


def _edit_shortest_record(path) -> tuple[int, str, int]:
    """Change one residue of the shortest record (the last its worker reads), keeping every length: its
    position, its id, and the shard that reads it (2 workers)."""
    index = SequenceIndex.build([path])
    position = int(index.order[-1])
    data = bytearray(path.read_bytes())
    residue = data.index(b"\n", int(index.offsets[position])) + 1
    data[residue] = ord("W") if data[residue] != ord("W") else ord("C")
    path.write_bytes(bytes(data))
    return position, index.id(position), (len(index) - 1) % 2


def _rows_of_shards(out) -> set[int]:
    return {int(i) for shard in (out / "shards").glob("shard_*.h5") for i in read(shard)["index"]}


def test_one_residue_edited_during_the_run_is_caught_and_nothing_is_merged(fasta, common, reference, tmp_path):
    """The same length, every record where it was: only the content changed. The worker that reads the
    edited record finds that its checksum differs, names it and stops; no row computed from the edited
    text is kept in any shard and no result is written; the advice leads back to the clean result once the
    file is restored."""
    original = tmp_path / "in.fasta"
    shutil.copy(fasta, original)
    saved = original.read_bytes()
    out = tmp_path / "out"
    proc = start(str(original), "--out", str(out), *common, env={"RUN_SHARDS_FAULT_BATCH_SLEEP": "0.3"})
    wait_for(lambda: all("checkpoint part_000000" in log_text(out, r) for r in (0, 1)), what="first checkpoints")
    position, seq_id, shard = _edit_shortest_record(original)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "Traceback" not in stderr, stderr
    assert (f"shard {shard} stopped: {original}: the file changed after it was indexed: record {position + 1:,} "
            in stderr and "no longer holds the text the index describes" in stderr and f"(record '{seq_id}')" in stderr)
    assert f"same records and lengths, but the contents of {original} differ" in stderr
    assert not (out / "result.h5").exists() and position not in _rows_of_shards(out)
    assert [c[0] for c in suggested_commands(stderr)] == ["rerun", "run"]
    original.write_bytes(saved)
    rerun_matches(out, reference)


def test_an_edit_undone_before_the_next_checkpoint_is_still_caught(fasta, common, reference, tmp_path):
    """Edited, read by a worker, then restored at once: a check of the files at checkpoints would find them
    as indexed and keep the row computed from the edited text; the record's checksum, taken as it is read,
    does not. The rerun then finishes the run with the clean result."""
    original = tmp_path / "in.fasta"
    shutil.copy(fasta, original)
    saved = original.read_bytes()
    out = tmp_path / "out"
    proc = start(str(original), "--out", str(out), *common, env={"RUN_SHARDS_FAULT_BATCH_SLEEP": "0.2"})
    wait_for(lambda: all("checkpoint part_000000" in log_text(out, r) for r in (0, 1)), what="first checkpoints")
    position, seq_id, shard = _edit_shortest_record(original)
    wait_for(lambda: "no longer holds the text" in log_text(out, shard), what="the worker's check")
    original.write_bytes(saved)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1 and f"(record '{seq_id}')" in stderr and "Traceback" not in stderr, stderr
    assert not (out / "result.h5").exists() and position not in _rows_of_shards(out)
    rerun_matches(out, reference)


def test_refused_input_leaves_no_output_directory(common, tmp_path):
    fasta = tmp_path / "in.fasta"
    fasta.write_bytes(b">ok\nMKVL\n>empty\n\n")
    out = tmp_path / "new"
    res = run_cli(str(fasta), "--out", str(out), *common)
    assert res.returncode == 2 and "have no residues" in res.stderr
    assert not out.exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    res = run_cli(str(fasta), "--out", str(existing), *common)
    assert res.returncode == 2 and existing.is_dir() and list(existing.iterdir()) == []


def test_long_sequence_refusal_says_how_many_it_does_not_list(common, tmp_path):
    fasta = tmp_path / "in.fasta"
    fasta.write_bytes(b"".join(b">long%d\n%s\n" % (i, b"M" * (30 + i)) for i in range(17)) + b">short\nMK\n")
    res = run_cli(str(fasta), "--out", str(tmp_path / "out"), *common, "--max-length", "20")
    assert res.returncode == 2
    assert "17 sequence(s) exceed the --max-length limit of 20 tokens" in res.stderr
    assert res.stderr.count("residues)") == 10 and "(and 7 more)" in res.stderr
    # the options, and a command with the one that keeps every residue: the same run as windows
    (command,) = suggested_commands(res.stderr)
    assert command[command.index("--on-long") + 1] == "window" and command[command.index("--max-length") + 1] == "20"
    res = run_cli(*command, "--no-progress")
    assert res.returncode == 0, res.stderr
    windows = read(tmp_path / "out" / "result.h5")["windows"].tolist()
    assert min(windows[:17]) >= 2 and windows[17] == 1, windows


def test_failure_report_is_in_run_log(fasta, common, reference, tmp_path):
    out = tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), *common, env={"RUN_SHARDS_FAULT_DIE_AT": "part-written",
                                                          "RUN_SHARDS_FAULT_DIE_SHARD": "0"})
    assert res.returncode == 1
    logged = (out / "logs" / "run.log").read_text()
    assert "shard 0 failed: killed by SIGKILL (not by run_shards" in logged
    # (it died writing its first checkpoint: what it computed is gone, and the bar and its row say so)
    lost = re.search(r"the ([\d,]+) sequences it computed after its last checkpoint were lost with it", res.stderr)
    assert lost and int(lost[1].replace(",", "")) > 0, res.stderr
    assert re.search(r"^ +0 +CPU +0 ", logged, re.M), logged
    assert f"Continue with:  run_shards rerun {out} --shards 0" in logged
    assert undocumented_files(out) == []
    (command,) = suggested_commands(res.stderr)
    res = run_cli(*command, "--no-progress")
    assert res.returncode == 0, res.stderr
    assert_same(read(out / "result.h5"), reference)


def test_start_over_command_covers_every_setting():
    """`RunConfig.as_command` is what refusals print to start a run over: every setting that shapes the
    result must be on it, with an option `run` accepts, and the line must parse back to the same values.
    A setting meaningless with the others (--pool with --task generate, --per-residue-dtype without
    --per-residue: what a run planned before they were refused may hold) is left out, as `run` refuses it."""
    import dataclasses
    import shlex

    from pipeline.cli import _given, run_command
    from pipeline.config import RunConfig, default_of, misplaced, option_of
    written_apart = {"fasta", "out", "devices", "workers", "threads_per_worker"}
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    assert {n for n in fields if option_of(n).apart} == written_apart
    assert all(option_of(n).flags for n in fields - {"fasta"}), "a RunConfig field without its option"
    options = {o for p in run_command.params for o in (*p.opts, *p.secondary_opts)}   # --no-X of --X/--no-X
    assert {option_of(n).flags[0] for n in fields - {"fasta"}} <= options
    common = dict(fasta=["/data/a b.fasta"], out="o", workers=3, threads_per_worker=2, model="/m", on_long="truncate",
                  max_length=500, checkpoint_seconds=2.5, batch_invariant=False, shards=4, max_tokens_per_batch=1000)
    meaningless = dict(pools=["mean", "cls"], layers=[-1, 2], per_residue=True, per_residue_dtype="float32",
                       sbatch="--partition=gpu")
    generate = RunConfig(**common, **meaningless, seed=7, task="generate", temperature=0.5)
    embed = RunConfig(**common, pools=["mean", "cls"], layers=[-1, 2], per_residue=True, per_residue_dtype="float32")
    flag_off = RunConfig(**common, per_residue_dtype="float32")
    for config, left_out in ((generate, meaningless), (embed, {}), (flag_off, {"per_residue_dtype": "float32"})):
        words = shlex.split(config.as_command("new"))
        assert words[:4] == ["run_shards", "run", "/data/a b.fasta", "--out"]
        ctx = run_command.make_context("run", words[2:])
        p = ctx.params
        assert misplaced(_given(ctx), p) is None, words   # `run` takes the line as it is
        assert (p["out"], p["workers"], p["threads"], p["model"], p["on_long"], p["max_length"],
                p["checkpoint_seconds"], p["gpus"]) == ("new", 3, 2, "/m", "truncate", 500, 2.5, "0")
        assert p["batch_invariant"] is False
        settings = {k: v for k, v in p.items() if k in fields}
        assert RunConfig(**dict(settings, fasta=["/data/a b.fasta"], out="o", devices=[], workers=3,
                                threads_per_worker=2)) == dataclasses.replace(
            config, **{k: default_of(k) for k in left_out})   # every setting that means something parses back
    assert (generate.as_command().count("--seed 7"), generate.as_command().count("--temperature 0.5")) == (1, 1)
    assert "--pool mean,cls --layers -1,2 --per-residue --per-residue-dtype float32" in embed.as_command()


def test_a_setting_meaningless_to_both_runs_is_no_change():
    """A run planned before --per-residue-dtype without --per-residue was refused kept the value: continuing it,
    or reusing its rows, with a command `run` now accepts (no --per-residue-dtype) is the same run; with
    --per-residue on both, the dtype is a change."""
    from pipeline.config import RunConfig
    from pipeline.planning.run_identity import settings_changes
    resolved = {"model": "demo", "engine": "native", "dtype": "float32"}
    old = RunConfig(fasta=["a.fa"], out="o", per_residue_dtype="float32")
    assert settings_changes(old, resolved, RunConfig(fasta=["a.fa"], out="o"), resolved) == []
    assert settings_changes(RunConfig(fasta=["a.fa"], out="o", per_residue=True, per_residue_dtype="float32"),
                            resolved, RunConfig(fasta=["a.fa"], out="o", per_residue=True), resolved) == \
        [("--per-residue-dtype", "float32", "float16")]


def test_suggested_commands_quote_an_out_with_spaces_quotes_and_dollars(fasta, common, reference, tmp_path):
    """A run directory named as users name folders ("my runs/it's $HOME"): every command the failure, `status`
    and report.html suggest names that directory when pasted into a shell, and the suggested rerun finishes
    the run (once, unquoted, they named '/tmp/my' with 'runs/...' as a second argument)."""
    import html
    import os
    import re
    import shlex
    import subprocess

    from .tiny_models import REPO
    out = tmp_path / "my runs" / "it's $HOME"
    res = run_cli(fasta, "--out", str(out), *common, env={"RUN_SHARDS_FAULT_DIE_AT": "part-written",
                                                          "RUN_SHARDS_FAULT_DIE_SHARD": "1"})
    assert res.returncode == 1, res.stderr
    (rerun,) = re.findall(r"Continue with:\s+(run_shards .+)", res.stderr)
    assert shlex.split(rerun) == ["run_shards", "rerun", str(out), "--shards", "1"], rerun

    status = run_cli("status", str(out))
    assert status.returncode == 0, status.stderr
    suggested = suggested_commands(status.stdout)
    assert suggested and all(c[1] == str(out) for c in suggested), status.stdout
    assert run_cli("report", str(out)).returncode == 0
    report = (out / "report.html").read_text()
    assert html.escape(shlex.join(["run_shards", "rerun", str(out)])) in report, report
    assert "<p id='headline' class='failed'>" in report and "$HOME" in report

    # pasted into a shell, as users do (bin/ on PATH stands for the installed command)
    env = dict(os.environ, PATH=f"{REPO / 'bin'}:{os.environ['PATH']}", HOME="/nonexistent")
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(["bash", "-c", rerun + " --no-progress"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert_same(read(out / "result.h5"), reference)
    finished = run_cli("status", str(out)).stdout
    assert [c[1] for c in suggested_commands(finished)] == [str(out)] * len(suggested_commands(finished))


def test_caches_too_large_for_the_ram_lead_to_a_run_that_continues_with_a_budget_that_fits(fasta, common, reference,
                                                                                          tmp_path):
    """A worker refusing caches past the free RAM stopped the run with "Continue with: run_shards rerun OUT",
    which stopped the same way (rerun keeps the budget). Its message now names the `run` command that continues
    the run with a --max-tokens-per-batch that fits, the run's own advice stays silent, and that command
    finishes the run with the rows a run with any budget gives."""
    import re

    out = tmp_path / "out"
    small = {"RUN_SHARDS_FAULT_FREE_RAM": str(64 * 2**20)}
    res = run_cli(fasta, "--out", str(out), *common, "--max-tokens-per-batch", "50000000", env=small)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "caches need" in res.stderr and "Continue with" not in res.stderr, res.stderr
    (command, *others) = {tuple(c) for c in suggested_commands(res.stderr)}
    assert others == [] and command[:3] == ("run", fasta, "--out") and command[3] == str(out), command
    budget = int(re.search(r"--max-tokens-per-batch to (\d+) ", res.stderr).group(1))
    assert command[command.index("--max-tokens-per-batch") + 1] == str(budget) and budget < 50000000
    res = run_cli(*command, "--no-progress", env=small)
    assert res.returncode == 0, res.stderr
    assert_same(read(out / "result.h5"), reference)


def _failed_run_without_its_index(fasta, common, out):
    res = run_cli(fasta, "--out", str(out), *common, env={"RUN_SHARDS_FAULT_DIE_AT": "part-written",
                                                          "RUN_SHARDS_FAULT_DIE_SHARD": "1"})
    assert res.returncode == 1, res.stderr
    planned = (out / "index.rsidx").read_bytes()
    (out / "index.rsidx").unlink()
    return planned


def test_an_index_deleted_by_hand_is_built_again_by_the_rerun_status_suggests(fasta, common, reference, tmp_path):
    """index.rsidx deleted from an unfinished run (a clean-up of "big files") stranded it: status, merge and
    rerun all failed ("cannot read the run's index ... check the file system") while its shards sat there.
    Now status and merge say so and name `rerun`, which builds the very same index from the FASTA and
    finishes the run."""
    out = tmp_path / "out"
    planned = _failed_run_without_its_index(fasta, common, out)
    status = run_cli("status", str(out))
    assert status.returncode == 0 and "index.rsidx is missing (deleted or moved)" in status.stdout, status
    assert suggested_commands(status.stdout) == [["rerun", str(out)]]
    merge = run_cli("merge", str(out))
    assert merge.returncode == 2 and suggested_commands(merge.stderr) == [["rerun", str(out)]], merge.stderr
    rerun_matches(out, reference)
    assert (out / "index.rsidx").read_bytes() == planned


def test_an_index_deleted_by_hand_is_built_again_by_the_same_run_command(fasta, common, reference, tmp_path):
    out = tmp_path / "out"
    planned = _failed_run_without_its_index(fasta, common, out)
    res = run_cli(fasta, "--out", str(out), *common)
    assert res.returncode == 0, res.stderr
    assert "index.rsidx was missing: built again from the FASTA" in res.stderr
    assert_same(read(out / "result.h5"), reference)
    assert (out / "index.rsidx").read_bytes() == planned


def test_an_index_deleted_with_the_copy_plan_of_a_reuse_run_is_refused_with_both_ways_out(tmp_path):
    """A run that copies rows from results --reuse named cannot rebuild its index without copies.rsidx, which
    alone records which (nor with a damaged one): the message names both files and a new run (the manifest check
    alone, no model needed). A run whose copies are its own duplicates rebuilds both (tests/test_damaged_files.py)."""
    import dataclasses

    from pipeline.config import RunConfig
    from pipeline.output import copy_plan
    from pipeline.planning.run_index import missing_index
    from pipeline.rundir.layout import RunDir
    run = RunDir(tmp_path / "out")
    counts = {"records": 10, "computed": 7}
    config = dataclasses.asdict(RunConfig(fasta=["in.fasta"], out=str(run.root)))
    reused = {"config": config, "world": 2, "copies": {"counts": counts, "sources": [{"path": "earlier/result.h5"}]}}
    own = {"config": config, "world": 2, "copies": {"counts": counts, "sources": []}}
    said = missing_index(run, reused)
    assert "copies.rsidx" in said and "restore both" in said and "--out" in said, said
    assert "builds it again" in missing_index(run, own)
    (tmp_path / "out").mkdir()
    run.copies_path.write_bytes(b"")
    assert "restore both" in missing_index(run, reused)
    copy_plan.write(run.copies_path, 10, [], [], counts)   # (a plan that reads; its arrays do not matter here)
    assert "builds it again" in missing_index(run, reused)


def test_an_index_deleted_from_a_run_an_earlier_version_planned_is_not_promised_back(tmp_path):
    """A run planned before 2026-11-27 may hold an index fingerprinted over fewer arrays: deleted, this version
    cannot build its like again. status promised `rerun` would, and rerun then said the FASTA had changed; both
    now say that the index may have to be restored, and rerun names both ways out."""
    import dataclasses

    from pipeline.config import RunConfig
    from pipeline.errors import UserError
    from pipeline.planning.run_index import _rebuild, missing_index
    from pipeline.rundir.layout import RunDir
    fasta = tmp_path / "in.fasta"
    fasta.write_text(">a\nMKV\n>b\nMKVL\n")
    run = RunDir(tmp_path / "out")
    run.root.mkdir()
    config = dataclasses.asdict(RunConfig(fasta=[str(fasta)], out=str(run.root)))
    earlier = {"config": config, "world": 1, "index": {"fingerprint": "b608e871-2", "count": 2}, "attrs": {}}
    said = missing_index(run, earlier)
    assert "builds it again" in said and "one from before 2026-11-27" in said and "restore index.rsidx" in said, said
    with pytest.raises(UserError) as refused:
        _rebuild(run, earlier)
    said = str(refused.value)
    assert "the FASTA changed since, or the run_shards that planned it (one from before 2026-11-27)" in said, said
    assert [c[0] for c in suggested_commands(said)] == ["rerun", "run"] and not run.index_path.exists(), said
    now = dict(earlier, attrs={"resolved": {}})   # planned by this version: the FASTA is what changed
    assert "before 2026-11-27" not in missing_index(run, now)
    with pytest.raises(UserError) as refused:
        _rebuild(run, now)
    assert "the input FASTA no longer matches this run" in str(refused.value)


def test_a_dry_runs_refusal_suggests_a_dry_run(fasta, common, tmp_path):
    """A --dry-run (a SLURM plan written, nothing submitted) into a directory planned with another --shards was
    refused with a start-over command without --dry-run: pasted as it was, it submitted the jobs the user was
    only previewing. The suggested command keeps --dry-run, and it writes the scripts and submits nothing."""
    out = tmp_path / "out"
    slurm = ["--launcher", "slurm", "--dry-run", *common[:2], "--gpus", "0"]
    res = run_cli(fasta, "--out", str(out), *slurm, "--shards", "2")
    assert res.returncode == 0 and "nothing was submitted" in res.stdout + res.stderr, res.stderr
    res = run_cli(fasta, "--out", str(out), *slurm, "--shards", "3")
    assert res.returncode == 2 and "holds a run planned as 2 shard(s)" in res.stderr, res.stderr
    (again,) = [c for c in suggested_commands(res.stderr) if c[0] == "run"]
    assert "--dry-run" in again and again[again.index("--out") + 1] == f"{out}-2", again
    res = run_cli(*again)
    assert res.returncode == 0 and "nothing was submitted" in res.stdout + res.stderr, res.stderr


def test_a_dry_run_reruns_refusal_suggests_commands_that_preview(fasta, common, tmp_path):
    """`rerun --dry-run` of a SLURM plan whose FASTA changed since was refused with `rerun OUT` and a start-over
    `run` without --dry-run (only `run`'s planning kept it): pasted, either submitted the jobs being previewed."""
    path, out = tmp_path / "in.fasta", tmp_path / "out"
    shutil.copy(fasta, path)
    slurm = ["--launcher", "slurm", "--dry-run", *common[:2], "--gpus", "0", "--shards", "2"]
    assert run_cli(str(path), "--out", str(out), *slurm).returncode == 0
    path.write_bytes(path.read_bytes() + b">appended\nMKV\n")
    res = run_cli("rerun", str(out), "--dry-run")
    assert res.returncode == 2 and "the input FASTA no longer matches this run" in res.stderr, res.stderr
    commands = suggested_commands(res.stderr)
    assert [c[0] for c in commands] == ["rerun", "run"] and all("--dry-run" in c for c in commands), commands
    res = run_cli(*commands[1])
    assert res.returncode == 0 and "nothing was submitted" in res.stdout + res.stderr, res.stderr


def _three_records(tmp_path) -> str:
    path = tmp_path / "three.fasta"
    path.write_text(">a\nMKTAYIAKQRQISFVKSHFSRQ\n>b\nMSEQNNTEMTFQIQRIYTKDIS\n>c\nMGLSDGEWQLVLNVWGKVEAD\n")
    return str(path)


@pytest.mark.parametrize("ram, settings", [(6_000_000, {"--max-tokens-per-batch"}),
                                           (2_500_000, {"--max-seqs"}),
                                           (1_000_000, {"--max-tokens-per-batch", "--max-seqs"})])
def test_generate_caches_too_large_lead_to_the_same_run_with_launch_settings_that_fit(models, tmp_path, ram,
                                                                                       settings):
    """Generating, a worker whose caches do not fit the RAM names the `run` command continuing the run with
    a lower --max-tokens-per-batch, else a lower --max-seqs, else both (how the shards run, not what they
    compute); the run's own advice names no `rerun` (which stops the same way), and that command finishes."""
    fasta, out = _three_records(tmp_path), tmp_path / "out"
    args = ["--model", models["demo"], "--gpus", "0", "--workers", "1", "--no-progress", "--task", "generate",
            "--max-new-tokens", "20", "--max-length", "1000"]
    small = {"RUN_SHARDS_FAULT_FREE_RAM": str(ram)}
    res = run_cli(fasta, "--out", str(out), *args, env=small)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "caches need" in res.stderr and "Continue with" not in res.stderr and "rerun" not in res.stderr
    (command, *others) = {tuple(c) for c in suggested_commands(res.stderr)}
    assert others == [] and command[:4] == ("run", fasta, "--out", str(out)), command
    lowered = {w for w in command if w in ("--max-tokens-per-batch", "--max-seqs")}
    assert lowered == settings, command
    assert command[command.index("--max-new-tokens") + 1] == "20"
    res = run_cli(*command, "--no-progress", env=small)
    assert res.returncode == 0, res.stderr
    assert len(read(out / "result.h5")["generate/finish_reason"]) == 3


def test_generate_caches_too_large_for_any_launch_setting_lead_to_a_new_run_with_fewer_new_tokens(models, tmp_path):
    """The red team's case: --max-new-tokens 1000000000 gives caches no --max-tokens-per-batch or --max-seqs
    brings within the RAM. The run ended with "Continue with: run_shards rerun OUT --shards 0", which stopped the
    same way. The worker's refusal now names a new run, in another --out (--max-new-tokens changes what is
    computed), with the largest --max-new-tokens that fits, no `rerun` is suggested, and that run finishes."""
    fasta, out = _three_records(tmp_path), tmp_path / "out"
    args = ["--model", models["demo"], "--gpus", "0", "--workers", "1", "--no-progress", "--task", "generate",
            "--max-new-tokens", "1000000000", "--max-length", "1000"]
    small = {"RUN_SHARDS_FAULT_FREE_RAM": str(16_000_000)}
    res = run_cli(fasta, "--out", str(out), *args, env=small)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "caches need" in res.stderr and "Continue with" not in res.stderr and "rerun" not in res.stderr
    (command, *others) = {tuple(c) for c in suggested_commands(res.stderr)}
    assert others == [] and command[:3] == ("run", fasta, "--out") and command[3] != str(out), command
    assert not Path(command[3]).exists() and Path(command[3]).parent == out.parent
    new_tokens = int(command[command.index("--max-new-tokens") + 1])
    assert 1 <= new_tokens < 1000 and f"--max-new-tokens to {new_tokens} (or less)" in res.stderr
    # `status` and the report say the same: no `rerun` (it said "`run_shards rerun OUT` computes the unfinished
    # shards"), the failed shard's message with its command
    status = run_cli("status", str(out), env=small)
    assert status.returncode == 0 and "a rerun stops the same way" in status.stdout, status.stdout
    assert {c[0] for c in suggested_commands(status.stdout)} == {"run", "report"}, status.stdout
    assert run_cli("report", str(out)).returncode == 0
    assert "Next: a rerun stops the same way" in (out / "report.html").read_text()
    res = run_cli(*command, "--no-progress", env=small)
    assert res.returncode == 0, res.stderr
    assert len(read(Path(command[3]) / "result.h5")["generate/finish_reason"]) == 3


def test_caches_are_sized_for_the_runs_longest_record_not_the_models_limit(models, tmp_path):
    """The KV cache held one sequence of the model's whole limit (the demo model's 65,536 tokens; Qwen3.5's
    262,144) whatever the input: three records of ~24 tokens were refused in 3 MB of RAM ("only --max-length
    helps", and no command). It now holds the run's longest record, recorded by the plan, and they run."""
    fasta, out = _three_records(tmp_path), tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), "--model", models["demo"], "--gpus", "0", "--workers", "1",
                  "--no-progress", env={"RUN_SHARDS_FAULT_FREE_RAM": str(3_000_000)})
    assert res.returncode == 0, res.stderr
    from transformers import AutoTokenizer
    longest = len(AutoTokenizer.from_pretrained(models["demo"])("MKTAYIAKQRQISFVKSHFSRQ")["input_ids"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["max_tokens"] == 65536 and manifest["longest_prompt"] == longest == 24, manifest
    pages = int(re.search(r"KV cache (\d+) pages x 16 tokens", log_text(out, 0)).group(1))
    assert pages == 2 + 4096 // 16 + 256    # the longest record's pages, then one step's and a page of slack each


def test_caches_too_large_for_the_longest_record_lead_to_a_new_run_with_a_max_length_that_fits(models, tmp_path):
    """Where no lower --max-tokens-per-batch, --max-seqs or --max-new-tokens makes the caches fit (the run's
    longest record alone is too much), the worker's refusal named no command ("only --max-length helps"). It
    now names a new run, in another --out, with the largest --max-length that fits and the records over it run
    as windows (--on-long error would refuse them); the run's advice names no `rerun`, and that run finishes
    with every record, the long one in windows."""
    fasta, out = tmp_path / "long.fasta", tmp_path / "out"
    residues = "ACDEFGHIKLMNPQRSTVWY" * 1000   # 20,000 residues: the demo model's cache for them is ~5 MB
    fasta.write_text(f">long\n{residues}\n>a\nMKTAYIAKQRQISFVKSHFSRQ\n>b\nMSEQNNTEMTFQIQRIYTKDIS\n")
    small = {"RUN_SHARDS_FAULT_FREE_RAM": str(3_000_000)}
    res = run_cli(str(fasta), "--out", str(out), "--model", models["demo"], "--gpus", "0", "--workers", "1",
                  "--no-progress", env=small)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "Continue with" not in res.stderr and "run_shards rerun" not in res.stderr, res.stderr
    (command, *others) = {tuple(c) for c in suggested_commands(res.stderr)}
    assert others == [] and command[:3] == ("run", str(fasta), "--out") and command[3] != str(out), command
    length = int(command[command.index("--max-length") + 1])
    assert 64 <= length < 20_000 and f"lower --max-length to {length} (or less)" in res.stderr
    assert command[command.index("--on-long") + 1] == "window" and "--window" not in command, command
    assert f"records over {length} tokens run as overlapping windows" in res.stderr
    res = run_cli(*command, "--no-progress", env=small)
    assert res.returncode == 0, res.stderr
    rows = read(Path(command[3]) / "result.h5")
    assert [i.decode() for i in rows["ids"]] == ["long", "a", "b"] and rows["windows"][0] > 1, rows["windows"]


def test_a_variants_run_sizes_its_caches_for_the_records_with_variants(models, tmp_path):
    """--task variants runs only the records with variants, but the cache was sized for the FASTA's longest
    record: a 20,000-residue record without variants had a run of two short records refused in 3 MB of RAM (and
    a new run with a lower --max-length named, which skipped nothing the run computes). It runs."""
    fasta, out, variants = tmp_path / "long.fasta", tmp_path / "out", tmp_path / "v.csv"
    fasta.write_text(f">long\n{'ACDEFGHIKLMNPQRSTVWY' * 1000}\n>a\nMKTAYIAKQRQISFVKSHFSRQ\n>b\nMSEQNNTEMTFQIQRIYTKDIS\n")
    variants.write_text("id,mutant\na,K2A\nb,S2A\n")
    res = run_cli(str(fasta), "--out", str(out), "--model", models["demo"], "--gpus", "0", "--workers", "1",
                  "--no-progress", "--task", "variants", "--variants", str(variants),
                  env={"RUN_SHARDS_FAULT_FREE_RAM": str(3_000_000)})
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "manifest.json").read_text())["longest_prompt"] == 24


def test_a_slurm_task_refusing_its_caches_names_no_rerun_nor_the_task_again(models, tmp_path):
    """A SLURM task (`run_shards work`) whose worker refused caches past the RAM ended with "Continue with:
    run_shards rerun OUT  (or this task again)", both of which stop the same way; the worker's command (a new
    run, in another --out, through the same launcher) is now the only one named, and the task exits 2 (final)."""
    fasta, out = _three_records(tmp_path), tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), "--model", models["demo"], "--gpus", "0", "--task", "generate",
                  "--max-new-tokens", "1000000000", "--max-length", "1000", "--launcher", "slurm", "--shards", "1",
                  "--dry-run", "--no-progress")
    assert res.returncode == 0, res.stderr
    res = run_cli("work", str(out), "--shard", "0", env={"RUN_SHARDS_FAULT_FREE_RAM": str(16_000_000)})
    assert res.returncode == 2 and "caches need" in res.stderr, res.stderr
    assert "Continue with" not in res.stderr and "this task again" not in res.stderr, res.stderr
    (command, *others) = {tuple(c) for c in suggested_commands(res.stderr)}
    assert others == [] and command[:3] == ("run", fasta, "--out") and command[3] != str(out), command
    assert command[command.index("--launcher") + 1] == "slurm" and "--max-new-tokens" in command


def test_a_slurm_run_whose_task_refused_its_settings_names_no_rerun(slurm_cluster, models, tmp_path):
    """A SLURM run followed with --wait, and `status` after it, ended a run whose shard task refused caches
    past the RAM with "Continue with: run_shards rerun OUT", whose tasks stop the same way; both now point at
    the shard's message, whose command (a new run with fewer new tokens) is the only one named."""
    fasta, out = _three_records(tmp_path), tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), "--model", models["demo"], "--gpus", "0", "--task", "generate",
                  "--max-new-tokens", "1000000000", "--max-length", "1000", "--launcher", "slurm", "--shards", "1",
                  "--wait", "--no-progress", env={**slurm_cluster.env, "RUN_SHARDS_FAULT_FREE_RAM": str(16_000_000)})
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "caches need" in res.stderr and "A rerun stops the same way" in res.stderr, res.stderr
    assert "Continue with" not in res.stderr and "run_shards rerun" not in res.stderr, res.stderr
    (command, *others) = {tuple(c) for c in suggested_commands(res.stderr)}
    assert others == [] and command[:3] == ("run", fasta, "--out") and command[3] != str(out), command
    status = run_cli("status", str(out), env=slurm_cluster.env)
    assert status.returncode == 0 and "a rerun stops the same way" in status.stdout, status.stdout
    assert "Continue with" not in status.stdout and "rerun" not in {c[0] for c in suggested_commands(status.stdout)}
