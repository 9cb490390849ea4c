"""Saved tensors that hold a parameter's values (without an autograd node) or are computed
from parameters alone.

NOTE [ Copies of parameters without a node ]
A copy of a parameter that autograd made (autocast's cast of a weight that needs a gradient)
is known by its node (NOTE [ Copies of parameters ] in packing.py). A frozen weight's cast has
none: under autocast over a model whose base weights are frozen (low-rank fine-tuning), the
cast needs no gradient, so it has no node, and the layer saves it for the gradient it passes
down, where its quantisation noise reaches every layer below (the input gradient of a frozen
convolution and linear layer under bfloat16 autocast had a cosine of 0.81 to plain's at 2
bits). Nor has autocast's cast of the model's input (an image batch made bfloat16 for the
first convolution), which NOTE [ Model inputs ] in inputs.py keeps exact in float32 for its
noise, the largest term of the first layer's weight gradient at 2 bits. Such a tensor is
recognised by its values: a saved tensor with no node whose shape is a parameter's (or a
matrix parameter's transpose) or one of the forward's float inputs' is compared with it in
the saved tensor's dtype. A forward saves its tensors in the same order every step, so the
answer is kept by shape, dtype, device and place among the forward's tensors of that shape,
and the comparison (on a GPU, a wait for the values) runs once for each, not every step;
another set of parameters (:meth:`ParameterCopies.set`, at the parameter scan) forgets the
answers. A copy is held as it is, version-checked, as the parameter or the input is: plain
PyTorch holds it until the backward too. (A graph compiled by ``torch.compile`` is held
whole before this is asked: NOTE [ Graphs compiled by torch.compile ] in packing.py.)

NOTE [ Weights computed from parameters ]
Some forwards compute a layer's weight from the parameters: weight normalisation (``g * v /
||v||``, audio and GAN models), a meta-learning step's fast weights (``p - lr * g`` through
``torch.func.functional_call``), a frozen weight plus a low-rank update merged in the forward.
The layer saves that weight for the gradient it passes down, as it would a parameter; it is
no activation (its size does not grow with the batch) and compressing it puts the same noise
into every sample's input gradient: with first-order fast weights the whole gradient's cosine
to plain's was 0.9945 at 8 bits. So a saved tensor with a parameter's shape (or a matrix
parameter's transpose) whose graph reaches the model's parameters alone within 24 nodes is
held as it is, version-checked, as the parameter is (:meth:`ParameterCopies.computed`). The
walk fails at a leaf that is not a parameter (an input that needs a gradient), at an indexing
op (an embedding's rows picked by data) and at a product one of whose operands needs no
gradient: that operand is a layer's input in ``x @ W.T`` or a convolution, so a layer's
output that happens to have a weight's shape is still compressed. Elementwise operands
without a gradient (a detached step, a frozen weight, a constant) are allowed. Spectral
normalisation and orthogonal parametrisations multiply by a buffer (the power iteration's
vector, a base matrix), which the walk cannot tell from data: their weights are compressed
as before. Only tensors of a parameter's shape are walked, so other tensors pay a dict
lookup.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ParameterCopies"]

_Key = tuple[tuple[int, ...], torch.dtype, torch.device, int]


class ParameterCopies:
    """The model's parameters by shape, and which nodeless saved tensors were copies of one."""

    def __init__(self) -> None:
        self._by_shape: dict[tuple[int, ...], list[tuple[torch.Tensor, bool]]] = {}
        self._known: dict[_Key, bool] = {}
        self._count: dict[tuple[tuple[int, ...], torch.dtype, torch.device], int] = {}
        self._which: tuple[int, ...] = ()
        self._leaves: frozenset[int] = frozenset()

    def set(self, parameters: list[torch.Tensor]) -> None:
        """The model's parameters (at the parameter scan); the answers kept are forgotten when
        they are not the same tensors as before."""
        by: dict[tuple[int, ...], list[tuple[torch.Tensor, bool]]] = {}
        for p in parameters:
            if not p.is_floating_point() or p.dim() == 0 or p.layout != torch.strided:
                continue
            shape = tuple(p.shape)
            by.setdefault(shape, []).append((p, False))
            if p.dim() == 2:
                by.setdefault(shape[::-1], []).append((p, True))
        which = tuple(id(p) for p in parameters)
        self._leaves = frozenset(which)
        if which != self._which:
            self._known.clear()
            self._which = which
        self._by_shape = by

    def begin_forward(self) -> None:
        """A forward starts: places count from the first tensor again."""
        self._count.clear()

    def holds(self, t: torch.Tensor, inputs: list[torch.Tensor] | None = None) -> bool:
        """Whether ``t`` (saved, with no autograd node) holds a parameter's values, or one of
        ``inputs``' (the forward's own float inputs: their casts)."""
        shape = tuple(t.shape)
        candidates = self._by_shape.get(shape)
        if inputs:
            mine = [(x, False) for x in inputs if tuple(x.shape) == shape and x is not t]
            if mine:
                candidates = [*(candidates or ()), *mine]
        if candidates is None or not t.is_floating_point():
            return False
        where = (shape, t.dtype, t.device)
        n = self._count.get(where, 0)
        self._count[where] = n + 1
        key = (*where, n)
        known = self._known.get(key)
        if known is None:
            known = self._known[key] = any(_same_values(t, p, transposed) for p, transposed in candidates)
        return known


    def computed(self, t: torch.Tensor, node: Any, shape: tuple[int, ...]) -> bool:
        """Whether ``t`` (saved, made by ``node``, of ``shape``) has a parameter's shape (or a
        matrix parameter's transpose) and is computed from the model's parameters alone (NOTE
        [ Weights computed from parameters ])."""
        if shape not in self._by_shape or not t.is_floating_point():
            return False
        return _from_parameters_alone(node, self._leaves)


def _from_parameters_alone(node: Any, leaves: frozenset[int]) -> bool:
    """Whether the graph above ``node`` reaches a gradient accumulator of one of ``leaves`` (by
    ``id``) within :data:`_WALK` nodes and ends there: it meets no other leaf that needs a
    gradient, no indexing op (data picking a parameter's rows) and no product with an operand
    that needs no gradient (data: a layer's input), only elementwise ops with such operands
    (a constant, a detached gradient, a frozen weight)."""
    stack, seen, found = [node], set(), False
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if len(seen) > _WALK:
            return False
        name = type(n).__name__
        if name == "AccumulateGrad":
            if id(n.variable) not in leaves:
                return False
            found = True
            continue
        if name in _INDEXING:
            return False
        edges = n.next_functions
        if name in _PRODUCTS and any(edge is None for edge, _ in edges):
            return False
        stack.extend(edge for edge, _ in edges if edge is not None)
    return found


_WALK = 24

# ops whose output picks a parameter's rows by data (an embedding's lookup): batch-shaped
_INDEXING = frozenset({"EmbeddingBackward0", "EmbeddingBagBackward0", "EmbeddingDenseBackward0",
                       "IndexBackward0", "IndexSelectBackward0", "GatherBackward0", "TakeBackward0"})

# products: their operand without a gradient is the data in a layer (x @ W.T, a convolution)
_PRODUCTS = frozenset({"AddmmBackward0", "MmBackward0", "BmmBackward0", "MvBackward0", "AddmvBackward0",
                       "BaddbmmBackward0", "AddbmmBackward0", "DotBackward0", "VdotBackward0",
                       "ConvolutionBackward0", "LinearBackward0", "MkldnnConvolutionBackward0",
                       "CudnnConvolutionBackward0", "ConvDepthwise2DBackward0", "SlowConv2DBackward0",
                       "EinsumBackward0", "TensordotBackward0"})


def _same_values(t: torch.Tensor, p: torch.Tensor, transposed: bool) -> bool:
    if p.device != t.device:
        return False
    q = p.detach().mT if transposed else p.detach()
    with torch.no_grad():
        return bool(torch.equal(t.detach(), q.to(t.dtype)))
