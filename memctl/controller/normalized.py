"""Batch-norm outputs recomputed from the batch norm's saved input (no payload of their own).

NOTE [ Batch-norm outputs recomputed from the input ]
A convolution block ``z = conv(·)``, ``x = batch_norm(z)``, ``y = act(x)`` saves three
tensors of one shape: batch norm saves its input ``z``, the activation saves its input
``x`` (hardswish, SiLU, hardtanh, ...: directly, or as the clone an in-place form takes)
or its result ``y`` (ReLU, in place or not), and the next layer saves ``y``. In training
and in eval mode ``x`` is a per-channel affine function of ``z``: ``x = a·z + c`` with
``a = weight·invstd`` and ``c = bias - mean·a``, and ``y`` a function of ``x``
(NOTE [ Outputs recomputed from the input ] in derived.py). The three records, each
quantised at the layers' own bits, hold one tensor's information three times. Of the
three, ``z`` is read least: batch norm's backward reads it only through per-channel
sums (its weight's gradient and the ``x̂·mean(g·x̂)`` term), while ``y`` is read value by
value by the next layer's weight gradient and ``x`` by value-dependent derivatives; a
ReLU net kept ``y`` at 2 bits, the other activations' nets ``x`` and ``y`` at 4 bits
and ``z`` at 2 (through derived.py), 6 bits per value where one record holds it all.

So when a tensor ``t`` is packed whose ``grad_fn`` is a batch norm (``x`` itself), a
``CloneBackward0`` of one (an in-place activation's copy of ``x``) or a ``ReluBackward0``
of one (``y = relu(x)``), and the batch norm's input is a quantised record still pending
(NOTE [ Finding the op that saved a tensor ] in regions.py), ``t`` keeps no payload: its
record decodes ``ẑ`` and applies ``a·ẑ + c`` (and ReLU), and ``z``'s record is encoded
again at the widest codec width within ``b_z + b_t`` bits (at most 8): 2 + 2 bits give
one 4-bit record where there were two 2-bit ones, so the bytes never grow and every read
is at least as fine as before. The bytes can hold the root under that width: at 4 + 4
bits an 8-bit root costs more than the two 4-bit records (NOTE [ Eight-bit groups ] in
the quantize codec). ``x``, affine in ``n``, is read as finely from a root of its own
width, so it still joins; ReLU's result is not (a grid over both signs of ``n``, twice as
coarse as its own 4-bit record: the gradient's error at the block's input 0.135 against
0.073), so it keeps its own record, and so does an activation's output rebuilt from ``x``
(expressions.py). Before this, ``bits=4`` kept the very records of ``bits=2``. A ReLU
result keeps its exact mask (region code) on top, so its zeros stay exact. The
activation's output ``y`` is then recomputed from ``x``'s record as before, and its bits
also go to ``z``'s record (the root of the chain): ``z``, ``x`` and ``y`` at 2 bits each
become one 4-bit record (the codec has no 6-bit width: the 2 bits left over are bytes
saved, not spent). On the conv nets of ``benchmarks/activations.py`` at 2 bits this took
ReLU's net from 0.983 to 0.991 (its result now read at 4 bits) and the ratio of the
other activations' nets from 12.2x to 14.9x at the same or better cosine (figures in
benchmarks/README.md).

Normalised coordinates: the record holds ``n = (z - mean)·invstd``, not ``z``: ``z``
(``n/invstd + mean``) and ``x`` (``weight·n + bias``) are both read from it. A
quantisation group is 256 consecutive values, which on a small late feature map (2x2
positions at a 64x64 input) spans 64 channels; ``z``'s channels differ in scale by
orders of magnitude (the batch norm is there to undo it), so a record of ``z`` quantised
small channels on the scale of the group's largest, and their ``x`` came back far
coarser than a record of ``x`` itself (EfficientNet-B0's 8-bit cosine fell from 0.99966
to 0.99947). ``n`` has every channel at mean 0 and variance 1 over the batch.

Half precision: from 16 bits per value (``z`` and ``x`` at 8 bits each), the record is
kept as ``n`` in float16 instead (2 bytes per value, relative error 2^-11 per value, not
a share of its group's range), when no value overflows; it is never a record autograd
unpacks itself (``z``'s and ``x``'s records apply their functions to it). This is what
brought the 8-bit whole-gradient cosine of MobileNetV3 from 0.99988 to 0.99999 and of
EfficientNet-B0 from 0.99966 to 0.99998 (``benchmarks/fidelity.py``).

The bias, which the node does not save, is read from the bias's gradient accumulator
(the node's third input edge), or is 0 without affine parameters; for ``x`` itself (or
its clone) it is measured as ``x - weight·n`` at the first value of each channel. A
frozen bias under a ReLU is not derived. The rebuilt functions (``n`` to ``t`` and ``n``
to ``z``) are compared with ``t`` and ``z`` (to a few units in the last place of the
largest value: the kernel's rounding order differs) the first time per chain, dtype and
device type; a mismatch keeps ``t``'s own record for good (per controller). Not derived: ``z`` kept as
a copy or under the error-bound codec, ``z`` modified in place since it was packed,
other normalisations (their statistics are per sample), cuDNN's batch-norm node (not
checked on a GPU here), and anything between the batch norm and ``t`` but the above.

NOTE [ Batch-norm inputs normalised when no record reads the output ]
A batch norm's output often goes into a sum that saves nothing: a residual block's last
norm and its downsampling shortcut (``out = bn2(conv2(·)); out += identity``), RepVGG's and
MobileOne's parallel branches. No chain forms then, and its input ``z`` stayed in its own
coordinates. Its backward reads ``z`` through ``x̂ = (ẑ - mean)·invstd`` per channel, so a
channel's rounding noise comes back scaled by its own ``invstd``; on a small feature map a
quantisation group spans channels (2x2 positions: 64 channels in a group of 256, 16 in an
8-bit group of 64), each small channel took the step of the group's largest, and its
``x̂`` came back as noise. MobileOne's scale branch (a depthwise 1x1 convolution, whose
channels differ in scale by their single weights) put timm's ``mobileone_s0`` at an 8-bit
whole-gradient cosine of 0.9788, the error in the batch norms after those convolutions (an
ad-hoc attribution, one layer at 8 bits and the rest exact: ``stages.2.*.conv_scale.bn``
and ``stages.3.0.conv_scale.bn`` first); at 2 bits everywhere its gradient came back 10^34
times too large (a channel of near-zero variance read through ``invstd``).

So when a module's output is a batch norm's output (the ``BatchNorm2d`` module's, or a
conv-norm-act module's with no activation) and its input's record has groups that span
channels (a channel's positions not a multiple of the record's group), that pending record
is watched; at the next module output that is not that tensor (or the forward's end), if
no chain was rebuilt from the record meanwhile (an activation above the norm that saves
its result or its input forms one, and moves the record to normalised coordinates
itself), the record is encoded again from ``n = (z - mean)·invstd`` at its own bits and
``z`` is read back as ``n/invstd + mean``, as a chain's root is. The same bytes; one more
encode in the forward that finds it, none from the next on (the slot becomes a root hint:
NOTE [ Roots known from the last forward ] in packing.py), and a pass of the channel map
each way (on the CPU ~3.5 ms for 2.4M values at one thread: why feature maps whose groups
lie in one channel are left as they were). The maps are checked against ``z`` once per
node kind, dtype and device type, as the chain's. ``mobileone_s0``: 8-bit cosine 0.9788 ->
0.99998, the 2-bit gradient's relative error 7.6e34 -> 1.08 (figures of the fidelity
benchmark in benchmarks/README.md).

NOTE [ Unbiased reads of a ReLU result ]
A ReLU result rebuilt from its chain is ``a·n̂ + c`` (``n̂`` the quantised ``n``) under its
exact mask. Stochastic rounding makes ``n̂`` unbiased, and so ``a·n̂ + c``, but a true
positive near zero can come back negative. Projected onto the mask (``max(·, floor)`` where
the mask is 1, NOTE [ Mask floor ] in codecs/base.py), those values are raised and the
others kept, so the mean of the read is above the true value, by about the quantisation
noise, on the small positives that every ReLU result is full of. The next convolution's
weight gradient reads that record too, and averaged the bias instead of the noise: on the
demo's DigitsNet at 2 bits (fixed weights, 256 draws of the codec's rounding) the mean
gradient of the two convolutions after a chain stayed 2-2.5 times further from the exact
one than unbiased draws would put it, and the whole gradient's mean 1.7 times; with the
records separate (no chain, each ReLU result quantised on its own, levels from 0 up) it
was unbiased.

So such a record is decoded unclamped: the map's values where the mask is 1, zero where it
is 0 (exact there), held as usual for its readers (NOTE [ One decode for several readers ]
in shared_decode.py). A reader whose backward is linear in what it reads (a convolution,
a matrix product, an element-wise product) or reads none of its values (max pooling, which
scatters by its indices) takes those values: ``packing._VALUE_READERS``, known by the
autograd node running when it unpacks. Any other reader, ReLU's own backward
above all, whose ``> 0`` test needs the mask's signs, takes them projected as before, a
copy made from the held values in one pass. Measured the same way: the two convolutions
within 1.1-1.2 times of unbiased draws, the whole gradient within 1.06, and each draw's
error the same (5.5% of the gradient's norm).

NOTE [ No chain into a value-dependent derivative ]
A chain's reads share one rounding: the batch norm's backward reads ``n̂`` and the
activation's backward reads ``x̂ = a·n̂ + c``. For ReLU and the other piecewise-linear ops
the derivative comes from the exact region code and the shared noise meets nothing. An op
whose derivative depends on the value inside its region (``derived.VALUE_DEPENDENT``:
hardswish, ELU/SELU, CELU, SiLU, GELU, Mish) reads ``f'(x̂)``, and the batch norm multiplies
that with ``n̂``: its weight's gradient ``Σ g·n̂`` with ``g = u·f'(x̂)``, and the
``n̂·mean(g·n̂)`` term of its input's gradient. ``E[f'(a·n̂ + c)·n̂] = f'(x)·n + a·f''·Var(n̂)``
for hardswish's linear ``f'`` (about so for the others): a bias at every value, of one
sign wherever ``f''`` keeps one, summed over the batch into the batch norm's parameters
and from there into every gradient upstream. Separate records round independently, and
the product's mean is the product of the means.

So a value-dependent op's input keeps a record of its own (its output is recomputed from
that record, raised by the output's bits: NOTE [ Outputs recomputed from the input ] in
derived.py), and the batch norm's input keeps its own, still in normalised coordinates (at
its own bits: in raw coordinates EfficientNet-B0's 20-step run of ``benchmarks/fidelity.py``
reached 86% of plain's loss drop instead of 99%). The op is known only once its output is
seen, after its input was packed (NOTE [ Finding the op that saved a tensor ] in
regions.py), so the match marks the input's slot (as for NOTE [ Roots known from the last
forward ] in packing.py), and the next forward packs the tensor at that slot as a record of
its own; a slot not confirmed in a forward is forgotten. The first forward, and the first
after the model's graph changes, still chain. Measured with ``benchmarks/gradient_bias.py
--act NAME`` (DigitsNet, 2 bits, 128 draws at fixed weights), the whole gradient's mean
against what unbiased draws would give: hardswish 4.5 -> 1.17, ELU 5.1 -> 1.07, SiLU 6.3 ->
2.3, GELU 1.5 -> 1.3, Mish 5.3 -> 3.6 (ReLU, never chained this way, 0.99). The cost is
bytes and noise per draw: the chain held the three tensors in one 4-bit record, now ``z``
keeps 2 bits and ``x`` 4 (hardswish net 15.5x -> 12.9x; one draw's error 19% -> 26% of the
gradient's norm). In ``fidelity.py`` (seed 0): MobileNetV3 default 10.0x -> 9.6x, ``bits=2``
12.3x -> 10.4x, EfficientNet-B0 ``bits=2`` 19.4x -> 14.1x, every loss drop 97-99% of plain's
as before. Keeping ``x`` at its own 2 bits with ``y`` read from it (4 bits in all, as the
chain) left the hardswish net's gradient biased (1.9x, ``f(x̂)``'s curvature at the coarser
step) and EfficientNet-B0 at 91-95% of plain's drop.

What is left on SiLU and Mish is the curvature of the derivative itself:
``E[f'(x̂)] - f'(x) ≈ f'''·Var(x̂)/2`` (hardswish's ``f'`` is linear and shows none). At 4
bits (``x`` at 8) Mish's draws are unbiased (ratio 0.99).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memctl.codecs import channels

__all__ = ["BATCH_NORM", "WIDE_BITS", "Chain", "UnreadNorm", "chain_of", "is_wide", "verified", "widen"]

Function = Callable[[torch.Tensor], torch.Tensor]

WIDE_BITS = 16
"""From this many bits per value, a chain's record is kept in half precision (NOTE [ ... ])."""

# The CPU's node and the GPU's: cuDNN's saves the same fields (its ``result2`` is the inverse
# standard deviation too) but names epsilon ``_saved_epsilon`` (seen on an H200, torch 2.11).
BATCH_NORM = frozenset({"NativeBatchNormBackward0", "CudnnBatchNormBackward0", "MiopenBatchNormBackward0"})
# grad_fn name -> the elementwise op between the batch norm and the packed tensor.
_AFTER: dict[str, Callable[[torch.Tensor], torch.Tensor] | None] = {
    "CloneBackward0": None,  # an in-place activation's copy of x: x itself
    "ReluBackward0": torch.relu,
}


@dataclass(frozen=True)
class Chain:
    """``t = after(a·z + c)`` for the batch norm input ``z`` (NOTE [ Batch-norm outputs ... ])."""

    source: tuple[int, int]
    """The autograd key ``(id(grad_fn), output_nr)`` of ``z``."""
    source_node: Any
    node: Any
    """The batch norm's node."""
    after: str | None
    """The op between the batch norm and ``t`` (None: ``t`` is the batch norm's output)."""

    @property
    def key(self) -> str:
        return type(self.node).__name__ + ("" if self.after is None else "+" + self.after)

    def functions(self, z: torch.Tensor, t: torch.Tensor) -> tuple[Function, Function, Function] | None:
        """``(normalise, z from n, t from n)`` with ``n = (z - mean)·invstd`` (NOTE [ Batch-norm outputs
        ... ], "Normalised coordinates"); None when the node's parameters cannot be read."""
        try:
            stats = _statistics(self.node, z, None if self.after == "ReluBackward0" else t)
        except (AttributeError, RuntimeError, TypeError, ValueError):  # a node without the field
            return None
        if stats is None:
            return None
        shape = [1, -1] + [1] * (z.dim() - 2)
        mean, invstd = (v.view(shape) for v in stats[:2])
        op = _AFTER.get(self.after) if self.after is not None else None
        z_dtype, t_dtype = z.dtype, t.dtype
        flat = [v.reshape(-1) for v in stats]
        # the fused channel passes' vectors (NOTE [ Fused channel passes ]: CPU kernels); none
        # off the CPU, where they would be two launches a chain and a step for nothing
        zero, std = (torch.zeros_like(flat[0]), flat[1].reciprocal()) if _fused_on(flat[0]) else (None, None)

        def normalise(v: torch.Tensor) -> torch.Tensor:
            fast = None if zero is None else channels.affine(v, flat[0], flat[1], zero)
            return fast if fast is not None else (v.to(mean.dtype) - mean).mul_(invstd)

        source = _Source(mean, invstd, flat[0], std, zero, z_dtype)
        output = _Output(flat[3], flat[2], zero, t_dtype, op)
        return normalise, source, output


@dataclass(slots=True)
class UnreadNorm:
    """A batch norm whose output no record has read yet (NOTE [ Batch-norm inputs normalised when
    no record reads the output ])."""

    saved: weakref.ref[Any]
    """The input's record."""
    z: torch.Tensor
    version: int
    output: weakref.ref[torch.Tensor]
    normalise: Function
    z_of: Function


def _fused_on(t: torch.Tensor) -> bool:
    """Whether the fused channel passes (CPU kernels) can run on ``t``'s device."""
    return t.is_cpu


class _Source:
    """``z`` from ``n``: ``n/invstd + mean`` (NOTE [ Batch-norm outputs ... ])."""

    normalised = True
    """Its record holds the batch norm's normalised input (NOTE [ A batch norm's input read twice ])."""

    def __init__(self, mean: torch.Tensor, invstd: torch.Tensor, flat_mean: torch.Tensor,
                 std: torch.Tensor | None, zero: torch.Tensor | None, dtype: torch.dtype) -> None:
        self._mean, self._invstd, self._flat_mean, self._std = mean, invstd, flat_mean, std
        self._zero, self._dtype = zero, dtype

    def __call__(self, n: torch.Tensor) -> torch.Tensor:
        if self._dtype == torch.float32 and self._zero is not None and self._std is not None:
            fast = channels.affine(n, self._zero, self._std, self._flat_mean)
            if fast is not None:
                return fast
        return torch.addcdiv(self._mean, n.to(self._mean.dtype), self._invstd).to(self._dtype)

    def channel_map(self, masked: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(sub, scale, shift)`` of :func:`channels.affine` that :meth:`__call__` applies, where a
        decode can apply it itself (NOTE [ Fused channel passes ]); None otherwise."""
        if masked or self._dtype != torch.float32 or self._zero is None or self._std is None:
            return None
        return self._zero, self._std, self._flat_mean


class _Output:
    """``t`` from ``n``: ``after(weight·n + bias)`` (NOTE [ Batch-norm outputs ... ]); :meth:`masked` also
    applies a ReLU result's region projection in the same pass (NOTE [ Fused channel passes ])."""

    def __init__(self, beta: torch.Tensor, gamma: torch.Tensor, zero: torch.Tensor | None, dtype: torch.dtype,
                 op: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        self._beta, self._gamma, self._zero, self._dtype, self._op = beta, gamma, zero, dtype, op

    def __call__(self, n: torch.Tensor) -> torch.Tensor:
        x = self.linear(n)
        if self._op is None:
            return x
        return x.relu_() if self._op is torch.relu else self._op(x)

    def linear(self, n: torch.Tensor) -> torch.Tensor:
        """``weight·n + bias`` in ``t``'s dtype: ``t`` before the op after the batch norm (a new tensor)."""
        if self._dtype == torch.float32 and self._zero is not None:
            fast = channels.affine(n, self._zero, self._gamma, self._beta)
            if fast is not None:
                return fast
        shape = [1, -1] + [1] * (n.dim() - 2)
        x = torch.addcmul(self._beta.view(shape), n.to(self._beta.dtype), self._gamma.view(shape))
        return x.to(self._dtype)

    def channel_map(self, masked: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(sub, scale, shift)`` of :func:`channels.affine` that :meth:`__call__` (or, ``masked``,
        :meth:`masked`) applies, where a decode can apply it itself (NOTE [ Fused channel
        passes ]); None otherwise."""
        if self._dtype != torch.float32 or (self._op is not None and not masked) or self._zero is None:
            return None
        return self._zero, self._gamma, self._beta

    def masked(self, n: torch.Tensor, mask: torch.Tensor, floor: float) -> torch.Tensor | None:
        """ReLU's region projection of ``self(n)`` under the packed ``mask``; None where the fused
        kernel does not apply (the caller projects ``self(n)`` itself)."""
        if self._dtype != torch.float32 or self._zero is None:
            return None
        return channels.affine(n, self._zero, self._gamma, self._beta, mask=mask, floor=floor)


def chain_of(t: torch.Tensor) -> Chain | None:
    """The batch norm chain ``t`` is the end of (NOTE [ Batch-norm outputs ... ]), else None."""
    node = t.grad_fn
    if node is None or int(t.output_nr) != 0 or t.dim() < 2:
        return None
    after = None
    name = type(node).__name__
    if name in _AFTER:
        after = name
        node, nr = node.next_functions[0] if node.next_functions else (None, 0)
        if node is None or int(nr) != 0:
            return None
    if type(node).__name__ not in BATCH_NORM or not node.next_functions:
        return None
    source, nr = node.next_functions[0]
    if source is None:
        return None
    return Chain((id(source), int(nr)), source, node, after)


def verified(fn: Function, z: torch.Tensor, t: torch.Tensor) -> bool:
    """``fn(z)`` equals ``t`` up to the rounding of a differently ordered computation."""
    got = fn(z)
    if got.shape != t.shape or got.dtype != t.dtype:
        return False
    scale = float(t.detach().abs().amax()) if t.numel() else 0.0
    tol = 16.0 * float(torch.finfo(t.dtype).eps) * max(scale, 1.0)
    diff = (got.float() - t.detach().float()).abs()
    return bool(torch.isfinite(diff).all()) and float(diff.amax()) <= tol


_Stats = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _statistics(node: Any, z: torch.Tensor, x: torch.Tensor | None) -> _Stats | None:
    """Per-channel ``(mean, invstd, weight, bias)`` (float32), ``x = weight·(z - mean)·invstd + bias``."""
    channels = int(z.shape[1])
    if bool(node._saved_training):
        mean, invstd = node._saved_result1, node._saved_result2
    else:
        mean, var = node._saved_running_mean, node._saved_running_var
        if mean is None or var is None:
            return None
        eps = getattr(node, "_saved_eps", None)
        invstd = torch.rsqrt(var.float() + float(node._saved_epsilon if eps is None else eps))
    if mean is None or invstd is None or mean.numel() != channels or invstd.numel() != channels:
        return None
    mean = mean.detach().float().reshape(-1)
    invstd = invstd.detach().float().reshape(-1)
    usable = (invstd > 0) & (invstd < math.inf)  # finite and positive (isfinite is four ops, this two)
    if invstd.is_cpu:
        if not bool(usable.all()):  # one read-back, not two
            return None
    else:  # no read-back that waits for the GPU: an unusable channel decodes to NaN, never to wrong values
        invstd = torch.where(usable, invstd, torch.nan)
    weight = node._saved_weight
    gamma = torch.ones_like(mean) if weight is None else weight.detach().float().reshape(-1)
    bias = _bias(node)
    if bias is not None:
        beta = bias.float().reshape(-1)
    elif weight is None:
        beta = torch.zeros_like(mean)
    elif x is not None:  # measured at each channel's first value
        z0 = z.detach()[0].reshape(channels, -1)[:, 0].float()
        x0 = x.detach()[0].reshape(channels, -1)[:, 0].float()
        beta = x0 - gamma * (z0 - mean) * invstd
    else:
        return None
    if gamma.numel() != channels or beta.numel() != channels:
        return None
    return mean.contiguous(), invstd.contiguous(), gamma.contiguous(), beta.contiguous()


def _bias(node: Any) -> torch.Tensor | None:
    edges = node.next_functions
    if len(edges) < 3 or edges[2][0] is None:
        return None
    var = getattr(edges[2][0], "variable", None)
    return var.detach() if isinstance(var, torch.Tensor) else None


def is_wide(data: Any) -> bool:
    """A chain's record kept in half precision by :func:`widen`."""
    return isinstance(data, torch.Tensor) and data.dtype == torch.float16


def widen(source: torch.Tensor) -> torch.Tensor | None:
    """``source`` (float32) in half precision, or None where that would overflow."""
    wide = source.detach().to(torch.float16)
    # One read-back: the half copy may not be non-finite where the source is finite.
    if not bool(torch.isfinite(wide).all() == torch.isfinite(source).all()):
        return None
    return wide
