"""The read-only view of a controller that the HTTP service needs: :class:`ControllerView`.

The service only calls these four methods; it never touches CUDA, the model or the
controller's internals. :class:`StaticView` is an in-memory implementation for tests,
documentation and demos.

The HTTP contract built on this view: docs/api.md.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from memctl.controller.budget import BudgetSpec, parse_budget, resolve_budget
from memctl.errors import ConfigError

__all__ = [
    "ALLOCATION_KEYS",
    "BUDGET_INFO_KEYS",
    "BUDGET_REQUEST_KEYS",
    "EVENT_KEYS",
    "LAYER_KEYS",
    "SNAPSHOT_KEYS",
    "ControllerView",
    "StaticView",
    "empty_snapshot",
]

#: Keys of :meth:`ControllerView.snapshot` (all present, values as documented there).
SNAPSHOT_KEYS = (
    "step", "budget", "budget_bytes", "activation_budget_bytes", "static_bytes", "raw_bytes",
    "packed_bytes", "other_bytes", "ratio", "avg_bits", "batch_size", "fallbacks", "allocation",
    "events", "layers", "memory", "rank", "world_size", "agreed", "counters", "timings", "ranks",
)
#: Keys of ``snapshot()["allocation"]`` when it is not ``None``.
ALLOCATION_KEYS = ("solver", "status", "time_ms", "objective", "feasible", "step")
#: Keys of each entry of ``snapshot()["events"]``.
EVENT_KEYS = ("step", "time", "kind", "message")
#: Keys of each entry of ``snapshot()["layers"]``.
LAYER_KEYS = ("name", "bits", "error_bound", "raw_bytes", "packed_bytes", "sensitivity")
#: Keys of :meth:`ControllerView.budget_info`.
BUDGET_INFO_KEYS = ("target", "target_bytes", "activation_budget_bytes", "pending", "device_total_bytes")
#: Keys of :meth:`ControllerView.request_budget`'s result.
BUDGET_REQUEST_KEYS = ("target", "target_bytes", "applies_at_step", "status")


@runtime_checkable
class ControllerView(Protocol):
    """What the HTTP service reads from a controller, and the one command it sends.

    Threading: every method is called from the server's threads, concurrently with
    training. Reads return state published at a step boundary (never half-updated
    state); :meth:`request_budget` only queues a change, which the training thread
    applies at its next step boundary. No method may block on the training step.

    Byte counts are ints; "target" values are budgets in the form a user types back:
    an int of bytes, a percentage string such as ``"75%"``, or ``None`` for no limit.
    """

    def snapshot(self) -> Mapping[str, Any]:
        """The immutable state published at the last step boundary.

        Keys (all present):

        - ``step`` (int): optimizer steps completed; 0 before the first.
        - ``budget`` (int | str | None): the device budget in force, as typed: int bytes,
          ``"NN%"``, or ``None`` for no limit.
        - ``budget_bytes`` (int | None): ``budget`` resolved to bytes on this device.
        - ``activation_budget_bytes`` (int | None): the part of the budget left for saved
          activations (budget minus static memory minus margin); ``None`` without a budget.
        - ``static_bytes`` (int): what the budget counts besides activations, measured at
          the last step boundary: parameters, gradients, buffers and optimizer state (each
          storage once), plus on a GPU the allocator workspace seen at the step's peak.
        - ``raw_bytes`` (int): bytes the compressed saved activations of the last step
          would take uncompressed.
        - ``packed_bytes`` (int): bytes they took compressed.
        - ``other_bytes`` (int): bytes of saved activations kept exact (small tensors, the
          loss's, integer and bool tensors); held activations are ``packed_bytes +
          other_bytes``.
        - ``ratio`` (float): ``raw_bytes / packed_bytes`` (1.0 when nothing was saved).
        - ``avg_bits`` (float): average bits per saved value, weighted by values.
        - ``batch_size`` (int | None): the batch size in force, when the controller manages it.
        - ``fallbacks`` (int): times a codec failed and the tensor was kept uncompressed,
          since attach.
        - ``allocation`` (Mapping | None): the last bit allocation, ``None`` before the first:
          ``solver`` (str: ``"dp"``, ``"milp"``, ``"greedy"`` or ``"trivial"``), ``status``
          (str, the solver's message), ``time_ms`` (float, solve time), ``objective`` (float | None, the
          variance objective reached), ``feasible`` (bool), ``step`` (int, when solved).
        - ``events`` (list of Mapping): the most recent decisions, oldest first, bounded:
          ``step`` (int), ``time`` (float, unix s), ``kind`` (str, e.g. ``"budget"``,
          ``"allocation"``, ``"batch_size"``, ``"fallback"``), ``message`` (str).
        - ``layers`` (list of Mapping): one per compressed layer, in forward order:
          ``name`` (str, the module's qualified name), ``bits`` (float | None, average bits,
          ``None`` in error-bound mode or when kept uncompressed), ``error_bound``
          (float | None, absolute error bound in error-bound mode), ``raw_bytes`` (int),
          ``packed_bytes`` (int), ``sensitivity`` (float, the layer's gradient-variance
          weight C_l, docs/design.md, "Sensitivity").
        - ``memory`` (Mapping | None): the latest monitor sample,
          :meth:`memctl.monitor.MemorySample.to_dict`, or ``None`` before the first.
        - ``rank`` (int | None): this process's rank in the controller's process group (0
          without one); ``None`` for a view that is no rank's. Metrics carry it as a label.
        - ``world_size`` (int): ranks in the group (1 without one).
        - ``agreed`` (bool): every rank applies the same allocation and batch size
          (NOTE [ Agreement across ranks ] in ``memctl/controller/distributed.py``).
        - ``ranks`` (list of Mapping): every rank's row of the aggregated view, as of the
          last allocation step (NOTE [ Aggregated view ] in
          ``memctl/controller/rank_summary.py``); empty without a process group. Each row:
          ``rank``, ``step`` (when it was taken), ``raw_bytes``, ``packed_bytes``,
          ``other_bytes``, ``ratio``, ``avg_bits``, ``batch_size``, ``budget_bytes``,
          ``activation_budget_bytes``, ``static_bytes``, ``process_bytes``,
          ``device_used_bytes`` (the rank's latest memory sample), ``agreed``,
          ``fallbacks``, ``errors``; unknown values are ``None``.
        - ``counters`` (Mapping): ``events`` (Mapping str -> int): events of each ``kind``
          since attach (the ``events`` list keeps only the most recent).
        - ``timings`` (Mapping): cumulative histograms ``encode``, ``decode`` and ``step``
          (:meth:`memctl.controller.timing.Histogram.to_dict`: ``buckets`` as
          [upper bound in s, cumulative count] pairs ending with ``inf``, ``sum``, ``count``),
          NOTE [ What is timed, and what it costs ]; empty when not measured.
        """
        ...

    def history(self, limit: int | None = None) -> list[Mapping[str, Any]]:
        """The monitor's samples as :meth:`~memctl.monitor.MemorySample.to_dict` dicts, oldest first.

        ``limit`` (a positive int) keeps the most recent ``limit``; ``None`` returns all
        that the monitor keeps.
        """
        ...

    def budget_info(self) -> Mapping[str, Any]:
        """The budget now and any change queued.

        Keys: ``target`` (int | str | None, the budget in force, as typed),
        ``target_bytes`` (int | None, resolved on this device), ``activation_budget_bytes``
        (int | None), ``pending`` (int | str | None: the queued target, normalised as
        :meth:`request_budget` returned it, or ``None`` when nothing is queued — a queued
        change to "no limit" also reads ``None`` here; the ``PUT`` response shows it),
        ``device_total_bytes`` (int | None, the device's capacity when known).
        """
        ...

    def request_budget(self, value: object) -> Mapping[str, Any]:
        """Validate ``value`` and queue it as the new budget for the next step boundary.

        ``value`` is what a user typed: int bytes, a size string (``"10GiB"``), a
        percentage (``"75%"``), or ``None`` for no limit; validated with
        :func:`memctl.controller.budget.parse_budget`. Thread-safe; a later request
        replaces a queued one.

        Returns ``target`` (int | str | None, normalised: ``BudgetSpec.to_json()``),
        ``target_bytes`` (int | None, resolved on this device), ``applies_at_step``
        (int, the step at whose end it is applied: the current ``step`` + 1) and
        ``status`` (``"pending"``).

        Raises:
            BudgetError: ``value`` is not a valid budget, or cannot be applied on this
                device (a percentage with an unknown device size, more than the device has).
        """
        ...


def empty_snapshot() -> dict[str, Any]:
    """A snapshot before the first step: no budget, nothing saved, no allocation."""
    return {
        "step": 0, "budget": None, "budget_bytes": None, "activation_budget_bytes": None,
        "static_bytes": 0, "raw_bytes": 0, "packed_bytes": 0, "other_bytes": 0, "ratio": 1.0,
        "avg_bits": 32.0, "batch_size": None,
        "fallbacks": 0, "allocation": None, "events": [], "layers": [], "memory": None,
        "rank": None, "world_size": 1, "agreed": True,
        "counters": {"events": {}}, "timings": {}, "ranks": [],
    }


class StaticView:
    """An in-memory :class:`ControllerView`: fixed state that a test or demo sets by hand.

    ``publish(**changes)`` plays the training thread's step boundary (update the state),
    ``apply_pending()`` plays a step boundary that applies a queued budget.
    """

    def __init__(self, snapshot: Mapping[str, Any] | None = None, *,
                 history: Sequence[Mapping[str, Any]] = (),
                 device_total_bytes: int | None = None) -> None:
        state = empty_snapshot()
        unknown = set(snapshot or {}) - set(SNAPSHOT_KEYS)
        if unknown:
            raise ConfigError(
                f"StaticView snapshot has unknown keys {sorted(unknown)}; allowed: {SNAPSHOT_KEYS}"
            )
        state.update(copy.deepcopy(dict(snapshot or {})))
        if device_total_bytes is not None and (isinstance(device_total_bytes, bool)
                                               or not isinstance(device_total_bytes, int)
                                               or device_total_bytes <= 0):
            raise ConfigError(f"device_total_bytes={device_total_bytes!r} must be a positive int or None")
        self._lock = threading.Lock()
        self._state = state
        self._history = [dict(s) for s in history]
        self._device_total = device_total_bytes
        self._pending: dict[str, Any] | None = None

    # --- ControllerView ------------------------------------------------------------------

    def snapshot(self) -> Mapping[str, Any]:
        with self._lock:
            return MappingProxyType(copy.deepcopy(self._state))

    def history(self, limit: int | None = None) -> list[Mapping[str, Any]]:
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ConfigError(f"history limit={limit!r} must be a positive int or None")
        with self._lock:
            kept: list[Mapping[str, Any]] = [dict(s) for s in self._history]
        return kept if limit is None else kept[-limit:]

    def budget_info(self) -> Mapping[str, Any]:
        with self._lock:
            pending = None if self._pending is None else self._pending["target"]
            return {
                "target": self._state["budget"],
                "target_bytes": self._state["budget_bytes"],
                "activation_budget_bytes": self._state["activation_budget_bytes"],
                "pending": pending,
                "device_total_bytes": self._device_total,
            }

    def request_budget(self, value: object) -> Mapping[str, Any]:
        spec = parse_budget(value)
        nbytes = resolve_budget(spec, self._device_total)  # refuses more than the device has
        with self._lock:
            self._pending = {
                "target": _target(spec),
                "target_bytes": nbytes,
                "applies_at_step": int(self._state["step"]) + 1,
            }
            return {**self._pending, "status": "pending"}

    # --- the training side ---------------------------------------------------------------

    def publish(self, **changes: Any) -> None:
        """Replace snapshot keys, as a step boundary would."""
        unknown = set(changes) - set(SNAPSHOT_KEYS)
        if unknown:
            raise ConfigError(f"publish() got unknown keys {sorted(unknown)}; allowed: {SNAPSHOT_KEYS}")
        with self._lock:
            self._state.update(copy.deepcopy(changes))

    def add_sample(self, sample: Mapping[str, Any]) -> None:
        """Append a monitor sample (a ``MemorySample.to_dict()``) and make it the latest."""
        with self._lock:
            self._history.append(dict(sample))
            self._state["memory"] = dict(sample)

    def apply_pending(self) -> Mapping[str, Any] | None:
        """End a step: advance ``step`` and apply the queued budget, if any; returns what was applied."""
        with self._lock:
            self._state["step"] = int(self._state["step"]) + 1
            applied, self._pending = self._pending, None
            if applied is not None:
                self._state["budget"] = applied["target"]
                self._state["budget_bytes"] = applied["target_bytes"]
            return applied


def _target(spec: BudgetSpec | None) -> int | str | None:
    return None if spec is None else spec.to_json()
