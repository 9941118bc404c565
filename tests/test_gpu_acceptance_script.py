"""bench/gpu_acceptance.sh, the first GPU session's one command: it parses, and on a machine without a GPU it
refuses loudly (exit 3, saying why) instead of skipping its steps and reporting success."""
from __future__ import annotations

import subprocess

import pytest
import torch

from .tiny_models import REPO

SCRIPT = REPO / "bench" / "gpu_acceptance.sh"


def test_the_script_parses():
    res = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the script would run its steps")
def test_without_a_gpu_it_refuses_before_running_anything(tmp_path):
    res = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin",
                                                                                  "OUT": str(tmp_path)})
    assert res.returncode == 3, res.stderr
    assert "no GPU visible" in res.stderr and "nothing was run" in res.stderr
    assert not (tmp_path / "gpu_acceptance.md").exists()
