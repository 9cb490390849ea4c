"""Saved tensors rebuilt from an earlier record through a chain of elementwise ops.

NOTE [ Elementwise expressions ]
An activation written as several PyTorch ops saves several tensors that are all functions
of one input. GPT-2's ``gelu_new``, ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))``,
saves ``x`` (for the cube), ``tanh(·)``, ``0.5·x`` and ``1 + tanh(·)``, and the next
linear layer saves the product: five records of one tensor's size, each quantised on its
own (in the library GPT-2 of ``benchmarks/fidelity.py`` a third of all packed bytes at the
default policy). NOTE [ Outputs recomputed from the input ] in derived.py does the same
for a single op of its table; this is the general case.

When a floating-point tensor ``t`` is packed, its autograd graph is walked back through
elementwise nodes (:data:`_UNARY`, the table ops of derived.py, scalar multiplication,
division and power, and the sum, difference and product of two walked operands) and
reshapes, up to :data:`_LIMIT` nodes. A walk ends at a node whose output is a record of
this forward: a quantised record whose tensor is still alive (the *root*), or a record
already rebuilt this way or by derived.py (its own function is applied, on top of its
root). If every path ends at one root, ``t`` is ``f(x)`` and its record keeps no payload
(a ``Derived`` of the root); its bits go to the root, as in derived.py: the root's width
grows by the record's bits (within the codec's widths, at most 8), so the bytes are at
most those of the separate records, and every rebuilt tensor carries the error of one
record at the summed bits. For ``gelu_new`` at 2 bits the five records of 2 bits (10
bits per value) become one of 8.

Constants: a node keeps a scalar it multiplies, divides or raises by (``_saved_other``,
``_saved_exponent``), and these are read from it. ``add``, ``sub`` and ``rsub`` keep
none (their backward does not need it): the constant is read off the data when that node
is the packed tensor's own (``c = t − u`` at a value, checked on all values), and a walk
through such a node anywhere else fails, unless its output is itself a record rebuilt
this way.

Nothing is trusted: the rebuilt ``f`` must reproduce ``t`` bit for bit from the root's
tensor before the record is dropped, once per structure (node types and constants, dtype,
device) when every constant came from a node, and every time when one was read off the
data or a record's own function was applied (either can change from one step to the
next). A module's output (``observe``) is tried the same way while its input is still
alive, and offered like derived.py's outputs, so that the next layer, which saves it
after the input is gone, reads it from the root.

Not rebuilt: broadcasts against non-scalar tensors, dtype conversions, permutes,
reductions, random ops (dropout), two roots (a residual sum, SwiGLU's product of two
projections), roots kept exact or at a floor, the error-bound codec.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memctl.controller.derived import Derived, output_function

__all__ = ["Expression", "Lookup", "build", "is_elementwise"]

Function = Callable[[torch.Tensor], torch.Tensor]
Lookup = Callable[[Any, int], Any]
"""``(node, output number) -> Saved`` of the record whose tensor that output is, else None."""

_LIMIT = 24
"""Most nodes one walk visits."""

_RESHAPES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AliasBackward0"})

_UNARY: dict[str, Function] = {
    "TanhBackward0": torch.tanh,
    "SigmoidBackward0": torch.sigmoid,
    "ExpBackward0": torch.exp,
    "Expm1Backward0": torch.expm1,
    "LogBackward0": torch.log,
    "Log1PBackward0": torch.log1p,
    "NegBackward0": torch.neg,
    "SqrtBackward0": torch.sqrt,
    "RsqrtBackward0": torch.rsqrt,
    "ReciprocalBackward0": torch.reciprocal,
    "ErfBackward0": torch.erf,
    "SinBackward0": torch.sin,
    "CosBackward0": torch.cos,
}
_SCALED = frozenset({"MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1"})
_SUMS = frozenset({"AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "RsubBackward1"})
_ELEMENTWISE = frozenset({*_UNARY, *_SCALED, *_SUMS, "PowBackward0"})


def is_elementwise(node: Any) -> bool:
    """Whether ``node`` is an op a walk starts from (a reshape alone is not)."""
    name = type(node).__name__
    return name in _ELEMENTWISE or output_function(node) is not None


@dataclass(frozen=True, eq=False)
class Expression:
    """``t = fn(root's tensor)``."""

    root: Any
    """The root's ``Saved`` record (a quantised payload)."""
    source: torch.Tensor
    """The root's tensor, alive and unmodified."""
    fn: Function
    """The root's tensor to ``t`` (in ``t``'s shape)."""
    key: tuple[Any, ...]
    """Structure, constants, dtype and device: what a check of ``fn`` holds for."""
    always_check: bool
    """A constant was read off the data or a record's function applied: check every time."""


class _Walk:
    def __init__(self, lookup: Lookup, root_ok: Callable[[Any], torch.Tensor | None]) -> None:
        self.lookup = lookup
        self.root_ok = root_ok
        self.root: Any = None
        self.source: torch.Tensor | None = None
        self.visits = 0
        self.always_check = False

    def record(self, saved: Any) -> tuple[Function, Any] | None:
        """A record as a function of the root."""
        data = saved.data
        if isinstance(data, Derived):
            inner = self.record(data.source)
            if inner is None:
                return None
            self.always_check = True
            g, _ = inner
            f, shape = data.fn, tuple(data.source.shape)
            return (lambda x: f(g(x).reshape(shape))), "record"
        raw = self.root_ok(saved)
        if raw is None or (self.root is not None and saved is not self.root):
            return None
        self.root, self.source = saved, raw
        return (lambda x: x), "root"

    def node(self, node: Any, nr: int, top: bool, target: torch.Tensor | None) -> tuple[Function, Any] | None:
        """``node``'s output ``nr`` as a function of the root's tensor (in some shape of the same size)."""
        self.visits += 1
        if node is None or self.visits > _LIMIT:
            return None
        saved = self.lookup(node, nr)
        if saved is not None and not top:
            return self.record(saved)
        name = type(node).__name__
        edges = node.next_functions
        if name in _RESHAPES:
            return self.node(edges[0][0], edges[0][1], top, target)
        if nr != 0:
            return None
        if name in _UNARY or name == "PowBackward0" or name in ("MulBackward1", "DivBackward1"):
            inner = self.node(edges[0][0], edges[0][1], False, None)
            if inner is None:
                return None
            g, k = inner
            if name in _UNARY:
                u = _UNARY[name]
                return (lambda x: u(g(x))), (name, k)
            c = _scalar(node, "_saved_exponent" if name == "PowBackward0" else "_saved_other")
            if c is None:
                return None
            op = _SCALAR_OPS[name]
            return _right(op, g, c), (name, c, k)
        if name in ("MulBackward0", "DivBackward0"):
            return self._product(node, name, edges)
        if name in _SUMS:
            return self._sum(node, name, edges, top, target)
        f = output_function(node)
        if f is None or len(edges) < 1:
            return None
        inner = self.node(edges[0][0], edges[0][1], False, None)
        if inner is None:
            return None
        g, k = inner
        return (lambda x: f(g(x))), (name, k)

    def _product(self, node: Any, name: str, edges: Any) -> tuple[Function, Any] | None:
        op = _SCALAR_OPS[name]
        a, b = edges[0][0], edges[1][0]
        if a is not None and b is not None:
            left = self.node(a, edges[0][1], False, None)
            right = self.node(b, edges[1][1], False, None) if left is not None else None
            if left is None or right is None:
                return None
            two: Callable[..., torch.Tensor] = torch.mul if name == "MulBackward0" else torch.div
            return _binary(two, left[0], right[0], 1), (name, left[1], right[1])
        if b is None and a is not None:
            c = _scalar(node, "_saved_other")
            inner = self.node(a, edges[0][1], False, None) if c is not None else None
            if inner is None or c is None:
                return None
            g, k = inner
            return _right(op, g, c), (name, "other", c, k)
        if a is None and b is not None and name == "MulBackward0":
            c = _scalar(node, "_saved_self")
            inner = self.node(b, edges[1][1], False, None) if c is not None else None
            if inner is None or c is None:
                return None
            g, k = inner
            return _right(op, g, c), (name, "self", c, k)  # a product: the order does not matter
        return None

    def _sum(self, node: Any, name: str, edges: Any, top: bool,
             target: torch.Tensor | None) -> tuple[Function, Any] | None:
        alpha = _scalar(node, "_saved_alpha")
        if alpha is None:
            return None
        two = len(edges) == 2 and edges[0][0] is not None and edges[1][0] is not None
        if two and name in ("AddBackward0", "SubBackward0"):
            left = self.node(edges[0][0], edges[0][1], False, None)
            right = self.node(edges[1][0], edges[1][1], False, None) if left is not None else None
            if left is None or right is None:
                return None
            op = torch.add if name == "AddBackward0" else torch.sub
            return _binary(op, left[0], right[0], alpha), (name, alpha, left[1], right[1])
        if edges[0][0] is None or target is None or not top:
            return None  # the constant is in no node: read off the data, and only from the packed tensor
        inner = self.node(edges[0][0], edges[0][1], False, None)
        if inner is None or self.source is None:
            return None
        g, k = inner
        c = _constant_from(name, alpha, g(self.source.detach()), target.detach())
        if c is None:
            return None
        self.always_check = True
        if name in ("AddBackward0", "AddBackward1"):
            return (lambda x: torch.add(g(x), c)), (name, alpha, k)
        if name in ("SubBackward0", "SubBackward1"):
            return (lambda x: torch.sub(g(x), c)), (name, alpha, k)
        return (lambda x: torch.rsub(g(x), c, alpha=alpha)), (name, alpha, k)


_SCALAR_OPS: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "PowBackward0": torch.pow, "MulBackward0": torch.mul, "MulBackward1": torch.mul,
    "DivBackward0": torch.div, "DivBackward1": torch.div,
}


def _right(op: Callable[[torch.Tensor, float], torch.Tensor], g: Function, c: float) -> Function:
    return lambda x: op(g(x), c)


def _binary(op: Callable[..., torch.Tensor], f: Function, g: Function, alpha: float) -> Function:
    """``op(f(x), g(x))``, the second operand in the first's shape (both have the root's size)."""
    def apply(x: torch.Tensor) -> torch.Tensor:
        a, b = f(x), g(x)
        if b.shape != a.shape:
            b = b.reshape(a.shape)
        return op(a, b) if alpha == 1 else op(a, b, alpha=alpha)

    return apply


def _scalar(node: Any, name: str) -> float | None:
    """A scalar the node keeps: a Python number, or a one-value tensor (read as a number)."""
    try:
        value = getattr(node, name)
    except (AttributeError, RuntimeError):
        return None
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.requires_grad \
            and value.is_floating_point():
        return float(value.item())
    return None


def _constant_from(name: str, alpha: float, u: torch.Tensor, t: torch.Tensor) -> float | None:
    """The constant ``c`` of ``t = u + c`` (``u − c``, ``c − u``) that reproduces every value of
    ``t``, else None. Candidates are read where ``|u|`` is smallest (the sum rounds least there):
    the float32 nearest the difference, and its neighbours, as the sum may have rounded by one unit."""
    if u.numel() != t.numel() or u.numel() == 0 or alpha != 1 or not u.dtype.is_floating_point:
        return None
    u, t = u.reshape(-1), t.reshape(-1)
    at = u.abs().argsort()[:4]
    ud, td = u[at].double(), t[at].double()
    if name in ("AddBackward0", "AddBackward1"):
        diff = td - ud
    else:
        diff = ud - td if name != "RsubBackward1" else td + ud
    near = diff.to(u.dtype)
    tried: set[float] = set()
    up, down = torch.nextafter(near, near + 1), torch.nextafter(near, near - 1)
    for c in (*near.tolist(), *up.tolist(), *down.tolist()):
        if c in tried or not math.isfinite(c):
            continue
        tried.add(c)
        if name in ("AddBackward0", "AddBackward1"):
            rebuilt = torch.add(u, c)
        elif name in ("SubBackward0", "SubBackward1"):
            rebuilt = torch.sub(u, c)
        else:
            rebuilt = torch.rsub(u, c)
        if torch.equal(rebuilt, t):
            return c
    return None


def build(t: torch.Tensor, lookup: Lookup,
          root_ok: Callable[[Any], torch.Tensor | None]) -> Expression | None:
    """``t`` as an :class:`Expression` of one root record, or None (NOTE [ Elementwise expressions ])."""
    node = t.grad_fn
    if node is None:
        return None
    walk = _Walk(lookup, root_ok)
    found = walk.node(node, int(t.output_nr), True, t)
    if found is None or walk.root is None or walk.source is None:
        return None
    g, key = found
    source = walk.source
    if source.numel() != t.numel():
        return None
    shape = t.shape
    return Expression(walk.root, source, lambda x: g(x).reshape(shape),
                      (key, t.dtype, t.device.type), walk.always_check)
