"""The multiple-choice knapsack as a ``scipy.optimize.milp`` (HiGHS) model.

Works on the canonical form of :mod:`memctl.allocation._greedy` (minimise ``Σ f`` subject
to ``Σ g <= cap``, one choice per layer) and returns the raw choice per layer; the caller
checks feasibility exactly and decides what to do with a failure. SciPy is imported on
first use, never at import time.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from memctl.allocation._greedy import BoolArray, FloatArray, IntArray, lp_price, min_g_choice, segments

__all__: list[str] = []

# NOTE [ Scaling the MILP ]
# HiGHS works with absolute tolerances (primal feasibility 1e-7, dual feasibility 1e-7,
# a MIP absolute gap of 1e-6, matrix entries below 1e-9 dropped). Raw allocation data
# ranges from a few bytes to tens of GiB and from 1e-12 to 1e6 in variance, so the model
# is solved in shifted and scaled units:
#   * each layer's least g (and, for the objective, least f among its candidates) is
#     subtracted: the row then counts only what a layer spends above its minimum, and
#     exactly-one-choice makes both shifts constants;
#   * the knapsack row is divided by the capacity left after those minimums, so its
#     right-hand side is 1;
#   * the objective is scaled so that the LP relaxation's (shifted) optimum, a lower bound
#     on the integer optimum, becomes _OBJECTIVE_SCALE: the 1e-6 absolute gap is then at
#     most 1e-12 of the optimum. The scale is capped so that no cost exceeds
#     _OBJECTIVE_SCALE / _MIN_LP_SHARE (HiGHS treats 1e20 as infinite).
# HiGHS's relative gap is measured on the shifted objective, which is smaller than the
# real one; the caller's gap (relative to the real objective) is widened by the ratio of
# the two at the incumbent, which is conservative since the ratio only grows as the
# objective falls. The answer is checked exactly against the unscaled data by the caller;
# HiGHS's tolerance may let a total overshoot the capacity by ~1e-7 of the room, which the
# caller repairs.
_OBJECTIVE_SCALE = 1e6
_MIN_LP_SHARE = 1e-6

# NOTE [ HiGHS 1.12 stray print ]
# The HiGHS inside SciPy 1.17 (1.12.0) writes "HighsMipSolverData::transformNewInteger
# FeasibleSolution tmpSolver.run();" to the process's stdout with a C printf when a
# solution found after a presolve restart needs repair (ERGO-Code/HiGHS#2783, fixed
# upstream). It is harmless; silencing it would mean redirecting file descriptor 1 of
# the whole process, which a library must not do. No option or scaling tried here
# (presolve off, other row scalings, a tighter mip_feasibility_tolerance) removed it.


@dataclass(frozen=True)
class MilpOutcome:
    """What the solver returned: a choice per layer (or ``None``) and its report."""

    choice: IntArray | None
    status: int
    success: bool
    message: str
    mip_gap: float | None
    n_vars: int
    solve_s: float = 0.0


def solve_milp(
    f: FloatArray,
    g: FloatArray,
    cap: float,
    keep: BoolArray,
    *,
    upper: float,
    time_limit_s: float,
    mip_rel_gap: float,
    presolve: bool = True,
) -> MilpOutcome:
    """Solve the canonical problem with ``scipy.optimize.milp``; may raise what milp raises.

    Only the choices in ``keep`` get variables; ``keep`` must hold each layer's least-g
    choice and no dominated one (:func:`~memctl.allocation._greedy.candidates`, possibly
    narrowed by :func:`~memctl.allocation._greedy.lagrangian_core`). A layer with one
    choice left is fixed and gets no variable. ``upper`` is the objective of a known
    feasible answer (for the gap conversion).
    """
    from scipy import sparse
    from scipy.optimize import Bounds, LinearConstraint, milp

    n_layers = f.shape[0]
    # Each layer's least-g choice among those kept (after reduced-cost fixing it need not
    # be the layer's least-g choice overall); a layer with one choice left stays there.
    start = min_g_choice(f, g, keep)
    all_rows = np.arange(n_layers)
    g_base = g[all_rows, start]
    room = cap - math.fsum(g_base.tolist())
    free = keep.sum(axis=1) > 1
    choice = start.copy()
    if not free.any() or room <= 0:
        return MilpOutcome(choice, 0, True, "no layer has a choice left to make", 0.0, 0)
    rows, cols = np.nonzero(keep & free[:, None])
    n_vars = rows.size
    free_layers = np.nonzero(free)[0]
    n_free = free_layers.size

    f_min = np.min(np.where(keep, f, np.inf), axis=1)
    f_shift = f[rows, cols] - f_min[rows]
    offset = math.fsum(f_min.tolist())
    lp_value, _ = lp_price(f, g, cap, keep, segments(f, g, keep))
    base = max(lp_value - offset, _MIN_LP_SHARE * float(f_shift.max()))
    c = f_shift * (_OBJECTIVE_SCALE / base) if base > 0 else f_shift
    shifted_upper = upper - offset
    gap = mip_rel_gap
    if shifted_upper > 0 and upper > 0:
        gap = min(mip_rel_gap * upper / shifted_upper, 0.5)
    weight = (g[rows, cols] - g_base[rows]) / room

    # One CSR matrix, built without Python loops: n_free one-hot equality rows, then the
    # knapsack row (its structural zeros, each layer's least-g choice, left out).
    nz = weight > 0
    var_idx = np.arange(n_vars)
    eq_ptr = np.searchsorted(np.searchsorted(free_layers, rows), np.arange(n_free + 1))
    indptr = np.concatenate([eq_ptr, [n_vars + int(nz.sum())]])
    indices = np.concatenate([var_idx, var_idx[nz]])
    data = np.concatenate([np.ones(n_vars), weight[nz]])
    a = sparse.csr_array((data, indices, indptr), shape=(n_free + 1, n_vars))
    lb = np.concatenate([np.ones(n_free), [-np.inf]])
    ub = np.concatenate([np.ones(n_free), [1.0]])
    options: dict[str, Any] = {
        "time_limit": float(time_limit_s),
        "mip_rel_gap": float(gap),
        "presolve": bool(presolve),
        "disp": False,
    }
    t0 = time.perf_counter()
    res = milp(
        c,
        integrality=np.ones(n_vars, dtype=np.uint8),
        bounds=Bounds(0.0, 1.0),
        constraints=LinearConstraint(a, lb, ub),
        options=options,
    )
    solve_s = time.perf_counter() - t0
    status = int(getattr(res, "status", 4))
    success = bool(getattr(res, "success", False))
    message = str(getattr(res, "message", ""))
    raw_gap = getattr(res, "mip_gap", None)
    mip_gap = None if raw_gap is None else float(raw_gap)
    x = getattr(res, "x", None)
    if x is None:
        return MilpOutcome(None, status, success, message, mip_gap, n_vars, solve_s)
    x = np.asarray(x, dtype=np.float64)
    if x.shape != (n_vars,) or not np.all(np.isfinite(x)):
        return MilpOutcome(None, status, False, f"{message} (malformed x)", mip_gap, n_vars, solve_s)
    # Each free layer's variable closest to 1; it must be clearly set.
    full = np.full(f.shape, -1.0)
    full[rows, cols] = x
    picked = np.argmax(full[free_layers], axis=1)
    if np.any(full[free_layers, picked] < 0.5):
        return MilpOutcome(None, status, False, f"{message} (no choice set in some layer)", mip_gap,
                           n_vars, solve_s)
    choice[free_layers] = picked
    return MilpOutcome(choice, status, success, message, mip_gap, n_vars, solve_s)
