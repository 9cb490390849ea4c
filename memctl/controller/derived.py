"""Outputs of piecewise activations recomputed from their saved input (no payload of their own).

NOTE [ Outputs recomputed from the input ]
An op of the region table that saves its *input* ``x`` (hardswish, ELU/SELU/CELU,
hardtanh/ReLU6, leaky_relu, ...) is usually followed by a layer that saves its *output*
``y = f(x)`` (the next convolution or linear layer). Compressed separately, the two
records each carry their own quantisation error at the layers' bits ``b_x`` and ``b_y``:
the op's backward reads the derivative off ``x̂`` (for hardswish ``x/3 + 1/2``, for ELU
``exp(x)``: inside a region it depends on the value, so the region code alone cannot
make it exact), and the next layer's weight gradient reads ``ŷ``. At 2 bits both errors
are large, and the whole-model gradient of such a net fell well below a ReLU net's,
whose derivative is exact and whose output is half exact zeros.

``y`` holds no information that ``x`` lacks, so memctl spends the bits on one record
instead of two: when ``y`` is packed and it is the direct output (``y.grad_fn`` is the
op's node) of a table op whose input record is a quantised payload, ``x`` is encoded
again at ``b_x + b_y`` bits (at most 8, rounded down to a width of the codec: 1, 2, 4 or
8; 1 + 2 bits give 2, and the bit left over is saved, never spent beyond what the
layers were given; and no wider than the bytes the two records held: an 8-bit record's
groups cost more, NOTE [ Eight-bit groups ] in the quantize codec; where that holds the
root at no more than ``b_y`` bits, 4 + 4 bits, ``y`` keeps its own record instead, which
reads it finer) and ``y``'s record keeps no payload; unpacking it
decodes ``x̂`` (projected into its regions) and applies ``f`` with the node's own
parameters. The bytes are those of the two records before (``b_x + b_y`` bits per
value), the error of both reads is that of one record at twice the bits (the step
shrinks about 5x from 2 to 4 bits), and ``f`` is Lipschitz on the regions, so ``ŷ``'s
error is at most ``x̂``'s times ``f'`` (ELU's negative branch shrinks it by ``exp(x)``).
The extra bytes of ``x``'s record are counted in ``y``'s layer, which still prices
``b_y`` bits per value of ``y``: the allocation's per-layer accounting is unchanged.

Smooth ops that save their input (SiLU, GELU, Mish: ``regions.SMOOTH``) have no branch
to keep but the same pair of records (EfficientNet's in-place SiLU before a depthwise
convolution, a transformer's GELU between two linear layers); they are matched like the
table's ops, with no region code, and their output is recomputed the same way. When
``x``'s record is itself recomputed from a batch norm's input (NOTE [ Batch-norm outputs
recomputed from the input ] in normalized.py), ``y``'s bits go to that record, the start
of the chain (a value-dependent op's input is chained only in the first forward: NOTE [ No
chain into a value-dependent derivative ] there).

Alternatives tried on the conv net of ``benchmarks/activations.py`` (2 bits, 5 seeds;
one-off experiments, not kept as benchmark modes):
quantising ``x``'s derivative coordinate (``x`` for hardswish, ``exp(x)`` for ELU) over
the region's fixed range at the same bits changed nothing for hardswish (0.941, its
group range is about the region's); even an *exact* ``x`` left the net at 0.963 against
ReLU's 0.985, because the next layer's ``ŷ`` (no exact zeros, a wider range than a ReLU
output) carries the rest of the error. Computing ``x`` from ``ŷ`` was not tried:
hardswish's inverse is ill-conditioned at its vertex. Recomputing ``ŷ`` from a finer
``x̂`` gained on every op of the table (figures in benchmarks/README.md).

An input of a *value-dependent* op (hardswish, ELU/SELU/CELU: the derivative varies
inside a region) whose output no record holds (the op feeds a mean, a sum or a residual
add, whose backward saves nothing) has no second record to take bits from; at the end of
the forward it is encoded again at twice its bits (at most 8) on its own, and the extra
bytes count as the layer's ``mask_bytes``, so the allocation prices them from the next
step on. At most two matched inputs are held, raw, waiting for their output to be
saved (as for the pending inputs); one pushed out by a third is raised then. On the
conv net this costs 10.5x -> 9.4x (hardswish) and 12.0x -> 10.6x (ELU) at 2 bits, and
brings the hardswish net's cosine from 0.975 to 0.988.

``y`` is matched also when the record is a reshape of it (up to four view, reshape or
alias nodes between them, which keep the values' order): ``nn.Linear`` flattens a 3-d
input to 2-d before its matmul, so in a transformer's MLP the next layer's record is a
view of the activation's output; ``f`` is then followed by the reshape. Ops written as
several PyTorch ops, and outputs offered from a module's exit: NOTE [ Elementwise
expressions ] in expressions.py.

NOTE [ A derived output read back into its derivative ]
For a value-dependent op (:data:`VALUE_DEPENDENT`) the output read ``ŷ = f(x̂)`` and the
op's own backward's ``f'(x̂)`` come from one rounding. A reader that only passes ``ŷ`` on to
another operand's gradient (a linear layer's weight gradient ``gᵀ·ŷ``) keeps the two apart,
but a reader whose gradient into ``y`` depends on ``ŷ`` itself multiplies them: the mean of
``f'(x̂)·h(f(x̂))`` is not ``f'(x)·h(f(x))``. Such readers are a norm (LayerNorm's backward
holds ``x̂ₕ·mean(g·x̂ₕ)``) and any op that reads its input for its own derivative. On
``benchmarks/gradient_bias.py --model bert`` (uniform 2 bits) the mean of 64 draws stayed
1.69 times as far from the exact gradient as unbiased draws would be, every layer's biases
about 3.5 times: the masked-LM head's ``dense → GELU → LayerNorm`` put a bias into the
gradient all layers below it read.

So when a derived output of a value-dependent op is unpacked, the reading node is judged
(:func:`reads_back`): anything but a matrix product, convolution or element-wise product
(and a product of the output with itself) gives the output's place (its layer and its
place among the layer's packs) a record of its own from the next forward on, at its
layer's bits, and the op's input is raised as an input whose output no record holds (so
the op's derivative keeps the finer read). The first step's reads stay as they were. A
reader judged harmless is not judged again at that place. BERT: 1.69 -> 1.04, and one
draw's error 15.4% -> 14.3% of the gradient's norm.

A product whose other operand is computed from ``y`` (the squeeze-excitation scale) is
left derived: there the shared rounding meets itself only through the scale's sum over
positions, and the bias left once NOTE [ A batch norm's input read twice ] (norm_reads.py)
was removed is small (mean of 48 draws over the unbiased figure: MobileNetV3 1.06,
EfficientNet-B0 1.03), while a record of its own (2 + 2 bits where one 4-bit record was)
adds noise to every read: judged like a norm, it took EfficientNet-B0's 20-step loss drop
of ``benchmarks/fidelity.py`` from 97.1% to 93.4% at the default policy and from 93.6% to
88.8% at ``bits=2``.

Not derived (today's path): ``y`` saved at kept-exact bits or by the error-bound codec
(``f`` can stretch an absolute bound by its slope, 1.5 for hardswish), ``x`` kept as a
copy, ``x`` modified in place since it was packed, ops whose forward cannot be rebuilt
from the node or whose rebuilt ``f``
does not reproduce ``y`` bit for bit (checked the first time an op is seen per dtype and
device type, so that the check's device-to-host read is paid once; ``threshold``'s node
does not save its replacement value, which is read off ``y`` where the op replaced
``x``), and outputs that are not the op's own result or a reshape of it (a slice, a
permute, a later op's). Calibration replays one layer at a time and does not raise the
unread inputs, so its measured variance is that of the
separate records at the layers' own bits (an overestimate for the records derived or
raised in training: it errs towards more bits).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["DERIVED_MAX_BITS", "PRODUCTS", "RESHAPES", "VALUE_DEPENDENT", "DerivableOutputs", "Derived",
           "output_function", "reads_back", "reshaped_from", "root_of", "width_within"]

DERIVED_MAX_BITS = 8
"""The most bits the input record is raised to (NOTE [ Outputs recomputed from the input ])."""

Function = Callable[[torch.Tensor], torch.Tensor]

_WIDTHS = (1, 2, 4, 8)
"""The quantize codec's widths."""


def width_within(bits: int) -> int:
    """The widest quantize width of at most ``bits`` (and :data:`DERIVED_MAX_BITS`) bits."""
    return max(w for w in _WIDTHS if w <= max(1, min(DERIVED_MAX_BITS, bits)))


def _f(node: Any, name: str) -> float:
    return float(getattr(node, name))


def _hardtanh(node: Any) -> Function:
    lo, hi = _f(node, "_saved_min_val"), _f(node, "_saved_max_val")
    return lambda x: F.hardtanh(x, lo, hi)


def _leaky(node: Any) -> Function:
    slope = _f(node, "_saved_negative_slope")
    return lambda x: F.leaky_relu(x, slope)


def _elu(node: Any) -> Function:
    alpha, scale = _f(node, "_saved_alpha"), _f(node, "_saved_scale")
    input_scale = _f(node, "_saved_input_scale")
    return lambda x: torch.ops.aten.elu(x, alpha, scale, input_scale)


def _celu(node: Any) -> Function:
    alpha = _f(node, "_saved_alpha")
    return lambda x: F.celu(x, alpha)


def _clamp(node: Any) -> Function | None:
    lo, hi = node._saved_min, node._saved_max
    if isinstance(lo, torch.Tensor) or isinstance(hi, torch.Tensor):
        return None
    return lambda x: x.clamp(lo, hi)


def _clamp_min(node: Any) -> Function:
    lo = _f(node, "_saved_min")
    return lambda x: x.clamp_min(lo)


def _clamp_max(node: Any) -> Function:
    hi = _f(node, "_saved_max")
    return lambda x: x.clamp_max(hi)


def _prelu(node: Any) -> Function:
    weight = node._saved_weight.detach()  # already shaped to broadcast over x
    return lambda x: torch.where(x > 0, x, weight.to(x.dtype) * x)


def _rrelu(node: Any) -> Function | None:
    lower, upper = _f(node, "_saved_lower"), _f(node, "_saved_upper")
    if bool(node._saved_training) and upper - lower > 1e-6:
        return None  # training mode: the slope is per-value noise
    slope = (lower + upper) / 2.0
    return lambda x: F.leaky_relu(x, slope)


def _gelu(node: Any) -> Function:
    approximate = str(node._saved_approximate)
    return lambda x: F.gelu(x, approximate=approximate)


def _shrink(op: Callable[[torch.Tensor, float], torch.Tensor]) -> Callable[[Any], Function]:
    def rule(node: Any) -> Function:
        lam = _f(node, "_saved_lambd")
        return lambda x: op(x, lam)

    return rule


def _threshold(node: Any, x: torch.Tensor, y: torch.Tensor) -> Function:
    """threshold's node keeps the threshold, not the replacement value: that is read off the output,
    at the first value the op replaced (any value will do when none was)."""
    th = _f(node, "_saved_threshold")
    replaced = (x <= th).flatten().nonzero()
    value = float(y.flatten()[replaced[0, 0]]) if replaced.numel() else 0.0
    return lambda v: F.threshold(v, th, value)


# grad_fn name -> the op's forward, rebuilt from the node's saved parameters and the op's input and output.
_FROM_DATA: dict[str, Callable[[Any, torch.Tensor, torch.Tensor], Function]] = {
    "ThresholdBackward0": _threshold,
}

# grad_fn name -> the op's forward, rebuilt from the node's saved parameters.
_FORWARD: dict[str, Callable[[Any], Function | None]] = {
    "HardswishBackward0": lambda node: F.hardswish,
    "HardsigmoidBackward0": lambda node: F.hardsigmoid,
    "HardtanhBackward0": _hardtanh,
    "LeakyReluBackward0": _leaky,
    "RreluWithNoiseBackward0": _rrelu,
    "EluBackward0": _elu,
    "CeluBackward0": _celu,
    "ClampBackward1": _clamp,
    "ClampMinBackward0": _clamp_min,
    "ClampMaxBackward0": _clamp_max,
    "PreluKernelBackward0": _prelu,
    "AbsBackward0": lambda node: torch.abs,
    "SiluBackward0": lambda node: F.silu,
    "GeluBackward0": _gelu,
    "MishBackward0": lambda node: F.mish,
    "HardshrinkBackward0": _shrink(F.hardshrink),
    "SoftshrinkBackward0": _shrink(F.softshrink),
}


def output_function(node: Any) -> Function | None:
    """``f`` with ``y = f(x)`` for a table op's node that saved its input ``x`` (else None)."""
    rule = _FORWARD.get(type(node).__name__)
    if rule is None:
        return None
    try:
        return rule(node)
    except (AttributeError, RuntimeError, TypeError, ValueError):  # a node without the field
        return None


def root_of(saved: Any) -> Any:
    """The record at the start of a chain of derived records (``saved`` itself if not derived)."""
    while isinstance(saved.data, Derived):
        saved = saved.data.source
    return saved


@dataclass(frozen=True, eq=False)
class Derived:
    """A saved output with no payload: ``fn`` applied to the decoded input record ``source``."""

    source: Any
    """The input's ``Saved`` record (strong: ``y``'s backward runs before ``x``'s)."""
    fn: Callable[..., torch.Tensor]
    """The decoded ``source`` (then the decoded ``others``, in order) to the output."""
    others: tuple[Any, ...] = ()
    """More input records (NOTE [ Elementwise expressions ] in expressions.py: a second root)."""
    reads: tuple[Any, str] | None = None
    """For a value-dependent op's output, its place and the op's node type, under which its
    readers are judged (NOTE [ A derived output read back into its derivative ])."""

    @property
    def codec(self) -> str:
        return "derived"

    @property
    def nbytes(self) -> int:
        return 0


_Key = tuple[str, torch.dtype, str]
_Unread = tuple[Any, torch.Tensor]
"""An input record and its input, of a value-dependent op whose output no record holds."""


@dataclass(frozen=True, eq=False)
class _Offer:
    node: Any
    saved: weakref.ref[Any]
    source: torch.Tensor
    version: int
    fn: Function | None
    """None: read off the output when it is saved (:data:`_FROM_DATA`)."""


class DerivableOutputs:
    """Table ops whose input record may serve their output too (NOTE [ Outputs recomputed ... ]).

    Entries hold the op's node and its input strongly, like the pending inputs of
    :class:`~memctl.controller.regions.RegionTracker`, and are dropped with them.
    """

    def __init__(self) -> None:
        self._offers: dict[int, _Offer] = {}
        self._raw: dict[int, tuple[weakref.ref[Any], torch.Tensor, int]] = {}
        self.verified: set[_Key] = set()
        """Ops (and dtype, device type) whose rebuilt ``f`` reproduced ``y`` once: checked no more."""

    def __bool__(self) -> bool:
        """Whether some output is on offer."""
        return bool(self._offers)

    def clear(self) -> None:
        self._offers.clear()
        self._raw.clear()

    def remember(self, saved: Any, source: torch.Tensor) -> None:
        """``saved`` (a quantised record) encodes ``source``: kept so that a chain derived from it
        can raise it again (NOTE [ Batch-norm outputs recomputed from the input ] in normalized.py).
        At most :data:`_OFFERS` raw tensors are held, as for the offers."""
        self._raw.pop(id(saved), None)
        self._raw[id(saved)] = (weakref.ref(saved), source, source._version)
        while len(self._raw) > _OFFERS:
            del self._raw[next(iter(self._raw))]

    def raw(self, saved: Any) -> torch.Tensor | None:
        """The tensor :meth:`remember` kept for ``saved``, unmodified since, else None."""
        entry = self._raw.get(id(saved))
        if entry is None or entry[0]() is not saved or entry[1]._version != entry[2]:
            return None
        return entry[1]

    def offer(self, node: Any, saved: Any, source: torch.Tensor, version: int) -> list[_Unread]:
        """The op ``node`` saved ``source`` (now recorded as ``saved``).

        Returns what :meth:`leftover` would for the offers this one pushes out of the table
        (at most :data:`_OFFERS` inputs are held, as for the pending inputs).
        """
        fn = output_function(node)
        if fn is None and type(node).__name__ not in _FROM_DATA:
            return []
        self._offers.pop(id(node), None)
        self._offers[id(node)] = _Offer(node, weakref.ref(saved), source, version, fn)
        evicted = []
        while len(self._offers) > _OFFERS:
            evicted.append(self._offers.pop(next(iter(self._offers))))
        return _unread(evicted)

    def offered(self, node: Any) -> bool:
        return id(node) in self._offers

    def leftover(self) -> list[_Unread]:
        """``(input record, input)`` of value-dependent ops whose output nobody saved; clears the table."""
        out = _unread(list(self._offers.values()))
        self._offers.clear()
        return out

    def take(self, t: torch.Tensor) -> tuple[Any, torch.Tensor, Function, _Key] | None:
        """``(input record, input, f, key of verified)`` when ``t`` is the output of an offered op,
        directly or through reshapes (NOTE [ Outputs recomputed from the input ])."""
        if t.grad_fn is None or not self._offers:
            return None
        node, nr = reshaped_from(t)
        if nr != 0:
            return None
        offer = self._offers.pop(id(node), None)
        if offer is None or offer.node is not node or offer.source._version != offer.version:
            return None
        saved = offer.saved()
        reshaped = node is not t.grad_fn
        key = (type(node).__name__ + ("/reshape" if reshaped else ""), t.dtype, t.device.type)
        fn = offer.fn
        if fn is None:
            try:
                output = t.detach().reshape(offer.source.shape)
                fn = _FROM_DATA[type(node).__name__](node, offer.source.detach(), output)
            except (AttributeError, RuntimeError, TypeError, ValueError):  # a node without the field
                fn = None
        if fn is not None and reshaped:
            fn = _reshaping(fn, t.shape)
        return None if saved is None or fn is None else (saved, offer.source, fn, key)


_OFFERS = 2

# Autograd nodes of ops whose output is their input's values in the same (row-major) order.
RESHAPES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AliasBackward0"})
_MAX_RESHAPES = 4


def reshaped_from(t: torch.Tensor) -> tuple[Any, int]:
    """The node (and output number) whose output ``t`` is, looking through up to
    :data:`_MAX_RESHAPES` reshapes (``nn.Linear`` flattens a 3-d input to 2-d before its matmul)."""
    return through_reshapes(t.grad_fn, int(t.output_nr))


def through_reshapes(node: Any, nr: int = 0) -> tuple[Any, int]:
    """``node`` (output ``nr``), or the node up to :data:`_MAX_RESHAPES` reshapes above it."""
    for _ in range(_MAX_RESHAPES):
        if node is None or type(node).__name__ not in RESHAPES:
            break
        node, nr = node.next_functions[0]
    return node, int(nr)


PRODUCTS = frozenset({"ConvolutionBackward0", "MkldnnConvolutionBackward0", "CudnnConvolutionBackward0",
                      "MmBackward0", "AddmmBackward0", "BmmBackward0", "MulBackward0"})
"""Backward nodes linear in each operand: a saved operand is read for the other operands' gradients."""


def reads_back(node: Any, op: str) -> bool:
    """Whether ``node``, reading an output of an ``op`` node (through reshapes), makes the gradient
    into that output depend on the value read (NOTE [ A derived output read back into its
    derivative ]): any reader but a product, and a product of the output with itself."""
    if type(node).__name__ not in PRODUCTS:
        return True
    sources = [through_reshapes(edge)[0] for edge, _ in node.next_functions if edge is not None]
    reached = [source for source in sources if source is not None and type(source).__name__ == op]
    return len(reached) > 1 and len({source._sequence_nr() for source in reached}) == 1


def _reshaping(fn: Function, shape: torch.Size) -> Function:
    return lambda x: fn(x).reshape(shape)


def _unread(offers: list[_Offer]) -> list[_Unread]:
    out = []
    for offer in offers:
        saved = offer.saved()
        if (saved is not None and type(offer.node).__name__ in VALUE_DEPENDENT
                and offer.source._version == offer.version):
            out.append((saved, offer.source))
    return out


VALUE_DEPENDENT = frozenset({"HardswishBackward0", "EluBackward0", "CeluBackward0", "SiluBackward0",
                             "GeluBackward0", "MishBackward0"})
"""Ops whose derivative depends on the value inside a region (not only on the branch)."""
