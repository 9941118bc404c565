"""pytest fixtures over the family checkpoints: import `family_checkpoint` into a test module or conftest.py;
`family_checkpoint(name)` builds each family once per test session (about 0.1 s each)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from .checkpoints import build_cached


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("families")
    return lambda name: build_cached(name, root)
