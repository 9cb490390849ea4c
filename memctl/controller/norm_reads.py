"""Batch and layer norms' backward corrected for reading their rounded input twice: :class:`NormReads`.

NOTE [ A batch norm's input read twice ]
In training, batch norm's backward is

    dx = w·invstd·(g − mean(g) − x̂ₕ·mean(g·x̂ₕ)),    x̂ₕ = (x̂ − mean)·invstd,

with the means over the ``M`` values of a channel (batch and positions). The last term
reads the saved input twice: its value at ``i`` times a sum that holds ``g_i·x̂ₕ_i`` too.
Stochastic rounding makes ``x̂ₕ`` unbiased, not its square, so that term's mean holds
``g_i·Var(x̂ₕ_i)/M`` beyond the exact one: every input gradient is shrunk by
``w·invstd·g_i·Var(x̂ₕ_i)/M``. It is small per value, but the exact ``dx`` is what is left
of ``g`` once its mean and its projection on ``x̂ₕ`` are taken out, often a small part of
``g``, and ``M`` is small where feature maps are: 64 values at 2x2 positions and a batch
of 16. The shrinkage is the same in every draw, so it does not average out over steps.
``benchmarks/gradient_bias.py --model mobilenet_v3`` (uniform 2 bits, 48 draws at fixed
weights) put the mean of the draws 1.50 times as far from the exact gradient as unbiased
draws would be, most in the squeeze-excitation layers that read the gradient after a
batch norm; keeping only the convolutions' outputs (the batch norms' inputs) compressed
showed the same, and the correction below brought it to 1.06.

So the node of every batch norm in training is given a post-hook when a module's output
is its result (or one activation above it: timm's ``BatchNormAct2d``), and when that node
unpacks a quantised record of its input, the record's rounding variance per value is
remembered: ``Δ²/6``, the variance's mean over a step's positions (as in NOTE [ Squares
of a rounded result ] in squares.py), in ``x̂ₕ``'s units (times ``invstd²`` for a record of
``x`` itself; a record in normalised coordinates, NOTE [ Batch-norm outputs recomputed from
the input ], holds ``x̂ₕ``). The hook adds ``w·invstd·g·Var/M`` to the input's gradient.
The correction is exact on average over a step's positions, not value by value, as the
squares' one. A record kept exact, in half precision or by the error-bound codec, gets
none. The weight's gradient ``Σ g·x̂ₕ`` is linear in the read and needs none. A batch
norm in eval mode reads no statistics of its own (``dx = w·invstd·g``), so it gets no
hook. cuDNN's node (``CudnnBatchNormBackward0``) has the native node's fields, its
``_saved_result2`` the inverse standard deviation as well (seen on an H200 under torch 2.11),
and gets the same hook (MIOpen's too, unchecked).

LayerNorm's backward has the same term over a row's ``D`` features, with its weight applied
to ``g`` first: ``dx = rstd·(g' − mean(g') − x̂ₕ·mean(g'·x̂ₕ))``, ``g' = w·g``; its node gets
the same hook, adding ``rstd³·w·g·Var(x̂)/D`` for a record of the input (the row statistics
it reads are kept exact, NOTE [ Norm statistics ] in floors.py; where they are not, no
hook). Its input is held at 4 bits or more by default (NOTE [ Bit floors ]), where the term
is 16 times smaller than at 2; at 2 bits (``norm_bits=None``) on a linear -> LayerNorm(64)
-> linear net, the input gradient along the output gradient, per row, stayed 23 standard
errors from the exact one over 96 draws without the correction, 1.2 with it. RMSNorm
(``x·rsqrt(mean(x²))``, written out or fused) has the term too and is not corrected.

A hook that fails leaves the gradient as the node made it, counts a codec fallback and
logs it (NOTE [ Codec fallback ]). The hook holds no reference to its node (a node that
holds a function holding it would never be freed); nodes are told apart by their
sequence numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from memctl.codecs.base import Packed
from memctl.controller.derived import Derived
from memctl.controller.squares import first_offset, group_variance

__all__ = ["NORM_NODES", "NormReads"]

_BATCH_NORMS = frozenset({"NativeBatchNormBackward0", "CudnnBatchNormBackward0", "MiopenBatchNormBackward0"})
"""A batch norm's node on a CPU, with cuDNN and with MIOpen: the same fields (``_saved_result2`` is
the inverse standard deviation in all three)."""
NORM_NODES = _BATCH_NORMS | {"NativeLayerNormBackward0"}
"""Backward nodes whose input gradient reads their saved input twice (NOTE [ A batch norm's ... ])."""

_ABOVE = frozenset({"ReluBackward0", "HardswishBackward0", "SiluBackward0", "GeluBackward0", "EluBackward0",
                    "LeakyReluBackward0", "HardtanhBackward0", "MishBackward0", "SigmoidBackward0"})
"""Activations a module may apply to a batch norm's result before returning it."""

_MOST_PENDING = 4096
"""Nodes watched at most; more (forwards that never ran their backward) are forgotten."""


class _Correction:
    """One watched node's factor (``w·invstd/M`` per channel of a batch norm, ``rstd/D`` per row
    of a layer norm, with its weight per feature apart) and its input read's variance."""

    __slots__ = ("factor", "group", "layer", "offset", "raw", "unit", "variance", "weight")

    def __init__(self, factor: torch.Tensor, unit: torch.Tensor, weight: torch.Tensor | None,
                 layer: str) -> None:
        self.factor = factor
        self.unit = unit
        """``invstd`` (or ``rstd``), whose square converts: a record of the input itself holds its
        variance in the input's units, ``x̂ₕ``'s is that times ``unit²`` (squared only for such
        a record: a batch-norm chain's record holds ``x̂ₕ`` itself)."""
        self.weight = weight
        """A layer norm's weight, applied to ``g`` before its statistics (None: none or in ``factor``)."""
        self.layer = layer
        self.variance: torch.Tensor | None = None
        """The rounding variance per group of the last read of the node's input, None before one."""
        self.group = 0
        """Values per group of that read."""
        self.offset = 0
        """Where that read's record starts in its first group (a batch's record: not at 0)."""
        self.raw = False
        """Whether that read's record holds the input itself (else its normalised values)."""

    def add_to(self, dx: torch.Tensor, g: torch.Tensor, variance: torch.Tensor) -> torch.Tensor:
        """``dx`` plus ``w·invstd·g·Var(x̂ₕ)/M`` (a layer norm's ``rstd·w·g·Var(x̂ₕ)/D``): for float32
        in one fused op (a pass and a launch fewer)."""
        scaled, factor = self._parts(g, variance)
        if dx.dtype is torch.float32 and scaled.shape == dx.shape:
            return torch.addcmul(dx, scaled, factor)
        return dx + scaled.mul_(factor).to(dx.dtype)

    def _parts(self, g: torch.Tensor, variance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``g·Var`` per value (times a layer norm's weight), float32 in ``g``'s shape, and the factor
        that multiplies it (broadcast)."""
        factor = self.factor * self.unit.square() if self.raw else self.factor
        n, group, offset = g.numel(), self.group, self.offset
        if g.is_contiguous() and offset == 0 and n == variance.numel() * group:
            out = (g.reshape(-1, group).float() * variance[:, None]).view(g.shape)  # groups in place
        else:
            out = variance.repeat_interleave(group)[offset:offset + n].reshape(g.shape).mul_(g)
        return (out, factor) if self.weight is None else (out.mul_(self.weight), factor)


class NormReads:
    """The batch and layer norms of the running forwards whose backward gets the correction of
    NOTE [ A batch norm's input read twice ]."""

    def __init__(self, peek: Callable[[], Any], on_fallback: Callable[[str, BaseException], None]) -> None:
        self._peek = peek
        """A context in which a node's fields are read without decoding anything lossy."""
        self._on_fallback = on_fallback
        self.pending: dict[int, _Correction] = {}
        """By node sequence number, the watched nodes whose backward has not run."""

    def clear(self) -> None:
        self.pending.clear()

    def watch(self, t: torch.Tensor, node: Any, layer: str) -> None:
        """Give the norm whose result ``t`` is (``node``: ``t.grad_fn``), or a batch norm one
        activation above, its post-hook."""
        name = type(node).__name__
        if name not in NORM_NODES:
            if name not in _ABOVE:
                return
            node = node.next_functions[0][0]
            if node is None or type(node).__name__ not in _BATCH_NORMS:
                return
            name = type(node).__name__
        seq = node._sequence_nr()
        if seq in self.pending or t.dim() < 2 or t.numel() == 0:
            return
        try:
            with self._peek():
                correction = (_batch_norm if name in _BATCH_NORMS else _layer_norm)(node, t, layer)
        except (AttributeError, RuntimeError, TypeError, ValueError):  # a field stored lossily, or missing
            return
        if correction is None:
            return
        if len(self.pending) >= _MOST_PENDING:
            self.pending.clear()
        self.pending[seq] = correction
        node.register_hook(self._hook(seq, correction))

    def read(self, node: Any, saved: Any) -> None:
        """``node`` (a batch norm's, :data:`NORM_NODES`) unpacks ``saved``: remember its rounding
        variance in normalised units if it is a watched node's lossy input record."""
        correction = self.pending.get(node._sequence_nr())
        if correction is None:
            return
        data = saved.data
        try:
            if isinstance(data, Packed) and data.codec == "quantize":
                record, raw = data, True
            elif isinstance(data, Derived) and getattr(data.fn, "normalised", False):
                record, raw = data.source.data, False  # NOTE [ Batch-norm outputs ... ]: x̂ₕ itself
                if not (isinstance(record, Packed) and record.codec == "quantize"):
                    return
            else:
                return
            if tuple(record.shape) != tuple(saved.shape):
                return
            correction.variance = group_variance(record)
            correction.group, correction.raw = int(record.params["group_size"]), raw
            correction.offset = first_offset(record)
        except Exception as exc:  # see NOTE [ Codec fallback ]: the gradient stays as the node makes it
            self._on_fallback(correction.layer, exc)

    def _hook(self, seq: int, correction: _Correction) -> Callable[..., Any]:
        def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> Any:
            self.pending.pop(seq, None)
            variance, correction.variance = correction.variance, None
            dx, g = grad_inputs[0], grad_outputs[0]
            if variance is None or dx is None or g is None:
                return None
            try:
                return (correction.add_to(dx, g, variance), *grad_inputs[1:])
            except Exception as exc:  # see NOTE [ Codec fallback ]
                self._on_fallback(correction.layer, exc)
                return None

        return hook


def _batch_norm(node: Any, t: torch.Tensor, layer: str) -> _Correction | None:
    """``w·invstd/M`` per channel of a batch norm in training whose result (or its activation's) is ``t``."""
    if not node._saved_training or t.shape[1] == 0:
        return None
    invstd, weight = node._saved_result2, node._saved_weight
    if invstd is None or invstd.dim() != 1 or invstd.numel() != t.shape[1]:
        return None
    shape = [1, -1] + [1] * (t.dim() - 2)
    invstd = invstd.detach().float()
    factor = invstd / (t.numel() // t.shape[1])
    if weight is not None:
        factor = factor * weight.detach().float()
    return _Correction(factor.view(shape), invstd.view(shape), None, layer)


def _layer_norm(node: Any, t: torch.Tensor, layer: str) -> _Correction | None:
    """``rstd/D`` per row of a layer norm whose result is ``t``, its weight per feature apart."""
    dims = tuple(node._saved_normalized_shape)
    rstd, weight = node._saved_result2, node._saved_weight
    if not dims or tuple(t.shape[-len(dims):]) != dims or rstd is None or rstd.dim() != t.dim():
        return None
    rstd = rstd.detach().float()
    factor = rstd / math.prod(dims)
    return _Correction(factor, rstd, None if weight is None else weight.detach().float(), layer)
