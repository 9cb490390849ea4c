"""Smoke run of ``benchmarks/syncs.py`` on the CPU (nothing to count there), and its call sites."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import syncs  # noqa: E402


def test_the_table_prints_a_row_per_model_and_policy() -> None:
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCH, "syncs.py"), "--device", "cpu", "--models", "mlp",
         "--policies", "plain,bits2", "--scale", "1", "--warmup", "1", "--steps", "1",
         "--max-forward-waits", "0"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("mlp")]
    assert len(rows) == 2 and all("not counted" in r for r in rows)
    assert "ratio -" in rows[0] and "ratio -" not in rows[1]


def test_ops_are_counted_inside_memctl_and_outside() -> None:
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCH, "syncs.py"), "--device", "cpu", "--models", "mlp",
         "--policies", "plain,bits2", "--scale", "1", "--warmup", "1", "--steps", "1", "--ops"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    counts = [line for line in proc.stdout.splitlines() if "aten ops in one step" in line]
    assert len(counts) == 2
    assert counts[0].split(":")[1].strip().startswith("0 inside memctl")  # plain: none of memctl's
    inside = int(counts[1].split(":")[1].split()[0])
    assert inside > 0 and "memctl/" in proc.stdout


def test_views_are_not_counted() -> None:
    import torch

    x = torch.randn(4, 4)
    counts = syncs.count_ops(lambda: (x.view(16), x.t(), x + 1))
    assert sum(counts.values()) == 1 and counts["outside"] == 1


def test_an_unknown_policy_is_named() -> None:
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "syncs.py"), "--policies", "bits3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "bits3" in proc.stderr


def test_a_wait_is_counted_at_its_innermost_memctl_frame() -> None:
    frames = [traceback.FrameSummary("/x/torch/nn/module.py", 1, "forward"),
              traceback.FrameSummary("/x/memctl/controller/packing.py", 10, "pack"),
              traceback.FrameSummary("/x/memctl/codecs/lossless/codec.py", 172, "_narrow"),
              traceback.FrameSummary("/x/torch/_tensor.py", 5, "item")]
    assert syncs._site(frames) == "memctl/codecs/lossless/codec.py:172 _narrow"
    assert syncs._site(frames[:1]) == "module.py:1 forward"


@pytest.mark.gpu
def test_a_memctl_forward_on_a_gpu_waits_only_where_allowed() -> None:
    """The benchmark's own check on a GPU: the CNN's forward at 2 bits makes no counted wait."""
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCH, "syncs.py"), "--device", "cuda", "--models", "cnn",
         "--policies", "bits2", "--scale", "1", "--warmup", "3", "--steps", "2", "--max-forward-waits", "0"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
