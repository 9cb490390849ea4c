"""Parsing of memory budgets: bytes, sizes with units, and percentages of the device."""

from __future__ import annotations

import math
import re
from fractions import Fraction

from memctl.errors import BudgetError

__all__ = ["BudgetSpec", "format_bytes", "parse_budget", "resolve_budget"]

# NOTE [ The budget rule ]
# One rule for every form a budget comes in (int, float, string, JSON):
#   * a number with no unit, or with the unit B, counts bytes and must be whole:
#     "1.5" and 1.5 are both refused (a fractional byte count is a missing unit);
#   * a number with a unit (kB, MB, GiB, ...) or a percentage may have a fraction; the
#     amount is rounded down to whole bytes ("1.5GiB" is 1610612736 bytes);
#   * the result must be at least 1 byte ("0", "0GiB" and a percentage that rounds to 0
#     bytes on the device are refused alike) and at most the device's total memory where
#     it is known (:func:`resolve_budget`), 1 PiB where it is not;
#   * units: B (byte); kB/KB, MB, GB, TB, PB (powers of 1000); KiB, MiB, GiB, TiB, PiB and
#     K, M, G, T (powers of 1024). The prefix may be in any case, but the final B must be
#     a capital: a lowercase b means bits ("10Gb" is 1.25 GB), so it is refused with the
#     two spellings that mean bytes rather than guessed;
#   * negative, NaN, infinite, empty, exponent forms ("1e9") and absurdly long numbers are
#     refused. Every refusal is a BudgetError naming the value, what is allowed and the fix.
# Numbers are parsed exactly (fractions.Fraction), never through a float, so "1" + "0" * 400
# is a too-large budget, not an OverflowError.
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_BINARY = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}
_UNIT_NAMES = "B, kB, MB, GB, TB, PB (powers of 1000), KiB, MiB, GiB, TiB, PiB, K, M, G, T (powers of 1024)"
_NUMBER = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(%|[a-zA-Z]*)$")
_MAX_NUMBER_CHARS = 40
_ACCEPTED = (
    "a positive whole number of bytes (int), a size string such as '12GiB', '800MB' or '512MiB', "
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
        return f"{(self.fraction or 0.0) * 100:g}%"


def parse_budget(value: object) -> BudgetSpec | None:
    """Parse a user's budget by NOTE [ The budget rule ].

    Accepts an ``int`` of bytes (or a float with no fractional part), a string with a
    size unit (``"12GiB"``, ``"800MB"``, ``"1.5G"``; a bare number is bytes and must be
    whole), a percentage (``"75%"``, of the device's total memory), or ``None`` for no
    limit. Sizes with a unit are rounded down to whole bytes; the result must be at least
    1 byte and at most 1 PiB (:func:`resolve_budget` then holds it to the device's total).
    A lowercase ``b`` (bits, as in ``"10Gb"``) is refused. Anything else raises
    :class:`BudgetError` naming the value and what is accepted.
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
        if not math.isfinite(value):
            raise BudgetError(f"budget {value!r} is not a finite number; expected {_ACCEPTED}")
        if value != int(value):
            raise BudgetError(
                f"budget {value!r} is not a whole number of bytes; give whole bytes ({math.floor(value)}) "
                "or a size with a unit such as '1.5GiB'"
            )
        return BudgetSpec(nbytes=_check_bytes(int(value), value), text=str(int(value)))
    if not isinstance(value, str):
        raise BudgetError(f"budget {_show(value)} has type {type(value).__name__}; expected {_ACCEPTED}")
    return _parse_text(value)


def _parse_text(value: str) -> BudgetSpec:
    text = value.strip()
    shown = _show(value)
    if not text:
        raise BudgetError(f"budget {shown} is empty; expected {_ACCEPTED}")
    if text.startswith("-"):
        raise BudgetError(
            f"budget {shown} is negative; a budget is a positive amount, such as '12GiB' or '75%'"
        )
    m = _NUMBER.match(text)
    if not m:
        raise BudgetError(f"budget {shown} could not be parsed; expected {_ACCEPTED}")
    number, unit = m.group(1), m.group(2)
    if len(number.split(".")[0].lstrip("0")) > 20:
        raise BudgetError(
            f"budget {shown} is more than any device holds (limit {format_bytes(MAX_BUDGET_BYTES)}); "
            "check the value and its unit"
        )
    if len(number) > _MAX_NUMBER_CHARS:
        raise BudgetError(
            f"budget {shown} has a number of {len(number)} characters; a budget's number has at most "
            f"{_MAX_NUMBER_CHARS} (a device holds at most {format_bytes(MAX_BUDGET_BYTES)}): check the value"
        )
    amount = Fraction(number)
    if unit == "%":
        if not 0 < amount <= 100:
            raise BudgetError(f"budget {shown} is outside (0%, 100%]; give a percentage such as '75%'")
        return BudgetSpec(fraction=float(amount / 100), text=text)
    scale = _unit_scale(unit, shown)
    if scale == 1 and amount.denominator != 1:
        raise BudgetError(
            f"budget {shown} is not a whole number of bytes; a number without a unit (or with 'B') "
            f"counts bytes: give whole bytes ({math.floor(amount)}) or add a unit such as 'GiB'"
        )
    return BudgetSpec(nbytes=_check_bytes(math.floor(amount * scale), value), text=text)


def _unit_scale(unit: str, shown: str) -> int:
    """Bytes per ``unit`` by NOTE [ The budget rule ]."""
    if unit == "":
        return 1
    if unit.endswith("b"):
        number = shown.strip("'\"")[: -len(unit)].strip()
        letter = unit[0].upper() if len(unit) > 1 else ""
        if letter and letter.lower() in _DECIMAL:
            power = " kmgtp".index(letter.lower())
            spellings = (f"'{number}{letter}B' ({number} x 10**{3 * power} bytes) "
                         f"or '{number}{letter}iB' ({number} x 2**{10 * power} bytes)")
        else:
            spellings = f"'{number}B' ({number} bytes)"
        raise BudgetError(
            f"budget {shown} ends in a lowercase 'b', which means bits; budgets count bytes: "
            f"write {spellings}"
        )
    key = unit.lower()
    if key == "b":
        return 1
    if len(key) == 1 and key in _BINARY:
        return _BINARY[key]
    if len(key) == 2 and key[1] == "b" and key[0] in _DECIMAL:
        return _DECIMAL[key[0]]
    if len(key) == 3 and key[1:] == "ib" and key[0] in _BINARY:
        return _BINARY[key[0]]
    raise BudgetError(f"budget {shown} has unknown unit {unit!r}; use one of {_UNIT_NAMES}")


def resolve_budget(spec: BudgetSpec | None, device_total: int | None) -> int | None:
    """Bytes for a spec on a device with ``device_total`` bytes (needed for percentages).

    Raises:
        BudgetError: a percentage with an unknown device total, a percentage that rounds
            to 0 bytes, or a budget above ``device_total`` (when it is known).
    """
    if spec is None:
        return None
    known = device_total is not None and device_total > 0
    if spec.nbytes is not None:
        nbytes = spec.nbytes
    else:
        if spec.fraction is None or not known:
            raise BudgetError(
                f"budget {spec.text!r} is a percentage, but the device's total memory is unknown; "
                "give the budget in bytes (e.g. '8GiB') instead"
            )
        nbytes = math.floor(Fraction(spec.fraction) * int(device_total or 0))
        if nbytes < 1:
            raise BudgetError(
                f"budget {spec.text!r} is 0 bytes of this device's {format_bytes(device_total)}; "
                "a budget must be at least 1 byte: give a larger percentage or a size such as '8GiB'"
            )
    if device_total is not None and known and nbytes > device_total:
        raise BudgetError(
            f"budget {spec.text!r} is {format_bytes(nbytes)} ({nbytes} bytes), more than the device's "
            f"{format_bytes(device_total)} ({device_total} bytes); "
            f"give at most {device_total} bytes or '100%'"
        )
    return nbytes


def format_bytes(n: float | None) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**30) == '3.00 GiB'``.

    Works for any int, however large (no float overflow), and for floats.
    """
    if n is None:
        return "none"
    if isinstance(n, float) and not math.isfinite(n):
        return f"{n} B"
    if abs(n) >= 2**70:
        digits = len(str(abs(int(n)))) if abs(n) < 10**4000 else int(abs(int(n)).bit_length() * 0.30103)
        return f"about 10^{digits - 1} B"
    for unit, scale in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{float(Fraction(n) / scale):.2f} {unit}"
    return f"{int(n)} B"


def _show(value: object) -> str:
    """``repr(value)``, shortened to 60 characters (a budget may be 4 KiB of digits)."""
    if isinstance(value, int) and abs(value) >= 10**60:
        return f"an int of {len(str(abs(value))) if abs(value) < 10**4000 else 'over 4000'} digits"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}...{text[-12:]} ({len(text) - 2} characters)"


def _check_bytes(n: int, shown: object) -> int:
    if n <= 0:
        raise BudgetError(f"budget {_show(shown)} must be positive (at least 1 byte); expected {_ACCEPTED}")
    if n > MAX_BUDGET_BYTES:
        raise BudgetError(
            f"budget {_show(shown)} is {format_bytes(n)}, more than any device holds "
            f"(limit {format_bytes(MAX_BUDGET_BYTES)}); check the unit"
        )
    return n
