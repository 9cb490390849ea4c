"""A populated StaticView and TestClient factories: a fresh app for every test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from memctl.api import StaticView, create_app

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DEVICE_TOTAL = 80 * 2**30


def sample(t: float, used: int) -> dict[str, Any]:
    return {
        "time": t, "reader": "nvml", "device": "cuda:0", "total_bytes": DEVICE_TOTAL, "used_bytes": used,
        "free_bytes": DEVICE_TOTAL - used, "process_bytes": used - 2**30, "utilization": 87.0,
        "allocated_bytes": used - 3 * 2**30, "reserved_bytes": used - 2 * 2**30, "peak_bytes": used,
        "activation_bytes": 2**30,
    }


def populated_view() -> StaticView:
    history = [sample(1000.0 + i, (20 + i) * 2**30) for i in range(8)]
    view = StaticView(
        {
            "step": 120, "budget": "75%", "budget_bytes": 60 * 2**30, "activation_budget_bytes": 30 * 2**30,
            "raw_bytes": 24 * 2**30, "packed_bytes": 3 * 2**30, "ratio": 8.0, "avg_bits": 4.0,
            "batch_size": 256, "fallbacks": 2,
            "allocation": {"solver": "milp", "status": "Optimal", "time_ms": 12.5, "objective": 0.031,
                           "feasible": True, "step": 100},
            "events": [{"step": 100, "time": 999.0, "kind": "allocation", "message": "re-solved"},
                       {"step": 110, "time": 999.5, "kind": "budget", "message": "budget 60 GiB"}],
            "layers": [
                {"name": "conv1", "bits": 2.0, "error_bound": None, "raw_bytes": 16 * 2**30,
                 "packed_bytes": 2**31, "sensitivity": 0.5},
                {"name": "blocks.0.fc", "bits": None, "error_bound": 0.01, "raw_bytes": 8 * 2**30,
                 "packed_bytes": 2**30, "sensitivity": 1.25},
            ],
            "memory": history[-1],
        },
        history=history,
        device_total_bytes=DEVICE_TOTAL,
    )
    return view


@pytest.fixture
def view() -> StaticView:
    return populated_view()


@pytest.fixture
def make_client() -> Iterator[Callable[..., TestClient]]:
    clients: list[TestClient] = []

    def make(view: Any, **options: Any) -> TestClient:
        client = TestClient(create_app(view, **options), base_url="http://127.0.0.1")
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def client(view: StaticView, make_client: Callable[..., TestClient]) -> TestClient:
    return make_client(view, token=TOKEN, history_capacity=600)
