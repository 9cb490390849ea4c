"""Saved tensors without an autograd node that hold a parameter's values.

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
"""

from __future__ import annotations

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


def _same_values(t: torch.Tensor, p: torch.Tensor, transposed: bool) -> bool:
    if p.device != t.device:
        return False
    q = p.detach().mT if transposed else p.detach()
    with torch.no_grad():
        return bool(torch.equal(t.detach(), q.to(t.dtype)))
