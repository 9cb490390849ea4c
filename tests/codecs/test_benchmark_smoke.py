"""Smoke run of ``benchmarks/codecs.py`` on a tiny tensor: it runs to the end and prints its tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "codecs.py"


def test_codec_benchmark_quick_run() -> None:
    out = subprocess.run(
        [sys.executable, str(_SCRIPT), "--quick", "--numel", "65536", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any(line.startswith("copy bandwidth") for line in lines)
    labels = [" ".join(line.split()[:3]) for line in lines if line.startswith(("quantize ", "lossless "))]
    assert labels[:4] == ["quantize 1 bits", "quantize 2 bits", "quantize 4 bits", "quantize 8 bits"]
    assert labels[4].startswith("lossless raw")
    two_bit = next(line for line in lines if line.startswith("quantize   2 bits"))
    assert float(two_bit.split()[-2]) >= 14.0  # the 2-bit ratio column
