"""No spill folders (`.rs-*`) outlive a killed command (issue 28): in a run directory the next command
removes them (it holds the run lock); in the index cache, which concurrent commands share, the next build
removes the folders of killed builds (their owner lock freed by the kernel) and leaves a live build's."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from index.spill_owner import OWNER, owned_folder, release

from .tiny_models import REPO, run_cli

HOLD = ("import sys; sys.path.insert(0, {repo!r}); from index.spill_owner import owned_folder; "
        "print(owned_folder({dir!r}, '.rs-index-'), flush=True); sys.stdin.read()")


def _holder(directory) -> tuple[subprocess.Popen, str]:
    """A process that made a spill folder in `directory` and lives until its stdin closes (or it is killed)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD.format(repo=str(REPO), dir=str(directory))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def _fasta(path, n: int = 12) -> None:
    subprocess.run([sys.executable, str(REPO / "tools" / "make_fasta.py"), "--n", str(n), "--seed", "4",
                    "--max-len", "60", str(path)], check=True, capture_output=True)


def test_the_next_index_build_removes_a_killed_builds_folder_only(tmp_path):
    cache = tmp_path / "cache"
    index_dir = cache / "index"
    index_dir.mkdir(parents=True)
    killed, dead_folder = _holder(index_dir)
    (open(os.path.join(dead_folder, "0.bin"), "wb")).close()
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    alive, live_folder = _holder(index_dir)
    try:
        fasta = tmp_path / "in.fasta"
        _fasta(fasta)
        res = run_cli("index", str(fasta), env={"RUN_SHARDS_CACHE": str(cache)})
        assert res.returncode == 0, res.stderr
        left = sorted(p.name for p in index_dir.iterdir() if p.name.startswith(".rs-"))
        assert left == [os.path.basename(live_folder)]   # the killed one's removed, the live one's kept
        assert (index_dir / os.path.basename(live_folder) / OWNER).exists()
    finally:
        alive.stdin.close()
        alive.wait()
    os.utime(tmp_path / "in.fasta", (1, 1))   # (the cached index is stale now: the next command builds)
    res = run_cli("index", str(tmp_path / "in.fasta"), env={"RUN_SHARDS_CACHE": str(cache)})
    assert res.returncode == 0, res.stderr
    assert not [p for p in index_dir.iterdir() if p.name.startswith(".rs-")]   # its maker ended: removed


def test_an_owned_folder_is_locked_until_released(tmp_path):
    from index.spill_owner import remove_abandoned
    root = owned_folder(str(tmp_path), ".rs-x-")
    assert remove_abandoned(str(tmp_path), ".rs-x-") == [] and os.path.isdir(root)   # (its maker: this process)
    release(root)
    assert not os.path.exists(root)
    unowned = tmp_path / ".rs-x-old"
    unowned.mkdir()
    assert remove_abandoned(str(tmp_path), ".rs-x-") == []   # just made, perhaps by a live maker: kept
    os.utime(unowned, (0, 0))
    assert remove_abandoned(str(tmp_path), ".rs-x-") == [".rs-x-old"]


@pytest.mark.slow
def test_the_next_command_removes_a_killed_ones_spill_folders_from_the_run(models, tmp_path):
    fasta, out = tmp_path / "in.fasta", tmp_path / "out"
    _fasta(fasta)
    plan = [str(fasta), "--out", str(out), "--model", models["demo"], "--gpus", "0", "--launcher", "slurm",
            "--shards", "2", "--dry-run", "--no-progress"]
    res = run_cli(*plan)
    assert res.returncode == 0, res.stderr
    for name in (".rs-merge-k1", ".rs-stride-k2", ".rs-copies-k3"):   # as a killed merge or planning leaves them
        (out / name).mkdir()
        (out / name / "0.bin").write_bytes(b"\0" * 4096)
    res = run_cli(*plan)
    assert res.returncode == 0, res.stderr
    assert not list(out.glob(".rs-*")) and (out / "manifest.json").exists() and (out / "index.rsidx").exists()
