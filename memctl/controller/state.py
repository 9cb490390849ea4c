"""Validation of a saved controller state before any of it is applied.

NOTE [ Atomic state restore ]
``Controller.load_state_dict`` first checks every key and every value (types, ranges,
finiteness), building the new layer states on the side, and only then assigns them: a
state that is rejected leaves the controller exactly as it was, and a state that is
accepted cannot make a later step fail (an infinite EMA would reach the solver). Each
error is a :class:`ConfigError` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from memctl.controller.budget import BudgetSpec, parse_budget
from memctl.controller.config import KEEP_BITS
from memctl.controller.stats import LayerState
from memctl.errors import ConfigError, MemctlError

__all__ = ["STATE_VERSION", "ValidState", "validate_state"]

STATE_VERSION = 1
_REQUIRED = ("version", "step", "budget", "layers")
_FIX = "pass the dict Controller.state_dict() returned, unchanged"


@dataclasses.dataclass(frozen=True)
class ValidState:
    """A checked controller state, ready to assign."""

    step: int
    budget: BudgetSpec | None
    layers: dict[str, LayerState]
    batch_size: int | None
    oom_cap: int | None
    static_bytes: int
    activation_budget: int | None
    fallbacks: int
    errors: int
    allocation: dict[str, Any] | None


def validate_state(state: object) -> ValidState:
    """Check ``state`` (a :meth:`Controller.state_dict`) completely; raise ConfigError on any fault."""
    if not isinstance(state, Mapping):
        raise ConfigError(f"controller state must be a mapping from state_dict(), got {type(state).__name__}")
    for key in _REQUIRED:
        if key not in state:
            raise ConfigError(f"controller state has no {key!r} key; {_FIX}")
    version = state["version"]
    if version != STATE_VERSION:
        raise ConfigError(
            f"controller state has version {version!r}; this memctl reads version {STATE_VERSION}"
        )
    try:
        budget = parse_budget(state["budget"])
    except MemctlError as exc:
        raise ConfigError(f"controller state key 'budget' is invalid: {exc}") from exc
    layers_in = state["layers"]
    if not isinstance(layers_in, Mapping):
        raise ConfigError(f"controller state key 'layers' must be a mapping of layer states, got "
                          f"{type(layers_in).__name__}; {_FIX}")
    layers = {}
    for name, sd in layers_in.items():
        if not isinstance(name, str) or not isinstance(sd, Mapping):
            raise ConfigError(f"controller state 'layers' entry {name!r} must map a name to a dict; {_FIX}")
        layers[name] = _layer(name, sd)
    alloc = state.get("allocation")
    if alloc is not None and not isinstance(alloc, Mapping):
        raise ConfigError(f"controller state key 'allocation' must be a dict or None, got {alloc!r}")
    return ValidState(
        step=_int("step", state["step"]),
        budget=budget,
        layers=layers,
        batch_size=_int("batch_size", state.get("batch_size"), low=1, optional=True),
        oom_cap=_int("oom_cap", state.get("oom_cap"), low=1, optional=True),
        static_bytes=_int("static_bytes", state.get("static_bytes", 0)),
        activation_budget=_int("activation_budget", state.get("activation_budget"), optional=True),
        fallbacks=_int("fallbacks", state.get("fallbacks", 0)),
        errors=_int("errors", state.get("errors", 0)),
        allocation=dict(alloc) if alloc else None,
    )


def _layer(name: str, sd: Mapping[str, Any]) -> LayerState:
    where = f"layers[{name!r}]"
    if sd.get("name", name) != name:
        raise ConfigError(f"controller state {where} has name {sd.get('name')!r}; {_FIX}")
    checks = {
        "kernel": lambda k, v: _int(k, v, low=1),
        "bits": lambda k, v: _real(k, v, low=1.0, high=float(KEEP_BITS), optional=True),
        "error_bound": lambda k, v: _real(k, v, low=0.0, optional=True, positive=True),
        "ema_grad_sq": lambda k, v: _real(k, v, low=0.0, optional=True),
        "ema_range_term": lambda k, v: _real(k, v, low=0.0, optional=True),
        "used_bits": lambda k, v: _real(k, v, low=0.0, high=float(KEEP_BITS), optional=True),
        "vmin": lambda k, v: _real(k, v, optional=True),
        "vmax": lambda k, v: _real(k, v, optional=True),
        "element_size": lambda k, v: _int(k, v, low=1, high=16),
        "batch": lambda k, v: _int(k, v, low=1),
    }
    for key in ("raw_bytes", "packed_bytes", "fixed_bytes", "mask_bytes", "other_bytes", "seen_steps",
                "grad_step", "range_step"):
        checks[key] = _int
    for key, check in checks.items():
        if key in sd:
            check(f"{where}[{key!r}]", sd[key])
    numels = sd.get("numels", ())
    if not isinstance(numels, list | tuple):
        raise ConfigError(f"controller state {where}['numels'] must be a list of ints, got {numels!r}")
    for n in numels:
        _int(f"{where}['numels']", n)
    try:
        return LayerState.from_state_dict(dict(sd))
    except TypeError as exc:
        raise ConfigError(f"controller state {where} is not a layer state ({exc}); {_FIX}") from exc


def _int(key: str, value: object, low: int = 0, high: int | None = None, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if (isinstance(value, bool) or not isinstance(value, int) or value < low
            or (high is not None and value > high)):
        allowed = f"an int >= {low}" + (f" and <= {high}" if high is not None else "")
        allowed += " or None" if optional else ""
        raise ConfigError(f"controller state {key}={value!r} is not allowed: it must be {allowed}; {_FIX}")
    return value


def _real(key: str, value: object, low: float = -math.inf, high: float = math.inf, optional: bool = False,
          positive: bool = False) -> Any:
    if value is None and optional:
        return None
    ok = (not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
          and low <= value <= high and (not positive or value > 0))
    if not ok:
        allowed = f"a finite number in [{low}, {high}]" + (" above 0" if positive else "")
        allowed += " or None" if optional else ""
        raise ConfigError(f"controller state {key}={value!r} is not allowed: it must be {allowed}; {_FIX}")
    return value
