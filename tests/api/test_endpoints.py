from __future__ import annotations

from collections.abc import Callable

from fastapi.testclient import TestClient

from memctl.api import StaticView

from .conftest import AUTH, DEVICE_TOTAL


def test_healthz(client: TestClient) -> None:
    r = client.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok", "step": 120}


def test_stats(client: TestClient) -> None:
    body = client.get("/v1/stats").json()
    assert body["step"] == 120 and body["budget"] == "75%" and body["budget_bytes"] == 60 * 2**30
    assert body["raw_bytes"] == 24 * 2**30 and body["packed_bytes"] == 3 * 2**30
    assert body["ratio"] == 8.0 and body["avg_bits"] == 4.0 and body["batch_size"] == 256
    assert body["fallbacks"] == 2
    assert body["allocation"]["time_ms"] == 12.5 and body["allocation"]["objective"] == 0.031
    assert [e["kind"] for e in body["events"]] == ["allocation", "budget"]
    assert body["memory"]["used_bytes"] == 27 * 2**30 and body["memory"]["reader"] == "nvml"
    assert "layers" not in body


def test_stats_before_the_first_step(make_client: Callable[..., TestClient]) -> None:
    body = make_client(StaticView()).get("/v1/stats").json()
    assert body["step"] == 0 and body["memory"] is None and body["allocation"] is None
    assert body["events"] == []


def test_stats_with_non_finite_ratio(make_client: Callable[..., TestClient]) -> None:
    r = make_client(StaticView({"ratio": float("inf")})).get("/v1/stats")
    assert r.status_code == 200 and r.json()["ratio"] is None


def test_layers(client: TestClient) -> None:
    body = client.get("/v1/layers").json()
    assert body["step"] == 120
    assert [(layer["name"], layer["bits"], layer["error_bound"]) for layer in body["layers"]] == [
        ("conv1", 2.0, None), ("blocks.0.fc", None, 0.01)
    ]
    assert body["layers"][1]["packed_bytes"] == 2**30 and body["layers"][1]["sensitivity"] == 1.25


def test_budget_round_trip(client: TestClient, view: StaticView) -> None:
    info = client.get("/v1/budget").json()
    assert info == {"target": "75%", "target_bytes": 60 * 2**30, "activation_budget_bytes": 30 * 2**30,
                    "pending": None, "device_total_bytes": DEVICE_TOTAL}
    r = client.put("/v1/budget", json={"target": "10GiB"}, headers=AUTH)
    assert r.status_code == 200
    assert r.json() == {"target": 10 * 2**30, "target_bytes": 10 * 2**30, "applies_at_step": 121,
                        "status": "pending"}
    assert client.get("/v1/budget").json()["pending"] == 10 * 2**30
    assert client.get("/v1/stats").json()["budget"] == "75%"  # applies at the step boundary
    view.apply_pending()
    stats = client.get("/v1/stats").json()
    assert stats["budget_bytes"] == 10 * 2**30 and stats["step"] == 121


def test_budget_accepts_every_form(client: TestClient) -> None:
    for target, expected in [(8 * 2**30, 8 * 2**30), ("50%", DEVICE_TOTAL // 2), ("800MB", 800 * 10**6),
                             (None, None), (1.0e9, 10**9)]:
        r = client.put("/v1/budget", json={"target": target}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["target_bytes"] == expected


def test_curl_style_body_without_content_type(client: TestClient) -> None:
    headers = {**AUTH, "Content-Type": "application/x-www-form-urlencoded"}
    r = client.put("/v1/budget", content=b'{"target": "10GiB"}', headers=headers)
    assert r.status_code == 200 and r.json()["target_bytes"] == 10 * 2**30


def test_no_token_configured_means_open_put(make_client: Callable[..., TestClient]) -> None:
    client = make_client(StaticView(device_total_bytes=DEVICE_TOTAL))
    assert client.put("/v1/budget", json={"target": "1GiB"}).status_code == 200


def test_history(client: TestClient) -> None:
    body = client.get("/v1/history").json()
    assert body["count"] == 8 and len(body["samples"]) == 8
    times = [s["time"] for s in body["samples"]]
    assert times == sorted(times)
    body = client.get("/v1/history", params={"limit": 3}).json()
    assert body["count"] == 3 and [s["time"] for s in body["samples"]] == [1005.0, 1006.0, 1007.0]


def test_history_is_capped_by_capacity(make_client: Callable[..., TestClient], view: StaticView) -> None:
    client = make_client(view, history_capacity=4)
    assert client.get("/v1/history").json()["count"] == 4
    assert client.get("/v1/history", params={"limit": 5}).status_code == 422


def test_openapi_lists_the_endpoints(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    paths = schema["paths"]
    for path in ("/healthz", "/v1/stats", "/v1/layers", "/v1/budget", "/v1/history", "/metrics"):
        assert path in paths, path
    assert set(paths["/v1/budget"]) == {"get", "put"}
    body = paths["/v1/budget"]["put"]["requestBody"]["content"]["application/json"]["schema"]
    assert "target" in body["required"]
    assert any(s.get("HTTPBearer") is not None for s in paths["/v1/budget"]["put"].get("security", []))
    assert client.get("/docs").status_code == 200


def test_each_app_is_independent(make_client: Callable[..., TestClient]) -> None:
    a = make_client(StaticView({"step": 1}))
    b = make_client(StaticView({"step": 2}))
    assert a.get("/healthz").json()["step"] == 1 and b.get("/healthz").json()["step"] == 2
    assert "memctl_steps_total 1.0" in a.get("/metrics").text
    assert "memctl_steps_total 2.0" in b.get("/metrics").text
