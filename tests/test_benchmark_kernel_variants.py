"""``benchmarks/kernel_variants.py`` in Numba's simulator: kernels of other shapes than today's
(blocks per multiprocessor, values per lane) still write the reference's bytes, and the
script says so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_variants.py"


@pytest.mark.cudasim
@pytest.mark.parametrize("shape", ["2,2,8", "4,3,8"])
def test_other_kernel_shapes_are_exact(shape: str) -> None:
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    out = subprocess.run([sys.executable, str(_SCRIPT), "--shape", shape, "--numel", "300"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    bits, blocks, chunk = shape.split(",")
    assert out.stdout.strip() == (f"bits {bits} blocks/SM {blocks} values/lane {chunk}: exact encode True "
                                  "decode True masked True"), out.stdout
