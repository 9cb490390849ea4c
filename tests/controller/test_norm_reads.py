"""NOTE [ A batch norm's input read twice ] and NOTE [ A derived output read back into its derivative ]:
gradients through a batch norm and through a derived output's readers, unbiased over draws."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import memctl
from memctl.controller import norm_reads, packing
from memctl.controller.derived import reads_back
from tests.controller.draws import bias_over_noise
from tests.controller.packers import spy_records


class _SmallMap(nn.Module):
    """1x1 convolution -> batch norm -> 1x1 convolution on a 2x2 map: 64 values per channel. Keeps
    the gradients at the batch norm's input and output of its last backward."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn, self.c2 = nn.Conv2d(8, 64, 1), nn.BatchNorm2d(64), nn.Conv2d(64, 16, 1)
        self.grads: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.c1(x)
        y = self.bn(z)
        if z.requires_grad:
            z.register_hook(lambda g: self._keep("z", g))
            y.register_hook(lambda g: self._keep("y", g))
        return self.c2(y)

    def _keep(self, name: str, g: torch.Tensor) -> None:
        self.grads[name] = g

    def shrinkage(self) -> torch.Tensor:
        """Per channel, the input gradient along the output gradient (which reads no record here):
        where the batch norm's shrinkage adds up, value by value."""
        return (self.grads["z"] * self.grads["y"]).sum((0, 2, 3))


def _draws(model: nn.Module, x: torch.Tensor, upstream: torch.Tensor,
           read: Callable[[Any], torch.Tensor], draws: int,
           **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``read(model)`` after a backward of ``(model(x) * upstream).sum()`` at fixed weights: exact,
    and one row per draw of the codec's rounding at 2 bits (the first step's left out: places are
    judged by its backward)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    (model(x) * upstream).sum().backward()
    exact = read(model).clone()
    opt.zero_grad()
    ctl = memctl.Controller(model, opt, bits=2.0, bit_choices=(2,), monitor_interval_s=0,
                            calibration_fraction=0.0, **options)
    rows = []
    for _ in range(draws + 1):
        (model(x) * upstream).sum().backward()
        rows.append(read(model).clone())
        opt.step()
        opt.zero_grad()
    ctl.detach()
    return exact, torch.stack(rows[1:])


def _small_map_draws(draws: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = _SmallMap().to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 8, 2, 2, generator=g).to(device)  # the model's input: kept by reference, exact
    upstream = torch.randn(16, 16, 2, 2, generator=g).to(device)
    exact, rows = _draws(model, x, upstream, lambda m: m.shrinkage(), draws)
    return exact.cpu(), rows.cpu()


@pytest.mark.parametrize("chain", [True, False], ids=["normalised-record", "own-record"])
def test_the_gradient_through_a_batch_norm_on_a_small_map_is_unbiased(
        chain: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch norm's input read from its chain's record in normalised coordinates (4 bits) or
    from a 2-bit record of its own: unbiased over 96 draws with the correction; the own record's
    bias without it is far beyond the draws' noise."""
    if not chain:
        monkeypatch.setattr(packing, "chain_of", lambda t: None)
    exact, rows = _small_map_draws(96)
    assert bias_over_noise(exact, rows) < 3.0
    if not chain:
        monkeypatch.setattr(packing, "NORM_NODES", frozenset())
        same, biased = _small_map_draws(96)
        assert torch.equal(same, exact)
        assert bias_over_noise(exact, biased) > 12.0


@pytest.mark.gpu
def test_the_gradient_through_a_cudnn_batch_norm_is_unbiased(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the batch norm's node is cuDNN's: it gets the same correction (2-bit own record)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.setattr(packing, "chain_of", lambda t: None)
    model = _SmallMap().cuda()
    names = {type(model.bn(torch.randn(4, 64, 2, 2, device="cuda")).grad_fn).__name__}
    assert names <= norm_reads.NORM_NODES, names
    exact, rows = _small_map_draws(96, "cuda")
    assert bias_over_noise(exact, rows) < 3.0
    monkeypatch.setattr(packing, "NORM_NODES", frozenset())
    same, biased = _small_map_draws(96, "cuda")
    assert torch.allclose(same, exact, rtol=1e-4, atol=1e-6)
    assert bias_over_noise(exact, biased) > 12.0


class _RowNorm(nn.Module):
    """linear -> LayerNorm over 64 features -> linear; keeps the gradients at the norm's input and
    output of its last backward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 64), nn.LayerNorm(64), nn.Linear(64, 16)
        self.grads: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.fc1(x)
        y = self.norm(z)
        if z.requires_grad:
            z.register_hook(lambda g: self.grads.__setitem__("z", g))
            y.register_hook(lambda g: self.grads.__setitem__("y", g))
        return self.fc2(y)


def _row_norm_draws(draws: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = _RowNorm()
    g = torch.Generator().manual_seed(3)
    x, upstream = torch.randn(256, 8, generator=g), torch.randn(256, 16, generator=g)

    def shrinkage(m: _RowNorm) -> torch.Tensor:
        return (m.grads["z"] * m.grads["y"] * m.norm.weight.detach()).sum(-1)

    return _draws(model, x, upstream, shrinkage, draws, norm_bits=None)


def test_the_gradient_through_a_layer_norm_at_two_bits_is_unbiased(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same term over a row's features (its input at 2 bits, the norm's floor off); biased
    beyond the draws' noise without the correction."""
    exact, rows = _row_norm_draws(96)
    assert bias_over_noise(exact, rows) < 3.0
    monkeypatch.setattr(packing, "NORM_NODES", frozenset({"NativeBatchNormBackward0"}))
    same, biased = _row_norm_draws(96)
    assert torch.equal(same, exact)
    assert bias_over_noise(exact, biased) > 12.0


def test_a_batch_norm_in_eval_mode_gets_no_correction() -> None:
    model = _SmallMap().eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = memctl.Controller(model, opt, bits=2.0, monitor_interval_s=0, calibration_fraction=0.0)
    x = torch.randn(16, 8, 2, 2)
    model(x).sum().backward()
    assert not ctl._packer._norm_reads.pending
    ctl.detach()


def test_a_failing_correction_leaves_the_gradient_and_counts_a_fallback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Codec fallback ]: the node's own gradient goes on; the event is counted."""
    def broken(data: Any) -> torch.Tensor:
        raise RuntimeError("injected")

    monkeypatch.setattr(packing, "chain_of", lambda t: None)
    monkeypatch.setattr(norm_reads, "group_variance", broken)
    model = _SmallMap()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = memctl.Controller(model, opt, bits=2.0, bit_choices=(2,), monitor_interval_s=0,
                            calibration_fraction=0.0)
    model(torch.randn(16, 8, 2, 2)).sum().backward()
    assert model.c1.weight.grad is not None and torch.isfinite(model.c1.weight.grad).all()
    assert ctl.stats()["fallbacks"] >= 1
    ctl.detach()


class _GeluNorm(nn.Module):
    """linear -> GELU -> LayerNorm -> linear (a masked-LM head), or the norm left out."""

    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 16)
        self.norm = nn.LayerNorm(128) if norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(self.act(self.fc1(x))))


def _gelu_draws(norm: bool, draws: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = _GeluNorm(norm)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 32, generator=g)
    with torch.no_grad():
        upstream = model(x)  # the gradient of half the output's square: along what the norm put out
    return _draws(model, x, upstream, lambda m: m.fc1.bias.grad, draws)


def test_a_gelu_output_a_layer_norm_reads_keeps_its_own_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first forward derives the GELU's output; its reader, a LayerNorm, gives it a record of
    its own from then on, and the gradient below it is unbiased; derived as before (the judge
    switched off) it is biased beyond the draws' noise."""
    records = spy_records(monkeypatch)
    exact, rows = _gelu_draws(norm=True, draws=96)
    gelu = [type(saved.data).__name__ for name, saved in records if name == "GeluBackward0"]
    assert gelu[0] == "Derived" and gelu[-1] != "Derived"
    assert bias_over_noise(exact, rows) < 3.0
    monkeypatch.setattr(packing, "reads_back", lambda node, op: False)
    same, biased = _gelu_draws(norm=True, draws=96)
    assert torch.equal(same, exact)
    assert bias_over_noise(exact, biased) > 6.0


def test_a_gelu_output_a_linear_layer_reads_stays_derived(monkeypatch: pytest.MonkeyPatch) -> None:
    records = spy_records(monkeypatch)
    _gelu_draws(norm=False, draws=3)
    gelu = [type(saved.data).__name__ for name, saved in records if name == "GeluBackward0"]
    assert gelu and all(kind == "Derived" for kind in gelu)


class _SqueezeExcite(nn.Module):
    """conv -> hardswish -> y * hardsigmoid(fc(mean(y))) -> conv: the scale is computed from y."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.act = nn.Conv2d(8, 32, 1), nn.Hardswish()
        self.fc, self.gate = nn.Conv2d(32, 32, 1), nn.Hardsigmoid()
        self.c2 = nn.Conv2d(32, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.c1(x))
        return self.c2(y * self.gate(self.fc(y.mean((2, 3), keepdim=True))))


def test_reads_back_tells_a_norm_from_a_product() -> None:
    model = _SqueezeExcite()
    x = torch.randn(2, 8, 4, 4)
    y = model.act(model.c1(x))
    scaled = y * model.gate(model.fc(y.mean((2, 3), keepdim=True)))
    out = model.c2(scaled)
    assert reads_back(torch.nn.functional.layer_norm(y, (4,)).grad_fn, "HardswishBackward0")
    assert reads_back(y.square().grad_fn, "HardswishBackward0")
    assert reads_back((y * y).grad_fn, "HardswishBackward0")  # both operands are the output
    assert not reads_back(out.grad_fn, "MulBackward0")  # a convolution reads it for its weight
    assert not reads_back(scaled.grad_fn, "HardswishBackward0")  # left derived: NOTE [ A derived output ... ]
    assert not reads_back((y * torch.randn(4, requires_grad=True)).grad_fn, "HardswishBackward0")


def test_a_squeeze_excitation_input_stays_derived(monkeypatch: pytest.MonkeyPatch) -> None:
    records = spy_records(monkeypatch)
    torch.manual_seed(0)
    model = _SqueezeExcite()
    x, upstream = torch.randn(16, 8, 4, 4), torch.randn(16, 8, 4, 4)
    _draws(model, x, upstream, lambda m: m.fc.weight.grad, draws=2)
    kinds = [type(saved.data).__name__ for name, saved in records if name == "HardswishBackward0"]
    assert kinds and all(kind == "Derived" for kind in kinds)


def test_the_correction_of_a_record_starting_inside_a_group_takes_its_groups_variance() -> None:
    """A batch's record starts inside a group (NOTE [ Batched small records ]): its values take
    the variance of the groups they sit in, not of groups counted from its first value."""
    correction = norm_reads._Correction(torch.ones(1), torch.ones(1), None, "layer")
    correction.group, correction.offset = 4, 3
    variance = torch.tensor([1.0, 10.0, 100.0])
    g = torch.ones(2, 3)
    got = correction.add_to(torch.zeros(2, 3), g, variance)
    assert torch.equal(got.reshape(-1), torch.tensor([1.0, 10.0, 10.0, 10.0, 10.0, 100.0]))


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_correction_adds_the_correction_term(raw: bool, dtype: torch.dtype) -> None:
    """``add_to`` (one fused op for float32) is ``dx`` plus ``factor·g·Var``, raw records'
    factor times the unit's square."""
    gen = torch.Generator().manual_seed(1)
    invstd = torch.rand(3, generator=gen) + 0.5
    correction = norm_reads._Correction((invstd / 8).view(1, 3, 1, 1), invstd.view(1, 3, 1, 1), None, "layer")
    correction.group, correction.raw = 4, raw
    g = torch.randn(2, 3, 2, 2, generator=gen)
    variance = torch.rand(6, generator=gen)
    dx = torch.randn(2, 3, 2, 2, generator=gen).to(dtype)
    per_value = variance.repeat_interleave(4).view(2, 3, 2, 2)
    factor = invstd.view(1, 3, 1, 1) / 8 * (invstd.view(1, 3, 1, 1) ** 2 if raw else 1)
    term = g * per_value * factor
    torch.testing.assert_close(correction.add_to(torch.zeros(2, 3, 2, 2), g, variance), term)
    got = correction.add_to(dx, g, variance)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), dx.float() + term, rtol=1e-2 if dtype is torch.bfloat16 else 1e-6,
                               atol=1e-2 if dtype is torch.bfloat16 else 1e-6)
