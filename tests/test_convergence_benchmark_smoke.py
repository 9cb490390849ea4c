"""Smoke run of ``benchmarks/convergence.py``: a few steps of both real-data tasks, one row each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "convergence.py"


def test_convergence_benchmark_runs_both_tasks() -> None:
    out = subprocess.run(
        [sys.executable, str(_SCRIPT), "--steps", "4", "--configs", "bits2"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:1] in (["digits"], ["text"])]
    by = {(r[0], r[1]): r for r in rows if len(r) > 2 and r[2] == "0"}
    assert set(by) == {("digits", "plain"), ("digits", "bits2"), ("text", "plain"), ("text", "bits2")}
    for task in ("digits", "text"):
        plain, bits2 = by[(task, "plain")], by[(task, "bits2")]
        assert "error:" not in bits2, bits2
        assert 0.0 < float(plain[3]) < 10.0  # validation loss
        assert float(bits2[7].rstrip("x")) > 4.0  # memctl's ratio at 2 bits
        assert float(bits2[8].rstrip("x")) > 4.0  # the same ratio measured outside memctl


def test_stdlib_text_is_deterministic_english() -> None:
    sys.path.insert(0, str(_SCRIPT.parent))
    try:
        import convergence
    finally:
        sys.path.remove(str(_SCRIPT.parent))
    train, val = convergence.stdlib_docstrings()
    assert len(train) > 500_000 and len(val) > 50_000
    assert max(train) < 128 and b" the " in train
    assert convergence.stdlib_docstrings() == (train, val)
