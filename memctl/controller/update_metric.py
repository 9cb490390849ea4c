"""Gradient noise measured as the optimizer sees it: the update metric.

NOTE [ Update metric ]
AC-GC's bound (NOTE [ Default policy ]) compares the variance compression adds to the
gradient with the minibatch gradient's own variance, both as squared norms of the gradient.
That is the noise SGD's update carries: its step is the gradient times one rate. An
adaptive optimizer divides by its own running scale: Adam's step is ``m̂ / (√v̂ + ε)``, so
noise on a parameter whose gradients are small (v̂ small) moves the weights as much as
noise ten times its size on a parameter whose gradients are large.

Measured on the demo's digits (``benchmarks/convergence.py --tasks digits --schedule cosine``,
300 steps, five seeds, CPU), the default policy against plain PyTorch's validation loss:
with Adam (the demo's optimizer) +3.93%, every seed above plain; the same model, data and
policy with SGD and momentum (lr 0.05, 0.9) -1.79%, every seed below plain (plain with
isotropic gradient noise of 2e-3 a step: +1.23%). At the end of an Adam run the allocation
in use added 1.8-2.7% of the minibatch gradient's variance in the gradient's metric and
6.4-7.7% in Adam's, from step 30 on.

With ``variance_metric="update"`` every squared norm the calibration takes (NOTE
[ Calibration ]: a replay's distance from the exact gradient, the exact ‖g‖², the two half
batches' tr Var(g), the training gradient's ‖ĝ‖² between probes) is taken of the update's
gradient-shaped part, each parameter's gradient times its gain ``1 / (√mean v̂ + ε)``, when
the optimizer keeps a second moment: ``exp_avg_sq`` (``max_exp_avg_sq`` with AMSGrad;
bias-corrected by ``1 - β₂^step``: Adam, AdamW, NAdam, RAdam), ``square_avg`` (RMSprop; less
``grad_avg²`` when centred), ``sum`` (Adagrad), ``exp_inf`` (Adamax, a magnitude: no root).
One gain per parameter tensor, not per coordinate: in the first steps v̂ holds one or two
squared gradients, and a coordinate whose gradient happened to be near zero weighs thousands
of times its neighbours; a replay's gradient, at the weights one step on, then measured 200x
the training gradient's ‖ĝ‖² in that metric (the test CNN of ``tests/controller/
test_variance.py``, first probe), and the calibration's unit stood on it. Per tensor the two
agree within 10%, and at the end of the digits run above the per-tensor share is 0.067
where the per-coordinate one is 0.073: the amplification is between parameters (a batch
norm's scale against a convolution's weight). It costs one number a parameter (one sum over
its second moment, at the steps that read ‖ĝ‖²: 1.6 ms against 0.5 ms a read for the
transformer of ``benchmarks/training.py`` at one thread), no copy of the optimizer state.
No tensor's scale ``√mean v̂`` counts as less than ``SCALE_FLOOR`` (1e-3) of the largest
tensor's. A parameter whose gradients have not started to flow (a residual branch behind a
zero-initialised scale, as timm's RegNetY starts the last batch norm of each block; a
layer scale at 1e-6, as ConvNeXt's) has v̂ near 0 and a gain near 1/ε: without the floor one such
tensor outweighed the rest of the model, and the calibration's unit (an average of ‖ĝ‖² over
the steps) followed it as its v̂ grew by orders of magnitude step to step (RegNetY over 20
steps of ``fidelity.py --configs varcheck``: unit 1.4e12 against the audit's exact ‖g‖² of
6.5e6; none of the 48 predictions within 2x). The linearisation is also wrong there: noise
on a parameter whose v̂ is near 0 is most of its v̂, so Adam's step on it is at most the
learning rate, not the noise over ε. With the floor RegNetY's unit is 4.6e5 against 3.6e5
and 26 of 48 predictions fall within 2x; a cap relative to the median gain did not do it
(in RegNetY most parameters sit behind such scales, so the median gain is itself ~1/ε).
The bound keeps its meaning (0.05: the update noise a batch 5% smaller adds); the guard's
and the allocation's figures are all in the one metric, and ``stats()["calibration"]
["metric"]`` names it. A parameter the optimizer does not hold weighs nothing (no step
moves it); one it holds without state yet weighs the mean gain of those with state. SGD
(whose step is linear in the gradient) keeps the gradient's metric either way. A calibration
state measured in the other metric (saved before, or with another optimizer) is dropped at
the next probe, with a ``calibration_metric`` event: its ratios do not compare.

It is not the default, because it moves the short runs the wrong way. Measured (CPU,
``benchmarks/README.md``): on the text model of ``convergence.py`` (AdamW, 300 steps) the
variance model's level holds in it (the audit's 24 pairs within 2x: default 18 -> 24,
``bits=2`` 14 -> 23 at seed 0; the unit 6.1e5 against the audit's exact 7.4e5) and validation
loss is as close to plain's or closer (+0.90% -> +0.31%, +0.47% -> +0.34%) at a lower ratio
(11.0x -> 9.4x outside memctl); on digits (ten seeds, against the mean of three plain runs
a seed) the default policy goes +1.56% ± 0.66 -> +0.97% ± 0.51 at 11.8-12.1x (12.1x; ``bits=2``
stays +3.59%: uniform 2 bits either way). But over the first 20 steps of ``fidelity.py``,
where v̂ is a few steps old, the default policy lets EfficientNet-B0 fall to 89.1% of plain's
loss drop at 13.7x (99.0% at 13.0x in the gradient's metric; issue 14's floor is 90%) and
LeViT to 7.3x (8.2x; the floor for transformers is 8x), with the scale floor above (without
it MobileNetV3 stood at 6.3-8.2x, against 10.2x with it and 10.3x in the gradient's metric).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["UpdateMetric"]

SCALE_FLOOR = 1e-3
"""No parameter tensor's scale ``√mean v̂`` counts as less than this share of the largest
one's (NOTE [ Update metric ]: a parameter whose gradients have not started to flow)."""

_SECOND_MOMENTS = ("max_exp_avg_sq", "exp_avg_sq", "square_avg", "sum", "exp_inf")
"""State keys of a per-coordinate scale, in the order looked for (AMSGrad's maximum first)."""


@dataclass
class _Moment:
    """What one parameter's gain is computed from."""

    moment: torch.Tensor
    centre: torch.Tensor | None  # RMSprop's ``grad_avg`` when centred (its square comes off)
    correction: float | torch.Tensor  # Adam's ``1 - β₂^step`` (1: none)
    eps: float
    root: bool  # False: Adamax's ``exp_inf``, a magnitude


class UpdateMetric:
    """Per parameter, the gain ``1 / (√mean v̂ + ε)`` of an optimizer's update (NOTE [ Update metric ])."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, enabled: bool = True) -> None:
        self._optimizer = optimizer if enabled else None

    @property
    def enabled(self) -> bool:
        """Whether an optimizer was given and the update metric asked for."""
        return self._optimizer is not None

    @property
    def name(self) -> str:
        """``"update"`` when the optimizer's state gives the gains now, else ``"gradient"``."""
        return "update" if self._moments() else "gradient"

    def _moments(self) -> dict[int, _Moment]:
        """Per parameter (by id) the optimizer keeps a second moment of: what its gain needs."""
        opt = self._optimizer
        if opt is None:
            return {}
        found = {}
        for group in opt.param_groups:
            for p in group["params"]:
                moment = _moment(opt.state.get(p), group)
                if moment is not None:
                    found[id(p)] = moment
        return found

    def gains(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor | float] | None:
        """Each parameter's gain (a 0-d tensor, or a number), or None for the gradient's metric
        (no optimizer state gives them). A parameter the optimizer does not hold gains 0; one it
        holds without state yet, the mean gain of those with state, weighted by their sizes."""
        moments = self._moments()
        if not moments:
            return None
        opt = self._optimizer
        held = {id(p) for group in opt.param_groups for p in group["params"]} if opt is not None else set()
        # of every parameter with state, the ones asked for or not: the floor is relative to all
        by_id = dict(zip(moments, _gains(list(moments.values())), strict=True))
        out: list[torch.Tensor | float] = [0.0] * len(params)
        stated = [i for i, p in enumerate(params) if id(p) in moments]
        for i in stated:
            out[i] = by_id[id(params[i])]
        missing = [i for i, p in enumerate(params) if id(p) in held and id(p) not in moments]
        if missing and stated:
            device = params[stated[0]].device
            sizes = [params[i].numel() for i in stated]
            mean = sum(torch.as_tensor(out[i]).to(device) * n
                       for i, n in zip(stated, sizes, strict=True)) / sum(sizes)
            for i in missing:
                out[i] = mean
        return out

    def grad_sq(self, grads: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Σ gain² ‖g‖² of the (parameter, gradient) pairs as float32 scalars to sum, one per
        device and dtype (one ``_foreach_norm`` each); in the gradient's metric (no gains) Σ ‖g‖²."""
        gains = self.gains([p for p, _ in grads])
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor | float]]]
        groups = {}
        for i, (_, g) in enumerate(grads):
            gain = 1.0 if gains is None else gains[i]
            if not (isinstance(gain, float) and gain == 0.0):  # a parameter no step moves
                group = groups.setdefault((g.device, g.dtype), ([], []))
                group[0].append(g)
                group[1].append(gain)
        out = []
        for gs, gain_list in groups.values():
            norms = torch.stack(torch._foreach_norm(gs)).float()
            if gains is not None:
                norms = norms * _stacked(gain_list, norms.device)
            out.append(norms.square().sum())
        return out

def _moment(state: dict[str, object] | None, group: dict[str, object]) -> _Moment | None:
    """One parameter's :class:`_Moment`, or None when the optimizer keeps no second moment of it."""
    if not state:
        return None
    key = next((k for k in _SECOND_MOMENTS if isinstance(state.get(k), torch.Tensor)), None)
    if key is None:
        return None
    centre = state.get("grad_avg") if key == "square_avg" else None
    correction: float | torch.Tensor = 1.0
    betas, step = group.get("betas"), state.get("step")
    if key in ("exp_avg_sq", "max_exp_avg_sq") and isinstance(betas, tuple | list) and step is not None:
        if isinstance(step, torch.Tensor) and step.is_cpu:
            step = step.item()  # no wait for a device: the count lives on the host
        correction = 1 - float(betas[1]) ** (step if isinstance(step, torch.Tensor) else float(step))  # type: ignore[arg-type]
    moment = state[key]
    assert isinstance(moment, torch.Tensor)
    return _Moment(moment, centre if isinstance(centre, torch.Tensor) else None, correction,
                   float(group.get("eps", 1e-8)), key != "exp_inf")  # type: ignore[arg-type]


def _gains(moments: list[_Moment]) -> list[torch.Tensor]:
    """``1 / (√mean v̂ + ε)`` (Adamax: ``1 / (mean u + ε)``) of each, as 0-d tensors: a few
    operations per device and dtype, however many parameters (NOTE [ Update metric ])."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, m in enumerate(moments):
        groups.setdefault((m.moment.device, m.moment.dtype), []).append(i)
    scales: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []  # (indices, scale, eps) per group
    with torch.no_grad():
        for (device, _), idx in groups.items():
            ms = [moments[i] for i in idx]
            mean = torch.stack([m.moment.sum(dtype=torch.float32) for m in ms])  # (L1 by foreach: 6x slower)
            mean = mean / torch.tensor([m.moment.numel() for m in ms], dtype=torch.float32, device=device)
            centred = [j for j, m in enumerate(ms) if m.centre is not None]
            if centred:
                centres = [ms[j].centre for j in centred]
                sq = torch.stack(torch._foreach_norm(centres)).float().square()  # type: ignore[arg-type]
                sizes = torch.tensor([ms[j].moment.numel() for j in centred], dtype=torch.float32,
                                     device=device)
                mean = mean.index_add(0, torch.tensor(centred, device=device), -sq / sizes)
            mean = mean / _stacked([m.correction for m in ms], device)
            root = torch.tensor([m.root for m in ms], device=device)
            scale = torch.where(root, mean.clamp_min(0).sqrt(), mean)
            eps = torch.tensor([m.eps for m in ms], dtype=torch.float32, device=device)
            scales.append((idx, scale, eps))
        # the floor: a share of the largest scale of all, whatever its device
        top = max(scale.max().to(scales[0][1].device) for _, scale, _ in scales) * SCALE_FLOOR
        out: list[torch.Tensor | None] = [None] * len(moments)
        for idx, scale, eps in scales:
            gain = (torch.maximum(scale, top.to(scale.device)) + eps).reciprocal()
            for i, g in zip(idx, gain.unbind(), strict=True):
                out[i] = g
    return [g for g in out if g is not None]


def _stacked(values: list[torch.Tensor | float], device: torch.device) -> torch.Tensor:
    """``values`` (numbers and 0-d tensors) as one float32 vector on ``device``."""
    if all(isinstance(v, float) for v in values):
        return torch.tensor(values, dtype=torch.float32, device=device)
    return torch.stack([torch.as_tensor(v, dtype=torch.float32, device=device) for v in values])
