"""A sigmoid's or tanh's result read by its own backward, corrected for the rounding's variance.

NOTE [ Squares of a rounded result ]
``tanh`` and ``sigmoid`` save their result ``y`` and their backward reads it squared:
``g·(1 - y²)`` and ``g·y·(1 - y)``, both ``g·(k - (y - c)²)`` with the parabola's vertex
``c`` at 0 (tanh) or 1/2 (sigmoid). Stochastic rounding makes ``ŷ`` unbiased but not its
square: ``E[(ŷ - c)²] = (y - c)² + p·(1 - p)·Δ²`` for a value a fraction ``p`` of the way
up its step ``Δ`` (the group's range over ``2**b - 1``), so the derivative read is too
small by the rounding's variance at every value, and the error compounds through the
layers before. Measured with ``benchmarks/gradient_bias.py --act tanh|sigmoid`` (DigitsNet
with every ReLU replaced, 2 bits, 128 draws at fixed weights), the whole gradient's mean
stayed 30% (tanh) and 17% (sigmoid) of its norm from the exact gradient: 8.8 and 5.1 times
what unbiased draws would give.

No function of ``ŷ`` alone can be unbiased for a square (the mean of any ``r(ŷ)`` is linear
in ``p``, a square is not), but over a step's positions ``p·(1 - p)`` averages ``1/6``. So
the backward of the op that saved the record (known by the autograd node running at
unpack, as in NOTE [ Unbiased reads of a ReLU result ] in normalized.py) reads ``r`` with
``(r - c)² = max((ŷ - c)² - Δ²/6, 0)`` on ``ŷ``'s side of ``c``: its derivative is the
read's mean one plus the mean variance. Every other reader (the next layer's matrix
product) reads ``ŷ`` itself, which is unbiased. Only a quantize record's own values are
corrected (its group ranges give ``Δ``); a record derived from another's, one kept in
half precision or exact, or the error-bound codec's, is read as it is. A batch's records
(NOTE [ Batched small records ]) start inside a group: a value takes the step of the
batch's group it sits in (``first_offset``). The tanh and sigmoid records of one batch are
flagged when packed and corrected together, by one kernel call, when the first of them is
read (``Packer._squared_piece``): a recurrent net reads hundreds of them a step, and each
call of its own cost more Python than arithmetic.

Measured the same way: tanh 30% -> 4.1% of the norm (1.48 times the unbiased figure),
sigmoid 17% -> 3.6% (1.08), and one draw's error falls too (tanh 39% -> 31%). Where the
values pile up at a group's ends (a saturated tanh) the correction overshoots: there
the values sit near the step's end and their variance is less than ``Δ²/6`` (tanh of a
unit normal times 1.5: the square's excess 0.061 -> -0.013). The cost is one pass per
read: ~10 µs for a 4,096-value record on the CPU when corrected alone, ~5 ms a step on the
GRU of ``benchmarks/training.py`` (288 gate reads) before its batches' records were
corrected together (2-6 µs less a saved tensor in its unpack hook since). Its draws
showed no bias beyond their noise either way (71% of the norm per draw; the mean of 256
within 1.5% of unbiased).
"""

from __future__ import annotations

from typing import Any

import torch

from memctl.codecs.quantize._kernels import square_read_cpu
from memctl.controller.batches import BatchRecord

__all__ = ["SQUARE_READERS", "first_offset", "group_variance", "rounding_variance", "square_read"]

SQUARE_READERS: dict[str, float] = {"TanhBackward0": 0.0, "SigmoidBackward0": 0.5}
"""Backward nodes reading their saved result squared, and their parabola's vertex ``c``."""


def _meta_array(data: Any) -> Any:
    """A quantize record's group ranges as a float32 NumPy array when they are contiguous on the
    CPU (a batch record's rows of its batch's, without the views its ``buffers`` would make), else None."""
    meta = data.batch.meta if type(data) is BatchRecord else data.buffers["meta"]
    if meta.device.type != "cpu" or meta.dtype != torch.float32 or not meta.is_contiguous():
        return None
    if type(data) is BatchRecord:
        g0, g1 = data.groups
        return meta.numpy()[g0:g1]
    return meta.numpy()


def first_offset(data: Any) -> int:
    """Where a quantize record's first value sits in its first group: 0, but for a batch's
    record, which starts where the one before it ended (NOTE [ Batched small records ])."""
    return data.start % data.batch.group if type(data) is BatchRecord else 0


def group_variance(data: Any) -> torch.Tensor:
    """``Δ²/6`` per group of a quantize record (its group's step ``Δ``), float32."""
    meta = data.buffers["meta"]
    big = float((1 << int(data.params["bits"])) - 1)
    return (meta[:, 1] - meta[:, 0]).square_().mul_(1.0 / (6.0 * big * big))  # three ops (a GPU's launches)


def rounding_variance(data: Any) -> torch.Tensor:
    """``Δ²/6`` per value of a quantize record (its group's step ``Δ``), float32, in its shape."""
    group = int(data.params["group_size"])
    offset = first_offset(data)
    return group_variance(data).repeat_interleave(group)[offset:offset + data.numel].reshape(data.shape)


def square_read(values: torch.Tensor, data: Any, center: float) -> torch.Tensor:
    """``values`` (the decode of the quantize record ``data``) moved towards ``center`` so that
    their squared distance from it is smaller by the rounding's mean variance (NOTE [ Squares of
    a rounded result ]); a new tensor. One kernel pass for float32 on the CPU (a recurrent net
    reads hundreds of small gate records a step), PyTorch ops elsewhere."""
    if values.dtype == torch.float32 and values.device.type == "cpu" and values.is_contiguous():
        meta = _meta_array(data)
        if meta is not None:
            params = data.params
            return square_read_cpu(values, meta, int(params["bits"]), int(params["group_size"]), center,
                                   first_offset(data))
    d = values.float() - center
    r = d.square().sub_(rounding_variance(data)).clamp_min_(0.0).sqrt_().copysign_(d)
    return r.add_(center).to(values.dtype)
