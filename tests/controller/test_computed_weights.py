"""NOTE [ Weights computed from parameters ]: a weight a forward computes from the model's
parameters alone (weight normalisation, a meta-learning step's fast weights, a low-rank
update added to a frozen weight) is held as it is, not compressed as an activation."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memctl
from memctl.controller.copies import ParameterCopies
from memctl.controller.versions import SavedRef


class _LowRank(nn.Module):
    """A frozen linear layer with a trainable low-rank update, merged into the weight in the
    forward (``F.linear(x, W + B @ A)``)."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        base.weight.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.b = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.base.weight + self.b @ self.a, self.base.bias)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 10))


def _weight_norm() -> nn.Module:
    net = _mlp()
    for i in (0, 2):
        net[i] = nn.utils.parametrizations.weight_norm(net[i])
    return net


def _low_rank() -> nn.Module:
    net = _mlp()
    net[2] = _LowRank(net[2])
    return net


def _fast_weights_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One first-order inner step (as meta-learning takes it), then the loss at the fast weights."""
    params = dict(net.named_parameters())
    grads = torch.autograd.grad(F.cross_entropy(net(x), y), list(params.values()))
    fast = {k: v - 0.1 * g.detach() for (k, v), g in zip(params.items(), grads, strict=True)}
    return F.cross_entropy(torch.func.functional_call(net, fast, (x,)), y)


def _plain_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(net(x), y)


@pytest.mark.parametrize(("make", "loss_of"), [(_weight_norm, _plain_loss), (_low_rank, _plain_loss),
                                               (_mlp, _fast_weights_loss)],
                         ids=["weight_norm", "low_rank", "fast_weights"])
def test_a_computed_weight_is_held_and_the_gradient_is_plains(
        make: Callable[[], nn.Module], loss_of: Callable[..., torch.Tensor]) -> None:
    """A batch of 8 rows (under ``min_numel``: every activation held as it is), so the weights
    of 128x128 are the only tensors large enough to compress: held, the gradient is plain
    PyTorch's to the bit (compressed at 1 bit, as they were, it was not)."""
    model = make()
    plain = copy.deepcopy(model)
    ctl = memctl.Controller(model, bits=1, bit_choices=(1, 2, 4, 8), monitor_interval_s=0,
                            calibration_fraction=0)
    x, y = torch.randn(8, 128), torch.randint(0, 10, (8,))
    grads = []
    for net in (model, plain):
        for _ in range(2):  # the second step packs at the allocation's widths
            net.zero_grad()
            loss_of(net, x, y).backward()
            if net is model:
                ctl.step()
        grads.append(torch.cat([p.grad.flatten() for p in net.parameters() if p.grad is not None]))
    assert torch.equal(grads[0], grads[1])
    ctl.detach()


def test_the_fast_weight_records_are_references() -> None:
    model = _mlp()
    ctl = memctl.Controller(model, bits=2, monitor_interval_s=0, calibration_fraction=0)
    handles: list[tuple[torch.Tensor, object]] = []
    pack = ctl._packer.pack

    def keep(t: torch.Tensor) -> object:
        handles.append((t, pack(t)))
        return handles[-1][1]

    ctl._scope._pack = keep
    _fast_weights_loss(model, torch.randn(8, 128), torch.randint(0, 10, (8,))).backward()
    ctl._packer.settle()
    weights = [h for t, h in handles if t.shape == (128, 128) and t.grad_fn is not None]
    assert len(weights) == 2  # the two fast weights' transposes, saved by their linear layers
    for h in weights:
        got = h.saved if hasattr(h, "saved") else h
        assert isinstance(got, SavedRef), type(got)
    ctl.detach()


def _copies_of(*params: torch.Tensor) -> ParameterCopies:
    copies = ParameterCopies()
    copies.set(list(params))
    return copies


def test_what_is_computed_from_parameters_alone() -> None:
    lin = nn.Linear(64, 64)
    frozen = torch.randn(64, 64)
    copies = _copies_of(lin.weight, lin.bias)
    fast = lin.weight - 0.1 * torch.randn(64, 64)  # a detached step: an operand without a gradient
    assert copies.computed(fast, fast.grad_fn, tuple(fast.shape))
    merged = frozen + lin.weight * 2
    assert copies.computed(merged, merged.grad_fn, tuple(merged.shape))
    transposed = fast.t()
    assert copies.computed(transposed, transposed.grad_fn, tuple(transposed.shape))
    # a layer's output of a parameter's shape is data: its product has an operand without a gradient
    out = torch.tanh(lin(torch.randn(64, 64)))
    assert not copies.computed(out, out.grad_fn, tuple(out.shape))
    # rows of a parameter picked by data
    emb = nn.Embedding(64, 64)
    rows = emb(torch.randperm(64)) * 2
    assert not _copies_of(emb.weight).computed(rows, rows.grad_fn, tuple(rows.shape))
    # another leaf that needs a gradient (an input being attacked) is not a parameter
    x = torch.randn(64, 64, requires_grad=True)
    mixed = x + lin.weight
    assert not copies.computed(mixed, mixed.grad_fn, tuple(mixed.shape))
    # a shape no parameter has
    other = (lin.weight * 2)[:32]
    assert not copies.computed(other, other.grad_fn, tuple(other.shape))


def test_a_layer_output_of_a_weights_shape_is_still_compressed() -> None:
    """Batch 128 through 128x128 linear layers: outputs of the weights' shape, compressed."""
    model = _mlp()
    ctl = memctl.Controller(model, bits=2, monitor_interval_s=0, calibration_fraction=0)
    for _ in range(2):
        F.cross_entropy(model(torch.randn(128, 128)), torch.randint(0, 10, (128,))).backward()
        ctl.step()
    stats = ctl.stats()
    assert stats["packed_bytes"] * 4 < stats["raw_bytes"]
    ctl.detach()
