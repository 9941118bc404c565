"""MKL's strict conditional numerical reproducibility (CNR) mode: what keeps a CPU matmul's row results
the same bits whatever its row count and thread count, set and read back through MKL's own functions, then
checked on this CPU by computing products (docs/engine.md, "Batch invariance").

Nothing else is claimed to keep them: outside strict mode MKL documents no such property, and measured
none (docs/engine.md, "MKL outside strict mode"): in its default mode on the SSE4.2, AVX2 and
COMPATIBLE branches (MKL_ENABLE_INSTRUCTIONS or MKL_CBWR on an Intel Xeon) rows of a 32 -> 96 product
changed with the row count from 17 rows up, even on one thread, and an AMD EPYC, whose MKL stays in its
default mode, stored other pseudo-log-likelihoods under another budget and thread count (issue 37)."""
from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..models.layers.linear import linear

# oneMKL's mkl_types.h: mkl_cbwr_get's option for the whole setting, the strict flag, the branches and
# the status of a mode change refused because MKL already computed something.
_ALL, STRICT, AUTO, _MODE_CHANGE_FAILURE = ~0, 0x10000, 2, -8
_BRANCHES = {0: "OFF", 1: "OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2",
             9: "AVX", 10: "AVX2", 11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1", 14: "AVX512_E1"}
# The branches whose ?gemm strict mode covers (oneMKL Developer Guide, "Specifying Code Branches" and
# "Reproducibility Conditions": AVX2 and AVX-512; the MIC ones now run AVX2 code). On other branches MKL
# records the flag but runs standard CNR, which changes results with the thread count.
STRICT_BRANCHES = frozenset({10, 11, 12, 13, 14})
_FIX = "unset MKL_CBWR (workers then set AUTO,STRICT themselves) or set it to AUTO,STRICT"

# What `strict_matmuls` computes to check that the mode MKL reports is the one it runs: products of these
# (in, out) features at these row counts (fewer than linear.py's MIN_ROWS are padded, as the engine's are)
# against the rows of one 100-row product on one thread, at each of CHECK_THREADS. Every mode but strict
# failed it on this project's machines (docs/engine.md): the 32 -> 96 and 32 -> 33 shapes (the test
# models' hidden size and ESM's vocabulary) on the SSE4.2, AVX2 and COMPATIBLE branches, 1,024 -> 256 at 2 and
# 3 threads in the default mode of an AVX-512 Xeon. About 0.2 s, once per process.
CHECK_SHAPES = ((32, 96), (32, 33), (64, 96), (96, 64), (1024, 256))
CHECK_ROWS = (1, 5, 16, 17, 19, 20, 21, 23, 25, 27, 31, 33, 47, 64)
CHECK_THREADS = (1, 2, 3)


@dataclass(frozen=True)
class MatmulMode:
    """Whether this process's CPU matmuls give each row the same bits for any row count (from
    models/layers/linear.py's MIN_ROWS up) and thread count, and why, in words for a log line."""
    holds: bool
    text: str


@dataclass(frozen=True)
class _Mkl:
    """mkl_cbwr_set(setting) -> status, mkl_cbwr_get(option) -> setting, mkl_cbwr_get_auto_branch() -> branch."""
    set: Callable[[int], int]
    get: Callable[[int], int]
    auto_branch: Callable[[], int]


@functools.lru_cache(maxsize=1)
def _mkl() -> _Mkl | None:
    """MKL's CNR functions in the MKL torch runs: linked into libtorch_cpu (pip wheels export them under
    MKL's internal mkl_serv_ names) or a shared MKL it depends on (public names); None without MKL."""
    if not torch.backends.mkl.is_available():
        return None
    for path in sorted((Path(torch.__file__).parent / "lib").glob("*torch_cpu.*")):
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:   # not loadable here: the next candidate, else `current` says MKL was not found
            continue
        for names in (("mkl_serv_cbwr_set", "mkl_serv_cbwr_get", "mkl_serv_cbwr_get_auto_branch"),
                      ("MKL_CBWR_Set", "MKL_CBWR_Get", "MKL_CBWR_Get_Auto_Branch")):
            try:
                functions = [getattr(lib, name) for name in names]
            except AttributeError:
                continue
            for f, args in zip(functions, ([ctypes.c_int], [ctypes.c_int], [])):
                f.argtypes, f.restype = args, ctypes.c_int
            return _Mkl(*functions)
    return None


def _name(branch: int) -> str:
    return _BRANCHES.get(branch, str(branch))


def strict_supported() -> bool:
    """Whether MKL's strict mode applies to this CPU: MKL whose automatic code branch is AVX2 or AVX-512
    (Intel CPUs since 2013; on other CPUs MKL offers only its AUTO and COMPATIBLE branches)."""
    mkl = _mkl()
    return mkl is not None and mkl.auto_branch() in STRICT_BRANCHES


def current() -> MatmulMode:
    """The mode MKL runs in now in this process, changing nothing (MKL reads MKL_CBWR here if it has not yet)."""
    mkl = _mkl()
    if mkl is None:
        return MatmulMode(False, "torch's CPU BLAS is not MKL (or does not export MKL's CNR functions): nothing "
                                 "keeps a matmul's row results independent of its row and thread count")
    setting, auto = mkl.get(_ALL), mkl.auto_branch()
    branch = setting & 0xFFFF
    effective = auto if branch == AUTO else branch
    user = os.environ.get("MKL_CBWR")
    source = f"MKL_CBWR={user} from the environment" if user else "set by run_shards"
    if setting & STRICT and effective in STRICT_BRANCHES:
        return MatmulMode(True, f"MKL in strict CNR mode ({source}; code branch {_name(effective)}): a matmul's "
                                "row results do not depend on its row or thread count")
    if user:
        return MatmulMode(False, f"MKL_CBWR={user} from the environment is kept, and is not MKL's strict CNR "
                                 f"mode on an AVX2 or AVX-512 code branch (this CPU's: {_name(auto)}): a matmul's "
                                 f"row results may depend on its row and thread count; {_FIX}")
    if auto not in STRICT_BRANCHES and branch in (0, 1):
        return MatmulMode(False, f"MKL in its default mode: its strict CNR mode does not apply to this CPU's code "
                                 f"branch ({_name(auto)}), and outside it a matmul's row results may depend on its "
                                 "row and thread count (MKL documents no such property, and on other branches they "
                                 "did: docs/engine.md)")
    return MatmulMode(False, f"MKL is not in strict CNR mode (CNR setting {setting:#x}): a matmul's row results "
                             "may depend on its row and thread count")


def set_strict_mode() -> MatmulMode:
    """Put MKL in strict CNR mode on its automatic branch if it is not and still can be, and say what MKL
    reports, computing nothing (`strict_matmuls` also checks it).

    MKL takes a mode before its first computation only (then mkl_cbwr_set refuses a change), so a worker
    calls this before its first op (worker/cpu_setup.py). A user's MKL_CBWR is kept as it is: MKL reads
    it itself, and `current` says whether it is strict. On CPUs where strict mode does not apply, MKL
    stays in its default mode. Calling it again changes nothing."""
    mkl = _mkl()
    if mkl is None or os.environ.get("MKL_CBWR") or not strict_supported() or current().holds:
        return current()
    status = mkl.set(AUTO | STRICT)
    if status == _MODE_CHANGE_FAILURE:
        return MatmulMode(False, "MKL computed in this process before its strict CNR mode could be set "
                                 "(mkl_cbwr_set refused the change): a matmul's row results may depend on its "
                                 "row and thread count")
    if status != 0:
        return MatmulMode(False, f"MKL refused strict CNR mode (mkl_cbwr_set returned {status}): a matmul's "
                                 "row results may depend on its row and thread count")
    return current()


def strict_matmuls() -> MatmulMode:
    """`set_strict_mode`, then, where MKL reports strict mode, the mode checked on this CPU (`rows_differ` at
    CHECK_THREADS): what holds. It computes (once per process; it changes torch's thread count meanwhile),
    so a worker calls it after its threads are set up (worker/cpu_setup.py), and the parent's answer, written
    into the result, is a fresh worker's on the same CPU."""
    mode = set_strict_mode()
    if not mode.holds:
        return mode
    differ = rows_differ(CHECK_THREADS)
    if differ:
        return MatmulMode(False, f"MKL reports strict CNR mode, but on this CPU a product's rows still change with "
                                 f"its row or thread count ({differ}): a matmul's row results depend on them here")
    return mode


@functools.lru_cache(maxsize=None)
def rows_differ(threads: tuple[int, ...], shapes: tuple[tuple[int, int], ...] = CHECK_SHAPES,
                product: Callable = linear) -> str | None:
    """Where a row of `product(x, w)` (linear.py's, as the models run it) is other bits than the same row of one
    100-row product on one thread, at CHECK_ROWS rows and each thread count of `threads` (restored after), in
    words; None where every row agrees. Cached per process: MKL's mode cannot change once it has computed."""
    before = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    try:
        for k, n in shapes:
            w, x = torch.randn(n, k, generator=gen), torch.randn(100, k, generator=gen)
            torch.set_num_threads(1)
            reference = product(x, w)
            for t in threads:
                torch.set_num_threads(t)
                for m in CHECK_ROWS:
                    if not torch.equal(product(x[:m], w), reference[:m]):
                        return f"{k} -> {n} features, {m} rows, {t} thread(s)"
    finally:
        torch.set_num_threads(before)
    return None
