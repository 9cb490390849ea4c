"""The aggregated view over HTTP: ``/v1/ranks`` and ``/metrics?ranks=all`` (memctl/api/ranks.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from memctl.api import StaticView


def _row(rank: int, **changes: Any) -> dict[str, Any]:
    row = {"rank": rank, "step": 40, "raw_bytes": 8000, "packed_bytes": 1000, "other_bytes": 10, "ratio": 8.0,
           "avg_bits": 4.0, "batch_size": 64, "budget_bytes": 10**6, "activation_budget_bytes": 5 * 10**5,
           "static_bytes": 4 * 10**5, "process_bytes": 7 * 10**5, "device_used_bytes": 9 * 10**5,
           "agreed": True, "fallbacks": 0, "errors": 0}
    return {**row, **changes}


def _job_view() -> StaticView:
    return StaticView({"step": 42, "rank": 0, "world_size": 2, "agreed": True, "avg_bits": 3.0,
                       "raw_bytes": 9000, "packed_bytes": 1500, "batch_size": 64,
                       "ranks": [_row(0), _row(1, avg_bits=2.5, packed_bytes=1600, budget_bytes=None,
                                               process_bytes=None, batch_size=32)]})


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    families = text_string_to_metric_families(text)
    return {f.name: [(dict(s.labels), s.value) for s in f.samples] for f in families}


def test_ranks_lists_every_ranks_row(make_client: Callable[..., TestClient]) -> None:
    body = make_client(_job_view()).get("/v1/ranks").json()
    assert (body["step"], body["rank"], body["world_size"], body["agreed"]) == (42, 0, 2, True)
    assert [r["rank"] for r in body["ranks"]] == [0, 1]
    assert body["ranks"][1]["avg_bits"] == 2.5 and body["ranks"][1]["budget_bytes"] is None
    assert body["ranks"][1]["batch_size"] == 32 and body["ranks"][0]["process_bytes"] == 7 * 10**5


def test_without_a_process_group_the_view_is_one_row_of_this_process(
        make_client: Callable[..., TestClient]) -> None:
    view = StaticView({"step": 7, "rank": 0, "raw_bytes": 4000, "packed_bytes": 500, "ratio": 8.0,
                       "avg_bits": 4.0, "batch_size": 16})
    rows = make_client(view).get("/v1/ranks").json()["ranks"]
    assert len(rows) == 1
    assert rows[0]["rank"] == 0 and rows[0]["step"] == 7 and rows[0]["packed_bytes"] == 500
    assert rows[0]["batch_size"] == 16


def test_metrics_carry_other_ranks_only_when_asked(make_client: Callable[..., TestClient]) -> None:
    client = make_client(_job_view())
    own = _samples(client.get("/metrics").text)
    assert own["memctl_avg_bits"] == [({"rank": "0"}, 3.0)]
    assert "memctl_rank_report_step" not in own
    every = _samples(client.get("/metrics", params={"ranks": "all"}).text)
    # This rank's live series, then the other ranks' rows, in one family per name.
    assert every["memctl_avg_bits"] == [({"rank": "0"}, 3.0), ({"rank": "1"}, 2.5)]
    assert every["memctl_batch_size"] == [({"rank": "0"}, 64.0), ({"rank": "1"}, 32.0)]
    assert every["memctl_steps"] == [({"rank": "0"}, 42.0), ({"rank": "1"}, 40.0)]
    assert every["memctl_rank_report_step"] == [({"rank": "0"}, 40.0), ({"rank": "1"}, 40.0)]
    # Unknown values are left out, not exported as NaN or 0.
    assert every["memctl_rank_process_bytes"] == [({"rank": "0"}, 7e5)]
    assert ({"rank": "1"}, 10.0**6) not in every.get("memctl_budget_bytes", [])


def test_a_family_this_rank_lacks_comes_from_the_rows(make_client: Callable[..., TestClient]) -> None:
    view = StaticView({"step": 3, "rank": 0, "world_size": 2, "ranks": [_row(0), _row(1)]})
    every = _samples(make_client(view).get("/metrics?ranks=all").text)
    # This rank has no budget (no memctl_budget_bytes of its own); rank 1's row has one.
    assert every["memctl_budget_bytes"] == [({"rank": "1"}, 10.0**6)]


def test_metrics_ranks_takes_only_all(make_client: Callable[..., TestClient]) -> None:
    r = make_client(_job_view()).get("/metrics?ranks=some")
    assert r.status_code == 422
    assert "ranks" in r.json()["detail"]
