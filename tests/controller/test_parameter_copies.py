"""NOTE [ Copies of parameters ]: autocast's lower-precision weights are held as they are."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memctl
from memctl.controller.copies import ParameterCopies
from memctl.controller.packing import _copy_of_parameter, _from_parameter
from memctl.controller.versions import SavedRef


def _net(frozen: bool = False) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 8 * 8, 10))
    if frozen:  # as in low-rank fine-tuning: the weights' casts need no gradient, and have no node
        net[0].weight.requires_grad_(False)
        net[3].weight.requires_grad_(False)
    return net


@pytest.mark.parametrize(("bits", "frozen"), [(1, False), (2, False), (2, True)])
def test_the_input_gradient_under_autocast_is_plains(bits: int, frozen: bool) -> None:
    """The gradient a net passes to its input reads its weights (and the ReLU's exact mask)
    only: with the weights' bfloat16 copies held as they are it is plain PyTorch's to the bit
    (compressed, as they were, it carried their quantisation noise: a cosine of 0.81 with the
    weights frozen at 2 bits)."""
    model = _net(frozen)
    plain = copy.deepcopy(model)
    ctl = memctl.Controller(model, bits=bits, bit_choices=(1, 2, 4, 8), monitor_interval_s=0,
                            calibration_fraction=0)
    x, y = torch.randn(8, 16, 8, 8), torch.randint(0, 10, (8,))
    grads = []
    for net in (model, plain):
        for _ in range(2):  # the second step packs at the allocation's widths
            xg = x.clone().requires_grad_(True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = net(xg)
            F.cross_entropy(out.float(), y).backward()
            if net is model:
                ctl.step()
        grads.append(xg.grad)
    assert ctl.stats()["packed_bytes"] < ctl.stats()["raw_bytes"]  # the activations were compressed
    assert torch.equal(grads[0], grads[1])
    ctl.detach()


def test_a_cast_weight_is_saved_by_reference() -> None:
    model = _net()
    ctl = memctl.Controller(model, bits=2, monitor_interval_s=0, calibration_fraction=0)
    handles = []
    pack = ctl._packer.pack

    def keep(t: torch.Tensor) -> object:
        handles.append((t, pack(t)))
        return handles[-1][1]

    ctl._scope._pack = keep
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(8, 16, 8, 8))
    ctl._packer.settle()
    weights = [(t, h) for t, h in handles if t.shape in {(32, 16, 3, 3), (2048, 10)}]
    assert len(weights) == 2  # the convolution's copy, and the linear layer's transposed copy
    for t, h in weights:
        assert t.dtype == torch.bfloat16
        got = h.saved if hasattr(h, "saved") else h
        assert isinstance(got, SavedRef), type(got)
    out.float().sum().backward()
    ctl.detach()


def test_only_copies_of_a_leaf_count() -> None:
    lin = nn.Linear(64, 64)
    h = lin(torch.randn(4, 64))
    assert _copy_of_parameter(lin.weight.to(torch.bfloat16).t().grad_fn)
    assert _copy_of_parameter(lin.weight.t().contiguous().view(-1).grad_fn)
    assert not _copy_of_parameter(lin.weight.t()[:, :8].grad_fn)  # views alone: no new memory
    assert _from_parameter(lin.weight.t()[:, :8].grad_fn)  # (a linear layer's matmul, as before)
    assert not _copy_of_parameter(h.to(torch.bfloat16).grad_fn)  # an activation's cast: compressed
    assert not _copy_of_parameter((lin.weight * 2).to(torch.bfloat16).grad_fn)  # computed from it
    assert not _copy_of_parameter(None)


def test_a_nodeless_tensor_is_a_copy_by_its_values() -> None:
    """NOTE [ Copies of parameters without a node ]: by shape, then values, once per place."""
    lin = nn.Linear(16, 8)
    copies = ParameterCopies()
    copies.set(list(lin.parameters()))
    with torch.no_grad():
        cast = lin.weight.to(torch.bfloat16)
        activation = torch.randn(8, 16)  # a parameter's shape, other values
    calls = 0
    real = torch.equal

    def counting(a: torch.Tensor, b: torch.Tensor) -> bool:
        nonlocal calls
        calls += 1
        return real(a, b)

    for forward in range(3):
        copies.begin_forward()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, "equal", counting)
            assert copies.holds(cast)
            assert copies.holds(cast.t())  # the transpose a linear layer saves
            assert not copies.holds(activation.to(torch.bfloat16))
            assert not copies.holds(torch.randn(3, 5))  # no parameter's shape: not compared
        if forward == 0:
            first = calls
    assert calls == first  # the places' answers were kept after the first forward
    copies.set(list(nn.Linear(16, 8).parameters()))  # other parameters: asked again
    copies.begin_forward()
    assert not copies.holds(cast)


def test_autocasts_copy_of_the_input_is_held_as_the_input_is() -> None:
    """NOTE [ Model inputs ]: the image is kept exact in float32; its bfloat16 cast under
    autocast too (the first layer's weight gradient reads it: here plain's to the bit)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1))
    plain = copy.deepcopy(model)
    ctl = memctl.Controller(model, bits=2, monitor_interval_s=0, calibration_fraction=0)
    x = torch.randn(8, 3, 32, 32)
    for net in (model, plain):
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = net(x)
            out.float().sum().backward()
            if net is model:
                ctl.step()
    assert model[0].weight.grad is not None and plain[0].weight.grad is not None
    assert torch.equal(model[0].weight.grad, plain[0].weight.grad)
    ctl.detach()
