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
this forward: a quantised record whose tensor is still alive (a *root*), or a record
already rebuilt this way or by derived.py (its own function is applied, on top of its
roots; when those are gone but its own tensor is alive, it is a root itself, decoded
through its own function). If every path ends at one or two roots of ``t``'s size, ``t``
is ``f(x)`` (or ``f(x, z)``) and its record keeps no payload (a ``Derived`` of the
roots); its bits go to a root, as in derived.py: the width of the quantised root with
the fewest bits grows by the record's bits (within the codec's widths, at most 8, and
no wider than the bytes the two records held: an 8-bit record's groups cost more, NOTE [
Eight-bit groups ] in the quantize codec; where that holds the root at no more than the
record's own bits, 4 + 4, the record keeps its own payload; so it does where every root is
a rebuilt record whose own root is no wider than the record), so the bytes are at most
those of the separate records, and lower where the widths are capped. For
``gelu_new`` at 2 bits the five records of 2 bits (10 bits per value) become one of 8.
SwiGLU's ``silu(gate)·up``, which the next linear layer saves, is read from the gate's
and the up projection's records: the same bytes, and on a 2-bit test MLP the gradients'
error falls from 1.2 to 0.16 of their norm. Each rebuilt record counts as one more
reader of its roots (NOTE [ One decode for several readers ]), so the backward decodes a
root once for all the records read from it.

A product's operands are usually gone by the time the next layer saves it (Python drops
the temporaries of ``a * b`` once the product exists), so the packer holds the last two
floating-point tensors it recorded until two more are recorded (:data:`_RECENT` in
packing.py; at most two tensors held a few ops longer than PyTorch would, as for the
offers of derived.py).

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
alive, and kept with its roots' tensors (at most two outputs, as for derived.py's
offers), so that the next layer, which saves it (or a reshape of it) after the input is
gone, reads it from the roots.

Cost: a check is a recomputation of ``f`` and a comparison (on CUDA, a device-to-host
read: GPT-2's ``gelu_new`` checks three records per layer and step, because ``1 + tanh``
takes its constant off the data; not measured on a GPU). A walk that rebuilds nothing
is ~10 µs of Python (a GRU packs ~600 tensors a step whose walks all fail: 6 ms of a
260 ms step). The packer keys each walk by the shape of the graph at the tensor (its
node's op and its inputs' ops); once a shape has missed four times and never been
rebuilt, only one walk in 64 is tried for it (:data:`_MISSES`, :data:`_RETRY` in
packing.py), which took the GRU's walks to 1.7 ms a step. Skipping a walk only keeps a
tensor's own record.

Not rebuilt: broadcasts against non-scalar tensors, dtype conversions, permutes,
reductions, random ops (dropout), three or more roots, roots of another size than the
tensor, roots kept exact or at a floor, the error-bound codec.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memctl.controller.derived import RESHAPES, Derived, output_function

__all__ = ["Expression", "Lookup", "build", "is_elementwise"]

Function = Callable[[torch.Tensor], torch.Tensor]
Roots = tuple[torch.Tensor, ...]
Rebuild = Callable[[Roots], torch.Tensor]
Lookup = Callable[[Any, int], Any]
"""``(node, output number) -> Saved`` of the record whose tensor that output is, else None."""

_LIMIT = 24
"""Most nodes one walk visits."""
_ROOTS = 2
"""Most roots of one expression."""

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
_SHIFTS: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "AddBackward0": torch.add, "AddBackward1": torch.add, "SubBackward0": torch.sub,
    "SubBackward1": torch.sub, "RsubBackward1": torch.rsub,
}
"""The sums and differences walked, by node: the op that applies one to a tensor and a constant."""
_SUMS = frozenset(_SHIFTS)
_ELEMENTWISE = frozenset({*_UNARY, *_SCALED, *_SUMS, "PowBackward0"})


def is_elementwise(node: Any) -> bool:
    """Whether ``node`` is an op a walk starts from (a reshape alone is not)."""
    name = type(node).__name__
    return name in _ELEMENTWISE or output_function(node) is not None


@dataclass(frozen=True, eq=False)
class Expression:
    """``t = fn(roots' tensors)``."""

    roots: tuple[Any, ...]
    """The roots' ``Saved`` records (quantised payloads), one or two."""
    sources: Roots
    """The roots' tensors, alive and unmodified."""
    fn: Rebuild
    """The roots' tensors (or decoded values) to ``t`` (in ``t``'s shape)."""
    key: tuple[Any, ...]
    """Structure, constants, dtype and device: what a check of ``fn`` holds for."""
    always_check: bool
    """A constant was read off the data or a record's function applied: check every time."""
    checked: bool = False
    """Already checked on this data: the packed tensor is ``c`` shifted from the rest, and ``c`` was
    found by reproducing every one of its values."""


class _Walk:
    def __init__(self, lookup: Lookup, root_ok: Callable[[Any], torch.Tensor | None]) -> None:
        self.lookup = lookup
        self.root_ok = root_ok
        self.roots: list[Any] = []
        self.sources: list[torch.Tensor] = []
        self.visits = 0
        self.always_check = False
        self.checked = False

    def record(self, saved: Any) -> tuple[Rebuild, Any] | None:
        """A record as a function of the roots."""
        data = saved.data
        for i, root in enumerate(self.roots):
            if root is saved:
                return _root(i), ("root", i)
        if isinstance(data, Derived):
            roots, sources, always = list(self.roots), list(self.sources), self.always_check
            inputs = []
            for part in (data.source, *data.others):
                inner = self.record(part)
                if inner is None:
                    break
                inputs.append((inner[0], tuple(part.shape)))
            else:
                self.always_check = True
                return _applied(data.fn, inputs), "record"
            # its inputs are gone: the rebuilt record itself is a root, while its tensor is alive
            self.roots, self.sources, self.always_check = roots, sources, always
        raw = self.root_ok(saved)
        if raw is None or len(self.roots) == _ROOTS:
            return None
        if self.sources and raw.numel() != self.sources[0].numel():
            return None
        self.roots.append(saved)
        self.sources.append(raw)
        return _root(len(self.roots) - 1), ("root", len(self.roots) - 1)

    def node(self, node: Any, nr: int, top: bool, target: torch.Tensor | None) -> tuple[Rebuild, Any] | None:
        """``node``'s output ``nr`` as a function of the roots' tensors (in some shape of the same size)."""
        self.visits += 1
        if node is None or self.visits > _LIMIT:
            return None
        saved = self.lookup(node, nr)
        if saved is not None and not top:
            return self.record(saved)
        name = type(node).__name__
        edges = node.next_functions
        if name in RESHAPES:
            return self.node(edges[0][0], edges[0][1], top, target)
        if nr != 0:
            return None
        if name in _UNARY or name == "PowBackward0" or name in ("MulBackward1", "DivBackward1"):
            inner = self.node(edges[0][0], edges[0][1], False, None)
            if inner is None:
                return None
            g, k = inner
            if name in _UNARY:
                return _then(_UNARY[name], g), (name, k)
            c = scalar_of(node, "_saved_exponent" if name == "PowBackward0" else "_saved_other")
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
        return _then(f, g), (name, k)

    def _product(self, node: Any, name: str, edges: Any) -> tuple[Rebuild, Any] | None:
        op = _SCALAR_OPS[name]
        a, b = edges[0][0], edges[1][0]
        if a is not None and b is not None:
            left = self.node(a, edges[0][1], False, None)
            right = self.node(b, edges[1][1], False, None) if left is not None else None
            if left is None or right is None:
                return None
            return _binary(op, left[0], right[0], 1), (name, left[1], right[1])
        if b is None and a is not None:
            c = scalar_of(node, "_saved_other")
            inner = self.node(a, edges[0][1], False, None) if c is not None else None
            if inner is None or c is None:
                return None
            g, k = inner
            return _right(op, g, c), (name, "other", c, k)
        if a is None and b is not None and name == "MulBackward0":
            c = scalar_of(node, "_saved_self")
            inner = self.node(b, edges[1][1], False, None) if c is not None else None
            if inner is None or c is None:
                return None
            g, k = inner
            return _right(op, g, c), (name, "self", c, k)  # a product: the order does not matter
        return None

    def _sum(self, node: Any, name: str, edges: Any, top: bool,
             target: torch.Tensor | None) -> tuple[Rebuild, Any] | None:
        alpha = scalar_of(node, "_saved_alpha")
        if alpha is None:
            return None
        two = len(edges) == 2 and edges[0][0] is not None and edges[1][0] is not None
        if two and name in ("AddBackward0", "SubBackward0"):
            left = self.node(edges[0][0], edges[0][1], False, None)
            right = self.node(edges[1][0], edges[1][1], False, None) if left is not None else None
            if left is None or right is None:
                return None
            return _binary(_SHIFTS[name], left[0], right[0], alpha), (name, alpha, left[1], right[1])
        if edges[0][0] is None or target is None or not top:
            return None  # the constant is in no node: read off the data, and only from the packed tensor
        inner = self.node(edges[0][0], edges[0][1], False, None)
        if inner is None or not self.sources:
            return None
        g, k = inner
        c = _constant_from(name, alpha, g(tuple(s.detach() for s in self.sources)), target.detach())
        if c is None:
            return None
        self.always_check = True
        self.checked = True  # the constant reproduced every value of the packed tensor: the whole check
        return _right(_SHIFTS[name], g, c), (name, alpha, k)


_SCALAR_OPS: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "PowBackward0": torch.pow, "MulBackward0": torch.mul, "MulBackward1": torch.mul,
    "DivBackward0": torch.div, "DivBackward1": torch.div,
}


def _root(i: int) -> Rebuild:
    return lambda xs: xs[i]


def _then(u: Function, g: Rebuild) -> Rebuild:
    return lambda xs: u(g(xs))


def _applied(f: Callable[..., torch.Tensor], inputs: list[tuple[Rebuild, tuple[int, ...]]]) -> Rebuild:
    """A rebuilt record's own function, on its inputs rebuilt from the roots."""
    return lambda xs: f(*(g(xs).reshape(shape) for g, shape in inputs))


def _right(op: Callable[[torch.Tensor, float], torch.Tensor], g: Rebuild, c: float) -> Rebuild:
    return lambda xs: op(g(xs), c)


def _binary(op: Callable[..., torch.Tensor], f: Rebuild, g: Rebuild, alpha: float) -> Rebuild:
    """``op(f(xs), g(xs))``, the second operand in the first's shape (both have the roots' size)."""
    def apply(xs: Roots) -> torch.Tensor:
        a, b = f(xs), g(xs)
        if b.shape != a.shape:
            b = b.reshape(a.shape)
        return op(a, b) if alpha == 1 else op(a, b, alpha=alpha)

    return apply


def scalar_of(node: Any, name: str) -> float | None:
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
    known = _KNOWN.setdefault((name, u.dtype), [])
    for c in known:  # a constant found before (GELU's 1 + tanh(...)): one check, no sort, no read-back
        if torch.equal(_SHIFTS[name](u, c), t):
            return c
    found = _search_constant(name, u, t)
    if found is not None:
        known.insert(0, found)
        del known[_MOST_KNOWN:]
    return found


_KNOWN: dict[tuple[str, torch.dtype], list[float]] = {}
"""Constants found by :func:`_constant_from`, by node name and dtype, the latest first: a
model adds the same few constants every step, and the search sorts the tensor and reads
candidates back (three waits for a GPU, four with the check: 17 a step of GPT-2's default
policy on an H200), where a known constant takes one check."""
_MOST_KNOWN = 4


def _search_constant(name: str, u: torch.Tensor, t: torch.Tensor) -> float | None:
    """:func:`_constant_from`'s search over candidates read off the data (flat ``u`` and ``t``)."""
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
        if torch.equal(_SHIFTS[name](u, c), t):
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
    if found is None or not walk.roots or walk.sources[0].numel() != t.numel():
        return None
    g, key = found
    shape = t.shape
    return Expression(tuple(walk.roots), tuple(walk.sources), lambda xs: g(xs).reshape(shape),
                      (key, t.dtype, t.device.type), walk.always_check, walk.checked)
