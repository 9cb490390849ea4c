"""Rows of the aggregated view: what one rank encodes and every rank decodes (rank_summary.py)."""

from __future__ import annotations

import math
from typing import Any

from memctl.controller.rank_summary import FIELDS, LEFT, decode_rows, encode_row


def _figures(**changes: Any) -> dict[str, Any]:
    row = {"step": 20, "raw_bytes": 4000, "packed_bytes": 500, "other_bytes": 7, "avg_bits": 2.5,
           "batch_size": 32, "budget_bytes": None, "activation_budget_bytes": None, "static_bytes": 900,
           "process_bytes": 10**6, "device_used_bytes": None, "agreed": True, "fallbacks": 1, "errors": 0}
    return {**row, **changes}


def _gather(rows: list[list[float] | None]) -> list[float]:
    """What the MIN all-reduce returns: each rank's row in its slot, +inf where none was sent."""
    k = len(FIELDS)
    return [v for row in rows for v in (row if row is not None else [math.inf] * k)]


def test_rows_round_trip_with_unknown_values_as_none() -> None:
    slots = _gather([encode_row(_figures()), encode_row(_figures(step=20, avg_bits=3.0, agreed=False))])
    rows, left = decode_rows(slots, 2)
    assert left == []
    assert [r["rank"] for r in rows] == [0, 1]
    assert rows[0]["budget_bytes"] is None and rows[0]["device_used_bytes"] is None
    assert rows[0]["raw_bytes"] == 4000 and isinstance(rows[0]["raw_bytes"], int)
    assert rows[0]["ratio"] == 8.0 and rows[0]["avg_bits"] == 2.5 and rows[0]["agreed"] is True
    assert rows[1]["avg_bits"] == 3.0 and rows[1]["agreed"] is False


def test_a_rank_that_left_or_sent_nothing_has_no_row() -> None:
    gone = [LEFT] + [math.inf] * (len(FIELDS) - 1)
    rows, left = decode_rows(_gather([encode_row(_figures()), gone, None]), 3)
    assert [r["rank"] for r in rows] == [0]
    assert left == [1]


def test_nothing_packed_reads_as_ratio_one() -> None:
    rows, _ = decode_rows(_gather([encode_row(_figures(raw_bytes=0, packed_bytes=0))]), 1)
    assert rows[0]["ratio"] == 1.0
