"""An exact dynamic program for the multiple-choice knapsack, specialised to its LP structure.

Works on the canonical form of :mod:`memctl.allocation._greedy` (minimise ``Σ f`` subject to
``Σ g <= cap``, one choice per layer) and returns the best assignment it found and whether
the search finished, i.e. whether that assignment is proven optimal within the requested
gap. The caller checks every answer exactly against the unscaled problem.

NOTE [ Expanding-core dynamic program ]
The LP relaxation of the knapsack is solved by taking hull segments in order of falling
ratio ``Δf / Δg`` up to the break segment, whose ratio ``λ`` is the price of ``g``
(:func:`~memctl.allocation._greedy.lp_point`). Rounding the break layer down gives an
integer assignment ``x̄`` in which every layer sits at a minimiser of ``f + λ g``. An
optimal assignment usually differs from ``x̄`` in a handful of layers near the break,
which is what Pisinger's algorithms for knapsack problems exploit (D. Pisinger, "A
minimal algorithm for the multiple-choice knapsack problem", EJOR 83, 1995): start from
``x̄``, add layers to a dynamic program one at a time, nearest the break first, and stop as
soon as bounds show that no layer left out can change in an improving assignment.

* A state is an assignment of the layers added so far, the others at ``x̄``: its totals
  ``(W, F)``. A state is dropped when another has ``W`` and ``F`` no larger (dominance),
  or when a lower bound on every completion reaches the incumbent ``U`` minus the gap.
* The bound of a state is the LP relaxation over the layers not yet added, exactly: with
  room ``r = cap - W >= 0`` they can only buy their hull segments above ``x̄`` (ratios
  ``<= λ``, best first); with ``r < 0`` they must sell segments below ``x̄`` (ratios
  ``>= λ``, cheapest first). Both are piecewise-linear lookups in cumulative sums.
* A layer ``l`` that is not added is fixed at ``x̄_l`` once
  ``min_s (F_s + λ (W_s - cap)) + rc_l >= U - gap``, where ``rc_l`` is the least reduced
  cost ``f + λ g - (f + λ g)(x̄_l)`` of its other choices: by Lagrangian duality every
  assignment that moves ``l`` is at least that. Descendants of a state only raise its
  ``F + λ (W - cap)`` and ``U`` only falls, so the fixing stays valid for the rest of the
  search, and the fixed layer's segments leave the LP bound, which tightens it.
* Layers are taken in order of how close a hull segment next to ``x̄`` comes to the price
  ``λ`` (smallest ``|Δf / Δg - λ|`` first): the layers whose integrality decides the bound.
  Ordering by reduced cost instead lets the many small layers (tiny ``Δg``, hence tiny
  reduced cost) multiply the states long before the bound can prune them; on the 500-layer
  benchmark that was 7x slower at the median, and some searches ran past 0.1 s.

The search is finished when every layer is added or fixed, or when no state is left; the
incumbent is then optimal within the gap. A state budget and a deadline bound the work; a
search cut short returns its incumbent with ``proven=False``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from memctl.allocation._greedy import BoolArray, FloatArray, IntArray, Segments, lp_point

__all__: list[str] = []

#: Most states alive at once before the search gives up (a few MB of arrays).
MAX_STATES = 200_000
#: Most states recorded over the whole search, for reading back the answer (~100 MB at most).
MAX_RECORDED = 8_000_000
# Relative slack of float comparisons between sums of the same numbers taken in other
# orders; the caller checks the final answer exactly.
_REL_TOL = 1e-12


@dataclass(frozen=True)
class DpOutcome:
    """What the search returned.

    Attributes:
        choice: the best assignment found (``upper_choice`` when nothing beat it).
        proven: whether the search finished: ``choice`` is optimal within the gap.
        reason: why it stopped early (empty when ``proven``).
        n_added: layers the dynamic program enumerated.
        n_fixed: layers proven to keep their LP choice.
        peak_states: the most states alive at once.
    """

    choice: IntArray
    proven: bool
    reason: str
    n_added: int
    n_fixed: int
    peak_states: int


class _LpBound:
    """The LP bound over the layers not yet added or fixed (NOTE [ Expanding-core ... ])."""

    def __init__(self, segs: Segments, taken: int, open_: BoolArray) -> None:
        # Above x̄: the segments not taken, best ratio first. Below x̄: the taken ones,
        # undone cheapest first (reverse order).
        self._up = (segs.layer[taken:], segs.dg[taken:], segs.df[taken:])
        self._down = (segs.layer[:taken][::-1], segs.dg[:taken][::-1], segs.df[:taken][::-1])
        self.refresh(open_)

    @staticmethod
    def _table(moves: tuple[IntArray, FloatArray, FloatArray],
               open_: BoolArray) -> tuple[FloatArray, FloatArray]:
        layer, dg, df = moves
        on = open_[layer]
        zero = np.zeros(1)
        return np.concatenate([zero, np.cumsum(dg[on])]), np.concatenate([zero, np.cumsum(df[on])])

    def refresh(self, open_: BoolArray) -> None:
        """Restrict the bound to the layers marked in ``open_``."""
        self._up_g, self._up_f = self._table(self._up, open_)
        self._down_g, self._down_f = self._table(self._down, open_)

    def __call__(self, w: FloatArray, fv: FloatArray, cap: float, slack: float) -> FloatArray:
        """Lower bound on ``Σ f`` of every completion of the states ``(w, fv)``.

        ``slack`` absorbs float rounding in the sums: a state over the capacity by less
        than that is not cut off.
        """
        room = cap - w
        gain = np.interp(np.maximum(room, 0.0), self._up_g, self._up_f)
        over = np.maximum(-room, 0.0)
        cost = np.interp(over, self._down_g, self._down_f)
        # More excess than every sale can free (beyond the slack): no completion fits.
        cost[over > self._down_g[-1] + slack] = np.inf
        return np.where(room >= 0, fv - gain, fv + cost)


def solve_dp(
    f: FloatArray,
    g: FloatArray,
    cap: float,
    keep: BoolArray,
    segs: Segments,
    upper_choice: IntArray,
    *,
    gap: float,
    deadline: float,
    max_states: int | None = None,
    max_recorded: int | None = None,
) -> DpOutcome:
    """Search for the optimum of the canonical problem over the choices in ``keep``.

    ``segs`` are the hull segments of ``keep`` (:func:`~memctl.allocation._greedy.segments`);
    ``upper_choice`` is a feasible assignment (the greedy answer), the first incumbent.
    ``gap`` is the accepted distance from the optimum relative to the objective (states
    whose bound is within it of the incumbent are dropped); ``deadline`` is a
    :func:`time.perf_counter` value. ``max_states`` and ``max_recorded`` default to
    :data:`MAX_STATES` and :data:`MAX_RECORDED`. See NOTE [ Expanding-core dynamic program ].
    """
    max_states = MAX_STATES if max_states is None else max_states
    max_recorded = MAX_RECORDED if max_recorded is None else max_recorded
    n = f.shape[0]
    rows = np.arange(n)
    x, price, taken = lp_point(f, g, cap, keep, segs)
    with np.errstate(invalid="ignore"):
        value = np.where(keep, f + price * g, np.inf)
    # Reduced cost of every other choice against x̄ (x̄ minimises f + λ g up to rounding).
    reduced = value - value[rows, x][:, None]
    reduced[rows, x] = np.inf
    least_rc = reduced.min(axis=1)

    best = float(f[rows, upper_choice].sum())
    tol = _REL_TOL * max(abs(best), float(np.abs(f[np.isfinite(f)]).max(initial=0.0)), 1e-300)
    slack = _REL_TOL * max(abs(cap), 1.0)

    def cutoff() -> float:
        return best - max(gap * abs(best), tol)

    w_states = np.array([math.fsum(g[rows, x].tolist())])
    f_states = np.array([math.fsum(f[rows, x].tolist())])
    found: tuple[int, int] | None = None  # (records to replay, state index) of the incumbent
    if w_states[0] <= cap + slack and f_states[0] < cutoff():
        best, found = float(f_states[0]), (0, 0)

    # Order: closest hull segment next to x̄ in ratio to the price, nearest first.
    distance = np.full(n, np.inf)
    np.minimum.at(distance, segs.layer, np.abs(segs.df / segs.dg - price))
    distance[~np.isfinite(least_rc)] = np.inf
    order = np.argsort(distance, kind="stable")

    open_ = np.ones(n, dtype=bool)  # layers whose segments the LP bound may still use
    lagrange_floor = float(f_states[0] + price * (w_states[0] - cap))
    open_ &= ~(least_rc >= cutoff() - lagrange_floor)  # fixed from the start
    bound = _LpBound(segs, taken, open_)
    records: list[tuple[int, np.ndarray, np.ndarray]] = []  # (layer or -1 for a remap, parent, choice)
    n_recorded = n_added = n_fixed = 0
    peak = 1
    reason = ""
    for layer in order.tolist():
        if not math.isfinite(least_rc[layer]) or w_states.size == 0:
            break
        if time.perf_counter() > deadline:
            reason = "deadline"
            break
        open_[layer] = False
        if float((f_states + price * (w_states - cap)).min()) + least_rc[layer] >= cutoff():
            n_fixed += 1
            continue
        n_added += 1
        bound.refresh(open_)
        ks = np.nonzero(keep[layer])[0]
        # One run per choice, each sorted by W like the states: the stable sort merges runs.
        w = ((g[layer, ks] - g[layer, x[layer]])[:, None] + w_states[None, :]).ravel()
        fv = ((f[layer, ks] - f[layer, x[layer]])[:, None] + f_states[None, :]).ravel()
        parent = np.tile(np.arange(w_states.size, dtype=np.int64), ks.size)
        pick = np.repeat(ks, w_states.size)
        alive = bound(w, fv, cap, slack) < cutoff()
        w, fv, parent, pick = w[alive], fv[alive], parent[alive], pick[alive]
        by = np.argsort(w, kind="stable")
        w, fv, parent, pick = w[by], fv[by], parent[by], pick[by]
        if fv.size:
            # Pareto frontier: by rising W, keep only states with F below all before them
            # (of states with equal W a dominated one may stay; it is harmless).
            frontier = np.ones(fv.size, dtype=bool)
            frontier[1:] = fv[1:] < np.minimum.accumulate(fv)[:-1]
            w, fv, parent, pick = w[frontier], fv[frontier], parent[frontier], pick[frontier]
        records.append((layer, parent, pick))
        w_states, f_states = w, fv
        n_recorded += w.size
        peak = max(peak, w.size)
        if w.size > max_states or n_recorded > max_recorded:
            reason = f"state budget ({w.size} states alive, {n_recorded} recorded)"
            break
        feasible = w <= cap + slack
        if feasible.any():
            i = int(np.argmin(np.where(feasible, fv, np.inf)))
            if fv[i] < cutoff():
                best, found = float(fv[i]), (len(records), i)
                keep_states = np.nonzero(bound(w_states, f_states, cap, slack) < cutoff())[0]
                w_states, f_states = w_states[keep_states], f_states[keep_states]
                records.append((-1, keep_states, keep_states))
    choice = upper_choice.copy()
    if found is not None:
        choice = x.copy()
        n_replay, i = found
        for layer, parent, pick in reversed(records[:n_replay]):
            if layer >= 0:
                choice[layer] = int(pick[i])
            i = int(parent[i])
    return DpOutcome(choice, not reason, reason, n_added, n_fixed, peak)
