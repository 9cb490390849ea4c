"""Every rank's figures in one place: the rows of the aggregated view rank 0 serves.

NOTE [ Aggregated view ]
Rank 0's server offers the whole job (``GET /v1/ranks``, ``/metrics?ranks=all``), so it
must learn the other ranks' figures. Two ways were open: rank 0 querying each rank's
HTTP server, or the ranks sending their figures along a collective they already run.
The second is what memctl does: each rank writes a fixed row of ``len(FIELDS)`` numbers
into its own slot of the layout check that opens every allocation step (NOTE
[ Agreement across ranks ]); the other slots hold +inf, so that MIN all-reduce gathers
every row on every rank, with no collective added, nothing on the per-step path, and
no extra bytes on the steps between allocations. HTTP would have needed every rank to
serve, rank 0 to know every other node's address and port (``port_per_rank`` numbers
ports by ``LOCAL_RANK``, the same on every node), the token and allowed Host names of
each, and requests that can time out while a scrape waits; the collective needs none
of it and cannot fail on its own. The cost is freshness: the rows are as of the last
allocation step (every ``allocation_interval`` steps, and at each budget change), and
each row carries the step it was taken at.

Unknown values (no budget, no memory sample) travel as -1 (every figure is >= 0) and
come back as None. A rank's row whose slot still holds +inf sent nothing (a rank that
left, NOTE [ Leaving the agreement ]) and is left out.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["FIELDS", "LEFT", "decode_rows", "encode_row", "this_rank"]

#: The figures of one rank's row, in slot order.
FIELDS = (
    "step", "raw_bytes", "packed_bytes", "other_bytes", "avg_bits", "batch_size", "budget_bytes",
    "activation_budget_bytes", "static_bytes", "process_bytes", "device_used_bytes", "agreed",
    "fallbacks", "errors",
)
_FLOATS = frozenset({"avg_bits"})
_NONE = -1.0
#: The value of ``step`` in the row of a rank that leaves the agreement.
LEFT = -2.0


def encode_row(values: dict[str, Any]) -> list[float]:
    """One rank's row: ``values[f]`` for each of :data:`FIELDS`, None as -1, bools as 0/1."""
    row = []
    for f in FIELDS:
        v = values.get(f)
        row.append(_NONE if v is None else float(v))
    return row


def decode_rows(slots: list[float], world: int) -> tuple[list[dict[str, Any]], list[int]]:
    """The rows of the ranks that sent one, and the ranks whose row says they left."""
    k = len(FIELDS)
    rows: list[dict[str, Any]] = []
    left: list[int] = []
    for rank in range(world):
        values = slots[rank * k: (rank + 1) * k]
        if not values or math.isinf(values[0]):
            continue
        if values[0] == LEFT:
            left.append(rank)
            continue
        row: dict[str, Any] = {"rank": rank}
        for f, v in zip(FIELDS, values, strict=True):
            if v == _NONE or not math.isfinite(v):
                row[f] = None
            elif f == "agreed":
                row[f] = bool(v)
            else:
                row[f] = float(v) if f in _FLOATS else int(v)
        raw, packed = row["raw_bytes"] or 0, row["packed_bytes"] or 0
        row["ratio"] = raw / packed if packed else 1.0
        rows.append(row)
    return rows, left


def this_rank(ctl: Any) -> dict[str, Any]:
    """The figures of ``ctl`` (a Controller) for its row, at the step boundary."""
    layers = [s for s in ctl._layers.values() if s.used_bits is not None]
    values = sum(sum(s.numels) for s in layers)
    bits = sum(sum(s.numels) * s.used_bits for s in layers)
    sample = ctl._monitor.latest() if ctl._monitor is not None else None
    return {
        "step": ctl._step,
        "raw_bytes": ctl._totals.get("raw_bytes", 0),
        "packed_bytes": ctl._totals.get("packed_bytes", 0),
        "other_bytes": ctl._totals.get("other_bytes", 0),
        "avg_bits": bits / values if values else 0.0,
        "batch_size": ctl._batch_size,
        "budget_bytes": ctl._resolve(ctl._budget_spec) if ctl._budget_spec is not None else None,
        "activation_budget_bytes": ctl._activation_budget,
        "static_bytes": ctl._static_bytes,
        "process_bytes": getattr(sample, "process_bytes", None),
        "device_used_bytes": getattr(sample, "used_bytes", None),
        "agreed": ctl._ranks.agreed if ctl._ranks is not None else True,
        "fallbacks": ctl._fallbacks,
        "errors": ctl._errors,
    }
