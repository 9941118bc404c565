"""OUT/report.html in a real headless browser (Debian's Chromium, installed by `make test-deps`): the page
renders, its charts are not blank, and its numbers are those of result.h5 and run.log; a failed run's page
shows why it failed, `run_shards report OUT` writes it for a run without a result, and the page of the
rerun that finished it lists the restart with its reason."""
from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from pipeline.reporting.facts import attempts
from pipeline.reporting.svg_charts import Box, text_width
from pipeline.rundir import events

from .run_helpers import read, skip_or_fail, status_rows, undocumented_files
from .tiny_models import run_cli

REPORT_ON = {"RUN_SHARDS_REPORT": "1"}
CHART_BLUE = (0x4c, 0x72, 0xb0)   # the length histogram's bars (pipeline/reporting/report.py)
CHART_LABELS = ["histogram of sequence lengths", "sequences, residues, tokens and seconds per shard",
                "each worker's throughput and progress over time", "time split of the run and of each shard"]


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
    from PIL import Image
    return dom.stdout, np.asarray(Image.open(shot).convert("RGB"), dtype=np.float64) / 255


def measure(page: Path, tmp_path: Path) -> list[dict]:
    """Each chart's legend frame, plot frames and texts as Chromium lays them out (boxes in px: left, top,
    right, bottom), measured by a script in a copy of the page (the page itself has none)."""
    script = """<script>
    const box = el => { const r = el.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
    const charts = [...document.querySelectorAll("svg")].map(svg => ({
      legend: svg.querySelector("g.legend > rect") ? box(svg.querySelector("g.legend > rect")) : null,
      frames: [...svg.querySelectorAll("rect.frame")].map(box),
      texts: [...svg.querySelectorAll("text")].map(t => ({
        text: t.textContent, box: box(t), width: t.getComputedTextLength(),
        size: parseFloat(t.getAttribute("font-size")), legend: t.closest("g.legend") !== null}))}));
    const pre = document.createElement("pre"); pre.id = "measured"; pre.textContent = JSON.stringify(charts);
    document.body.appendChild(pre);
    </script>"""
    copy = tmp_path / "measured.html"
    copy.write_text(page.read_text().replace("</body>", script + "</body>"))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1200,1600"]
    dom = subprocess.run([chromium(), *flags, "--dump-dom", copy.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr
    return json.loads(html.unescape(re.search(r'<pre id="measured">(.*?)</pre>', dom.stdout, re.S)[1]))


def _tag(element: ET.Element) -> str:
    return element.tag.rsplit("}", 1)[-1]


def charts(page: str) -> list[ET.Element]:
    """The page's inline SVG charts, parsed."""
    return [ET.fromstring(svg) for svg in re.findall(r"<svg\b.*?</svg>", page, re.S)]


def panels(chart: ET.Element) -> list[dict]:
    """Each panel of a chart: its frame (x0, y0, x1, y1), its bars and horizontal bars (rects: x, y, width,
    height), its markers (cx, cy, fill), its lines (path data), its texts (x, y, anchor, text) and px per unit
    on each numeric axis (from the tick labels' positions and numbers)."""
    out = []
    for g in chart.iter():
        if _tag(g) != "g" or g.get("class") != "panel":
            continue
        rects = [r for r in g if _tag(r) == "rect"]
        frame = next(r for r in rects if r.get("class") == "frame")
        x, y, w, h = (float(frame.get(k)) for k in ("x", "y", "width", "height"))
        texts = [(float(t.get("x")), float(t.get("y")), t.get("text-anchor"), t.text) for t in g if _tag(t) == "text"]
        numeric = [(tx, ty, anchor, float(text.replace(",", ""))) for tx, ty, anchor, text in texts
                   if re.fullmatch(r"-?[\d,]+(\.\d+)?", text)]
        ys = [(ty, v) for tx, ty, anchor, v in numeric if anchor == "end" and tx < x]
        xs = [(tx, v) for tx, ty, anchor, v in numeric if anchor == "middle" and ty > y + h]
        out.append({"frame": (x, y, x + w, y + h), "texts": texts,
                    "bars": [tuple(float(r.get(k)) for k in ("x", "y", "width", "height"))
                             for r in rects if r is not frame],
                    "markers": [(float(c.get("cx")), float(c.get("cy")), c.get("fill"))
                                for c in g if _tag(c) == "circle"],
                    "lines": [p.get("d") for p in g if _tag(p) == "path" and p.get("stroke") != "#333"],  # not ticks
                    "y_per_unit": (ys[0][0] - ys[-1][0]) / (ys[-1][1] - ys[0][1]) if len(ys) > 1 else None,
                    "x_per_unit": (xs[-1][0] - xs[0][0]) / (xs[-1][1] - xs[0][1]) if len(xs) > 1 else None})
    return out


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
    chart is an inline SVG with its label and drawn content (bars of positive height, lines, a note)."""
    assert "run_shards report" in page and "Traceback" not in page
    assert not re.search(r"""(?:src|href)=["'](?!data:)""", page) and "<script" not in page   # self-contained
    blue = np.all(np.abs(shot * 255 - CHART_BLUE) < 6, axis=-1)
    assert blue.sum() > 500, "no chart drawn in the screenshot"
    svgs = charts(page)
    assert [(svg.get("role"), svg.get("aria-label")) for svg in svgs] == [("img", label) for label in CHART_LABELS]
    for svg, label in zip(svgs, CHART_LABELS):
        for panel in panels(svg):
            drawn = [b for b in panel["bars"] if b[2] > 0 and b[3] > 0]
            assert drawn or panel["lines"] or any("no checkpoint yet" in t for *_, t in panel["texts"]), label


def assert_laid_out_clear(measured: list[dict]) -> None:
    """In Chromium's layout: text is no wider than svg_charts estimates (its layout rests on that), a legend
    holds its entries and covers no plot and no other text, and no two texts overlap."""
    def box(b):
        return Box(*b)
    for chart in measured:
        texts = chart["texts"]
        for t in texts:
            assert t["width"] <= text_width(t["text"], t["size"]), t
        others = [box(t["box"]) for t in texts if not t["legend"]]
        if chart["legend"]:
            legend = box(chart["legend"])
            inside = [box(t["box"]) for t in texts if t["legend"]]
            assert inside and all(legend.x0 <= b.x0 and b.x1 <= legend.x1 and legend.y0 <= b.y0 and b.y1 <= legend.y1
                                  for b in inside), chart
            assert not any(legend.overlaps(b) for b in others + [box(f) for f in chart["frames"]]), chart
        for k, a in enumerate(others):
            assert not any(a.overlaps(b) for b in others[k + 1:]), (texts, a)


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
    assert shows(page, timings[1]) and not shows(page, "of the last command only")
    assert shows(page, "none: every attempt of every shard finished")

    # The charts show these numbers: bar heights over the axis' px per unit.
    lengths, balance, throughput, time = (panels(svg) for svg in charts(page))
    bars = lengths[0]["bars"]
    counts = [round(h / lengths[0]["y_per_unit"]) for *_, h in bars]
    assert sum(counts) == int((result["lengths"] > 0).sum()) == 242 and len(bars) > 3   # empty1 has no length
    assert all(abs(h / lengths[0]["y_per_unit"] - c) < 0.2 for (*_, h), c in zip(bars, counts))
    assert any(t == f"{len(result['ids']):,} records" for svg in charts(page)[:1] for t in svg.itertext())
    for panel, column in zip(balance, (3, 4, 5, 6)):     # sequences, residues, tokens, worker seconds
        expected = [float(shards[r][column].replace(",", "")) for r in sorted(shards)]
        shown = [h / panel["y_per_unit"] for _, _, _, h in sorted(panel["bars"])]
        slack = 0.002 * max(expected) + 0.2 / panel["y_per_unit"] + (0.05 if column == 6 else 0)   # px rounding; .1f
        assert np.all(np.abs(np.subtract(shown, expected)) <= slack), (column, shown, expected)
    progress = throughput[1]
    by_series = {}
    for _, cy, fill in progress["markers"]:
        by_series[fill] = max(by_series.get(fill, 0.0), (progress["frame"][3] - cy) / progress["y_per_unit"])
    assert sorted(round(v) for v in by_series.values()) == sorted(number(row[2]) for row in shards.values())
    assert [t for *_, anchor, t in time[0]["texts"] if anchor == "end"] == ["whole run", "shard 0", "shard 1"]
    whole_run = [b for b in time[0]["bars"] if b[1] < min(b2[1] for b2 in time[0]["bars"]) + 1]
    run_seconds = sum(float(v) for v in re.findall(r"([\d.]+) s", timings[1]))
    assert abs(sum(w for _, _, w, _ in whole_run) / time[0]["x_per_unit"] - run_seconds) < 0.3
    assert_laid_out_clear(measure(out / "report.html", tmp_path))


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
    # Its rows line is `status`'s: what is to compute and what is durable, not "240 computed" (as it said)
    rows = f"240 records: 240 to compute ({durable} computed and durable so far)"
    assert shows(page, f"Rows: {rows}.") and f"\nrows: {rows}\n" in run_cli("status", str(out)).stdout

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
    assert shows(page, "Rows: 240 records: 240 computed.")
    # the time split is the rerun's, and says so (it read as the whole run's)
    split = re.search(r"timings: (prepare .*? s, start workers .*? s, compute .*? s, finish shards and merge .*? s)",
                      done.stderr)[1]
    assert shows(page, f"{split}; of the last command only, which continued the run")
    assert "seconds since the last command started" in page and "seconds since the run started" not in page
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
        drawing = time_figure(facts).render("time")
        legend, plot = drawing.legend, drawing.plots[0]
        labels = [t for t in drawing.texts if t.role in ("xlabel", "tick")]
        assert legend is not None and {t.text for t in labels} >= {"whole run", "seconds since the run started"}
        assert not any(legend.overlaps(t.box) for t in labels), shards
        assert not legend.overlaps(plot) and legend.y1 <= plot.y0, shards


def test_ctrl_c_while_the_page_is_written_leaves_a_merged_run_a_success(reference_run, tmp_path, monkeypatch, caplog):
    """A Ctrl-C that lands while report.html is written, after the result was merged, ended the command as
    interrupted (exit 130) over a complete result; the page is optional: a warning naming the command that
    writes it, and the command's outcome stands. (The interrupt is raised where the page is written.)"""
    import logging

    from pipeline import api
    from pipeline.reporting import report
    from pipeline.rundir.layout import RunDir
    out = tmp_path / "my out"
    shutil.copytree(reference_run, out)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "write", interrupted)
    monkeypatch.setenv("RUN_SHARDS_REPORT", "1")
    with caplog.at_level(logging.WARNING, logger="run_shards"):
        assert api._reported(RunDir(out), lambda: out / "result.h5", "merge") == out / "result.h5"
    assert f"could not write {out / 'report.html'} (interrupted); `run_shards report '{out}'` tries again" \
        in caplog.text
    assert events.last(events.read(RunDir(out).run_events_path), "ended")["error"] is None
