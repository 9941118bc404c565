"""What the elementwise kernels' tests share: the device they run on (the GPU, else the Triton interpreter on the
CPU), the bfloat16 skip the interpreter needs, and float64 inputs drawn from a generator."""
import pytest
import torch

from tests.interpreter_bfloat16 import installed as bfloat16_mended

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def skip_interpreter_bf16(dtype: torch.dtype) -> None:
    """Skip a bfloat16 case on the CPU unless the interpreter computes bfloat16 as a GPU does
    (tests/interpreter_bfloat16.py, installed by conftest where this Triton allows)."""
    if dtype == torch.bfloat16 and DEVICE == "cpu" and not bfloat16_mended():
        pytest.skip("this Triton's interpreter computes bfloat16 wrongly and tests/interpreter_bfloat16.py cannot "
                    "mend it")


def randn64(g: torch.Generator, *shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """Normal float64 values, times `scale`, plus `shift`."""
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift
