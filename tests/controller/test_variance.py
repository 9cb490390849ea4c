"""The calibrated variance model against measurement on a small net (NOTE [ Calibration ])."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import memctl
from memctl.controller.hooks import ModuleTracker
from memctl.controller.replay import Capture, Replayer, exact, only
from memctl.controller.update_metric import UpdateMetric
from tests.controller.models import CNN


def _data(n: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, 16, 16, generator=g)
    w = torch.randn(256, 10, generator=g)
    return x, (x.flatten(1) @ w).argmax(1)


def _measure(model: nn.Module, config: memctl.ControllerConfig, x: torch.Tensor, y: torch.Tensor,
             layers: list[str], bits: tuple[int, ...], draws: int,
             optimizer: torch.optim.Optimizer | None = None) -> dict[tuple[str, int], float]:
    """Mean over ``draws`` of ‖g(layer at b bits, the rest exact) − g(exact)‖², without any controller;
    with ``optimizer``, in its update metric (NOTE [ Update metric ]), as the controller measures."""
    tracker = ModuleTracker()
    handles = tracker.attach(model)
    try:
        out = model(x)
        grad_out = torch.autograd.grad(nn.functional.cross_entropy(out, y), out)[0]
        capture = Capture(args=(x,), kwargs={}, cpu_rng=torch.get_rng_state(), out_grads={0: grad_out})
        replayer = Replayer(config, tracker, torch.device("cpu"), metric=UpdateMetric(optimizer))
        replayer.begin_metric(model)
        g0 = replayer.gradient(model, capture, exact, 0)
        assert g0 is not None
        result = {}
        for name in layers:
            for b in bits:
                total = 0.0
                for k in range(draws):
                    g = replayer.gradient(model, capture, only(name, float(b), None), 1000 + k)
                    assert g is not None
                    total += float((g - g0).square().sum())
                result[(name, b)] = total / draws
        return result
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("metric", ["gradient", "update"])
def test_predicted_variance_matches_measurement_within_2x(metric: str) -> None:
    torch.manual_seed(0)
    model = CNN(c=8)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    ctl = memctl.Controller(model, opt, bits=4, monitor_interval_s=0, min_numel=64, allocation_interval=2,
                            calibration_fraction=1000.0, calibration_max_replays=200, variance_metric=metric)
    x, y = _data()
    g = torch.Generator().manual_seed(1)
    for _ in range(7):
        idx = torch.randint(0, len(x), (32,), generator=g)
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        opt.zero_grad()
    layers = {e["name"]: e for e in ctl.stats()["layers"] if e.get("variance_measured")}
    config = ctl.config
    ctl.detach()
    assert len(layers) >= 8, sorted(layers)
    for e in layers.values():
        assert set(e["variance_predicted"]) == set(e["variance_measured"]) == {"1", "2", "4", "8"}
    idx = torch.randint(0, len(x), (32,), generator=g)
    truth = _measure(model, config, x[idx], y[idx], sorted(layers), (1, 2, 4, 8), draws=4,
                     optimizer=opt if metric == "update" else None)
    scale = max(truth.values())
    ratios = {}
    for (name, b), measured in truth.items():
        predicted = layers[name]["variance_predicted"][str(b)]
        if measured < 1e-12 * scale and predicted < 1e-12 * scale:
            continue  # a layer whose compression changes nothing (dropout's mask is lossless); an
            # 8-bit batch-norm input adds ~1e-6 of the 1-bit head's variance, and is a pair
        ratios[(name, b)] = predicted / measured
    assert len(ratios) >= 36
    assert {b for _, b in ratios} == {1, 2, 4, 8}
    assert sum(name.endswith(("bn", "bn1", "bn2")) for name, _ in ratios) >= 16  # BatchNorm inputs
    # The scale and the layers apart: every prediction is the calibration's unit (NOTE [ Gradient
    # scale ]) times a layer's stored ratio, and the unit follows the last few 32-sample batches,
    # whose ‖g‖² spreads ~4x here (0.45-1.73 over four fresh batches at seed 0, where the last
    # training batch's was 0.94): the median ratio is the unit against this batch, 0.65 at seed
    # 0, 0.83 and 1.03 at seeds 1-2; within 2x.
    median = statistics.median(ratios.values())
    assert 0.5 <= median <= 2.0, ratios
    # Over the median, the per-layer model: at 4 and 8 bits the prediction pools the layer's
    # draws at every width from 2 bits up (NOTE [ Pooling the widths from 2 bits up ]). A
    # 4-draw measurement against a prediction from the calibration's own draws: in the gradient's
    # metric, at seeds 0-2, 1-2 pairs of 36-39 outside 2x, the worst 2.3-2.7x; in AdamW's update
    # metric (NOTE [ Update metric ]) 2 of 40 at seed 0, the worst 3.2x (block2.bn1 at 4 bits,
    # whose error lands most on its own batch norm's parameters, those of the largest gain),
    # seeds 1-2 within 3x; most pairs within 2x, every pair within 3x (3.5x in the update metric)
    shape = {k: r / median for k, r in ratios.items()}
    missed = {k: r for k, r in shape.items() if not 0.5 <= r <= 2.0}
    assert len(missed) <= len(shape) // 10, shape
    worst = 3.5 if metric == "update" else 3.0
    assert all(1 / worst <= r <= worst for r in shape.values()), shape


def test_closed_form_alone_is_far_from_measurement() -> None:
    """The reason for calibrating: the closed form's layer-to-layer ratios are wrong by large factors."""
    torch.manual_seed(0)
    model = CNN(c=8)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    ctl = memctl.Controller(model, opt, bits=4, monitor_interval_s=0, min_numel=64, allocation_interval=2,
                            calibration_fraction=1000.0, calibration_max_replays=200)
    x, y = _data()
    for i in range(3):
        nn.functional.cross_entropy(model(x[32 * i:32 * (i + 1)]), y[32 * i:32 * (i + 1)]).backward()
        opt.step()
        opt.zero_grad()
    factors = [
        e["variance_measured"]["2"] / e["variance_closed_form"]["2"]
        for e in ctl.stats()["layers"]
        if e.get("variance_measured") and e["variance_closed_form"]["2"] > 0
        and e["variance_measured"]["2"] > 0
    ]
    ctl.detach()
    assert len(factors) >= 6
    assert max(factors) / min(factors) > 4.0, factors
    assert all(math.isfinite(f) for f in factors)


@pytest.mark.parametrize("fraction", [0.0])
def test_calibration_off_keeps_the_closed_form(fraction: float) -> None:
    model = CNN(c=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctl = memctl.Controller(model, opt, bits=2, monitor_interval_s=0, min_numel=64,
                            calibration_fraction=fraction)
    x, y = _data(64)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    s = ctl.stats()
    ctl.detach()
    assert s["calibration"]["probes"] == 0
    for e in s["layers"]:
        if "variance_predicted" in e:
            assert e["variance_measured"] == {}
            assert e["variance_predicted"] == pytest.approx(e["variance_closed_form"])


@settings(max_examples=40, deadline=None)
@given(groups=st.integers(1, 6), tail=st.integers(0, 7), data=st.data())
def test_group_ranges_skip_non_finite_values(groups: int, tail: int, data: st.DataObject) -> None:
    """NOTE [ Range statistics ]: each group's (min, max) over its finite values, (0, 0) for a
    group with none, on the one-pass path and the masked one alike."""
    from memctl.controller.packing import _group_ranges

    g = 8
    n = groups * g + tail
    special = st.sampled_from([math.nan, math.inf, -math.inf])
    value = st.one_of(st.floats(-100.0, 100.0, width=32), special)
    flat = torch.tensor(data.draw(st.lists(value, min_size=n, max_size=n)), dtype=torch.float32)
    lo, hi = _group_ranges(flat, g)
    padded = torch.cat([flat, torch.full(((-n) % g,), math.nan)]).view(-1, g)
    for i, row in enumerate(padded):
        finite = row[torch.isfinite(row)]
        want = (float(finite.min()), float(finite.max())) if finite.numel() else (0.0, 0.0)
        assert (float(lo[i]), float(hi[i])) == want
