"""A CPU-only install has no Triton: setup.cfg installs it on Linux only (there are no wheels for macOS or
Windows). So nothing a CPU run imports may import triton: each kernel package's public op imports its Triton
kernels only when one runs (triton_kernels/__init__.py). These run with `import triton` failing, as it does on
such a machine, and check that a CPU run on Linux, where triton is installed, does not import it either (its
import is CPU time every worker would spend for nothing)."""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys

import triton_kernels

from .tiny_checkpoints import write_tiny
from .tiny_models import REPO, run_cli

# `import triton` raises what it raises where none is installed.
BLOCK = """import sys

class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "triton":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoTriton())
"""

# Every kernel path the native engine has on a CPU: ESM (rotary with the q scale, the residual add with LayerNorm,
# the linear with GELU), Qwen3.5 (the delta rule, its conv and gates, RMS norms, q/k norm with rotary, gated
# attention), T5 (RMS norms, gelu_tanh * up, relative position bias); paged attention in all three.
FORWARD = """
import re, sys, torch
from pipeline.engine.native import NativeEngine
for path in sys.argv[1:]:
    engine = NativeEngine.load(path, torch.device("cpu"), torch.float32, "")
    out = engine.forward([[5, 6, 7, 8, 9, 10, 11, 12], [7, 8, 9]], [engine.spec.num_layers], False)
    assert all(bool(h.isfinite().all()) for h in out.hidden.values()), path
kernels = r"triton_kernels\\..*\\.(kernel|chunk|fused_recurrent|norm_rotate|split)"
print("imported:", sorted(m for m in sys.modules if m.split(".")[0] == "triton" or re.fullmatch(kernels, m)))
"""


def _forward(paths, block: bool) -> str:
    code = (BLOCK if block else "") + FORWARD
    res = subprocess.run([sys.executable, "-c", code, *map(str, paths)], capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_the_native_engine_runs_every_cpu_path_without_triton(tmp_path):
    paths = [write_tiny(kind, tmp_path / kind) for kind in ("esm2", "qwen3_5", "prott5")]
    # With triton importable, a CPU forward still imports neither it nor a kernel module.
    assert _forward(paths, block=False).strip() == "imported: []"
    # Where it cannot be imported, the same forward runs (an import of it would raise).
    assert _forward(paths, block=True).strip() == "imported: []"


def test_a_run_on_a_machine_without_triton(tmp_path):
    """The parent and its spawned workers (a sitecustomize on PYTHONPATH blocks triton in each of them)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK)
    fasta = tmp_path / "in.fasta"
    fasta.write_text(">a\nMKTAYIAKQRQISFVKSHFSRQ\n>b\nGSHMLEDPVDAFQ\n>c\nMVLSEGEWQLVLHVWAKVEADVAGHG\n")
    res = run_cli(str(fasta), "--out", str(tmp_path / "out"), "--workers", "2", "--no-progress",
                  env={"PYTHONPATH": str(site)})
    assert res.returncode == 0, res.stderr
    assert re.search(r"merged 3 sequences", res.stdout + res.stderr), res.stdout + res.stderr
    logs = "".join(p.read_text() for p in (tmp_path / "out" / "logs").glob("worker_*.log"))
    assert "triton" not in logs.lower(), logs


def test_the_kernel_tests_skip_without_triton_saying_so_and_fail_under_ci(tmp_path):
    """README: without triton `make test` skips the Triton kernels' tests, saying why (a test module that imports
    them, a test reaching them); under CI=true, where setup.cfg installs it, that is a failure."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "CI", "TRITON_INTERPRET"))}
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
               "tests/kernels/test_gated_delta_rule.py", "tests/kernels/test_add_layer_norm.py"]
    res = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env={**env, "PYTHONPATH": str(site)},
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:]
    assert " skipped" in res.stdout and " passed" in res.stdout and "failed" not in res.stdout, res.stdout[-3000:]
    assert "triton cannot be imported (setup.cfg installs it on Linux only)" in res.stdout, res.stdout[-3000:]
    res = subprocess.run(command, capture_output=True, text=True, cwd=REPO,
                         env={**env, "PYTHONPATH": str(site), "CI": "true"}, timeout=300)
    assert res.returncode != 0 and "CI=true but triton cannot be imported" in res.stdout, res.stdout[-3000:]


def test_import_kernels_imports_every_module_that_imports_triton():
    """What a GPU worker imports ahead (worker/entry.prepare_worker) is every module of the package that imports
    triton at its top: none is left to its first step."""
    root = REPO / "triton_kernels"
    with_triton = {".".join(p.relative_to(REPO).with_suffix("").parts) for p in root.rglob("*.py")
                   if re.search(r"^import triton$", p.read_text(), re.M)}
    assert len(with_triton) >= 14, with_triton
    triton_kernels.import_kernels()
    missing = {name for name in with_triton if name not in sys.modules}
    assert not missing, f"add the kernel modules that import these to KERNEL_MODULES: {sorted(missing)}"
    for name in triton_kernels.KERNEL_MODULES:
        assert re.search(r"@triton\.jit", (root / name.replace(".", "/")).with_suffix(".py").read_text()), name
        importlib.import_module(f"triton_kernels.{name}")
