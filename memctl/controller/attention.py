"""An explicit attention's probabilities recomputed from its query and key records.

NOTE [ Attention probabilities recomputed from query and key ]
An explicit attention, ``softmax(q @ kᵀ · scale (+ mask)) @ v``, saves its probabilities
(the softmax's result, and again as the second matmul's operand: one record, NOTE
[ De-duplication ] in packing.py) and the operands of its first matmul, the query and the
key, all three at the attention floor (8 bits by default, NOTE [ Bit floors ] in floors.py).
The probabilities have ``T/d`` values for each of the query's (``T`` the sequence length,
``d`` a head's width): at ``T = 32``, ``d = 16`` they were 66 KiB of the 431 KiB a step of
the test transformer block keeps; at ``T = 1024``, ``d = 64`` their record is 16 times the
query's. ``scaled_dot_product_attention`` keeps none: its backward recomputes them from the
saved query and key. memctl does the same for the explicit form.

When the softmax's result is packed, its node's input is walked down to the first matmul
through reshapes, multiplications and divisions by a scalar, ``masked_fill`` and the
addition of a tensor without a gradient (a mask), and the matmul's two operands are the
query and key records the floor walk has just raised (:class:`~memctl.controller.floors.Raise`).
Then the result keeps no payload of its own: its record is a ``Derived`` of those two
records, and unpacking it decodes them (NOTE [ One decode for several readers ]: the first
matmul's backward reads the same decode), multiplies them, applies the scalars and takes
the softmax over the last dimension. A chain whose one mask is a ``masked_fill`` (of a
scalar or of a 0-dim tensor) uses that op's own mask (which autograd keeps for its backward
anyway; read when the probabilities are packed, so a padding mask that changes every batch
is that batch's); any other chain with a
mask (an added mask tensor, several masks) keeps a bit map of the places where the
probabilities were exactly 0 (1 bit a value, an eighth of the 8-bit record). Either way those
places are masked out (``-inf``) before the softmax: a mask filled with ``-inf``, the dtype's
lowest value or any value whose exponential underflows is reproduced.

Nothing is trusted: the recomputation from the exact query and key must reproduce the
probabilities bit for bit before their record is dropped. Once per structure (the chain's
node types and scalars, the shape's rank, dtype and device) when nothing is added to the
logits, and at every step when a tensor is: an added tensor is in no node, and one whose
values at unmasked places are not 0 (an ALiBi bias) cannot be reproduced, so there the
check fails and the probabilities keep their record at the floor, as do those of a
structure that failed once (not tried again). The check is a matmul, a softmax and a
comparison (on a GPU a wait: every step for a chain with an added tensor).

The probabilities' bytes go (``T·T`` values a head and row of the batch at 8 bits; a bit
map's eighth stays where the chain's mask is not a ``masked_fill``'s), and so do their encode
and decode; the backward runs a matmul, the scalars, the mask and a softmax per attention
instead, as the fused attention's backward does. The recomputation's ops run in place on the
matmul's new output. An explicit causal attention layer (``T = 256``, 4 heads of 16, batch 8,
``masked_fill``) at 2 bits, one thread: 3.49 -> 1.68 MiB of records (memctl's own count),
35.4 -> 34.0 ms a step (plain PyTorch 21.0 ms). The recomputed probabilities carry the error
of the 8-bit query and key through the exponential, as ``scaled_dot_product_attention``'s do
under memctl.

A dropout between the softmax and the second matmul (nanoGPT's ``attn_dropout``, a Hugging
Face eager attention's ``attention_dropout``) makes that matmul's operand another tensor,
``P·M`` (on a CPU, ``F.dropout`` multiplies by a mask ``M`` of zeros and ``1/(1−p)``, which the
product's node saves). When the softmax's result was recomputed and the operand is that
product (through views and an expand that repeats nothing), it keeps no record either: its
unpack multiplies the recomputed probabilities by the mask's record (a two-valued tensor,
which the quantiser stores exactly at any width). The mask's record is the one memctl's pack
hook returned for the product's saved ``other``: read from the node without decoding it
(autograd hands the unpack hook that record), so no data is compared. The floor walk sees
through such a product as well: the value operand of ``dropout(P) @ v`` takes the value
floor, and an operand that keeps a record the attention floor (NOTE [ Bit floors ]).

Not recomputed (the record stays at the floor): a dropout of another kind (``native_dropout``
on a GPU: its own node and a bool mask; not tried), a softmax with a dtype cast
(``softmax(x, dtype=...)``, autocast), a softmax over another dimension than the last, any
other op in the chain, a query that is the key, and the error-bound codec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memctl.controller.derived import RESHAPES
from memctl.controller.floors import SOFTMAX

__all__ = ["MATMULS", "Logits", "logits_of", "probabilities"]

MATMULS = {"BmmBackward0": torch.bmm, "MmBackward0": torch.mm}
"""The matmuls recomputed, by node type (also a layout copy's product, NOTE [ Layout copies of
a record ] in layout.py)."""
_SCALAR_MUL = frozenset({"MulBackward0", "MulBackward1"})
_SCALAR_DIV = frozenset({"DivBackward0", "DivBackward1"})
_MASKS = frozenset({"MaskedFillBackward0", "MaskedFillBackward1"})
_ADDED = frozenset({"AddBackward0", "SubBackward0"})
_LIMIT = 12
"""Most nodes walked from the softmax to the matmul."""


@dataclass(frozen=True)
class Logits:
    """How a softmax's input was made from its first matmul's output."""

    softmax: str
    """The softmax's node type (``_safe_softmax`` gives 0, not NaN, on a row masked whole)."""
    matmul: Any
    """The matmul's node (``BmmBackward0`` or ``MmBackward0``)."""
    scalars: tuple[tuple[str, float], ...]
    """``("mul" | "div", c)`` from the matmul outward."""
    masked: bool
    """A mask or an added tensor is in the chain."""
    added: bool
    """A tensor without a gradient is added: every recomputation is checked."""
    fill: Any = None
    """The chain's one ``masked_fill`` node, when its mask alone masks (no added tensor, no
    reshape between it and the softmax): its mask serves at unpack, no bit map is kept."""

    def key(self, t: torch.Tensor) -> tuple[Any, ...]:
        """What a check of the recomputation holds for."""
        return (self.softmax, type(self.matmul).__name__, self.scalars, self.masked, t.dim(), t.dtype,
                t.device.type)


def logits_of(node: Any, ndim: int, scalar: Callable[[Any, str], float | None]) -> Logits | None:
    """The chain from a softmax's node (its result of ``ndim`` dimensions) down to its first
    matmul, or None when some op in it cannot be replayed (NOTE [ Attention probabilities
    recomputed from query and key ]). ``scalar(node, field)``: a node's saved scalar, or None."""
    if type(node).__name__ not in SOFTMAX or _softmax_dim(node, ndim) != -1:
        return None
    scalars: list[tuple[str, float]] = []
    masked = added = reshaped = False
    fills: list[Any] = []
    edges = node.next_functions
    below = edges[0][0] if edges else None
    for _ in range(_LIMIT):
        if below is None:
            return None
        name = type(below).__name__
        if name in MATMULS:
            fill = fills[0] if len(fills) == 1 and not added else None
            return Logits(type(node).__name__, below, tuple(reversed(scalars)), masked, added, fill)
        edges = below.next_functions
        if name in RESHAPES:
            reshaped = True
            below = edges[0][0]
            continue
        first = edges[0][0] if edges else None
        second = edges[1][0] if len(edges) > 1 else None
        if name in _MASKS:
            # its mask broadcasts against the softmax's input as it did against its own input
            # when no reshape lies between them
            fills.append(None if reshaped else below)
            masked, below = True, first
        elif name in _ADDED and first is not None and second is None:
            masked = added = True
            below = first
        elif name in _SCALAR_MUL or name in _SCALAR_DIV:
            kind = "mul" if name in _SCALAR_MUL else "div"
            if first is not None and second is None:
                c = scalar(below, "_saved_other")
                walked = first
            elif kind == "mul" and first is None and second is not None:
                c = scalar(below, "_saved_self")
                walked = second
            else:
                return None
            if c is None:
                return None
            scalars.append((kind, c))
            below = walked
        else:
            return None
    return None


def _softmax_dim(node: Any, ndim: int) -> int | None:
    """The softmax's dimension (of a result of ``ndim`` dimensions), -1 for the last."""
    try:
        dim = int(node._saved_dim)
    except (AttributeError, RuntimeError, TypeError):
        return None
    if dim >= 2**63:  # read back as an unsigned 64-bit number
        dim -= 2**64
    return -1 if dim in (-1, ndim - 1) else dim


def probabilities(logits: Logits, a: torch.Tensor, b: torch.Tensor, zero: torch.Tensor | None,
                  shape: tuple[int, ...]) -> torch.Tensor:
    """The softmax's result from the matmul's operands ``a`` and ``b`` (decoded records, or the
    exact tensors for the check), with ``zero``'s places masked out (a bit map of ``shape``'s
    size, or the ``masked_fill``'s own mask, which broadcasts), in ``shape``. The matmul's
    output is new: the rest runs in place on it, as the forward's ops gave the same values."""
    s = MATMULS[type(logits.matmul).__name__](a, b).reshape(shape)
    for kind, c in logits.scalars:
        if kind == "mul":
            s.mul_(c)
        else:
            s.div_(c)
    if zero is not None:
        s.masked_fill_(zero.reshape(shape) if zero.numel() == s.numel() else zero, float("-inf"))
    if logits.softmax == "SafeSoftmaxBackward0":
        return torch._safe_softmax(s, -1)
    return torch.softmax(s, dim=-1)
