"""OUT/report.html in a real headless browser (Debian's Chromium, installed by `make test-deps`): the page
renders, its charts are not blank, and its numbers are those of result.h5 and run.log; a failed run's page
shows why it failed, `run_shards report OUT` writes it for a run without a result, and the page of the
rerun that finished it lists the restart with its reason."""
from __future__ import annotations

import base64
import html
import io
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pipeline.reporting.facts import attempts
from pipeline.rundir import events

from .run_helpers import read, skip_or_fail, status_rows, undocumented_files
from .tiny_models import run_cli

REPORT_ON = {"RUN_SHARDS_REPORT": "1"}
CHART_BLUE = (0x4c, 0x72, 0xb0)   # the length histogram's bars (pipeline/reporting/report.py)


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    why = ("not root" if os.geteuid() != 0 else "no apt-get" if not shutil.which("apt-get") else
           "its install failed (see the output of tests/setup/install_chromium.sh)")
    skip_or_fail(f"Chromium is not installed ({why}; `make test-deps` installs it: tests/setup/install_chromium.sh)")


def render(page: Path, tmp_path: Path) -> tuple[str, np.ndarray]:
    """The page's DOM as Chromium built it, and a screenshot of it as an RGB array in 0..1."""
    browser = chromium()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             f"--user-data-dir={tmp_path / 'chromium-profile'}"]
    dom = subprocess.run([browser, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0 and "</html>" in dom.stdout, dom.stderr
    shot = tmp_path / "screenshot.png"
    done = subprocess.run([browser, *flags, f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and shot.exists(), done.stderr
    import matplotlib.image
    return dom.stdout, matplotlib.image.imread(str(shot))[..., :3]


def charts(page: str) -> list[np.ndarray]:
    """The page's inline images, decoded."""
    import matplotlib.image
    return [matplotlib.image.imread(io.BytesIO(base64.b64decode(data)), format="png")[..., :3]
            for data in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]


def cells(page: str, table: str) -> list[list[str]]:
    """The text of each data row's cells of the table with this id."""
    body = re.search(rf"""<table id=["']{table}["'][^>]*>(.*?)</table>""", page, re.S).group(1)
    return [[html.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
            for row in re.findall(r"<tr>(.*?)</tr>", body, re.S)][1:]


def number(text: str) -> int:
    return int(text.replace(",", ""))


def shows(page: str, text: str) -> bool:
    return text in html.unescape(re.sub(r"<[^>]+>", "", page))


def assert_renders(page: str, shot: np.ndarray) -> None:
    """Chromium laid the page out and drew its charts: the screenshot holds the histogram's blue, and every
    inline image has content (a blank or broken image has none)."""
    assert "run_shards report" in page and "Traceback" not in page
    assert not re.search(r"""(?:src|href)=["'](?!data:)""", page) and "<script" not in page   # self-contained
    blue = np.all(np.abs(shot * 255 - CHART_BLUE) < 6, axis=-1)
    assert blue.sum() > 500, "no chart drawn in the screenshot"
    images = charts(page)
    assert len(images) == 4 and all(img.std() > 0.05 for img in images), [img.std() for img in images]


@pytest.mark.slow
def test_the_report_of_a_finished_run_renders_with_the_runs_numbers(fasta, common, tmp_path):
    # The fixture's records, two with characters outside the model's alphabet (status 2), one empty (status 3).
    odd = tmp_path / "in.fasta"
    odd.write_text(Path(fasta).read_text() + ">odd1\nACDEJJKL@@MN\n>empty1\n>odd2\nACDJBZOU\n")
    out = tmp_path / "out"
    res = run_cli(str(odd), "--out", str(out), *common, "--skip-empty", env=REPORT_ON)
    assert res.returncode == 0, res.stderr
    assert f"report: {out / 'report.html'}" in res.stderr
    assert undocumented_files(out) == []
    page, shot = render(out / "report.html", tmp_path)
    assert_renders(page, shot)

    result, run_log = read(out / "result.h5"), (out / "logs" / "run.log").read_text()
    assert shows(page, f"finished: {out}/result.h5 holds {len(result['ids']):,} rows")
    statuses = {number(row[0]): (number(row[2]), row[3]) for row in cells(page, "statuses")}
    codes, counts = np.unique(result["status"], return_counts=True)
    counted = {k: n for k, (n, _) in statuses.items()}
    assert counted == dict(zip(codes.tolist(), counts.tolist())) == {0: 240, 2: 2, 3: 1}
    assert statuses[2][1] == "odd1, odd2" and statuses[3][1] == "empty1"

    planned = {int(r): (int(n), int(res_)) for r, n, res_ in
               re.findall(r"INFO   shard (\d+): (\d+) sequences, (\d+) residues", run_log)}
    summary = {int(r): (int(n), number(t)) for r, n, t in
               re.findall(r"^\s+(\d+)\s+CPU\s+(\d+)\s+([\d,]+)\s", run_log, re.M)}   # the per-shard summary
    shards = {number(row[0]): row for row in cells(page, "shards")}
    assert sorted(shards) == sorted(planned) == sorted(summary) == [0, 1]
    for r, row in shards.items():
        assert row[1] == "complete" and row[8] == "complete" and row[7] == "1"
        assert (number(row[3]), number(row[4])) == planned[r]                       # sequences, residues
        assert (number(row[2]), number(row[5])) == summary[r]                       # rows, tokens computed
        assert number(row[5]) == int(result["num_tokens"][_shard_rows(result, r)].sum())
        # the throughput chart's data: every token of the shard passed through a checkpoint event
        checkpoints = attempts(events.read(out / "logs" / f"events_{r}.jsonl"))[0].checkpoints
        assert sum(tokens for _, _, tokens in checkpoints) == summary[r][1]
    timings = re.search(r"timings: (prepare .*? s, start workers .*? s, compute .*? s, finish shards and merge .*? s)",
                        run_log)
    assert shows(page, timings[1])
    assert shows(page, "none: every attempt of every shard finished")


def _shard_rows(result: dict, rank: int, world: int = 2) -> np.ndarray:
    """Rows of `result` that shard `rank` computed: stride `rank` of the length-descending order."""
    order = np.lexsort((result["index"], -result["lengths"]))
    return order[rank::world]


@pytest.mark.slow
def test_the_report_of_a_failed_run_shows_why_and_the_rerun_its_restart(fasta, common, tmp_path):
    out = tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), *common,
                  env={**REPORT_ON, "RUN_SHARDS_FAULT_DIE_AT": "part-written", "RUN_SHARDS_FAULT_DIE_SHARD": "1",
                       "RUN_SHARDS_FAULT_DIE_AFTER": "1"})
    assert res.returncode == 1 and "shard 1 failed: killed by SIGKILL" in res.stderr
    assert f"report: {out / 'report.html'}" in res.stderr      # written by the failed run itself
    page, shot = render(out / "report.html", tmp_path)
    assert_renders(page, shot)
    status = status_rows(out)
    assert shows(page, f"not finished: 1 of 2 shard(s) complete, {sum(s['durable'] for s in status.values())} of "
                       "240 rows durable; no result.h5 yet")
    shards = {number(row[0]): row for row in cells(page, "shards")}
    assert {r: (row[1], number(row[2])) for r, row in shards.items()} == {
        r: (s["state"], s["durable"]) for r, s in status.items()} == {0: ("complete", 120), 1: ("failed", 22)}
    assert shows(page, f"Next: `run_shards rerun {out}` computes the unfinished shards")
    error = html.unescape(re.search(r"""<pre id=["']error["']>(.*?)</pre>""", page, re.S)[1])
    assert "shard 1 failed: killed by SIGKILL" in error and f"run_shards rerun {out} --shards 1" in error
    assert [row[0] for row in cells(page, "failures")] == ["1"] and "killed by SIGKILL" in cells(page, "failures")[0][4]
    durable = sum(s["durable"] for s in status.values())
    assert [number(row[2]) for row in cells(page, "statuses")] == [durable]   # the rows the shards hold so far

    (out / "report.html").unlink()     # written again from the run directory alone (no result.h5)
    again = run_cli("report", str(out))
    assert again.returncode == 0 and again.stdout.strip() == f"report: {out / 'report.html'}", again.stderr
    assert shows((out / "report.html").read_text(), "shard 1 failed: killed by SIGKILL")

    # The rerun finishes the run; a report it cannot write (something in the way) is a warning naming the
    # command that writes it, and that command's page lists the restart and its reason.
    (out / "report.html").unlink()
    (out / "report.html").mkdir()
    (out / "report.html" / "in-the-way").write_text("")
    done = run_cli("rerun", str(out), "--no-progress", env=REPORT_ON)
    assert done.returncode == 0, done.stderr
    warning = f"`run_shards report {out}` tries again"
    assert warning in done.stderr and warning in (out / "logs" / "run.log").read_text()
    shutil.rmtree(out / "report.html")
    assert run_cli("report", str(out)).returncode == 0
    page = (out / "report.html").read_text()
    assert shows(page, f"finished: {out}/result.h5 holds 240 rows") and shows(page, "1 restart(s) in all")
    failures = cells(page, "failures")
    assert [(row[0], row[1]) for row in failures] == [("1", "1 of 2")] and "killed by SIGKILL" in failures[0][4]
    assert cells(page, "shards")[1][7] == "2" and not re.search(r"""id=["']error""", page)


def test_report_refuses_a_directory_that_holds_no_run(tmp_path):
    for path, message in ((tmp_path / "nothing", "no such run directory"),
                          (tmp_path, "not a run_shards output directory (no manifest.json)")):
        res = run_cli("report", str(path))
        assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_the_time_charts_legend_is_clear_of_the_axis_label():
    """The legend of "Where the time went" used to sit below the chart, over its x-axis label."""
    from pipeline.reporting.facts import Attempt, RunFacts, ShardFacts
    from pipeline.reporting.report import time_figure
    for shards in (1, 3, 6, 12):   # a run of 28 s; its shards' attempts from 1 s in to its end
        attempts_ = [[Attempt(start=113.0 + r / 5, end=139.0, loaded=118.0 + r, completed=139.0,
                              checkpoints=[(130.0 + r, 10, 100)])] for r in range(shards)]
        facts = RunFacts(root="/x", manifest={}, lengths=np.ones(3), budget=10,
                         shards=[ShardFacts(r, "complete", 10, 10, 30, 100, a, None) for r, a in enumerate(attempts_)],
                         statuses={}, rows=0, result="complete", timings=[1.0, 5.0, 20.0, 2.0], timings_end=140.0,
                         error="", written="")
        fig = time_figure(facts)
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        ax = fig.axes[0]
        legend = ax.get_legend().get_window_extent(renderer)
        for item in [ax.xaxis.label, *ax.get_xticklabels(), *ax.get_yticklabels()]:
            assert not legend.overlaps(item.get_window_extent(renderer)), (shards, item.get_text())
        assert not legend.overlaps(ax.get_window_extent(renderer)), shards
