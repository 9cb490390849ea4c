"""Smoke run of ``benchmarks/training.py`` on the MLP: every method's child process runs and reports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "training.py"


@pytest.mark.slow
def test_training_benchmark_runs_each_method_in_its_own_process() -> None:
    methods = ["plain", "memctl", "memctl-default", "memctl-budget", "checkpoint", "save_on_cpu"]
    out = subprocess.run(
        [sys.executable, str(_SCRIPT), "--models", "mlp", "--methods", ",".join(methods),
         "--steps", "1", "--warmup", "0"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("mlp ")]
    assert [r[1] for r in rows] == methods, out.stdout
    assert all(len(r) == 12 for r in rows), out.stdout  # no "failed" row
    # the forward's peak can only be at or above what it leaves held (both MiB)
    assert all(float(r[9]) >= float(r[7]) for r in rows), out.stdout
    assert all(float(r[2]) > 0 and float(r[4]) > 0 for r in rows)
    # without warm-up the first step's calibration probe is measured, and counted, in memctl's rows
    probes = {r[1]: r[6] for r in rows}
    assert all(probes[m] == "-" for m in ("plain", "checkpoint", "save_on_cpu")), out.stdout
    assert all(int(probes[m]) >= 1 for m in ("memctl", "memctl-default", "memctl-budget")), out.stdout


@pytest.mark.slow
def test_rounds_time_each_method_again_and_report_their_range() -> None:
    out = subprocess.run(
        [sys.executable, str(_SCRIPT), "--models", "mlp", "--methods", "plain,checkpoint",
         "--steps", "1", "--warmup", "1", "--rounds", "2", "--threads", "1"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "1 threads, 2 rounds" in out.stdout, out.stdout
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("mlp ")]
    assert [r[1] for r in rows] == ["plain", "checkpoint"], out.stdout
    for r in rows:
        assert len(r) == 13, out.stdout
        low, high = (float(v) for v in r[12].split("-"))
        assert low <= float(r[2]) <= high, out.stdout  # the median lies within the rounds' range


def test_rounds_must_be_positive() -> None:
    out = subprocess.run([sys.executable, str(_SCRIPT), "--rounds", "0"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "--rounds 0" in out.stderr


@pytest.mark.slow
def test_gpt2_runs_and_its_checkpointing_holds_less() -> None:
    """A transformers model behind the same interface: transformers' own checkpointing is on."""
    pytest.importorskip("transformers")
    out = subprocess.run(
        [sys.executable, str(_SCRIPT), "--models", "gpt2", "--methods", "plain,memctl,checkpoint",
         "--steps", "1", "--warmup", "1"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r[1]: r for r in (line.split() for line in out.stdout.splitlines() if line.startswith("gpt2 "))}
    assert set(rows) == {"plain", "memctl", "checkpoint"}, out.stdout
    assert all(len(r) == 12 for r in rows.values()), out.stdout
    held = {method: float(r[7]) for method, r in rows.items()}
    assert held["checkpoint"] < 0.5 * held["plain"], out.stdout
    assert held["memctl"] < 0.5 * held["plain"], out.stdout
