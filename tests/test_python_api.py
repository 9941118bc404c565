"""`import run_shards` (docs/python.md): each command a function of the same name and arguments, computing
what the command line computes; options by their names, refused as the command line refuses them; and the
package installed with the project (the wheel `pip install .` builds holds it, beside the console script)."""
from __future__ import annotations

import glob
import shutil
import subprocess
import sys
import zipfile

import pytest

import run_shards
from pipeline.config import RunConfig

from .run_helpers import env_with, raw_datasets
from .tiny_models import REPO, run_cli

FASTA = ">first one\nMKTAYIAKQRQISFVKSHFSRQLEERLGLIEV\n>second\nGSHMKT\n>third\nMVLSPADKTNVKAAWGKVGAHAGE\n"


@pytest.fixture(scope="module")
def fasta(tmp_path_factory):
    path = tmp_path_factory.mktemp("python_api") / "three.fasta"
    path.write_text(FASTA)
    return path


@pytest.fixture(scope="module")
def result(fasta):
    """A run made with run_shards.run, and the same run made by the command line (2 shards, one worker computing
    both in turn)."""
    py = fasta.parent / "py_out"
    got = run_shards.run(fasta, out=py, gpus=0, workers=1, shards=2, pool="mean,cls", per_residue=True,
                         per_residue_dtype="float32", max_tokens_per_batch=128, checkpoint_every=1,
                         show_progress=False)
    cli = fasta.parent / "cli_out"
    res = run_cli(str(fasta), "--out", str(cli), "--gpus", "0", "--workers", "1", "--shards", "2", "--pool",
                  "mean,cls", "--per-residue",
                  "--per-residue-dtype", "float32", "--max-tokens-per-batch", "128", "--checkpoint-every", "1",
                  "--no-progress")
    assert res.returncode == 0, res.stderr[-3000:]
    return got, py, cli


@pytest.mark.slow
def test_run_computes_what_the_command_line_computes(result):
    got, py, cli = result
    assert got == py / "result.h5"
    assert raw_datasets(got) == raw_datasets(cli / "result.h5")
    with run_shards.open_result(py) as res:
        assert len(res) == 3 and res.attrs["config"] and "embeddings/cls" in res.columns
        assert res.get("second")["per_residue/values"].shape[0] == 6
        with pytest.raises(run_shards.MissingIds, match="'fourth'"):
            res.rows(["first", "fourth"])
        # one id as text: its characters were looked up as ids ('s', 'e', ...: rows of other records where
        # such ids exist)
        with pytest.raises(run_shards.UserError, match=r"rows\(\) takes a list of ids, not one id as text"):
            res.rows("second")
        with pytest.raises(run_shards.UserError, match=r"records\(\) takes a list of ids, not one id as text"):
            res.records("second")   # (records() converted the text first, past rows()' check)
        assert [r["ids"] for r in res.records(["second", "first"])] == ["second", "first"]
    assert run_shards.get(py, "second") == run_shards.get(py, ["second"])


@pytest.mark.slow
def test_the_other_commands_print_what_the_command_line_prints(result, fasta, tmp_path):
    _, py, cli = result
    def lines(text: str, out) -> list[str]:   # (the free disk space changes from one call to the next)
        return [line for line in text.strip().replace(str(out), "OUT").splitlines() if not line.startswith("disk:")]

    assert lines(run_shards.status(py), py) == lines(run_cli("status", str(cli)).stdout, cli)
    assert run_shards.get(py, ["second", "first"], format="json") == \
        run_cli("get", str(cli), "second", "first", "--format", "json").stdout.strip()
    ids = tmp_path / "ids.txt"
    ids.write_text("third\n")
    assert run_shards.get(py, ids_from=ids) == run_cli("get", str(cli), "--ids-from", str(ids)).stdout.strip()
    printed = run_cli("index", str(fasta), "--workers", "2").stdout.strip()   # (built here, then reused)
    assert run_shards.index(fasta, workers=2) == printed.replace("index: built", "index: reused cached")
    written = run_shards.export(py, "per-id-h5", tmp_path / "per-id.h5", column="embeddings/mean")
    assert written == tmp_path / "per-id.h5" and written.exists()
    assert run_shards.merge(py) == py / "result.h5"
    assert run_shards.report(py) == py / "report.html" and (py / "report.html").exists()


def test_options_go_by_their_names_and_are_refused_as_the_command_line_refuses_them(fasta):
    config = run_shards.run_config(fasta, out="o", gpus=0, workers=2, pool="mean,cls", layers="-1,1",
                                   checkpoint_every=7, max_tokens_per_batch=512, batch_invariant=False)
    assert config == RunConfig(fasta=[str(fasta)], out="o", devices=[], workers=2,
                               threads_per_worker=config.threads_per_worker, pools=["mean", "cls"], layers=[-1, 1],
                               checkpoint_sequences=7, max_tokens_per_batch=512, batch_invariant=False)
    assert run_shards.run_config([fasta, fasta], gpus=0, reuse="old", pools=["last"]).reuse == ["old"]
    refusals = [
        (dict(pol="mean"), "run() has no option 'pol'; did you mean 'pool'?"),
        (dict(pool="mean", pools=["cls"]), "run() was given --pool twice"),
        (dict(temperature=0.7), "--temperature applies only to --task generate (this run's task is embed)"),
        (dict(task="generate", per_residue=True), "--per-residue applies only to --task embed"),
        (dict(dry_run=True), "--dry-run applies only to --launcher slurm"),
        (dict(task="variants"), "--task variants needs --variants FILE"),
        # values of another type than the option's: "no" was taken as true, "512" failed with a TypeError
        (dict(per_residue="no"), "--per-residue must be True or False (got 'no')"),
        (dict(trust_remote_code="false"), "--trust-remote-code must be True or False (got 'false')"),
        (dict(max_tokens_per_batch="512"), "--max-tokens-per-batch must be a whole number (got '512')"),
        (dict(layers=[-1, "2"]), "--layers must be a list of whole numbers (got [-1, '2'])"),
        (dict(layers="-1,x"), "--layers '-1,x': each comma-separated value must be a whole number"),
        # the arguments resolved into devices too: "2" failed with a TypeError, 0 ran the default worker count
        (dict(workers="2"), "--workers must be a whole number (got '2')"),
        (dict(threads="2"), "--threads must be a whole number (got '2')"),
        (dict(workers=0), "--workers must be at least 1 (got 0)"),
        (dict(threads=0), "--threads must be at least 1 (got 0)"),
    ]
    for options, message in refusals:
        with pytest.raises(run_shards.UserError) as e:
            run_shards.run(fasta, out=fasta.parent / "never", gpus=0, **options)
        assert message in str(e.value), (options, str(e.value))
        assert not (fasta.parent / "never").exists()
    for call, message in ((lambda: run_shards.get("x", ["a"], format="csv"), "--format 'csv': not one of tsv, json"),
                          (lambda: run_shards.export("x", "csv"), "--format 'csv': not one of parquet, per-id-h5"),
                          (lambda: run_shards.report(fasta.parent), "not a run_shards output directory")):
        with pytest.raises(run_shards.UserError, match=message):
            call()


def test_sampling_options_of_greedy_decoding_are_refused_and_accepted_with_a_temperature(fasta):
    """--seed and --top-p at --temperature 0 (greedy: nothing is drawn) were ignored, so a user who forgot
    --temperature believed the run sampled with their seed; now both the command line and run() refuse them,
    naming the temperature, and take them with a temperature above 0 (as_command keeps them then)."""
    never = fasta.parent / "greedy"
    for option, value in (("--seed", "7"), ("--top-p", "0.9")):
        message = (f"{option} applies only with --temperature above 0 (at 0, greedy decoding, nothing is sampled): "
                   f"give --temperature T, or drop {option}")
        res = run_cli(str(fasta), "--out", str(never), "--gpus", "0", "--task", "generate", option, value,
                      "--no-progress")
        assert res.returncode == 2 and message in res.stderr, res.stderr[-3000:]
        with pytest.raises(run_shards.UserError) as e:
            run_shards.run(fasta, out=never, gpus=0, task="generate", show_progress=False,
                           **{option[2:].replace("-", "_"): float(value)})
        assert message in str(e.value)
    assert not never.exists()
    sampled = RunConfig(fasta=[str(fasta)], out=str(never), task="generate", temperature=0.5, seed=7, top_p=0.9)
    assert not {"seed", "top_p"} & sampled.ignored()
    assert "--seed 7" in sampled.as_command() and "--top-p 0.9" in sampled.as_command()


@pytest.mark.slow
def test_an_option_of_a_flag_left_off_is_refused_saying_how_to_fix_it(result, fasta):
    """--per-residue-dtype without --per-residue was run, the option ignored; now refused before any work, by
    the command line and by run(), naming both ways out. The first (add --per-residue) is `result`'s run."""
    never = fasta.parent / "never"
    message = "--per-residue-dtype applies only with --per-residue: add --per-residue, or drop --per-residue-dtype"
    res = run_cli(str(fasta), "--out", str(never), "--gpus", "0", "--per-residue-dtype", "float32", "--no-progress")
    assert res.returncode == 2 and message in res.stderr, res.stderr[-3000:]
    with pytest.raises(run_shards.UserError) as e:
        run_shards.run(fasta, out=never, gpus=0, per_residue_dtype="float32", show_progress=False)
    assert message in str(e.value)
    # (per_residue=False given is the flag left off too; score has no per-residue dtype, whatever the flag)
    with pytest.raises(run_shards.UserError, match="add --per-residue, or drop --per-residue-dtype"):
        run_shards.run(fasta, out=never, gpus=0, per_residue=False, per_residue_dtype="float16")
    with pytest.raises(run_shards.UserError, match=r"--per-residue-dtype applies only to --task embed \(this run's "
                                                   r"task is score\)"):
        run_shards.run(fasta, out=never, gpus=0, task="score", per_residue=True, per_residue_dtype="float32")
    assert not never.exists()
    _, py, cli = result   # added --per-residue: the values are stored as float32
    for out in (py, cli):
        with run_shards.open_result(out) as data:
            assert data.get("second")["per_residue/values"].dtype == "float32"


def test_the_package_is_installed_with_the_project(tmp_path):
    """What `pip install .` (and `-e .`) installs: run_shards/ beside the rooms, and the console script. Built
    from a copy, so the checkout gets no build/ folder."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in ("run_shards", "pipeline", "index", "triton_kernels"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(tmp_path), str(source)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = glob.glob(str(tmp_path / "*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry_points = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "run_shards/__init__.py" in names and "pipeline/commands.py" in names and "index/__init__.py" in names
    assert "run_shards = pipeline.cli:entry" in entry_points


def test_a_script_without_a_main_guard_runs_once(fasta, tmp_path):
    """docs/python.md's example saved as a script, as written (no `if __name__ == "__main__":`): the workers are
    spawned processes, and spawn runs the main script's top level again in each one unless run_shards hides it;
    the worker then started a second run of its own (refused: the run directory is in use) and the shard
    failed. The script's top level runs once, and the run succeeds."""
    script = tmp_path / "embed.py"
    script.write_text(
        "import run_shards\n"
        f"with open({str(tmp_path / 'ran')!r}, 'a') as ran:\n"
        "    ran.write('top level\\n')\n"
        f"print(run_shards.run({str(fasta)!r}, out={str(tmp_path / 'out')!r}, gpus=0, workers=1, "
        "show_progress=False))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env_with(PYTHONPATH=REPO))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(tmp_path / "out" / "result.h5")
    assert (tmp_path / "ran").read_text() == "top level\n"


@pytest.mark.slow
def test_run_leaves_the_callers_logging_as_it_found_it(fasta, tmp_path):
    """docs/python.md: the functions print nothing themselves; basicConfig(level=INFO) shows what the command
    line shows. run() set the `run_shards` logger to INFO for run.log and left it there, so a script's plain
    `logging.basicConfig()` (WARNING) printed every INFO line of the run. Now the caller's handlers show what
    its levels let through, run.log keeps the INFO lines, and a second run at INFO shows each line once."""
    script = tmp_path / "quiet.py"
    script.write_text(
        "import logging, run_shards\n"
        "logging.basicConfig(format='%(levelname)s %(message)s')\n"
        "ours, root = logging.getLogger('run_shards'), logging.getLogger()\n"
        f"run_shards.run({str(fasta)!r}, out={str(tmp_path / 'a')!r}, gpus=0, workers=1, show_progress=False)\n"
        "print('after:', ours.level, ours.handlers, root.handlers[0].filters, flush=True)\n"
        "root.setLevel(logging.INFO)\n"
        f"run_shards.run({str(fasta)!r}, out={str(tmp_path / 'b')!r}, gpus=0, workers=1, show_progress=False)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env_with(PYTHONPATH=REPO, RUN_SHARDS_REPORT="0"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "after: 0 [] []"
    assert f"merged 3 sequences into {tmp_path / 'a'}" not in done.stderr
    assert f"merged 3 sequences into {tmp_path / 'a'}" in (tmp_path / "a" / "logs" / "run.log").read_text()
    assert done.stderr.count(f"INFO merged 3 sequences into {tmp_path / 'b'}") == 1, done.stderr[-3000:]
    assert done.stderr.count("INFO run_shards ") == 1, done.stderr[-3000:]


def test_each_function_docs_python_md_spells_out_has_those_arguments():
    """docs/python.md writes each function with its arguments (`run_shards.merge(out, allow_partial=False,
    ...)`): the names and their order are the function's, and each default written is its default (at 17f6bc6
    `work` lacked show_progress)."""
    import inspect
    import re
    written = re.findall(r"`run_shards\.(\w+)\(([^`]*)\)`", (REPO / "docs" / "python.md").read_text())
    assert {name for name, _ in written} >= {"run", "rerun", "merge", "status", "get", "export", "work", "index"}
    for name, args in written:
        params = [p for p in inspect.signature(getattr(run_shards, name)).parameters.values()]
        shown = [a.strip() for a in args.replace("\n", " ").split(",") if a.strip()]
        assert len(shown) == len(params), (name, shown)
        for text, p in zip(shown, params):
            if p.kind is p.VAR_KEYWORD:
                assert text == f"**{p.name}", (name, text)
                continue
            given, _, default = text.partition("=")
            assert given == p.name, (name, text)
            if default:
                assert eval(default) == p.default, (name, text, p.default)


@pytest.mark.slow
def test_ctrl_c_during_run_is_not_swallowed_by_a_scripts_except_run_failed(fasta, tmp_path):
    """A script going over its inputs, `except run_shards.RunFailed: continue`, went on to the next input when
    the user pressed Ctrl-C while shards ran (the interruption was a RunFailed): it now raises
    run_shards.RunInterrupted, a KeyboardInterrupt naming where the shards stopped, which ends the script; the
    run's checkpoints are kept and its rerun finishes it."""
    import signal
    import time

    outs = [tmp_path / "a", tmp_path / "b"]
    script = tmp_path / "many.py"
    script.write_text(
        "import run_shards\n"
        f"for out in {[str(o) for o in outs]!r}:\n"
        "    try:\n"
        f"        run_shards.run({str(fasta)!r}, out=out, gpus=0, workers=1, show_progress=False)\n"
        "    except run_shards.RunFailed:\n"
        "        print('went on', flush=True)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, env=env_with(PYTHONPATH=REPO, RUN_SHARDS_REPORT="0",
                                                       RUN_SHARDS_FAULT_BATCH_SLEEP="8"))
    log = outs[0] / "logs" / "worker_0.log"
    deadline = time.time() + 120
    while not (log.exists() and "to do" in log.read_text()):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "went on" not in stdout, (stdout, stderr[-3000:])
    assert "RunInterrupted" in stderr and "shard 0 stopped" in stderr, stderr[-3000:]
    assert not outs[1].exists()
    assert isinstance(run_shards.RunInterrupted("x"), KeyboardInterrupt)
    assert not issubclass(run_shards.RunInterrupted, run_shards.RunFailed)
    assert run_shards.rerun(outs[0], show_progress=False) == outs[0] / "result.h5"
