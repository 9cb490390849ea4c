"""The default policy (NOTE [ Default policy ]) on a ResNet-18 layout with BatchNorm and AdamW."""

from __future__ import annotations

import torch
from torch import nn

import memctl
from tests.controller.models import ResNet18


def _images(n: int = 16, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, size, size, generator=g)
    w = torch.randn(3 * size * size, 10, generator=g)
    return x, (x.flatten(1) @ w).argmax(1)  # labels a function of the image


def _losses(steps: int = 20, **kw: object) -> tuple[list[float], memctl.Controller | None]:
    torch.manual_seed(0)
    model = ResNet18(width=8)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    ctl = None
    if kw:
        ctl = memctl.Controller(model, opt, monitor_interval_s=0, **kw)  # type: ignore[arg-type]
    x, y = _images()
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    if ctl is not None:
        ctl.detach()
    return losses, ctl


def _drop(losses: list[float]) -> float:
    return losses[0] - min(losses[-3:])


def test_default_policy_trains_like_plain_on_a_resnet() -> None:
    plain, _ = _losses()
    default, ctl = _losses(min_numel=256)
    assert ctl is not None
    s = ctl.stats()
    assert s["allocation"]["policy"] == "bytes"
    # the default policy loses at most 10% of plain's loss drop, and still compresses
    assert _drop(default) >= 0.9 * _drop(plain), (plain, default)
    assert s["ratio"] > 3.0, s["ratio"]


def test_bits_and_budget_keep_their_meaning() -> None:
    model = ResNet18(width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, bits=2, monitor_interval_s=0)
    x, y = _images(4)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    s = ctl.stats()
    ctl.detach()
    assert s["allocation"]["policy"] == "variance"
    assert "average 2 bits" in s["events"][0]["message"]
