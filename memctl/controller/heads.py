"""The layer that makes a model's logits, found from the model's outputs.

NOTE [ The head's input ]
A classifier's or language model's last layer (its head: the linear layer or convolution
whose output is the logits the loss reads) saves its input for its weight gradient like any
other layer, but that gradient is the one the loss sets most directly: ``dW = (p - y)ᵀ x``,
with nothing between the loss and the weight to average the input's rounding away. Measured
on the demo's digits (``benchmarks/convergence.py --tasks digits --schedule cosine``, 300
steps, Adam, ten seeds, against the mean of three plain runs a seed), at ``bits=2``, where
every layer takes 2 bits: +3.59% ± 0.55 validation loss. Plain training whose first 50 steps
took memctl's gradient error on one group of parameters only (the error of a ``bits=2``
shadow at the same weights, batch and dropout draw): the head's weight and bias +3.23% ±
0.43, every convolution's weight +0.59% ± 1.02, the batch norms' parameters -0.22% ± 0.44,
everything +3.14% ± 0.73. The calibration does not see it: the head's share of the
gradient's squared norm is small (the added variance at ``bits=2`` was 13% of the minibatch
gradient's own at step 0 and 3% at step 50), and the harm is in where Adam's steps go
(NOTE [ Update metric ]).

So the input records of the model's head are stored at ``head_bits`` (default 4), outside
the allocation's control, as the floors of NOTE [ Bit floors ] are. The weight gradient reads
that input linearly, as an attention's backward reads its value (``attention_value_bits``, 4):
with the floor at 4 bits digits' ``bits=2`` ends +0.44% ± 0.80 and the default policy +0.06% ±
0.52 (+1.56% ± 0.66 before); at 8 bits +0.16% ± 0.76 and -0.57% ± 0.58, at twice the bytes and
a quarter of the group (NOTE [ Eight-bit groups ]). A CNN's head reads the pooled features
(batch x channels: a few KB), so the floor costs nothing there; a language model's head reads
every token's hidden state, one record of the many a block saves (behind a final LayerNorm it
is already at ``norm_bits``; on the LSTM of ``benchmarks/convergence.py --tasks text-lstm``
the ratio stayed 9.8x at ``bits=2``, where 8 bits took it to 6.6x).

The head is found when the model's forward ends, from each output tensor's ``grad_fn``:
the logits themselves (through views, casts and the bias a linear layer adds to a 3-D
product), or a loss the model computed (Hugging Face models given labels) through the loss's
own nodes (``nll_loss``, ``log_softmax``, the reductions, a scaling, label smoothing's sum), a
chain that must pass a log-softmax or a loss node, so that a backbone returning its residual
stream floors nothing. The head is the first node of a matrix product or convolution
(:data:`HEADS`) there; its inputs that are compressed records are stored again at the floor
while their source tensor is alive, and the same place packs at the floor from the next
forward on (NOTE [ Floors known from the last forward ]; a ReLU result with its region code).
A record derived from others (NOTE [ Outputs recomputed from the input ]) or already at a
floor keeps what it has. ``codec="errorbound"`` keeps its bounds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from memctl.controller.floors import CASTS

__all__ = ["HEAD", "HEADS", "head_nodes"]

HEAD = "head"
"""The floor's kind (:class:`~memctl.controller.floors.Raise`)."""

HEADS = frozenset({"AddmmBackward0", "MmBackward0", "BmmBackward0", "ConvolutionBackward0",
                   "LinearBackward0"})
"""Nodes of the ops a head is: the weight's gradient reads the saved input."""

_CASTS = CASTS | {"SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "UnsqueezeBackward0",
                  "ContiguousBackward0"}
"""Nodes that only re-index, copy or cast: logits returned through them are still logits."""

_ANCHORS = frozenset({"LogSoftmaxBackward0", "NllLossBackward0", "NllLoss2DBackward0",
                      "BinaryCrossEntropyWithLogitsBackward0", "MseLossBackward0", "SmoothL1LossBackward0",
                      "HuberLossBackward0", "L1LossBackward0", "SoftMarginLossBackward0",
                      "MultiMarginLossBackward0", "MultilabelMarginLossBackward0"})
"""A loss, or the log-softmax of one: what a chain from a model's output must pass to reach a head
other than through views alone."""

_THROUGH = _CASTS | _ANCHORS | {"MeanBackward0", "MeanBackward1", "SumBackward0", "SumBackward1",
                                "DivBackward0", "DivBackward1", "MulBackward0", "MulBackward1",
                                "AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1",
                                "NegBackward0"}
"""Nodes a chain from an output to the head passes through (first input first)."""

_CHAIN = 16
"""Most nodes one chain visits."""


def _tensors(outputs: Any) -> Iterator[torch.Tensor]:
    """The tensors at the top level of a model's outputs: not those nested further, as
    ``replay.flatten_tensors`` finds them (a cache's keys and values are views of projections,
    not logits)."""
    if isinstance(outputs, torch.Tensor):
        yield outputs
    elif isinstance(outputs, dict):  # Hugging Face's ModelOutput is a dict
        for v in outputs.values():
            if isinstance(v, torch.Tensor):
                yield v
    elif isinstance(outputs, tuple | list):
        for v in outputs:
            if isinstance(v, torch.Tensor):
                yield v


def _is_bias(name: str, edges: Any) -> bool:
    """Whether a node is a head's bias added to its product (a linear layer on a 3-D input
    adds it after the matrix product): an addition of a parameter."""
    return name == "AddBackward0" and len(edges) == 2 and edges[1][0] is not None \
        and type(edges[1][0]).__name__ == "AccumulateGrad"


def head_nodes(outputs: Any) -> list[Any]:
    """The autograd nodes of the heads the model's ``outputs`` come from (NOTE [ The head's input ])."""
    found: dict[int, Any] = {}
    for t in _tensors(outputs):
        node = t.grad_fn
        if node is None or not t.is_floating_point():
            continue
        head = _chain(node)
        if head is not None:
            found.setdefault(id(head), head)
    return list(found.values())


def _chain(node: Any) -> Any:
    """The head at the end of the chain from an output's ``node``, or None (see the NOTE)."""
    anchored = False
    casts_only = True
    for _ in range(_CHAIN):
        if node is None:
            return None
        name = type(node).__name__
        if name in HEADS:
            return node if anchored or casts_only else None
        if name not in _THROUGH:
            return None
        edges = node.next_functions
        anchored = anchored or name in _ANCHORS
        casts_only = casts_only and (name in _CASTS or _is_bias(name, edges))
        node = edges[0][0] if edges else None
    return None
