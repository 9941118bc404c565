"""Where and at what size the profile runs: the GPU at the sizes issue 35 measures (one 32,768-token step of
an ESM-2 650M shape, 10,000 sequences end to end), or --smoke: the CPU at toy sizes, so that the tests run
every step's code in seconds (its numbers mean nothing)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# ESM-2 650M's published shape (bench_pll.py's, with the ESM vocabulary's pad and mask ids), and a toy one.
ESM2_650M = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=33, num_attention_heads=20)
ESM_TOY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)


@dataclass(frozen=True)
class Setting:
    smoke: bool
    device: torch.device
    dtype: torch.dtype
    scratch: Path          # checkpoints, FASTA, run directories: removed by the script at the end
    step_tokens: int       # one engine step's token budget
    esm_shape: dict
    warmups: int
    repeats: int
    gemm_rows: int         # M of the micro step's products
    e2e_sequences: int

    @classmethod
    def make(cls, smoke: bool, scratch: Path) -> "Setting":
        if smoke:
            # One thread: idle intra-op threads spin-wait, which makes toy tensors 10-50x slower on a loaded
            # small machine (tests/conftest.py: one_torch_thread).
            torch.set_num_threads(1)
            return cls(True, torch.device("cpu"), torch.float32, scratch, 1500, ESM_TOY, 1, 2, 256, 20)
        if not torch.cuda.is_available():
            raise SystemExit("gpu_profile: no GPU visible (pass --smoke for the CPU check of the script)")
        return cls(False, torch.device("cuda:0"), torch.bfloat16, scratch, 32768, ESM2_650M, 3, 5, 32768, 10000)

    @property
    def gpu(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize(self.device)

    def clock(self) -> float:
        """Seconds, after the device's queued work is done."""
        self.sync()
        return time.perf_counter()

    def seconds_left(self) -> float:
        """Seconds until the script stops this step (GPU_PROFILE_DEADLINE, set by gpu_profile.sh), else inf."""
        deadline = os.environ.get("GPU_PROFILE_DEADLINE")
        return float(deadline) - time.time() if deadline else float("inf")
