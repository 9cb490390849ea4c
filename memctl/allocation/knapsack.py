"""The generic multiple-choice knapsack: problem, answer, exact solve with fallbacks.

Every layer picks exactly one of its choices (a bit width, or keeping the tensor as it
is); choice ``k`` of layer ``l`` costs ``nbytes[l][k]`` bytes and adds ``variance[l][k]``
to the gradient variance (docs/design.md, "The problem"). Two modes:

* :attr:`Objective.VARIANCE` (ActNN): minimise total variance, total bytes <= a budget;
* :attr:`Objective.BYTES` (AC-GC): minimise total bytes, total variance <= a bound.

:func:`solve` answers a :class:`Problem` with an :class:`Allocation`; it never raises for
a well-formed problem (an infeasible one comes back marked ``feasible=False``). The
controller builds its problem from per-layer statistics with
:func:`memctl.allocation.build_problem`; the public names of this module are
re-exported there.

NOTE [ One greedy for both objectives ]
Both modes are the same problem in canonical form: minimise ``Σ f`` subject to
``Σ g <= cap``. VARIANCE mode is ``f = variance, g = bytes, cap = budget``; BYTES mode
swaps the roles, ``f = bytes, g = variance, cap = bound``. The dynamic program, the MILP
model, the greedy fallback and the repair step are therefore written once, for the
canonical form.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from memctl.allocation import _greedy
from memctl.allocation._dp import solve_dp
from memctl.errors import ConfigError

if TYPE_CHECKING:
    from memctl.allocation._greedy import BoolArray, FloatArray, IntArray

__all__ = [
    "DEFAULT_MIP_REL_GAP",
    "DEFAULT_TIME_LIMIT_S",
    "VARIANCE_RTOL",
    "Allocation",
    "Method",
    "Objective",
    "Problem",
    "Solver",
    "solve",
    "solve_greedy",
]

_log = logging.getLogger("memctl.allocation")

# NOTE [ Solver defaults ]
# HiGHS proves small allocations optimal in a few milliseconds, but for hundreds of layers
# whose sensitivities span orders of magnitude it is slow: on the 500-layer benchmark
# (benchmarks/allocation.py, 2-core CPU) a proven optimum took a median of ~105 ms, the
# root node alone ~75 ms, and even a 20-layer core left by the reductions took HiGHS
# ~30 ms. The knapsack's own structure does better: the dynamic program of
# NOTE [ Expanding-core dynamic program ] (in memctl.allocation._dp) proves the same
# optima in a median of ~6 ms (p95 ~10 ms). So `solve` runs the dynamic program first and hands over
# to milp only when it stops early (its state budget or the deadline), with the best
# answer so far as milp's bound; milp stays the general solver, and the tests compare the
# two with each other and with brute force. The whole solve is time-boxed (the controller
# solves on the training thread every few steps); past the limit the best answer found so
# far is used, at worst the greedy one (median 1e-4 above the optimum). The default gap,
# 1e-6 of the objective, is far below the noise of the sensitivities it is computed from
# and halves the tail of the search; 0 asks for the optimum up to float rounding.
DEFAULT_TIME_LIMIT_S = 0.1
DEFAULT_MIP_REL_GAP = 1e-6

# Relative tolerance when comparing a float total variance with the bound: the same
# numbers summed in another order may differ in their last bits.
VARIANCE_RTOL = 1e-9


class Objective(str, enum.Enum):
    """What the allocation minimises (the other quantity is the constraint)."""

    VARIANCE = "variance"
    BYTES = "bytes"


class Solver(str, enum.Enum):
    """Which path produced an :class:`Allocation`.

    ``DP``: the knapsack dynamic program; ``MILP``: ``scipy.optimize.milp``; ``GREEDY``: the
    convex-hull greedy (the last fallback). ``TRIVIAL`` means no search was needed: the
    unconstrained optimum fits, or the problem is infeasible and the fallback assignment
    is returned.
    """

    DP = "dp"
    MILP = "milp"
    GREEDY = "greedy"
    TRIVIAL = "trivial"


class Method(str, enum.Enum):
    """How :func:`solve` searches: ``AUTO`` runs the dynamic program and falls back to
    milp when it stops early; ``MILP`` goes to ``scipy.optimize.milp`` directly."""

    AUTO = "auto"
    MILP = "milp"


def _as_int_row(row: object, where: str) -> tuple[int, ...]:
    try:
        arr = np.asarray(row)
    except (OverflowError, ValueError) as exc:
        raise ConfigError(f"{where} = {row!r} is not a list of whole byte counts: {exc}") from exc
    if arr.ndim != 1 or arr.size == 0:
        raise ConfigError(f"{where} = {row!r} must be a non-empty 1-D list of choices")
    if arr.dtype.kind not in "iu":
        raise ConfigError(
            f"{where} = {row!r} holds {arr.dtype} values; bytes must be whole numbers (int) >= 0"
        )
    bad = np.nonzero(arr < 0)[0]
    if bad.size:
        raise ConfigError(f"{where}[{bad[0]}] = {arr[bad[0]]!r} is negative; bytes must be >= 0")
    return tuple(int(v) for v in arr.tolist())


def _as_float_row(row: object, where: str) -> tuple[float, ...]:
    try:
        arr = np.asarray(row, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where} = {row!r} is not a list of numbers: {exc}") from exc
    if arr.ndim != 1 or arr.size == 0:
        raise ConfigError(f"{where} = {row!r} must be a non-empty 1-D list of choices")
    bad = np.nonzero(~np.isfinite(arr) | (arr < 0))[0]
    if bad.size:
        raise ConfigError(
            f"{where}[{bad[0]}] = {arr[bad[0]]!r} is not allowed; variances must be finite and >= 0"
        )
    return tuple(arr.tolist())


@dataclass(frozen=True)
class Problem:
    """A validated multiple-choice knapsack.

    Attributes:
        nbytes: per layer, the bytes of each choice (whole numbers >= 0).
        variance: per layer, the added gradient variance of each choice (finite, >= 0);
            the same shape as ``nbytes``. Layers may have different numbers of choices.
        objective: what to minimise; the other quantity is constrained.
        budget_bytes: the byte budget (> 0); required for, and only for, VARIANCE mode.
        variance_bound: the variance bound (>= 0); required for, and only for, BYTES mode.

    Rows may be given as any sequences or 1-D arrays; they are stored as tuples.
    """

    nbytes: Sequence[Sequence[int]]
    variance: Sequence[Sequence[float]]
    objective: Objective = Objective.VARIANCE
    budget_bytes: int | None = None
    variance_bound: float | None = None
    _f: FloatArray = field(init=False, repr=False, compare=False)
    _g: FloatArray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            objective = Objective(self.objective)
        except ValueError:
            raise ConfigError(
                f"Problem.objective = {self.objective!r}; allowed: {[o.value for o in Objective]}"
            ) from None
        if len(self.nbytes) != len(self.variance):
            raise ConfigError(
                f"Problem.nbytes has {len(self.nbytes)} layers but Problem.variance has "
                f"{len(self.variance)}; give one row per layer in both"
            )
        nb = tuple(_as_int_row(r, f"Problem.nbytes[{i}]") for i, r in enumerate(self.nbytes))
        var = tuple(_as_float_row(r, f"Problem.variance[{i}]") for i, r in enumerate(self.variance))
        for i, (a, b) in enumerate(zip(nb, var, strict=True)):
            if len(a) != len(b):
                raise ConfigError(
                    f"layer {i} has {len(a)} choices in Problem.nbytes but {len(b)} in "
                    "Problem.variance; both rows must list the same choices"
                )
        budget, bound = self.budget_bytes, self.variance_bound
        if objective is Objective.VARIANCE:
            if bound is not None:
                raise ConfigError(
                    f"Problem.variance_bound = {bound!r} is only used with objective='bytes'; "
                    "leave it None for objective='variance'"
                )
            if isinstance(budget, bool) or not isinstance(budget, int | np.integer) or budget <= 0:
                raise ConfigError(
                    f"Problem.budget_bytes = {budget!r}; objective='variance' needs a whole "
                    "number of bytes > 0"
                )
            budget = int(budget)
        else:
            if budget is not None:
                raise ConfigError(
                    f"Problem.budget_bytes = {budget!r} is only used with objective='variance'; "
                    "leave it None for objective='bytes'"
                )
            if (isinstance(bound, bool) or not isinstance(bound, int | float | np.floating)
                    or not math.isfinite(bound) or bound < 0):
                raise ConfigError(
                    f"Problem.variance_bound = {bound!r}; objective='bytes' needs a finite "
                    "number >= 0"
                )
            bound = float(bound)
        width = max((len(r) for r in nb), default=1)
        byte_arr = np.full((len(nb), width), np.inf)
        var_arr = np.full((len(nb), width), np.inf)
        for i, (a, b) in enumerate(zip(nb, var, strict=True)):
            byte_arr[i, : len(a)] = a
            var_arr[i, : len(b)] = b
        f, g = (var_arr, byte_arr) if objective is Objective.VARIANCE else (byte_arr, var_arr)
        for name, value in (("nbytes", nb), ("variance", var), ("objective", objective),
                            ("budget_bytes", budget), ("variance_bound", bound),
                            ("_f", f), ("_g", g)):
            object.__setattr__(self, name, value)

    @property
    def n_layers(self) -> int:
        return len(self.nbytes)

    @property
    def capacity(self) -> float:
        """The constrained total: the byte budget or the variance bound."""
        if self.objective is Objective.VARIANCE:
            assert self.budget_bytes is not None
            return float(self.budget_bytes)
        assert self.variance_bound is not None
        return self.variance_bound

    def totals(self, choice: Sequence[int]) -> tuple[int, float]:
        """Exact total bytes and (correctly rounded) total variance of an assignment."""
        total_bytes = sum(row[k] for row, k in zip(self.nbytes, choice, strict=True))
        total_var = math.fsum(row[k] for row, k in zip(self.variance, choice, strict=True))
        return total_bytes, total_var

    def is_feasible(self, choice: Sequence[int]) -> bool:
        """Whether an assignment meets the constraint (variance with :data:`VARIANCE_RTOL`)."""
        total_bytes, total_var = self.totals(choice)
        if self.objective is Objective.VARIANCE:
            assert self.budget_bytes is not None
            return total_bytes <= self.budget_bytes
        assert self.variance_bound is not None
        return total_var <= self.variance_bound * (1.0 + VARIANCE_RTOL)


@dataclass(frozen=True)
class Allocation:
    """The answer to a :class:`Problem`.

    Attributes:
        choice: the chosen index per layer.
        objective: the minimised total (variance, or bytes as a float).
        total_bytes, total_variance: totals of the assignment, computed exactly.
        feasible: whether the constraint holds; ``False`` only for an infeasible problem,
            whose answer is then the least-constrained assignment (cheapest in VARIANCE
            mode, most precise in BYTES mode).
        solver: ``"dp"``, ``"milp"``, ``"greedy"`` (the fallback) or ``"trivial"`` (no
            search needed); see :class:`Solver`.
        status: what happened, in words (solver message, fallback reason, repair).
        time_s: wall time of the solve.
    """

    choice: tuple[int, ...]
    objective: float
    total_bytes: int
    total_variance: float
    feasible: bool
    solver: Solver
    status: str
    time_s: float


def _answer(problem: Problem, choice: IntArray | Sequence[int], solver: Solver, status: str,
            t0: float) -> Allocation:
    picked = tuple(int(k) for k in choice)
    total_bytes, total_var = problem.totals(picked)
    objective = total_var if problem.objective is Objective.VARIANCE else float(total_bytes)
    return Allocation(picked, objective, total_bytes, total_var, problem.is_feasible(picked),
                      solver, status, time.perf_counter() - t0)


def _objective_of(problem: Problem, choice: IntArray) -> float:
    total_bytes, total_var = problem.totals(choice.tolist())
    return total_var if problem.objective is Objective.VARIANCE else float(total_bytes)


def _trivial(problem: Problem, t0: float) -> Allocation | None:
    """The answer when no search is needed (infeasible, or the unconstrained optimum fits)."""
    f, g = problem._f, problem._g
    start = _greedy.min_g_choice(f, g)
    if not problem.is_feasible(start.tolist()):
        least = "cheapest" if problem.objective is Objective.VARIANCE else "most precise"
        total_bytes, total_var = problem.totals(start.tolist())
        used = total_bytes if problem.objective is Objective.VARIANCE else total_var
        return _answer(problem, start, Solver.TRIVIAL,
                       f"infeasible: even the {least} choices need {used!r} > "
                       f"{problem.capacity!r}; returned the {least} assignment", t0)
    best = _greedy.min_f_choice(f, g)
    if problem.is_feasible(best.tolist()):
        return _answer(problem, best, Solver.TRIVIAL, "optimal: the unconstrained optimum fits", t0)
    return None


def _feasible_or_repaired(problem: Problem, choice: IntArray) -> tuple[IntArray, bool]:
    """``choice``, or its repair when float rounding let it overshoot; and whether it fits."""
    if problem.is_feasible(choice.tolist()):
        return choice, True
    repaired = _greedy.repair(problem._f, problem._g, problem.capacity * (1.0 - 1e-12), choice)
    return repaired, problem.is_feasible(repaired.tolist())


def _greedy_choice(problem: Problem, keep: BoolArray | None = None,
                   segs: _greedy.Segments | None = None) -> IntArray:
    """The convex-hull greedy's answer, repaired if float rounding let it overshoot."""
    f, g = problem._f, problem._g
    if keep is None:
        keep = _greedy.candidates(f, g, problem.capacity)
    return _feasible_or_repaired(problem, _greedy.hull_greedy(f, g, problem.capacity, keep, segs))[0]


def solve_greedy(problem: Problem) -> Allocation:
    """Answer ``problem`` with the convex-hull greedy only (the fallback of :func:`solve`)."""
    t0 = time.perf_counter()
    trivial = _trivial(problem, t0)
    if trivial is not None:
        return trivial
    return _answer(problem, _greedy_choice(problem), Solver.GREEDY,
                   "greedy (convex-hull marginal utility)", t0)


def _check_options(time_limit_s: float, mip_rel_gap: float) -> None:
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, int | float) or not (
        math.isfinite(time_limit_s) and time_limit_s > 0
    ):
        raise ConfigError(f"time_limit_s = {time_limit_s!r}; give a finite number of seconds > 0")
    if isinstance(mip_rel_gap, bool) or not isinstance(mip_rel_gap, int | float) or not (
        0.0 <= mip_rel_gap < 1.0
    ):
        raise ConfigError(f"mip_rel_gap = {mip_rel_gap!r}; give a number in [0, 1), e.g. 1e-9")


def _fallback(problem: Problem, fallback: IntArray, fallback_solver: Solver, reason: str, t0: float, *,
              incumbent: IntArray | None = None, level: int = logging.WARNING) -> Allocation:
    """The fallback answer (or milp's incumbent when that is better), logged with ``reason``."""
    choice, solver = fallback, fallback_solver
    status = f"fallback to the {fallback_solver.value} answer: {reason}"
    if incumbent is not None and problem.is_feasible(incumbent.tolist()) and (
        _objective_of(problem, incumbent) < _objective_of(problem, fallback)
    ):
        choice, solver = incumbent, Solver.MILP
        status = f"milp incumbent, better than the {fallback_solver.value} answer: {reason}"
    _log.log(level, "bit allocation: %s (%d layers)", status, problem.n_layers)
    return _answer(problem, choice, solver, status, t0)


def solve(
    problem: Problem,
    *,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    mip_rel_gap: float = DEFAULT_MIP_REL_GAP,
    presolve: bool = True,
    method: Method | str = Method.AUTO,
) -> Allocation:
    """Solve ``problem`` exactly: the knapsack dynamic program, then ``scipy.optimize.milp``.

    The convex-hull greedy runs first: its answer is the first incumbent and the last
    fallback. With ``method="auto"`` the dynamic program of
    :mod:`memctl.allocation._dp` searches for the optimum (NOTE [ Solver defaults ]); when
    it finishes, its answer is optimal within ``mip_rel_gap``. When it stops early (its
    state budget or the time limit) or with ``method="milp"``, ``scipy.optimize.milp``
    (HiGHS) solves the model left after reduced-cost fixing against the best answer so
    far (NOTE [ Reduced-cost fixing ] in :mod:`memctl.allocation._greedy`).

    Args:
        problem: the validated knapsack.
        time_limit_s: wall-time budget of the whole solve in seconds (> 0).
        mip_rel_gap: accepted distance from the optimum, relative to the objective, in
            [0, 1); 0 asks for the optimum up to float rounding.
        presolve: whether HiGHS presolves the model.
        method: ``"auto"`` (the dynamic program, milp when it stops early) or ``"milp"``.

    Returns:
        An :class:`Allocation`. Every answer is checked against the unscaled data; one
        that overshoots by a float or solver tolerance is repaired. When milp raises,
        reports no solution, stops at the time limit (its incumbent is kept if it beats
        the best answer so far), or returns something malformed, the best answer so far
        is used; the reason is logged on ``memctl.allocation`` (INFO for the time limit,
        WARNING otherwise) and written into ``status``. Never raises for a valid problem.
    """
    _check_options(time_limit_s, mip_rel_gap)
    try:
        method = Method(method)
    except ValueError:
        raise ConfigError(f"method = {method!r}; allowed: {[m.value for m in Method]}") from None
    t0 = time.perf_counter()
    trivial = _trivial(problem, t0)
    if trivial is not None:
        return trivial
    f, g, cap = problem._f, problem._g, problem.capacity
    keep = _greedy.candidates(f, g, cap)
    segs = _greedy.segments(f, g, keep)
    best, best_solver = _greedy_choice(problem, keep, segs), Solver.GREEDY
    dp_note = ""
    if method is Method.AUTO:
        out = solve_dp(f, g, cap, keep, segs, best, gap=mip_rel_gap, deadline=t0 + time_limit_s)
        choice, fits = _feasible_or_repaired(problem, out.choice)
        if fits and _objective_of(problem, choice) < _objective_of(problem, best):
            best, best_solver = choice, Solver.DP
        summary = (f"{out.n_added} layers enumerated, {out.n_fixed} fixed by bounds, "
                   f"at most {out.peak_states} states")
        if out.proven and fits:
            repaired = "" if choice is out.choice else "; repaired a float overshoot"
            return _answer(problem, best, Solver.DP,
                           f"optimal within {mip_rel_gap:g} (dynamic program: {summary}){repaired}", t0)
        dp_note = f"dynamic program stopped early ({out.reason}; {summary}); "
        _log.info("bit allocation: %s(%d layers); trying milp", dp_note, problem.n_layers)
    from memctl.allocation._milp import solve_milp

    rows = np.arange(problem.n_layers)
    upper = float(f[rows, best].sum())
    core, _ = _greedy.lagrangian_core(f, g, cap, keep, upper, segs)
    core[rows, best] = True  # the best answer so far stays feasible for the MILP
    left = time_limit_s - (time.perf_counter() - t0)
    if left <= 0:
        return _fallback(problem, best, best_solver,
                         f"{dp_note}the {time_limit_s} s time limit was spent before the milp",
                         t0, level=logging.INFO)
    try:
        out_milp = solve_milp(f, g, cap, core, upper=upper, time_limit_s=left, mip_rel_gap=mip_rel_gap,
                              presolve=presolve)
    except Exception as exc:  # any solver failure must not stop training
        return _fallback(problem, best, best_solver, f"{dp_note}milp raised {type(exc).__name__}: {exc}", t0)
    if out_milp.choice is None:
        return _fallback(problem, best, best_solver,
                         f"{dp_note}milp status {out_milp.status} without a solution ({out_milp.message})",
                         t0, level=logging.INFO if out_milp.status == 1 else logging.WARNING)
    if not out_milp.success:
        reason = f"milp status {out_milp.status}, gap {out_milp.mip_gap} ({out_milp.message})"
        return _fallback(problem, best, best_solver, dp_note + reason, t0, incumbent=out_milp.choice,
                         level=logging.INFO if out_milp.status == 1 else logging.WARNING)
    n_core = int(np.count_nonzero(core.sum(axis=1) > 1))
    status = f"{dp_note}optimal ({out_milp.message}; {n_core} of {problem.n_layers} layers left to the milp)"
    choice, fits = _feasible_or_repaired(problem, out_milp.choice)
    if choice is not out_milp.choice:
        status += "; repaired an overshoot within the solver's tolerance"
        _log.info("bit allocation: milp answer overshot the constraint by the solver tolerance; repaired")
    if not fits:
        return _fallback(problem, best, best_solver, f"{dp_note}milp answer infeasible and repair failed", t0)
    if _objective_of(problem, best) < _objective_of(problem, choice):
        # Possible within mip_rel_gap: the answer so far is the better one, keep it.
        choice = best
        status += f"; the {best_solver.value} answer was better within the gap, kept it"
    if out_milp.solve_s > time_limit_s:
        status += f"; took {out_milp.solve_s:.3f} s, over the {time_limit_s} s limit"
        _log.info("bit allocation: milp took %.3f s, over its %.3f s limit", out_milp.solve_s, time_limit_s)
    return _answer(problem, choice, Solver.MILP, status, t0)
