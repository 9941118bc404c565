"""Shared test setup.

Without a GPU, Triton kernels run through the interpreter: TRITON_INTERPRET=1 must be set before any
module defining kernels is imported (triton decides compiled vs interpreted when a kernel is decorated),
so it is set here, first. With a GPU it is left alone so kernel tests run compiled. Code under test that
must not run interpreted kernels (the engine's CPU path, the CLI's workers) does not depend on it.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pathlib  # noqa: E402

import pytest  # noqa: E402

SHARED_DATA = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data"


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test: tests share a small machine, and idle intra-op threads spin-wait,
    which made tiny-tensor tests 10-50x slower on a loaded 2-core CI machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Each test gets its own index cache so tests never see each other's (or the user's) files."""
    monkeypatch.setenv("RUN_SHARDS_CACHE", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Tiny checkpoints of real architectures, saved as a hub download would be."""
    from pipeline import demo_model

    from .tiny_models import save_esm, save_llama, save_qwen3
    root = tmp_path_factory.mktemp("models")
    return {
        "demo": str(demo_model.write(root / "demo")),
        "esm": str(save_esm(root / "esm")),
        "llama": str(save_llama(root / "llama")),
        "qwen3": str(save_qwen3(root / "qwen3")),
    }
