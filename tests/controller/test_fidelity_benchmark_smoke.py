"""Smoke runs of ``benchmarks/fidelity.py``: two steps, plain against ``bits=2``, one table row each."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fidelity.py"


def _run(model: str, *extra: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, str(_SCRIPT), "--models", model, "--steps", "2", "--configs", "bits2", "--quick",
         *extra],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


def _row(lines: list[str], model: str, config: str) -> list[str]:
    rows = [line.split() for line in lines if line.split()[:2] == [model, config]]
    assert len(rows) == 1, lines
    return rows[0]


def test_fidelity_benchmark_runs_the_project_model() -> None:
    """The project's own CNN needs none of the ``fidelity`` extra's libraries."""
    lines = _run("cnn")
    assert any(line.startswith("model ") for line in lines)
    plain, bits2 = _row(lines, "cnn", "plain"), _row(lines, "cnn", "bits2")
    assert plain[6] == "no" and "error" not in bits2
    assert float(bits2[8].rstrip("x")) > 4.0  # memctl's ratio at 2 bits
    assert float(bits2[9].rstrip("x")) > 4.0  # the same ratio measured outside memctl's statistics
    # and the two agree: the outside count follows recomputed records to their roots (a batch
    # norm's normalised input is a record the pack hook never returns itself)
    assert 0.67 < float(bits2[9].rstrip("x")) / float(bits2[8].rstrip("x")) < 1.5, bits2


def test_fidelity_benchmark_runs_under_autocast() -> None:
    """``--autocast``: every forward under bfloat16 autocast; the activations a layer saves are
    bfloat16, half of float32's bytes, so the ratio at 2 bits is about half of float32's."""
    lines = _run("cnn", "--autocast")
    assert any("bfloat16 autocast" in line for line in lines)
    plain, bits2 = _row(lines, "cnn", "plain"), _row(lines, "cnn", "bits2")
    assert plain[6] == "no" and "error" not in bits2
    assert 2.0 < float(bits2[8].rstrip("x")) < 8.0


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="the 'fidelity' extra (transformers) is not installed: pip install 'memctl[fidelity]'",
)
def test_fidelity_benchmark_runs_a_library_model() -> None:
    lines = _run("gpt2")
    bits2 = _row(lines, "gpt2", "bits2")
    assert "error" not in bits2 and float(bits2[3]) > 0.0


def test_fidelity_benchmark_audits_the_variance_model() -> None:
    """``--configs varcheck`` ends with the audit line: predictions against fresh replays."""
    out = subprocess.run(
        [sys.executable, str(_SCRIPT), "--models", "cnn", "--steps", "2", "--configs", "varcheck", "--quick"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    audit = [line for line in out.stdout.splitlines() if line.strip().startswith("audit cnn:")]
    assert len(audit) == 1, out.stdout
    found = re.search(r"within 2x: (\d+)/(\d+) ", audit[0])
    assert found is not None, audit[0]
    total = int(found.group(2))
    assert total > 0 and total % 4 == 0, audit[0]  # every audited layer at each of the 4 widths
    # and the same pairs over each side's own gradient scale (NOTE [ Gradient scale between probes ])
    scaled = [line for line in out.stdout.splitlines() if line.strip().startswith("audit cnn, over")]
    assert len(scaled) == 1 and re.search(r"within 2x (\d+)/(\d+);", scaled[0]), out.stdout


def test_fidelity_benchmark_reseeded_plain_row() -> None:
    """Outside ``--quick`` a second plain run with other random draws gives the noise floor:
    the project's CNN has a dropout layer, so its training losses move, while the start
    point (evaluated before training, with fixed draws) is plain's own."""
    out = subprocess.run(
        [sys.executable, str(_SCRIPT), "--models", "cnn", "--steps", "2", "--configs", ""],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    plain, reseed = _row(lines, "cnn", "plain"), _row(lines, "cnn", "reseed")
    assert reseed[2] != plain[2], (plain, reseed)  # the first steps' loss: other dropout masks
    assert reseed[6] == "no" and 50.0 < float(reseed[5].rstrip("%")) < 150.0, reseed
    assert float(plain[7]) > 0.999  # the 8-bit cosine, on the plain row


def test_the_outside_count_leaves_out_what_the_model_holds() -> None:
    """A batch norm in training saves its running statistics, the model's own buffers: memory
    the model holds anyway, not saved activations, in neither the plain nor the memctl count."""
    sys.path.insert(0, str(_SCRIPT.parent))
    try:
        import fidelity
    finally:
        sys.path.remove(str(_SCRIPT.parent))
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
    counter = fidelity._PlainCounter(model)
    x = torch.randn(4, 8)
    counter.hold(x)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        model(x).sum().backward()
    bn = model[1]
    held = {t.untyped_storage().data_ptr() for t in (bn.running_mean, bn.running_var)}
    assert not held & set(counter.storages)
    # the linear's output (the norm's input), the norm's batch mean and inverse deviation,
    # and the ReLU's result
    assert sorted(counter.storages.values()) == [64, 64, 256, 256]
