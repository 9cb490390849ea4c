"""Residual branches closed by a normalisation scale near zero (NOTE [ Gates near zero ])."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memctl
from memctl.errors import ConfigError


class _Block(nn.Module):
    """A residual block whose last batch norm starts at zero scale (timm's ``zero_init_last``),
    with a downsampling shortcut when ``down``, and torchvision's in-place sum and ReLU."""

    def __init__(self, c: int, down: bool = False, zero: bool = True) -> None:
        super().__init__()
        cin = c // 2 if down else c
        self.conv1 = nn.Conv2d(cin, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.act1 = nn.ReLU()
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        if zero:
            nn.init.zeros_(self.bn2.weight)
        shortcut = nn.Sequential(nn.Conv2d(cin, c, 1, bias=False), nn.BatchNorm2d(c))
        self.down = shortcut if down else nn.Identity()
        self.act2 = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(self.act1(self.bn1(self.conv1(x)))))
        y += self.down(x)
        return self.act2(y)


def _model(zero: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        _Block(8, zero=zero), _Block(16, down=True, zero=zero),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )


def _train(model: nn.Module, ctl: memctl.Controller, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (16,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def test_a_closed_branch_keeps_its_gate_join_and_shortcut_at_four_bits() -> None:
    """The zero-scale batch norms are gates from the start (their own inputs floored at step
    0); after one forward their neighbours are known: the ReLU that reads the residual sum and
    the shortcut's last layer (the stem's ReLU for an identity shortcut, the shortcut's batch
    norm for a downsampling one). At ``bits=2`` those take 4 bits, the rest 2."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # the guard off: what it raises depends on how many layers a probe's time budget measured
    ctl = memctl.Controller(model, opt, bits=2, monitor_interval_s=0, guard=False)
    try:
        assert ctl._gates is not None and ctl._gates.gates == {"3.bn2", "4.bn2"}
        assert ctl._choice_for("3.bn2")[0] == 4.0 and ctl._choice_for("3.bn1")[0] == 2.0
        _train(model, ctl, opt, 2)
        floored = {"3.bn2", "3.act2", "2", "4.bn2", "4.act2", "4.down.1"}
        assert set(ctl._gate_floors) == floored
        bits = {la["name"]: la["bits"] for la in ctl.stats()["layers"] if la["bits"] is not None}
        assert all(bits[name] >= 4 for name in floored)
        assert all(b <= 2 for name, b in bits.items() if name not in floored)
        events = [e["message"] for e in ctl.stats()["events"] if e["kind"] == "gates"]
        assert events and "6 layers kept at >= 4 bits" in events[-1]
    finally:
        ctl.detach()


def test_a_gate_that_opened_lets_its_layers_go_at_the_next_allocation() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctl = memctl.Controller(model, opt, bits=2, monitor_interval_s=0, allocation_interval=2, guard=False)
    try:
        _train(model, ctl, opt, 2)
        assert ctl._gate_floors
        with torch.no_grad():
            for block in (model[3], model[4]):
                block.bn2.weight.fill_(1.0)
        _train(model, ctl, opt, 2)  # an allocation at step 2
        assert ctl._gates is not None and not ctl._gates.gates and not ctl._gate_floors
        bits = {la["name"]: la["bits"] for la in ctl.stats()["layers"] if la["bits"] is not None}
        assert max(bits.values()) <= 2.0
        events = [e["message"] for e in ctl.stats()["events"] if e["kind"] == "gates"]
        assert "opened: 3.bn2, 4.bn2" in events[-1]
    finally:
        ctl.detach()


def test_a_model_without_gates_is_left_as_it_was() -> None:
    """Scales at one (the usual initialisation): no gate, no floor, no hook left watching."""
    model = _model(zero=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctl = memctl.Controller(model, opt, bits=2, monitor_interval_s=0)
    try:
        assert ctl._gates is not None and not ctl._gates.gates and not ctl._gates.watching
        _train(model, ctl, opt, 2)
        assert not ctl._gate_floors
        assert not [e for e in ctl.stats()["events"] if e["kind"] == "gates"]
    finally:
        ctl.detach()


def test_gate_bits_none_turns_the_floors_off_and_other_values_are_refused() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctl = memctl.Controller(model, opt, bits=2, monitor_interval_s=0, gate_bits=None, guard=False)
    try:
        _train(model, ctl, opt, 1)
        assert ctl._gates is None and not ctl._gate_floors
        assert max(la["bits"] for la in ctl.stats()["layers"] if la["bits"] is not None) <= 2.0
    finally:
        ctl.detach()
    with pytest.raises(ConfigError, match="gate_bits=3"):
        memctl.Controller(_model(), gate_bits=3)


def test_a_copy_made_while_watching_watches_nothing() -> None:
    """NOTE [ Copies of an attached model ]: the watch's hooks are inert in a deep copy, whose
    forward neither fails nor feeds the original's watch."""
    model = _model()
    ctl = memctl.Controller(model, bits=2, monitor_interval_s=0)
    try:
        assert ctl._gates is not None and ctl._gates.watching
        twin = copy.deepcopy(model)
        twin(torch.randn(2, 3, 32, 32)).sum().backward()
        assert not ctl._gates._outputs and not ctl._gates._inputs
    finally:
        ctl.detach()
    assert ctl._gates is not None and not ctl._gates.watching


class _LinearNorm(nn.Module):
    """LeViT's linear layer and batch norm over its tokens, the norm's output reshaped back."""

    def __init__(self, c: int, zero: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(c, c, bias=False)
        self.bn = nn.BatchNorm1d(c)
        if zero:
            nn.init.zeros_(self.bn.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return self.bn(y.flatten(0, 1)).reshape_as(y)


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = _LinearNorm(32, zero=False)
        self.branches = nn.ModuleList([_LinearNorm(32, zero=True) for _ in range(3)])
        self.act = nn.Hardswish()
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for branch in self.branches:
            x = x + branch(self.act(x))
        return self.head(x.mean(1))


def test_a_gate_whose_output_is_reshaped_before_the_sum_is_found() -> None:
    """The sum's operand is a view of the norm's output (LeViT's ``LinearNorm``), and one
    activation module reads every sum: each of its calls counts."""
    torch.manual_seed(0)
    model = _Tokens()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctl = memctl.Controller(model, opt, bits=2, monitor_interval_s=0)
    try:
        assert ctl._gates is not None  # three of the four norms are gates: their median is zero
        assert ctl._gates.gates == {"branches.0.bn", "branches.1.bn", "branches.2.bn"}
        for _ in range(2):
            nn.functional.cross_entropy(model(torch.randn(8, 64, 32)), torch.randint(0, 10, (8,))).backward()
            opt.step()
            opt.zero_grad()
        # the shared activation reads the first two sums, the stem made the first one's other
        # operand; the last sum goes to a mean, no module
        assert set(ctl._gate_floors) == {"branches.0.bn", "branches.1.bn", "branches.2.bn", "act", "stem"}
    finally:
        ctl.detach()


class _LinearResidual(nn.Module):
    """``x + bn(linear(x))`` with the norm's scale at zero: a closed branch."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)
        nn.init.zeros_(self.bn.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bn(self.lin(x))


def test_the_gates_event_counts_the_layers_that_hold_records() -> None:
    """A container whose input is the residual sum (LeViT's blocks) is a neighbour of the gate
    along with the layer inside it that saves the sum; only layers with records are counted."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), _LinearResidual(16),
        nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU()),
        nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 10),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctl = memctl.Controller(model, opt, bits=2, monitor_interval_s=0, min_numel=16, guard=False)
    try:
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            x, y = torch.randn(32, 16, generator=g), torch.randint(0, 10, (32,), generator=g)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        assert ctl._gates is not None and ctl._gates.gates == {"3.bn"}
        floored = set(ctl._gate_floors)
        assert "4" in floored and "4" not in ctl._layers  # the container: no records of its own
        held = floored & set(ctl._layers)
        assert "4.0" in held and len(held) < len(floored)
        events = [e["message"] for e in ctl.stats()["events"] if e["kind"] == "gates"]
        assert events and f"{len(held)} layers kept at >= 4 bits" in events[-1]
    finally:
        ctl.detach()
