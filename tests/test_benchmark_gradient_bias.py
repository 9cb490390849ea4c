"""Smoke run of ``benchmarks/gradient_bias.py``: the table prints, and the mean of draws is
closer to the exact gradient than one draw."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gradient_bias.py"


def test_gradient_bias_benchmark_prints_the_means() -> None:
    out = subprocess.run([sys.executable, str(_SCRIPT), "--draws", "16", "--warmup", "2"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {int(line.split()[0]): [float(v) for v in line.split()[1:]] for line in out.stdout.splitlines()
            if line.split() and line.split()[0].isdigit()}
    assert sorted(rows) == [1, 4, 16]
    one, mean, unbiased = rows[16]
    assert 0 < mean < one
    assert one / 4 - 1e-6 <= unbiased < one / 2  # the draws' root mean square error over sqrt(16)
    assert "stem.0.weight" in out.stdout and "head.bias" in out.stdout


def test_an_option_reaches_the_controller() -> None:
    """``--option KEY=VALUE``: the value read as a Python literal, printed with the run."""
    out = subprocess.run([sys.executable, str(_SCRIPT), "--draws", "1", "--warmup", "1", "--option",
                          "log_prob_bits=None", "--option", "codec=quantize"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "options {'log_prob_bits': None, 'codec': 'quantize'}" in out.stdout
    bad = subprocess.run([sys.executable, str(_SCRIPT), "--option", "bits"], capture_output=True, text=True,
                         timeout=600)
    assert bad.returncode != 0 and "expected KEY=VALUE" in bad.stderr
