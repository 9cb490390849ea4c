"""Robust measurements for the calibration: outlying draws re-probed, the median kept.

NOTE [ Robust measurements ]
A calibration measurement (NOTE [ Calibration ]) is one random draw: the squared
distance between the whole-model gradient with one layer compressed and the exact one.
Most draws spread within a few x of their mean (NOTE [ Pooling the widths from 2 bits
up ]), but some are absurd: on the real-data language model of
``benchmarks/convergence.py`` a probe measured 7.9e13 against a minibatch gradient
variance of 0.16. A running mean that takes such a draw is wrong for the next four
probes, by any factor, and the allocation and the guard act on it. So:

- *A draw is suspect* when it is not finite, or above ``_ABSURD`` times the probe's own
  gradient scale (the larger of the exact gradient's squared norm and the minibatch
  gradient's variance: a relative measure, so the test holds at any loss scale and any
  point of training), or above ``SUSPECT`` times what the calibrated model expected
  for it when the model rests on measurements of that layer and width.
- *A suspect draw is re-probed*: the same replay with fresh random draws, up to
  ``REDRAWS`` more times; the probe keeps the mean of its draws without those above
  ``SUSPECT`` times their median (a non-finite draw orders as ``+inf`` and is never
  averaged). One outlier among three draws is then outvoted; a reproducible one (two of
  three) is real and is kept.
- *Every layer's estimate is the same outlier-free mean* of its last probes' values
  (:func:`robust_value`): an outlier that survived the re-probe is left out once two
  ordinary probes outnumber it. A plain median would be robust too, but biased: single
  draws are skewed (NOTE [ Pooling the widths from 2 bits up ]), so the median of a few
  sits up to ~2x below their mean, which is what the allocation adds up.
- *An absurd draw is still evidence*: a width that produced one (finite or not) for a
  layer is a width at which that layer can, now and then, wreck a step's gradient, and
  the median hides exactly that. The calibration keeps the widest such width per layer
  (:meth:`~memctl.controller.calibration.Calibration.mark_unsafe`) and the allocation
  floors the layer one width above it (``Calibration.floor``), as it does for 1 bit
  before it is measured. Under a process group these floors are not used (every rank
  would need the same ones; NOTE [ Calibration across ranks ] carries only the values).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

__all__ = ["REDRAWS", "SUSPECT", "absurd", "robust_draws", "robust_value", "suspect"]

_ABSURD = 1e4
"""A draw above this many times the probe's gradient scale is absurd."""
SUSPECT = 8.0
"""A draw above this many times the model's measured expectation is re-probed."""
REDRAWS = 2


def absurd(value: float, scale: float | None) -> bool:
    """Whether ``value`` is non-finite or above ``_ABSURD`` times ``scale`` (the gradient's scale)."""
    if not math.isfinite(value) or value < 0:
        return True
    return scale is not None and scale > 0 and value > _ABSURD * scale


def suspect(value: float, scale: float | None, expected: float | None) -> bool:
    """Whether a draw must be re-probed (see NOTE [ Robust measurements ])."""
    if absurd(value, scale):
        return True
    return expected is not None and expected > 0 and value > SUSPECT * expected


def robust_value(draws: Sequence[float]) -> float:
    """The mean of ``draws`` without outliers: with three or more, those above ``SUSPECT``
    times their median are left out (a non-finite draw orders as ``+inf``; ``inf`` if the
    median is). Not the median itself: a draw's spread is skewed (a chi-square with few
    degrees of freedom on a BatchNorm input), so a median sits below the mean the
    allocation needs, by up to ~2x."""
    if not draws:
        return math.nan
    ordered = sorted(v if math.isfinite(v) and v >= 0 else math.inf for v in draws)
    n = len(ordered)
    if n < 3:
        return statistics.fmean(ordered) if not math.isinf(ordered[-1]) else math.inf
    median = ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])
    if math.isinf(median):
        return math.inf
    kept = [v for v in ordered if v <= SUSPECT * median]
    return statistics.fmean(kept) if kept else median


def robust_draws(first: float, redraw: Callable[[int], float | None], scale: float | None,
                 expected: float | None) -> list[float]:
    """``first`` and, if it is suspect, up to ``REDRAWS`` more draws from ``redraw(i)``
    (``None``: the replay could not run)."""
    draws = [first]
    if not suspect(first, scale, expected):
        return draws
    for i in range(REDRAWS):
        value = redraw(i)
        if value is None:
            break
        draws.append(value)
    return draws
