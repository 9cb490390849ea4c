"""Test tiers: plain CPU, the Numba CUDA simulator, and a real GPU.

Without a real GPU the whole session runs Numba-CUDA kernels in the simulator (the
variable must be set before ``numba.cuda`` is first imported, hence here). Tests marked
``gpu`` need a real device and are skipped with a reason without one; tests marked
``cudasim`` need the simulator and are skipped on a real-GPU session.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
CUDASIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a real CUDA device (torch.cuda.is_available() is False)")
    skip_sim = pytest.mark.skip(
        reason="simulator tier: runs only with NUMBA_ENABLE_CUDASIM=1 (set automatically without a GPU)"
    )
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        if "cudasim" in item.keywords and not CUDASIM:
            item.add_marker(skip_sim)


@pytest.fixture(autouse=True)
def _no_leaked_saved_tensor_hooks() -> object:
    """Every test must leave autograd's saved-tensor hook stack as it found it."""
    before = torch._C._autograd._top_saved_tensors_default_hooks(True)
    yield
    after = torch._C._autograd._top_saved_tensors_default_hooks(True)
    assert after is before or after == before, "a test left saved-tensor hooks pushed"
