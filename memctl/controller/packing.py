"""The pack/unpack pair a controller installs, and its per-step accounting.

The hook contract (as for ``torch.autograd.graph.save_on_cpu``): ``unpack(pack(t))``
equals ``t`` up to the layer's codec error, with ``t``'s shape, dtype and device.

NOTE [ What is compressed ]
- Parameters and buffers (recognised by their storage) are saved as they are: they
  change only in the optimizer step, after the backward pass has read them. So are copies
  of a parameter (NOTE [ Copies of parameters ]).
- Non-float tensors (max-pool indices, bool masks) go to the lossless codec; below
  ``min_numel`` values (a loss's targets) they are held as they are, version-checked.
- Float tensors below ``min_numel`` values are held as they are (detached, version-checked).
- Log-softmax outputs (inside or outside the model's forward) are stored as their
  probabilities at ``log_prob_bits`` (NOTE [ Log-probabilities ] in logprobs.py): their
  backward exponentiates them, so quantising the log-probabilities themselves would make
  the error grow exponentially; ``log_prob_bits=None`` copies them.
- Other float tensors saved outside the model's forward (the loss) are copied, not
  compressed: they are small (``compress_outside`` changes this).
- Every other float tensor is compressed at its layer's bits (or error bound).
With saved-tensor hooks active, autograd no longer detects in-place modification of a
saved tensor, so keeping the original object unchecked would give silently wrong gradients
after an in-place op (docs/design.md, "Pack: what is compressed"). A tensor kept as it is
either is a copy (outside the forward, an exact op's) or is the tensor itself (detached:
it shares the version counter; below ``min_numel``, a layer at "keep", a floor that keeps
it exact), whose unpack compares its version with the one it had when saved and raises
autograd's in-place error as PyTorch would (NOTE [ In-place checks ]). Until 2026-11-27
those were copied too: a launch each on a GPU (a batch norm's mean and inverse standard
deviation, two a batch norm and step; a LayerNorm's row statistics), and the memory twice.

NOTE [ Copies of parameters ]
Under autocast a layer saves its weight's lower-precision copy (a convolution the copy
itself, a linear layer its transpose): ``ToCopyBackward0`` (and views of it) above the
weight's gradient accumulator, in another storage than the parameter's. Compressing it puts
quantisation noise into the gradient the layer passes down (the weight multiplies the
output's gradient there), for every layer below, which no activation's record does; plain
PyTorch holds the copy until the backward too. So a tensor whose node is a view, copy or
cast (``floors.CASTS``) that reaches a leaf's gradient accumulator within four such nodes, one
of them a copy, is held as it is, version-checked, like a parameter (:func:`_copy_of_parameter`).
A view of the leaf alone is compressed as before (it holds no memory of its own, but tests
and functional code stand leaves in for activations). A frozen weight's copy has no node to
follow (the cast needs no gradient): it is found by its values (NOTE [ Copies of parameters
without a node ] in copies.py). A compiled graph's tensors are all held (NOTE [ Graphs
compiled by torch.compile ]). Under bfloat16 autocast on the CPU, 20 steps of
``fidelity.py``'s models at 2 bits: MobileNetV3's final loss 0.644 -> 0.296 (plain 0.242),
GPT-2's 4.524 -> 4.315 (plain 4.312), ResNet-18's 0.0174 -> 0.0081 (plain 0.0071).

NOTE [ Graphs compiled by torch.compile ]
A model run under ``torch.compile`` saves its tensors from AOTAutograd's ``CompiledFunction``:
one autograd function for the whole graph, whose backward reads them by its own code. memctl
sees none of the ops inside (no nodes, no module hooks): not a ReLU's result, whose backward
compares it with zero (quantised, its small positives round to zero and their gradient is
lost: the exact masks of NOTE [ Derivative regions ] need the op), not an attention, a norm
or the head. Compressed as plain quantisation, a compiled ResNet-18 did not learn at 2 bits
(loss 2.26 -> 2.21 in 20 steps, plain compiled 2.26 -> 0.007) and its gradient's cosine to
plain's was 0.98 at 8 bits. So a tensor saved by a compiled graph (known from the frame that
saves it, :func:`_from_compiled_graph`) is held as it is, version-checked, like a parameter,
and the first one is reported once (a warning and the log). The frame is looked at for a
tensor that needs no gradient (what a compiled graph computes) and, once one compiled graph
was seen, for every tensor (an activation of the eager part saved as a compiled submodule's
input), so that a model without one pays a frame walk only for its few tensors without a
gradient. Parts of the model left
uncompiled (a compiled submodule inside an eager model: its graph's tensors are held, the
rest compressed) are compressed as in eager mode.

NOTE [ Small views of large tensors ]
A small tensor held as it is keeps its whole storage alive. When it is a view of a much
larger tensor that nothing else keeps (a classifier reads the first token of the last
norm's output, ``x[:, 0]``: a ViT's head saves 3,072 values of a 52,224-value output,
and plain PyTorch keeps all of them until the backward), holding the view would keep
the large tensor too. So a small tensor whose storage holds more than twice its own
bytes and at least :data:`_PIN_SURPLUS` bytes more is held as a copy of its own values
(:func:`_held_small`), and its unpack checks its version while the view is alive, as a
compressed record's does (the copy's values are those autograd saved, whatever happens
to the large tensor later). A copy costs at most ``min_numel`` values.

NOTE [ De-duplication ]
One tensor is often saved twice in a step (a ReLU output by relu and by max_pool). A
second save with the same storage, offset, shape, stride, dtype and version reuses the
first record. The table holds a weak reference to the record (the one its micro-batch
tracks it by), and the record one to the first tensor; an entry is reused only while
both are alive: a new tensor that happens to reuse a
freed address is never mistaken for the old one, and the table never keeps a record
alive after autograd has freed it (with gradient accumulation every micro-batch's
records would otherwise stay until the optimizer step; NOTE [ Micro-batches ]).
A contiguous tensor is keyed by its values' place alone (storage, offset, number of
values), so a contiguous view of a saved tensor with another shape (a matmul saves its
operand reshaped to 3-D: an explicit attention's probabilities are saved by the softmax
and again by the next matmul) reuses the record too, through an :class:`Alias` that
reshapes what the record decodes.

NOTE [ Pack path cost ]
The pack hook runs once per saved tensor: a 2-layer GRU saves ~900 per step, so every
microsecond here is about a millisecond per step. The hook therefore reads each tensor
attribute once (``grad_fn``, ``numel``, ``nbytes``), leaves ``detach()`` to the codec (which
detaches anyway), counts a record's bytes from its buffers' ``nbytes``, and keeps one
weak reference per record (shared by the de-duplication table and the micro-batch) and
no per-record tuples: each object a record keeps alive through the forward is tracked
by Python's garbage collector, survives its young-generation passes and makes the
full collections (~0.1 s each with torch imported) come sooner. What every tensor reads is
kept where one attribute read finds it (the running module's name, FSDP's flag, the model
inputs' storages, a partition's bit planes), the codec checks its arguments without a call
apiece, and torch calls the module hooks straight from C (``ControllerHook`` in copysafe.py).
Between the model's kernels, which evict the caches, a call costs far more than in a loop:
a no-op Python call timed in place inside the quantize encode of the MLP of
benchmarks/training.py took ~3.6 µs (2026-11-28), against ~0.05 µs in a loop. Where the rest
of the time goes, per tensor and per step: ``benchmarks/overhead.py``.

NOTE [ Packs queued in the forward ]
Inside a module's forward, a tensor of fewer than :data:`~memctl.controller.batches.BATCH_BELOW`
values is not packed when autograd saves it: the hook checks only what must be read then
(parameters and inputs, FSDP's parameters, a backward running, the module it belongs to, its
version) and queues it, and the queue is packed in order, in one loop, when it holds
:data:`_QUEUE_RECORDS` tensors or :data:`~memctl.controller.batches.BATCH_VALUES` values, before
a larger tensor is packed, when a module's forward returns (before its output is matched, NOTE
[ Finding the op that saved a tensor ]), when the model's forward ends, and before any unpack.
Autograd keeps a small handle (:class:`_Queued`) that leads to the record. Packed in a loop,
the same work costs less than interleaved with the ops that save the tensors (presumably
their kernels and allocator evict the Python path's code and data between two hooks): on the
GRU of ``benchmarks/training.py``, whose 873 saved tensors a step are all small, steps with the
queue on and off alternated in one process spent 3.9-5.5 ms less CPU time per forward with it
(three processes; memctl adds ~50 ms a step there on that machine) for the same records and
losses (benchmarks/README.md, ``overhead.py``). Nothing is packed differently: the
records are made in the same order, from the same tensors and graph, with the layer and the
version read when the tensor was saved (a tensor changed in place meanwhile is the case
autograd's in-place check refuses anyway: the unpack raises it, NOTE [ In-place checks ]). The
tensors wait at most one queue, the size of one of the batches they mostly join next and are
held by anyway (NOTE [ Batched small records ] in batches.py). A node field read while the queue
is packed that reaches a tensor still queued (none should: a record's graph was built before
it was saved) gets the tensor itself, which is exact. Replays (NOTE [ Replay ]) pack at once:
no module exit reaches their packer.

NOTE [ ReLU masks ]
Generalised to every op whose backward branches on its saved tensor: see
NOTE [ Derivative regions ] in ``memctl/controller/regions.py``. A float tensor produced by
such an op (recognised by its ``grad_fn``), or saved as the input of one (recognised by
the op's node when it appears, NOTE [ Finding the op that saved a tensor ]), also keeps
an exact 1- or 2-bit region code (the lossless codec's bit-packed bools), and decoding
puts every value back inside its true region: for ReLU, every positive value above zero
and every zero at exactly zero. The same record serves the next layer, which reads the
quantised values (ActNN keeps such a mask too). The code's bytes count as the layer's
``mask_bytes``, so the allocation prices them.
For a ReLU output compressed by a codec that applies masks in its decode (the quantize
codec: NOTE [ Masks in decode ] in ``memctl/codecs/base.py``, NOTE [ Masked decode ]), the
code is applied inside the codec's decode kernel (``decode(p, mask=...)``), so the final
tensor is written in one pass; other codes are applied after decoding (the projections commute: each
region holds the true value, so clamping into one never leaves another).

NOTE [ Distributed parameters and recomputation ]
- FSDP2's unsharded parameters are recognised through FSDP's own parameter objects
  (NOTE [ FSDP2 parameters ] in fsdp.py) and saved as they are, like parameters.
- A tensor saved while the autograd engine runs a backward node (the recomputation of a
  reentrant ``torch.utils.checkpoint`` region, or a hook that saves for a double
  backward) is used within that backward: it is passed through, neither compressed nor
  counted, so a recomputed region is never accounted twice. Non-reentrant checkpoints
  push their own hooks above these and keep their tensors themselves.
``passed`` counts tensors saved as they are (parameters and recomputation) and
``fsdp_passed`` the FSDP2 parameters among them.

NOTE [ Parameter scan ]
Walking ``model.parameters()`` and ``model.buffers()`` and reading every storage costs
about a microsecond per tensor, every step. The step boundary therefore walks the model
only at allocation steps (and after an error); in other steps it compares the data
pointers of the tensors found by the last walk with theirs then, and walks again when
one moved (``model.to(...)``, ``p.data = ...``, a replaced buffer). A parameter newly
registered on the model between two walks is recognised from the next allocation step.

NOTE [ Floors known from the last forward ]
An input packed before its op's node exists (a LayerNorm's input, an attention's query
and key when the attention is recognised later) is encoded at its layer's bits and then
encoded again at its op's floor once the op shows up (NOTE [ Bit floors ]): two encodes,
the first thrown away. On the 4-layer transformer of ``benchmarks/training.py`` that was 20
of the 78 encodes of a step, ~48 ms of ~1,300 at one thread. A model's forward packs the
same tensors in the same order every step, so a record remembers its slot (layer, place
among the layer's packs in the forward, number of values), a raise to a floor remembers
the slot's floor, and the next forward encodes a tensor packed at a remembered slot at
its floor straight away (a record outside the allocation's control, as the raise would
have made it), or keeps it exact where the raise kept it exact (an attention's logsumexp,
a LayerNorm's row statistics: NOTE [ Norm statistics ] in floors.py; until 2026-11-27
these were encoded and then copied every step, 22 encodes of the 60 of a step of that
transformer on a GPU). The later raise then finds it at its floor, which confirms the slot for
the forward after; a slot not confirmed in a forward is forgotten, so a model whose
forward changes gets one forward of double encodes, as before, and nothing worse. Slots
carry no region code (a record with one is never encoded early), and a forward that packs
nothing (evaluation under ``no_grad``) keeps the slots it found.

NOTE [ Roots known from the last forward ]
A batch norm's input is packed (and encoded at its layer's bits) before its output shows
up; when the output is then recomputed from it (NOTE [ Batch-norm outputs recomputed from
the input ]), the input's record moves to normalised coordinates and is encoded again, so
the first encode is thrown away: 5 of the 19 encodes of a step of the CNN in
``benchmarks/training.py``, ~2 ms each at one thread. As for floors, a record remembers its
slot, and a slot whose record became such a root in the last forward is, on the CPU, given
a deferred record (NOTE [ Batched small records ] in batches.py: its record at once, its
bytes written later): stored again within :data:`~memctl.controller.batches.DEFER_PACKS`
packs, it is never encoded (its group ranges, which the statistics read, take one pass
instead); otherwise it is encoded then, or when the forward ends or a decode comes first.
The raw tensor waits at most those few packs, and a slot not confirmed in a forward is
forgotten.

NOTE [ Codec fallback ]
If a codec raises, the tensor is kept as an uncompressed copy, the event is counted and
logged (a warning the first time per layer), and training goes on.

These rules in the context of a whole step: docs/design.md, "Pack: what is compressed".
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import sys
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors
from torch.autograd.function import BackwardCFunction

from memctl.codecs import channels
from memctl.codecs.base import Codec, Impl, Packed, decodes_mask, mask_floor
from memctl.codecs.lossless.codec import bits_record
from memctl.codecs.quantize import BITS, packed_nbytes, poll_checks, settle_checks
from memctl.codecs.quantize._kernels import square_read_segments_cpu
from memctl.codecs.quantize.codec import group_at
from memctl.controller.attention import MATMULS, logits_of, probabilities
from memctl.controller.batches import BATCH_BELOW, BATCH_VALUES, Batch, Batches, BatchRecord
from memctl.controller.collector import CollectorPause
from memctl.controller.config import KEEP_BITS, CodecMode, ControllerConfig
from memctl.controller.copies import ParameterCopies
from memctl.controller.derived import (
    DERIVED_MAX_BITS,
    PRODUCTS,
    RESHAPES,
    VALUE_DEPENDENT,
    Derived,
    reads_back,
    reshaped_from,
    root_of,
    through_reshapes,
    width_within,
)
from memctl.controller.expressions import Expression, build, is_elementwise, scalar_of
from memctl.controller.floors import (
    ATTENTION,
    CASTS,
    NORM,
    SOFTMAX,
    VALUES,
    FloorTracker,
    Raise,
    dropout_operand,
    row_group,
)
from memctl.controller.fsdp import FsdpParameters, local_tensor
from memctl.controller.heads import HEAD, head_nodes
from memctl.controller.hooks import ROOT, ModuleTracker
from memctl.controller.inputs import ModelInputs
from memctl.controller.layout import LAYOUT, below_layout, layout_of, replay
from memctl.controller.logprobs import LogProbs, decode_log_probs, encode_log_probs, is_log_softmax
from memctl.controller.microbatch import MicroBatch, peak_basis
from memctl.controller.norm_outputs import NormInputs
from memctl.controller.norm_reads import NORM_NODES, NormReads
from memctl.controller.normalized import BATCH_NORM, WIDE_BITS, UnreadNorm, chain_of, is_wide, verified, widen
from memctl.controller.regions import RELU, Partition, RegionCode, RegionTracker, result_partition
from memctl.controller.shared_decode import SharedDecode
from memctl.controller.squares import SQUARE_READERS, square_read
from memctl.controller.stats import LayerStep
from memctl.controller.strides import laid_out, same_layout
from memctl.controller.timing import Timings
from memctl.controller.versions import SavedRef, autograd_wording, check_version
from memctl.controller.walks import QuietWalks
from memctl.errors import CodecError

__all__ = ["Alias", "Packer", "Saved"]

_log = logging.getLogger("memctl.controller")

# grad_fn names of ops whose saved output is never quantised (NOTE [ What is compressed ]).
_EXACT_OPS = frozenset({"LogSoftmaxBackward0", "LogSoftmaxBackward1"})
# NOTE [ Elementwise expressions ] in expressions.py
_OFFERED = 2
"""Module outputs held for the next layer, as for derived.py's offers."""
_RECENT = 2
"""Recorded tensors held until this many more are recorded (a product's operands)."""
_MISSES = 4
_RETRY = 64
"""A graph shape that missed :data:`_MISSES` walks and was never rebuilt is walked once in this many."""

_LOSS_NODES = 8
"""Nodes searched from a model output for the loss that reads a log-softmax (NOTE [ Rows no loss reads ])."""


def _shape_of(node: Any) -> tuple[str, ...]:
    """A node's op and its inputs' ops (NOTE [ Elementwise expressions ]: which walks to skip)."""
    return (type(node).__name__, *(type(n).__name__ for n, _ in node.next_functions if n is not None))


@dataclass(eq=False)
class _HeldLogProbs:
    """A log-softmax output held raw until the model's forward ends (NOTE [ Rows no loss reads ])."""

    node: Any
    saved: Saved
    source: torch.Tensor
    layer: str
    version: int
    losses: int = 0
    """The ``nll_loss`` nodes among the model's outputs that read it."""
    rows: torch.Tensor | None = None
    """The rows the last of them does not ignore (None: all)."""

_DedupKey = tuple[int, Any, int | tuple[int, ...], tuple[int, ...] | None, torch.dtype, torch.device, int]
_current_node = torch._C._current_autograd_node
# Backward nodes whose computation is linear in every saved tensor they read (NOTE [ Unbiased
# reads of a ReLU result ]): convolutions, matrix products, element-wise products; and max
# pooling, whose backward reads only its input's shape (it scatters by its saved indices).
_VALUE_READERS = PRODUCTS | {"MaxPool2DWithIndicesBackward0", "MaxPool3DWithIndicesBackward0"}


_MOST_PLACES = 4096
"""Places remembered at most by NOTE [ A derived output read back into its derivative ]."""

_Slot = tuple[str, int, int]
"""A record's layer, its place among the layer's packs in the forward, and its number of values."""

_PIN_SURPLUS = 16384
"""Bytes of storage beyond its own that a small tensor held as it is may keep alive
(NOTE [ Small views of large tensors ])."""


def _held_small(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """What a small tensor held as it is keeps: ``t`` detached, or a copy of its own values
    when it is a view of a much larger storage (NOTE [ Small views of large tensors ])."""
    if type(t) is not torch.Tensor:  # a subclass (a DTensor's storage is its shard's)
        return t.detach()
    whole = t.untyped_storage().nbytes()
    if whole > 2 * nbytes and whole - nbytes >= _PIN_SURPLUS:
        return t.detach().clone(memory_format=torch.contiguous_format)
    return t.detach()


_TWO_VALUED_FROM = BATCH_BELOW
"""Values from which a float tensor without a gradient is tested for two values (NOTE [
Two-valued floats ] in the lossless codec): below, the test's ~10 µs outweighs what one bit a
value saves over a batched record (a recurrent layer's zero initial state)."""

_QUEUE_RECORDS = 64
"""Tensors queued before the queue is packed (NOTE [ Packs queued in the forward ])."""
_QUEUE_VALUES = BATCH_VALUES
"""Values queued before the queue is packed: one batch's (NOTE [ Batched small records ])."""


class Saved:
    """What the pack hook returns: a packed record, a copy, or a parameter reference."""

    __slots__ = ("__weakref__", "data", "device", "dtype", "layer", "owner", "readers", "regions", "shape",
                 "slot", "source", "stride", "version")

    def __init__(self, data: Packed | LogProbs | Derived | torch.Tensor, like: torch.Tensor,
                 regions: tuple[RegionCode, ...] = (), layer: str | None = None) -> None:
        self.data = data
        self.regions = regions
        self.layer = layer
        """The layer whose bits decide this record (None: not under the allocation's control)."""
        # a plain tuple of ints (which the garbage collector stops tracking): the record's own when packed
        self.shape = data.shape if type(data) is Packed or type(data) is BatchRecord else tuple(like.shape)
        self.dtype = like.dtype
        self.device = like.device
        # NOTE [ In-place checks ] and NOTE [ Micro-batches ]; set by Packer.pack
        self.source: Callable[[], torch.Tensor | None] | None = None
        self.version = 0
        self.owner: MicroBatch | None = None
        self.readers = 1
        """Pack hook calls that returned this record (NOTE [ One decode for several readers ])."""
        self.slot: _Slot | None = None
        """Where it was packed, for NOTE [ Floors known from the last forward ]."""
        self.stride: tuple[int, ...] | None = None
        """The saved tensor's strides when it was not contiguous (NOTE [ The saved layout ])."""


class _Held:
    """A strong reference called like a weak one (``Saved.source`` of a record kept as it is now);
    ``node``: the name and output number of the op that made the tensor, for the in-place error."""

    __slots__ = ("node", "tensor")

    def __init__(self, tensor: torch.Tensor, node: tuple[str, int] | None = None) -> None:
        self.tensor = tensor
        self.node = node

    def __call__(self) -> torch.Tensor:
        return self.tensor


class Alias:
    """A record saved again under another shape (NOTE [ De-duplication ])."""

    __slots__ = ("alias_of", "shape", "stride")

    def __init__(self, saved: Saved, shape: tuple[int, ...], stride: tuple[int, ...] | None = None) -> None:
        self.alias_of = saved
        self.shape = shape
        self.stride = stride
        """The view's strides when it was not contiguous (NOTE [ The saved layout ])."""


_Handle = Saved | SavedRef | Alias | torch.Tensor
"""What :meth:`Packer.pack` makes of a tensor, once packed."""


def _storage_ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (its local shard's for a DTensor), as ``Packer.pack`` reads it."""
    return int((t if type(t) is torch.Tensor else local_tensor(t)).untyped_storage().data_ptr())


def _op_of(t: torch.Tensor) -> tuple[str, int] | None:
    """The name of the op that made ``t`` and ``t``'s output number, for the in-place error of a
    record holding ``t`` detached (NOTE [ In-place checks ]); None for a leaf."""
    node = t.grad_fn
    return None if node is None else (node.name(), int(t.output_nr))


def _keep_changed(saved: Saved, source: torch.Tensor) -> None:
    """``saved`` holds ``source`` as it is now, changed in place after it was saved: its unpack
    raises autograd's error (NOTE [ In-place checks ]) however long the tensor lives."""
    held = source.detach()  # (shares the version counter)
    saved.data, saved.source = held, _Held(held, _op_of(source))


_VIEWED = frozenset({*RESHAPES, "ExpandBackward0"})
"""Nodes between a dropout's output and the matmul's operand (NOTE in attention.py)."""


class _HandleRead(Exception):
    """Raised by :meth:`Packer._peek` once it has the handle :meth:`Packer._saved_handle` asks for."""


class _Queued:
    """What autograd holds for a tensor whose pack waits in the queue (NOTE [ Packs queued in the
    forward ]): the tensor and what was read when it was saved, then the record."""

    __slots__ = ("layer", "ptr", "saved", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, ptr: int, layer: str, version: int) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.ptr = ptr
        self.layer = layer
        self.version = version
        self.saved: _Handle | None = None


class Packer:
    """Installs nothing itself: the controller hands :meth:`pack` and :meth:`unpack` to autograd."""

    def __init__(
        self,
        config: ControllerConfig,
        tracker: ModuleTracker,
        choice_for: Callable[[str], tuple[float, float | None]],
        on_fallback: Callable[[str, BaseException], None],
        queue: bool = True,
    ) -> None:
        """``queue``: small tensors saved inside a module's forward are packed in batches of them
        (NOTE [ Packs queued in the forward ]); a replay's packer, which sees no module exit, packs
        every tensor when it is saved."""
        autograd_wording()  # read outside any backward (NOTE [ In-place checks ])
        self._config = config
        self._tracker = tracker
        self._choice_for = choice_for
        self._on_fallback = on_fallback
        self._codecs: dict[str, Codec] = {}
        self._param_ptrs: frozenset[int] = frozenset()
        self._copies = ParameterCopies()
        self.compiled_passed = 0
        """Tensors a compiled graph saved, held as they are (NOTE [ Graphs compiled by torch.compile ])."""
        self._compiled_warned = False
        self._param_tensors: list[torch.Tensor] = []
        self._param_data: list[int] = []
        self._seen: dict[_DedupKey, weakref.ref[Saved]] = {}
        self._micro = MicroBatch()
        self._done: list[MicroBatch] = []
        self._step: dict[str, LayerStep] = self._micro.records
        self._begun: int | None = None
        self.last_samples = 0
        """Samples per forward of the last finished step's peak micro-batch."""
        self.last_micro_batches = 0
        """Micro-batches (forwards that backward read) in the last finished step."""
        # NOTE [ Range statistics ]: by layer, its records' metadata, or runs of a batch's groups
        self._metas: dict[int, tuple[LayerStep, list[torch.Tensor | list[Any]]]] = {}
        self.ranging = True
        """Whether this step's records keep range statistics (NOTE [ Range statistics on the steps
        that gather statistics ])."""
        self._ranged_layers: set[str] = set()
        """The layers whose records kept range statistics at least once."""
        self._regions = RegionTracker()
        self._floors = FloorTracker({ATTENTION: config.attention_bits, VALUES: config.attention_value_bits,
                                     NORM: config.norm_bits})
        self._norms = NormInputs()  # NOTE [ Norm outputs recomputed from the input ]
        self._norm_reads = NormReads(lambda: self._reading_fields(any_exact=True), on_fallback)
        self.inputs = ModelInputs()
        """The model's own inputs, saved by reference (NOTE [ Model inputs ])."""
        self.collector = CollectorPause(config.pause_collector)
        """NOTE [ Collector paused while records live ]."""
        self._counter = 0
        self._seed_base = 0
        self._steps = 0
        # NOTE [ Floors known from the last forward ]
        self._floor_hints: dict[_Slot, int] = {}
        self._hints_next: dict[_Slot, int] = {}
        # NOTE [ Norm rows in groups of their own ] in floors.py: a norm record's group by place
        self._group_hints: dict[_Slot, int] = {}
        self._group_hints_next: dict[_Slot, int] = {}
        self._hints_packs = 0
        # NOTE [ Roots known from the last forward ]
        self._root_hints: set[_Slot] = set()
        self._root_hints_next: set[_Slot] = set()
        # NOTE [ No chain into a value-dependent derivative ] in normalized.py
        self._own_hints: set[_Slot] = set()
        # NOTE [ A derived output read back into its derivative ]: by place (layer, pack number)
        self._own_outputs: set[tuple[str, int]] = set()
        self._harmless_reads: set[tuple[tuple[str, int], str]] = set()
        self._declined = False
        self._inner_reads = 0
        self._own_hints_next: set[_Slot] = set()
        self.packs = 0
        self.passed = 0
        self.fsdp_passed = 0
        self.fsdp = FsdpParameters()
        self.timings = Timings()
        self._shared = SharedDecode()
        self._batches = Batches(config.group_size, self._empty_exceptions)  # NOTE [ Batched small records ]
        self._batching = config.codec_impl is None
        # NOTE [ Elementwise expressions ] in expressions.py: this forward's records by the autograd
        # output they were packed from (the node held, so that its id is not reused meanwhile), and
        # the bits granted to each root so far
        self._producers: dict[tuple[int, int], tuple[Any, weakref.ref[Saved]]] = {}
        # NOTE [ Layout copies of a record ] in layout.py: structures checked, and failed
        self._layouts_checked: set[tuple[Any, ...]] = set()
        self._layouts_failed: set[tuple[Any, ...]] = set()
        self._granted: dict[int, int] = {}
        self._offered: dict[int, tuple[Any, Expression]] = {}
        """Module outputs rebuilt while their roots were alive, by node id (at most two)."""
        self._derivations = QuietWalks()
        """Whether packs look for a record to keep as derived (NOTE [ Walks that find nothing ])."""
        self._unread_norms: list[UnreadNorm] = []
        """Batch norms whose output no record has read yet (NOTE [ Batch-norm inputs normalised ... ])."""
        self._recent: list[torch.Tensor] = []
        """The last floating-point tensors recorded, held until two more are (roots of a product
        that the next layer saves: SwiGLU's ``silu(gate)·up``)."""
        self._misses: dict[tuple[str, ...], int] = {}
        """Walks that rebuilt nothing, by the shape of the graph at the packed tensor (its node and
        the nodes of its inputs): after :data:`_MISSES` of them, one walk in :data:`_RETRY`."""
        self._rebuilt: set[tuple[str, ...]] = set()
        """Graph shapes that were rebuilt at least once: always walked."""
        # NOTE [ Attention probabilities recomputed from query and key ] in attention.py: the
        # structures checked (recomputed once) and those that failed their check (not tried again)
        self._attention_checked: set[tuple[Any, ...]] = set()
        self._attention_failed: set[tuple[Any, ...]] = set()
        self._recomputed_softmax = False
        """A softmax's result was recomputed this step: its dropout's output may be as well."""
        self._caught: list[Any] | None = None
        """While set, :meth:`_peek` puts the handle it is given here (:meth:`_saved_handle`)."""
        self._held_log_probs: dict[int, _HeldLogProbs] = {}
        """Log-softmax outputs of this forward, raw, by node id (NOTE [ Rows no loss reads ])."""
        self._peeking = False
        """A node's fields are being read in the forward: :meth:`unpack` returns exact records only."""
        self._peek_exact = False
        """Those fields may come from any exact record, a layer's too (:meth:`_reading_fields`)."""
        self._matching = False
        """Whether a pack or a module output may have left something for a later pack to match
        since the last unpack in a backward cleared it (the trackers, the producers)."""
        self._queueing = queue
        self._queue: list[_Queued] = []
        """Tensors saved but not packed yet, in order (NOTE [ Packs queued in the forward ])."""
        self._queued_values = 0
        self._settling = False
        self._no_exceptions: tuple[torch.Tensor, torch.Tensor] | None = None
        self._decoded: tuple[tuple[Batch, tuple[torch.Tensor, ...], torch.Tensor], ...] = ()
        """The two batches decoded last, whole, with their values, newest first (NOTE [ Batched
        small records ])."""
        self._squared: tuple[tuple[Batch, dict[int, torch.Tensor]], ...] = ()
        """The two batches whose squared records were corrected last, those records' values by
        index, newest first (NOTE [ Squares of a rounded result ] in squares.py)."""

    # -- step lifecycle -------------------------------------------------------------
    def set_parameters(self, model: torch.nn.Module) -> None:
        """Remember the storages of the model's parameters and buffers."""
        tensors = [local_tensor(p) for p in model.parameters()]
        tensors += [local_tensor(b) for b in model.buffers()]
        self._param_ptrs = frozenset(t.untyped_storage().data_ptr() for t in tensors)
        self._copies.set([local_tensor(p) for p in model.parameters()])
        self._param_tensors = tensors
        self._param_data = [t.data_ptr() for t in tensors]
        if self.fsdp.active:
            self.fsdp.refresh()

    def refresh_parameters(self, model: torch.nn.Module, full: bool) -> None:
        """At a step boundary: :meth:`set_parameters` when ``full`` or when a known
        parameter's or buffer's data moved (NOTE [ Parameter scan ])."""
        if full or [t.data_ptr() for t in self._param_tensors] != self._param_data:
            self.set_parameters(model)
        elif self.fsdp.active:
            self.fsdp.refresh()

    def begin_step(self, step: int, ranging: bool = True) -> None:
        """A step's capture window opens; ``ranging``: whether its records keep range statistics
        (NOTE [ Range statistics on the steps that gather statistics ])."""
        self.ranging = ranging
        if self._begun == step:
            return  # the window reopened within the step: keep the seed sequence going
        self._begun = step
        self._seed_base = (step * 0x9E3779B1) & 0xFFFFFFFF
        self._counter = 0
        self._regions.clear()
        self._floors.clear()
        self._norms.clear()
        self._norm_reads.clear()

    def begin_forward(self, samples: int) -> None:
        """A top-level forward of the model starts a micro-batch (NOTE [ Micro-batches ])."""
        if self._queue:
            self.settle()
        if self._batches:
            self._encode_batches()
        self._shared.clear()
        self._decoded = self._squared = ()
        self._forget_producers()
        if self._held_log_probs:
            self._flush_log_probs()
        self._floors.walks.begin_forward()
        self._regions.walks.begin_forward()
        self._copies.begin_forward()
        self._derivations.begin_forward()
        if self.packs != self._hints_packs:  # the last forward packed: its floors are the hints
            self._floor_hints, self._hints_next = self._hints_next, {}
            self._group_hints, self._group_hints_next = self._group_hints_next, {}
            self._root_hints, self._root_hints_next = self._root_hints_next, set()
            self._own_hints, self._own_hints_next = self._own_hints_next, set()
            self._hints_packs = self.packs
        if not self._micro.empty:
            self._done.append(self._micro)
            self._micro = MicroBatch([b for b in self._done if b.live])
            self._step = self._micro.records
            self._seen = {k: v for k, v in self._seen.items() if _alive(v)}
        self._micro.samples += samples

    @property
    def walking(self) -> tuple[bool, bool, bool]:
        """Whether the region tracker's and the floor tracker's packs walk in full in this
        forward, and whether packs look for derived records (NOTE [ Walks that find nothing ]
        in walks.py)."""
        return self._regions.walks.walking, self._floors.walks.walking, self._derivations.walking

    @walking.setter
    def walking(self, walking: tuple[bool, bool, bool]) -> None:
        """Walk as another packer does: a replay of its step (the same model, the same
        inputs) walks where training walked; anything found turns the walks on as ever."""
        self._regions.walks.walking, self._floors.walks.walking, self._derivations.walking = walking

    @property
    def graph_alive(self) -> bool:
        """True while autograd holds records of the current micro-batch."""
        return self._micro.live

    def finish_step(self) -> dict[str, LayerStep]:
        """The step's per-layer records at its peak micro-batch; resets them and the tables."""
        if self._queue:
            self.settle()
        if self._batches:
            self._encode_batches()
        poll_checks()
        self._fold_ranges()
        self._shared.clear()
        self._decoded = self._squared = ()
        peak = peak_basis([*self._done, self._micro])
        self._done = []
        self._micro = MicroBatch()
        self._step = self._micro.records
        self._seen.clear()
        self._regions.clear()
        self._floors.clear()
        self._norms.clear()
        self._unread_norms.clear()  # a forward that raised never ended: its tensors let go
        self._begun = None
        self._steps += 1
        self._recomputed_softmax = False
        self.last_samples = peak.samples
        self.last_micro_batches = peak.micro_batches
        return peak.records

    def record(self, layer: str) -> LayerStep:
        rec = self._step.get(layer)
        if rec is None:
            # NOTE [ Range statistics on the steps that gather statistics ]: and a layer's first
            ranged = self.ranging or layer not in self._ranged_layers
            rec = self._step[layer] = LayerStep(ranged=ranged)
            if ranged:
                self._ranged_layers.add(layer)
        return rec

    # -- hooks -------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> _Handle | _Queued:
        """Pack hook (see NOTE [ What is compressed ]; its cost: NOTE [ Pack path cost ])."""
        self._matching = True
        if t.layout != torch.strided or t.is_meta:
            return t.detach().clone()
        if _current_node() is not None:
            self.passed += 1  # NOTE [ Distributed parameters and recomputation ]
            return t
        if self.fsdp.active and self.fsdp.contains(t):
            self.passed += 1
            self.fsdp_passed += 1
            return t
        ptr = (t if type(t) is torch.Tensor else local_tensor(t)).untyped_storage().data_ptr()
        inputs = self.inputs  # NOTE [ Model inputs ] in inputs.py
        if ptr in self._param_ptrs or (ptr in inputs.ptrs and inputs.holds(t, ptr)):
            # a parameter, a view of one, or a model input: no op above it consumed an input
            # the region tracker waits for (and its grad_fn, not read, gets no Python object
            # for the collector to track all step)
            self.passed += 1
            return SavedRef(t)  # NOTE [ In-place checks ]
        # NOTE [ Graphs compiled by torch.compile ]
        if (not t.requires_grad or self.compiled_passed) and _from_compiled_graph():
            self.passed += 1
            self.compiled_passed += 1
            if not self._compiled_warned:
                self._compiled_warned = True
                _log.warning(_COMPILED_WARNING)
                warnings.warn(_COMPILED_WARNING, RuntimeWarning, stacklevel=2)
            return SavedRef(t)
        layer = self._tracker.current
        if self._queueing and layer != ROOT:  # NOTE [ Packs queued in the forward ]
            numel = t.numel()
            if numel < BATCH_BELOW:
                queued = _Queued(t, ptr, layer, t._version)
                queue = self._queue
                queue.append(queued)
                self._queued_values += numel
                if len(queue) >= _QUEUE_RECORDS or self._queued_values >= _QUEUE_VALUES:
                    self.settle()
                return queued
        if self._queue:
            self.settle()
        saved = self._pack_tensor(t, ptr, layer, t._version)
        if layer == ROOT:  # NOTE [ Exception lists without a wait ]: saved after the forward (the loss's)
            settle_checks()
        return saved

    def settle(self) -> None:
        """Pack the queued tensors, in the order they were saved (NOTE [ Packs queued in the forward ])."""
        if self._settling:
            return
        self._settling = True
        try:
            while self._queue:
                queue, self._queue = self._queue, []
                self._queued_values = 0
                for i, queued in enumerate(queue):
                    t = queued.tensor
                    if t is None:
                        continue
                    try:
                        if t._version != queued.version:
                            queued.saved = self._changed_since_saved(t, queued.version)
                        else:
                            queued.saved = self._pack_tensor(t, queued.ptr, queued.layer, queued.version)
                    except BaseException:
                        self._queue[:0] = queue[i + 1:]  # the rest stays queued, in order
                        raise
                    queued.tensor = None
        finally:
            self._settling = False

    @staticmethod
    def _changed_since_saved(t: torch.Tensor, version: int) -> Saved:
        """The record of a queued tensor changed in place before its turn: it holds the tensor as it
        is now, and its unpack raises autograd's in-place error, as PyTorch's backward does for it
        (NOTE [ In-place checks ]); packed now, the changed values would give a silently wrong
        gradient wherever nothing else holds the tensor to check it against."""
        saved = Saved(t, t)
        saved.version = version
        _keep_changed(saved, t)
        return saved

    def _pack_tensor(self, t: torch.Tensor, ptr: int, layer: str, version: int) -> _Handle:
        """:meth:`pack` of a tensor that is neither a parameter nor an input, saved in ``layer`` at
        ``version``."""
        node = t.grad_fn
        # plain tuples (a torch.Size would stay tracked by the garbage collector all step)
        shape = tuple(t.shape)
        # held as the parameter or input it was made from: NOTE [ Copies of parameters ], NOTE
        # [ Weights computed from parameters ], NOTE [ Copies of parameters without a node ]
        if node is not None:
            held = ((type(node).__name__ in CASTS and _copy_of_parameter(node))
                    or self._copies.computed(t, node, shape))
        else:
            held = self._copies.holds(t, self.inputs.floats)
        if held:
            self.passed += 1
            return SavedRef(t)
        if node is not None:
            self._match(t, node)
        flat = t.is_contiguous() and t.numel() > 0  # NOTE [ De-duplication ]: contiguous by place
        key: _DedupKey = (ptr, t.storage_offset(), t.numel() if flat else shape,
                          None if flat else t.stride(), t.dtype, t.device, version)
        hit = self._seen.get(key)
        if hit is not None:
            again = hit()
            if again is not None and again.source is not None and again.source() is not None:
                again.readers += 1
                if again.shape != shape:
                    # region codes are laid out in the record's shape: a view of another
                    # shape is not offered to the region matcher (its op keeps the values)
                    return Alias(again, shape, None if t.is_contiguous() else t.stride())
                if again.layer is not None:
                    self._regions.note(t, again, again.layer, node)
                return again
        operands: list[Raise] = []  # an attention's query and key (NOTE in attention.py)
        if self._floors.active:  # NOTE [ Bit floors ]: before t's record (read from a norm's input?)
            for found in self._floors.matches(t):
                self._raise_to_floor(found)
                if found.kind == NORM:  # NOTE [ Norm outputs recomputed from the input ]
                    self._norms.note(found.op, found.saved, found.source)
                elif found.kind == ATTENTION and found.place is not None:
                    operands.append(found)
        try:
            saved = self._pack_new(t, layer, operands)
        except Exception as exc:  # statistics code failed: see NOTE [ Codec fallback ]
            self._on_fallback(layer, exc)
            saved = Saved(t.detach().clone(), t)
        data = saved.data
        if isinstance(data, torch.Tensor) and ptr != 0 and _storage_ptr(data) == ptr:
            # held as it is: its version checked however long ``t`` lives
            saved.source = _Held(data, _op_of(t))
        else:
            saved.source = weakref.ref(t)
        saved.version, saved.owner = version, self._micro
        if not flat and t.numel() > 0:
            saved.stride = t.stride()  # NOTE [ The saved layout ]
        self._seen[key] = self._micro.track(saved)
        if saved.layer is not None:
            self._regions.note(t, saved, saved.layer, node)
            if node is not None and isinstance(saved.data, Packed | Derived):
                self._producers[(id(node), int(t.output_nr))] = (node, weakref.ref(saved))
                self._recent.append(t)
                if len(self._recent) > _RECENT:
                    del self._recent[0]
        # (active again if t's own floor was found: NOTE [ Walks that find nothing ] in walks.py)
        data = saved.data
        quantised = isinstance(data, Packed) and data.codec == "quantize"
        hinted = saved.slot is not None and type(data) is torch.Tensor  # exact by a hint: its raise confirms
        if (quantised or hinted) and saved.layer is not None and self._floors.active:
            self._floors.note(t, saved, saved.layer)
        return saved

    def end_forward(self, outputs: Any = None) -> None:
        """The model's forward ended, with ``outputs``: no pending input can be matched any more."""
        if self._queue:
            self.settle()
        if self._unread_norms:
            self._normalise_unread(None)
        if self._batches:
            self._encode_batches()
        if self._held_log_probs:
            self._flush_log_probs()
        for saved, source in self._regions.outputs.leftover():
            self._raise_unread(saved, source)
        if outputs is not None and self._config.head_bits is not None and self._producers:
            self._floor_heads(outputs, self._config.head_bits)
        settle_checks()  # NOTE [ Exception lists without a wait ]: no input is held into the backward
        self._regions.clear()
        self._floors.clear()
        self._norms.clear()
        self.inputs.clear()
        self._forget_producers()

    @contextlib.contextmanager
    def _reading_fields(self, any_exact: bool = False) -> Iterator[None]:
        """Node fields read in the forward go through :meth:`_peek`, not a decode; ``any_exact``:
        a layer's exact records are read too (by a reader that keeps the tensor it gets, NOTE [
        Norm outputs recomputed from the input ]), not only those outside every layer."""
        self._peeking, self._peek_exact = True, any_exact
        try:
            yield
        finally:
            self._peeking = self._peek_exact = False

    def _peek(self, saved: Saved | SavedRef | Alias | torch.Tensor) -> torch.Tensor:
        """A node field read during the forward (NOTE [ Elementwise expressions ]: constants; NOTE
        [ Rows no loss reads ]: a loss's target): exact records, with none of :meth:`unpack`'s
        bookkeeping; anything lossy raises."""
        if self._caught is not None:  # :meth:`_saved_handle`: the handle itself is what is asked
            self._caught.append(saved)
            raise _HandleRead
        if isinstance(saved, torch.Tensor):
            return saved
        if isinstance(saved, SavedRef):
            return saved.unpack()
        if isinstance(saved, _Queued) and saved.saved is not None:  # packed since (the queue is in order)
            return self._peek(saved.saved)
        if isinstance(saved, Saved):
            data = saved.data
            if isinstance(data, torch.Tensor) and (saved.layer is None or self._peek_exact):
                return data
            if isinstance(data, Packed) and data.codec == "lossless" and not saved.dtype.is_floating_point:
                out: torch.Tensor = self._codec("lossless").decode(data)
                return out
        raise RuntimeError("memctl reads only exact records of a node while packing")

    # -- NOTE [ Rows no loss reads ] in logprobs.py -------------------------------------------
    def _find_losses(self, t: torch.Tensor) -> None:
        """Record, for each held log-softmax output an ``nll_loss`` within a few nodes of ``t`` reads,
        the rows whose target is not ignored."""
        stack: list[Any] = [t.grad_fn]
        seen = 0
        while stack and seen < _LOSS_NODES:
            node = stack.pop()
            seen += 1
            if type(node).__name__ != "NllLossBackward0":
                stack.extend(n for n, _ in node.next_functions if n is not None)
                continue
            source, nr = node.next_functions[0]
            held = self._held_log_probs.get(id(source)) if source is not None else None
            if held is None or held.node is not source or nr != 0:
                continue
            held.losses += 1
            held.rows = self._kept_rows(node, held)

    def _kept_rows(self, node: Any, held: _HeldLogProbs) -> torch.Tensor | None:
        """The rows of the held ``y`` (N, V) whose target the loss ``node`` does not ignore, or
        None (all): only when the softmax runs along each row, so that a row's gradient is 0
        wherever its ``g`` is."""
        y = held.source
        ignore = getattr(node, "_saved_ignore_index", None)
        dim = getattr(held.node, "_saved_dim", None)
        if not isinstance(ignore, int) or not isinstance(dim, int) or y.dim() != 2:
            return None
        if dim >= 2**63:
            dim -= 2**64  # the node reports an int64 as unsigned (−1 reads 2⁶⁴ − 1)
        if dim not in (1, -1):
            return None
        try:
            with self._reading_fields():  # the target is an integer tensor: exact however it was stored
                target = node._saved_target
        except RuntimeError:
            return None
        if target.dim() != 1 or target.numel() != y.shape[0]:
            return None
        return (target != ignore).nonzero().reshape(-1)

    def _flush_log_probs(self) -> None:
        """Encode the held log-softmax outputs (NOTE [ Rows no loss reads ])."""
        held_all, self._held_log_probs = self._held_log_probs, {}
        bits = self._config.log_prob_bits
        for held in held_all.values():
            saved = held.saved
            if bits is None or saved.data is not held.source or held.source._version != held.version:
                continue  # modified in place: kept as it is, exact (autograd's own check follows)
            rows = held.rows if held.losses == 1 and saved.readers <= 2 else None
            if rows is not None and rows.numel() == held.source.shape[0]:
                rows = None
            kept = self._log_probs(held.source, held.layer, bits, rows)
            if kept is None:
                continue
            saved.data = kept
            rec = self.record(held.layer)
            rec.fixed_bytes += kept.nbytes - held.source.nbytes
            rec.packed_bytes += kept.nbytes - held.source.nbytes

    def _floor_heads(self, outputs: Any, bits: int) -> None:
        """Store the inputs of the head ``outputs`` come from at ``bits`` (NOTE [ The head's input ]
        in heads.py): now, while their source is alive, and from the next forward on by place."""
        if self._config.codec is not CodecMode.QUANTIZE:
            return
        for node in head_nodes(outputs):
            for parent, nr in node.next_functions:
                entry = self._producers.get((id(parent), int(nr))) if parent is not None else None
                saved = entry[1]() if entry is not None and entry[0] is parent else None
                if saved is None or saved.layer is None or saved.slot is None:
                    continue  # a record at a floor of its own, or outside every layer
                data = saved.data
                if not isinstance(data, Packed) or data.codec != "quantize":
                    continue  # derived from others: keeps what it has
                source = saved.source() if isinstance(saved.source, weakref.ref) else None
                # a batch's piece (NOTE [ Batched small records ]) is written with its batch
                if source is not None and source._version == saved.version and type(data) is not BatchRecord:
                    self._raise_to_floor(Raise(saved, source, saved.layer, bits, node, HEAD))
                else:  # gone: stored at the floor from the next forward on
                    self._hints_next[saved.slot] = max(self._hints_next.get(saved.slot, 0), bits)

    def _forget_producers(self) -> None:
        self._producers.clear()
        self._granted.clear()
        self._offered.clear()
        self._recent.clear()

    def observe(self, output: Any) -> None:
        """Match pending inputs against a module's output (NOTE [ Finding the op that saved a tensor ])."""
        if self._queue:
            self.settle()  # NOTE [ Packs queued in the forward ]: what the module saved, first
        self._matching = True
        if isinstance(output, dict):
            items = list(output.values())
        else:
            items = list(output) if isinstance(output, tuple | list) else [output]
        if self._unread_norms:
            self._normalise_unread(items)
        for t in items:
            node = t.grad_fn if isinstance(t, torch.Tensor) else None
            if node is not None:
                self._match(t, node)
                if type(node).__name__ in BATCH_NORM:
                    self._watch_unread(t)
                # NOTE [ A batch norm's input read twice ] in norm_reads.py
                self._norm_reads.watch(t, node, self._tracker.current)
                if self._producers and t.is_floating_point():
                    self._offer_expression(t)
                if self._held_log_probs:
                    self._find_losses(t)

    def _match(self, t: torch.Tensor, node: Any) -> None:
        """:meth:`observe` for one tensor, whose ``grad_fn`` is ``node`` (not None)."""
        for pending, part in self._regions.matches(t, node):
            saved = pending.saved()
            if saved is not None:
                if saved.slot is not None and type(pending.op).__name__ in VALUE_DEPENDENT and (
                        isinstance(saved.data, Derived) or saved.slot in self._own_hints):
                    self._own_hints_next.add(saved.slot)  # NOTE [ No chain into a value-dependent ... ]
                if part is not None:
                    self._attach_region(saved, part, pending.source, pending.layer)
                root = root_of(saved).data  # NOTE [ Batch-norm outputs recomputed from the input ]
                if is_wide(root) or (isinstance(root, Packed) and root.codec == "quantize"):
                    offers = self._regions.outputs
                    for unread in offers.offer(pending.op, saved, pending.source, pending.version):
                        self._raise_unread(*unread)

    def unpack(self, saved: _Handle | _Queued) -> torch.Tensor:
        """Unpack hook: decode and check that shape and dtype came back unchanged, in the saved
        tensor's layout where the reader needs it (NOTE [ The saved layout ])."""
        out = self._read(saved)
        handle = saved.saved if type(saved) is _Queued else saved
        stride = handle.stride if type(handle) is Saved or type(handle) is Alias else None
        if stride is not None and not self._inner_reads and not same_layout(out, stride) \
                and isinstance(_current_node(), BackwardCFunction):
            return laid_out(out, stride)
        return out

    def _read(self, saved: _Handle | _Queued) -> torch.Tensor:
        """:meth:`unpack`'s values, in whatever layout the record decodes to."""
        if self._queue:
            self.settle()  # NOTE [ Packs queued in the forward ]
        poll_checks()  # NOTE [ Exception lists without a wait ]
        if type(saved) is _Queued:
            if saved.saved is None:  # read while the queue is packed, before its turn: exact
                return saved.tensor  # type: ignore[return-value]  # (held until its record is made)
            saved = saved.saved
        out = self._unpack(saved)  # type: ignore[arg-type]  # (a queued tensor's record, above)
        if type(saved) is not Saved:
            return out
        data = saved.data
        if isinstance(data, Packed) and data.codec == "quantize":
            node = _current_node()
            name = type(node).__name__ if node is not None else None
            center = SQUARE_READERS.get(name) if name is not None else None
            if center is not None:  # NOTE [ Squares of a rounded result ] in squares.py
                if type(data) is BatchRecord and data.batch.squares.get(data.index) == center:
                    squared = self._squared_piece(data)
                    if squared is not None:
                        return squared
                return square_read(out, data, center)
            if name in NORM_NODES and self._norm_reads.pending and not self._inner_reads:
                self._norm_reads.read(node, saved)  # NOTE [ A batch norm's input read twice ]
        elif isinstance(data, Derived) and (data.reads is not None or self._norm_reads.pending) \
                and not self._inner_reads:  # what the running node reads, not a record's root
            node = _current_node()
            if node is not None:
                name = type(node).__name__
                if data.reads is not None:  # NOTE [ A derived output read back into its derivative ]
                    self._judge_reader(data.reads, node, name)
                if name in NORM_NODES and self._norm_reads.pending:  # NOTE [ A batch norm's input ... ]
                    self._norm_reads.read(node, saved)
        return out

    def _inner_unpack(self, saved: _Handle) -> torch.Tensor:
        """:meth:`unpack` of a record another record is rebuilt from (its root, an expression's
        other input): read for that record, not by the running node itself."""
        self._inner_reads += 1
        try:
            return self.unpack(saved)
        finally:
            self._inner_reads -= 1

    def _judge_reader(self, reads: tuple[tuple[str, int], str], node: Any, name: str) -> None:
        """A derived output of a value-dependent op at ``reads[0]`` is read by ``node``: from the next
        forward on, that place keeps a record of its own if the read goes back into the op's
        derivative (NOTE [ A derived output read back into its derivative ] in derived.py)."""
        place, op = reads
        if place in self._own_outputs or (place, name) in self._harmless_reads:
            return
        if reads_back(node, op):
            if len(self._own_outputs) >= _MOST_PLACES:
                self._own_outputs.clear()
            self._own_outputs.add(place)
        else:
            if len(self._harmless_reads) >= _MOST_PLACES:
                self._harmless_reads.clear()
            self._harmless_reads.add((place, name))

    def _unpack(self, saved: _Handle) -> torch.Tensor:
        if self._peeking:  # a node's field read in the forward: exact records only, nothing decoded lossily
            return self._peek(saved)
        if self._matching and _current_node() is not None:  # not a node field read while packing
            self._matching = False  # (once a backward: nothing is added until the next pack)
            self.collector.backward()  # NOTE [ Collector paused while records live ]
            self._regions.clear()  # the forward is over: no pending input can still be matched
            self._floors.clear()
            self._norms.clear()
            if self._producers:
                self._forget_producers()
        if isinstance(saved, torch.Tensor):
            return saved
        if isinstance(saved, Alias):
            return self.unpack(saved.alias_of).reshape(saved.shape)
        if isinstance(saved, SavedRef):
            return saved.unpack()
        if saved.owner is not None:
            saved.owner.used = True
        data = saved.data
        # NOTE [ Batched small records ]: the bytes of pending records are written before a lossy
        # decode (an exact record, a node's field read in the forward too, needs nothing encoded);
        # an encode that failed, or a member changed in place, leaves the record exact
        if not isinstance(data, torch.Tensor) and self._batches:
            self._encode_batches()
            data = saved.data
        source = saved.source() if saved.source is not None else None
        if source is not None and source._version != saved.version:
            check_version(source, saved.version, getattr(saved.source, "node", None))
        if isinstance(data, torch.Tensor):
            return data
        if isinstance(data, LogProbs):  # NOTE [ Log-probabilities ]
            return decode_log_probs(data, self._codec("quantize"), saved.shape, saved.dtype)
        # a ReLU result read unclamped (NOTE [ Unbiased reads of a ReLU result ])
        unclamped = _unclamped_code(saved, data) if saved.regions else None
        shared = self._shared.take(saved)  # NOTE [ One decode for several readers ]
        if shared is not None:
            return shared if unclamped is None else self._for_reader(shared, unclamped, saved.dtype)
        if type(data) is BatchRecord and data.exc is None and not saved.regions:
            # NOTE [ Batched small records ]: the most common record of a recurrent net, its
            # piece of its batch in its own shape and dtype (what the checks below would verify);
            # the decode time observed is the batch's, when it is decoded
            out = self._from_batch(data, timed=True)
            if saved.readers > 0:
                self._shared.keep(saved, out)
            return out
        start = time.perf_counter()
        fused = None
        if isinstance(data, Derived) and (mapped := self._decode_mapped(saved, data, unclamped)) is not None:
            fused, out = mapped  # NOTE [ Fused channel passes ]: decode and channel map in one pass
        elif isinstance(data, Derived):  # NOTE [ Outputs recomputed from the input ]
            source = self._inner_unpack(data.source)
            masked = getattr(data.fn, "masked", None)  # NOTE [ Fused channel passes ]
            fused = _relu_code(saved) if saved.regions and masked is not None else None
            got = None
            if fused is not None and masked is not None:
                floor = -math.inf if unclamped is not None else mask_floor(saved.dtype)
                got = masked(source, fused.planes[0].buffers["payload"], floor)
            if got is None and unclamped is not None:  # the map's values, zero off the mask
                linear = data.fn.linear  # type: ignore[attr-defined]  # (_unclamped_code checked it)
                got = linear(source).mul_(self._codec("lossless").decode(unclamped.planes[0]))
            elif got is None:
                others = [self._inner_unpack(o) for o in data.others]  # NOTE [ Elementwise expressions ]
                fused, got = None, data.fn(source, *others)
            out = got
        else:
            codec: Any = self._codec(data.codec)
            # NOTE [ ReLU masks ]
            fused = _relu_code(saved) if saved.regions and decodes_mask(codec) else None
            if fused is None and type(data) is BatchRecord and data.exc is None:
                out = self._from_batch(data)  # NOTE [ Batched small records ]
            else:
                out = codec.decode(data) if fused is None else codec.decode(data, mask=fused.planes[0])
        if out.dtype != saved.dtype or out.shape != saved.shape or out.device != saved.device:
            raise CodecError(
                f"codec {data.codec!r} decoded a {tuple(out.shape)} {out.dtype} tensor on {out.device} "
                f"for a saved {tuple(saved.shape)} {saved.dtype} tensor on {saved.device}; "
                "this is a bug in the codec, please report it"
            )
        for region in saved.regions:
            if region is fused:
                continue
            lossless = self._codec("lossless")
            if len(region.planes) == 1:  # NOTE [ One-plane projection ] in regions.py
                code = lossless.decode(region.planes[0])
            else:
                code = torch.zeros(saved.shape, dtype=torch.uint8, device=out.device)
                for bit, plane in enumerate(region.planes):
                    code |= lossless.decode(plane).to(torch.uint8) << bit
            out = region.partition.project(out, code)
        self._shared.keep(saved, out)
        self.timings.observe_decode(time.perf_counter() - start)
        return out if unclamped is None else self._for_reader(out, unclamped, saved.dtype)

    def _for_reader(self, values: torch.Tensor, code: RegionCode, dtype: torch.dtype) -> torch.Tensor:
        """A ReLU result's unclamped values (NOTE [ Unbiased reads of a ReLU result ]) as the op
        reading them needs them: as they are for a reader linear in them, else projected onto
        the mask (a new tensor; ``values`` may be held for other readers)."""
        node = _current_node()
        if node is not None and type(node).__name__ in _VALUE_READERS:
            return values
        floor = mask_floor(dtype)
        if values.dim() >= 2 and values.is_cpu:  # NOTE [ Fused channel passes ]: the identity map, masked
            ones = torch.ones(values.shape[1])
            zeros = torch.zeros(values.shape[1])
            fast = channels.affine(values, zeros, ones, zeros, mask=code.planes[0].buffers["payload"],
                                   floor=floor)
            if fast is not None:
                return fast
        return RELU.project(values, self._codec("lossless").decode(code.planes[0]))

    def _from_batch(self, data: BatchRecord, timed: bool = False) -> torch.Tensor:
        """``data``'s values, its piece of its batch decoded whole (the two batches decoded last
        are held, split into their records' pieces by one call); ``timed``: the batch's decode
        is observed in the decode timings."""
        batch = data.batch
        held = self._decoded
        if held and held[0][0] is batch:
            pieces = held[0][1]
        elif len(held) > 1 and held[1][0] is batch:
            pieces = held[1][1]
        else:
            start = time.perf_counter()
            values = self._codec("quantize").decode(batch.whole())
            pieces = values.split(batch.sizes)
            if timed:
                self.timings.observe_decode(time.perf_counter() - start)
            self._decoded = ((batch, pieces, values), *held[:1])
        out = pieces[data.index].view(*data.shape)  # (ints parse faster than a tuple; never 0-d)
        return out if out.dtype is data.dtype else out.to(data.dtype)

    def _squared_piece(self, data: BatchRecord) -> torch.Tensor | None:
        """``data``'s values read squared (:func:`~memctl.controller.squares.square_read`), from its
        batch's squared records corrected together by one kernel call when the first of them is
        read; None where that does not apply (then ``data`` alone is corrected)."""
        batch = data.batch
        for held, pieces in self._squared:
            if held is batch:
                piece = pieces.get(data.index)
                return None if piece is None else piece.view(*data.shape)
        values = next((v for held, _, v in self._decoded if held is batch), None)
        if values is None or values.dtype is not torch.float32 or not values.is_cpu \
                or not values.is_contiguous():
            return None  # (not decoded through its batch: a record with exceptions, say)
        starts = list(itertools.accumulate(batch.sizes, initial=0))
        segments = [(starts[i], starts[i + 1], center) for i, center in batch.squares.items()]
        out = square_read_segments_cpu(values, batch.meta.numpy()[:batch.groups], batch.bits, batch.group,
                                       segments)
        pieces = {i: out[s:e] for (s, e, _), i in zip(segments, batch.squares, strict=True)}
        self._squared = ((batch, pieces), *self._squared[:1])
        return pieces[data.index].view(*data.shape)

    def _decode_mapped(self, saved: Saved, data: Derived,
                       unclamped: RegionCode | None) -> tuple[RegionCode | None, torch.Tensor] | None:
        """A batch-norm chain's record decoded straight from its root through its channel map
        (NOTE [ Fused channel passes ] in memctl/codecs/channels.py), with the ReLU code it
        applied (``unclamped``: zeroing off the mask only, NOTE [ Unbiased reads of a ReLU
        result ]); None where that does not apply (then the root is decoded, or its held
        tensor taken, and the map applied after)."""
        get_map = getattr(data.fn, "channel_map", None)
        root = data.source
        if get_map is None or data.others or not isinstance(root, Saved) or root.regions:
            return None
        packed = root.data
        if not isinstance(packed, Packed) or packed.codec != "quantize" or self._shared.holds(root):
            return None
        codec: Any = self._codec("quantize")
        decode_affine = getattr(codec, "decode_affine", None)
        code = _relu_code(saved) if saved.regions else None
        spec = get_map(code is not None)
        if decode_affine is None or spec is None:
            return None
        mask = None if code is None else code.planes[0].buffers["payload"]
        out = decode_affine(packed, *spec, mask_bits=mask, floor=-math.inf if unclamped is not None else None)
        if out is None:
            return None
        # what unpack does for the root it no longer decodes
        if root.owner is not None:
            root.owner.used = True
        source = root.source() if root.source is not None else None
        if source is not None and source._version != root.version:
            check_version(source, root.version)
        self._shared.take(root)
        return code, out

    # -- internals -------------------------------------------------------------------
    def _pack_new(self, t: torch.Tensor, layer: str, operands: list[Raise] | None = None) -> Saved:
        self.packs += 1
        if self._batches.deferred:  # NOTE [ Roots known from the last forward ]: not stored again in time
            for b in self._batches.overdue(self.packs):
                self._encode_batches(b)
        rec = self._step.get(layer)
        if rec is None:
            rec = self.record(layer)
        rec.tensors += 1
        nbytes = t.nbytes
        if not t.is_floating_point():
            if t.numel() < self._config.min_numel:  # as a small float tensor is: held, version-checked
                rec.other_bytes += nbytes
                return Saved(_held_small(t, nbytes), t)
            try:
                p = self._codec("lossless").encode(t)
            except Exception as exc:  # see NOTE [ Codec fallback ]
                self._on_fallback(layer, exc)
                rec.other_bytes += nbytes
                return Saved(t.detach().clone(), t)
            rec.other_bytes += _nbytes(p)
            return Saved(p, t)
        rec.raw_bytes += nbytes
        numel = t.numel()
        config = self._config
        node = t.grad_fn
        if config.log_prob_bits is not None and numel >= config.min_numel and is_log_softmax(t):
            if layer != ROOT and t.dim() == 2 and node is not None:  # NOTE [ Rows no loss reads ]
                raw = t.detach()
                held = Saved(raw, t)
                self._held_log_probs[id(node)] = _HeldLogProbs(node, held, raw, layer, t._version)
                rec.fixed_bytes += nbytes  # exact until the forward ends
                rec.packed_bytes += nbytes
                return held
            kept = self._log_probs(t, layer, config.log_prob_bits)
            if kept is not None:
                rec.fixed_bytes += kept.nbytes
                rec.packed_bytes += kept.nbytes
                return Saved(kept, t)
        if node is None and numel >= _TWO_VALUED_FROM and t.is_cpu and type(t) is torch.Tensor:
            two = self._two_valued(t, layer)  # NOTE [ Two-valued floats ] in the lossless codec
            if two is not None:  # exact, one bit a value: outside the allocation's control
                size = _nbytes(two)
                rec.fixed_bytes += size
                rec.packed_bytes += size
                return Saved(two, t)
        exact = (layer == ROOT and not config.compress_outside) or (
            node is not None and type(node).__name__ in _EXACT_OPS
        )
        if exact or numel < config.min_numel:
            rec.fixed_bytes += nbytes
            rec.packed_bytes += nbytes
            if not exact:  # NOTE [ Small tensors kept as they are ] in controller.py
                rec.small_bytes += nbytes
            # a small tensor is held as it is (its unpack checks its version: NOTE [ In-place
            # checks ]); a copy was a launch a tensor on a GPU (a batch norm's mean and invstd)
            return Saved(_held_small(t, nbytes) if not exact else t.detach().clone(), t)
        rec.numels.append(numel)
        rec.element_size = t.element_size()
        part = result_partition(node)
        mask_nbytes = part.nbytes(numel) if part is not None else 0
        rec.mask_bytes += mask_nbytes
        bits, error_bound = self._choice_for(layer)
        quantising = config.codec is CodecMode.QUANTIZE
        if operands and config.attention_recompute and bits < KEEP_BITS and quantising:
            derived = self._derive_attention(t, operands, layer, rec)
            if derived is not None:  # NOTE in attention.py: no values of its own to price
                rec.numels.pop()
                self._recomputed_softmax = True
                return derived
        if self._recomputed_softmax and part is None and bits < KEEP_BITS and quantising:
            derived = self._derive_dropped(t, layer)
            if derived is not None:  # NOTE in attention.py: the dropout's output
                rec.numels.pop()
                return derived
        if part is None and quantising and node is not None and type(node).__name__ in LAYOUT:
            derived = self._derive_layout(t, node, bits, layer)
            if derived is not None:  # NOTE [ Layout copies of a record ] in layout.py
                rec.numels.pop()
                return derived
        found = self._floors.result_floor(node) if part is None else None
        if found is not None and bits < found[0] and quantising:
            floor, kind = found
            rec.numels.pop()
            if self._norms:  # NOTE [ Norm outputs recomputed from the input ]
                derived = self._derive_norm(t, floor, layer)
                if derived is not None:
                    return derived
            # NOTE [ Bit floors ]; a norm's output in its rows' groups (NOTE [ Norm rows in ... ])
            group = row_group(t, config.group_size) if kind == NORM else None
            return self._at_floor(t, floor, layer, rec, group)
        if bits >= KEEP_BITS:  # held as it is, version-checked (NOTE [ What is compressed ])
            rec.bit_values += 8 * nbytes
            rec.packed_bytes += nbytes
            return Saved(t.detach(), t, layer=layer)
        # NOTE [ Walks that find nothing ] in walks.py: the derived records' checks as well,
        # unless an op's output or a module's expression is on offer in this forward
        if self._derivations.walking or self._offered or self._regions.outputs:
            self._derivations.packed()
            derived = self._derive(t, bits, layer, rec) if part is None else None
            if self._declined:  # NOTE [ A derived output read back into its derivative ]
                self._declined = False
            else:
                if derived is None and (part is None or part == RELU):
                    derived = self._derive_normalized(t, bits, layer, rec, part)
                if derived is None and part is None and self._producers:
                    derived = self._derive_expression(t, bits, layer, rec)
            if derived is not None:
                self._derivations.found()
                return derived
        slot: _Slot = (layer, rec.tensors, numel)
        hint = self._floor_hints.get(slot)
        # NOTE [ Norm rows in groups of their own ] in floors.py: a norm's record by place
        group = self._group_hints.get(slot) if part is None and self._group_hints else None
        floored = hint is not None and bits < hint and config.codec is CodecMode.QUANTIZE
        if hint is not None and floored:  # NOTE [ Floors known from the last forward ]
            rec.numels.pop()
            if part is None:
                saved = self._at_floor(t, hint, layer, rec, group)
                saved.slot = slot
                return saved
            bits = hint  # with its region code (a ReLU result that a head reads), below
        seed = self._next_seed()
        quantised = config.codec is not CodecMode.ERRORBOUND or error_bound is None
        if part is None and self._batching and quantised and group is None:
            if self._batches.accepts(t, numel):  # NOTE [ Batched small records ]
                return self._batched(t, int(bits), seed, layer, rec, slot)
            if slot in self._root_hints and t.is_cpu:  # NOTE [ Roots known from the last ... ]
                return self._batched(t, int(bits), seed, layer, rec, slot, defer=True)
        try:
            p, region = self._compress(t, bits, error_bound, seed, part, group)
        except Exception as exc:  # see NOTE [ Codec fallback ]
            self._on_fallback(layer, exc)
            rec.fixed_bytes += nbytes
            rec.packed_bytes += nbytes
            rec.numels.pop()
            rec.mask_bytes -= mask_nbytes
            return Saved(t.detach().clone(), t)
        if region is not None:
            rec.packed_bytes += region.nbytes
        rec.packed_bytes += _nbytes(p)
        if floored:  # outside the allocation's control, as _at_floor's records
            rec.fixed_bytes += _nbytes(p)
            rec.floored_bytes += _nbytes(p)
        else:
            rec.bit_values += bits * numel
            self._range_stats(t, p, rec, group)
        saved = Saved(p, t, () if region is None else (region,), layer=layer)
        saved.slot = slot
        return saved

    def _two_valued(self, t: torch.Tensor, layer: str) -> Packed | None:
        """``t``'s lossless record when it takes at most two values (a CPU dropout's mask),
        else None; a codec that fails leaves ``t`` to the path of any other tensor."""
        try:
            found: Packed | None = self._codec("lossless").two_valued(t)  # type: ignore[attr-defined]
        except Exception as exc:  # the tensor then takes the usual path: nothing is lost
            _log.debug("two-valued test of a tensor in %s failed: %s", layer, exc)
            return None
        return found

    def _batched(self, t: torch.Tensor, bits: int, seed: int, layer: str, rec: LayerStep,
                 slot: _Slot, defer: bool = False) -> Saved:
        """``t``'s record in a batch of small records, or alone when ``defer``, its bytes written
        later (NOTE [ Batched small records ], NOTE [ Roots known from the last forward ])."""
        if defer:
            p = self._batches.defer(t, bits, seed, rec, layer, self.packs)
        else:
            full = self._batches.full(bits, t.dtype, t.numel())
            if full is not None:
                self._encode_batches(full)
            p = self._batches.add(t, bits, seed, rec, layer)
        node = t.grad_fn
        if node is not None and t.dtype is torch.float32:
            center = SQUARE_READERS.get(type(node).__name__)
            if center is not None:  # NOTE [ Squares of a rounded result ]: read squared by its own backward
                p.batch.squares[p.index] = center
        self._batch_range_stats(p, rec)  # (if it raises, the member is never live: the batch skips it)
        rec.bit_values += bits * p.numel
        rec.packed_bytes += p.nbytes
        saved = p.saved = Saved(p, t, layer=layer)
        saved.slot = slot
        return saved

    def _empty_exceptions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared empty exception buffers of CPU quantize records."""
        empty = self._no_exceptions
        if empty is None:
            codec: Any = self._codec("quantize")
            empty = self._no_exceptions = codec.exceptions(torch.zeros(1))
        return empty

    def _encode_batches(self, batch: Batch | None = None) -> None:
        """Write the bytes of ``batch``'s records, or of every pending batch's (NOTE [ Batched
        small records ])."""
        codec: Any = self._codec("quantize")
        for b in self._batches.take(batch):
            start = time.perf_counter()
            members = b.members
            ngroups = b.groups
            live = any(m.live for m in members)
            try:
                with torch.no_grad():
                    sources = []
                    for m in members:
                        assert m.source is not None  # held until this encode: every member, in place
                        sources.append(m.source)
                    # one call flattens and concatenates them in C++ (a reshape a member from
                    # Python cost more than the encode of their values: NOTE [ Pack path cost ])
                    flat = _flatten_dense_tensors(sources)
                    if live:
                        nonfinite = codec.encode_into(
                            flat, b.payload[:ngroups * b.group * b.bits // 8], b.meta[:ngroups], bits=b.bits,
                            seed=int(b.params["seed"]))
                    else:  # every record stored again: only the group ranges its statistics read
                        lo, hi = _group_ranges(flat.float(), b.group)
                        b.meta[:ngroups, 0], b.meta[:ngroups, 1] = lo, hi
                        nonfinite = False
            except Exception as exc:  # see NOTE [ Codec fallback ]: every member kept exact
                self._on_fallback(members[0].layer, exc)
                for m in members:
                    self._unbatch(m)
                    m.source = m.saved = None
                continue
            b.shrink()
            for m in members:
                source = m.source
                if not m.live or source is None:
                    continue  # stored again meanwhile (a floor, a raised root)
                saved = m.saved
                if source._version != m.version:
                    _keep_changed(saved, source)
                    continue
                if nonfinite:
                    try:
                        index, value = codec.exceptions(source)
                    except Exception as exc:  # see NOTE [ Codec fallback ]: this member kept exact
                        self._on_fallback(m.layer, exc)
                        self._unbatch(m)
                        continue
                    if index.numel():
                        m.exc = index, value
                        m.rec.packed_bytes += index.nbytes + value.nbytes
            for m in members:  # the tensors go, and the records' cycles with theirs
                m.source = m.saved = None
            b.members = []
            if live:
                self.timings.observe_encode(time.perf_counter() - start)

    def _settle_deferred(self) -> None:
        """Let go of the deferred records stored again (NOTE [ Roots known from the last forward ])."""
        for b in [b for b in self._batches.deferred if not any(m.live for m in b.members)]:
            self._encode_batches(b)

    def _unbatch(self, m: BatchRecord) -> None:
        """A member whose batch could not be encoded, kept as an exact copy."""
        source = m.source
        if not m.live or source is None:
            return
        numel = m.numel
        raw = numel * source.element_size()
        m.saved.data = source.detach().clone()
        rec = m.rec
        self._drop_meta(rec, m)
        rec.packed_bytes += raw - m.nbytes
        rec.fixed_bytes += raw
        _uncontrol(rec, numel, m.batch.bits)

    def _drop_meta(self, rec: LayerStep, old: Packed) -> None:
        """Forget the range statistics kept for ``old`` (NOTE [ Range statistics ])."""
        entry = self._metas.get(id(rec))
        if entry is None:
            return
        kept = entry[1]
        if type(old) is BatchRecord:  # its groups leave the run that holds them
            meta, (g0, g1) = old.batch.meta, old.groups
            for i, run in enumerate(kept):
                if type(run) is list and run[0] is meta and run[1] <= g0 and g1 <= run[2]:
                    kept[i:i + 1] = [r for r in ([meta, run[1], g0, run[3]], [meta, g1, run[2], run[3]])
                                     if r[1] < r[2]]
                    break
        else:
            held = old.buffers.get("meta")
            if held is not None:
                kept[:] = [m for m in kept if (m if type(m) is torch.Tensor else m[0]) is not held]
        if not kept:
            del self._metas[id(rec)]

    def _at_floor(self, t: torch.Tensor, bits: int, layer: str, rec: LayerStep,
                  group: int | None = None) -> Saved:
        """``t`` at its op's floor, outside the allocation's control (NOTE [ Bit floors ]), in
        groups of ``group`` values (None: the configured group)."""
        seed = self._next_seed()
        start = time.perf_counter()
        try:
            p: Packed | torch.Tensor = t.detach() if bits >= KEEP_BITS else \
                self._quantizer(group).encode(t.detach(), bits=bits, seed=seed)
        except Exception as exc:  # see NOTE [ Codec fallback ]
            self._on_fallback(layer, exc)
            p = t.detach().clone()
        self.timings.observe_encode(time.perf_counter() - start)
        nbytes = p.nbytes if isinstance(p, Packed) else t.numel() * t.element_size()
        rec.fixed_bytes += nbytes
        rec.floored_bytes += nbytes
        rec.packed_bytes += nbytes
        return Saved(p, t, layer=layer)

    def _derive_attention(self, t: torch.Tensor, operands: list[Raise], layer: str,
                          rec: LayerStep) -> Saved | None:
        """A softmax's result recomputed from its logits matmul's operand records, or None
        (NOTE [ Attention probabilities recomputed from query and key ] in attention.py)."""
        try:
            with self._reading_fields():
                logits = logits_of(t.grad_fn, t.dim(), scalar_of)
            if logits is None:
                return None
            by_place = {r.place: r for r in operands if r.op is logits.matmul}
            a, b = by_place.get(0), by_place.get(1)
            key = logits.key(t)
            if a is None or b is None or a.saved is b.saved or key in self._attention_failed:
                return None
            shape = tuple(t.shape)
            zero: torch.Tensor | None = None
            own_mask = logits.fill is not None  # the masked_fill's own (a bool tensor autograd keeps)
            if own_mask:
                with self._reading_fields():
                    zero = logits.fill._saved_mask
                if zero is None or zero.dtype is not torch.bool:
                    return None
                own_mask = zero.numel() <= t.numel() // 8  # a mask larger than a bit map: the bit map
            if logits.masked and not own_mask:
                zero = t.detach() == 0
            if logits.added or key not in self._attention_checked:
                exact = probabilities(logits, a.source.detach(), b.source.detach(), zero, shape)
                if not torch.equal(exact, t.detach()):
                    self._attention_failed.add(key)
                    return None
                if not logits.added:
                    self._attention_checked.add(key)
            others: tuple[Saved | torch.Tensor, ...] = (b.saved,)
            if own_mask and zero is not None:
                others += (zero,)  # held as autograd holds it for the masked_fill's backward
            elif zero is not None:
                bitmap = self._codec("lossless").encode(zero)
                others += (Saved(bitmap, zero),)
                nbytes = _nbytes(bitmap)
                rec.fixed_bytes += nbytes
                rec.floored_bytes += nbytes
                rec.packed_bytes += nbytes
            a.saved.readers += 1  # NOTE [ One decode for several readers ]: the matmul's backward too
            b.saved.readers += 1

            def recompute(x: torch.Tensor, y: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
                return probabilities(logits, x, y, rest[0] if rest else None, shape)

            return Saved(Derived(a.saved, recompute, others), t, layer=layer)
        except Exception as exc:  # see NOTE [ Codec fallback ]: the probabilities keep their record
            self._on_fallback(layer, exc)
            return None

    def _saved_handle(self, node: Any, field: str) -> Any:
        """What memctl's pack hook returned for ``node``'s saved ``field`` (None if nothing of
        memctl's), read without decoding it: autograd hands the handle to the unpack hook."""
        self._caught = []
        try:
            with self._reading_fields():
                getattr(node, field)
        except Exception:  # _HandleRead, or a field autograd cannot give
            pass
        finally:
            caught, self._caught = self._caught, None
        handle = caught[0] if caught else None
        return handle.saved if isinstance(handle, _Queued) else handle

    def _derive_dropped(self, t: torch.Tensor, layer: str) -> Saved | None:
        """A dropout's output ``P·M`` of a recomputed softmax result ``P``, kept as a function of
        ``P``'s record and the dropout's mask ``M``'s, or None (NOTE [ Attention probabilities
        recomputed from query and key ] in attention.py)."""
        node: Any = t.grad_fn
        nr = int(t.output_nr)
        for _ in range(4):  # a matmul's operand: a view of it, expanded to its own shape
            if node is None or type(node).__name__ not in _VIEWED:
                break
            node, nr = node.next_functions[0]
        operand = dropout_operand(node) if nr == 0 else None
        if operand is None:
            return None
        below, nr = through_reshapes(*operand)
        if nr != 0 or type(below).__name__ not in SOFTMAX:
            return None
        probs = self._producer(below, 0)
        if probs is None or not isinstance(probs.data, Derived):
            return None
        mask = self._saved_handle(node, "_saved_other")
        if not isinstance(mask, Saved) or mask.shape != probs.shape or mask.dtype != t.dtype \
                or t.numel() != math.prod(probs.shape):  # an expand that repeats nothing
            return None
        probs.readers += 1  # NOTE [ One decode for several readers ]
        mask.readers += 1
        shape = tuple(t.shape)

        def dropped(p: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            return (p * m).reshape(shape)

        return Saved(Derived(probs, dropped, (mask,)), t, layer=layer)

    def _derive_layout(self, t: torch.Tensor, node: Any, bits: float, layer: str) -> Saved | None:
        """``t`` kept as a quantised record of this forward laid out again, or as a matmul of
        two records laid out, or None (NOTE [ Layout copies of a record ] in layout.py)."""
        bottom = below_layout(node)
        if bottom is None:
            return None
        root = self._producer(*bottom)
        product = None
        if root is not None:
            data = root.data
            if not isinstance(data, Packed) or data.codec != "quantize" or int(data.params["bits"]) < bits:
                return None
            operands: tuple[Any, ...] = (root,)
        elif type(bottom[0]).__name__ in MATMULS and bottom[1] == 0:
            found_operands = self._product_operands(bottom[0], bits)
            if found_operands is None:
                return None
            operands = found_operands
            product = type(bottom[0]).__name__
        else:
            return None  # (the common case, found from node types alone)
        found = layout_of(node)
        if found is None:
            return None
        steps = found[2]
        contiguous = t.is_contiguous()
        # an operand saved as an alias (a record of another shape) is read from its record and
        # reshaped: a derived record's inputs are records (Derived.source)
        shapes = tuple(h.shape if isinstance(h, Alias) else None for h in operands)
        records = tuple(_aliased(h) for h in operands)
        key = (product, steps, contiguous, t.dtype, t.device.type, tuple(s is not None for s in shapes))
        if key in self._layouts_failed:
            return None
        laid_out = replay(steps, contiguous)
        fn = laid_out if product is None else _laid_out_product(MATMULS[product], laid_out)
        if any(s is not None for s in shapes):
            fn = _reshaped_inputs(fn, shapes)
        if key not in self._layouts_checked:
            found_exact = [_exact_operand(r) for r in records]
            exact = [x for x in found_exact if x is not None]
            if len(exact) < len(found_exact):
                return None  # nothing to check against now: its own record this time
            try:
                same = torch.equal(fn(*exact), t.detach())
            except RuntimeError:  # a shape the steps do not fit
                same = False
            (self._layouts_checked if same else self._layouts_failed).add(key)
            if not same:
                return None
        for r in records:  # NOTE [ One decode for several readers ]
            r.readers += 1
        return Saved(Derived(records[0], fn, records[1:]), t, layer=layer)

    def _product_operands(self, node: Any, bits: float) -> tuple[Any, Any] | None:
        """The records of a matmul's two operands (an eager attention's probabilities and
        value), each quantised at no fewer than ``bits`` or rebuilt from records, else None."""
        if any(_from_parameter(edge) for edge, _ in node.next_functions):
            return None  # a linear layer's matmul: its weight is no record (known from node types)
        handles = (self._saved_handle(node, "_saved_self"), self._saved_handle(node, "_saved_mat2"))
        for h in handles:
            rec = _aliased(h)
            if not isinstance(rec, Saved):
                return None
            data = rec.data
            if isinstance(data, Packed):
                if data.codec != "quantize" or int(data.params["bits"]) < bits:
                    return None
            elif not isinstance(data, Derived):
                return None
        return handles

    def _raise_to_floor(self, found: Raise) -> None:
        """Store a record packed at its layer's bits again at its op's floor, or exact
        (NOTE [ Bit floors ]); its values leave the layer's controlled values."""
        saved, source = found.saved, found.source
        old = saved.data
        if found.bits is None and saved.slot is not None and isinstance(old, torch.Tensor):
            self._hints_next[saved.slot] = KEEP_BITS  # kept exact at once: NOTE [ Floors known from ... ]
            return
        if not isinstance(old, Packed) or old.codec != "quantize":
            return
        old_bits = int(old.params["bits"])
        group = self._config.group_size
        if found.kind == NORM and found.bits is not None:  # NOTE [ Norm rows in groups of their own ]
            group = row_group(source, group)
        elif found.kind == HEAD and saved.slot is not None:  # a norm's record keeps its rows' groups
            group = self._group_hints_next.get(saved.slot) or self._group_hints.get(saved.slot) or group
        if saved.slot is not None:  # NOTE [ Floors known from the last forward ]
            self._hints_next[saved.slot] = KEEP_BITS if found.bits is None else found.bits
            if group != self._config.group_size:
                self._group_hints_next[saved.slot] = group
        if found.bits is not None and old_bits >= found.bits:
            if old.params.get("group_size") != group_at(old_bits, group):  # (8 bits: a quarter of it)
                self._regroup(saved, source, old, group, found.layer)
            return
        seed = self._next_seed()
        start = time.perf_counter()
        try:
            new: Packed | torch.Tensor = source.detach() if found.bits is None else \
                self._quantizer(group).encode(source.detach(), bits=found.bits, seed=seed)
        except Exception as exc:  # see NOTE [ Codec fallback ]: the record stays as it is
            self._on_fallback(found.layer, exc)
            return
        self.timings.observe_encode(time.perf_counter() - start)
        saved.data = new
        if isinstance(new, torch.Tensor):  # held as it is: its version checked however long ``source`` lives
            saved.source = _Held(new, _op_of(source))
        nbytes = new.nbytes if isinstance(new, Packed) else source.numel() * source.element_size()
        rec = self.record(found.layer)
        rec.packed_bytes += nbytes - old.nbytes
        rec.fixed_bytes += nbytes
        rec.floored_bytes += nbytes
        _uncontrol(rec, source.numel(), old_bits)
        self._drop_meta(rec, old)

    def _regroup(self, saved: Saved, source: torch.Tensor, old: Packed, group: int, layer: str) -> None:
        """Store a norm's record again at its own bits in groups of ``group`` values, still under
        the allocation's control (NOTE [ Norm rows in groups of their own ] in floors.py); a codec
        that fails leaves the record as it is."""
        seed = self._next_seed()
        start = time.perf_counter()
        try:
            new = self._quantizer(group).encode(source.detach(), bits=int(old.params["bits"]), seed=seed)
        except Exception as exc:  # see NOTE [ Codec fallback ]
            self._on_fallback(layer, exc)
            return
        self.timings.observe_encode(time.perf_counter() - start)
        saved.data = new
        rec = self.record(layer)
        rec.packed_bytes += new.nbytes - old.nbytes
        self._drop_meta(rec, old)
        self._range_stats(source, new, rec, group)

    def _log_probs(self, t: torch.Tensor, layer: str, bits: int,
                   rows: torch.Tensor | None = None) -> LogProbs | None:
        """``t`` (only ``rows``, if given) as quantised probabilities, or None (kept exact) if that fails."""
        seed = self._next_seed()
        try:
            return encode_log_probs(t, self._codec("quantize"), bits, seed, self._config.group_size, rows)
        except Exception as exc:  # see NOTE [ Codec fallback ]
            self._on_fallback(layer, exc)
            return None

    def _compress(self, t: torch.Tensor, bits: float, error_bound: float | None, seed: int,
                  part: Partition | None, group: int | None = None) -> tuple[Packed, RegionCode | None]:
        """``t`` encoded at ``bits`` (or ``error_bound``), in groups of ``group`` values (None: the
        configured group), with the region code of ``part``."""
        start = time.perf_counter()
        # The codecs read t through t.detach() themselves.
        region = None
        if self._config.codec is CodecMode.ERRORBOUND and error_bound is not None:
            p = self._codec("errorbound").encode(t, error_bound=error_bound)
        else:
            quantize: Any = self._quantizer(group)
            if part is not None and part.positive_plane and hasattr(quantize, "encode_with_positive"):
                # NOTE [ Positive mask in encode ]: the ReLU code in the same pass as the values
                p, plane = quantize.encode_with_positive(t, bits=int(bits), seed=seed)
                region = RegionCode(part, (plane,))
            else:
                p = quantize.encode(t, bits=int(bits), seed=seed)
        if part is not None and region is None:
            region = self._region_code(t.detach(), part)
        self.timings.observe_encode(time.perf_counter() - start)
        return p, region

    def _derive(self, t: torch.Tensor, bits: float, layer: str, rec: LayerStep) -> Saved | None:
        """``t`` kept as its op's input record raised by ``bits`` (NOTE [ Outputs recomputed ... ])."""
        place = (layer, rec.tensors)
        if self._own_outputs and place in self._own_outputs:
            # NOTE [ A derived output read back into its derivative ]: t keeps a record of its own
            # (nothing else derives it), and its op's input, still on offer, is raised at the
            # forward's end as an input whose output no record holds
            self._declined = True
            return None
        offer = self._regions.outputs.take(t)
        if offer is None or self._config.codec is CodecMode.ERRORBOUND:
            return None
        source_saved, source, fn, key = offer
        op = key[0].split("/", 1)[0]
        reads = (place, op) if op in VALUE_DEPENDENT else None
        # NOTE [ Batch-norm outputs recomputed from the input ]: the input record may itself be
        # derived; the bits go to the record at the chain's start, re-encoded from its own tensor
        root = root_of(source_saved)
        old = root.data
        root_source = source if root is source_saved else self._regions.outputs.raw(root)
        if not (is_wide(old) or (isinstance(old, Packed) and old.codec == "quantize")) or root_source is None:
            return None
        try:
            if key not in self._regions.outputs.verified:
                if not torch.equal(fn(source.detach()), t.detach()):
                    return None  # f not rebuilt exactly from the node: keep y's own record
                self._regions.outputs.verified.add(key)
        except Exception as exc:  # see NOTE [ Codec fallback ]: both records stay as they are
            self._on_fallback(layer, exc)
            return None
        if not self._raise_root(root, root_source, int(bits), layer, rec, hidden=root is not source_saved):
            return None
        rec.bit_values += bits * t.numel()
        self._derived_range_stats(t, rec)
        return Saved(Derived(source_saved, fn, reads=reads), t, layer=layer)

    # -- NOTE [ Elementwise expressions ] in expressions.py ----------------------------------
    def _producer(self, node: Any, nr: int) -> Saved | None:
        entry = self._producers.get((id(node), nr))
        return entry[1]() if entry is not None and entry[0] is node else None

    @staticmethod
    def _root_tensor(saved: Saved) -> torch.Tensor | None:
        """A quantised or rebuilt record's tensor, alive and unmodified since it was packed (else None)."""
        data = saved.data
        if not (isinstance(data, Derived) or (isinstance(data, Packed) and data.codec == "quantize")):
            return None
        if saved.layer is None:
            return None
        if saved.source is None:
            return None
        t = saved.source()
        return t if t is not None and t._version == saved.version else None

    def _expression(self, t: torch.Tensor, layer: str) -> Expression | None:
        """``t`` rebuilt from its roots, checked against ``t`` as the NOTE asks (else None)."""
        if self._config.codec is CodecMode.ERRORBOUND or t.grad_fn is None:
            return None
        try:
            shape = _shape_of(t.grad_fn)
            misses = self._misses.get(shape, 0)
            if misses >= _MISSES and misses % _RETRY:
                self._misses[shape] = misses + 1  # this shape of graph was never rebuilt: walked now and then
                return None
            with self._reading_fields():
                expr = build(t, self._producer, self._root_tensor)
            if expr is None:
                if shape not in self._rebuilt:
                    self._misses[shape] = misses + 1
                return None
            self._rebuilt.add(shape)
            self._misses.pop(shape, None)
            verified = self._regions.outputs.verified
            if not expr.checked and (expr.always_check or expr.key not in verified):
                if not torch.equal(expr.fn(tuple(s.detach() for s in expr.sources)), t.detach()):
                    return None
                if not expr.always_check:
                    verified.add(expr.key)
        except Exception as exc:  # see NOTE [ Codec fallback ]: t keeps its own record
            self._on_fallback(layer, exc)
            return None
        return expr

    def _derive_expression(self, t: torch.Tensor, bits: float, layer: str, rec: LayerStep) -> Saved | None:
        """``t`` kept as a function of its roots, the narrowest of which grows by ``bits``."""
        expr = self._take_offered(t)
        if expr is None:
            expr = self._expression(t, layer)
        if expr is None:
            return None
        quantised = [r for r in expr.roots if isinstance(r.data, Packed)]
        if quantised:  # the bits go to the narrowest quantised root (a rebuilt root has no width)
            root = min(quantised, key=lambda r: int(r.data.params["bits"]))
            source = expr.sources[expr.roots.index(root)]
            have = int(root.data.params["bits"])
            granted = self._granted.get(id(root), have) + int(bits)
            if not self._raise_root(root, source, granted - have, layer, rec, at_least=int(bits) + 1):
                return None
            self._granted[id(root)] = granted
        elif any(isinstance(data, Packed) and int(data.params["bits"]) <= int(bits)
                 for data in (root_of(r).data for r in expr.roots)):
            return None  # read through a rebuilt root no finer than t's own record: t keeps its own
        for r in expr.roots:
            r.readers += 1  # NOTE [ One decode for several readers ]: a root is decoded once for all
        rec.bit_values += bits * t.numel()
        self._derived_range_stats(t, rec)
        fn, shape = expr.fn, t.shape
        derived = Derived(expr.roots[0], lambda *xs: fn(xs).reshape(shape), expr.roots[1:])
        return Saved(derived, t, layer=layer)

    def _take_offered(self, t: torch.Tensor) -> Expression | None:
        """The expression :meth:`_offer_expression` found for ``t``, or for the tensor ``t`` reshapes."""
        if not self._offered or t.grad_fn is None:
            return None
        node, nr = reshaped_from(t)
        entry = self._offered.pop(id(node), None)
        if entry is None or entry[0] is not node or nr != 0:
            return None
        expr = entry[1]
        if any(s._version != r.version for s, r in zip(expr.sources, expr.roots, strict=True)):
            return None
        return expr

    def _offer_expression(self, t: torch.Tensor) -> None:
        """A module's output rebuilt from its roots while their tensors are alive, kept (with the
        tensors) for the layer that saves it next (NOTE [ Elementwise expressions ])."""
        node = t.grad_fn
        if not is_elementwise(node) or self._regions.outputs.offered(node) or id(node) in self._offered:
            return
        expr = self._expression(t, self._tracker.current)
        if expr is None:
            return
        self._offered[id(node)] = (node, expr)
        while len(self._offered) > _OFFERED:
            del self._offered[next(iter(self._offered))]

    def _raise_root(self, root: Saved, source: torch.Tensor, bits: int, layer: str, rec: LayerStep,
                    force: bool = False, hidden: bool = False, at_least: int | None = None) -> bool:
        """``root``'s payload again at ``bits`` more (within the codec's widths), encoded from ``source``
        (also when the width does not grow, if ``force``; in half precision from 16 bits on, if
        ``hidden``: a record autograd never unpacks itself); its growth counted in ``rec``, the layer
        of the record that no longer keeps its own (NOTE [ Outputs recomputed ... ]). False: the
        bytes held the root under the sum of the widths and under ``at_least`` bits (default
        ``bits + 1``), where the derived record would come back coarser than its own record, or
        the encode failed; both records then stay as they are."""
        old = root.data
        if is_wide(old):
            return True  # half precision already holds more than any sum of widths
        if not isinstance(old, Packed):
            return False
        total = int(old.params["bits"]) + bits
        if hidden and total >= WIDE_BITS and source.dtype == torch.float32:  # NOTE [ Batch-norm outputs ... ]
            wide = widen(source)
            if wide is not None:
                root.data = wide
                rec.packed_bytes += wide.element_size() * wide.numel() - old.nbytes
                return True
        raised = width_within(total)
        # no larger than the two records were (an 8-bit record's groups cost more: NOTE [ Eight-bit
        # groups ]; ``bits`` may be a sum of several records' widths)
        n, group = source.numel(), self._config.group_size
        kept = old.nbytes + (packed_nbytes(n, bits, group) if bits in BITS else
                             -(-n * bits // 8) + 8 * -(-n // group))
        while raised > int(old.params["bits"]) and packed_nbytes(n, raised, group) > kept:
            raised = width_within(raised - 1)
        if raised < width_within(total) and raised < (bits + 1 if at_least is None else at_least):
            # an activation's result read from its input's grid at its own width comes back
            # coarser than its own record (4 + 4 bits held at 4: NOTE [ Batch-norm outputs ... ])
            return False
        if raised > int(old.params["bits"]) or force:
            start = time.perf_counter()
            seed = self._next_seed()
            try:
                p = self._codec("quantize").encode(source.detach(), bits=raised, seed=seed)
            except Exception as exc:  # see NOTE [ Codec fallback ]: both records stay as they are
                self._on_fallback(layer, exc)
                return False
            self.timings.observe_encode(time.perf_counter() - start)
            root.data = p
            rec.packed_bytes += p.nbytes - old.nbytes  # the bytes the derived record would have held
        return True

    def _derive_normalized(self, t: torch.Tensor, bits: float, layer: str, rec: LayerStep,
                           part: Partition | None) -> Saved | None:
        """``t`` recomputed from its batch norm's input record (NOTE [ Batch-norm outputs ... ])."""
        chain = chain_of(t)
        if chain is None or self._config.codec is CodecMode.ERRORBOUND:
            return None
        slot: _Slot = (layer, rec.tensors, t.numel())
        # NOTE [ No chain into a value-dependent derivative ]: t keeps its own record, z's moves
        # to normalised coordinates at its own bits all the same
        own = slot in self._own_hints
        pending = self._regions.pending(chain.source, chain.source_node)
        z_saved = pending.saved() if pending is not None else None
        if pending is None or z_saved is None or pending.source.shape != t.shape:
            return None
        z = pending.source.detach()
        root = root_of(z_saved)  # z's record itself, or the normalised record it is read from
        n = self._regions.outputs.raw(root) if root is not z_saved else None
        quantised = isinstance(root.data, Packed) and root.data.codec == "quantize"
        derived_root = root is not z_saved
        if not (quantised or (derived_root and is_wide(root.data))) or (derived_root and n is None):
            return None
        fns = chain.functions(z, t)
        if fns is None:
            return None
        normalise, z_of, t_of = fns
        # the batch norm's output is affine in n, so a root of its own width reads it as finely as
        # its own record; ReLU's result needs a finer one (NOTE [ Batch-norm outputs ... ])
        finest = int(bits) + (1 if chain.after == "ReluBackward0" else 0)
        key = (chain.key, t.dtype, t.device.type)
        region = None
        try:
            if key not in self._regions.outputs.verified:
                if not (verified(lambda v: t_of(normalise(v)), z, t)
                        and verified(lambda v: z_of(normalise(v)), z, z)):
                    return None  # not rebuilt from the node: keep t's own record
                self._regions.outputs.verified.add(key)
            if part is not None and not own:
                region = self._region_code(t.detach(), part)
            if root is z_saved:  # the first output read from z: z's record moves to normalised coordinates
                n = normalise(z)
                normalised = self._normalise_root(z_saved, n, z_of, 0 if own else int(bits), layer, rec,
                                                  at_least=finest)
                if normalised is None:
                    return None
                root = normalised
                if self._batches.deferred:
                    self._settle_deferred()
            elif own or n is None or not self._raise_root(root, n, int(bits), layer, rec, hidden=True,
                                                          at_least=finest):
                return None
        except Exception as exc:  # see NOTE [ Codec fallback ]: t keeps its own record
            self._on_fallback(layer, exc)
            return None
        self._regions.outputs.remember(root, n)
        if own:
            return None
        if region is not None:
            rec.packed_bytes += region.nbytes
        rec.bit_values += bits * t.numel()
        self._derived_range_stats(t, rec)
        saved = Saved(Derived(root, t_of), t, () if region is None else (region,), layer=layer)
        saved.slot = slot
        return saved

    def _normalise_root(self, z_saved: Saved, n: torch.Tensor, z_of: Callable[[torch.Tensor], torch.Tensor],
                        bits: int, layer: str, rec: LayerStep, at_least: int | None = None) -> Saved | None:
        """``z_saved``'s record (a batch norm's input) encoded again from ``n``, that input in
        normalised coordinates, ``bits`` wider, and ``z_saved`` read back through ``z_of`` from it
        (NOTE [ Batch-norm outputs recomputed from the input ]). The normalised record, or None
        where :meth:`_raise_root` left the record as it was."""
        normalised = Saved(z_saved.data, n, layer=z_saved.layer)
        if not self._raise_root(normalised, n, bits, layer, rec, force=True, hidden=True, at_least=at_least):
            return None
        z_saved.data = Derived(normalised, z_of)
        if z_saved.slot is not None:  # NOTE [ Roots known from the last forward ]
            self._root_hints_next.add(z_saved.slot)
        return normalised

    def _watch_unread(self, t: torch.Tensor) -> None:
        """``t``, a module's output, is a batch norm's: its input's record is normalised if no
        record reads ``t`` (NOTE [ Batch-norm inputs normalised when no record reads the output ])."""
        chain = chain_of(t)
        if chain is None or chain.after is not None or self._config.codec is CodecMode.ERRORBOUND:
            return
        pending = self._regions.pending(chain.source, chain.source_node)
        z_saved = pending.saved() if pending is not None else None
        if pending is None or z_saved is None or pending.source.shape != t.shape:
            return
        data = z_saved.data
        if not (isinstance(data, Packed) and data.codec == "quantize") or \
                any(u.saved() is z_saved for u in self._unread_norms):
            return
        z = pending.source.detach()
        group = int(data.params.get("group_size", 0))
        if group > 0 and z.dim() >= 2 and (z.numel() // max(1, z.shape[0] * z.shape[1])) % group == 0:
            return  # every group lies in one channel: its own step already
        try:
            fns = chain.functions(z, t)
            if fns is None:
                return
            normalise, z_of, _ = fns
            key = (chain.key + "/input", z.dtype, z.device.type)  # the input maps alone, once
            if key not in self._regions.outputs.verified:
                if not verified(lambda v: z_of(normalise(v)), z, z):
                    return
                self._regions.outputs.verified.add(key)
        except Exception as exc:  # see NOTE [ Codec fallback ]: z keeps its record
            if z_saved.layer is not None:
                self._on_fallback(z_saved.layer, exc)
            return
        self._unread_norms.append(UnreadNorm(weakref.ref(z_saved), z, pending.version, weakref.ref(t),
                                             normalise, z_of))

    def _normalise_unread(self, outputs: list[Any] | None) -> None:
        """The watched batch norms whose output is not among ``outputs`` (None: all of them): the
        input's record, where no record was rebuilt from it meanwhile, encoded again in normalised
        coordinates at its own bits (NOTE [ Batch-norm inputs normalised when no record reads ... ])."""
        kept: list[UnreadNorm] = []
        for u in self._unread_norms:
            out = u.output()
            if outputs is not None and out is not None and any(o is out for o in outputs):
                kept.append(u)
                continue
            z_saved = u.saved()
            if z_saved is None or z_saved.layer is None or root_of(z_saved) is not z_saved \
                    or u.z._version != u.version:
                continue
            data = z_saved.data
            if not (isinstance(data, Packed) and data.codec == "quantize"):
                continue
            layer = z_saved.layer
            try:
                self._normalise_root(z_saved, u.normalise(u.z), u.z_of, 0, layer, self.record(layer))
            except Exception as exc:  # see NOTE [ Codec fallback ]: z keeps its record
                self._on_fallback(layer, exc)
        self._unread_norms = kept
        if self._batches.deferred:
            self._settle_deferred()

    def _derive_norm(self, t: torch.Tensor, floor: int, layer: str) -> Saved | None:
        """``t``, a norm's output at the norm's floor, recomputed from the norm's input record
        (NOTE [ Norm outputs recomputed from the input ] in norm_outputs.py); None: ``t`` keeps its own."""
        found = self._norms.find(t)
        if found is None:
            return None
        chain, root, x = found
        data = root.data
        if not (isinstance(data, Packed) and data.codec == "quantize" and int(data.params["bits"]) >= floor):
            return None
        try:
            with self._reading_fields(any_exact=True):
                built = chain.function(getattr, t.shape, t.dtype)
        except (AttributeError, RuntimeError, TypeError, ValueError):  # a field stored lossily, or missing
            return None  # t keeps its own record
        if built is None:
            return None
        fn, name = built
        key = (name, t.dtype, t.device.type)
        if key in self._norms.rejected:
            return None
        if key not in self._norms.verified:
            try:
                ok = verified(fn, x.detach(), t.detach())
            except Exception as exc:  # see NOTE [ Codec fallback ]: t keeps its own record
                self._on_fallback(layer, exc)
                return None
            (self._norms.verified if ok else self._norms.rejected).add(key)
            if not ok:
                return None
        root.readers += 1  # NOTE [ One decode for several readers ]: decoded once for all
        return Saved(Derived(root, fn), t, layer=layer)

    def _raise_unread(self, saved: Saved, source: torch.Tensor) -> None:
        """A value-dependent op's input at twice its bits when no record holds its output.

        NOTE [ Outputs recomputed from the input ]: with no output record to take the bits
        from, the extra bits are the layer's own, counted as its ``mask_bytes`` (priced).
        """
        old = saved.data
        if not isinstance(old, Packed) or old.codec != "quantize" or saved.layer is None:
            return
        raised = min(DERIVED_MAX_BITS, 2 * int(old.params["bits"]))
        if raised <= int(old.params["bits"]):
            return
        seed = self._next_seed()
        try:
            p = self._codec("quantize").encode(source.detach(), bits=raised, seed=seed)
        except Exception as exc:  # see NOTE [ Codec fallback ]: the record stays as it is
            self._on_fallback(saved.layer, exc)
            return
        saved.data = p
        rec = self.record(saved.layer)
        rec.packed_bytes += p.nbytes - old.nbytes
        rec.mask_bytes += p.nbytes - old.nbytes
        rec.raised_values += source.numel()

    def _region_code(self, data: torch.Tensor, part: Partition) -> RegionCode:
        bits = part.packed_plane(data)  # NOTE [ Fused channel passes ]
        if bits is not None:
            return RegionCode(part, (bits_record(bits, tuple(data.shape), data.device),))
        lossless = self._codec("lossless")
        return RegionCode(part, tuple(lossless.encode(plane) for plane in part.planes(data)))

    def _attach_region(self, saved: Saved, part: Partition, source: torch.Tensor, layer: str) -> None:
        """Add the region code of a packed input whose saving op is now known (NOTE [ ReLU masks ])."""
        if any(r.partition == part for r in saved.regions):
            return
        rec = self.record(layer)
        rec.mask_bytes += part.nbytes(source.numel())
        if not isinstance(saved.data, Packed | Derived):
            return  # kept uncompressed: exact already, the bytes only price the choice
        try:
            region = self._region_code(source.detach(), part)
        except Exception as exc:  # see NOTE [ Codec fallback ]: the values stay as quantised
            self._on_fallback(layer, exc)
            return
        saved.regions = (*saved.regions, region)
        rec.packed_bytes += region.nbytes

    def _range_stats(self, t: torch.Tensor, p: Packed, rec: LayerStep, group: int | None = None) -> None:
        """G·Σ_g R_g² and the value range, from the quantiser's group metadata when present
        (``p`` written by the codec of groups of ``group`` values, None: the configured group).

        NOTE [ Range statistics ]
        The quantiser's per-group (min, max) metadata already holds every group's range, so
        for its records this only keeps a reference to that buffer (part of the record, no
        copy); :meth:`_fold_ranges` reduces all of a layer's buffers at the step boundary in
        one concatenation and a few reductions, instead of ~10 small tensor operations per
        saved tensor (a GRU saves ~900 per step). A buffer is held until the step boundary
        even when backward has freed its record: 8 bytes per group, under 1% of the raw
        activation, and the step boundary follows the backward pass. A batched record
        (NOTE [ Batched small records ] in batches.py) keeps its groups of its batch's
        metadata instead, as a run ``[meta, first group, end]`` that the next record of the
        same layer in the batch extends (a record stored again leaves its run, which splits);
        the runs are sliced at the step boundary, after every batch is encoded. An 8-bit
        record's groups are a quarter of its codec's (NOTE [ Eight-bit groups ] in the quantize
        codec): it keeps its metadata as a run ``[meta, 0, groups, 4]`` whose four consecutive
        groups are merged into one (their least min, their largest max) when folded, so that a
        layer's ranges are those of the configured groups at every width. There, a CPU
        layer's metadata is reduced with NumPy into floats (a torch op on a few hundred values
        costs ~5 µs of dispatch, ~20 in the cold first call of a step; the MLP of
        benchmarks/training.py: 194 -> 130 µs a step for this fold, and 175 -> 28 µs for
        reading the statistics back, NOTE [ One read-back per step ] in stats.py).

        A derived record (NOTE [ Outputs recomputed from the input ], NOTE [ Batch-norm
        outputs recomputed from the input ]) has no metadata of its own: its groups' ranges
        take a pass over the tensor (``amin`` and ``amax`` on a CPU, several on a GPU), which on a
        conv net with batch-norm chains was a fifth of memctl's CPU time beyond the codecs
        (26 ms a step of the CNN in benchmarks/training.py at one thread). They are measured
        on the steps that keep ranges (below), two in ten; until 2026-11-29 every step kept
        them, and a derived record was measured every fourth step and its last terms reused
        between.

        NOTE [ Range statistics on the steps that gather statistics ]
        A layer's range sum, minimum and maximum feed its closed form (NOTE [ Sensitivity ]),
        which only the next allocation reads, and ``‖∇Y‖²``, the other half of it, is read only
        on the steps that gather statistics (the first two, and the two around each re-solve:
        NOTE [ Sparse gradient statistics ] in stats.py). So the ranges are kept on those steps
        too (``ranging``, the controller's ``_probing``), and on a layer's first step whatever
        the step (a branch first taken between them still gets a range, not a closed form of 0);
        their EMA decays per step seen, not per reading, as ``‖∇Y‖²``'s does. The other steps
        skip this method, the batched and derived records' own, and the step boundary's fold:
        on the 3-layer MLP of ``benchmarks/training.py`` (``benchmarks/overhead.py --paired mlp
        --steps 400``, three interleaved runs each) the step boundary 0.338 -> 0.258 ms a step,
        memctl's whole cost 1.38 -> 1.29 ms. ``stats()``'s per-layer ``min`` and ``max`` are
        those of the last step that gathered statistics.
        """
        if not rec.ranged:
            return
        meta = p.buffers.get("meta")
        if meta is not None and meta.dtype is torch.float32 and meta.dim() == 2 and meta.size(1) == 2:
            written = p.params.get("group_size")  # (merged: NOTE [ Eight-bit groups ])
            merged = (group or self._config.group_size) // int(written) if written else 1
            self._keep_meta(rec, meta if merged <= 1 else [meta, 0, meta.shape[0], merged])
            return
        if meta is not None and meta.dim() == 2 and meta.shape[1] == 2:
            lo, hi = meta[:, 0].float(), meta[:, 1].float()
        else:
            lo, hi = _group_ranges(t.detach().reshape(-1).float(), self._config.group_size)
        self._keep_meta(rec, _range_meta(lo, hi))

    def _keep_meta(self, rec: LayerStep, meta: torch.Tensor | list[Any]) -> None:
        """Keep ``meta`` (float32 ``(groups, 2)``: each group's min and max) for ``rec``'s range
        statistics, reduced at the step boundary (NOTE [ Range statistics ])."""
        entry = self._metas.get(id(rec))
        if entry is None:
            self._metas[id(rec)] = (rec, [meta])
        else:
            entry[1].append(meta)

    def _batch_range_stats(self, p: BatchRecord, rec: LayerStep) -> None:
        """:meth:`_range_stats` of a batched record: its groups of the batch's metadata, written
        by the batch's encode before the step boundary reads them; consecutive records of a layer
        in one batch make one run of groups (NOTE [ Range statistics ])."""
        if not rec.ranged:
            return
        meta, (g0, g1) = p.batch.meta, p.groups
        entry = self._metas.get(id(rec))
        if entry is None:
            self._metas[id(rec)] = (rec, [[meta, g0, g1, p.batch.merged]])
            return
        last = entry[1][-1]
        if type(last) is list and last[0] is meta and last[2] == g0:
            last[2] = g1
        else:
            entry[1].append([meta, g0, g1, p.batch.merged])

    def _derived_range_stats(self, t: torch.Tensor, rec: LayerStep) -> None:
        """:meth:`_range_stats` of a derived record: a pass over the tensor (NOTE [ Range
        statistics ])."""
        if not rec.ranged:
            return
        flat = t.detach().reshape(-1).float()
        self._keep_meta(rec, _range_meta(*_group_ranges(flat, self._config.group_size)))

    def _fold_ranges(self) -> None:
        """Reduce the group metadata kept by :meth:`_range_stats` (NOTE [ Range statistics ]).

        The layers on the host are reduced together: their runs of groups in one array, each
        layer's sum of squared ranges, minimum and maximum by ``reduceat`` (a few NumPy calls a
        step however many layers and runs; NumPy's reductions cost a µs, torch's ~5). So are a
        device's layers, by :func:`_segment_ranges`: about ten launches a step, where one layer
        at a time took eight a layer."""
        g = self._config.group_size
        host: list[np.ndarray] = []
        starts: list[int] = []
        recs: list[LayerStep] = []
        rows = 0
        views: dict[int, np.ndarray] = {}
        devices: dict[torch.device, tuple[list[torch.Tensor], list[int], list[LayerStep]]] = {}
        for rec, kept in self._metas.values():
            first = kept[0]
            first_meta = first if type(first) is torch.Tensor else first[0]
            if not first_meta.is_cpu:
                metas = [k if type(k) is torch.Tensor else _merged_groups(k[0][k[1]:k[2]], int(k[3]))
                         for k in kept]
                count = sum(m.shape[0] for m in metas)
                if count:
                    on = devices.setdefault(first_meta.device, ([], [], []))
                    on[0].extend(metas)
                    on[1].append(count)
                    on[2].append(rec)
                continue
            begin = rows
            for k in kept:
                if type(k) is torch.Tensor:
                    a = k.numpy()
                else:  # a run of groups (a batch's, an 8-bit record's): one NumPy view of each buffer
                    whole = views.get(id(k[0]))
                    if whole is None:
                        whole = views[id(k[0])] = k[0].numpy()
                    a = whole[k[1]:k[2]]
                    if k[3] > 1:  # an 8-bit record's groups, four to a configured group
                        starts_k = np.arange(0, a.shape[0], int(k[3]))
                        a = np.stack((np.minimum.reduceat(a[:, 0], starts_k),
                                      np.maximum.reduceat(a[:, 1], starts_k)), axis=1)
                host.append(a)
                rows += a.shape[0]
            if rows > begin:
                starts.append(begin)
                recs.append(rec)
        self._metas.clear()
        for metas, counts, on_device in devices.values():
            terms_d, mins_d, maxs_d = _segment_ranges(metas, counts, g)
            for j, rec in enumerate(on_device):  # views of three tensors: one read-back at the boundary
                rec.range_terms.append(terms_d[j])
                rec.mins.append(mins_d[j])
                rec.maxs.append(maxs_d[j])
        if not recs:
            return
        a = np.concatenate(host).astype(np.float64)
        lo_h, hi_h = a[:, 0], a[:, 1]
        span = hi_h - lo_h
        terms = np.add.reduceat(span * span, starts) * g
        mins = np.minimum.reduceat(lo_h, starts)
        maxs = np.maximum.reduceat(hi_h, starts)
        for rec, term, lo, hi in zip(recs, terms.tolist(), mins.tolist(), maxs.tolist(), strict=True):
            rec.range_terms.append(term)
            rec.mins.append(lo)
            rec.maxs.append(hi)

    def _next_seed(self) -> int:
        """The seed of the next record encoded: one stream of them per packer."""
        self._counter += 1
        return (self._seed_base + self._counter * 0x85EBCA6B) & 0xFFFFFFFF

    def _quantizer(self, group: int | None) -> Any:
        """The ``quantize`` codec with groups of ``group`` values (None: the configured group)."""
        return self._codec("quantize", group)

    def _codec(self, name: str, group: int | None = None) -> Codec:
        """Codec ``name``, built once; the grouped codecs in groups of ``group`` values (None:
        the configured group; NOTE [ Norm rows in groups of their own ] in floors.py)."""
        grouped = name in ("quantize", "errorbound")
        size = group if grouped and group is not None else self._config.group_size
        key = name if not grouped or size == self._config.group_size else f"{name}/{size}"
        codec = self._codecs.get(key)
        if codec is None:
            from memctl import codecs

            codec = codecs.get(name, **({"group_size": size} if grouped else {}))
            if self._config.codec_impl is not None:
                codec = _WithImpl(codec, self._config.codec_impl)
            self._codecs[key] = codec
        return codec


def _laid_out_product(product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                      laid_out: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    def rebuilt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return laid_out(product(a, b))

    return rebuilt


def _reshaped_inputs(fn: Callable[..., torch.Tensor],
                     shapes: tuple[tuple[int, ...] | None, ...]) -> Callable[..., torch.Tensor]:
    """``fn`` of its inputs, each first reshaped to its entry of ``shapes`` (None: as it is)."""
    def rebuilt(*inputs: torch.Tensor) -> torch.Tensor:
        return fn(*(x if s is None else x.reshape(s) for x, s in zip(inputs, shapes, strict=True)))

    return rebuilt


def _leaf_through_copies(node: Any) -> bool | None:
    """None unless ``node`` is a leaf's gradient accumulator, or reaches one through at most three
    views, copies and casts (``floors.CASTS``); else whether a copy or cast was among them."""
    copied = False
    for _ in range(4):
        if node is None:
            return None
        name = type(node).__name__
        if name == "AccumulateGrad":
            return copied
        if name not in CASTS:
            return None
        copied = copied or name in _COPIES
        edges = node.next_functions
        node = edges[0][0] if len(edges) == 1 else None
    return None


_COPIES = frozenset({"ToCopyBackward0", "CloneBackward0"})


def _from_parameter(node: Any) -> bool:
    """Whether a matmul's input edge is a leaf (a parameter), directly or through views and casts."""
    return _leaf_through_copies(node) is not None


def _copy_of_parameter(node: Any) -> bool:
    """Whether ``node``'s output is a copy (a cast, a clone) of a leaf that needs a gradient, or a
    view of one (NOTE [ Copies of parameters ]). A view of the leaf alone is not: it is
    compressed as before."""
    return _leaf_through_copies(node) is True


_COMPILED_WARNING = (
    "memctl: part of the model runs as a graph compiled by torch.compile, whose ops memctl cannot "
    "see (a ReLU's mask, an attention, a norm): the tensors a compiled graph saves are kept as they "
    "are, not compressed (at 2 bits a compiled ResNet-18 stopped learning). Leave the model, or the "
    "parts whose activations should shrink, uncompiled: those are compressed as usual."
)


def _from_compiled_graph() -> bool:
    """Whether the tensor being packed is saved by a graph ``torch.compile`` made: AOTAutograd runs
    it as the autograd function ``CompiledFunction``, whose ``apply`` saves its tensors (NOTE [ Graphs
    compiled by torch.compile ])."""
    try:
        frame: types.FrameType | None = sys._getframe(2)
    except ValueError:  # called from the top of a stack (nothing compiled saves that way)
        return False
    for _ in range(4):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "apply" and code.co_filename.endswith(_FUNCTION_FILE):
            cls = frame.f_locals.get("cls")
            return cls is not None and "_aot_autograd" in getattr(cls, "__module__", "")
        frame = frame.f_back
    return False


_FUNCTION_FILE = os.path.join("autograd", "function.py")


def _aliased(handle: Any) -> Any:
    """The record a handle stands for: an alias's record, anything else itself."""
    return handle.alias_of if isinstance(handle, Alias) else handle


def _exact_operand(handle: Any) -> torch.Tensor | None:
    """The tensor a record (or an alias of one) was packed from, alive and unmodified, in the
    handle's shape; else None."""
    rec = _aliased(handle)
    source = rec.source() if rec.source is not None else None
    if source is None or source._version != rec.version:
        return None
    return source.detach().reshape(handle.shape) if isinstance(handle, Alias) else source.detach()


def _nbytes(p: Packed) -> int:
    """``p.nbytes`` (each buffer's ``element_size() * numel()``), without a generator."""
    n = 0
    for b in p.buffers.values():
        n += b.nbytes
    return n


def _range_meta(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Groups' ``lo`` and ``hi`` as a quantize record's metadata, float32 ``(groups, 2)``, for
    :meth:`Packer._keep_meta` (NOTE [ Range statistics ])."""
    return torch.stack((lo.float(), hi.float()), 1)


def _segment_ranges(metas: list[torch.Tensor], counts: list[int],
                    group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(G·Σ_g R_g², min, max)`` of each run of ``counts[i]`` consecutive groups of ``metas``
    (float32 ``(groups, 2)`` tensors on one device) concatenated, in float64, each a tensor of
    ``len(counts)`` values: one pass for every layer of a step (NOTE [ Range statistics ]).
    The counts travel to a GPU from pinned memory, behind the queued work (no wait)."""
    m = metas[0] if len(metas) == 1 else torch.cat(metas)
    a = m.double()
    lo, hi = a[:, 0], a[:, 1]
    span = hi - lo
    if len(counts) == 1:
        return (span.dot(span) * group).reshape(1), lo.min().reshape(1), hi.max().reshape(1)
    lengths = torch.tensor(counts, dtype=torch.int64, pin_memory=m.is_cuda).to(m.device, non_blocking=True)
    # unsafe: the counts are right by construction, and the check reads them back (two waits)
    terms = torch.segment_reduce(span * span, "sum", lengths=lengths, unsafe=True) * group
    mins = torch.segment_reduce(lo, "min", lengths=lengths, unsafe=True)
    return terms, mins, torch.segment_reduce(hi, "max", lengths=lengths, unsafe=True)


def _merged_groups(meta: torch.Tensor, k: int) -> torch.Tensor:
    """``meta`` (float32 ``(groups, 2)``) with each ``k`` consecutive groups merged into one: their
    least min and largest max (NOTE [ Range statistics ])."""
    if k <= 1:
        return meta
    pad = (-meta.shape[0]) % k
    lo, hi = meta[:, 0], meta[:, 1]
    if pad:
        lo = torch.cat((lo, lo.new_full((pad,), math.inf)))
        hi = torch.cat((hi, hi.new_full((pad,), -math.inf)))
    return torch.stack((lo.view(-1, k).amin(dim=1), hi.view(-1, k).amax(dim=1)), dim=1)


def _group_ranges(flat: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's (min, max) over its finite values of a flat float32 tensor, (0, 0) for a
    group with none (NOTE [ Range statistics ]).

    On a CPU one ``amin`` and one ``amax`` pass over the groups come first: they are the answer
    unless some group holds a non-finite value (its min or max is then non-finite, and so is
    the sum of the differences, which is read back; an overflow of that sum only takes the
    path below), which is rare. On a GPU, where that read would wait for the device, and for
    those rare tensors, each non-finite value is replaced by the neutral value of each
    reduction first (two passes more; ``isfinite`` is four ops and ``where`` one more).
    """
    numel = flat.numel()
    if flat.is_cpu and numel and numel % g == 0:
        groups = flat.view(-1, g)
        # two reductions: aminmax(dim=1) took 5.3 ms on 2.4M values at one thread, amin and amax 0.3
        lo, hi = groups.amin(dim=1), groups.amax(dim=1)
        if math.isfinite(float((lo - hi).sum())):
            return lo, hi
    inf = math.inf
    lo_src = flat.nan_to_num(nan=inf, posinf=inf, neginf=inf)
    hi_src = flat.nan_to_num(nan=-inf, posinf=-inf, neginf=-inf)
    pad = (-numel) % g
    if pad:
        lo_src = torch.nn.functional.pad(lo_src, (0, pad), value=inf)
        hi_src = torch.nn.functional.pad(hi_src, (0, pad), value=-inf)
    lo = lo_src.view(-1, g).amin(dim=1)
    hi = hi_src.view(-1, g).amax(dim=1)
    ok = lo <= hi  # a group without a finite value: inf against -inf
    return torch.where(ok, lo, 0.0), torch.where(ok, hi, 0.0)


def _uncontrol(rec: LayerStep, numel: int, bits: int) -> None:
    """Take a record of ``numel`` values at ``bits`` out of its layer's controlled values."""
    if numel in rec.numels:
        rec.numels.remove(numel)
        rec.bit_values = max(0.0, rec.bit_values - bits * numel)


def _alive(ref: weakref.ref[Saved]) -> bool:
    """Whether a de-duplication entry may still be reused (NOTE [ De-duplication ])."""
    saved = ref()
    return saved is not None and saved.source is not None and saved.source() is not None


def _unclamped_code(saved: Saved, data: object) -> RegionCode | None:
    """The ReLU code of a record whose values are read unclamped (NOTE [ Unbiased reads of a
    ReLU result ]): a batch-norm chain's ReLU result, rebuilt from the chain's root, else None."""
    if not saved.regions or not isinstance(data, Derived) or getattr(data.fn, "linear", None) is None:
        return None
    return _relu_code(saved)


def _relu_code(saved: Saved) -> RegionCode | None:
    """The record's ReLU code, which the quantize codec applies in its decode (NOTE [ Masked decode ])."""
    for region in saved.regions:
        if region.partition == RELU:
            return region
    return None


class _WithImpl:
    """A codec whose ``encode``/``decode`` run the configured implementation (``codec_impl``)."""

    def __init__(self, codec: Codec, impl: str) -> None:
        self._inner = codec
        self._impl = impl
        self.name = codec.name
        self.decodes_mask = decodes_mask(codec)

    def encode(self, t: torch.Tensor, *, bits: int | None = None, error_bound: float | None = None,
               seed: int = 0, impl: Impl | str | None = None) -> Packed:
        return self._inner.encode(t, bits=bits, error_bound=error_bound, seed=seed, impl=impl or self._impl)

    def decode(self, p: Packed, *, impl: Impl | str | None = None, **options: Any) -> torch.Tensor:
        # options: what the codec's own decode takes besides impl (quantize's mask=).
        return self._inner.decode(p, impl=impl or self._impl, **options)

    def two_valued(self, t: torch.Tensor) -> Packed | None:
        find = getattr(self._inner, "two_valued", None)
        return None if find is None else cast(Packed | None, find(t, impl=self._impl))
