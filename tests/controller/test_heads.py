"""The head's input at ``head_bits`` (NOTE [ The head's input ], memctl/controller/heads.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memctl
from memctl.controller.heads import head_nodes
from memctl.errors import ConfigError


class _Classifier(nn.Module):
    """conv -> ReLU -> global mean -> linear head: the head reads the pooled features."""

    def __init__(self, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.act = nn.ReLU()
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.conv(x)).mean(dim=(2, 3)))


class _WithLoss(_Classifier):
    """Returns its loss, as a Hugging Face model given labels does, with its logits."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        logits = super().forward(x)
        return {"loss": F.cross_entropy(logits.float(), y, label_smoothing=0.1), "logits": logits}


class _Backbone(nn.Module):
    """Returns its residual stream: no head, nothing floored."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x))
        return x + self.out(h)


def _train(model: nn.Module, steps: int = 3, **options: Any) -> memctl.Controller:
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, bits=2, min_numel=256, calibration_fraction=0,
                            monitor_interval_s=0, **options)
    for _ in range(steps):
        x = torch.randn(64, 3, 8, 8)
        y = torch.randint(0, 10, (64,))
        out = model(x, y) if isinstance(model, _WithLoss) else model(x)
        loss = out["loss"] if isinstance(out, dict) else F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return ctl


def _layer(ctl: memctl.Controller, name: str) -> dict[str, Any]:
    return next(layer for layer in ctl.stats()["layers"] if layer["name"] == name)


def test_a_classifier_head_input_is_stored_at_head_bits() -> None:
    ctl = _train(_Classifier())
    head = _layer(ctl, "head")
    # 64 x 64 pooled features at 4 bits in groups of 256: 2048 + 16 x 8 bytes
    assert head["floored_bytes"] == 2048 + 16 * 8
    assert head["packed_bytes"] == head["floored_bytes"]
    assert all(layer["floored_bytes"] == 0 for layer in ctl.stats()["layers"] if layer["name"] != "head")


def test_the_head_is_floored_at_once_when_its_source_lives_and_by_place_after() -> None:
    """A record of its own (past the batched small records) is stored again at the forward's end;
    a batch's piece, and every record from the next forward on, at the floor by its place."""
    big = 1024 * 64  # batch x width of the pooled features: not a batch's piece
    ctl = _train(_Classifier(width=1024), steps=1)
    assert _layer(ctl, "head")["floored_bytes"] == big // 2 + big // 256 * 8
    ctl = _train(_Classifier(width=1024), steps=3)
    assert _layer(ctl, "head")["floored_bytes"] == big // 2 + big // 256 * 8
    ctl = _train(_Classifier(), steps=1)  # a batch's piece: at its layer's bits in the first step
    assert _layer(ctl, "head")["floored_bytes"] == 0
    ctl = _train(_Classifier(), steps=2)
    assert _layer(ctl, "head")["floored_bytes"] == 2048 + 16 * 8


def test_a_loss_the_model_returns_leads_to_its_head() -> None:
    ctl = _train(_WithLoss())
    assert _layer(ctl, "head")["floored_bytes"] == 2048 + 16 * 8


@pytest.mark.parametrize("options", [{"head_bits": None}, {"codec": "errorbound"}])
def test_no_floor_when_turned_off_or_under_error_bounds(options: dict[str, Any]) -> None:
    ctl = _train(_Classifier(), **options)
    assert _layer(ctl, "head")["floored_bytes"] == 0
    assert _layer(ctl, "head")["packed_bytes"] < 4096


def test_head_bits_eight() -> None:
    ctl = _train(_Classifier(), head_bits=8)
    # at 8 bits in groups of 64 (NOTE [ Eight-bit groups ]): 4096 + 64 x 8 bytes
    assert _layer(ctl, "head")["floored_bytes"] == 4096 + 64 * 8


def test_a_backbone_returning_its_residual_stream_floors_nothing() -> None:
    torch.manual_seed(0)
    model = _Backbone()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, bits=2, min_numel=256, calibration_fraction=0, monitor_interval_s=0)
    for _ in range(3):
        model(torch.randn(64, 128)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert all(layer["floored_bytes"] == 0 for layer in ctl.stats()["layers"])


@pytest.mark.parametrize("bad", [3, 16, True, "8"])
def test_bad_head_bits_is_named(bad: object) -> None:
    model = _Classifier()
    with pytest.raises(ConfigError, match="head_bits"):
        memctl.Controller(model, torch.optim.SGD(model.parameters(), lr=0.1), head_bits=bad)


def _seq(nodes: list[Any]) -> list[tuple[str, int]]:
    return [(type(n).__name__, n._sequence_nr()) for n in nodes]


def test_head_nodes_through_views_casts_and_losses() -> None:
    w = torch.randn(10, 32, requires_grad=True)
    x = torch.randn(4, 6, 32, requires_grad=True)
    logits = x @ w.t()  # a language model's head on every token
    found = _seq(head_nodes(logits))
    assert [name for name, _ in found] == ["MmBackward0"]
    loss = F.cross_entropy(logits.reshape(-1, 10).float(), torch.randint(0, 10, (24,)))
    assert _seq(head_nodes({"loss": loss})) == found
    assert _seq(head_nodes((loss / 3, logits))) == found
    b = torch.randn(10, requires_grad=True)
    biased = F.linear(x, w, b)  # on a 3-D input the bias is added after the product
    assert [type(n).__name__ for n in head_nodes(biased)] in (["MmBackward0"], ["AddmmBackward0"])
    # a sum with another tensor, no loss between: not a head's logits
    assert head_nodes(logits + x.sum(-1, keepdim=True)) == []
    assert head_nodes(torch.relu(logits)) == []
    assert head_nodes(None) == []
