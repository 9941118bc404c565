"""OUT/report.html in a real headless browser (Chromium from Debian, installed by `make test-deps`): the page
renders, its charts are not blank, and its numbers are those of result.h5 and run.log; for a failed run
it shows the failure's reason, and `run_shards report OUT` writes it for a run without a result."""
from __future__ import annotations

import base64
import io
import re
import shutil
import subprocess

import numpy as np
import pytest

from .run_helpers import read, skip_or_fail, undocumented_files
from .tiny_models import run_cli

REPORT_ON = {"RUN_SHARDS_REPORT": "1"}


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        skip_or_fail("Chromium is not installed (make test-deps installs it as root: tests/setup/install_chromium.sh)")
    return found


def render(page, tmp_path) -> tuple[str, np.ndarray]:
    """The page's text as Chromium lays it out, and a screenshot as an RGB array."""
    browser = chromium()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([browser, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr
    shot = tmp_path / "shot.png"
    done = subprocess.run([browser, *flags, f"--screenshot={shot}", "--window-size=1100,1400", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and shot.exists(), done.stderr
    import matplotlib.image
    return dom.stdout, matplotlib.image.imread(str(shot))


def charts(html: str) -> list[np.ndarray]:
    import matplotlib.image
    return [matplotlib.image.imread(io.BytesIO(base64.b64decode(data)), format="png")
            for data in re.findall(r'src="data:image/png;base64,([^"]+)"', html)]


def cells(html: str, table: str) -> list[list[str]]:
    body = re.search(rf'<table id="{table}">(.*?)</table>', html, re.S).group(1)
    return [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", body, re.S)][1:]


@pytest.mark.slow
def test_the_report_of_a_finished_run_renders_with_the_runs_numbers(fasta, common, tmp_path):
    out = tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), *common, env=REPORT_ON)
    assert res.returncode == 0, res.stderr
    assert f"report: {out / 'report.html'}" in res.stderr
    assert undocumented_files(out) == []
    text, shot = render(out / "report.html", tmp_path)
    assert "run_shards report" in text and "Traceback" not in text
    assert shot.std() > 0.05                                           # not a blank page
    images = charts(text)
    assert len(images) == 4 and all(img[..., :3].std() > 0.02 for img in images)   # four charts, none blank
    result = read(out / "result.h5")
    assert f"result: {out}/result.h5, {len(result['ids']):,} rows" in text
    shards = cells(text, "shards")
    assert [row[1] for row in shards] == ["complete", "complete"]
    assert sum(int(row[3].replace(",", "")) for row in shards) == len(result["ids"])
    statuses = {int(row[0]): int(row[2].replace(",", "")) for row in cells(text, "statuses")}
    codes, counts = np.unique(result["status"], return_counts=True)
    assert statuses == dict(zip(codes.tolist(), counts.tolist()))
    timings = re.search(r"timings: prepare ([\d.]+) s", (out / "logs" / "run.log").read_text())
    assert f"prepare {timings[1]} s" in text


@pytest.mark.slow
def test_the_report_of_a_failed_run_shows_why_and_can_be_written_again(fasta, common, tmp_path):
    out = tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), *common,
                  env={**REPORT_ON, "RUN_SHARDS_FAULT_DIE_AT": "part-written", "RUN_SHARDS_FAULT_DIE_SHARD": "1",
                       "RUN_SHARDS_FAULT_DIE_AFTER": "1"})
    assert res.returncode == 1 and "shard 1 failed: killed by SIGKILL" in res.stderr
    (out / "report.html").unlink()
    again = run_cli("report", str(out))
    assert again.returncode == 0 and again.stdout.strip() == f"report: {out / 'report.html'}", again.stderr
    text, shot = render(out / "report.html", tmp_path)
    assert "no result yet: 1 of 2 shard(s) complete" in text and shot.std() > 0.05
    assert [row[1] for row in cells(text, "shards")] == ["complete", "failed"]
    assert "shard 1: killed by SIGKILL" in text
    assert "no result.h5 yet" in text

    res = run_cli("report", str(tmp_path / "nothing"))
    assert res.returncode == 2 and "no such run directory" in res.stderr and "Traceback" not in res.stderr
