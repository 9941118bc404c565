"""What a user watching a run sees: the progress bar in a terminal (and none with -q), the summary lines a
log gets instead, and what a command continuing a run says it starts from, checked against `status`.
"""
import os
import re
import select
import struct
import subprocess
import sys
import time

import pytest

from pipeline import __version__
from pipeline.launchers.progress import ProgressBoard

from .run_helpers import status_rows
from .tiny_models import REPO


def run_in_terminal(*args: str, env: dict | None = None, timeout: float = 300) -> tuple[int, str]:
    """The real CLI with a terminal (a pty of 120 columns) as its stdin, stdout and stderr, as a user at a
    shell runs it: its exit code and everything it wrote there."""
    import fcntl
    import pty
    import termios
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    full_env = dict(os.environ)
    full_env.pop("TRITON_INTERPRET", None)
    full_env.update(env or {})
    proc = subprocess.Popen([sys.executable, str(REPO / "bin" / "run_shards"), *args], stdin=slave, stdout=slave,
                            stderr=slave, env=full_env, cwd=REPO)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:   # EIO: every process holding the terminal has ended
                break
            if not data:
                break
            chunks.append(data)
        else:
            proc.kill()
            pytest.fail(f"run_shards {' '.join(args)} ran past {timeout} s")
        return proc.wait(timeout=60), b"".join(chunks).decode(errors="replace")
    finally:
        os.close(master)


@pytest.fixture(scope="module")
def args(models):
    return ["--model", models["demo"], "--gpus", "0", "--workers", "2", "--max-tokens-per-batch", "1000",
            "--checkpoint-every", "4"]


BAR = re.compile(r"run_shards: +\d+%\|.*\| *\d+/40 \[")   # tqdm's line: desc, percent, bar, n/total


def test_the_bar_shows_in_a_terminal_and_quiet_leaves_only_the_result(small_fasta, args, tmp_path):
    """-q says "only warnings and errors on the terminal": it showed the bar all the same."""
    code, shown = run_in_terminal(small_fasta, "--out", str(tmp_path / "a"), *args)
    assert code == 0, shown
    assert BAR.search(shown) and "40/40 [" in shown, shown   # (the pty is a terminal: the bar is drawn)
    code, shown = run_in_terminal(small_fasta, "--out", str(tmp_path / "b"), *args, "-q")
    assert code == 0, shown
    assert not BAR.search(shown) and "seq/s" not in shown, shown
    lines = [line for line in shown.splitlines() if line.strip()]
    assert lines[-1] == f"result: {tmp_path / 'b' / 'result.h5'}", shown
    # warnings stay: a CPU where this run is not batch-invariant says so (AMD EPYC: MKL's CNR mode does not apply)
    assert all(line.startswith("W ") for line in lines[:-1]), shown


def test_a_continued_run_says_what_it_starts_from_as_status_counts_it(small_fasta, args, tmp_path):
    """After a failure the bar and the summary lines count only what is left; `rerun` now says where it begins
    in run.log, what is durable already (as `status` counts it) and what is left, and the resumed worker's
    log says its shard file holds the earlier attempts' rows too."""
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(REPO / "bin" / "run_shards"), small_fasta, "--out", str(out), *args,
                          "--no-progress"], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "RUN_SHARDS_FAULT_DIE_AT": "part-written", "RUN_SHARDS_FAULT_DIE_SHARD": "1",
                              "RUN_SHARDS_FAULT_DIE_AFTER": "1"})
    assert res.returncode == 1, res.stderr
    rows = status_rows(out)
    assert rows[0]["state"] == "complete" and rows[1]["state"] == "failed" and 0 < rows[1]["durable"] < rows[1]["of"]
    durable, left = sum(r["durable"] for r in rows.values()), rows[1]["of"] - rows[1]["durable"]

    code, shown = run_in_terminal("rerun", str(out))
    assert code == 0, shown
    assert f"run_shards {__version__}: rerun {out}" in shown
    assert (f"continuing: {durable} of the 40 sequences to compute are durable from earlier commands (1 of 2 "
            f"shard(s) complete); {left} left, in shard(s) 1") in shown, shown
    assert f"| {left}/{left} [" in shown and f"({left} of {left} sequences, 100%)" in shown, shown
    log = (out / "logs" / "run.log").read_text()
    assert log.index("Continue with:") < log.index(f"rerun {out}") < log.index("continuing: ")
    worker = (out / "logs" / "worker_1.log").read_text()
    assert re.search(rf"shard complete: \S+ \({left} sequences, \d+ tokens, .*; with the {rows[1]['durable']} rows "
                     rf"of earlier attempts it holds all {rows[1]['of']}\n", worker), worker


def test_the_summary_line_gives_the_share_done_and_the_time_left():
    """A log (nohup, a pipe) shows no bar: its summary lines were the only progress and left the ETA to guess."""
    board = ProgressBoard(400, "2 CPU worker(s)", 30.0, show_bar=False)
    board.expect(0, 200)
    board.expect(1, 200)
    board.add_worker(0, "CPU")
    board.add_worker(1, "CPU")
    board.start -= 100.0   # 100 s into the command
    board.message("progress", 0, {"sequences": 60, "tokens": 6000})
    board.message("progress", 1, {"sequences": 40, "tokens": 4000})
    line = board.summary_line()
    assert "(100 of 400 sequences, 25%, about 5 min 00 s left at this rate)" in line, line   # 300 left at 1/s
    board.message("progress", 0, {"sequences": 140, "tokens": 14000})
    board.message("progress", 1, {"sequences": 160, "tokens": 16000})
    assert board.summary_line().endswith("(400 of 400 sequences, 100%)")
    board.close()


def test_a_long_sequence_in_windows_shows_its_windows_and_tokens_before_its_row():
    """One record of 200,000 residues under --on-long window is thousands of windows in one batch: the bar (which
    counts sequences) and the summary lines said "0 tok/s ... (0 of 1 sequences, 0%)" for minutes while it ran.
    Now they count the windows' tokens as they go and say how many windows are done; the row's own count replaces
    them when it comes."""
    board = ProgressBoard(1, "1 CPU worker(s)", 30.0, show_bar=False)
    board.add_worker(0, "CPU")
    board.message("start", 0, {"sequences": 1, "residues": 200000, "durable": 0})
    board.start -= 100.0
    board.message("batch", 0, {"tokens": 260000, "budget": 8192})
    board.message("windows", 0, {"done": 64, "of": 2105, "tokens": 8192})
    board.message("windows", 0, {"done": 128, "of": 2105, "tokens": 8192})
    line = board.summary_line()
    assert "164 tok/s" in line and line.endswith("(0 of 1 sequences, 0%; shard 0: 128 of 2,105 windows)"), line
    board.message("progress", 0, {"sequences": 1, "tokens": 200002})
    assert board.workers[0].tokens == 200002 and board.summary_line().startswith("Total: 0.01 seq/s, 2.0k tok/s")
    assert board.summary_line().endswith("(1 of 1 sequences, 100%)"), board.summary_line()
    board.close()


def test_a_generate_batch_shows_its_tokens_as_it_runs_before_its_rows():
    """A generate batch of thousands of new tokens per sequence is minutes of steps: its worker told the parent
    (for the hang detector) how many tokens it had run, but the bar and summary lines said "0 tok/s ... (0 of 64
    sequences, 0%)" until the batch's rows came. Now they count those tokens as they go and say the batch is
    generating; the rows' own count replaces them, and the next batch starts from nothing."""
    board = ProgressBoard(64, "1 CPU worker(s)", 30.0, show_bar=False)
    board.add_worker(0, "CPU")
    board.message("start", 0, {"sequences": 64, "residues": 6400, "durable": 0})
    board.start -= 100.0
    board.message("batch", 0, {"tokens": 6400, "budget": 8192})
    board.message("generating", 0, {"tokens": 9000})
    board.message("generating", 0, {"tokens": 20000})   # (the batch's tokens so far, not an increment)
    line = board.summary_line()
    assert "200 tok/s" in line and line.endswith("(0 of 64 sequences, 0%; shard 0: generating, 20,000 tokens run in "
                                                 "this batch)"), line
    board.message("progress", 0, {"sequences": 32, "tokens": 22000})
    assert board.workers[0].tokens == 22000 and board.summary_line().endswith("(32 of 64 sequences, 50%, about "
                                                                              "1 min 40 s left at this rate)")
    board.message("generating", 0, {"tokens": 500})
    assert board.workers[0].tokens == 22500 and "shard 0: generating, 500 tokens" in board.summary_line()
    board.close()


def test_a_worker_that_dies_takes_what_it_lost_off_the_bar_and_its_row():
    """The bar and the per-shard table counted the sequences a killed worker computed after its last checkpoint,
    which died with it: they said more was done than its shard holds (status said the truth)."""
    board = ProgressBoard(400, "2 CPU worker(s)", 30.0, show_bar=False)
    for rank in (0, 1):
        board.add_worker(rank, "CPU")
        board.message("start", rank, {"sequences": 200, "residues": 20000, "durable": 20 * rank})
    board.message("progress", 0, {"sequences": 30, "tokens": 3000})
    board.message("checkpoint", 0, {"durable": 20})
    board.message("progress", 0, {"sequences": 15, "tokens": 1500})
    board.message("progress", 1, {"sequences": 25, "tokens": 2500})
    board.message("checkpoint", 1, {"durable": 40})   # (20 of an earlier attempt, 20 of this one)
    assert "(70 of 400 sequences" in board.summary_line()
    assert board.lost(0) == 25 and board.workers[0].sequences == 20
    assert board.lost(1) == 5 and board.workers[1].sequences == 20
    assert "(40 of 400 sequences, 10%" in board.summary_line()
    assert board.lost(0) == 0   # (said once)
    table = board.table().splitlines()
    assert table[1].split()[:3] == ["0", "CPU", "20"] and table[2].split()[:3] == ["1", "CPU", "20"], table
    board.close()


def test_quiet_hides_the_decompression_bar_of_a_gzip_input(small_fasta, args, tmp_path):
    """A plain gzip input is decompressed into the cache with a bar of its own, which -q and --no-progress did
    not reach (only the shards' bar was turned off). Now neither draws it; without them it is drawn."""
    import gzip
    gz = tmp_path / "in.fasta.gz"
    gz.write_bytes(gzip.compress(open(small_fasta, "rb").read()))
    for flag, cache in (("--no-progress", "c1"), (None, "c2")):   # (-q turns it off through --no-progress)
        code, shown = run_in_terminal(str(gz), "--out", str(tmp_path / cache), *args, *([flag] if flag else []),
                                      env={"RUN_SHARDS_CACHE": str(tmp_path / f"cache-{cache}"),
                                           "RUN_SHARDS_REPORT": "0"})
        assert code == 0, shown
        assert ("decompressing in.fasta.gz" in shown) == (flag is None), (flag, shown)


def test_the_per_shard_table_of_many_shards_shows_the_slowest_and_a_line_for_all():
    """300 shards on 2 workers printed a 300-row per-shard summary to the terminal and run.log."""
    def board_of(shards: int) -> ProgressBoard:
        board = ProgressBoard(10 * shards, "2 CPU worker(s)", 30.0, show_bar=False)
        for r in range(shards):
            board.add_worker(r, "CPU")
            w = board.workers[r]
            w.sequences, w.tokens = 10, 1000 + r   # shard 0 the slowest: 1,000 tokens in 10 s
            w.finished = w.started + 10.0
        return board

    small = board_of(20).table().splitlines()
    assert len(small) == 21 and [line.split()[0] for line in small[1:]] == [str(r) for r in range(20)]
    lines = board_of(300).table().splitlines()
    assert len(lines) == 12 and lines[0].endswith("(the 10 slowest of 300 shards)"), lines
    assert [line.split()[0] for line in lines[1:11]] == [str(r) for r in range(10)], lines
    assert lines[-1] == ("all 300 shards: 3,000 sequences, 344,850 tokens; seconds 10.0..10.0 (median 10.0), "
                         "tok/s 100..130 (median 115)"), lines[-1]
