"""NOTE [ Elementwise expressions ]: saved tensors rebuilt from one earlier record."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import memctl
from memctl.controller import expressions
from tests.controller.test_regions import _Act


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's activation, as Hugging Face transformers writes it."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class _Root:
    data = None


FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_like": lambda x: 0.5 * x * torch.tanh(0.79 * (x + 0.044715 * torch.pow(x, 3.0))),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "tanh_derivative": lambda x: 1.0 - torch.tanh(x) ** 2,
    "affine": lambda x: x / 3.0 + 0.5,
    "minus": lambda x: torch.sigmoid(x) * x.exp() - 2.0,
    "reshaped": lambda x: torch.sigmoid(x.view(-1, 8)).view(x.shape) * 2.0,
    "table_op": lambda x: nn.functional.silu(x) * 1.5,
}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_rebuilt_function_reproduces_the_tensor_bit_for_bit(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, requires_grad=True)
    x = torch.randn(4, 16, generator=g) * 3.0 * w  # a root with a grad_fn
    y = FUNCTIONS[name](x)
    root = _Root()
    x_node = x.grad_fn  # held: an id names a node only while its Python object lives (torch 2.11)
    nodes = {(id(x_node), 0): root}
    expr = expressions.build(y, lambda node, nr: nodes.get((id(node), nr)),
                             lambda s: x if s is root else None)
    assert expr is not None and expr.roots == (root,)
    assert torch.equal(expr.fn((x.detach(),)), y.detach())
    fresh = torch.randn(4, 16, generator=g)
    assert torch.equal(expr.fn((fresh,)), FUNCTIONS[name](fresh))


def test_two_roots() -> None:
    """SwiGLU's product as Llama's MLP writes it: a function of the gate's and the up projection's records."""
    w = torch.randn(16, requires_grad=True)
    gate, up = torch.randn(4, 16) * w, torch.randn(4, 16) * w
    y = (nn.functional.silu(gate) * up).view(-1)
    gate_node, up_node = gate.grad_fn, up.grad_fn  # held, as above
    roots = {(id(gate_node), 0): _Root(), (id(up_node), 0): _Root()}
    tensors = {id(roots[(id(gate_node), 0)]): gate, id(roots[(id(up_node), 0)]): up}
    expr = expressions.build(y, lambda node, nr: roots.get((id(node), nr)), lambda s: tensors.get(id(s)))
    assert expr is not None and len(expr.roots) == 2
    assert torch.equal(expr.fn(tuple(t.detach() for t in expr.sources)), y.detach())


@pytest.mark.parametrize("fn", [
    lambda x, z, v: x * z * v,  # three roots
    lambda x, z, v: x * torch.ones(4, 16),  # a non-scalar constant
    lambda x, z, v: x.t().contiguous() * 2.0,  # a permute
    lambda x, z, v: x.sum(1, keepdim=True) * x,  # a reduction
    lambda x, z, v: (x + 1.0) * x,  # a constant in no node, inside the expression (not the saved tensor)
])
def test_what_is_not_up_to_two_roots_through_elementwise_ops_is_not_rebuilt(
        fn: Callable[..., torch.Tensor]) -> None:
    w = torch.randn(16, requires_grad=True)
    xs = [torch.randn(4, 16) * w for _ in range(3)]
    x_nodes = [x.grad_fn for x in xs]  # held, as above
    roots = {(id(n), 0): _Root() for n in x_nodes}
    tensors = {id(roots[(id(n), 0)]): x for n, x in zip(x_nodes, xs, strict=True)}
    expr = expressions.build(fn(*xs), lambda node, nr: roots.get((id(node), nr)),
                             lambda s: tensors.get(id(s)))
    assert expr is None


# -- through the controller ------------------------------------------------------------------------
def _mlp(fn: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), _Act(fn), nn.Linear(256, 32))


def _run(model: nn.Module, bits: int | None, steps: int = 1,
         between: Callable[[int], None] | None = None) -> tuple[int, list[torch.Tensor]]:
    """Packed bytes of the last step and each step's gradients of the first layer's bias (through the
    activation's backward) and the last layer's weight (which reads the activation's output), plain
    PyTorch when ``bits`` is None."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = None
    if bits is not None:
        ctl = memctl.Controller(model, opt, bits=float(bits), bit_choices=(bits,), monitor_interval_s=0,
                                calibration_fraction=0.0)
    g = torch.Generator().manual_seed(1)
    grads = []
    for step in range(steps):
        if between is not None:
            between(step)
        x = torch.randn(8, 16, 32, generator=g)  # 3-d: nn.Linear saves a reshape of its input
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
        grads.append(torch.cat([model[0].bias.grad, model[2].weight.grad.flatten()]))
    packed = 0
    if ctl is not None:
        packed = sum(e["packed_bytes"] for e in ctl.stats()["layers"])
        ctl.detach()
    return packed, grads


def _separate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(expressions, "build", lambda *args: None)
    from memctl.controller import packing

    monkeypatch.setattr(packing, "build", lambda *args: None)


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_gelu_new_keeps_one_record_of_its_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """x, tanh(.), 1 + tanh(.), 0.5x and the next layer's input: one record at 8 bits, not five at 2."""
    plain = _run(_mlp(_gelu_new), None)[1][0]
    joint, joint_grad = _run(_mlp(_gelu_new), 2)
    _separate(monkeypatch)
    separate, separate_grad = _run(_mlp(_gelu_new), 2)
    values = 8 * 16 * 256
    assert joint < separate
    assert separate - joint > values * 2 / 8 * 0.9  # at least the 10 bits per value that became 8
    assert _error(joint_grad[0], plain) < 0.5 * _error(separate_grad[0], plain)


def test_a_constant_that_changes_between_steps_is_read_again() -> None:
    """``x + c`` keeps no ``c`` in its node: it is read off the data at every step, not cached."""
    state = {"c": 1.0}

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * (x + state["c"])

    def between(step: int) -> None:
        state["c"] = [1.0, 5.0, -3.0][step]

    plain = _run(_mlp(fn), None, steps=3, between=between)[1]
    state["c"] = 1.0
    packed = _run(_mlp(fn), 8, steps=3, between=between)[1]
    for a, b in zip(packed, plain, strict=True):
        assert _error(a, b) < 0.02


def test_a_rebuild_that_misses_the_tensor_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """With tanh rebuilt wrongly, the records that need it keep their own payload (the others,
    ``0.5·x``, are still rebuilt): the gradients stay as good as with separate records."""
    plain = _run(_mlp(_gelu_new), None)[1][0]
    joint, joint_grad = _run(_mlp(_gelu_new), 2)
    monkeypatch.setitem(expressions._UNARY, "TanhBackward0", torch.sigmoid)
    wrong, wrong_grad = _run(_mlp(_gelu_new), 2)
    _separate(monkeypatch)
    separate, separate_grad = _run(_mlp(_gelu_new), 2)
    # (the whole expression's root reaches 8 bits, whose groups cost more than the partial
    # rebuild's 4-bit root and two 2-bit records: NOTE [ Eight-bit groups ])
    assert joint < separate and wrong < separate
    assert _error(joint_grad[0], plain) < _error(wrong_grad[0], plain)
    assert _error(wrong_grad[0], plain) < 1.2 * _error(separate_grad[0], plain)


class _SwiGLU(nn.Module):
    """Llama's MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(32, 256), nn.Linear(32, 256), nn.Linear(256, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def _swiglu_run(bits: int | None) -> tuple[int, torch.Tensor]:
    torch.manual_seed(0)
    model = _SwiGLU()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = None
    if bits is not None:
        ctl = memctl.Controller(model, opt, bits=float(bits), bit_choices=(bits,), monitor_interval_s=0,
                                calibration_fraction=0.0)
    x = torch.randn(8, 16, 32, generator=torch.Generator().manual_seed(1))
    model(x).square().sum().backward()
    opt.step()
    packed = 0
    if ctl is not None:
        packed = sum(e["packed_bytes"] for e in ctl.stats()["layers"])
        ctl.detach()
    return packed, torch.cat([model.gate.bias.grad, model.up.bias.grad, model.down.weight.grad.flatten()])


def test_swiglu_product_is_read_from_its_two_roots(monkeypatch: pytest.MonkeyPatch) -> None:
    """The down projection's input ``silu(gate)·up`` keeps no payload: its bits go to the narrower root
    (the bytes stay those of separate records at most; the errors shrink)."""
    plain = _swiglu_run(None)[1]
    joint, joint_grad = _swiglu_run(2)
    _separate(monkeypatch)
    separate, separate_grad = _swiglu_run(2)
    assert joint <= separate
    assert _error(joint_grad, plain) < _error(separate_grad, plain)


class _Loop(nn.Module):
    """A recurrence whose saved tensors are elementwise ops of two matmuls: no walk ever rebuilds one."""

    def __init__(self) -> None:
        super().__init__()
        self.w, self.u = nn.Linear(128, 128), nn.Linear(128, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros_like(x)
        for _ in range(100):
            h = torch.tanh(self.w(x) + self.u(h))
        return h


def test_a_graph_shape_that_never_rebuilds_is_walked_now_and_then(monkeypatch: pytest.MonkeyPatch) -> None:
    from memctl.controller import packing

    calls = {"n": 0}
    real = packing.build

    def counted(*args: Any) -> Any:
        calls["n"] += 1
        return real(*args)

    monkeypatch.setattr(packing, "build", counted)
    torch.manual_seed(0)
    model = nn.Sequential(_Loop())  # inside a layer: the model's own ops are kept exact
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = memctl.Controller(model, opt, bits=2.0, bit_choices=(2,), monitor_interval_s=0,
                            calibration_fraction=0.0)
    model(torch.randn(64, 128)).square().sum().backward()  # 8,192 values: compressed
    opt.step()
    ctl.detach()
    # one shape of graph (tanh of a sum of two matmuls), 100 times: 4 walks, then 1 in 64
    assert 4 <= calls["n"] <= 4 + 100 // 64 + 1, calls


def test_a_constant_found_once_is_tried_first_without_a_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """An added constant is read off the data once; later tensors that add the same one take a
    single check (no sort, no read-back), and one that adds another is searched again."""
    from memctl.controller import expressions

    monkeypatch.setattr(expressions, "_KNOWN", {})
    searches: list[float | None] = []
    search = expressions._search_constant

    def counting(name: str, u: torch.Tensor, t: torch.Tensor) -> float | None:
        searches.append(search(name, u, t))
        return searches[-1]

    monkeypatch.setattr(expressions, "_search_constant", counting)
    g = torch.Generator().manual_seed(3)
    got = []
    for c in (1.0, 1.0, 1.0, 0.5):
        u = torch.tanh(torch.randn(4096, generator=g))
        got.append(expressions._constant_from("AddBackward0", 1.0, u, u + c))
    assert got == [1.0, 1.0, 1.0, 0.5] and searches == [1.0, 0.5]
    u = torch.randn(64, generator=g)
    assert expressions._constant_from("AddBackward0", 1.0, u, u * 2.0) is None  # no constant at all
