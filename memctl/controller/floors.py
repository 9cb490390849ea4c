"""Bit floors for the tensors that named autograd ops save, whatever their layer's bits.

NOTE [ Bit floors ]
Some saved tensors cannot take the few bits the allocation gives their layer, because
of what the op's backward does with them, not because of their layer:

- ``scaled_dot_product_attention`` saves query, key, value, its output and the
  logsumexp of each row of logits (the CPU flash kernel; the CUDA kernels save the
  same plus random-number state). Its backward recomputes the probabilities as
  ``exp(q·kᵀ·scale − logsumexp)`` from the saved query and key: with 2-bit query and key
  a logit can exceed the saved logsumexp by several units, and the exponential turns
  that into probabilities far above 1, a heavy-tailed error that no variance model
  predicts. Keeping these tensors exact took a byte-level transformer LM trained 300
  steps at 2 bits from +9.1% to +3.1% validation loss against plain PyTorch
  (benchmarks/README.md). An explicit attention's ``softmax`` output is its probabilities.
- LayerNorm's input: one quantisation group of 256 values spans tokens (a ViT of width
  192 puts more than one token in a group), and one outlier token widens the range of
  the whole group, while the backward normalises each token by its own statistics.

So every tensor such an op saves is stored at ``max(layer bits, floor)`` bits
(``attention_bits``, ``norm_bits`` in :class:`~memctl.controller.config.ControllerConfig`;
``None`` turns a floor off), and the floats an attention op saves that carry no gradient
(the logsumexp: one value per row, ``1/head_dim`` of the query) are kept exact. A tensor
held at its floor is outside the allocation's control: its bytes count as the layer's
``fixed_bytes`` (and ``floored_bytes`` in ``stats()["layers"]``), not as values the
layer's bits decide, nor in its range statistics, so the allocation neither prices nor
credits them, and the activation ratio counts them as stored.

The ops are recognised by their autograd node's type, as NOTE [ Finding the op that
saved a tensor ] (regions.py) recognises piecewise activations: an op that saves its
result (the attention's output, softmax) is known when that result is packed, because
its ``grad_fn`` is the op's node, and the floor applies at once. The inputs (query, key,
value; LayerNorm's input) are packed before the node exists: the :data:`RECENT` most
recent compressed records keep their source tensor, keyed by autograd identity; a later
pack whose ``grad_fn`` (or a node up to :data:`_WALK_DEPTH` steps above it: a linear
layer packs a view of LayerNorm's output) is a table op re-encodes the recent records
that are that node's inputs at the floor. The floats without a gradient packed between
an attention op's first input and its output are its own non-differentiable outputs
(nothing else packs inside one op's autograd wrapper) and are kept exact. A record the
window has let go keeps its layer's bits (the path without floors), never a wrong value.
Floors apply to the ``quantize`` codec's records; ``codec="errorbound"`` keeps its bounds.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ATTENTION", "NORM", "RECENT", "FloorTracker", "Raise"]

RECENT = 6
"""Compressed records that wait for the op that saved them (query, key, value, logsumexp, ...)."""

_WALK_DEPTH = 2

ATTENTION = "attention"
NORM = "norm"



@dataclass(frozen=True)
class _Op:
    kind: str
    result: bool
    """The op saves its own result (floored when packed)."""
    inputs: bool
    """The op saves its inputs (floored when the op's node shows up)."""
    exact_extras: bool = False
    """Its saved floats without a gradient (logsumexp) are kept exact."""


_SDPA = _Op(ATTENTION, result=True, inputs=True, exact_extras=True)
_OPS: dict[str, _Op] = {
    "ScaledDotProductFlashAttentionForCpuBackward0": _SDPA,
    "ScaledDotProductFlashAttentionBackward0": _SDPA,
    "ScaledDotProductEfficientAttentionBackward0": _SDPA,
    "ScaledDotProductCudnnAttentionBackward0": _SDPA,
    "ScaledDotProductFusedAttentionOverrideableBackward0": _SDPA,
    "SoftmaxBackward0": _Op(ATTENTION, result=True, inputs=False),
    "SafeSoftmaxBackward0": _Op(ATTENTION, result=True, inputs=False),
    "NativeLayerNormBackward0": _Op(NORM, result=False, inputs=True),
    "FusedRmsNormBackward0": _Op(NORM, result=False, inputs=True),
}


@dataclass
class _Recent:
    source: torch.Tensor
    version: int
    node: Any
    key: tuple[int, int] | None
    saved: weakref.ref[Any]
    """Weak: a record autograd has dropped must die."""
    layer: str
    order: int


@dataclass(frozen=True)
class Raise:
    """A recent record to store again: at ``bits``, or exact when ``bits`` is None."""

    saved: Any
    source: torch.Tensor
    layer: str
    bits: int | None


class FloorTracker:
    """Finds the records a floor applies to (NOTE [ Bit floors ])."""

    def __init__(self, floors: dict[str, int | None]) -> None:
        self._floors = {k: v for k, v in floors.items() if v is not None}
        self._recent: dict[int, _Recent] = {}
        self._order = 0

    @property
    def active(self) -> bool:
        return bool(self._floors)

    def clear(self) -> None:
        self._recent.clear()

    def result_floor(self, t: torch.Tensor) -> int | None:
        """The floor of a tensor its own ``grad_fn`` saves as its result (else None)."""
        node = t.grad_fn
        if node is None or not self._floors:
            return None
        op = _OPS.get(type(node).__name__)
        if op is None or not op.result:
            return None
        return self._floors.get(op.kind)

    def note(self, t: torch.Tensor, saved: Any, layer: str) -> None:
        """Remember a record compressed at its layer's bits, in case a table op saved it."""
        if not self._floors:
            return
        node = t.grad_fn
        self._order += 1
        key = None if node is None else (id(node), int(t.output_nr))
        self._recent[self._order] = _Recent(t, t._version, node, key, weakref.ref(saved), layer, self._order)
        while len(self._recent) > RECENT:
            del self._recent[next(iter(self._recent))]

    def matches(self, t: torch.Tensor) -> list[Raise]:
        """The recent records that a table op at or a few steps above ``t``'s node saved."""
        if not self._recent or t.grad_fn is None:
            return []
        found: list[Raise] = []
        frontier: list[Any] = [t.grad_fn]
        for _ in range(_WALK_DEPTH + 1):
            nxt: list[Any] = []
            for node in frontier:
                op = _OPS.get(type(node).__name__)
                if op is not None and op.inputs and op.kind in self._floors:
                    found += self._inputs_of(node, self._floors[op.kind], op.exact_extras)
                nxt.extend(e[0] for e in node.next_functions if e[0] is not None)
            if not nxt or not self._recent:
                break
            frontier = nxt[:4]
        return found

    def _inputs_of(self, node: Any, bits: int | None, extras_exact: bool) -> list[Raise]:
        keys = {(id(n), int(nr)): n for n, nr in node.next_functions if n is not None}
        hits = [r for r in self._recent.values()
                if r.key is not None and r.key in keys and keys[r.key] is r.node]
        if not hits:
            return []
        first = min(r.order for r in hits)
        extras = [r for r in self._recent.values() if extras_exact and r.node is None and r.order > first]
        out: list[Raise] = []
        for r, b in [(r, bits) for r in hits] + [(r, None) for r in extras]:
            del self._recent[r.order]
            saved = r.saved()
            if saved is not None and r.source._version == r.version:
                out.append(Raise(saved, r.source, r.layer, b))
        return out
