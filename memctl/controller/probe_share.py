"""Calibration probes and the convergence guard agreed across ranks: :class:`ProbeShare`.

NOTE [ Calibration across ranks ]
Under a process group every rank must apply the same allocation, so everything the
solver reads must be the same on every rank: the statistics (reduced at the allocation
step, NOTE [ Agreement across ranks ]) and also the calibrated variance model (NOTE
[ Calibration ]) and the convergence guard's floors (NOTE [ Convergence guard ]). So:

- every rank probes: on an allocation step each rank replays its own captured step
  (NOTE [ Replay ]) and measures what it can in its time allowance, but records nothing
  yet (``run_probe(..., record=False)``);
- the measurements travel with the statistics, in the same SUM and MAX all-reduces (no
  collective added): per layer and bit width a (sum, count) pair, (sum, count) for
  the exact gradient's squared norm, the minibatch noise and the added variance of the
  allocation in use, and per bit width (sum, count) for the replays with every layer at
  that width, which fit the unmeasured layers' factor (NOTE [ Unmeasured layers ]; fitted
  by each rank from its own replay, the factors differed by 3x between two ranks and so
  did their allocations); MAX carries each layer's guard floor, whether any rank's loss turned
  back up, whether any rank's calibration is off (a probe that failed on one rank
  turns calibration off on all), and the absurd draws of NOTE [ Robust measurements ]:
  per layer the widest width that gave one, and whether a replay of the allocation in
  use did (before, a rank's own absurd draws were dropped with its unrecorded figures);
- every rank then folds the same means into its :class:`Calibration` and runs the guard
  on them, with the floors agreed by MAX: identical inputs, so identical floors and an
  identical allocation.

The means are what the single-process code uses at the scale of one rank: DDP averages
the W ranks' gradients, which divides both the added variance and the minibatch noise
by W, so their ratio (what the bound and the guard compare) is the ratio of the means.
Under a group the loss signal of the guard is read at allocation steps only (a rank whose
loss turns at another step would otherwise re-solve alone).

Replays must not run the wrapper's collectives: under DDP the replay runs ``.module``
(DDP's forward would broadcast buffers and arm its reducer; ``torch.autograd.grad``
on the plain module fires none of DDP's gradient hooks and touches no ``.grad``). Under
FSDP2 a replay would have to all-gather and reduce-scatter (FSDP's hooks sit inside
the module), so calibration is off there and the closed form is used; the guard's loss
signal still works. A model with ``SyncBatchNorm`` runs its collectives in every replay,
which matches across ranks only while the ranks replay alike (same batch sizes).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from memctl.controller.probe import ProbeResult, run_probe
from memctl.controller.stats import LayerState, grad_sq_names, median_grad_sq

__all__ = ["ProbeShare", "apply_share", "replay_module", "share_probe"]

_log = logging.getLogger("memctl.controller")

# A Controller, typed as Any (importing controller.py here would make an import cycle).
Controller = Any


def replay_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module a replay runs: the wrapped module under DDP (no DDP collectives), else ``model``."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # a torch without torch.distributed has no DDP to unwrap
        return model
    return model.module if isinstance(model, DistributedDataParallel) else model


class ProbeShare:
    """One rank's part of the allocation step's reduction, and the agreed result."""

    def __init__(self, names: list[str], choices: tuple[int, ...], result: ProbeResult | None,
                 floors: dict[str, float], loss_turning: bool, disabled: bool) -> None:
        self.names = names
        self.choices = choices
        self.result = result
        self.floors = floors
        self.loss_turning = loss_turning
        self.disabled = disabled
        self.received = False
        self.measured: list[tuple[str, int, float]] = []
        self.grad_sq: float | None = None
        self.noise: float | None = None
        self.added: float | None = None
        self.uniform: list[tuple[int, float]] = []
        self.unsafe: dict[str, int] = {}
        self.tail = False

    def sums(self) -> list[float]:
        slot = {(n, b): i for i, (n, b) in enumerate((n, b) for n in self.names for b in self.choices)}
        width = {b: i for i, b in enumerate(self.choices)}
        out = [0.0] * (2 * len(slot) + 6 + 2 * len(width))
        r = self.result
        if r is not None:
            for name, bits, value in r.measured:
                i = slot.get((name, bits))
                if i is not None and math.isfinite(value) and value >= 0:
                    out[2 * i] += value
                    out[2 * i + 1] += 1.0
            base = 2 * len(slot)
            for k, v in enumerate((r.grad_sq, r.noise, r.added)):
                if v is not None and math.isfinite(v) and v >= 0:
                    out[base + 2 * k], out[base + 2 * k + 1] = v, 1.0
            base += 6
            for bits, value in r.uniform:
                j = width.get(bits)
                if j is not None and math.isfinite(value) and value >= 0:
                    out[base + 2 * j] += value
                    out[base + 2 * j + 1] += 1.0
        return out

    def maxima(self) -> list[float]:
        floors = [self.floors.get(n, 0.0) for n in self.names]
        widest = dict.fromkeys(self.names, 0)
        r = self.result
        if r is not None:
            for name, bits in r.unsafe:
                if name in widest:
                    widest[name] = max(widest[name], bits)
        tail = r is not None and r.tail
        return [*floors, float(self.loss_turning), float(self.disabled),
                *(float(widest[n]) for n in self.names), float(tail)]

    def receive(self, sums: list[float], maxima: list[float]) -> None:
        """Take the reduced ``sums()`` and ``maxima()`` (every rank receives the same)."""
        pairs = [(n, b) for n in self.names for b in self.choices]
        self.measured = [(n, b, sums[2 * i] / sums[2 * i + 1])
                         for i, (n, b) in enumerate(pairs) if sums[2 * i + 1] > 0]
        base = 2 * len(pairs)
        means = [sums[base + 2 * k] / sums[base + 2 * k + 1] if sums[base + 2 * k + 1] > 0 else None
                 for k in range(3)]
        self.grad_sq, self.noise, self.added = means
        base += 6
        self.uniform = [(b, sums[base + 2 * j] / sums[base + 2 * j + 1])
                        for j, b in enumerate(self.choices) if sums[base + 2 * j + 1] > 0]
        self.floors = {n: f for n, f in zip(self.names, maxima, strict=False) if f > 0}
        k = len(self.names)
        self.loss_turning = maxima[k] > 0
        self.disabled = maxima[k + 1] > 0
        self.unsafe = {n: int(b) for n, b in zip(self.names, maxima[k + 2:2 * k + 2], strict=True) if b > 0}
        self.tail = maxima[2 * k + 2] > 0
        self.received = True

    def keep_local(self) -> None:
        """Use this rank's own figures (the ranks' layer tables differ: nothing was reduced)."""
        self.receive(self.sums(), self.maxima())


def share_probe(ctl: Controller) -> ProbeShare:
    """Run this rank's due probe without recording it, and gather what the reduction carries."""
    capture, ctl._capture = ctl._capture, None
    ctl._await_output = False
    layers = [s for s in ctl._layers.values() if s.numels]
    result: ProbeResult | None = None
    if capture is not None and capture.out_grads and layers:
        ctl._replaying = True
        try:
            result = run_probe(replay_module(ctl.model), ctl._replayer, capture, ctl._calibration, layers,
                               ctl._choice_for, ctl.config, ctl._calibration.median_grad_sq(layers),
                               ctl._step, ctl._train_s, record=False)
        except Exception as exc:  # NOTE [ Codec fallback ]: calibration never stops training
            _log.warning("calibration probe failed at step %d (%s: %s); calibration is off from now on, "
                         "on every rank", ctl._step, type(exc).__name__, exc)
            ctl._event("calibration_failed", f"{type(exc).__name__}: {exc}")
            ctl._calibration.disable()
        finally:
            ctl._replaying = False
            ctl._tracker.reset()
        ctl._train_s = 0.0
    loss = bool(ctl.config.guard) and ctl._guard.loss_turning(ctl._step)
    return ProbeShare(sorted(ctl._layers), tuple(ctl.config.bit_choices), result, dict(ctl._guard.floors),
                      loss, not ctl._calibration.enabled)


def apply_share(ctl: Controller, share: ProbeShare) -> bool:
    """Fold the agreed figures into the calibration and run the guard; True if it raised bits."""
    layers: list[LayerState] = [s for s in ctl._layers.values() if s.numels]
    cal = ctl._calibration
    # first, as run_probe does (NOTE [ Gradient scale ], NOTE [ The median's layers ])
    cal.record_reference(share.grad_sq, share.noise, median_grad_sq(layers), grad_sq_names(layers))
    fallback_g2 = cal.median_grad_sq(layers)
    # The prediction of the allocation in use, before this probe's measurements (as run_probe does).
    predicted = sum(cal.estimate(s, fallback_g2, ctl._choice_for(s.name)[0]) for s in layers)
    by_name = {s.name: s for s in layers}
    for name, bits, value in share.measured:
        s = by_name.get(name)
        if s is not None:
            cal.record(name, bits, value, cal.closed_form(s, fallback_g2, bits), ctl._step)
    if share.uniform and cal.unmeasured(layers):  # as run_probe fits them, after the layers
        for bits, value in share.uniform:
            cal.fit_width(bits, value, layers, fallback_g2)
    if share.added is not None:
        cal.added, cal.added_predicted = share.added, predicted
    if share.disabled and cal.enabled:
        cal.disable()
        ctl._event("calibration_failed", "calibration is off on every rank: it failed or is off on one")
    for name, bits in share.unsafe.items():  # NOTE [ Robust measurements ], as run_probe marks them
        cal.mark_unsafe(name, bits)
    if share.unsafe:
        ctl._outlier_event(sorted(share.unsafe.items()), " (on at least one rank)")
    ctl._guard.floors = dict(share.floors)
    fired = False
    if ctl.config.guard and share.added is not None and layers:
        fired = ctl._noise_guard(share.added, layers, fallback_g2)
    if ctl.config.guard and not fired and share.tail and layers:
        fired = ctl._tail_guard(layers, fallback_g2, " on at least one rank")
    if ctl.config.guard and not fired and share.loss_turning and layers:
        fired = ctl._raise_bits(layers, fallback_g2, 0.5,
                                "the loss turned back up against its history (on at least one rank)")
    ctl._guard_fired = fired
    return bool(fired)
