"""Norm outputs recomputed from the norm's input record (no payload of their own).

NOTE [ Norm outputs recomputed from the input ]
A pre-norm transformer block saves one tensor three times around each norm: the norm's
input ``x`` (the residual stream: LayerNorm saves it, an RMSNorm's square and product
save it), the normalised ``n = x·r`` (an explicit RMSNorm's product by its gain saves
it), and the output ``y`` (the linear layers that make query, key and value, or the
MLP's input, save it). The floors of NOTE [ Bit floors ] keep each at ``norm_bits`` (4):
in the Llama of ``benchmarks/fidelity.py`` at ``bits=2`` these records were a third of
all packed bytes. Given the norm's statistics, ``n`` and ``y`` hold nothing ``x`` lacks:

    LayerNorm        y = (x − mean)·rstd·weight + bias      (native_layer_norm's node)
    RMSNorm          n = x·rstd,  y = n·weight               (a product by an rsqrt, then by a gain:
                                                              Hugging Face's LlamaRMSNorm, and
                                                              F.rms_norm as the CPU runs it)

and the statistics (one value per row) are kept exact (NOTE [ Norm statistics ] in
floors.py). So when a tensor is packed that the floors would keep at the norm's floor as
a norm's output (directly, or through reshapes and a cast), and the norm's input is a
quantised record of this forward at least as fine as that floor, the tensor keeps no
payload: its record decodes ``x̂`` and applies the norm with the node's own statistics,
weight and bias. Every read is as fine as before (``x̂`` at the floor or above, and the
map from ``x`` to ``n`` or ``y`` is per row affine, so an error in ``x̂`` of one group
step becomes one of ``rstd·weight`` steps, what quantising ``y`` at the same bits gives
up to the group's range), and the norm's records cost one tensor's bytes instead of two
or three. The input's record is not raised: the floor already sets how fine the norm's
reads are, and here they stay at it. The record counts as one more reader of the input's
(NOTE [ One decode for several readers ]), which the backward decodes once for all.

The norm's input is found by the floor walk (NOTE [ Bit floors ]), which now runs before
the packed tensor's own record is made: the walk that stores the norm's input at the
floor also notes which norm saved it, and the packed tensor's record is read from it.
The rebuilt function is compared with the tensor (to a few units in the last place of
its largest value: the norm's kernel rounds in another order) the first time for each
structure (norm kind, gain, casts, reshape, weight and bias present), dtype and device
type; a mismatch keeps today's record for good (per controller). The statistics, weight
and bias are read from the node's fields while packing (exact records only; a field
stored lossily keeps today's record). Not derived: an output whose layer keeps bits at
or above the floor (it is then compressed at its layer's bits, as before), an input kept
exact or under the error-bound codec, an input modified in place since it was packed,
a norm whose input record the floor walk no longer holds, casts other than one between
an RMSNorm's product and its gain and one after the whole norm, and the CUDA fused
RMSNorm's node (not seen on this machine's CPU build, where ``F.rms_norm`` runs as the
products above).

Measured (CPU; benchmarks/README.md, ``fidelity.py``, 20 steps, seed 0): Llama 7.9x -> 10.0x
at ``bits=2`` and 6.5x -> 7.9x at the default policy, BERT 8.5x -> 10.1x, ViT 8.8x -> 10.1x at
``bits=2``, each at the loss drop it had (within a point). On a 3-block pre-norm MLP at 2 bits
(rows scaled 0.2-5) the whole gradient's relative error against plain PyTorch moved by under
2% either way (LayerNorm 0.0517 -> 0.0524, RMSNorm 0.0217 -> 0.0216) for 9.7x -> 10.9x and
9.0x -> 10.9x.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memctl.controller.derived import reshaped_from
from memctl.controller.floors import is_rsqrt

__all__ = ["NormChain", "NormInputs", "chain_of"]

Function = Callable[[torch.Tensor], torch.Tensor]
Read = Callable[[Any, str], Any]
"""``(node, field name) -> the field's value``, read from exact records only (else raises)."""

_LAYER_NORM = "NativeLayerNormBackward0"
_PRODUCT = "MulBackward0"
_CAST = "ToCopyBackward0"
_HELD = 4
"""Norm inputs held, raw, until their outputs are packed (strong references, as the floors' recent)."""


def _name(node: Any) -> str:
    return type(node).__name__


def _rsqrt_side(node: Any) -> int | None:
    """For an RMSNorm's product ``x·rstd`` (``MulBackward0``), the place of its ``rstd`` operand,
    else None."""
    if node is None or _name(node) != _PRODUCT:
        return None
    sides = [i for i, (e, _) in enumerate(node.next_functions) if is_rsqrt(e)]
    return sides[0] if len(sides) == 1 and len(node.next_functions) == 2 else None


def _input_place(node: Any) -> int | None:
    """The place of the norm's input ``x`` among ``node``'s operands, for a norm whose output
    :func:`chain_of` recognises; else None."""
    if node is None:
        return None
    if _name(node) == _LAYER_NORM:
        return 0
    side = _rsqrt_side(node)
    return None if side is None else 1 - side


@dataclass(frozen=True)
class NormChain:
    """``t`` is ``cast(gain·cast(norm(x)))`` reshaped (NOTE [ Norm outputs recomputed from the input ])."""

    op: Any
    """The norm's node: LayerNorm's, or an RMSNorm's product ``x·rstd``."""
    place: int
    """The place of the norm's input among :attr:`op`'s operands (an RMSNorm's ``rstd``: the other)."""
    gain: Any = None
    """The RMSNorm's multiplication by its gain, when ``t`` is past it."""
    gain_side: int = 0
    """The gain's operand place in :attr:`gain`'s node."""
    inner_cast: bool = False
    """A cast between the product and the gain (to the gain's dtype)."""
    outer_cast: bool = False
    """A cast of the whole output (to ``t``'s dtype)."""
    reshaped: bool = False

    def function(self, read_field: Read, shape: torch.Size,
                 dtype: torch.dtype) -> tuple[Function, str] | None:
        """``x ↦ t`` from the nodes' fields, with its structure's key; None where a field is missing.
        The fields are detached: the function rebuilds values, never a graph to the weights."""

        def read(node: Any, name: str) -> Any:
            value = read_field(node, name)
            return value.detach() if isinstance(value, torch.Tensor) else value

        op = self.op
        if _name(op) == _LAYER_NORM:
            mean, rstd = read(op, "_saved_result1"), read(op, "_saved_result2")
            weight, bias = read(op, "_saved_weight"), read(op, "_saved_bias")
            if not isinstance(mean, torch.Tensor) or not isinstance(rstd, torch.Tensor):
                return None
            key = f"layer_norm{'+w' if weight is not None else ''}{'+b' if bias is not None else ''}"

            def norm(x: torch.Tensor) -> torch.Tensor:
                y = (x.to(mean.dtype) - mean).mul_(rstd)
                if weight is not None:
                    y = y.mul_(weight) if y.dtype == weight.dtype else y * weight
                return y if bias is None else y.add_(bias)
        else:
            x_first = self.place == 0
            rstd = read(op, "_saved_other" if x_first else "_saved_self")
            if not isinstance(rstd, torch.Tensor):
                return None
            key = "rms_norm"

            def norm(x: torch.Tensor) -> torch.Tensor:
                return x * rstd if x_first else rstd * x
        fn: Function = norm
        if self.gain is not None:
            gain = read(self.gain, "_saved_other" if self.gain_side == 1 else "_saved_self")
            if not isinstance(gain, torch.Tensor):
                return None
            inner, cast, side = fn, self.inner_cast, self.gain_side
            key += "+gain" + ("+cast" if cast else "")

            def gained(x: torch.Tensor) -> torch.Tensor:
                n = inner(x)
                if cast:
                    n = n.to(gain.dtype)
                return n * gain if side == 1 else gain * n

            fn = gained
        key += ("+out_cast" if self.outer_cast else "") + ("/reshape" if self.reshaped else "")
        before = fn

        def finished(x: torch.Tensor) -> torch.Tensor:
            return before(x).to(dtype).reshape(shape)  # (no copy where dtype and shape are t's already)

        return finished, key


def chain_of(t: torch.Tensor) -> NormChain | None:
    """The norm ``t`` is the output of (through reshapes and casts), else None."""
    node, nr = reshaped_from(t)
    if node is None or nr != 0:
        return None
    reshaped = node is not t.grad_fn
    outer_cast = False
    if _name(node) == _CAST:
        outer_cast = True
        node, nr = node.next_functions[0] if node.next_functions else (None, 0)
        if node is None or nr != 0:
            return None
    place = _input_place(node)
    if place is not None:
        return NormChain(node, place, outer_cast=outer_cast, reshaped=reshaped)
    if _name(node) != _PRODUCT or len(node.next_functions) != 2:
        return None
    for i, (inner, inner_nr) in enumerate(node.next_functions):
        cast = inner is not None and _name(inner) == _CAST
        if cast:
            inner, inner_nr = inner.next_functions[0] if inner.next_functions else (None, 0)
        side = _rsqrt_side(inner) if inner is not None and int(inner_nr) == 0 else None
        if side is not None:
            return NormChain(inner, 1 - side, gain=node, gain_side=1 - i, inner_cast=cast,
                             outer_cast=outer_cast, reshaped=reshaped)
    return None


@dataclass(frozen=True, eq=False)
class _Input:
    op: Any
    saved: weakref.ref[Any]
    source: torch.Tensor
    version: int


class NormInputs:
    """Norm inputs the floor walk found this forward, by the norm's node (NOTE [ Norm outputs ... ])."""

    def __init__(self) -> None:
        self._inputs: dict[int, _Input] = {}
        self.verified: set[tuple[str, torch.dtype, str]] = set()
        """Structures whose rebuilt function reproduced the output once: checked no more."""
        self.rejected: set[tuple[str, torch.dtype, str]] = set()
        """Structures whose rebuilt function did not: not derived again."""

    def __bool__(self) -> bool:
        return bool(self._inputs)

    def clear(self) -> None:
        self._inputs.clear()

    def note(self, op: Any, saved: Any, source: torch.Tensor) -> None:
        """The floor walk stored ``source`` (now recorded as ``saved``) at ``op``'s norm floor: kept
        when ``op`` is a norm and ``source`` its input (not a weight or bias computed in the forward)."""
        place = _input_place(op)
        if place is None:
            return
        node, nr = op.next_functions[place]
        if node is None or node is not source.grad_fn or int(nr) != int(source.output_nr):
            return
        self._inputs.pop(id(op), None)
        self._inputs[id(op)] = _Input(op, weakref.ref(saved), source, source._version)
        while len(self._inputs) > _HELD:
            del self._inputs[next(iter(self._inputs))]

    def find(self, t: torch.Tensor) -> tuple[NormChain, Any, torch.Tensor] | None:
        """``(chain, input record, input)`` when ``t`` is the output of a norm whose input was
        noted and is unmodified since, else None."""
        if not self._inputs:
            return None
        chain = chain_of(t)
        if chain is None:
            return None
        entry = self._inputs.get(id(chain.op))  # (its source is the norm's input: :meth:`note`)
        if entry is None or entry.op is not chain.op or entry.source._version != entry.version:
            return None
        saved = entry.saved()
        return None if saved is None else (chain, saved, entry.source)
