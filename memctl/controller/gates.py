"""Residual branches closed by a normalisation scale near zero: their neighbours kept wider.

NOTE [ Gates near zero ]
Many residual networks start each block closed: the last normalisation of the branch has
its scale initialised to zero (timm's ResNets and RegNets by default, ``zero_init_last``;
torchvision's ``zero_init_residual=True``), so a block begins as its shortcut and opens as
that scale grows. On timm's RegNetY-200MF (benchmarks/fidelity.py, 20 steps) ``bits=2``
kept 84.4% of plain PyTorch's loss drop, and 98.9% when the same model was built without the
zero scales. Measured there (the exact gradient at the compressed run's weights, AdamW's
update from both): at step 0 23% of the zero scales' coordinates moved the wrong way, still
10-15% up to step 5, and by step 19 the scales had grown to 86% of plain's. With the exact
gradient given to the blocks' last conv and norm and to the shortcut (51 of 186 parameter
tensors) the run kept 96.4%; given to every tensor for the first five steps only, 90.7%.
The whole gradient's added variance was 14% of the minibatch's own, so neither the variance
model nor the convergence guard sees it: what these few parameters add is nothing against
the whole gradient, while AdamW moves each of their coordinates by its own normalised,
noisy gradient at the steps that decide whether a block opens.

So while a block is closed its neighbourhood keeps at least ``gate_bits`` (4) bits. A
*gate* is an affine normalisation module (batch, group or layer norm) whose scale's root
mean square is under a hundredth of the upper quartile over the model's normalisation
modules (not the median: where the closed branches outnumber the other norms, the median
is zero); its neighbours, found from one training forward's autograd graph (each module's
input and output nodes, the input read before an in-place op rewrites it):

- the gate's own layer (its saved input, from which its scale's gradient is computed);
- the module that reads the residual sum the gate's output goes into (the join: the
  block's last activation, whose record is the next block's input);
- the module that made the sum's other operand (the shortcut's last module with
  parameters, or the previous block's join).

Each is a floor of the allocation beside the calibration's (``evidence_floors`` of
:func:`memctl.controller.policy.allocate`): under ``bits=`` the floored layers come on top
of the average (the other layers cannot go below 2 bits before 1 bit is measured), under a
budget they are dropped when the budget cannot hold them. A gate is released once its scale
reaches a hundredth of that quartile: the floors go at the next allocation. Measured on
RegNetY (``bits=2``, layers kept by name in an ad-hoc script) before this was built: the
three together held for all 20 steps (a tenth of the quartile) 96.4% at 9.85x (84.4% at
11.18x without), released at step 12 (a hundredth) 93.6%; the gate alone 88.4%, gate and
shortcut 93.3%; raising every layer to the same memory instead (``bits=2.3``) 90.1%. A
tenth held timm's ResNet-18 (its ``zero_init_last``) at 9.55x for 200 steps and more; a
hundredth lets its gates go by step 20 (11.95x from there). With a hundredth, as built
(benchmarks/README.md): RegNetY ``bits=2`` 92.3% (84.2% without), the default policy 97.8%
(92.7%). Models without such a norm (ResNet-18 as torchvision builds it, ConvNeXt,
MobileNetV3) run the same to the bit. A scale kept as a bare parameter (ConvNeXt's and
CaiT's layer scale of 1e-6) is no normalisation module and is not seen here.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch
from torch import nn

from memctl.controller.copysafe import ControllerHook
from memctl.controller.floors import VIEWS
from memctl.controller.hooks import hookable_modules

__all__ = ["GATE_RATIO", "GateFloors"]

GATE_RATIO = 0.01
"""A normalisation's scale is a gate while its RMS is under this share of the upper quartile of
the model's normalisation scales."""

_NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
_LEAST_NORMS = 4
"""Fewer normalisation modules than this give no quartile to judge a scale against."""
_MOST_CALLS = 64
"""Calls of one module noted while watching (micro-batches before the first step add more)."""


class GateFloors:
    """Finds the gates of a model and the layers around them (NOTE [ Gates near zero ])."""

    def __init__(self, model: nn.Module, bits: float) -> None:
        self.bits = bits
        # plain tensors only: a sharded scale (FSDP2's DTensor) is no one rank's to read
        self._norms = {name: m for name, m in model.named_modules()
                       if isinstance(m, _NORMS) and isinstance(getattr(m, "weight", None), torch.Tensor)
                       and type(m.weight.detach()) is torch.Tensor and m.weight.device.type != "meta"}
        self._model = model
        self._neighbours: dict[str, tuple[str, ...]] | None = None
        """By gate candidate: the layers kept with it (None until a forward was watched)."""
        self._handles: list[Any] = []
        self._inputs: dict[str, list[Any]] = {}
        self._outputs: dict[str, Any] = {}
        self.gates: frozenset[str] = frozenset()
        """The normalisation modules that were gates at the last :meth:`refresh`."""

    @property
    def possible(self) -> bool:
        """Whether the model has enough normalisation modules for a gate to be told."""
        return len(self._norms) >= _LEAST_NORMS

    def refresh(self) -> None:
        """Read the scales again (one read-back for all) and decide which are gates."""
        if not self.possible:
            self.gates = frozenset()
            return
        weights = [m.weight.detach() for m in self._norms.values()]
        rms = [math.sqrt(v) for v in _mean_squares(weights)]
        # the upper quartile, not the median: a model whose branches outnumber its other
        # norms has zero scales in the majority
        typical = statistics.quantiles(rms, n=4, method="inclusive")[2]
        if not (typical > 0 and math.isfinite(typical)):
            self.gates = frozenset()
            return
        self.gates = frozenset(name for name, r in zip(self._norms, rms, strict=True)
                               if r < GATE_RATIO * typical)

    def floors(self) -> dict[str, float]:
        """``{layer: bits}`` for every gate and its neighbours (the gates alone before a forward
        was watched)."""
        out: dict[str, float] = {}
        for gate in self.gates:
            for layer in (self._neighbours or {}).get(gate, (gate,)):
                out[layer] = self.bits
        return out

    # -- the structure, from one forward ------------------------------------------------
    @property
    def watching(self) -> bool:
        return bool(self._handles)

    def watch(self) -> None:
        """Note every module's input and output node in the next forward (one forward)."""
        if self._neighbours is not None or self._handles or not self.gates:
            return
        for name, module in hookable_modules(self._model):  # NOTE [ TorchScript submodules ]
            if not name:
                continue
            # NOTE [ Copies of an attached model ]: a copy of the model does not inherit them
            self._handles.append(module.register_forward_pre_hook(ControllerHook(self._pre(name))))
            self._handles.append(module.register_forward_hook(ControllerHook(self._post(name))))

    def close(self) -> None:
        """Stop watching, keeping nothing of it."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._inputs, self._outputs = {}, {}

    def _pre(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            node = _node(args[0]) if args else None
            if node is not None:  # before an in-place op makes the input its own output
                calls = self._inputs.setdefault(name, [])  # a module may run more than once
                if len(calls) < _MOST_CALLS:
                    calls.append(node)
        return hook

    def _post(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            node = _node(output)
            if node is not None:
                self._outputs[name] = node
        return hook

    def finish(self) -> None:
        """Stop watching; the neighbours of every candidate gate from what the forward showed
        (nothing, if it showed nothing: then watch the next one)."""
        inputs, outputs = self._inputs, self._outputs
        self.close()
        if not outputs:
            return
        modules = dict(self._model.named_modules())
        # a node to the module that made it: the innermost one with parameters of its own
        made_by: dict[Any, str] = {}
        for name, node in outputs.items():
            own = next(modules[name].parameters(recurse=False), None) is not None
            if own or node not in made_by:
                made_by[node] = name
        # the sums the modules read (their operands, and each operand below its views), and
        # which modules read each node: found once for every candidate
        sums: list[tuple[str, list[Any], list[Any]]] = []
        readers: dict[Any, list[str]] = {}
        for consumer, nodes in inputs.items():
            for node in nodes:
                readers.setdefault(node, []).append(consumer)
                if type(node).__name__.startswith("AddBackward"):
                    operands = [n for n, _ in node.next_functions if n is not None]
                    sums.append((consumer, operands, [_through_views(n) for n in operands]))
        neighbours: dict[str, tuple[str, ...]] = {}
        for gate in self._norms:
            out = outputs.get(gate)
            if out is None:
                continue
            # its output, and the outputs of modules that only passed it on (its activation, a
            # drop path)
            passed = {out} | {outputs[m] for m in readers.get(out, ()) if m in outputs}
            layers = [gate]
            for consumer, operands, below in sums:
                mine = [b in passed for b in below]
                if not any(mine):
                    continue
                layers.append(consumer)
                layers += [made_by[n] for n, m in zip(operands, mine, strict=True) if not m and n in made_by]
            neighbours[gate] = tuple(dict.fromkeys(layers))
        self._neighbours = neighbours


def _through_views(node: Any) -> Any:
    """The node below the views that ``node`` is (LeViT's norm output reshaped back), or ``node``."""
    for _ in range(4):
        if type(node).__name__ not in VIEWS or not node.next_functions or node.next_functions[0][0] is None:
            break
        node = node.next_functions[0][0]
    return node


def _node(value: Any) -> Any:
    return value.grad_fn if isinstance(value, torch.Tensor) else None


def _mean_squares(weights: list[torch.Tensor]) -> list[float]:
    """Each tensor's mean square, read back at once per device."""
    out = [0.0] * len(weights)
    by_device: dict[torch.device, list[int]] = {}
    for i, w in enumerate(weights):
        by_device.setdefault(w.device, []).append(i)
    for index in by_device.values():
        group = [weights[i].float() for i in index]
        norms = torch.stack(torch._foreach_norm(group)).double().square()
        sizes = torch.tensor([max(g.numel(), 1) for g in group], dtype=torch.float64, device=norms.device)
        for i, v in zip(index, (norms / sizes).tolist(), strict=True):
            out[i] = v
    return out
