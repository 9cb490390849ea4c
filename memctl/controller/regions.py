"""Exact derivative regions of piecewise activations: which saved values must keep their branch.

NOTE [ Derivative regions ]
Many ops' backward branches on the tensor they saved: ReLU reads ``result > 0``,
hardtanh (and ReLU6) ``min_val < self < max_val``, leaky_relu ``self > 0``, clamp
``min <= self <= max``, hardswish three branches split at -3 and 3, abs the sign of
``self``. Quantising that tensor moves values across the thresholds and so picks the
wrong branch: at 2 bits, a large share of small values land on the wrong side, and
the gradient through them is lost or doubled. For every op of :data:`_RULES` the saved
tensor therefore also keeps a lossless region code (the index of the branch each value
takes, one bit plane per bit, 1 or 2 bits per value, bit-packed by the ``lossless``
codec), and decoding moves every value to the nearest point of its true region (a
union of intervals whose boundaries belong where the op's backward puts them). The
backward then takes, value by value, the branch it would have taken on the original;
the values inside a region keep the codec's (unbiased) error.

The boundaries follow torch 2.13's CPU kernels (``derivatives.yaml`` and the backward
kernels it names), checked value by value against torch's own gradients in the tests:

    op (autograd node)                 saved   branch test of the backward
    relu                ReluBackward0   result  result > 0
    threshold(th, v)    ThresholdBackward0/1  self  self > th
    hardtanh, relu6     HardtanhBackward0      self  min < self < max
    leaky_relu(s)       LeakyReluBackward0/1   self/result  > 0
    rrelu (eval)        RreluWithNoiseBackward0/1  self/result  > 0
    clamp, clip         ClampBackward1 (Scalar bounds)  self  min <= self <= max
    clamp_min/max       ClampMinBackward0, ClampMaxBackward0  self  >= min / <= max
    hardswish           HardswishBackward0     self  <= -3 | (-3, 3) | >= 3
    hardsigmoid         HardsigmoidBackward0   self  -3 < self < 3
    prelu               PreluKernelBackward0   self  self > 0
    elu, selu           EluBackward0/1         self/result  <= 0
    celu                CeluBackward0/1        self/result  <= 0
    abs                 AbsBackward0           self  < 0 | == 0 | > 0
    hardshrink          HardshrinkBackward0    self  -l <= self <= l
    softshrink          SoftshrinkBackward0    self  -l <= self <= l

Left alone: ops whose branch compares two tensors (maximum, minimum, fmax, fmin, max,
min, amax, the L1/Huber losses), clamp with tensor bounds, softplus (its branch at
``beta·x > threshold`` changes the derivative by less than 1e-8), sgn/sign (zero
gradient), nan_to_num (finiteness, which the codecs keep), and rrelu in training mode
(its backward reads the saved noise, not the sign).

NOTE [ Finding the op that saved a tensor ]
An op that saves its *result* is recognised when the result is packed: its ``grad_fn``
is the op's node. An op that saves its *input* packs it before its output (and its
node) exist, so the pack hook cannot know yet who is saving. :class:`RegionTracker`
therefore keeps the most recent :data:`PENDING` packed inputs (strong references, so a
temporary such as a BatchNorm output is still readable), keyed by their autograd
identity ``(grad_fn, output_nr)``. Each later pack walks a few steps up the graph from
the packed tensor's ``grad_fn``; a node of the table whose first input edge is a
pending key has saved that pending tensor, and its region code is computed then, from
the original values. The in-place forms (``hardtanh_``, ``clamp_``, ...) save a clone,
whose ``CloneBackward0`` edge leads to the input's key. A pending tensor modified in
place since it was packed is skipped. What is never matched (an output nothing saves
within the window) keeps today's path: quantised values, no region code.

NOTE [ Releasing inputs early ]
The pending inputs are strong references to full-precision tensors, so until they are
released the forward's peak holds them besides the compressed records: with the window
filled by inputs of convolutions and linear layers (never matched: they are not table
ops), a 4-block CNN peaked at 123 MiB in the forward against 14 MiB held after it, and
plain PyTorch's 171 MiB (CPU, resident set). So a walk that meets the op that consumed a
pending input, and that op is outside the table, drops the entry at once; so does
:class:`~memctl.controller.floors.FloorTracker` for its recent records. A view, a copy
a matrix product or a batch norm does not release (:data:`HOLDING`): the tensor lives on
in it, the product may be an attention's, and a batch norm's input may become the root of
its output's record (NOTE [ Batch-norm outputs recomputed from the input ]). An input
that one op consumes without saving it and a later table op saves again is noted again by
that op's pack (the de-duplicated record is re-noted), unless the walk from an unrelated
tensor found the first consumer in between: then it keeps the quantised values without a
region code, the path of an unmatched input. With the release the same CNN peaks at
96 MiB: what is left is two batch-norm inputs and two normalised tensors kept for the
batch-norm chains, and the block's own working set.

NOTE [ Walking only newer nodes ]
The walk runs for every packed tensor, so it must be short. Autograd numbers the nodes
it creates in one thread in creation order (``_sequence_nr()``), and a node's inputs are
created before it. The op that saved a pending input consumed that input's node, so it
was created after it: a node numbered below every pending input's node cannot be that
op, and neither can any node above it, so the walk does not go past it. Most of a walk
is then the few nodes created since the last packs. A forward that creates nodes in
several threads numbers each thread's nodes apart; a node from another thread may then
be skipped, and its input keeps the codec's values without a region code (the path of
an unmatched input), never a wrong one.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from memctl.codecs import channels
from memctl.codecs.base import mask_floor
from memctl.controller import floors
from memctl.controller.derived import DerivableOutputs, reshaped_from
from memctl.controller.normalized import BATCH_NORM
from memctl.controller.walks import QuietWalks

__all__ = ["HOLDING", "PENDING", "RELU", "SMOOTH", "Interval", "Partition", "RegionCode", "RegionTracker",
           "result_partition"]

PENDING = 2
"""How many recently packed inputs wait for the op that saved them (NOTE [ Finding ... ])."""

HOLDING = floors.HOLDING | BATCH_NORM
"""Nodes whose consumption of a pending input does not release it (NOTE [ Releasing inputs early ]):
the bit floors' (views and copies pass the tensor on; a matrix product may be an attention's,
which the floors recognise only once its softmax shows up), and batch norms, whose input may
become their output's record."""

_WALK_DEPTH = 3
_WALK_NODES = 24
_INF = math.inf


@dataclass(frozen=True)
class Interval:
    """Values ``lo (<|<=) x (<|<=) hi`` take branch ``code``."""

    lo: float
    hi: float
    lo_open: bool
    hi_open: bool
    code: int

    def contains(self, x: torch.Tensor) -> torch.Tensor:
        inside = None
        if self.lo > -_INF:
            inside = (x > self.lo) if self.lo_open else (x >= self.lo)
        if self.hi < _INF:
            below = (x < self.hi) if self.hi_open else (x <= self.hi)
            inside = below if inside is None else inside.logical_and_(below)
        return torch.ones_like(x, dtype=torch.bool) if inside is None else inside

    def clamp(self, v: torch.Tensor) -> torch.Tensor:
        """The nearest point of the interval (in ``v``'s dtype) to each value of ``v``."""
        lo = _inner(self.lo, +1.0, v) if self.lo_open and self.lo > -_INF else self.lo
        hi = _inner(self.hi, -1.0, v) if self.hi_open and self.hi < _INF else self.hi
        return v.clamp(min=None if lo == -_INF else lo, max=None if hi == _INF else hi)


def _inner(bound: float, direction: float, like: torch.Tensor) -> float:
    """The first value of ``like``'s dtype strictly beyond ``bound`` towards ``direction``.

    Zero steps to ``mask_floor`` (a normal number, so that a flush-to-zero of subnormals
    cannot move a value back onto the boundary, and large enough that its products stay
    normal: NOTE [ Mask floor ] in ``memctl/codecs/base.py``).
    """
    if bound == 0.0:
        return direction * mask_floor(like.dtype)
    b = torch.tensor(bound, dtype=like.dtype)
    return float(torch.nextafter(b, torch.tensor(direction * _INF, dtype=like.dtype)))


@dataclass(frozen=True)
class Partition:
    """One op's branches over the values of the tensor it saved (NOTE [ Derivative regions ])."""

    op: str
    intervals: tuple[Interval, ...]

    @functools.cached_property
    def bits(self) -> int:
        """Bit planes of the code (computed once: read for every record that has one)."""
        codes = 1 + max(iv.code for iv in self.intervals)
        return 1 if codes <= 2 else 2

    @functools.cached_property
    def positive_plane(self) -> bool:
        """Whether the code is one bit plane, ``x > 0`` (ReLU's, leaky_relu's, ...)."""
        positive = Interval(0.0, _INF, True, False, 1)
        return self.bits == 1 and [iv for iv in self.intervals if iv.code == 1] == [positive]

    def nbytes(self, numel: int) -> int:
        """Bytes of the bit-packed code of ``numel`` values."""
        return self.bits * -(-numel // 8)

    def codes(self, x: torch.Tensor) -> torch.Tensor:
        """The branch of each value of ``x`` (uint8; 0 for NaN)."""
        out = torch.zeros_like(x, dtype=torch.uint8)
        for iv in self.intervals:
            if iv.code:
                out.masked_fill_(iv.contains(x), iv.code)
        return out

    def _two_intervals(self) -> tuple[Interval, Interval] | None:
        """The partition's intervals of code 0 and 1, when it has exactly one of each."""
        if len(self.intervals) != 2:
            return None
        a, b = self.intervals
        if {a.code, b.code} != {0, 1}:
            return None
        return (a, b) if a.code == 0 else (b, a)

    def planes(self, x: torch.Tensor) -> Iterator[torch.Tensor]:
        """The code's bit planes (bool tensors), lowest bit first."""
        if self.bits == 1:  # one plane: where any interval of code 1 holds (ReLU's x > 0)
            plane = None
            for iv in self.intervals:
                if iv.code == 1:
                    inside = iv.contains(x)
                    plane = inside if plane is None else plane.logical_or_(inside)
            yield plane if plane is not None else torch.zeros_like(x, dtype=torch.bool)
            return
        code = self.codes(x)
        for bit in range(self.bits):
            yield (code >> bit) & 1 == 1

    def packed_plane(self, x: torch.Tensor) -> torch.Tensor | None:
        """The one plane of a 1-bit partition whose code 1 is one interval, bit-packed straight from
        ``x`` as the ``lossless`` codec lays it out (NOTE [ Fused channel passes ]); None otherwise."""
        if self.bits != 1:
            return None
        ones = [iv for iv in self.intervals if iv.code == 1]
        if len(ones) != 1:
            return None
        iv = ones[0]
        # An infinite bound is no test (Interval.contains): closed, it holds for every non-NaN value.
        lo_open, hi_open = iv.lo_open and iv.lo > -_INF, iv.hi_open and iv.hi < _INF
        return channels.interval_bits(x, iv.lo, iv.hi, lo_open, hi_open)

    def project(self, v: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        """Each value of ``v`` moved to the nearest point of the region its ``code`` names.

        ``code`` is the uint8 branch index, or, for a 1-bit partition, its one bool plane.
        """
        codes = [iv.code for iv in self.intervals]
        if code.dtype is torch.bool:
            two = self._two_intervals()
            if two is not None:
                # NOTE [ One-plane projection ]
                # A 1-bit code with one interval per code (ReLU's result, leaky_relu, threshold,
                # the one-sided clamps) moves each value with one select between the two
                # clamped copies, reading the decoded bool plane as it is: no uint8 code is
                # built and no per-code comparison is made (five passes over the tensor fewer).
                # NaN stays NaN: both clamps keep it. When the code-0 region is the single
                # point 0 (ReLU's result), the select is a product with the plane, which
                # PyTorch's CPU kernels run about 3x faster than ``torch.where``; NaN * 0 is
                # still NaN. The product differs from the select only for a value decoded as
                # +inf where the original was <= 0, which no codec returns: each decodes a
                # finite value finite and puts a non-finite one back as it was.
                low, high = two
                if low.lo == low.hi == 0.0 and not (low.lo_open or low.hi_open):
                    return high.clamp(v).mul_(code)
                return torch.where(code, high.clamp(v), low.clamp(v))
            code = code.to(torch.uint8)
        if len(set(codes)) == len(codes):  # one interval per code: no nearest-of-two choice
            out = v
            for iv in self.intervals:
                out = torch.where(code == iv.code, iv.clamp(v), out)
            return out
        out = v.clone()
        best = torch.full_like(v, _INF)
        for iv in self.intervals:
            c = iv.clamp(v)
            dist = (c - v).abs().masked_fill_(code != iv.code, _INF)
            closer = dist < best
            out = torch.where(closer, c, out)
            best = torch.where(closer, dist, best)
        return torch.where(torch.isnan(v), v, out)


def _two(op: str, cut: float, low_closed: bool, low: int = 0, high: int = 1) -> Partition:
    """``x <= cut`` (``low_closed``) or ``x < cut`` takes ``low``; the rest ``high``."""
    return Partition(op, (Interval(-_INF, cut, False, not low_closed, low),
                          Interval(cut, _INF, low_closed, False, high)))


def _inside(op: str, lo: float, hi: float, closed: bool) -> Partition:
    """Values inside ``[lo, hi]`` (``closed``) or ``(lo, hi)`` take 1, the rest 0."""
    return Partition(op, (Interval(-_INF, lo, False, closed, 0), Interval(lo, hi, not closed, not closed, 1),
                          Interval(hi, _INF, closed, False, 0)))


def _hardtanh(node: Any) -> Partition:
    return _inside("hardtanh", float(node._saved_min_val), float(node._saved_max_val), closed=False)


def _threshold(node: Any) -> Partition:
    return _two("threshold", float(node._saved_threshold), low_closed=True)


def _positive(op: str) -> Callable[[Any], Partition]:
    return lambda node: _two(op, 0.0, low_closed=True)


def _rrelu(node: Any) -> Partition | None:
    if bool(node._saved_training) and float(node._saved_upper) - float(node._saved_lower) > 1e-6:
        return None
    return _two("rrelu", 0.0, low_closed=True)


def _clamp(node: Any) -> Partition | None:
    lo, hi = node._saved_min, node._saved_max
    if isinstance(lo, torch.Tensor) or isinstance(hi, torch.Tensor):
        return None
    if lo is not None and hi is not None:
        return _inside("clamp", float(lo), float(hi), closed=True)
    if lo is not None:
        return _two("clamp", float(lo), low_closed=False)
    if hi is not None:
        return _two("clamp", float(hi), low_closed=True, low=1, high=0)
    return None


def _clamp_min(node: Any) -> Partition:
    return _two("clamp_min", float(node._saved_min), low_closed=False)


def _clamp_max(node: Any) -> Partition:
    return _two("clamp_max", float(node._saved_max), low_closed=True, low=1, high=0)


def _hardswish(node: Any) -> Partition:
    return Partition("hardswish", (Interval(-_INF, -3.0, False, False, 0), Interval(-3.0, 3.0, True, True, 1),
                                   Interval(3.0, _INF, False, False, 2)))


def _hardsigmoid(node: Any) -> Partition:
    return _inside("hardsigmoid", -3.0, 3.0, closed=False)


def _abs(node: Any) -> Partition:
    return Partition("abs", (Interval(-_INF, 0.0, False, True, 0), Interval(0.0, 0.0, False, False, 1),
                             Interval(0.0, _INF, True, False, 2)))


def _shrink(op: str) -> Callable[[Any], Partition]:
    def rule(node: Any) -> Partition:
        lam = float(node._saved_lambd)
        return Partition(op, (Interval(-_INF, -lam, False, True, 1), Interval(-lam, lam, False, False, 0),
                              Interval(lam, _INF, True, False, 1)))

    return rule


_RELU = Partition("relu", (Interval(0.0, 0.0, False, False, 0), Interval(0.0, _INF, True, False, 1)))
#: ReLU's partition: its code is the quantize codec's decode mask (NOTE [ Masked decode ]).
RELU = _RELU

# grad_fn name -> how to read the node's partition; saved tensor: the op's input.
_SELF_RULES: dict[str, Callable[[Any], Partition | None]] = {
    "ThresholdBackward0": _threshold,
    "ThresholdBackward1": _threshold,
    "HardtanhBackward0": _hardtanh,
    "LeakyReluBackward0": _positive("leaky_relu"),
    "RreluWithNoiseBackward0": _rrelu,
    "ClampBackward1": _clamp,
    "ClampMinBackward0": _clamp_min,
    "ClampMaxBackward0": _clamp_max,
    "HardswishBackward0": _hardswish,
    "HardsigmoidBackward0": _hardsigmoid,
    "PreluKernelBackward0": _positive("prelu"),
    "EluBackward0": _positive("elu"),
    "CeluBackward0": _positive("celu"),
    "AbsBackward0": _abs,
    "HardshrinkBackward0": _shrink("hardshrink"),
    "SoftshrinkBackward0": _shrink("softshrink"),
}

# grad_fn name -> partition; saved tensor: the op's result (recognised by its own grad_fn).
_RESULT_RULES: dict[str, Callable[[Any], Partition | None]] = {
    "ReluBackward0": lambda node: _RELU,
    "ReluBackward1": lambda node: _RELU,
    "LeakyReluBackward1": _positive("leaky_relu"),
    "RreluWithNoiseBackward1": _rrelu,
    "EluBackward1": _positive("elu"),
    "CeluBackward1": _positive("celu"),
}


# Smooth ops that save their input: no branch to keep, but their output can be recomputed from
# it (NOTE [ Outputs recomputed from the input ] in derived.py), so they are matched as well.
SMOOTH = frozenset({"SiluBackward0", "GeluBackward0", "MishBackward0"})


def result_partition(node: Any) -> Partition | None:
    """The partition of a tensor whose own ``grad_fn`` saves it as its result (else None)."""
    if node is None:
        return None
    rule = _RESULT_RULES.get(type(node).__name__)
    return None if rule is None else _safe(rule, node)


def input_partition(node: Any) -> Partition | None:
    """The partition of the input a table op's node saved (None for other nodes)."""
    rule = _SELF_RULES.get(type(node).__name__)
    return None if rule is None else _safe(rule, node)


def _safe(rule: Callable[[Any], Partition | None], node: Any) -> Partition | None:
    try:
        return rule(node)
    except (AttributeError, RuntimeError, TypeError, ValueError):  # a node without the field
        return None


@dataclass(frozen=True, eq=False)
class RegionCode:
    """A tensor's branch codes under one partition: its bit planes, each bit-packed."""

    partition: Partition
    planes: tuple[Any, ...]
    """``Packed`` records of the lossless codec, lowest bit first."""

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.planes)


_Key = tuple[int, int]


@dataclass(slots=True)
class _Pending:
    source: torch.Tensor
    version: int
    node: Any
    saved: weakref.ref[Any]
    """Weak: a record autograd has dropped must die (NOTE [ Micro-batches ] tracks liveness)."""
    layer: str
    op: Any = None
    """The table op's node, once matched."""


class RegionTracker:
    """Matches packed inputs with the table op that saved them (NOTE [ Finding ... ])."""

    def __init__(self) -> None:
        self._pending: dict[_Key, _Pending] = {}
        self.walks = QuietWalks()
        """How far packs walk in this forward (NOTE [ Walks that find nothing ] in walks.py)."""
        self.outputs = DerivableOutputs()
        """Matched ops whose output may be recomputed (NOTE [ Outputs recomputed from the input ])."""

    def clear(self) -> None:
        self._pending.clear()
        self.outputs.clear()

    def note(self, t: torch.Tensor, saved: Any, layer: str, node: Any) -> None:
        """Remember a packed float tensor (of autograd node ``node``, its ``grad_fn``) as a
        possible input of a table op."""
        if node is None:
            return
        self.walks.packed()
        key: _Key = (id(node), int(t.output_nr))
        if type(node).__name__ == "CloneBackward0":  # what an in-place op saves: a clone
            parent, nr = node.next_functions[0]
            if parent is not None:
                node, key = parent, (id(parent), int(nr))
        self._pending.pop(key, None)
        self._pending[key] = _Pending(t, t._version, node, weakref.ref(saved), layer)
        while len(self._pending) > PENDING:
            del self._pending[next(iter(self._pending))]

    def pending(self, key: _Key, node: Any) -> _Pending | None:
        """The pending input packed under ``key`` (autograd node ``node``), unmodified since, else None."""
        hit = self._pending.get(key)
        if hit is None or hit.node is not node or hit.source._version != hit.version:
            return None
        return hit

    def matches(self, t: torch.Tensor, node: Any) -> list[tuple[_Pending, Partition | None]]:
        """Pending inputs whose table op lies within a few steps above ``t``'s ``grad_fn``,
        ``node`` (with no partition for the smooth ops of :data:`SMOOTH`)."""
        if not self._pending or node is None:
            return []
        found: list[tuple[_Pending, Partition | None]] = []
        if not self.walks.walking:  # NOTE [ Walks that find nothing ]: the tensor's own node only
            node = reshaped_from(t)[0]
            if node is not None:
                self._visit(node, found)
        else:
            frontier: list[Any] = [node]
            seen: dict[int, Any] = {}  # the nodes too: a freed node's id can name another (floors.py)
            # NOTE [ Walking only newer nodes ]: a node older than every pending input's node
            # (and so all of its inputs) cannot have consumed one.
            oldest = min(p.node._sequence_nr() for p in self._pending.values())
            for _ in range(_WALK_DEPTH + 1):
                nxt: list[Any] = []
                for node in frontier:
                    if id(node) in seen or len(seen) >= _WALK_NODES:
                        continue
                    seen[id(node)] = node
                    if node._sequence_nr() < oldest:
                        continue
                    nxt.extend(e[0] for e in self._visit(node, found) if e[0] is not None)
                if not nxt or not self._pending:
                    break
                frontier = nxt
        if found:
            self.walks.found()
        return found

    def _visit(self, node: Any, found: list[tuple[_Pending, Partition | None]]) -> Any:
        """Match (into ``found``) or release the pending input ``node`` consumed; its edges."""
        edges = node.next_functions
        name = type(node).__name__
        if (name in _SELF_RULES or name in SMOOTH) and edges and edges[0][0] is not None:
            hit = self._pending.get((id(edges[0][0]), int(edges[0][1])))
            if hit is not None and hit.node is edges[0][0]:
                part = input_partition(node)
                del self._pending[(id(edges[0][0]), int(edges[0][1]))]
                if (part is not None or name in SMOOTH) and hit.source._version == hit.version:
                    hit.op = node
                    found.append((hit, part))
        elif name not in HOLDING:
            self._release(edges)
        return edges

    def _release(self, edges: Any) -> None:
        """Drop the pending inputs an op outside the table consumed (NOTE [ Releasing inputs early ])."""
        for parent, nr in edges:
            if parent is not None:
                hit = self._pending.get((id(parent), int(nr)))
                if hit is not None and hit.node is parent:
                    del self._pending[(id(parent), int(nr))]
