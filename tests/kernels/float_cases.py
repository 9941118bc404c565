"""What the elementwise kernels' tests share: the device they run on (the GPU, else the Triton interpreter on the
CPU), the bfloat16 skip the interpreter needs, and float64 inputs drawn from a generator."""
import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def skip_interpreter_bf16(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("the Triton interpreter computes bfloat16 wrongly (a known interpreter limit)")


def randn64(g: torch.Generator, *shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """Normal float64 values, times `scale`, plus `shift`."""
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift
