"""Smoke run of ``benchmarks/activations.py``: every mode runs and prints a cosine per bit width."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
_SCRIPT = _ROOT / "benchmarks" / "activations.py"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["derived", "separate", "exact-act"])
def test_activation_benchmark_runs_in_each_mode(mode: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, str(_SCRIPT), "--acts", "hardswish", "--seeds", "1", "--bits", "8,2",
         "--mode", mode],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| hardswish |")]
    assert len(rows) == 1, out.stdout
    cells = [c.strip() for c in rows[0].split("|")[2:-1]]
    assert len(cells) == 2
    cos8, cos2 = (float(c.split()[0]) for c in cells)
    assert cos8 >= 0.9999 and 0.5 < cos2 < 1.0, cells
