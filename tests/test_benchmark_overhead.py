"""Smoke run of ``benchmarks/overhead.py`` on the MLP: each configuration runs and the table prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "overhead.py"


@pytest.mark.slow
def test_overhead_benchmark_prints_the_per_phase_split() -> None:
    out = subprocess.run(
        [sys.executable, str(_SCRIPT), "--models", "mlp", "--steps", "2", "--warmup", "1", "--repeat", "1"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "failed" not in out.stdout, out.stdout
    lines = out.stdout.splitlines()
    assert any(line.startswith("mlp: 11 saved tensors per step") for line in lines), out.stdout
    for phase in ("pack hook", "unpack hook", "step boundary", "memctl - plain"):
        assert any(line.strip().startswith(phase) for line in lines), (phase, out.stdout)
    assert any("outside the codec kernels:" in line for line in lines), out.stdout
    full = "(full collections in the 2 measured steps: plain "
    assert any(line.strip().startswith(full) for line in lines), out.stdout
    split = next((line for line in lines if line.strip().startswith("split (CPU ms per step):")), None)
    assert split is not None, out.stdout
    assert "quantize encode" in split and "region codes in Python" in split and "everything else" in split
    # the first probe runs at step 0, in the warm-up: the whole run's figure counts it
    probes = next((line for line in lines if "with calibration on (the default)" in line), None)
    assert probes is not None, out.stdout
    whole = probes.split("over the whole run with the warm-up: ")[1]
    assert float(whole.split(" probes per step")[0]) >= 0.33, probes  # 1 of 3 steps, printed to 2 places
    assert float(whole.split(", ")[1].split(" ms")[0]) > 0, probes


@pytest.mark.slow
def test_call_counts_are_the_same_on_every_run() -> None:
    """``--calls`` is a deterministic figure: two processes count the same calls, and the
    pack hook's calls are the MLP's 11 saved tensors."""
    firsts = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, str(_SCRIPT), "--calls", "mlp", "--warmup", "3", "--top", "5"],
            capture_output=True, text=True, timeout=600,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        lines = out.stdout.splitlines()
        assert lines[0].startswith("mlp: one training step after 3: "), out.stdout
        assert "; 11 saved tensors: " in lines[0], out.stdout
        python = int(lines[0].split(": ")[2].split(" Python")[0])
        assert python > 11, out.stdout  # at least the pack and unpack hooks of each tensor
        assert len(lines) == 6 and all(line.split()[0].isdigit() for line in lines[1:]), out.stdout
        firsts.append(lines[0])
    assert firsts[0] == firsts[1]
