"""Bit allocation: how many bits each layer's saved activations get (docs/design.md, "The allocation").

A multiple-choice knapsack, independent of models and hooks: :mod:`~memctl.allocation.knapsack`
holds the generic problem, its answer and :func:`solve` (an exact dynamic program in
``_dp``, ``scipy.optimize.milp`` in ``_milp``, the convex-hull greedy in ``_greedy``);
:mod:`~memctl.allocation.layers` builds the problem from per-layer sensitivities and sizes.
The controller's policy (:mod:`memctl.controller.policy`) is its only caller in memctl.
"""

from memctl.allocation.knapsack import (
    DEFAULT_MIP_REL_GAP,
    DEFAULT_TIME_LIMIT_S,
    VARIANCE_RTOL,
    Allocation,
    Method,
    Objective,
    Problem,
    Solver,
    solve,
    solve_greedy,
)
from memctl.allocation.layers import (
    DEFAULT_CHOICES,
    KEEP,
    MAX_BITS,
    BuiltProblem,
    LayerAllocation,
    LayerInfo,
    LayerSpec,
    SizeFn,
    allocate,
    build_problem,
    uniform_bits,
)

__all__ = [
    "DEFAULT_CHOICES",
    "DEFAULT_MIP_REL_GAP",
    "DEFAULT_TIME_LIMIT_S",
    "KEEP",
    "MAX_BITS",
    "VARIANCE_RTOL",
    "Allocation",
    "BuiltProblem",
    "LayerAllocation",
    "LayerInfo",
    "LayerSpec",
    "Method",
    "Objective",
    "Problem",
    "SizeFn",
    "Solver",
    "allocate",
    "build_problem",
    "solve",
    "solve_greedy",
    "uniform_bits",
]
