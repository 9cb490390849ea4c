"""NOTE [ Releasing inputs early ]: the trackers drop a full-precision input once an op outside
their tables has consumed it, so the forward's peak does not hold it besides its record."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

import memctl


def _alive_after_later_layers(model: nn.Module, first: nn.Module, last: nn.Module, x: torch.Tensor,
                              **config: Any) -> bool:
    """Whether ``first``'s output is still alive when ``last`` runs, with a controller attached."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = memctl.Controller(model, opt, bits=2, **config)
    ref: list[weakref.ref[torch.Tensor]] = []
    alive: list[bool] = []
    h1 = first.register_forward_hook(lambda m, a, out: ref.append(weakref.ref(out)))
    h2 = last.register_forward_hook(lambda m, a, out: alive.append(ref[-1]() is not None))
    try:
        model(x).sum().backward()
    finally:
        h1.remove()
        h2.remove()
        ctl.detach()
    return alive[-1]


def test_convolution_inputs_are_released_once_consumed() -> None:
    torch.manual_seed(0)
    convs = [nn.Conv2d(16, 16, 3, padding=1) for _ in range(6)]
    model = nn.Sequential(*convs)
    x = torch.randn(4, 16, 32, 32, requires_grad=True)
    # conv 1's output is saved by conv 2; once later convolutions have packed, nothing but
    # its compressed record may hold it (the bit floors' window held the last 6)
    assert not _alive_after_later_layers(model, convs[0], convs[-1], x)
