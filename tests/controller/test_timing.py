"""The controller's timing histograms and event counters (memctl/controller/timing.py)."""

from __future__ import annotations

import math

import pytest
import torch

import memctl
from memctl.controller.timing import BUCKETS, Histogram, Timings

from .models import MLP


def test_histogram_buckets_are_cumulative() -> None:
    h = Histogram()
    for seconds in (5e-6, 1e-5, 3e-3, 20.0):
        h.observe(seconds)
    d = h.to_dict()
    assert d["count"] == 4 and d["sum"] == pytest.approx(20.003015)
    bounds = [b for b, _ in d["buckets"]]
    assert bounds[:-1] == list(BUCKETS) and math.isinf(bounds[-1])
    counts = {b: n for b, n in d["buckets"]}
    assert counts[1e-5] == 2  # an upper bound is inclusive
    assert counts[5e-3] == 3 and counts[10.0] == 3 and counts[float("inf")] == 4


def test_step_overhead_includes_the_steps_codec_time() -> None:
    t = Timings()
    t.observe_encode(0.25)
    t.observe_decode(0.5)
    t.observe_step(1.0)
    t.observe_step(0.125)
    d = t.to_dict()
    assert d["step"]["count"] == 2 and d["step"]["sum"] == pytest.approx(1.875)
    assert d["encode"]["count"] == 1 and d["decode"]["count"] == 1


def test_a_training_run_fills_the_histograms_and_counters() -> None:
    torch.manual_seed(0)
    model = MLP(d_in=256, d_hidden=512)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, bits=2.0, monitor_interval_s=0, allocation_interval=2)
    for _ in range(4):
        x, y = torch.randn(32, 256), torch.randint(0, 10, (32,))
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    ctl.set_budget("1GiB")
    torch.nn.functional.cross_entropy(model(torch.randn(32, 256)), torch.randint(0, 10, (32,))).backward()
    opt.step()
    snap = ctl.snapshot()
    ctl.detach()
    timings = snap["timings"]
    assert timings["step"]["count"] == 5
    compressed = timings["encode"]["count"]
    assert compressed >= 5 * 2  # fc1 and fc2 outputs (>= min_numel values) in each of 5 steps
    # Every compressed tensor is read back; one saved by two ops (ReLU, then Linear) twice. The
    # first step stores the head's input once more, at its floor (NOTE [ The head's input ]).
    assert compressed - 1 <= timings["decode"]["count"] <= 2 * compressed
    assert timings["step"]["sum"] >= timings["encode"]["sum"] + timings["decode"]["sum"]
    events = snap["counters"]["events"]
    assert events["attach"] == 1 and events["budget"] == 1
    assert events["allocation"] + events.get("budget_infeasible", 0) >= 3  # steps 0, 2, 4 and the change
