"""The layers' view of the allocation: per-layer sensitivities and sizes to a knapsack and back.

The controller describes every layer by its sensitivity ``C_l`` (ActNN), the number of
values it saves per step and their uncompressed size. Compressing layer ``l`` at ``b``
bits adds about ``C_l / (2^b - 1)^2`` to the gradient variance and costs the codec's
packed size; keeping it costs its raw bytes and adds nothing. :func:`build_problem` turns
that into a :class:`~memctl.allocation.knapsack.Problem`, :func:`allocate` solves it and
maps the answer back to bits per layer; :func:`uniform_bits` is the uniform baseline.
See docs/design.md, "The allocation".
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final, Protocol

from memctl.allocation.knapsack import (
    DEFAULT_MIP_REL_GAP,
    DEFAULT_TIME_LIMIT_S,
    Allocation,
    Method,
    Objective,
    Problem,
    solve,
)
from memctl.errors import ConfigError

__all__ = [
    "DEFAULT_CHOICES",
    "KEEP",
    "MAX_BITS",
    "BuiltProblem",
    "LayerAllocation",
    "LayerInfo",
    "LayerSpec",
    "SizeFn",
    "allocate",
    "build_problem",
    "uniform_bits",
]

#: The "bits" reported for a layer that is kept uncompressed (whatever its dtype).
KEEP: Final = 32
#: The largest bit width a choice may name (below :data:`KEEP`, so the two never clash).
MAX_BITS: Final = 16
#: Bit widths offered when the caller gives none (ActNN's set, docs/design.md, "The allocation").
DEFAULT_CHOICES: Final = (1, 2, 4, 8)

#: ``size_fn(numel, bits) -> bytes``: the exact packed size of ``numel`` values at ``bits``.
SizeFn = Callable[[int, int], int]


class LayerInfo(Protocol):
    """What the allocation needs to know about a layer (:class:`LayerSpec` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def sensitivity(self) -> float: ...

    @property
    def numel(self) -> int: ...

    @property
    def raw_nbytes(self) -> int: ...


def _check_layer(layer: LayerInfo, where: str) -> tuple[str, float, int, int]:
    name, c, numel, raw = layer.name, layer.sensitivity, layer.numel, layer.raw_nbytes
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name = {name!r}; give a non-empty string")
    if isinstance(c, bool) or not isinstance(c, numbers.Real) or not math.isfinite(c) or c < 0:
        raise ConfigError(f"{where} ({name!r}).sensitivity = {c!r}; give a finite number >= 0")
    counts = []
    for field_name, value in (("numel", numel), ("raw_nbytes", raw)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ConfigError(f"{where} ({name!r}).{field_name} = {value!r}; give a whole number >= 0")
        counts.append(int(value))
    return name, float(c), counts[0], counts[1]


@dataclass(frozen=True)
class LayerSpec:
    """One layer as the allocation sees it.

    Attributes:
        name: unique layer name (e.g. the module's qualified name).
        sensitivity: ActNN's ``C_l >= 0``; the layer's extra gradient variance at ``b``
            bits is ``C_l / (2^b - 1)^2``.
        numel: values the layer saves per step.
        raw_nbytes: bytes of those values kept uncompressed.
    """

    name: str
    sensitivity: float
    numel: int
    raw_nbytes: int

    def __post_init__(self) -> None:
        _check_layer(self, "LayerSpec")


def _check_choices(choices: Sequence[int]) -> tuple[int, ...]:
    bits = tuple(choices)
    if not bits:
        raise ConfigError(f"choices = {choices!r} is empty; give bit widths such as {DEFAULT_CHOICES}")
    for b in bits:
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= MAX_BITS:
            raise ConfigError(
                f"choices = {choices!r} holds {b!r}; every choice must be a whole number of "
                f"bits in [1, {MAX_BITS}] (use keep=True for uncompressed)"
            )
    if len(set(bits)) != len(bits):
        raise ConfigError(f"choices = {choices!r} repeats a bit width; list each once")
    return tuple(sorted(bits))


def _size(size_fn: SizeFn, numel: int, bits: int, name: str) -> int:
    value = size_fn(numel, bits)
    try:
        n = operator.index(value)
    except TypeError:
        n = -1
    if isinstance(value, bool) or n < 0:
        raise ConfigError(
            f"size_fn({numel}, {bits}) returned {value!r} for layer {name!r}; it must return "
            "a whole number of bytes >= 0"
        )
    return n


@dataclass(frozen=True)
class BuiltProblem:
    """A :class:`Problem` built from layers, with what its rows and choices mean.

    Attributes:
        problem: the knapsack; row ``i`` is layer ``names[i]``.
        names: layer names, in the order given.
        bits: what choice ``k`` means, the same for every layer: a bit width, or
            :data:`KEEP` for the uncompressed tensor.
    """

    problem: Problem
    names: tuple[str, ...]
    bits: tuple[int, ...]


def build_problem(
    layers: Sequence[LayerInfo],
    budget_bytes: int | None,
    *,
    size_fn: SizeFn,
    choices: Sequence[int] = DEFAULT_CHOICES,
    keep: bool = True,
    objective: Objective | str = Objective.VARIANCE,
    variance_bound: float | None = None,
) -> BuiltProblem:
    """The knapsack for ``layers`` (ActNN's mixed-precision problem, docs/design.md, "The problem").

    For each layer and bit width ``b`` in ``choices``: bytes ``size_fn(numel, b)`` (the
    controller passes the quantize codec's exact packed size) and variance
    ``sensitivity / (2^b - 1)^2``; with ``keep``, one more choice costs ``raw_nbytes``
    and adds no variance. ``budget_bytes`` is required for ``objective="variance"`` and
    must be ``None`` for ``objective="bytes"``, which needs ``variance_bound`` instead.
    """
    bits = _check_choices(choices)
    names: list[str] = []
    nbytes: list[list[int]] = []
    variance: list[list[float]] = []
    for i, layer in enumerate(layers):
        name, c, numel, raw = _check_layer(layer, f"layers[{i}]")
        names.append(name)
        nbytes.append([_size(size_fn, numel, b, name) for b in bits] + ([raw] if keep else []))
        variance.append([c / float((1 << b) - 1) ** 2 for b in bits] + ([0.0] if keep else []))
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ConfigError(f"layer name {dup!r} appears more than once; layer names must be unique")
    problem = Problem(nbytes, variance, Objective(objective), budget_bytes=budget_bytes,
                      variance_bound=variance_bound)
    return BuiltProblem(problem, tuple(names), bits + ((KEEP,) if keep else ()))


@dataclass(frozen=True)
class LayerAllocation:
    """Bits per layer, with the knapsack answer they came from.

    Attributes:
        bits: layer name -> bit width (:data:`KEEP` for uncompressed), read-only.
        allocation: the generic answer (choice indices, totals, solver, status, time).
        built: the problem that was solved.
    """

    bits: Mapping[str, int] = field(hash=False)
    allocation: Allocation
    built: BuiltProblem = field(repr=False)

    @property
    def total_bytes(self) -> int:
        return self.allocation.total_bytes

    @property
    def total_variance(self) -> float:
        return self.allocation.total_variance

    @property
    def feasible(self) -> bool:
        return self.allocation.feasible


def _solve_built(built: BuiltProblem, time_limit_s: float, mip_rel_gap: float,
                 method: Method | str) -> LayerAllocation:
    answer = solve(built.problem, time_limit_s=time_limit_s, mip_rel_gap=mip_rel_gap, method=method)
    mapping = {name: built.bits[k] for name, k in zip(built.names, answer.choice, strict=True)}
    return LayerAllocation(MappingProxyType(mapping), answer, built)


def allocate(
    layers: Sequence[LayerInfo],
    budget_bytes: int | None,
    *,
    size_fn: SizeFn,
    objective: Objective | str = Objective.VARIANCE,
    variance_bound: float | None = None,
    choices: Sequence[int] = DEFAULT_CHOICES,
    keep: bool = True,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    mip_rel_gap: float = DEFAULT_MIP_REL_GAP,
    method: Method | str = Method.AUTO,
) -> LayerAllocation:
    """Bits per layer: least variance within ``budget_bytes``, or (``objective="bytes"``)
    fewest bytes within ``variance_bound``.

    Never raises for valid input: an infeasible problem comes back with
    ``feasible=False`` and every layer at its cheapest (VARIANCE) or most precise
    (BYTES) choice. See :func:`build_problem` for the arguments and :func:`solve` for
    ``time_limit_s``, ``mip_rel_gap`` and ``method``.
    """
    built = build_problem(layers, budget_bytes, size_fn=size_fn, choices=choices, keep=keep,
                          objective=objective, variance_bound=variance_bound)
    return _solve_built(built, time_limit_s, mip_rel_gap, method)


def _interpolated_size(size_fn: SizeFn, numel: int, avg_bits: float, bits: tuple[int, ...],
                       name: str) -> int:
    lo = max(b for b in bits if b <= avg_bits)
    hi = min(b for b in bits if b >= avg_bits)
    s_lo = _size(size_fn, numel, lo, name)
    if hi == lo:
        return s_lo
    s_hi = _size(size_fn, numel, hi, name)
    return s_lo + math.floor((s_hi - s_lo) * (avg_bits - lo) / (hi - lo))


def uniform_bits(
    layers: Sequence[LayerInfo],
    avg_bits: float,
    *,
    size_fn: SizeFn,
    choices: Sequence[int] = DEFAULT_CHOICES,
    keep: bool = True,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    mip_rel_gap: float = DEFAULT_MIP_REL_GAP,
    method: Method | str = Method.AUTO,
) -> LayerAllocation:
    """Bits per layer for an average of ``avg_bits`` bits per value, placed by sensitivity.

    Used when there is no byte budget. NOTE [ Average bits as a budget ]: the request is
    the VARIANCE problem whose byte budget is what ``avg_bits`` everywhere would cost,
    ``Σ_l size_fn(numel_l, avg_bits)``. For an ``avg_bits`` between two choices
    ``lo < avg_bits < hi`` a layer's share is interpolated linearly between
    ``size_fn(numel, lo)`` and ``size_fn(numel, hi)`` (rounded down), so the budget
    always holds every layer at ``lo`` and the answer is always feasible; for an
    ``avg_bits`` in ``choices`` the uniform assignment is feasible, so the answer's
    variance is never above it. Sensitive layers get more bits, insensitive ones fewer,
    within the same total bytes.

    Raises:
        ConfigError: ``avg_bits`` outside ``[min(choices), max(choices)]``.
    """
    bits = _check_choices(choices)
    if (isinstance(avg_bits, bool) or not isinstance(avg_bits, int | float)
            or not bits[0] <= avg_bits <= bits[-1]):
        raise ConfigError(
            f"avg_bits = {avg_bits!r}; give a number of bits in [{bits[0]}, {bits[-1]}] "
            f"(the range of choices {bits})"
        )
    budget = 0
    for i, layer in enumerate(layers):
        name, _, numel, _ = _check_layer(layer, f"layers[{i}]")
        budget += _interpolated_size(size_fn, numel, float(avg_bits), bits, name)
    # A budget of 0 (only empty layers) still has to be a valid Problem budget.
    built = build_problem(layers, max(budget, 1), size_fn=size_fn, choices=bits, keep=keep)
    return _solve_built(built, time_limit_s, mip_rel_gap, method)
