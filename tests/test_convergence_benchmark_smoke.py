"""Smoke run of ``benchmarks/convergence.py``: a few steps of both real-data tasks, one row each."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import torch

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
    convergence = _convergence()
    train, val = convergence.stdlib_docstrings()
    assert len(train) > 500_000 and len(val) > 50_000
    assert max(train) < 128 and b" the " in train
    assert convergence.stdlib_docstrings() == (train, val)


def test_cosine_schedule_decays_the_learning_rate_to_zero_and_constant_keeps_it() -> None:
    convergence = _convergence()
    rates = {}
    for schedule in convergence.SCHEDULES:
        task = convergence.Task("digits", 0, 8, schedule)
        seen = []
        for _ in range(8):
            seen.append(task.opt.param_groups[0]["lr"])
            task.opt.step()
            if task.scheduler is not None:
                task.scheduler.step()
        rates[schedule] = (seen, task.opt.param_groups[0]["lr"])
    assert rates["constant"] == ([2e-3] * 8, 2e-3)
    cosine, last = rates["cosine"]
    assert cosine[0] == 2e-3 and all(a > b for a, b in itertools.pairwise(cosine)) and last < 1e-9


def test_convergence_benchmark_audits_the_variance_model_on_fresh_batches() -> None:
    """``--audit N`` ends a memctl run with the variance model's audit on N batches the run never
    stepped on in that order (``benchmarks/variance_audit.py``); one batch and two layers here."""
    out = subprocess.run(
        [sys.executable, str(_SCRIPT), "--tasks", "digits", "--steps", "3", "--configs", "bits2",
         "--audit", "1", "--audit-layers", "2"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line.strip() for line in out.stdout.splitlines()
             if line.strip().startswith("audit digits/bits2")]
    assert len(lines) == 2, out.stdout  # the audit, and the same over each side's scale
    found = re.search(r"over 1 batch within 2x: (\d+)/(\d+) ", lines[0])
    assert found is not None and int(found.group(2)) == 8, lines[0]  # 2 layers at each of 4 widths
    assert "each batch alone" not in out.stdout  # fresh batches have no training order
    convergence = _convergence()
    task = convergence.Task("digits", 0, 4)
    fresh = task.fresh_batches(2, 0)
    assert len(fresh) == 2 and fresh[0][0].shape == task.batches[0][0].shape
    assert not torch.equal(fresh[0][0], task.batches[0][0])  # another draw than training's
    assert all(torch.equal(a[0], b[0]) for a, b in zip(fresh, task.fresh_batches(2, 0), strict=True))


def _convergence():
    sys.path.insert(0, str(_SCRIPT.parent))
    try:
        import convergence
    finally:
        sys.path.remove(str(_SCRIPT.parent))
    return convergence


def test_perturbed_plain_runs_start_from_weights_changed_in_the_sixth_digit() -> None:
    convergence = _convergence()
    plain = convergence.run_worker("digits", "plain", 2, 0, 1, False, {}, "cosine")
    perturbed = convergence.run_worker("digits", "plain1", 2, 0, 1, False, {}, "cosine")
    again = convergence.run_worker("digits", "plain1", 2, 0, 1, False, {}, "cosine")
    assert perturbed["val_loss"] != plain["val_loss"]  # another draw ...
    assert abs(perturbed["val_loss"] / plain["val_loss"] - 1) < 1e-3  # ... from nearly the same start
    assert again["val_loss"] == perturbed["val_loss"]  # the digit seeds it
    assert "ratio" not in perturbed  # plain PyTorch: no memctl


def test_summary_compares_with_the_mean_of_plains_runs_with_a_standard_error() -> None:
    convergence = _convergence()

    def result(config: str, seed: int, val: float) -> dict:
        return {"task": "digits", "config": config, "seed": seed, "val_loss": val, "val_acc": 99.0}

    runs = [result("plain", 0, 1.0), result("plain1", 0, 1.2), result("default", 0, 1.21),
            result("plain", 1, 2.0), result("plain1", 1, 2.0), result("default", 1, 1.96)]
    results = {(r["config"], r["seed"]): r for r in runs}
    lines = convergence.summary("digits", results, [0, 1], ["plain", "default", "plain1"])
    against = {line.split()[1]: line for line in lines if "mean of plain's runs" in line}
    # default: +10% and -2% against the means 1.1 and 2.0: mean +4%, standard error 6%
    assert "+4.00% ± 6.00%" in against["default"], against
    assert "per seed [-2.00, +10.00]" in against["default"]
    # without perturbed runs there is nothing to average: the plain comparison alone
    plain_only = convergence.summary("digits", results, [0, 1], ["plain", "default"])
    assert not any("mean of plain's runs" in line for line in plain_only)
