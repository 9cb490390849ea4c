"""Bit allocation: the dynamic program and the MILP against brute force, fallbacks, the layer
builder, validation."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from memctl.allocation import (
    DEFAULT_MIP_REL_GAP,
    KEEP,
    VARIANCE_RTOL,
    Allocation,
    LayerSpec,
    Objective,
    Problem,
    Solver,
    _greedy,
    allocate,
    build_problem,
    solve,
    solve_greedy,
    uniform_bits,
)
from memctl.errors import ConfigError

LOGGER = "memctl.allocation"


# --------------------------------------------------------------------------- helpers


def brute_force(p: Problem) -> float | None:
    """The optimum by enumeration (None when nothing is feasible)."""
    sizes = [len(r) for r in p.nbytes]
    grid = np.indices(sizes).reshape(len(sizes), -1)
    total_b = np.zeros(grid.shape[1], dtype=np.int64)
    total_v = np.zeros(grid.shape[1])
    for layer, (b_row, v_row) in enumerate(zip(p.nbytes, p.variance, strict=True)):
        total_b += np.asarray(b_row, dtype=np.int64)[grid[layer]]
        total_v += np.asarray(v_row)[grid[layer]]
    if p.objective is Objective.VARIANCE:
        assert p.budget_bytes is not None
        ok, obj = total_b <= p.budget_bytes, total_v
    else:
        assert p.variance_bound is not None
        ok, obj = total_v <= p.variance_bound * (1 + VARIANCE_RTOL), total_b.astype(float)
    return float(obj[ok].min()) if ok.any() else None


def random_problem(rng: np.random.Generator, kind: int, objective: Objective) -> Problem:
    n_layers = int(rng.integers(1, 7))
    nbytes: list[list[int]] = []
    variance: list[list[float]] = []
    for _ in range(n_layers):
        k = int(rng.integers(2, 6))
        if kind == 0:  # small integers
            nbytes.append(rng.integers(0, 1000, k).tolist())
            variance.append(rng.random(k).tolist())
        elif kind == 1:  # realistic magnitudes: up to 10 GB, variances over 14 decades
            nbytes.append(rng.integers(0, 10**10, k).tolist())
            variance.append((10.0 ** rng.uniform(-10, 4, k)).tolist())
        else:  # many ties and duplicates
            nbytes.append(rng.integers(0, 20, k).tolist())
            variance.append(rng.integers(0, 5, k).astype(float).tolist())
    if objective is Objective.VARIANCE:
        lo, hi = sum(min(r) for r in nbytes), sum(max(r) for r in nbytes)
        budget = int(lo + rng.uniform(-0.1, 1.0) * (hi - lo))
        if rng.random() < 0.25:  # exactly the bytes of some assignment
            budget = sum(r[int(rng.integers(len(r)))] for r in nbytes)
        return Problem(nbytes, variance, Objective.VARIANCE, budget_bytes=max(budget, 1))
    vlo, vhi = sum(min(r) for r in variance), sum(max(r) for r in variance)
    bound = max(vlo + rng.uniform(-0.1, 1.0) * (vhi - vlo), 0.0)
    if rng.random() < 0.25:
        bound = math.fsum(r[int(rng.integers(len(r)))] for r in variance)
    return Problem(nbytes, variance, Objective.BYTES, variance_bound=bound)


def packed(numel: int, bits: int) -> int:
    """A packed size like the quantize codec's: payload plus 4 bytes per 256-value group."""
    return -(-numel * bits // 8) + 4 * -(-numel // 256)


SLACK_S = 30.0
"""The time limit of solves whose answer a test compares with the optimum: the default (0.1 s)
is a training step's budget, and on a loaded machine HiGHS then stops at an incumbent
(which the solver reports, and which such a test would take for a wrong answer)."""


def cases(n: int) -> list[tuple[int, Objective, int]]:
    return [(seed, obj, seed % 3) for seed in range(n) for obj in Objective]


def check_answer(p: Problem, a: Allocation) -> None:
    assert len(a.choice) == p.n_layers
    assert all(0 <= k < len(r) for k, r in zip(a.choice, p.nbytes, strict=True))
    total_b, total_v = p.totals(a.choice)
    assert a.total_bytes == total_b
    assert a.total_variance == total_v
    assert a.objective == (total_v if p.objective is Objective.VARIANCE else float(total_b))
    assert a.feasible == p.is_feasible(a.choice)
    assert a.time_s >= 0


def instance_needing_search(seed: int = 0) -> Problem:
    """A 12-layer problem whose greedy answer is not optimal (so the MILP path runs)."""
    rng = np.random.default_rng(seed)
    for _ in range(500):
        nbytes = rng.integers(1, 1000, (12, 4)).tolist()
        variance = rng.random((12, 4)).tolist()
        budget = int(sum(min(r) for r in nbytes) + 0.4 * sum(max(r) - min(r) for r in nbytes))
        p = Problem(nbytes, variance, budget_bytes=budget)
        if solve_greedy(p).objective > solve(p, time_limit_s=SLACK_S).objective * (1 + 1e-6):
            return p
    raise AssertionError("no instance where the greedy is suboptimal")


# --------------------------------------------------------------------------- exactness



@pytest.mark.parametrize(("method", "solver"), [("auto", Solver.DP), ("milp", Solver.MILP)])
@pytest.mark.parametrize("chunk", range(4))
def test_solvers_match_brute_force(chunk: int, method: str, solver: Solver) -> None:
    for seed, objective, kind in cases(1000)[chunk::4]:
        p = random_problem(np.random.default_rng(seed), kind, objective)
        best = brute_force(p)
        a = solve(p, method=method, mip_rel_gap=0.0, time_limit_s=SLACK_S)
        check_answer(p, a)
        if best is None:
            assert not a.feasible, (seed, objective, a)
            assert a.solver is Solver.TRIVIAL
            continue
        assert a.feasible, (seed, objective, a)
        assert a.solver in (solver, Solver.TRIVIAL), a.status
        assert abs(a.objective - best) <= 1e-9 * abs(best), (seed, objective, kind, a, best)


def test_default_gap_holds_against_brute_force() -> None:
    for seed, objective, kind in cases(300):
        p = random_problem(np.random.default_rng(seed), kind, objective)
        best = brute_force(p)
        a = solve(p, time_limit_s=SLACK_S)
        if best is not None:
            assert a.feasible, (seed, a)
            assert a.objective <= best + DEFAULT_MIP_REL_GAP * abs(a.objective), (seed, a, best)


def network_problem(rng: np.random.Generator, objective: Objective) -> Problem:
    """A 30-80 layer network: sizes and sensitivities spread, or repeated like a stack of blocks."""
    n = int(rng.integers(30, 80))
    numel = np.exp(rng.uniform(math.log(4096), math.log(1e6), n)).astype(int)
    sens = 10.0 ** rng.uniform(-4, 2, n)
    if rng.random() < 0.5:  # repeated blocks: a few distinct layers, many copies
        numel, sens = numel[np.arange(n) % 4], sens[np.arange(n) % 4]
    layers = [LayerSpec(f"l{i}", float(c), int(m), 4 * int(m))
              for i, (c, m) in enumerate(zip(sens, numel, strict=True))]
    budget = sum(packed(s.numel, 1) for s in layers)
    budget += int(rng.uniform(0.05, 0.9) * sum(4 * s.numel - packed(s.numel, 1) for s in layers))
    p = build_problem(layers, budget, size_fn=packed).problem
    if objective is Objective.VARIANCE:
        return p
    bound = math.fsum(r[1] for r in p.variance) * rng.uniform(0.05, 1.0)
    return Problem(p.nbytes, p.variance, Objective.BYTES, variance_bound=bound)


@pytest.mark.parametrize("objective", list(Objective))
def test_dynamic_program_matches_milp_on_networks(objective: Objective) -> None:
    rng = np.random.default_rng(11)
    for _ in range(12):
        p = network_problem(rng, objective)
        dp = solve(p, mip_rel_gap=0.0, time_limit_s=30)
        ref = solve(p, method="milp", mip_rel_gap=1e-9, time_limit_s=30)
        assert dp.feasible and dp.solver in (Solver.DP, Solver.TRIVIAL), dp.status
        assert dp.objective <= ref.objective * (1 + 1e-9), (dp.status, ref.status)
        assert ref.objective <= dp.objective * (1 + 1e-7), (dp.status, ref.status)


def test_gap_is_honoured() -> None:
    rng = np.random.default_rng(5)
    for _ in range(6):
        p = network_problem(rng, Objective.VARIANCE)
        exact = solve(p, mip_rel_gap=0.0, time_limit_s=30).objective
        loose = solve(p, mip_rel_gap=1e-2, time_limit_s=30)
        assert loose.feasible and exact <= loose.objective <= exact / (1 - 1e-2)


@pytest.mark.parametrize("chunk", range(2))
def test_greedy_is_feasible_whenever_anything_is(chunk: int) -> None:
    for seed, objective, kind in cases(400)[chunk::2]:
        p = random_problem(np.random.default_rng(seed), kind, objective)
        best = brute_force(p)
        a = solve_greedy(p)
        check_answer(p, a)
        assert a.feasible == (best is not None), (seed, objective, a)
        if best is not None:
            assert a.objective >= best * (1 - 1e-12)


def test_infeasible_budget_returns_cheapest_assignment() -> None:
    p = Problem([[10, 20], [5, 3, 8]], [[1.0, 0.5], [0.1, 0.2, 0.0]], budget_bytes=12)
    a = solve(p)
    assert not a.feasible
    assert a.choice == (0, 1)
    assert a.total_bytes == 13
    assert "infeasible" in a.status


def test_infeasible_bound_returns_most_precise_assignment() -> None:
    p = Problem([[10, 20], [5, 3, 8]], [[1.0, 0.5], [0.1, 0.2, 0.05]], Objective.BYTES,
                variance_bound=0.5)
    a = solve(p)
    assert not a.feasible
    assert a.choice == (1, 2)
    assert a.total_variance == pytest.approx(0.55)


def test_zero_bound_needs_zero_variance_choices() -> None:
    p = Problem([[1, 4], [2, 9]], [[3.0, 0.0], [1.0, 0.0]], Objective.BYTES, variance_bound=0.0)
    a = solve(p)
    assert a.feasible and a.choice == (1, 1) and a.objective == 13.0


def test_empty_problem() -> None:
    a = solve(Problem([], [], budget_bytes=1))
    assert a.choice == () and a.feasible and a.total_bytes == 0


def test_realistic_problem_is_feasible_and_no_worse_than_greedy() -> None:
    rng = np.random.default_rng(7)
    numel = np.exp(rng.uniform(math.log(1e3), math.log(1e7), 150)).astype(int)
    layers = [LayerSpec(f"l{i}", float(10.0 ** rng.uniform(-6, 2)), int(n), int(n) * 4)
              for i, n in enumerate(numel)]
    budget = sum(packed(s.numel, 2) for s in layers)
    p = build_problem(layers, budget, size_fn=packed).problem
    a, g = solve(p), solve_greedy(p)
    assert a.feasible and a.total_bytes <= budget
    assert a.objective <= g.objective
    assert a.solver in (Solver.DP, Solver.MILP, Solver.GREEDY)


# --------------------------------------------------------------------------- fallback


def _fake_milp(monkeypatch: pytest.MonkeyPatch, behave: Callable[..., Any]) -> list[int]:
    import scipy.optimize

    calls: list[int] = []

    def fake(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return behave(*args, **kwargs)

    monkeypatch.setattr(scipy.optimize, "milp", fake)
    return calls


def _raise(*_: Any, **__: Any) -> Any:
    raise RuntimeError("solver exploded")


def _no_solution(status: int, message: str) -> Callable[..., Any]:
    def behave(*_: Any, **__: Any) -> Any:
        from scipy.optimize import OptimizeResult

        return OptimizeResult(status=status, success=False, x=None, message=message, mip_gap=None)

    return behave


def _malformed(*_: Any, **__: Any) -> Any:
    from scipy.optimize import OptimizeResult

    return OptimizeResult(status=0, success=True, x=np.zeros(3), message="ok", mip_gap=0.0)


@pytest.mark.parametrize(
    ("behave", "reason", "level"),
    [
        (_raise, "RuntimeError: solver exploded", logging.WARNING),
        (_no_solution(4, "HiGHS lost its way"), "HiGHS lost its way", logging.WARNING),
        (_no_solution(2, "infeasible"), "status 2", logging.WARNING),
        (_no_solution(1, "Time limit reached"), "Time limit reached", logging.INFO),
        (_malformed, "malformed", logging.WARNING),
    ],
)
def test_fallback_is_used_logged_and_feasible(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    behave: Callable[..., Any], reason: str, level: int,
) -> None:
    p = instance_needing_search()
    expected = solve_greedy(p)
    calls = _fake_milp(monkeypatch, behave)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        a = solve(p, method="milp")
    assert calls, "the MILP was not called"
    assert a.solver is Solver.GREEDY
    assert a.feasible and a.total_bytes <= (p.budget_bytes or 0)
    assert a.choice == expected.choice
    assert reason in a.status and "fallback" in a.status
    records = [r for r in caplog.records if r.name == LOGGER and reason in r.getMessage()]
    assert records and records[0].levelno == level


def test_time_limit_keeps_a_better_incumbent(monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    import scipy.optimize

    p = instance_needing_search()
    optimum = solve(p, time_limit_s=SLACK_S)
    real = scipy.optimize.milp

    def stopped(*args: Any, **kwargs: Any) -> Any:
        res = real(*args, **kwargs)
        res.status, res.success, res.message = 1, False, "Time limit reached"
        return res

    _fake_milp(monkeypatch, stopped)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        a = solve(p, method="milp")
    assert a.solver is Solver.MILP and "incumbent" in a.status
    assert a.objective == pytest.approx(optimum.objective, rel=1e-9)
    assert a.objective < solve_greedy(p).objective
    assert any("Time limit reached" in r.getMessage() for r in caplog.records if r.name == LOGGER)


@pytest.mark.parametrize("method", ["auto", "milp"])
def test_tiny_time_limit_falls_back(caplog: pytest.LogCaptureFixture, method: str) -> None:
    p = instance_needing_search()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        a = solve(p, time_limit_s=1e-9, method=method)
    assert a.solver in (Solver.GREEDY, Solver.DP) and a.feasible
    assert "time limit" in a.status and "fallback" in a.status
    assert a.objective <= solve_greedy(p).objective
    assert any(r.name == LOGGER for r in caplog.records)


def test_dynamic_program_that_stops_early_hands_over_to_milp(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    from memctl.allocation import _dp

    p = instance_needing_search()
    optimum = solve(p, method="milp", mip_rel_gap=0.0, time_limit_s=SLACK_S)
    monkeypatch.setattr(_dp, "MAX_STATES", 0)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        a = solve(p, mip_rel_gap=0.0, time_limit_s=SLACK_S)
    assert a.solver is Solver.MILP and "state budget" in a.status, a.status
    assert a.objective == pytest.approx(optimum.objective, rel=1e-9)
    assert any("stopped early" in r.getMessage() for r in caplog.records if r.name == LOGGER)
    # ... and when milp then fails too, the best answer so far is kept.
    _fake_milp(monkeypatch, _raise)
    b = solve(p, mip_rel_gap=0.0)
    assert b.solver in (Solver.DP, Solver.GREEDY) and b.feasible and "exploded" in b.status
    assert b.objective <= solve_greedy(p).objective


def test_solver_not_called_when_unconstrained_optimum_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_milp(monkeypatch, _raise)
    a = solve(Problem([[1, 2], [3, 4]], [[1.0, 0.0], [2.0, 0.0]], budget_bytes=100))
    assert not calls and a.solver is Solver.TRIVIAL and a.choice == (1, 1)


# --------------------------------------------------------------------------- helpers of the greedy


def test_hull_mask_matches_definition() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        k = int(rng.integers(1, 7))
        f = rng.integers(0, 8, (1, k)).astype(float)
        g = rng.integers(0, 8, (1, k)).astype(float)
        keep = _greedy.undominated(f, g)
        got = _greedy.hull_mask(f, g, keep)[0]
        idx = np.nonzero(keep[0])[0]
        for j in range(k):
            # On the lower hull: kept, and strictly below every chord between kept neighbours.
            expect = bool(keep[0, j]) and not any(
                g[0, a] < g[0, j] < g[0, b]
                and (f[0, j] - f[0, a]) * (g[0, b] - g[0, a]) >= (f[0, b] - f[0, a]) * (g[0, j] - g[0, a])
                for a in idx for b in idx
            )
            assert got[j] == expect, (f, g, keep, got)


# --------------------------------------------------------------------------- layers


def layer_set(rng: np.random.Generator, n: int) -> list[LayerSpec]:
    return [LayerSpec(f"layer{i}", float(10.0 ** rng.uniform(-3, 3)), int(rng.integers(100, 5000)), 0)
            for i in range(n)]


def test_build_problem_rows() -> None:
    seen: list[tuple[int, int]] = []

    def size_fn(numel: int, bits: int) -> int:
        seen.append((numel, bits))
        return numel * bits // 8

    built = build_problem([LayerSpec("a", 9.0, 64, 256)], 10, size_fn=size_fn, choices=(4, 2))
    assert built.names == ("a",)
    assert built.bits == (2, 4, KEEP)
    assert built.problem.nbytes == ((16, 32, 256),)
    assert len(built.problem.variance) == 1
    assert list(built.problem.variance[0]) == pytest.approx([1.0, 9.0 / 225.0, 0.0])
    assert sorted(seen) == [(64, 2), (64, 4)]
    no_keep = build_problem([LayerSpec("a", 9.0, 64, 256)], 10, size_fn=size_fn, keep=False)
    assert no_keep.bits == (1, 2, 4, 8) and len(no_keep.problem.nbytes[0]) == 4


def test_sensitive_layer_gets_at_least_as_many_bits() -> None:
    rng = np.random.default_rng(11)
    for trial in range(30):
        n = int(rng.integers(2000, 100_000))
        layers = [LayerSpec("hot", 1000.0, n, 4 * n), LayerSpec("cold", 1.0, n, 4 * n),
                  *layer_set(rng, int(rng.integers(0, 5)))]
        budget = int(sum(packed(s.numel, 1) for s in layers) * rng.uniform(1.0, 6.0))
        out = allocate(layers, budget, size_fn=packed)
        assert out.feasible and out.total_bytes <= budget
        assert out.bits["hot"] >= out.bits["cold"], (trial, dict(out.bits))


def test_larger_budget_never_worse() -> None:
    rng = np.random.default_rng(5)
    layers = layer_set(rng, 14)
    lo = sum(packed(s.numel, 1) for s in layers)
    previous = math.inf
    for budget in np.linspace(lo, lo * 10, 25).astype(int):
        out = allocate(layers, int(budget), size_fn=packed, keep=False, mip_rel_gap=1e-9)
        assert out.feasible and out.total_bytes <= budget
        assert out.allocation.objective <= previous * (1 + 1e-9)
        previous = out.allocation.objective


def test_allocate_maps_names_to_bits_and_keep() -> None:
    layers = [LayerSpec("a", 5.0, 1000, 4000), LayerSpec("b", 0.0, 1000, 4000)]
    out = allocate(layers, 10**9, size_fn=packed)
    assert dict(out.bits) == {"a": KEEP, "b": 1}  # ample budget: keep what matters, 1 bit for the rest
    with pytest.raises(TypeError):
        out.bits["a"] = 2  # type: ignore[index]
    assert out.allocation.solver is Solver.TRIVIAL


def test_allocate_bytes_objective_matches_brute_force() -> None:
    rng = np.random.default_rng(2)
    for _ in range(20):
        layers = layer_set(rng, 4)
        built = build_problem(layers, None, size_fn=packed, objective="bytes", variance_bound=1.0)
        bound = float(rng.uniform(0.1, 2.0)) * sum(row[1] for row in built.problem.variance)
        out = allocate(layers, None, size_fn=packed, objective=Objective.BYTES, variance_bound=bound)
        p = Problem(built.problem.nbytes, built.problem.variance, Objective.BYTES, variance_bound=bound)
        best = brute_force(p)
        assert best is not None and out.feasible
        assert out.total_variance <= bound * (1 + VARIANCE_RTOL)
        assert out.total_bytes == best


def test_uniform_bits_holds_the_average() -> None:
    rng = np.random.default_rng(9)
    layers = layer_set(rng, 10)
    for avg in (2, 4):
        out = uniform_bits(layers, avg, size_fn=packed, keep=False)
        uniform_var = sum(s.sensitivity / (2**avg - 1) ** 2 for s in layers)
        assert out.feasible
        assert out.total_bytes <= sum(packed(s.numel, avg) for s in layers)
        assert out.total_variance <= uniform_var * (1 + 1e-6)
    out = uniform_bits(layers, 3.0, size_fn=packed, keep=False)
    cap = sum(packed(s.numel, 2) + (packed(s.numel, 4) - packed(s.numel, 2)) // 2 for s in layers)
    assert out.feasible and out.total_bytes <= cap
    assert out.total_bytes > sum(packed(s.numel, 2) for s in layers)
    assert set(out.bits.values()) <= {1, 2, 4, 8}


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"nbytes": [[1, -5]], "variance": [[0.0, 0.0]], "budget_bytes": 1}, "-5"),
        ({"nbytes": [[1, 2.5]], "variance": [[0.0, 0.0]], "budget_bytes": 1}, "float64"),
        ({"nbytes": [[1, 2]], "variance": [[0.0, float("nan")]], "budget_bytes": 1}, "nan"),
        ({"nbytes": [[1, 2]], "variance": [[0.0, -1.0]], "budget_bytes": 1}, "-1.0"),
        ({"nbytes": [[1, 2]], "variance": [[0.0]], "budget_bytes": 1}, "2 choices"),
        ({"nbytes": [[1]], "variance": [[0.0], [1.0]], "budget_bytes": 1}, "1 layers"),
        ({"nbytes": [[]], "variance": [[]], "budget_bytes": 1}, "non-empty"),
        ({"nbytes": [[1]], "variance": [[0.0]], "budget_bytes": 0}, "budget_bytes = 0"),
        ({"nbytes": [[1]], "variance": [[0.0]], "budget_bytes": 2.5}, "budget_bytes = 2.5"),
        ({"nbytes": [[1]], "variance": [[0.0]], "budget_bytes": 1, "variance_bound": 1.0},
         "variance_bound = 1.0"),
        ({"nbytes": [[1]], "variance": [[0.0]], "objective": "bytes", "variance_bound": -1.0},
         "variance_bound = -1.0"),
        ({"nbytes": [[1]], "variance": [[0.0]], "objective": "bytes", "variance_bound": 1.0,
          "budget_bytes": 5}, "budget_bytes = 5"),
        ({"nbytes": [[1]], "variance": [[0.0]], "objective": "speed", "budget_bytes": 1}, "'speed'"),
    ],
)
def test_problem_validation_names_the_value(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        Problem(**kwargs)
    assert needle in str(info.value)


def test_solve_option_validation() -> None:
    p = Problem([[1]], [[0.0]], budget_bytes=1)
    with pytest.raises(ConfigError, match="time_limit_s = 0"):
        solve(p, time_limit_s=0)
    with pytest.raises(ConfigError, match=r"mip_rel_gap = 1\.5"):
        solve(p, mip_rel_gap=1.5)
    with pytest.raises(ConfigError, match=r"method = 'simplex'.*'auto'"):
        solve(p, method="simplex")


def test_layer_validation_names_the_value() -> None:
    with pytest.raises(ConfigError, match=r"sensitivity = -1\.0"):
        LayerSpec("a", -1.0, 1, 1)
    with pytest.raises(ConfigError, match=r"numel = 2\.5"):
        LayerSpec("a", 1.0, 2.5, 1)  # type: ignore[arg-type]
    good = LayerSpec("a", 1.0, 10, 40)
    with pytest.raises(ConfigError, match="'a' appears more than once"):
        build_problem([good, good], 10, size_fn=packed)
    for bad in ((), (0, 2), (2, 17), (True,), (2, 2)):
        with pytest.raises(ConfigError, match="choices"):
            build_problem([good], 10, size_fn=packed, choices=bad)
    with pytest.raises(ConfigError, match=r"size_fn\(10, 1\) returned -3"):
        build_problem([good], 10, size_fn=lambda n, b: -3)
    with pytest.raises(ConfigError, match=r"returned 1\.5"):
        build_problem([good], 10, size_fn=lambda n, b: 1.5)  # type: ignore[arg-type,return-value]
    with pytest.raises(ConfigError, match="avg_bits = 9"):
        uniform_bits([good], 9, size_fn=packed)
    with pytest.raises(ConfigError, match="budget_bytes = None"):
        allocate([good], None, size_fn=packed)
