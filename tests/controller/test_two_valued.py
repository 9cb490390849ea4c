"""A CPU dropout's float mask is stored at one bit a value, exactly (NOTE [ Two-valued floats ]
in memctl/codecs/lossless/codec.py)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import memctl
from memctl.codecs.base import Packed
from tests.controller.packers import record_of, records_of


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 1024)  # a (64, 1024) mask: 65,536 values, where the test starts
        self.drop = nn.Dropout(0.2)
        self.b = nn.Linear(1024, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(F.relu(self.a(x))))


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).double()


def test_a_dropout_mask_takes_one_bit_and_trains_as_plain_pytorch() -> None:
    torch.manual_seed(0)
    model = _Net()
    plain = copy.deepcopy(model)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = memctl.Controller(model, opt, bits=8.0, bit_choices=(8,), calibration_fraction=0.0,
                            monitor_interval_s=0)
    records = records_of(ctl, lambda t: t.grad_fn is None and t.is_floating_point() and t.shape == (64, 1024))
    try:
        for _ in range(2):
            torch.manual_seed(5)
            plain.zero_grad()
            F.cross_entropy(plain(x), y).backward()
            torch.manual_seed(5)
            opt.zero_grad()
            records.clear()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        (mask,) = (record_of(r) for r in records)
        assert isinstance(mask.data, Packed) and mask.data.params["layout"] == "two"
        assert mask.data.nbytes == 64 * 1024 // 8 + 2 * 4
        layer = next(row for row in ctl.stats()["layers"] if row["name"] == "drop")
        assert layer["packed_bytes"] == mask.data.nbytes  # outside the allocation's control
        a, b = _grads(model), _grads(plain)
        assert float(a @ b / (a.norm() * b.norm())) > 0.9999
    finally:
        ctl.detach()


def test_a_small_mask_keeps_the_usual_path() -> None:
    """Below 65,536 values the test is not made (a recurrent layer's zero initial state):
    the mask is quantised, as before."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Dropout(0.2), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = memctl.Controller(model, opt, bits=2.0, calibration_fraction=0.0, monitor_interval_s=0)
    records = records_of(ctl, lambda t: t.grad_fn is None and t.is_floating_point() and t.shape == (64, 128))
    try:
        model(torch.randn(64, 64)).sum().backward()
        (saved,) = (record_of(r) for r in records)
        assert getattr(saved.data, "codec", None) == "quantize"
    finally:
        ctl.detach()


def test_a_tensor_of_many_values_without_a_gradient_keeps_the_usual_path() -> None:
    """A no-gradient float tensor that is not two-valued (a positional table) is quantised as
    before; the test reads a few of its values."""
    torch.manual_seed(0)
    table = torch.randn(64, 1024)

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(64, 1024)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.a(x) * table).sum()

    model = Scaled()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = memctl.Controller(model, opt, bits=2.0, calibration_fraction=0.0, monitor_interval_s=0)
    records = records_of(ctl, lambda t: t.grad_fn is None and t.data_ptr() == table.data_ptr())
    try:
        model(torch.randn(64, 64)).backward()
        (saved,) = (record_of(r) for r in records)
        assert isinstance(saved.data, Packed) and saved.data.codec == "quantize"
    finally:
        ctl.detach()
