"""Saved tensors that are a layout copy of a record: kept as that record, re-laid out.

NOTE [ Layout copies of a record ]
An attention written with ``scaled_dot_product_attention`` returns ``(B, H, T, d)``; the
model then runs ``out.transpose(1, 2).contiguous().reshape(B, T, H·d)`` and the output
projection saves that, a copy of the attention's output in another layout (Hugging Face's
Llama, Mistral, GPT-NeoX, OPT, Phi, T5; timm's ViT without the ``contiguous``). The
attention's own record of its output is at the value floor (4 bits, NOTE [ Bit floors ]);
the copy was a second record of the same values at the layer's bits. At 2 bits the output
projection's weight gradient came back with 60-78% relative error on those models, the
largest share of the whole gradient's error.

When a tensor is packed whose ``grad_fn`` is a layout op (a view or reshape, an alias, a
transpose, a permute or a clone), its graph is walked down through such nodes (at most
:data:`_LIMIT`) to the first other node; when that node's output has a quantised record
of this forward (the attention's output) stored at least at the bits the tensor's layer
would give it, the tensor keeps no payload: its record is a ``Derived`` of that record,
and unpacking it decodes the record (once for both readers, NOTE [ One decode for several
readers ]) and replays the layout: the transposes and permutes with the dimensions their
nodes saved, the views and reshapes to the shapes their nodes' outputs had
(``Node._input_metadata``), a clone as nothing, and a contiguous copy at the end when the
tensor was contiguous. The reader sees the record's values at the record's bits (the
value floor's 4 where its layer had 2), for no bytes. Nothing is trusted: the replay of
the record's exact tensor must equal the tensor bit for bit once per structure (the
layout's steps, dtype, device) before any record is dropped this way; while that tensor
is gone (nothing holds it), the copy keeps its own record. A structure that failed once
is not tried again.

An attention written out (OPT, T5, BART, nanoGPT: ``probs @ v``, then the same layout)
has no record of its output: the matmul saves its operands, not its result. When the node
below the chain is a matmul (``bmm``, ``mm``) whose two saved operands are records of this
forward (the probabilities, recomputed or at the attention floor, and the value at its
floor; each quantised at no fewer bits than the copy's layer would take, or rebuilt), the
copy is that matmul of the two decoded records, laid out: one matmul more in the backward,
as the fused attention's backward recomputes, and no bytes; checked the same way, against
the matmul of the exact operands. The operands are the handles autograd hands the unpack
hook for the matmul's saved fields (NOTE [ Attention probabilities recomputed from query
and key ] in attention.py reads a dropout's mask so).

Not derived: a chain whose first other node has no quantised record and is no such matmul
(a slice, a select or an expand stops the walk, so only a record of the slice itself would
serve), a record kept exact or rebuilt itself (``Derived``), one at fewer bits than the
copy's layer would take, the error-bound codec.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memctl.controller.derived import RESHAPES

__all__ = ["LAYOUT", "Layout", "below_layout", "layout_of", "replay"]

LAYOUT = frozenset({*RESHAPES, "TransposeBackward0", "PermuteBackward0", "CloneBackward0"})
"""The nodes of ops that only lay their input's values out again."""
_LIMIT = 8
"""Most layout nodes walked."""

Step = tuple[str, tuple[int, ...]]
"""``("reshape", shape)``, ``("transpose", (d0, d1))`` or ``("permute", dims)``."""
Layout = tuple[Any, int, tuple[Step, ...]]
"""The node below the chain, its output number, and the steps from its output up."""


def _signed(value: Any) -> int:
    """A saved int (an int64 node field reads back unsigned: −1 as 2⁶⁴ − 1)."""
    value = int(value)
    return value - 2**64 if value >= 2**63 else value


def _step(node: Any, name: str) -> Step | None:
    """The forward step of one layout node (None for a clone, which changes no layout)."""
    if name == "CloneBackward0":
        return None
    if name == "TransposeBackward0":
        return ("transpose", (_signed(node._saved_dim0), _signed(node._saved_dim1)))
    if name == "PermuteBackward0":
        return ("permute", tuple(_signed(d) for d in node._saved_dims))
    return ("reshape", tuple(int(s) for s in node._input_metadata[0].shape))


def below_layout(node: Any) -> tuple[Any, int] | None:
    """``(node, output number)`` of the first node below a layout chain that starts at
    ``node``, or None when the chain is longer than :data:`_LIMIT` nodes (node types only:
    what a pack whose tensor has no record to read from pays)."""
    for _ in range(_LIMIT):
        edges = node.next_functions
        if not edges or edges[0][0] is None:
            return None
        below, nr = edges[0]
        if type(below).__name__ not in LAYOUT:
            return below, int(nr)
        node = below
    return None


def layout_of(node: Any) -> Layout | None:
    """The layout chain from ``node`` (a layout op's node) down to the first other node, or
    None when it is longer than :data:`_LIMIT` nodes or a node's fields cannot be read."""
    steps: list[Step] = []
    try:
        for _ in range(_LIMIT):
            name = type(node).__name__
            if name not in LAYOUT:
                return None
            step = _step(node, name)
            if step is not None:
                steps.append(step)
            edges = node.next_functions
            if not edges or edges[0][0] is None:
                return None
            below, nr = edges[0]
            if type(below).__name__ not in LAYOUT:
                return below, int(nr), tuple(reversed(steps))
            node = below
    except (AttributeError, RuntimeError, TypeError, IndexError):
        return None
    return None


def replay(steps: tuple[Step, ...], contiguous: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function that lays a record's values out as the copy had them."""

    def laid_out(x: torch.Tensor) -> torch.Tensor:
        for kind, args in steps:
            if kind == "transpose":
                x = x.transpose(args[0], args[1])
            elif kind == "permute":
                x = x.permute(args)
            else:
                x = x.reshape(args)
        return x.contiguous() if contiguous else x

    return laid_out
