"""Helpers for tests that run the real CLI and break things around it: start a run, watch its logs, read
its result, check what it left in the run directory, mount a small disk.

Tests that need root (a tmpfs) skip with the reason elsewhere, and fail instead when CI=true, because CI
machines are meant to run them.
"""
from __future__ import annotations

import os
import re
import resource
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from .tiny_models import REPO, run_cli

# What a run directory may hold (README "Where things go"), as regular expressions on paths relative to OUT.
LAYOUT = [r"manifest\.json", r"index\.rsidx", r"copies\.rsidx", r"result\.h5", r"report\.html", r"\.lock",
          r"merge_problems\.tsv", r"variants\.npz",
          r"logs", r"logs/run\.log", r"logs/worker_\d+\.log", r"logs/events\.jsonl", r"logs/events_\d+\.jsonl",
          r"shards", r"shards/shard_\d+\.h5", r"shards/shard_\d+\.lock", r"shards/shard_\d+\.failed\.json",
          r"shards/shard_\d+\.h5\.corrupt(\.\d+)?", r"shards/shard_\d+\.verified", r"shards/shard_\d+\.parts",
          r"shards/shard_\d+\.parts/part_\d{6}\.h5", r"shards/shard_\d+\.parts/part_\d{6}\.h5\.corrupt(\.\d+)?"]


def skip_or_fail(reason: str) -> None:
    """Skip a test that cannot run here, with the reason; under CI=true that is a failure."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


TRITON_MISSING = ("triton cannot be imported (setup.cfg installs it on Linux only): this test runs or imports the "
                  "Triton kernels, which the Triton interpreter runs on a CPU")


def triton_missing(error: BaseException) -> bool:
    """Whether `error` is the import of triton failing (the kernel modules import it on first use)."""
    return isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] == "triton"


def require_triton() -> None:
    """At the top of a test module that imports Triton kernels: skip it where triton cannot be imported (a CPU-only
    install on macOS or Windows runs everything else); under CI=true that is a failure."""
    try:
        import triton   # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but {TRITON_MISSING}", pytrace=False)
        pytest.skip(TRITON_MISSING, allow_module_level=True)


def undocumented_files(out: Path) -> list[str]:
    """Entries of the run directory that the documented layout does not name (temporaries, strays)."""
    pattern = re.compile("|".join(f"(?:{p})" for p in LAYOUT))
    return sorted(str(p.relative_to(out)) for p in out.rglob("*")
                  if not pattern.fullmatch(str(p.relative_to(out))))


def read(path) -> dict:
    with h5py.File(path) as f:
        names = []
        f.visit(lambda n: names.append(n) if isinstance(f[n], h5py.Dataset) else None)
        return {k: f[k][:] for k in names}


def raw_datasets(path) -> dict[str, bytes]:
    """Every dataset of an HDF5 file as its raw bytes (strings as their repr): equal means byte-identical."""
    with h5py.File(path) as f:
        data = {}
        f.visititems(lambda name, obj: data.__setitem__(name, obj[()].tobytes() if obj.dtype.kind != "O"
                                                        else repr(obj[()].tolist()).encode())
                     if isinstance(obj, h5py.Dataset) else None)
        return data


def assert_same(got: dict, want: dict) -> None:
    """Resumed shards run the same batches with the same thread count, so they agree to float32 rounding."""
    assert sorted(got) == sorted(want)
    for key in want:
        if want[key].dtype.kind == "f":
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-6, err_msg=key)
        else:
            assert np.array_equal(got[key], want[key]), key


def env_with(**extra) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def option_set(args: list[str], option: str, value: str | None = None) -> list[str]:
    """`args` with `option`'s value replaced by `value`, or the option left out (`value` None)."""
    i = args.index(option)
    return args[:i] + ([option, value] if value is not None else []) + args[i + 2:]


def file_size_limit(limit: int):
    """A preexec_fn for a child whose writes past `limit` bytes fail with EFBIG, as on a full disk."""
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # writes past the limit fail with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def start(*args: str, env: dict | None = None, **popen) -> subprocess.Popen:
    """The real CLI in the background (stdout and stderr piped, as text)."""
    return subprocess.Popen([sys.executable, str(REPO / "bin" / "run_shards"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env_with(**(env or {})), cwd=REPO, **popen)


def wait_for(predicate, timeout: float = 120.0, what: str = "condition") -> None:
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} not reached in {timeout:.0f} s")


def log_text(out: Path, rank: int) -> str:
    path = out / "logs" / f"worker_{rank}.log"
    return path.read_text() if path.exists() else ""


def worker_pid(out: Path, rank: int) -> int:
    return int(log_text(out, rank).rsplit("started (pid ", 1)[1].split(",")[0])


def rerun_matches(out: Path, reference: dict, *extra: str) -> subprocess.CompletedProcess:
    res = run_cli("rerun", str(out), "--no-progress", *extra)
    assert res.returncode == 0, res.stderr
    assert_same(read(out / "result.h5"), reference)
    assert undocumented_files(out) == []
    return res


# The environment that makes a Python process list every module it imports on its stderr (`-X importtime`).
IMPORT_TIMES = {"PYTHONPROFILEIMPORTTIME": "1"}


def imported(stderr: str) -> set[str]:
    """The top-level packages a process started with IMPORT_TIMES imported, read from its stderr."""
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in stderr.splitlines()
            if line.startswith("import time:") and line.count("|") == 2} - {"imported package"}


def suggested_commands(text: str) -> list[list[str]]:
    """Every `run_shards ...` command a message suggests (between backticks, or after "Continue with:")."""
    found = re.findall(r"`(run_shards [^`]+)`", text) + re.findall(r"Continue with:\s+(run_shards .+)", text)
    return [shlex.split(c)[1:] for c in found]


def status_rows(out: Path, *extra: str) -> dict[int, dict]:
    """`run_shards status` parsed: shard -> {state, durable, of, detail}."""
    res = run_cli("status", str(out), *extra)
    assert res.returncode == 0, res.stderr
    rows = {}
    for line in res.stdout.splitlines():
        m = re.match(r"^(\d+)\s+(\S+)\s+([\d,]+)\s+([\d,]+)\s+\S+%\s*(.*)$", line)
        if m:
            rows[int(m[1])] = {"state": m[2], "durable": int(m[3].replace(",", "")),
                               "of": int(m[4].replace(",", "")), "detail": m[5]}
    return rows


class Tmpfs:
    """Small tmpfs mounts for disk-full tests (root only), unmounted at the end."""

    def __init__(self, root: Path):
        self.root, self.mounted = root, []

    def mount(self, size: str) -> Path:
        if os.geteuid() != 0:
            skip_or_fail("mounting a tmpfs needs root")
        path = self.root / f"disk{len(self.mounted)}"
        path.mkdir()
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            skip_or_fail(f"cannot mount a tmpfs here: {res.stderr.strip()}")
        self.mounted.append(path)
        return path

    def fill(self, path: Path) -> Path:
        """Fill the file system holding `path` to the last byte."""
        filler = path / "filler"
        with open(filler, "wb", buffering=0) as fh:   # unbuffered: closing has nothing left to write
            try:
                while True:
                    fh.write(b"\0" * 4096)
            except OSError:
                pass
        return filler

    def unmount_all(self) -> None:
        for path in self.mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def triton_test_device():
    """The device where tests run the engine's Triton path: a GPU with compiled Triton, else the CPU
    under TRITON_INTERPRET=1 (tests/kernels/conftest.py sets it); otherwise the calling module skips."""
    import pytest
    import torch
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if torch.cuda.is_available() and not interpret:
        return torch.device("cuda")
    if interpret:
        return torch.device("cpu")
    pytest.skip("needs a GPU, or TRITON_INTERPRET=1 for the interpreter", allow_module_level=True)


def undocumented_in_schema(result: Path) -> list[str]:
    """Datasets and root attributes of a result file that README's "Output schema" section does not name. Every
    name in backticks there is a pattern: `<pool>`, `<k>` stand for one part of a name, `...` and `*` for the
    rest (`embeddings/<pool>_layer<k>`, `variants/...`)."""
    section = (REPO / "README.md").read_text().split("\n## Output schema", 1)[1].split("\n## ", 1)[0]
    names = [n for n in re.findall(r"`([^`\s]+)`", section) if re.fullmatch(r"[a-z_][\w<>]*(/[\w<>.*]+)?", n)]
    patterns = [re.escape(n).replace(r"\.\.\.", ".*").replace(r"\*", ".*") for n in names]
    pattern = re.compile("|".join(re.sub(r"<[a-z]+>", "[^/]+", p) for p in patterns))
    with h5py.File(result) as f:
        names = [f"dataset {n}" for n in _datasets(f)] + [f"attribute {a}" for a in f.attrs]
    return sorted(n for n in names if not pattern.fullmatch(n.split(" ", 1)[1]))


def _datasets(f: h5py.File) -> list[str]:
    names = []
    f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    return names
