"""Array helpers for the multiple-choice knapsack: dominance, convex hulls, greedy, bounds.

Every function works on one canonical form (see NOTE [ One greedy for both objectives ] in
:mod:`memctl.allocation.knapsack`): minimise ``Σ_l f[l, c_l]`` subject to
``Σ_l g[l, c_l] <= cap``, exactly one choice ``c_l`` per layer. ``f`` and ``g`` are
``(L, K)`` float64 arrays; a layer with fewer than ``K`` choices pads its row with ``inf``
in both. A ``keep`` mask restricts the choices considered; it always holds each layer's
least-g choice. Nothing here validates input: :class:`~memctl.allocation.knapsack.Problem`
does, and the caller checks every answer exactly.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

__all__: list[str] = []

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.intp]
BoolArray = npt.NDArray[np.bool_]

# Relative slack when comparing float sums of g with the capacity (a sum of the same
# numbers in another order differs in the last bits). The exact check is the caller's.
_SLACK = 1e-12


def _rows(n: int) -> IntArray:
    return np.arange(n, dtype=np.intp)


def min_g_choice(f: FloatArray, g: FloatArray, keep: BoolArray | None = None) -> IntArray:
    """Per layer, the choice in ``keep`` with the least ``g`` (ties: least ``f``, then index)."""
    if f.size == 0:
        return np.zeros(f.shape[0], np.intp)
    if keep is not None:
        f, g = np.where(keep, f, np.inf), np.where(keep, g, np.inf)
    return np.lexsort((f, g), axis=1)[:, 0].astype(np.intp)


def min_f_choice(f: FloatArray, g: FloatArray) -> IntArray:
    """Per layer, the choice with the least ``f`` (ties: least ``g``, then lowest index)."""
    if f.size == 0:
        return np.zeros(f.shape[0], np.intp)
    return np.lexsort((g, f), axis=1)[:, 0].astype(np.intp)


def undominated(f: FloatArray, g: FloatArray) -> BoolArray:
    """Mask of the choices that no other choice of the same layer dominates.

    Choice ``j`` dominates ``k`` when ``g_j <= g_k`` and ``f_j <= f_k`` and it is strictly
    better in one of them, or equal in both and listed first. A dominated choice is never
    needed for an optimum, so dropping it keeps the integer optimum.
    """
    valid = np.isfinite(f) & np.isfinite(g)
    fj, fk = f[:, :, None], f[:, None, :]
    gj, gk = g[:, :, None], g[:, None, :]
    k = f.shape[1]
    earlier = np.arange(k)[:, None] < np.arange(k)[None, :]
    no_worse = (fj <= fk) & (gj <= gk) & valid[:, :, None]
    better = (fj < fk) | (gj < gk) | earlier[None, :, :]
    return valid & ~np.any(no_worse & better, axis=1)


def candidates(f: FloatArray, g: FloatArray, cap: float) -> BoolArray:
    """Choices worth considering: undominated, and within the room left above the least-g total."""
    g_min = np.min(g, axis=1, keepdims=True)
    room = cap - math.fsum(g_min[:, 0].tolist())
    slack = 1e-9 * max(abs(room), abs(cap))
    with np.errstate(invalid="ignore"):
        fits = (g - g_min) <= room + slack
    return undominated(f, g) & fits


def hull_mask(f: FloatArray, g: FloatArray, keep: BoolArray) -> BoolArray:
    """Mask of the choices on each layer's lower convex hull in the (g, f) plane.

    ``keep`` must hold only undominated choices (distinct ``g`` within a layer, ``f``
    falling as ``g`` grows). Points are sorted by ``g``; every round drops each point on
    or above the chord between its surviving neighbours (such a point is no hull vertex,
    so dropping several at once is safe) until none is left: at most ``K`` rounds.
    """
    n, k = f.shape
    order = np.argsort(np.where(keep, g, np.inf), axis=1, kind="stable")
    gs = np.take_along_axis(np.where(keep, g, 0.0), order, axis=1)
    fs = np.take_along_axis(np.where(keep, f, 0.0), order, axis=1)
    on = np.take_along_axis(keep, order, axis=1)
    pos = np.arange(k)
    rows = _rows(n)[:, None]
    for _ in range(k):
        last = np.maximum.accumulate(np.where(on, pos, -1), axis=1)
        prev = np.concatenate([np.full((n, 1), -1), last[:, :-1]], axis=1)
        first = np.minimum.accumulate(np.where(on, pos, k)[:, ::-1], axis=1)[:, ::-1]
        nxt = np.concatenate([first[:, 1:], np.full((n, 1), k)], axis=1)
        interior = on & (prev >= 0) & (nxt < k)
        p, q = np.clip(prev, 0, k - 1), np.clip(nxt, 0, k - 1)
        gp, fp, gq, fq = gs[rows, p], fs[rows, p], gs[rows, q], fs[rows, q]
        drop = interior & ((fs - fp) * (gq - gp) >= (fq - fp) * (gs - gp))
        if not drop.any():
            break
        on = on & ~drop
    mask = np.zeros_like(keep)
    np.put_along_axis(mask, order, on, axis=1)
    return mask


class Segments(NamedTuple):
    """The hull segments of all layers, in order of falling ``Δf / Δg``.

    ``layer`` and ``dst``: the layer and the choice a segment leads to; ``dg``: the g it
    costs; ``df``: the f it saves. Ties are ordered by layer, then position along the
    hull, so each layer's segments appear in hull order.
    """

    layer: IntArray
    dst: IntArray
    dg: FloatArray
    df: FloatArray


def segments(f: FloatArray, g: FloatArray, keep: BoolArray) -> Segments:
    """The hull segments of the choices in ``keep`` (see :class:`Segments`)."""
    n, k = f.shape
    hull = hull_mask(f, g, keep)
    n_hull = hull.sum(axis=1)
    # Hull choices first, in order of g.
    order = np.argsort(np.where(hull, g, np.inf), axis=1, kind="stable")
    seg_pos = np.broadcast_to(np.arange(max(k - 1, 0))[None, :], (n, max(k - 1, 0)))
    ok = seg_pos < (n_hull - 1)[:, None]
    layer = np.broadcast_to(_rows(n)[:, None], seg_pos.shape)[ok]
    src, dst, pos = order[:, :-1][ok], order[:, 1:][ok], seg_pos[ok]
    dg = g[layer, dst] - g[layer, src]
    df = f[layer, src] - f[layer, dst]
    by = np.lexsort((pos, layer, -(df / dg))) if dg.size else np.zeros(0, np.intp)
    return Segments(layer[by], dst[by], dg[by], df[by])


def lp_point(f: FloatArray, g: FloatArray, cap: float, keep: BoolArray,
             segs: Segments) -> tuple[IntArray, float, int]:
    """The LP relaxation's integer part, its price of g, and how many segments it takes.

    The classical result for the multiple-choice knapsack (Sinha and Zoltners, 1979): from
    the least-g assignment take the hull segments in order of falling ``Δf / Δg``; the
    first that does not fit (the break segment) is taken fractionally, and its ratio is the
    price (0 when every segment fits). Returned: the assignment with the break segment left
    out (every layer at a minimiser of ``f + price * g``), the price, and the index of the
    break segment in ``segs``.
    """
    n = f.shape[0]
    x = min_g_choice(f, g, keep)
    room = cap - math.fsum(g[_rows(n), x].tolist())
    taken = int(np.searchsorted(np.cumsum(segs.dg), room, side="right"))
    # Each layer ends at the destination of its last segment taken (its segments appear
    # in hull order).
    last = np.full(n, -1, dtype=np.intp)
    np.maximum.at(last, segs.layer[:taken], np.arange(taken, dtype=np.intp))
    moved = last >= 0
    x[moved] = segs.dst[last[moved]]
    price = float(segs.df[taken] / segs.dg[taken]) if taken < segs.dg.size else 0.0
    return x, price, taken


def lp_price(f: FloatArray, g: FloatArray, cap: float, keep: BoolArray,
             segs: Segments) -> tuple[float, float]:
    """The LP relaxation's optimum over ``keep`` and its price of g (the knapsack row's dual)."""
    x, price, taken = lp_point(f, g, cap, keep, segs)
    rows = _rows(f.shape[0])
    value = float(f[rows, x].sum())
    if taken < segs.dg.size:
        room = cap - float(g[rows, x].sum())
        value -= float(segs.df[taken]) * max(room, 0.0) / float(segs.dg[taken])
    return value, price


def lagrangian_core(f: FloatArray, g: FloatArray, cap: float, keep: BoolArray, upper: float,
                    segs: Segments) -> tuple[BoolArray, float]:
    """The choices that can still be in an assignment with objective <= ``upper``.

    NOTE [ Reduced-cost fixing ]
    For any price ``λ >= 0`` and any feasible assignment ``x``,
    ``Σ f(x) >= Σ_l min_k (f_lk + λ g_lk) - λ cap + Σ_l rc_l(x_l)``, where
    ``rc_lk = f_lk + λ g_lk - min_j (f_lj + λ g_lj) >= 0`` (Lagrangian relaxation of the
    knapsack row). The first two terms are a lower bound ``LB``; so an assignment no worse
    than ``upper`` (the greedy answer) uses only choices with ``rc <= upper - LB``, and all
    others can be dropped without losing the optimum. ``λ`` is the LP relaxation's price,
    which makes ``LB`` the LP bound. Unlike dropping the choices off the convex hull
    ("LP-dominated"), which keeps only the LP optimum, this keeps the integer optimum.

    Returns the reduced mask (a superset, by a small tolerance, of what the bound allows)
    and ``LB``.
    """
    _, price = lp_price(f, g, cap, keep, segs)
    with np.errstate(invalid="ignore"):
        value = np.where(keep, f + price * g, np.inf)
    best = value.min(axis=1, keepdims=True)
    lower = float(best.sum()) - price * cap
    scale = abs(upper) + abs(lower) + float(np.abs(best).sum())
    slack = (upper - lower) + 1e-9 * scale
    return keep & (value - best <= slack), lower


def hull_greedy(f: FloatArray, g: FloatArray, cap: float, keep: BoolArray,
                segs: Segments | None = None) -> IntArray:
    """Marginal-utility greedy over the convex hulls, then a fill pass.

    Every layer starts at its least-``g`` choice. The hull segments of all layers are
    taken in order of falling ``Δf / Δg`` (f saved per unit of g spent) while they fit;
    a layer whose next segment does not fit stops there (its later hull points cost even
    more). :func:`fill` then spends what is left on single-layer moves, off-hull choices
    included. The answer is feasible whenever the start is.
    """
    if segs is None:
        segs = segments(f, g, keep)
    rows = _rows(f.shape[0])
    choice = min_g_choice(f, g, keep)
    room = cap - float(g[rows, choice].sum())
    blocked = np.zeros(f.shape[0], dtype=bool)
    tol = _SLACK * max(abs(cap), 1.0)
    for layer, dst, step in zip(segs.layer.tolist(), segs.dst.tolist(), segs.dg.tolist(), strict=True):
        if blocked[layer]:
            continue
        if step <= room + tol:
            choice[layer] = dst
            room -= step
        else:
            blocked[layer] = True
    return fill(f, g, cap, choice, keep)


def fill(f: FloatArray, g: FloatArray, cap: float, choice: IntArray,
         keep: BoolArray | None = None) -> IntArray:
    """Repeatedly make the single-layer change that lowers ``f`` most and still fits."""
    choice = choice.copy()
    rows = _rows(f.shape[0])
    allowed = np.isfinite(f) if keep is None else keep
    tol = _SLACK * max(abs(cap), 1.0)
    for _ in range(f.size + 1):
        cur_f = f[rows, choice][:, None]
        cur_g = g[rows, choice][:, None]
        room = cap - float(cur_g.sum())
        with np.errstate(invalid="ignore"):
            gain = np.where(allowed & (g - cur_g <= room + tol), cur_f - f, 0.0)
        best = int(np.argmax(gain))
        layer, k = divmod(best, f.shape[1])
        if not gain[layer, k] > 0.0:
            break
        choice[layer] = k
    return choice


def repair(f: FloatArray, g: FloatArray, cap: float, choice: IntArray) -> IntArray:
    """Make an over-capacity answer fit by the cheapest moves to smaller ``g``, then fill.

    Each step makes one single-layer change: the one adding the least ``f`` among those
    that free enough ``g`` on their own (an answer that overshoots only by a solver
    tolerance needs one small change), else the one adding the least ``f`` per unit of
    ``g`` freed. It ends feasible whenever the least-``g`` assignment is.
    """
    choice = choice.copy()
    rows = _rows(f.shape[0])
    for _ in range(f.size + 1):
        cur_f = f[rows, choice][:, None]
        cur_g = g[rows, choice][:, None]
        excess = float(cur_g.sum()) - cap
        if excess <= 0:
            break
        freed = cur_g - g
        movable = (freed > 0) & np.isfinite(f)
        enough = movable & (freed >= excess)
        with np.errstate(invalid="ignore", divide="ignore"):
            if enough.any():
                cost = np.where(enough, f - cur_f, np.inf)
            else:
                cost = np.where(movable, (f - cur_f) / freed, np.inf)
        best = int(np.argmin(cost))
        layer, k = divmod(best, f.shape[1])
        if not np.isfinite(cost[layer, k]):
            break
        choice[layer] = k
    return fill(f, g, cap, choice)
