"""`bin/run_shards`, the command the README tells users to run, started by a Python that lacks the
project's packages (here: `python -S`, which sees no site-packages): it uses the checkout's `.venv` when
there is one, and otherwise says in one line how to install, instead of an import traceback."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .tiny_models import REPO


def _checkout(root: Path, with_venv: bool) -> Path:
    """A throw-away checkout: the real bin/ script, the packages linked, and `.venv` linked to ours."""
    (root / "bin").mkdir(parents=True)
    shutil.copy(REPO / "bin" / "run_shards", root / "bin" / "run_shards")
    for package in ("pipeline", "index", "triton_kernels"):
        (root / package).symlink_to(REPO / package)
    if with_venv:
        (root / ".venv").symlink_to(Path(sys.prefix))
    return root


def _bare_python(script: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "RUN_SHARDS_VENV_TRIED")}
    return subprocess.run([sys._base_executable, "-S", str(script), *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_uses_the_checkouts_venv(tmp_path):
    assert sys.prefix != sys.base_prefix, "the test suite runs in a virtual environment (make test)"
    root = _checkout(tmp_path / "repo", with_venv=True)
    res = _bare_python(root / "bin" / "run_shards", "status", str(tmp_path / "nowhere"))
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == f"error: {tmp_path / 'nowhere'}: no such run directory"   # the CLI ran


def test_without_a_venv_says_how_to_install(tmp_path):
    root = _checkout(tmp_path / "repo", with_venv=False)
    res = _bare_python(root / "bin" / "run_shards", "--version")
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "run_shards needs the Python package(s) torch" in res.stderr
    assert f"`make -C {root} install`" in res.stderr


def test_a_deleted_current_directory_is_named(tmp_path):
    """Run from a directory deleted under the shell: a relative FASTA was os.path.abspath's traceback, and an
    absolute one torch's import dying in "Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so"."""
    gone = tmp_path / "gone"
    gone.mkdir()
    for fasta in ("x.fasta", str(REPO / "examples" / "demo.fasta")):
        res = subprocess.run(["bash", "-c", 'cd "$1" && rmdir "$1" && exec "$2" "$3" "$4" --out "$5"', "-", str(gone),
                              sys.executable, str(REPO / "bin" / "run_shards"), fasta, str(tmp_path / "o")],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 2, res.stderr
        assert res.stderr.strip() == ("error: the current directory no longer exists (it was deleted, or its file "
                                      "system unmounted): cd to an existing directory and run the command again")
        assert not (tmp_path / "o").exists()
        gone.mkdir()
