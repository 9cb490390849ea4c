"""Parsing of memory budgets: bytes, sizes with units, and percentages of the device."""

from __future__ import annotations

import math
import re

from memctl.errors import BudgetError

__all__ = ["BudgetSpec", "format_bytes", "parse_budget", "resolve_budget"]

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")
_PERCENT = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*%\s*$")
_ACCEPTED = (
    "a positive number of bytes (int), a size string such as '12GiB', '800MB' or '512MiB', "
    "a percentage of the device's total memory such as '75%', or None for no limit"
)
# A budget above this is certainly a typo (1 PiB); a real device is far smaller.
MAX_BUDGET_BYTES = 2**50


class BudgetSpec:
    """A parsed budget: either absolute bytes or a fraction of the device's total memory.

    Percentages stay fractions until a device total is known (:func:`resolve_budget`),
    so the same spec can move between machines.
    """

    __slots__ = ("fraction", "nbytes", "text")

    def __init__(self, *, nbytes: int | None = None, fraction: float | None = None,
                 text: str = "") -> None:
        if (nbytes is None) == (fraction is None):
            raise BudgetError("a BudgetSpec holds exactly one of nbytes or fraction")
        self.nbytes = nbytes
        self.fraction = fraction
        self.text = text

    def __repr__(self) -> str:
        return f"BudgetSpec({self.text!r})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, BudgetSpec) and self.nbytes == other.nbytes
                and self.fraction == other.fraction)

    def __hash__(self) -> int:
        return hash((self.nbytes, self.fraction))

    def to_json(self) -> str | int:
        """The form a user would type back in: bytes as an int, a fraction as 'NN%'."""
        if self.nbytes is not None:
            return self.nbytes
        assert self.fraction is not None
        return f"{self.fraction * 100:g}%"


def parse_budget(value: object) -> BudgetSpec | None:
    """Parse a user's budget.

    Accepts an ``int`` of bytes, a string with a size unit (``"12GiB"``, ``"800MB"``,
    ``"1.5G"``; a bare number is bytes), a percentage (``"75%"``, of the device's total
    memory), or ``None`` for no limit. Anything else raises :class:`BudgetError` naming
    the value and what is accepted.
    """
    if value is None:
        return None
    if isinstance(value, BudgetSpec):
        return value
    if isinstance(value, bool):
        raise BudgetError(f"budget {value!r} is a bool; expected {_ACCEPTED}")
    if isinstance(value, int):
        return BudgetSpec(nbytes=_check_bytes(value, value), text=str(value))
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise BudgetError(f"budget {value!r} is not a whole number of bytes; expected {_ACCEPTED}")
        return BudgetSpec(nbytes=_check_bytes(int(value), value), text=str(int(value)))
    if not isinstance(value, str):
        raise BudgetError(f"budget {value!r} has type {type(value).__name__}; expected {_ACCEPTED}")
    m = _PERCENT.match(value)
    if m:
        pct = float(m.group(1))
        if not 0.0 < pct <= 100.0:
            raise BudgetError(
                f"budget {value!r} is outside (0%, 100%]; give a percentage such as '75%'"
            )
        return BudgetSpec(fraction=pct / 100.0, text=value.strip())
    m = _SIZE.match(value)
    if not m:
        raise BudgetError(f"budget {value!r} could not be parsed; expected {_ACCEPTED}")
    unit = m.group(2).lower()
    if unit not in _UNITS:
        known = ", ".join(u for u in ("B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB"))
        raise BudgetError(f"budget {value!r} has unknown unit {m.group(2)!r}; use one of {known}")
    nbytes = float(m.group(1)) * _UNITS[unit]
    return BudgetSpec(nbytes=_check_bytes(int(nbytes), value), text=value.strip())


def resolve_budget(spec: BudgetSpec | None, device_total: int | None) -> int | None:
    """Bytes for a spec on a device with ``device_total`` bytes (needed for percentages)."""
    if spec is None:
        return None
    if spec.nbytes is not None:
        return spec.nbytes
    assert spec.fraction is not None
    if device_total is None or device_total <= 0:
        raise BudgetError(
            f"budget {spec.text!r} is a percentage, but the device's total memory is unknown; "
            "give the budget in bytes (e.g. '8GiB') instead"
        )
    return int(spec.fraction * device_total)


def format_bytes(n: float | None) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    if n is None:
        return "none"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _check_bytes(n: int, shown: object) -> int:
    if n <= 0:
        raise BudgetError(f"budget {shown!r} must be positive; expected {_ACCEPTED}")
    if n > MAX_BUDGET_BYTES:
        raise BudgetError(
            f"budget {shown!r} is {format_bytes(n)}, more than any device holds "
            f"(limit {format_bytes(MAX_BUDGET_BYTES)}); check the unit"
        )
    return n
