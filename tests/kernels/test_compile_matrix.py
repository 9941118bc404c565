"""Every Triton kernel compiles for A100 and H100 at real model shapes without spilling, no GPU needed.

The matrix itself is tests/kernels/compile_matrix.py; it runs in a subprocess because this one has
TRITON_INTERPRET=1 (set by conftest.py), under which triton.jit builds interpreted functions that cannot
be compiled. Through Triton's cache a second run takes seconds; a cold one compiles 320 kernels (13 CPU
minutes on a slow 2-core VM: docs/BENCHMARKS.md, "Kernel compile matrix").
"""
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from triton_kernels._launch import A100, H100

from tests.run_helpers import require_triton
from tests.kernels.sm_model import blocks_per_sm, kernel_counts, local_accesses, loop_counts, waves
from triton_kernels.launch_config import launch_row
from triton_kernels.paged_attention.launch import KV_SPLIT_COUNTS, default_launch

REPO = Path(__file__).resolve().parents[2]

require_triton()


def launched_kernels() -> set[str]:
    """Names of the kernels the package launches (first argument of every `launch(` call)."""
    names = set()
    for path in (REPO / "triton_kernels").rglob("*.py"):
        names |= set(re.findall(r"\blaunch\(\s*(_\w+)\s*,", path.read_text()))
    return {n.strip("_") for n in names}


def compile_matrix(tmp_path, *only: str) -> list[dict]:
    """The matrix's rows (all, or `--only` these cases), compiled in a subprocess; fails on its problems."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # Triton 3.9's default, said explicitly (silences its warning)
    report = tmp_path / "matrix.json"
    done = subprocess.run([sys.executable, "-m", "tests.kernels.compile_matrix", "--json", str(report), *only],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    print(done.stdout)   # the table: registers, spills and shared memory per launch (pytest -s shows it)
    header = done.stdout.partition("\n")[0]   # names the Triton version that compiled the matrix
    assert done.returncode == 0, header + "\n" + done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(report.read_text())
    assert not result["problems"]
    return result["rows"]


def test_every_kernel_compiles_for_a100_and_h100_without_spills(tmp_path):
    rows = compile_matrix(tmp_path)
    assert {r["kernel"] for r in rows} == launched_kernels()
    assert {(r["arch"], r["dtype"]) for r in rows} == {(a, d) for a in (80, 90) for d in ("bf16", "fp16")}
    assert all(r["spill_bytes"] == 0 and 0 < r["registers"] <= 255 for r in rows)
    limits = {80: 163 * 1024, 90: 227 * 1024}
    assert all(r["shared_bytes"] <= limits[r["arch"]] for r in rows)
    # Every launch fits an SM at least once, and its waves follow from its grid and SM count.
    for r in rows:
        programs = 1
        for n in r["grid"]:
            programs *= n
        sms = {80: A100.num_sms, 90: H100.num_sms}[r["arch"]]
        assert r["blocks_per_sm"] >= 1 and r["waves"] == -(-programs // (sms * r["blocks_per_sm"])), r
    # The walk's chunk loop was found in its SASS: its products on tensor cores (wgmma on sm_90, mma.sync on
    # sm_80), barriers between them, shared-memory traffic for its operands.
    walks = [r for r in rows if r["kernel"] == "chunk_walk_kernel"]
    assert walks and all(r["sass"] is not None for r in walks)
    for r in walks:
        mma = r["sass"]["HGMMA"] if r["arch"] == 90 else r["sass"]["HMMA"]
        assert mma >= 4 and r["sass"]["BAR.SYNC"] >= 1 and r["sass"]["LDS"] + r["sass"]["STS"] > 0, r
    # and the prep kernel's whole code: more instructions than any walk's chunk, tensor-core products among them
    for r in (r for r in rows if r["kernel"] == "chunk_prep_kernel"):
        assert r["sass"]["instructions"] > max(w["sass"]["instructions"] for w in walks if w["arch"] == r["arch"])
        assert r["sass"]["HGMMA"] + r["sass"]["HMMA"] > 0, r
    # The split design (issue 36): its state walk's chunk loop carries fewer tensor-core products than the fused
    # design's output-writing walk of the same V block on the same GPU (two dependent products a chunk instead of
    # four), and its prep (solve, W / U) and output kernels run at 4 warps with at least two blocks an SM; the solve
    # kernel at <= 128 registers (four blocks an SM) with barriers in the tens (the one-kernel prep it replaced: 254
    # BAR.SYNC on sm_90, 275 on sm_80; its forward substitution alone took ~90 in the solve until each row of the
    # diagonal blocks was taken from them transposed).
    for arch in (80, 90):
        mma = "HGMMA" if arch == 90 else "HMMA"
        fused = {r["knobs"].split()[0]: r["sass"][mma] for r in walks if r["arch"] == arch and "+o" in r["knobs"]}
        states = [r for r in rows if r["kernel"] == "split_state_kernel" and r["arch"] == arch]
        assert states and all(r["sass"] is not None for r in states)
        compared = [(r["sass"][mma], fused[r["knobs"].split()[0]]) for r in states if r["knobs"].split()[0] in fused]
        assert compared and all(0 < split < whole for split, whole in compared), compared
        for name in ("split_solve_kernel", "split_wu_kernel", "split_output_kernel"):
            chosen = [r for r in rows if r["kernel"] == name and r["arch"] == arch]
            assert chosen and all(r["num_warps"] == 4 and r["blocks_per_sm"] >= 2 for r in chosen), chosen
        solves = [r for r in rows if r["kernel"] == "split_solve_kernel" and r["arch"] == arch]
        assert all(r["registers"] <= 128 and r["blocks_per_sm"] >= 4 and r["sass"]["BAR.SYNC"] < 100
                   for r in solves), solves
    # The delta rule at the benchmark's shapes is in the matrix (its waves are what the GPU run will see).
    assert any(r["shape"].startswith("bench delta H=16 HV=16: 64k tokens in 8") for r in rows)
    # The conv compiled with its launch-table row for each GPU, with and without windows.
    for arch, target in ((80, A100), (90, H100)):
        conv = launch_row(target).conv
        knobs = {r["knobs"] for r in rows if r["arch"] == arch and r["kernel"] == "causal_conv_kernel"}
        assert knobs == {f"BT={conv.block_t} BC={conv.block_c} w{conv.num_warps} s1"}
        knobs = {r["knobs"] for r in rows if r["arch"] == arch and r["kernel"] == "conv_window_kernel"}
        assert knobs == {f"BC={conv.block_c} w{conv.num_warps} s1"}


def test_gelu_tanh_mul_compiles_at_ankh_large_without_spills(tmp_path):
    """T5's gated-gelu feed-forward (Ankh-large, d_ff 3,840, 32k tokens) on both GPUs in both 16-bit dtypes: the
    gated MLPs' kernel with its tanh GELU (libdevice's tanhf inlined), in silu_mul's launch-table knobs."""
    rows = compile_matrix(tmp_path, "--only", "gated-gelu")
    assert {(r["arch"], r["dtype"]) for r in rows} == {(a, d) for a in (80, 90) for d in ("bf16", "fp16")}
    for r in rows:
        rms = launch_row({80: A100, 90: H100}[r["arch"]]).rms
        assert r["kernel"] == "act_mul_kernel" and "gelu_tanh" in r["knobs"], r
        assert r["grid"] == [-(-32768 // rms.silu_block_rows), -(-3840 // rms.silu_block_cols)], r
        assert r["spill_bytes"] == 0 and 0 < r["registers"] <= 64 and r["blocks_per_sm"] >= 4, r


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


def test_gpus_with_99_kib_of_shared_memory_take_rows_of_their_own():
    """sm_86 to sm_89 (RTX 30xx / 40xx, A10, A40, L4, L40S) and sm_120 (RTX 50xx): 100 KiB of shared memory and
    1,536 threads an SM, sm_80's products. Their rows are the A100's but where that spills there (compiled by
    `python -m tests.kernels.compile_matrix --targets 89,120`, docs/BENCHMARKS.md): attention over 128 rows of
    heads of 128 in 2 stages, not 3; on sm_120 the bias's walk kept at 3 and the split design's output kernel in 8
    warps. Before, sm_120 took the H100 row (its walk spilled 720 B there). B200 (sm_100, and B300, Thor after
    it) has a row of its own too: the H100's with the walk at 32 columns and linear_gelu's tiles 128 x 64."""
    from triton_kernels._launch import B200, GpuTarget, L40S, RTX5090
    from triton_kernels.launch_config import table_arch
    assert [table_arch(a) for a in (75, 80, 86, 87, 89, 90, 100, 103, 110, 120, 121)] == [
        80, 80, 86, 86, 86, 90, 100, 100, 100, 120, 120]
    # the rows as the table writes them (Triton 3.9); Triton 3.6's change to the H100's (above) is the H100's own
    b200, h100 = launch_row(B200, (3, 9)), launch_row(H100, (3, 9))
    assert (b200.chunk.block_v, b200.gemm.block_n) == (32, 64)
    assert dataclasses.replace(b200, chunk=h100.chunk, gemm=h100.gemm) == h100
    a100, l40s, rtx = launch_row(A100), launch_row(L40S), launch_row(RTX5090)
    assert launch_row(GpuTarget(86, 72)) == l40s
    assert l40s.attention.num_stages == 2 and rtx.attention.num_stages == 2 and a100.attention.num_stages == 3
    assert dataclasses.replace(l40s, attention=a100.attention) == a100
    assert rtx.chunk.output_num_warps == 8 and rtx.attention.bias_num_stages == 3
    t5 = dict(num_q_tokens=32768, num_seqs=108, num_q_heads=16, num_kv_heads=16, head_dim=64, page_size=16,
              max_kv_len=4096)
    assert default_launch(**t5, target=RTX5090, relative_bias=True).num_stages == 3
    assert default_launch(**t5, target=RTX5090).num_stages == 2 and default_launch(**t5, target=L40S,
                                                                                   relative_bias=True).num_stages == 2


def test_the_rows_of_other_gpus_compile_without_spills_where_they_differ(tmp_path):
    """The launches those rows change, compiled for an L40S and an RTX 5090: Llama-8B's attention (its prefill
    spilled 40 / 72 B in the A100's 3 stages) and Ankh-large's with T5's bias (24 B in 2 stages on sm_120,
    float16), within 99 KiB of shared memory a block; and for a B200 the delta rule's walk with states carried in
    and out (16-32 B at the H100's 64 columns). Unlike the A100's and H100's, these rows allow a spill outside
    every loop (Triton 3.6 parks 16 B of Llama-8B's 32-split decode there on sm_89: 3 stores and 4 loads a
    program, none in its loops; the one stage that removes it would cost every attention launch of the row its
    pipelining), never one inside a loop."""
    rows = compile_matrix(tmp_path, "--targets", "89,120", "--dtypes", "bf16", "--only", "Llama-8B 32/8",
                          "--cold-spills-ok")
    rows += compile_matrix(tmp_path, "--targets", "120", "--dtypes", "fp16", "--only", "Ankh-large enc 16/16",
                           "--cold-spills-ok")
    assert {r["arch"] for r in rows} == {89, 120}
    assert any(r["kernel"] == "paged_attention_fwd" and "w8 s2" in r["knobs"] for r in rows)
    assert any(r["kernel"] == "paged_attention_fwd" and "+bias" in r["knobs"] and "s3" in r["knobs"] for r in rows)
    assert all(r["spill_accesses_in_loops"] == 0 for r in rows if r["spill_bytes"])
    assert all(r["shared_bytes"] <= 99 * 1024 and r["blocks_per_sm"] >= 1 for r in rows)
    walks = compile_matrix(tmp_path, "--targets", "100", "--dtypes", "bf16", "--only", "delta H=16 HV=16 K=V=128")
    assert any(r["kernel"] == "chunk_walk_kernel" and r["knobs"].startswith("BV=32") and "+h0 +ht" in r["knobs"]
               for r in walks)
    assert all(r["spill_bytes"] == 0 for r in walks)


def test_blocks_per_sm_by_hand():
    """The occupancy rule on cases worked out by hand (registers rounded to 256 a warp, 16,384 a quarter-SM)."""
    # the prep kernel: 254 registers x 8 warps: 8,192 a warp, 2 warps a quarter, 8 an SM: one block
    assert blocks_per_sm(90, 254, 8, 12 * 1024) == (1, "registers")
    # the walk at block_v 64, 2 stages: registers would allow 2 blocks of 4 warps, 144 KiB of shared memory 1
    assert blocks_per_sm(90, 227, 4, 144 * 1024) == (1, "shared")
    assert blocks_per_sm(90, 227, 4, 0)[0] == 2
    # the A100 walk at block_v 32, 1 stage: 236 registers -> 7,680 a warp, 2 a quarter: 2 blocks of 4 warps
    assert blocks_per_sm(80, 236, 4, 52 * 1024) == (2, "registers")
    # 53 KiB + 1 KiB reserved, in 128-byte units: 164 KiB / 54 KiB = 3 on an A100, 228 / 54 = 4 on an H100
    assert blocks_per_sm(80, 32, 4, 53 * 1024) == (3, "shared")
    assert blocks_per_sm(90, 32, 4, 53 * 1024) == (4, "shared")
    assert blocks_per_sm(90, 16, 16, 0) == (4, "threads")    # 2,048 threads / 512
    assert blocks_per_sm(90, 16, 1, 0) == (32, "blocks")     # at most 32 resident blocks
    assert waves(16 * 1024, 132, 1) == 125 and waves(256, 132, 1) == 2 and waves(256, 132, 2) == 1


def test_loop_counts_on_hand_written_sass():
    """The main loop is the body of the backward branch with the most matrix instructions; the trailing
    branch to itself after EXIT is no loop."""
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                  /* 0x00000a0000017a02 */
        /*0010*/                   LDS.U.128 R8, [R2] ;                    /* 0x0000000002087984 */
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;   /* 0x0000000c0804723c */
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;           /* 0x0000000000007b1d */
        /*0040*/                   LDSM.16.M88.4 R12, [R3] ;               /* 0x000000000300783b */
        /*0050*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;   /* 0x0000000c0804723c */
        /*0060*/                   STS.128 [R3], R4 ;                      /* 0x0000000403007388 */
        /*0070*/                   FFMA R5, R5, R6, R7 ;                   /* 0x0000000605057223 */
        /*0080*/               @!P0 BRA 0x10 ;                             /* 0xffffff8000000947 */
        /*0090*/                   ISETP.NE.AND P1, PT, R0, RZ, PT ;       /* 0x000000ff0000720c */
        /*00a0*/               @P1 BRA 0x90 ;                              /* 0xfffffff000001947 */
        /*00b0*/                   EXIT ;                                  /* 0x000000000000794d */
        /*00c0*/                   BRA 0xc0;                               /* 0xfffffffc00fc7947 */
    """
    assert loop_counts(sass) == {"HGMMA": 0, "HMMA": 2, "BAR.SYNC": 1, "LDS": 2, "STS": 1, "LDGSTS": 0, "LDG": 0,
                                 "FFMA": 1, "instructions": 8}
    assert loop_counts(sass.replace("@!P0 BRA 0x10", "@!P0 BRA 0xb0").replace("@P1 BRA 0x90", "NOP")) is None
    assert kernel_counts(sass)["instructions"] == 13 and kernel_counts(sass)["HMMA"] == 2


def test_local_accesses_inside_and_outside_loops_on_hand_written_sass():
    """A spill's local stores and loads: those between a backward branch's target and the branch are in a loop;
    one before the loop and one after it are not (registers parked across it, as Triton 3.6 compiles two
    attention launches of the sm_86-89 and sm_100 rows, docs/BENCHMARKS.md)."""
    sass = """
        /*0000*/                   STL [R1+0x8], R5 ;                      /* 0x0000080501007387 */
        /*0010*/                   LDS.U.128 R8, [R2] ;                    /* 0x0000000002087984 */
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;   /* 0x0000000c0804723c */
        /*0030*/               @!P0 BRA 0x10 ;                             /* 0xffffff8000000947 */
        /*0040*/                   LDL.LU R18, [R1+0x8] ;                  /* 0x0000040001127983 */
        /*0050*/                   EXIT ;                                  /* 0x000000000000794d */
        /*0060*/                   BRA 0x60;                               /* 0xfffffffc00fc7947 */
    """
    assert local_accesses(sass) == (2, 0)
    hot = sass.replace("LDS.U.128 R8, [R2]", "LDL R8, [R1+0x4]")
    assert local_accesses(hot) == (3, 1)
    assert local_accesses(sass.replace("STL [R1+0x8], R5", "MOV R1, R5").replace("LDL.LU R18, [R1+0x8]", "NOP")) == (0, 0)
    # a rarely taken path placed after EXIT, jumped to and branching back, is no loop around what it spans
    stub = sass.replace("/*0060*/                   BRA 0x60;", "/*0060*/                   BRA 0x0;")
    assert stub != sass and local_accesses(stub) == (2, 0)
