"""Every Triton kernel compiles for A100 and H100 at real model shapes without spilling, no GPU needed.

The matrix itself is tests/kernels/compile_matrix.py; it runs in a subprocess because this one has
TRITON_INTERPRET=1 (set by conftest.py), under which triton.jit builds interpreted functions that cannot
be compiled. Through Triton's cache a second run takes seconds; a cold one compiles about 100 kernels
(see docs/BENCHMARKS.md, "Kernel compile matrix").
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from triton_kernels._launch import A100, H100
from triton_kernels.launch_config import launch_row
from triton_kernels.paged_attention.launch import KV_SPLIT_COUNTS, default_launch

REPO = Path(__file__).resolve().parents[2]

pytest.importorskip("triton")


def launched_kernels() -> set[str]:
    """Names of the kernels the package launches (first argument of every `launch(` call)."""
    names = set()
    for path in (REPO / "triton_kernels").rglob("*.py"):
        names |= set(re.findall(r"\blaunch\(\s*(_\w+)\s*,", path.read_text()))
    return {n.strip("_") for n in names}


def test_every_kernel_compiles_for_a100_and_h100_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # Triton 3.9's default, said explicitly (silences its warning)
    report = tmp_path / "matrix.json"
    done = subprocess.run([sys.executable, "-m", "tests.kernels.compile_matrix", "--json", str(report)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    print(done.stdout)   # the table: registers, spills and shared memory per launch (pytest -s shows it)
    header = done.stdout.partition("\n")[0]   # names the Triton version that compiled the matrix
    assert done.returncode == 0, header + "\n" + done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(report.read_text())
    rows = result["rows"]
    assert not result["problems"]
    assert {r["kernel"] for r in rows} == launched_kernels()
    assert {(r["arch"], r["dtype"]) for r in rows} == {(a, d) for a in (80, 90) for d in ("bf16", "fp16")}
    assert all(r["spill_bytes"] == 0 and 0 < r["registers"] <= 255 for r in rows)
    limits = {80: 163 * 1024, 90: 227 * 1024}
    assert all(r["shared_bytes"] <= limits[r["arch"]] for r in rows)
    # The conv compiled with its launch-table row for each GPU, with and without windows.
    for arch, target in ((80, A100), (90, H100)):
        conv = launch_row(target).conv
        knobs = {r["knobs"] for r in rows if r["arch"] == arch and r["kernel"] == "causal_conv_kernel"}
        assert knobs == {f"BT={conv.block_t} BC={conv.block_c} w{conv.num_warps} s1"}
        knobs = {r["knobs"] for r in rows if r["arch"] == arch and r["kernel"] == "conv_window_kernel"}
        assert knobs == {f"BC={conv.block_c} w{conv.num_warps} s1"}


def test_decode_split_counts_come_from_a_fixed_set():
    """A draining decode batch (256 sequences down to 1, contexts growing) compiles at most six variants."""
    seen = set()
    for target in (A100, H100):
        for num_seqs in range(1, 257):
            for kv_len in (17, 300, 1000, 4096, 32768, 100_000):
                for heads in ((32, 8, 128), (8, 2, 256), (20, 20, 64)):
                    knobs = default_launch(num_q_tokens=num_seqs, num_seqs=num_seqs, num_q_heads=heads[0],
                                           num_kv_heads=heads[1], head_dim=heads[2], page_size=16,
                                           max_kv_len=-(-kv_len // 16) * 16, target=target)
                    assert knobs.num_kv_splits in KV_SPLIT_COUNTS
                    seen.add(knobs.num_kv_splits)
    assert seen == set(KV_SPLIT_COUNTS)


def test_knobs_differ_by_gpu_where_the_compile_matrix_needs_it():
    """The A100 row avoids the spills the H100 knobs have there (see launch_config.TABLE)."""
    from triton_kernels.launch_config import launch_row

    a100, h100 = launch_row(A100), launch_row(H100)
    assert (a100.chunk.block_v, a100.chunk.num_stages) == (32, 1)
    assert (h100.chunk.block_v, h100.chunk.num_stages) == (64, 2)
    wide = dict(num_q_tokens=32768, num_seqs=8, num_q_heads=8, num_kv_heads=2, head_dim=256, page_size=16,
                max_kv_len=4096)
    assert default_launch(**wide, target=A100).num_warps == 8
    assert launch_row(H100, (3, 9)).attention.rows_for_8_warps_wide == 128
    assert launch_row(H100, (3, 6)).attention.rows_for_8_warps_wide == 64   # Triton 3.6 spills in 4 warps
    assert launch_row(A100, (3, 6)) == launch_row(A100, (3, 9))
