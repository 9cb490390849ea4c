"""NOTE [ Fused recurrent layers ]: GRU and LSTM layers saving their sequences, not every gate."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import memctl
from memctl.controller import recurrent
from memctl.controller.recurrent import RecurrentMode


def _relu_rnn(*args: Any, **kwargs: Any) -> nn.Module:
    return nn.RNN(*args, nonlinearity="relu", **kwargs)


KINDS = [nn.GRU, nn.LSTM, nn.RNN, _relu_rnn]
KIND_IDS = ["GRU", "LSTM", "RNN-tanh", "RNN-relu"]


def _run(model: nn.Module, x: Any, fused: bool) -> tuple[Any, RecurrentMode]:
    mode = RecurrentMode()
    if not fused:
        return model(x), mode
    with mode:
        return model(x), mode


def _loss(out: torch.Tensor, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
    # every output and final state read with its own weights, so each gradient path counts
    loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()
    for s in states:
        loss = loss + (s.square() * torch.arange(s.numel(), dtype=s.dtype).view_as(s)).sum()
    return loss


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize(("layers", "bidirectional", "batch_first", "bias"),
                         [(1, False, False, True), (2, True, True, True), (2, False, True, False),
                          (3, True, False, True)])
def test_outputs_states_and_gradients_are_pytorchs(kind: Callable[..., nn.Module], layers: int,
                                                   bidirectional: bool, batch_first: bool,
                                                   bias: bool) -> None:
    torch.manual_seed(0)
    model = kind(5, 6, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first,
                 bias=bias).double()
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    results = []
    for fused in (False, True):
        (out, states), mode = _run(model, x, fused)
        states = states if isinstance(states, tuple) else (states,)
        grads = torch.autograd.grad(_loss(out, states), [x, *model.parameters()])
        results.append((out, states, grads, mode.fused))
    (out, states, grads, _), (f_out, f_states, f_grads, fused_calls) = results
    assert fused_calls == 1
    # to float rounding, not bit for bit: PyTorch's CPU op projects a reverse direction's input in
    # time order and reverses the steps, the fused layer runs the op on the reversed sequence, and
    # BLAS may round a GEMM row by where it falls in a block (one ulp on some CPUs)
    for a, b in zip((out, *states), (f_out, *f_states), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-13, atol=1e-15)
    assert f_out.stride() == out.stride()  # batch_first: a transposed view, as PyTorch returns
    for a, b in zip(grads, f_grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_gradients_of_gradients(kind: Callable[..., nn.Module]) -> None:
    """``create_graph``: the layer's backward recomputes through PyTorch's op, so it is differentiable."""
    torch.manual_seed(0)
    model = kind(3, 4, num_layers=2, bidirectional=True).double()
    x = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)

    def fn(inp: torch.Tensor) -> torch.Tensor:
        with RecurrentMode():
            out: torch.Tensor = model(inp)[0]
        return out

    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_dropout_between_layers_draws_pytorchs_masks(kind: Callable[..., nn.Module]) -> None:
    model = kind(4, 6, num_layers=3, dropout=0.5).double()  # float64: PyTorch's LSTM skips oneDNN
    x = torch.randn(5, 2, 4, dtype=torch.float64)
    torch.manual_seed(3)
    plain = model(x)[0]
    torch.manual_seed(3)
    (fused, _), mode = _run(model, x, True)
    assert mode.fused == 1 and torch.equal(plain, fused)


def _unsupported() -> list[tuple[str, Callable[[], tuple[nn.Module, Any]]]]:
    def packed() -> tuple[nn.Module, Any]:
        seq = nn.utils.rnn.pack_padded_sequence(torch.randn(5, 3, 4), [5, 3, 2])
        return nn.GRU(4, 6), seq

    return [
        ("packed sequence", packed),
        ("LSTM projection", lambda: (nn.LSTM(4, 6, proj_size=3), torch.randn(5, 3, 4))),
        ("bfloat16", lambda: (nn.GRU(4, 6).bfloat16(), torch.randn(5, 3, 4, dtype=torch.bfloat16))),
    ]


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
@pytest.mark.parametrize(("name", "build"), _unsupported(), ids=[n for n, _ in _unsupported()])
def test_what_is_not_fused_runs_as_pytorchs_op(name: str, build: Callable[[], tuple[nn.Module, Any]]) -> None:
    torch.manual_seed(0)
    model, x = build()
    plain = model(x)[0]
    (fused, _), mode = _run(model, x, True)
    assert mode.fused == 0
    plain_t = plain.data if isinstance(plain, nn.utils.rnn.PackedSequence) else plain
    fused_t = fused.data if isinstance(fused, nn.utils.rnn.PackedSequence) else fused
    assert torch.equal(plain_t, fused_t)


def test_a_forward_without_gradients_is_pytorchs() -> None:
    model = nn.GRU(4, 6)
    with torch.no_grad():
        (_, _), mode = _run(model, torch.randn(5, 3, 4), True)
    assert mode.fused == 0


def test_a_fused_layer_that_fails_falls_back_and_says_so(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: Any) -> Any:
        raise RuntimeError("injected")

    monkeypatch.setattr(recurrent._GRULayer, "apply", broken)
    torch.manual_seed(0)
    model = nn.GRU(4, 6)
    x = torch.randn(5, 3, 4)
    plain = model(x)[0]
    with caplog.at_level(logging.WARNING, logger="memctl.controller"):
        (fused, _), mode = _run(model, x, True)
    assert mode.fused == 0 and torch.equal(plain, fused)
    assert "fused gru failed (RuntimeError: injected)" in caplog.text


class _Tagger(nn.Module):
    def __init__(self, kind: type[nn.Module]) -> None:
        super().__init__()
        self.rnn = kind(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.rnn(x)[0])
        return out


def _train_step(kind: type[nn.Module], **options: Any) -> tuple[list[torch.Tensor], int, int]:
    torch.manual_seed(0)
    model = _Tagger(kind)
    x, y = torch.randn(8, 12, 16), torch.randint(0, 5, (8, 12))
    ctl = None
    if options:
        ctl = memctl.Controller(model, calibration_fraction=0.0, monitor_interval_s=0, min_numel=0, **options)
    nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    packs = held = 0
    if ctl is not None:
        ctl.step()  # the step boundary: the step's bytes reach stats()
        stats = ctl.stats()
        packs, held = ctl._packer.packs, stats["packed_bytes"] + stats["other_bytes"]
        ctl.detach()
    return [p.grad for p in model.parameters() if p.grad is not None], packs, held


def _cos(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    x, y = torch.cat([t.reshape(-1) for t in a]), torch.cat([t.reshape(-1) for t in b])
    return float(x @ y / (x.norm() * y.norm()))


@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM])
def test_an_attached_controller_compresses_a_few_sequences(kind: type[nn.Module]) -> None:
    """A 2-layer recurrent net: a handful of records, the gradient as PyTorch's. PyTorch's own
    backward saves hundreds of a GRU's tensors; a float32 LSTM runs on oneDNN, whose workspace
    (every gate of every step, as bytes memctl cannot quantise) is held as it is."""
    exact, _, _ = _train_step(kind)
    fused, fused_packs, fused_held = _train_step(kind, bits=8)
    per_op, per_op_packs, per_op_held = _train_step(kind, bits=8, fused_rnn=False)
    assert fused_packs <= 12 < per_op_packs and 4 * fused_held < per_op_held
    assert _cos(fused, exact) > 0.9999 and _cos(per_op, exact) > 0.9999
    two, _, _ = _train_step(kind, bits=2)
    assert 0.5 < _cos(two, exact) < 0.99999  # compressed, not exact, and still a gradient


def test_a_copy_of_an_attached_model_runs_plain() -> None:
    """NOTE [ Copies of an attached model ]: the recurrent hooks are inert in a deep copy."""
    torch.manual_seed(0)
    model = _Tagger(nn.GRU)
    ctl = memctl.Controller(model, bits=2, calibration_fraction=0.0, monitor_interval_s=0)
    twin = copy.deepcopy(model)
    x = torch.randn(2, 5, 16)
    assert torch.equal(twin(x), model(x))
    assert not any(isinstance(h, memctl.controller.copysafe.ControllerHook)
                   for h in twin.rnn._forward_pre_hooks.values())
    ctl.detach()
    assert not model.rnn._forward_pre_hooks and not model.rnn._forward_hooks


def test_fused_rnn_must_be_a_bool() -> None:
    with pytest.raises(memctl.errors.ConfigError, match="fused_rnn='no': must be True or False"):
        memctl.Controller(nn.GRU(2, 3), fused_rnn="no")


def test_an_output_changed_in_place() -> None:
    """A GRU's output is saved (as cuDNN saves it): changed in place, autograd's error. An LSTM's
    is not (its backward recomputes the layer from its input): the gradient stays PyTorch's."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    model = _Tagger(nn.GRU)
    ctl = memctl.Controller(model, bits=2, calibration_fraction=0.0, monitor_interval_s=0)
    out = model.rnn(x)[0]
    out.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    ctl.detach()

    lstm = nn.LSTM(16, 32, batch_first=True).double()
    xd = x.double()
    expected = torch.autograd.grad(lstm(xd)[0].mul(2).square().sum(), list(lstm.parameters()))
    with RecurrentMode() as mode:
        out = lstm(xd)[0]
    out.mul_(2)
    got = torch.autograd.grad(out.square().sum(), list(lstm.parameters()))
    assert mode.fused == 1
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b, a)


def test_torch_func_transforms_run_pytorchs_op() -> None:
    model = nn.GRU(3, 4)
    x = torch.randn(5, 2, 3)
    mode = RecurrentMode()

    def loss(params: dict[str, torch.Tensor]) -> torch.Tensor:
        with mode:
            out: torch.Tensor = torch.func.functional_call(model, params, (x,))[0]
        return out.square().sum()

    got = torch.func.grad(loss)(dict(model.named_parameters()))
    model(x)[0].square().sum().backward()
    assert mode.fused == 0
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad)


@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM])
def test_autocast_runs_pytorchs_op(kind: type[nn.Module]) -> None:
    """CPU autocast runs an LSTM in bfloat16 (and a GRU in float32): its dtypes are PyTorch's own."""
    torch.manual_seed(0)
    model = kind(8, 16, batch_first=True)
    x = torch.randn(4, 5, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = model(x)[0]
        (fused, _), mode = _run(model, x, True)
    fused.float().sum().backward()
    assert mode.fused == 0 and fused.dtype == plain.dtype and torch.equal(plain, fused)


def test_micro_batches_backward_in_any_order() -> None:
    """Gradient accumulation: two forwards, then their backwards in reverse order."""
    torch.manual_seed(0)
    model = _Tagger(nn.LSTM)
    xs = [torch.randn(4, 12, 16) for _ in range(2)]
    for x in xs:
        model(x).square().mean().backward()
    exact = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    ctl = memctl.Controller(model, bits=8, calibration_fraction=0.0, monitor_interval_s=0)
    losses = [model(x).square().mean() for x in xs]
    for loss in reversed(losses):
        loss.backward()
    ctl.detach()
    assert _cos([p.grad for p in model.parameters() if p.grad is not None], exact) > 0.9999


class _AfterReLU(nn.Module):
    def __init__(self, kind: Callable[..., nn.Module]) -> None:
        super().__init__()
        self.lin, self.act = nn.Linear(16, 32), nn.ReLU()
        self.rnn, self.head = kind(32, 32, batch_first=True), nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.rnn(self.act(self.lin(x)))[0])
        return out


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_a_relu_result_read_by_a_fused_layer(kind: Callable[..., nn.Module]) -> None:
    """The layer's input is a ReLU's result, whose record serves readers by their node (NOTE [
    Unbiased reads of a ReLU result ]): the fused layer's backward gets the result itself."""
    torch.manual_seed(0)
    model = _AfterReLU(kind)
    x, y = torch.randn(8, 12, 16), torch.randint(0, 5, (8, 12))
    nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    exact = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = memctl.Controller(model, opt, bits=8.0, bit_choices=(8,), calibration_fraction=0.0,
                            monitor_interval_s=0, min_numel=0)
    for _ in range(2):  # the second step's records are made with the first forward's hints
        nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        got = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        opt.step()
        opt.zero_grad()
        assert _cos(got, exact) > 0.9999
    ctl.detach()
