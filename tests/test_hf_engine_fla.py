"""The hf engine on the CPU with fla-core installed: transformers 5 sends Qwen3.5's gated delta rule to fla's
Triton kernels whenever fla imports, whatever the device, and those fail on CPU tensors; the engine hides fla
from a CPU process (engine/hf.keep_transformers_torch_kernels) so transformers keeps its torch path.

fla-core is kept out of the CPU test environment (it is GPU code), so this test skips there, saying so; it runs
where fla-core is importable: `PYTHONPATH=<folder with fla-core> pytest tests/test_hf_engine_fla.py`, and in
bench/gpu_acceptance.sh's `fla_cpu` step, which installs fla-core into its own folder.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tiny_checkpoints import write_tiny

REPO = Path(__file__).resolve().parents[1]

# A fresh process, as a worker is: nothing has imported transformers' model modules yet.
FORWARD = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from pipeline.engine.hf import HFEngine
engine = HFEngine(sys.argv[2], torch.device("cpu"), torch.float32, logprobs=True)
out = engine.forward([[1, 2, 3, 4, 5, 6, 7, 8], [3, 4, 5]], [1], True)
torch.save({"hidden": out.hidden, "logprobs": out.token_logprobs}, sys.argv[3])
print("fla hidden" if "fla" in sys.modules and sys.modules["fla"] is None else "fla not hidden")
"""


@pytest.mark.skipif(importlib.util.find_spec("fla") is None,
                    reason="fla-core is not importable (kept out of the CPU test environment on purpose)")
def test_qwen35_on_the_cpu_hf_engine_runs_with_fla_installed(tmp_path):
    path = write_tiny("qwen3_5", tmp_path / "qwen3_5")
    fla_root = str(Path(importlib.util.find_spec("fla").origin).parents[1])

    def forward(out: Path, with_fla: bool) -> str:
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != fla_root]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(([fla_root] if with_fla else []) + paths)}
        done = subprocess.run([sys.executable, "-c", FORWARD, str(REPO), str(path), str(out)], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip()

    assert forward(tmp_path / "with.pt", with_fla=True) == "fla hidden"
    if fla_root not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        return   # fla-core is among the interpreter's own packages: there is no run without it to compare with
    assert forward(tmp_path / "without.pt", with_fla=False) == "fla not hidden"
    with_fla, without = torch.load(tmp_path / "with.pt"), torch.load(tmp_path / "without.pt")
    assert all(torch.equal(with_fla["hidden"][k], without["hidden"][k]) for k in without["hidden"])
    assert torch.equal(with_fla["logprobs"], without["logprobs"])
