"""Bit floors for the tensors that named autograd ops save, whatever their layer's bits.

NOTE [ Bit floors ]
Some saved tensors cannot take the few bits the allocation gives their layer, because
of what the op's backward does with them, not because of their layer:

- ``scaled_dot_product_attention`` saves query, key, value, its output and the
  logsumexp of each row of logits (the CPU flash kernel; the CUDA kernels save the
  same plus random-number state). Its backward recomputes the probabilities as
  ``exp(q·kᵀ·scale − logsumexp)`` from the saved query and key: with 2-bit query and key
  a logit can exceed the saved logsumexp by several units, and the exponential turns
  that into probabilities far above 1, a heavy-tailed error that no variance model
  predicts. An explicit attention, ``softmax(q @ kᵀ · scale) @ v``, saves the operands of
  its two matmuls and the probabilities (the softmax's result, and again as the second
  matmul's operand).
- LayerNorm: its output feeds the linear layers that make the attention's query, key and
  value (and the MLP's input), whose weight gradients read it; one quantisation group of
  256 values spans tokens (a ViT of width 192 puts more than one token in a group), so
  one outlier token widens the range of the whole group. Its input is the residual
  stream.

So every such tensor is stored at ``max(layer bits, floor)`` bits, and the floats an
attention op saves that carry no gradient (the logsumexp: one value per row,
``1/head_dim`` of the query) are kept exact. The floors (in
:class:`~memctl.controller.config.ControllerConfig`; ``None`` turns one off):
``attention_bits`` (default 8) for what the backward exponentiates, the query, the key and
the probabilities; ``attention_value_bits`` (default 4) for what it reads linearly, the
value and the output (``dV = Pᵀ·dO``, ``dP = dO·Vᵀ`` and the row sums ``rowsum(dO ∘ O)``
that the flash backward subtracts inside the softmax's derivative: an error there is an
error of the same size in the gradient, not an exponentiated one); ``norm_bits``
(default 4) for LayerNorm and RMSNorm. Measured
on the byte-level LM of benchmarks/convergence.py (3 blocks, uniform 2 bits, calibration
and guard off, 300 steps, seed 0, validation loss against plain): no floor +9.1%; the
attention's tensors at 8 bits +3.3% (only query and key at 8: +3.9%); LayerNorm's outputs
at 8 bits as well +1.6%, at 4 bits +1.8%; LayerNorm's inputs alone at 8 bits +3.0%;
LayerNorm's inputs and outputs at 4 bits +1.5%;
smaller groups (128 values, one token) for every tensor instead +2.8% (benchmarks/README.md).
Value and output at 4 bits instead of 8 (the defaults since) cost +0.3 points there
(+0.74% → +1.04% at seed 0, on the code of 2026-11-23) for 6.7x → 7.4x, and raise the
library transformers' ratio 2-11% at the same loss drop (benchmarks/README.md).

A tensor held at its floor is outside the allocation's control: its bytes count as the
layer's ``fixed_bytes`` (and ``floored_bytes`` in ``stats()["layers"]``), not as values
the layer's bits decide, nor in its range statistics, so the allocation neither prices
nor credits them, and the activation ratio counts them as stored.

The ops are recognised by their autograd node's type, as NOTE [ Finding the op that
saved a tensor ] (regions.py) recognises piecewise activations. An op that saves its
result (the attention's output, softmax) is known when that result is packed, because
its ``grad_fn`` is the op's node; an op's output that the next op saves (LayerNorm's, the
probabilities as a matmul operand) is known from its ``grad_fn`` through view-like nodes
(:data:`VIEWS`) and casts (a bfloat16 model's ``F.rms_norm`` on a CPU computes in float32
and casts its output back); an explicit RMSNorm (Hugging Face's ``LlamaRMSNorm``, no node of
its own) is recognised by its multiplication by an ``rsqrt``. Both get the floor at once.
Inputs (query, key, value, the matmul operands, LayerNorm's input) are packed before the
node that saves them exists: the :data:`RECENT` most recent compressed records keep their
source tensor, keyed by autograd identity, and each later pack walks a few nodes up from its ``grad_fn``
(view-like nodes cost no step); a table op there whose input edges are recent records
has them encoded again at the floor. An explicit attention's matmuls are recognised by
their place: the matmul below a softmax through scaling, masking and views (q @ kᵀ), and
a matmul with a softmax's output as an operand (p @ v). The floats without a gradient
packed between an attention op's first input and its output are its own
non-differentiable outputs (nothing else packs inside one op's autograd wrapper) and are
kept exact. A record the window has let go keeps its layer's bits (the path without
floors), never a wrong value. Floors apply to the ``quantize`` codec's records;
``codec="errorbound"`` keeps its bounds.

The walks stop in a model where they found nothing for a while
(NOTE [ Walks that find nothing ] in walks.py).

NOTE [ Norm statistics ]
LayerNorm saves, besides its input, the mean and inverse standard deviation of every row
(``native_layer_norm``'s second and third outputs: floats without a gradient, one value
per row); an explicit RMSNorm saves ``rsqrt(mean(x²) + eps)``, one value per row, for its
product. Below ``min_numel`` values they are kept as they are, like any small tensor,
but a language model's batch has more rows than that (8 sequences of 512 tokens: 4096),
and then they were quantised at the layer's bits (LayerNorm's) or at the norm's floor
(RMSNorm's). A row's statistic scales every value of that row in the backward, and one
quantisation group of them spans 256 rows whose scales can differ by orders of
magnitude. On a 3-block LayerNorm MLP over 16 x 512 tokens at 2 bits (rows scaled
0.2-5), the first norm's weight gradient came back with a relative error of 0.26 (0.16
for the last); with the statistics exact, 0.07 and 0.06, the biases' errors halved too,
for two exact floats per row (2/D of the input's raw bytes; 2.4% of the ratio at width 64,
9.98x to 9.74x). So the floats without a gradient that a LayerNorm (or the fused RMSNorm) saves
after its input are kept exact, as the attention's logsumexp is, found the same way when
the norm's node shows up; so is the ``rsqrt`` an explicit RMSNorm multiplies by. This
holds whatever ``norm_bits`` is (it is not a floor: ``norm_bits=None`` still keeps them),
while some floor is set (the walks run only then). GroupNorm's mean and inverse standard
deviation (one per sample and group; outputs of its node, which has no floor) are kept
exact the same way: a diffusion model's batch of 256 with 32 groups has 8192 of them;
they are known by their node alone. A LayerNorm whose input was not compressed (a model
input, a layer kept exact) leaves nothing to anchor its statistics by (they have no
node), and they keep the layer's bits.

NOTE [ Norm rows in groups of their own ]
A norm scales each row by its own statistic (LayerNorm's and RMSNorm's ``rstd``, one per
token), and its backward reads the saved input through that scale: ``x̂ · rstd``. A
quantisation group of 256 values spans rows when a row is not a multiple of 256 long (a
width of 128, 192, 384, 576, 896, 960: small LMs, ViT-Tiny/Small, CaiT, Swin), and then a
row's quantisation step is set by the largest row beside it. Two cases wrecked gradients:
- A row of zeros (the embedding of a padding index is zero in every Hugging Face model that
  declares one, and a pad token's residual stream stays zero in recurrent models) has
  ``rstd = 1/sqrt(eps)``, ~1000: the noise its zeros take from the neighbouring row's step
  comes back 1000 times larger, and squared through the backward's ``x̂ · mean(x̂ · g)``.
  RecurrentGemma (transformers, width 128, ``fidelity.py``'s ad-hoc sweep): one norm's input
  at 8 bits, every other tensor exact, gave a whole-gradient error of 3.4 times the
  gradient's norm; every layer at 2 bits, 4.8e13 times.
- A row of another scale than its neighbours (CaiT's class token beside the patch tokens in
  the final norm, whose gradient flows through that row alone): at 2 bits the final norm
  alone put an error of 0.49 of the gradient's norm into the whole gradient; training at
  ``bits=2`` reached 55% of plain's loss drop over 20 steps.
So a norm's input and output records are quantised in groups that divide the row:
:func:`row_group` picks the largest multiple of 8 up to the configured group size that
divides the row's length (192 for a width of 192 or 384, 224 for 896, 240 for 960), at
least :data:`_LEAST_ROW_GROUP` values: each group carries 8 bytes of range, a quarter of a
4-bit group of 64 values (``fidelity.py``'s ``transformer_block``, width 64, in groups of 64:
9.7x -> 9.1x at the default policy); a row that is a multiple of the group already, or has
no such divisor, keeps the configured group. A zero row then decodes to zeros exactly (its
groups have no range), and every row keeps the relative precision of its own scale. Rows
are the last dimension (a norm over several trailing dimensions has rows that are multiples
of it). With them: the norm's input alone at 8 bits 0.005 of the gradient's norm, every
layer at 2 bits 0.98 (RecurrentGemma); CaiT's final norm at 2 bits 0.006. The record is
found by the floor walk (the norm's node shows up after its input was packed): a record
already at or above the floor is stored again at its own bits in row groups and stays under
the allocation's control, and the same place packs in row groups from the next forward on
(NOTE [ Floors known from the last forward ]). A norm output kept at the floor is packed in
row groups at once. The allocation prices every record at the configured group (a group of
192 adds 1/96 of a bit a value of metadata: 4% of a record at 2 bits).

NOTE [ Floors through dropout ]
A norm's output read through a dropout (``F.dropout`` on a CPU multiplies by a mask that has
no gradient, ``native_dropout`` on a GPU) kept no floor: its reader saved the dropout's
output, whose node is the mask's product, not the norm's. peft's LoRA applies
``lora_dropout`` to the norm's output before ``A``, so every adapted projection's ``A`` read
its input at the layer's 2 bits where, without the dropout (or in full fine-tuning, which
reads the norm's output itself), it read it at ``norm_bits``: holding those inputs took a
small Llama's LoRA run at ``bits=2`` from 85.6% to 88.7% of plain's loss drop in 30 steps.
So the output-kind walk (:meth:`FloorTracker.result_floor`) steps through a dropout's
product to its operand as it steps through views and casts: a dropout of a norm's output
takes the norm's floor. (Any product with a tensor without a gradient is taken as such a
mask: a norm output scaled by a constant tensor keeps its floor too.)
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memctl.controller.walks import QuietWalks

__all__ = [
    "ATTENTION", "CASTS", "HOLDING", "NORM", "RECENT", "VALUES", "VIEWS", "FloorTracker", "Raise", "is_rsqrt",
    "row_group",
]

RECENT = 6
"""Compressed records that wait for the op that saved them (query, key, value, logsumexp, ...)."""

_WALK_DEPTH = 2

ATTENTION = "attention"
"""Query, key and probabilities: what an attention's backward exponentiates."""
VALUES = "attention_values"
"""Value and output: what an attention's backward reads linearly."""
NORM = "norm"
STATISTICS = "statistics"
"""A norm's statistics only: no floor for its tensors (NOTE [ Norm statistics ])."""



_LEAST_ROW_GROUP = 128
"""The smallest group :func:`row_group` picks (NOTE [ Norm rows in groups of their own ])."""


def row_group(t: torch.Tensor, group: int) -> int:
    """The quantisation group for a norm's record ``t`` whose rows are its last dimension: the
    largest multiple of 8 up to ``group`` (and at least :data:`_LEAST_ROW_GROUP`) that divides
    the row, or ``group`` itself when it divides the row or nothing does (NOTE [ Norm rows in
    groups of their own ])."""
    if t.dim() < 2:
        return group
    row = int(t.shape[-1])
    if row <= 0 or row % group == 0:
        return group
    for g in range(min(group, row) // 8 * 8, _LEAST_ROW_GROUP - 1, -8):
        if row % g == 0:
            return g
    return group


@dataclass(frozen=True)
class _Op:
    kind: str
    result: bool
    """The op saves its own result (floored when packed)."""
    inputs: bool
    """The op saves its inputs (floored when the op's node shows up)."""
    exact_extras: bool = False
    """Its saved floats without a gradient (logsumexp) are kept exact."""
    output: bool = False
    """Its output (or a view of it), when the next op saves it, is floored too."""
    result_kind: str | None = None
    """The floor of its saved result, when not ``kind``'s."""
    input_kinds: tuple[str, ...] = ()
    """The floor of each saved input by its place, when not ``kind``'s (the rest: ``kind``'s)."""

    def input_kind(self, index: int) -> str:
        return self.input_kinds[index] if index < len(self.input_kinds) else self.kind


# query, key, value (attn_mask, when it has a gradient, takes the query's floor)
_SDPA = _Op(ATTENTION, result=True, inputs=True, exact_extras=True, result_kind=VALUES,
            input_kinds=(ATTENTION, ATTENTION, VALUES))
_OPS: dict[str, _Op] = {
    "ScaledDotProductFlashAttentionForCpuBackward0": _SDPA,
    "ScaledDotProductFlashAttentionBackward0": _SDPA,
    "ScaledDotProductEfficientAttentionBackward0": _SDPA,
    "ScaledDotProductCudnnAttentionBackward0": _SDPA,
    "ScaledDotProductFusedAttentionOverrideableBackward0": _SDPA,
    "SoftmaxBackward0": _Op(ATTENTION, result=True, inputs=False, output=True),
    "SafeSoftmaxBackward0": _Op(ATTENTION, result=True, inputs=False, output=True),
    # their mean and inverse standard deviation (per row, no gradient) are kept exact
    "NativeLayerNormBackward0": _Op(NORM, result=False, inputs=True, output=True, exact_extras=True),
    "FusedRmsNormBackward0": _Op(NORM, result=False, inputs=True, output=True, exact_extras=True),
    # no floor, only its per-(sample, group) statistics exact (NOTE [ Norm statistics ])
    "NativeGroupNormBackward0": _Op(STATISTICS, result=False, inputs=True, exact_extras=True),
}

# Nodes that only re-index or copy their input (a linear layer saves a 2-D view of a 3-D input;
# Hugging Face's models return their last hidden state through ``aten.alias``).
VIEWS = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AliasBackward0",
                    "TransposeBackward0", "TBackward0", "PermuteBackward0", "ExpandBackward0",
                    "SliceBackward0", "SelectBackward0", "AsStridedBackward0", "CloneBackward0"})
_WALK_NODES = 16

# An explicit attention: softmax(scale · q @ kᵀ (+ mask)) @ v (NOTE [ Bit floors ]).
SOFTMAX = frozenset({"SoftmaxBackward0", "SafeSoftmaxBackward0"})
"""A softmax's node types (``_safe_softmax`` gives 0, not NaN, on a row masked whole)."""
_MATMULS = frozenset({"BmmBackward0", "MmBackward0"})

HOLDING = VIEWS | _MATMULS
"""Consumers that do not release a recent record (NOTE [ Releasing inputs early ] in regions.py):
views and copies pass it on, and a matrix product may be an attention's, known once its softmax
shows up."""
_SCALING = VIEWS | {"MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1", "AddBackward0",
                     "AddBackward1", "SubBackward0", "SubBackward1", "MaskedFillBackward0",
                     "MaskedFillBackward1", "WhereBackward0"}


def _first_beyond(node: Any, skip: frozenset[str], limit: int = 6) -> Any:
    """The first node below ``node`` along first inputs whose type is not in ``skip``."""
    for _ in range(limit):
        if node is None or type(node).__name__ not in skip:
            return node
        edges = node.next_functions
        node = edges[0][0] if edges else None
    return None


CASTS = VIEWS | {"ToCopyBackward0"}
"""View-like nodes and casts (a bfloat16 model's ``F.rms_norm`` on a CPU casts its output back)."""
_RMS_PRODUCT = "MulBackward0"
"""The node of an explicit RMSNorm's product (:func:`_is_rms_norm` looks no further for any other)."""


def _is_rms_norm(node: Any) -> bool:
    """Whether ``node`` is an explicit RMSNorm's product (Hugging Face's ``LlamaRMSNorm``:
    ``weight * (x * rsqrt(mean(x²) + eps))``): a multiplication by an ``rsqrt``, or of
    such a product by a gain."""
    if type(node).__name__ != _RMS_PRODUCT:
        return False
    for nxt, _ in node.next_functions:
        if is_rsqrt(nxt):
            return True
        below = _first_beyond(nxt, CASTS)
        if type(below).__name__ == _RMS_PRODUCT and any(is_rsqrt(n) for n, _ in below.next_functions):
            return True
    return False


def is_rsqrt(node: Any) -> bool:
    """Whether ``node`` is (a cast or view of) an ``rsqrt``: an explicit RMSNorm's statistic."""
    below = _first_beyond(node, CASTS)
    return below is not None and type(below).__name__ == "RsqrtBackward0"


def _attention_matmul(node: Any) -> tuple[Any, tuple[str, ...]] | None:
    """The matmul node of an explicit attention that ``node`` identifies, with the floor of
    each of its operands, or None: a softmax's logits matmul (q @ kᵀ: both the query's),
    or a matmul with a softmax's output as an operand (p @ v: the probabilities take the
    query's floor, the values theirs)."""
    name = type(node).__name__
    if name in SOFTMAX:
        edges = node.next_functions
        below = _first_beyond(edges[0][0], _SCALING) if edges else None
        if below is None or type(below).__name__ not in _MATMULS:
            return None
        return below, (ATTENTION,) * len(below.next_functions)
    if name in _MATMULS:
        kinds = tuple(ATTENTION if _is_probabilities(nxt) else VALUES for nxt, _ in node.next_functions)
        if ATTENTION in kinds:
            return node, kinds
    return None


def _is_probabilities(node: Any) -> bool:
    """Whether ``node`` is (a view of) a softmax's output, or of its dropout."""
    below = _first_beyond(node, VIEWS)
    operand = dropout_operand(below)
    if operand is not None:
        below = _first_beyond(operand[0], VIEWS)
    return type(below).__name__ in SOFTMAX


def dropout_operand(node: Any) -> tuple[Any, int] | None:
    """``(node, output number)`` of what ``node`` multiplies when it is a product with a tensor
    that has no gradient (a dropout's mask, as ``F.dropout`` applies it on a CPU), else None."""
    if type(node).__name__ != "MulBackward0":
        return None
    edges = node.next_functions
    if len(edges) != 2 or edges[0][0] is None or edges[1][0] is not None:
        return None
    return edges[0][0], int(edges[0][1])


@dataclass(slots=True)
class _Recent:
    source: torch.Tensor
    version: int
    node: Any
    key: tuple[int, int] | None
    saved: weakref.ref[Any]
    """Weak: a record autograd has dropped must die."""
    layer: str
    order: int


@dataclass(frozen=True)
class Raise:
    """A recent record to store again: at ``bits``, or exact when ``bits`` is None."""

    saved: Any
    source: torch.Tensor
    layer: str
    bits: int | None
    op: Any = None
    """The table op whose input it is (None: one of its outputs without a gradient)."""
    kind: str | None = None
    """The floor's kind (None: exact)."""
    place: int | None = None
    """Which of ``op``'s inputs it is (NOTE [ Attention probabilities recomputed from query and key ]
    in attention.py: a matmul's first or second operand)."""


class FloorTracker:
    """Finds the records a floor applies to (NOTE [ Bit floors ])."""

    def __init__(self, floors: dict[str, int | None]) -> None:
        self._floors = {k: v for k, v in floors.items() if v is not None}
        self._attention = ATTENTION in self._floors or VALUES in self._floors
        self._recent: dict[int, _Recent] = {}
        self._order = 0
        self.walks = QuietWalks()
        """Whether packs walk in this forward (NOTE [ Walks that find nothing ] in walks.py)."""

    @property
    def active(self) -> bool:
        """Whether packs walk for table ops and note their records: some floor is set, and
        the walks found something lately (NOTE [ Walks that find nothing ])."""
        return self.walks.walking and bool(self._floors)

    def clear(self) -> None:
        self._recent.clear()

    def result_floor(self, node: Any) -> tuple[int, str] | None:
        """The floor of a tensor its own ``grad_fn``, ``node``, saves as its result, and the
        floor's kind (else None)."""
        if node is None or not self._floors:
            return None
        self.walks.packed()
        name = type(node).__name__
        op = _OPS.get(name)
        if op is None and name not in CASTS and name != _RMS_PRODUCT:
            return None  # what _output_kind finds for any other op's output (the common case)
        kind = self._output_kind(node) if op is None or not op.result else op.result_kind or op.kind
        floor = self._floors.get(kind) if kind is not None else None
        if floor is None or kind is None:
            return None
        self.walks.found()  # NOTE [ Walks that find nothing ]: walk again from here on
        return floor, kind

    def _output_kind(self, node: Any) -> str | None:
        """The floor's kind of a tensor that is (a view or a cast of) the output of a table op
        with ``output``."""
        for _ in range(_WALK_DEPTH + 2):
            name = type(node).__name__
            if name not in CASTS:
                op = _OPS.get(name)
                if op is None and _is_rms_norm(node):
                    return NORM
                if op is None:  # NOTE [ Floors through dropout ]
                    operand = dropout_operand(node) if name == "MulBackward0" else \
                        (node.next_functions[0] if name == "NativeDropoutBackward0" else None)
                    if operand is not None and operand[0] is not None:
                        node = operand[0]
                        continue
                return op.kind if op is not None and op.output else None
            edges = node.next_functions
            if not edges or edges[0][0] is None:
                return None
            node = edges[0][0]
        return None

    def note(self, t: torch.Tensor, saved: Any, layer: str) -> None:
        """Remember a record compressed at its layer's bits, in case a table op saved it."""
        if not self._floors:
            return
        node = t.grad_fn
        self._order += 1
        key = None if node is None else (id(node), int(t.output_nr))
        self._recent[self._order] = _Recent(t, t._version, node, key, weakref.ref(saved), layer, self._order)
        while len(self._recent) > RECENT:
            del self._recent[next(iter(self._recent))]

    def matches(self, t: torch.Tensor) -> list[Raise]:
        """The recent records that a table op at or a few steps above ``t``'s node saved.

        Nodes that only re-index (:data:`VIEWS`, clones) cost no step; a node created
        before every recent record's node cannot have consumed one, and the walk stops
        there (NOTE [ Walking only newer nodes ] in regions.py).
        """
        if not self._recent or t.grad_fn is None:
            return []
        keyed: dict[tuple[int, int], list[_Recent]] = {}
        for r in self._recent.values():
            if r.key is not None:
                keyed.setdefault(r.key, []).append(r)
        if not keyed:
            return []
        oldest = min(rs[0].node._sequence_nr() for rs in keyed.values())
        found: list[Raise] = []
        frontier: deque[tuple[Any, int]] = deque([(t.grad_fn, 0)])
        # the visited nodes themselves, not only their ids: a node's Python object lives only as
        # long as something holds it (torch 2.11 makes a new one on a later ``next_functions``),
        # so a freed node's id could come back as another node's and skip it
        seen: dict[int, Any] = {}
        while frontier and len(seen) < _WALK_NODES and self._recent:
            node, depth = frontier.popleft()
            if id(node) in seen:
                continue
            seen[id(node)] = node
            if node._sequence_nr() < oldest:
                continue
            name = type(node).__name__
            op = _OPS.get(name)
            rms = op is None and name == _RMS_PRODUCT and _is_rms_norm(node)
            edges = node.next_functions
            if op is not None and op.inputs:
                kinds = [op.input_kind(i) for i in range(len(edges))]
                # a norm's statistics are exact whatever its floor; an attention's logsumexp
                # goes with the query's floor (NOTE [ Bit floors ], NOTE [ Norm statistics ])
                extras = op.exact_extras and (op.kind != ATTENTION or ATTENTION in self._floors)
                found += self._inputs_of(node, kinds, extras)
            elif rms:  # the input at the norm's floor, the rsqrt exact (NOTE [ Norm statistics ])
                found += self._inputs_of(node, [None if is_rsqrt(e) else NORM for e, _ in edges], False)
            elif self._attention:
                matmul = _attention_matmul(node)
                if matmul is not None:
                    found += self._inputs_of(matmul[0], list(matmul[1]), False)
            if op is None and name not in HOLDING and self._recent and not rms:
                self._release(edges, keyed)  # NOTE [ Releasing inputs early ] in regions.py
            below = depth + (0 if name in VIEWS else 1)
            if below <= _WALK_DEPTH:
                for e in edges:
                    if e[0] is not None:
                        frontier.append((e[0], below))
        if found:
            self.walks.found()
        return found

    def _release(self, edges: Any, keyed: dict[tuple[int, int], list[_Recent]]) -> None:
        """Drop the recent records an op with no floor consumed (``edges``: its inputs; ``keyed``:
        the recent records by autograd key, kept in step with the deletions)."""
        for parent, nr in edges:
            if parent is None:
                continue
            rs = keyed.get((id(parent), int(nr)))
            if rs is not None and rs[0].node is parent:
                del keyed[(id(parent), int(nr))]
                for r in rs:
                    self._recent.pop(r.order, None)

    def _inputs_of(self, node: Any, kinds: Sequence[str | None], extras_exact: bool) -> list[Raise]:
        """The recent records among ``node``'s inputs, each to be stored again at the floor of
        its kind (``kinds``, by input place; None: exact); one whose kind has no floor is only
        let go. With ``extras_exact``, also exact: the op's own later outputs (known by its node)
        and the floats without a gradient recorded after the first of its inputs (its
        non-differentiable outputs)."""
        keys = {(id(n), int(nr)): (n, i) for i, (n, nr) in enumerate(node.next_functions) if n is not None}
        hits = [r for r in self._recent.values()
                if r.key is not None and r.key in keys and keys[r.key][0] is r.node]
        # the op's own later outputs (GroupNorm's statistics; known by their node alone), and
        # the floats without a gradient recorded after its first input (LayerNorm's)
        extras: list[_Recent] = []
        if extras_exact:
            first = min((r.order for r in hits), default=None)
            extras = [r for r in self._recent.values()
                      if (r.node is node and r.key is not None and r.key[1] > 0)
                      or (first is not None and r.node is None and r.order > first)]
        if not hits and not extras:
            return []
        out: list[Raise] = []
        pairs = [(r, keys[r.key][1]) for r in hits if r.key is not None]
        for r, place in pairs + [(r, None) for r in extras]:
            kind = None if place is None else kinds[place]
            del self._recent[r.order]
            bits = None if kind is None else self._floors.get(kind)
            if kind is not None and bits is None:
                continue  # no floor for this kind: the record keeps its layer's bits
            saved = r.saved()
            if saved is not None and r.source._version == r.version:
                out.append(Raise(saved, r.source, r.layer, bits, node if kind is not None else None, kind,
                                 place if kind is not None else None))
        return out
