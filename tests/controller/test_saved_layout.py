"""NOTE [ The saved layout ]: a Python autograd function reads its saved tensors in their strides."""

from __future__ import annotations

import copy
import shutil
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memctl
from memctl.controller.strides import laid_out, same_layout


class _StrideChecked(torch.autograd.Function):
    """``x * w`` that checks, in its backward, the strides ``x`` had when it was saved."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.stride = x.stride()
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        if x.stride() != ctx.stride:
            raise AssertionError(f"saved with strides {ctx.stride}, read with {x.stride()}")
        return grad * w, (grad * x).sum(0, keepdim=True)


class _Net(nn.Module):
    def __init__(self, layout: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.w = nn.Parameter(torch.randn(1, 8, 12, 12))
        self.head = nn.Linear(8, 4)
        self.layout = layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        if self.layout == "channels_last":
            h = h.contiguous(memory_format=torch.channels_last)
        elif self.layout == "transposed":
            h = h.transpose(2, 3)
        h = _StrideChecked.apply(h, self.w)
        return self.head(h.relu().mean((2, 3)))


@pytest.mark.parametrize("layout", ["channels_last", "transposed"])
def test_a_custom_function_reads_its_saved_strides(layout: str) -> None:
    torch.manual_seed(0)
    model = _Net(layout)
    plain = _Net(layout)
    plain.load_state_dict(model.state_dict())
    ctl = memctl.Controller(model, bits=8, monitor_interval_s=0, calibration_fraction=0)
    x, y = torch.randn(16, 3, 12, 12), torch.randint(0, 4, (16,))
    for _ in range(2):  # the second step packs at the allocation's widths
        F.cross_entropy(model(x), y).backward()
        ctl.step()
    F.cross_entropy(plain(x), y).backward()
    assert ctl.stats()["packed_bytes"] < ctl.stats()["raw_bytes"]  # the conv output was compressed
    got, want = model.w.grad, plain.w.grad
    assert got is not None and want is not None
    cos = F.cosine_similarity(got.flatten(), 2 * want.flatten(), dim=0)  # two steps' gradients
    assert cos > 0.999
    ctl.detach()


@pytest.mark.parametrize(("shape", "stride"), [
    ((4, 3, 5, 6), (90, 1, 18, 3)),  # channels-last
    ((5, 4), (1, 5)),  # a transpose
    ((4, 3), (8, 1)),  # a slice: gaps between rows
    ((4, 1, 3), (3, 7, 1)),  # a dimension of size 1 with any stride
])
def test_laid_out_gives_the_strides(shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
    values = torch.randn(shape)
    out = laid_out(values, stride)
    assert same_layout(out, stride)
    assert torch.equal(out, values)


def test_laid_out_rebuilds_an_expanded_tensor() -> None:
    base = torch.randn(3, 1)
    expanded = base.expand(3, 4)
    out = laid_out(expanded.contiguous(), expanded.stride())
    assert out.stride() == expanded.stride()
    assert torch.equal(out, expanded)
    assert not same_layout(torch.zeros(3, 4), expanded.stride())
    assert same_layout(torch.zeros(3, 1, 2), (2, 99, 1))


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="Inductor compiles C++ on the CPU")
def test_an_inductor_compiled_conv_net_trains_as_plain() -> None:
    """Inductor lays a convolution's input and weight out channels-last and checks their strides
    in the compiled backward (it raised on memctl's contiguous decode); a compiled graph's tensors
    are now held as they are (NOTE [ Graphs compiled by torch.compile ] in packing.py)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.GELU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 4))
    plain = copy.deepcopy(model)
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 4, (16,))
    ctl = memctl.Controller(model, bits=2, monitor_interval_s=0, calibration_fraction=0)
    losses: dict[str, list[float]] = {}
    for name, net in (("memctl", model), ("plain", plain)):
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        compiled = torch.compile(net)
        for _ in range(3):
            loss = F.cross_entropy(compiled(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.setdefault(name, []).append(loss.item())
    assert losses["memctl"] == losses["plain"] and losses["plain"][-1] < losses["plain"][0]
    assert ctl._packer.compiled_passed > 0
    ctl.detach()
