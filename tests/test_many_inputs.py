"""Runs over many FASTA files: what names the inputs (run.log's first line, the commands messages suggest) stays
readable. 3,000 one-protein files made a 150 KB first line in run.log and a 100 KB `run_shards run ...` in every
start-over message; now a line names a few and how many, and a suggested command names them by a glob where one
names exactly them, in their order (else still every path: a command that works)."""
import os
import re
import subprocess

from pipeline.advice import command, files_shown, files_words

from .run_helpers import read, suggested_commands
from .tiny_models import REPO, run_cli


def _files(folder, names):
    folder.mkdir(parents=True, exist_ok=True)
    paths = [str(folder / n) for n in names]
    for i, p in enumerate(paths):
        with open(p, "w") as f:
            f.write(f">s{i}\nMKVLAAGIVG\n")
    return paths


def _expanded(words: list[str]) -> list[str]:
    """What bash makes of the command's words (a glob expanded), as a pasted command gets them."""
    line = command("x", *words)[len("run_shards x "):]
    out = subprocess.run(["bash", "-c", f"printf '%s\\0' {line}"], capture_output=True, text=True, check=True).stdout
    return out.split("\0")[:-1]


def test_a_line_names_a_few_of_many_files_and_how_many():
    few = [f"d/p{i}.fa" for i in range(3)]
    assert files_shown(few) == "d/p0.fa d/p1.fa d/p2.fa"
    many = [f"d/p{i:04d}.fa" for i in range(3000)]
    assert files_shown(many) == "3,000 files: d/p0000.fa d/p0001.fa ... d/p2999.fa"


def test_a_glob_names_many_files_only_where_it_expands_to_exactly_them_in_order(tmp_path):
    # zero-padded names in a folder whose name needs quoting: one word, which bash expands to exactly them
    folder = tmp_path / "my runs" / "it's $HOME"
    padded = _files(folder, [f"p{i:03d}.fasta" for i in range(12)])
    (words,) = files_words(padded)
    assert words.endswith("*.fasta") and _expanded([words]) == padded
    # another file the glob would take: every path again
    _files(folder, ["p0-old.fasta"])
    assert files_words(padded) == padded and _expanded(padded) == padded
    # names whose order a locale may sort otherwise (unpadded numbers), or not in sorted order: every path
    plain = _files(tmp_path / "plain", [f"p{i}.fa" for i in range(12)])
    assert files_words(plain) == plain
    ordered = _files(tmp_path / "ordered", [f"p{i:02d}.fa" for i in range(12)])
    assert files_words(ordered[::-1]) == ordered[::-1]
    assert len(files_words(ordered)) == 1
    # files of several folders, and few files: the paths
    assert files_words(plain[:6] + ordered[:6]) == plain[:6] + ordered[:6]
    assert files_words(ordered[:3]) == ordered[:3]


def test_a_run_over_many_files_logs_a_short_first_line_and_suggests_a_start_over_that_works(common, tmp_path):
    paths = _files(tmp_path / "in", [f"p{i:03d}.fasta" for i in range(40)])
    out = tmp_path / "out"
    res = run_cli(*paths, "--out", str(out), *common)
    assert res.returncode == 0, res.stderr
    first = (out / "logs" / "run.log").read_text().splitlines()[0]
    assert "40 files: " in first and [p for p in paths if p in first] == [paths[0], paths[1], paths[-1]], first
    assert run_cli("report", str(out)).returncode == 0   # its settings table: a few paths, not a JSON list of 40
    page = (out / "report.html").read_text()
    assert f"<td>fasta</td><td>40 files: {paths[0]} {paths[1]} ... {paths[-1]} (every one in manifest.json)" in page
    assert paths[20] not in page

    with open(paths[5], "w") as f:   # an input edited after the run: the start-over command names the glob
        f.write(">s5\nMKVLAAGIVW\n")
    res = run_cli("rerun", str(out))
    assert res.returncode == 2, res.stderr
    (start_over,) = [c for c in re.findall(r"`(run_shards run [^`]+)`", res.stderr)]
    assert f"{tmp_path / 'in'}/p0*.fasta --out" in start_over and paths[0] not in start_over, start_over
    assert [c[0] for c in suggested_commands(res.stderr)] == ["rerun", "run"]
    env = dict(os.environ, PATH=f"{REPO / 'bin'}:{os.environ['PATH']}")
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(["bash", "-c", start_over + " --no-progress"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert [i.decode() for i in read(out.parent / "out-2" / "result.h5")["ids"]] == [f"s{i}" for i in range(40)]

    # the inputs moved away: the message names a few of them and how many (it named each, twice)
    (tmp_path / "in").rename(tmp_path / "moved")
    res = run_cli("rerun", str(out))
    assert res.returncode == 2 and "Put 40 files: " in res.stderr and paths[1] in res.stderr, res.stderr
    assert "and 35 more" in res.stderr and paths[20] not in res.stderr and len(res.stderr) < 2000, res.stderr


def test_failed_shards_among_many_are_named_as_ranges_that_rerun_takes(models, tmp_path):
    """A failed run of many shards named every failed one (`--shards 0,1,2,...,119`); now as ranges, which
    `rerun --shards` takes."""
    out, fasta = tmp_path / "out", tmp_path / "six.fasta"
    fasta.write_text("".join(f">s{i}\n{'MKTAYIAKQR' * (2 + i)}\n" for i in range(6)))
    res = run_cli(str(fasta), "--out", str(out), "--model", models["demo"], "--gpus", "0", "--workers", "1",
                  "--shards", "2", "--checkpoint-every", "1", "--no-progress",
                  env={"RUN_SHARDS_FAULT_DIE_AT": "part-written"})
    assert res.returncode == 1, res.stderr
    (rerun,) = re.findall(r"Continue with:\s+(run_shards .+)", res.stderr)
    assert rerun == f"run_shards rerun {out} --shards 0-1", rerun
    bad = run_cli("rerun", str(out), "--shards", "5-2")
    assert bad.returncode == 2 and "shard numbers or ranges (3,17,20-22), got '5-2'" in bad.stderr, bad.stderr
    res = run_cli(*rerun.split()[1:])
    assert res.returncode == 0, res.stderr
    assert f"rerun {out} --shards 0-1" in (out / "logs" / "run.log").read_text()
    assert len(read(out / "result.h5")["ids"]) == 6
