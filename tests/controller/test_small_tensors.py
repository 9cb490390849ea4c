"""The hint when tensors under ``min_numel`` hold most of a step's activations (NOTE [ Small
tensors kept as they are ] in controller.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import memctl


class _CellLoop(nn.Module):
    """An LSTM cell stepped in Python: a few tensors of batch x hidden values a time step."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(hidden, hidden)
        self.head = nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = c = torch.zeros(x.shape[1], x.shape[2])
        for step in x:
            h, c = self.cell(step, (h, c))
        return self.head(h)


def _train(model: nn.Module, x: torch.Tensor, steps: int, **options: object) -> list[dict[str, object]]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ctl = memctl.Controller(model, opt, bits=2, calibration_fraction=0.0, monitor_interval_s=0, **options)
    try:
        for _ in range(steps):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return [e for e in ctl.stats()["events"] if e["kind"] == "small_tensors"]
    finally:
        ctl.detach()


def test_a_python_loop_of_small_tensors_is_named_once(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    x = torch.randn(200, 8, 32)  # 200 time steps of 8 x 32 values: ~2 MiB of small tensors a step
    with caplog.at_level(logging.WARNING, logger="memctl.controller"):
        events = _train(_CellLoop(), x, steps=3)
    assert len(events) == 1
    message = str(events[0]["message"])
    assert "min_numel=4096" in message and "min_numel=1024" in message and "%" in message
    assert sum("min_numel=4096" in r.getMessage() for r in caplog.records) == 1


def test_no_hint_when_the_small_tensors_are_compressed_or_few() -> None:
    torch.manual_seed(0)
    x = torch.randn(200, 8, 32)
    assert _train(_CellLoop(), x, steps=2, min_numel=64) == []  # compressed: nothing to say
    wide = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    assert _train(wide, torch.randn(64, 256), steps=2) == []  # large tensors only
