"""The delta-rule layers' causal conv gets its launch knobs the way the delta-rule kernels do: the launch
table's row for the GPU (triton_kernels/launch_config.py), under the engine config's explicit ones
(`gdn_launch["causal_conv1d"]`), handed to the layers by the model runner.

Runs the engine's Triton path: compiled on a GPU, else the Triton interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py without a GPU).
"""
from __future__ import annotations

import pytest
import torch

from pipeline.engine.native import NativeEngine
from triton_kernels._device import target_of
from triton_kernels.launch_config import launch_row
from tests.run_helpers import triton_test_device
from tests.tiny_checkpoints import random_sequences, write_tiny

DEVICE = triton_test_device()

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_conv_knobs_come_from_the_launch_table_under_the_engine_config(tmp_path, monkeypatch):
    import pipeline.models.layers.gated_deltanet as gdn

    seen = []
    conv = gdn.causal_conv1d
    monkeypatch.setattr(gdn, "causal_conv1d", lambda *a, **k: seen.append(k) or conv(*a, **k))
    engine = NativeEngine.load(str(write_tiny("qwen3_5", tmp_path / "q")), DEVICE, torch.float32, "",
                               kernels="triton", gdn_launch={"causal_conv1d": {"block_t": 16}})
    engine.forward(random_sequences([20, 5], seed=3), [4], False)
    row = launch_row(target_of(DEVICE)).conv
    assert row.block_t != 16   # else the test could not tell the config's knob from the table's
    assert seen and all((k["block_t"], k["block_c"], k["num_warps"]) == (16, row.block_c, row.num_warps)
                        for k in seen)
