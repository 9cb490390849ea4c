"""The strides a saved tensor had, given back to readers that check them.

NOTE [ The saved layout ]
A record decodes to a contiguous tensor, whatever the strides of the tensor that was saved
(a channels-last activation, a transposed view, a slice). PyTorch's own derivative formulas
read any layout, so for them the decoded tensor is returned as it is: a copy into the old
strides would cost a pass over the values for nothing. A graph compiled by ``torch.compile``
is another reader: AOTAutograd runs it as an autograd function (``CompiledFunctionBackward``)
whose backward checks every saved tensor's sizes and strides against those it was compiled
for (Inductor's ``assert_size_stride``) and raises on a mismatch, and it does lay tensors out
as it pleases (Inductor turns a convolution's input and weight channels-last). A custom
``torch.autograd.Function`` may likewise hand its saved tensors to a kernel that assumes
their strides. So a record of a tensor that was not contiguous keeps its strides
(``Saved.stride``, ``Alias.stride``), and when the node reading it is a Python autograd
function (a ``BackwardCFunction``, which both are) :func:`laid_out` copies the decoded values
into a tensor of those strides. Dimensions of size 1 do not count (their stride is never
read; Inductor skips them too). A tensor whose strides overlap (an expanded one) cannot be
copied into: its storage is rebuilt element by element from the decoded values (where the
values of one storage element differ, after a lossy decode, one of them is kept).
"""

from __future__ import annotations

import torch

__all__ = ["laid_out", "same_layout"]


def same_layout(t: torch.Tensor, stride: tuple[int, ...]) -> bool:
    """Whether ``t`` has ``stride`` in every dimension of size above 1."""
    got = t.stride()
    if got == stride:
        return True
    return all(n <= 1 or a == b for n, a, b in zip(t.shape, got, stride, strict=True))


def _overlaps(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether two indices of a tensor of ``shape`` and ``stride`` can reach one storage element."""
    extent = 0  # the furthest element reached by the dimensions of smaller stride
    for n, s in sorted(((n, s) for n, s in zip(shape, stride, strict=True) if n > 1), key=lambda d: d[1]):
        if s <= extent:
            return True
        extent += (n - 1) * s
    return False


def laid_out(values: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``values`` in a new tensor of strides ``stride`` (NOTE [ The saved layout ])."""
    shape = tuple(values.shape)
    if not _overlaps(shape, stride):
        out = torch.empty_strided(shape, stride, dtype=values.dtype, device=values.device)
        return out.copy_(values)
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True) if n > 0)
    index = torch.arange(span, device=values.device).as_strided(shape, stride)
    storage = values.new_empty(span)
    storage[index.reshape(-1)] = values.reshape(-1)
    return storage.as_strided(shape, stride)
