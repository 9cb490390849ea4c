"""A sigmoid's or tanh's result read by its own backward (NOTE [ Squares of a rounded result ])."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import memctl
from memctl.codecs.quantize.codec import QuantizeCodec
from memctl.controller import packing
from memctl.controller.squares import SQUARE_READERS, rounding_variance, square_read
from tests.controller.draws import bias_over_noise


@pytest.mark.parametrize(("fn", "gain", "center", "shrink"), [
    (torch.tanh, 0.7, 0.0, 20.0), (torch.sigmoid, 1.5, 0.5, 20.0),
    (torch.tanh, 1.5, 0.0, 4.0),  # saturated: values pile at the groups' ends, where the variance is less
])
def test_the_corrected_square_is_unbiased_over_draws(fn: Any, gain: float, center: float,
                                                     shrink: float) -> None:
    """Averaged over the codec's draws, ``(r - c)²`` is ``(y - c)²`` within a twentieth of the
    decoded value's own excess (a quarter where most values saturate); that excess, the
    rounding's variance, shows in every draw."""
    y = fn(torch.randn(16, 1024, generator=torch.Generator().manual_seed(0)) * gain)
    codec = QuantizeCodec(group_size=256)
    exact = float((y - center).square().mean())
    plain, corrected = [], []
    for seed in range(32):
        p = codec.encode(y, bits=2, seed=seed)
        got = codec.decode(p)
        plain.append(float((got - center).square().mean()) - exact)
        corrected.append(float((square_read(got, p, center) - center).square().mean()) - exact)
    excess = sum(plain) / len(plain)
    assert min(plain) > 0.5 * excess > 0
    assert abs(sum(corrected) / len(corrected)) < excess / shrink, (excess, corrected[:4])


def test_rounding_variance_is_a_sixth_of_the_squared_step() -> None:
    t = torch.linspace(-2.0, 6.0, 512).reshape(2, 256)  # one group per row at group size 256
    p = QuantizeCodec(group_size=256).encode(t, bits=2, seed=1)
    var = rounding_variance(p)
    assert var.shape == t.shape
    step = (t.amax(1) - t.amin(1)) / 3
    assert torch.allclose(var, (step.square() / 6)[:, None].expand(2, 256))


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 96), nn.Linear(96, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def test_only_the_ops_own_backward_reads_the_corrected_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tanh's backward reads the corrected values; the next layer's matrix product reads
    the same record as decoded."""
    reads: list[tuple[str, torch.Tensor]] = []
    unpack = packing.Packer.unpack

    def spy(self: packing.Packer, saved: Any) -> torch.Tensor:
        got = unpack(self, saved)
        node = torch._C._current_autograd_node()
        reads.append((type(node).__name__ if node is not None else "", got.detach().clone()))
        return got

    monkeypatch.setattr(packing.Packer, "unpack", spy)
    torch.manual_seed(0)
    model = _Gated()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    # head_bits=None: the tanh's result, which the last layer reads, at 2 bits too
    ctl = memctl.Controller(model, opt, bits=2.0, bit_choices=(2,), monitor_interval_s=0,
                            calibration_fraction=0.0, min_numel=0, head_bits=None)
    model(torch.randn(64, 64)).square().mean().backward()
    ctl.detach()
    by = {(name, tuple(t.shape)): t for name, t in reads}
    tanh, mm = by["TanhBackward0", (64, 96)], by["AddmmBackward0", (64, 96)]
    assert tanh.shape == mm.shape == (64, 96)
    assert not torch.equal(tanh, mm)
    assert bool((tanh.abs() <= mm.abs()).all())  # moved towards the vertex at 0, never past it
    assert bool(((tanh == 0) | (tanh.sign() == mm.sign())).all())
    assert set(SQUARE_READERS) == {"TanhBackward0", "SigmoidBackward0"}


def _first_layer_draws(draws: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first layer's weight gradient of ``_Gated`` (what the tanh's derivative feeds), exact
    and one row per draw of the codec's rounding at 2 bits, at fixed weights."""
    torch.manual_seed(0)
    model = _Gated()
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model(x).square().mean().backward()
    exact = model.a.weight.grad.flatten().clone()
    opt.zero_grad()
    # head_bits=None: the tanh's result, which the last layer reads, at 2 bits too
    ctl = memctl.Controller(model, opt, bits=2.0, bit_choices=(2,), monitor_interval_s=0,
                            calibration_fraction=0.0, min_numel=0, head_bits=None)
    rows = []
    for _ in range(draws):
        model(x).square().mean().backward()
        rows.append(model.a.weight.grad.flatten().clone())
        opt.step()
        opt.zero_grad()
    ctl.detach()
    return exact, torch.stack(rows)


def test_the_gradient_through_a_tanh_is_far_less_biased(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the corrected read, the mean of 96 draws of the gradient before the tanh is within a
    few standard errors of the exact one; read as decoded, it is far off (the derivative too
    small by the rounding's variance at every value)."""
    exact, rows = _first_layer_draws(96)
    corrected = bias_over_noise(exact, rows)
    monkeypatch.setattr(packing, "SQUARE_READERS", {})
    plain_exact, plain = _first_layer_draws(96)
    assert torch.equal(plain_exact, exact)
    uncorrected = bias_over_noise(exact, plain)
    assert corrected < 5.0 and uncorrected > 12.0 and uncorrected > 4 * corrected, (corrected, uncorrected)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("center", [0.0, 0.5])
def test_the_cpu_kernel_is_the_pytorch_formula(bits: int, center: float) -> None:
    """The one-pass CPU kernel gives the PyTorch ops' values (the path off the CPU), a partial
    last group included, and half precision takes the PyTorch path."""
    y = torch.sigmoid(torch.randn(1000, generator=torch.Generator().manual_seed(bits)) * 2) - 0.5 + center
    p = QuantizeCodec(group_size=128).encode(y, bits=bits, seed=7)
    got = QuantizeCodec(group_size=128).decode(p)
    d = got - center
    want = d.square().sub(rounding_variance(p)).clamp_min(0).sqrt().copysign(d) + center
    assert torch.allclose(square_read(got, p, center), want, rtol=0, atol=1e-6)
    half = square_read(got.half(), p, center)
    assert half.dtype == torch.float16 and torch.allclose(half.float(), want, atol=2e-3)


@pytest.mark.parametrize("center", [0.0, 0.5])
def test_a_batch_record_starting_inside_a_group_reads_its_own_groups(center: float) -> None:
    """A batch's record starts where the one before it ended, inside a group: its values take
    the ranges of the batch's groups they sit in (the whole batch's correction, sliced)."""
    from memctl.controller.batches import Batch

    group, bits = 64, 2
    codec = QuantizeCodec(group_size=group)
    empty = (torch.empty(0, dtype=torch.int64), torch.empty(0))
    batch = Batch(bits, torch.float32, group, 5, empty, capacity=1024)
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.sigmoid(torch.randn(n, generator=gen) * scale) - 0.5 + center
               for n, scale in ((100, 0.2), (150, 4.0), (90, 1.0))]  # very different ranges per group
    members = [batch.add(t, None, "layer") for t in tensors]
    whole = torch.cat(tensors)
    used = batch.groups
    codec.encode_into(whole, batch.payload[:used * group * bits // 8], batch.meta[:used], bits=bits, seed=5)
    record = batch.whole()
    decoded = codec.decode(record)
    want_var = rounding_variance(record)
    want = square_read(decoded, record, center)
    for m in members:
        assert m.start % group or m is members[0]
        piece = decoded[m.start:m.start + m.numel]
        assert torch.equal(rounding_variance(m), want_var[m.start:m.start + m.numel])
        assert torch.equal(square_read(piece.clone(), m, center), want[m.start:m.start + m.numel])
        half = square_read(piece.half(), m, center).float()  # the PyTorch path
        assert torch.allclose(half, want[m.start:m.start + m.numel], atol=2e-3)


class _Cell(nn.Module):
    """A few steps of a GRU-like cell written out: its gates' tanh and sigmoid results are small
    records of the same batches (NOTE [ Batched small records ])."""

    def __init__(self) -> None:
        super().__init__()
        self.x, self.h, self.out = nn.Linear(16, 3 * 96), nn.Linear(96, 3 * 96), nn.Linear(96, 4)

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(xs.shape[1], 96)
        for x in xs:
            a, b, c = (self.x(x) + self.h(h)).chunk(3, dim=1)
            z, r = torch.sigmoid(a), torch.sigmoid(b)
            n = torch.tanh(c * r)
            h = (1 - z) * n + z * h
        return self.out(h)


def _cell_grads(monkeypatch: pytest.MonkeyPatch, together: bool) -> tuple[list[torch.Tensor], int]:
    from memctl.codecs.quantize import _kernels

    calls = [0]
    segments = _kernels.square_read_segments_cpu

    def counting(*args: Any) -> torch.Tensor:
        calls[0] += 1
        return segments(*args)

    monkeypatch.setattr(packing, "square_read_segments_cpu", counting)
    if not together:
        monkeypatch.setattr(packing.Packer, "_squared_piece", lambda self, data: None)
    torch.manual_seed(0)
    model = _Cell()
    xs = torch.randn(6, 64, 16, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = memctl.Controller(model, opt, bits=2.0, bit_choices=(2,), monitor_interval_s=0,
                            calibration_fraction=0.0)
    for _ in range(2):
        opt.zero_grad()
        model(xs).square().sum().backward()
        opt.step()
    ctl.detach()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None], calls[0]


def test_a_batchs_squared_records_corrected_together_are_as_one_by_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The tanh and sigmoid records of a batch corrected by one call when the first is read give
    the gradients of each corrected alone, bit for bit."""
    together, calls = _cell_grads(monkeypatch, together=True)
    assert calls > 0
    monkeypatch.undo()
    alone, none = _cell_grads(monkeypatch, together=False)
    assert none == 0
    assert all(torch.equal(a, b) for a, b in zip(together, alone, strict=True))
