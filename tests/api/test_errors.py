"""Bad input is a 4xx with a sentence, never a 5xx; unexpected failures are a clean JSON 500."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from memctl.api import StaticView

from .conftest import AUTH, TOKEN


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"target": -1}, "must be positive"),
        ({"target": 0}, "must be positive"),
        ({"target": "0GiB"}, "must be positive"),
        ({"target": "9999TiB"}, "more than any device holds"),
        ({"target": 10**30}, "more than any device holds"),
        ({"target": "200GiB"}, "more than the device's"),
        ({"target": "12XB"}, "unknown unit 'XB'"),
        ({"target": "ten gigs"}, "could not be parsed"),
        ({"target": "150%"}, "outside (0%, 100%]"),
        ({"target": "-5%"}, "is negative"),
        ({"target": [1, 2]}, "has type list"),
        ({"target": True}, "is a bool"),
        ({"target": {"size": 1}}, "has type dict"),
        ({"target": 1.5}, "not a whole number"),
        ({}, "target: Field required"),
        ({"targt": "1GiB"}, "targt: Extra inputs are not permitted"),
        ([{"target": "1GiB"}], "body: Input should be an object"),
        ("10GiB", "body: Input should be an object"),
    ],
)
def test_bad_budget_bodies_are_422(client: TestClient, body: Any, needle: str) -> None:
    r = client.put("/v1/budget", json=body, headers=AUTH)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert isinstance(detail, str) and needle in detail
    assert client.get("/v1/budget").json()["pending"] is None  # nothing was queued


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b'{"target": ', "Invalid JSON"),
        (b"not json", "Invalid JSON"),
        (b"\xff\xfe\x00", "Invalid JSON"),
        (b'{"target": NaN}', "not a finite number"),
        (b'{"target": 1e400}', "not a finite number"),
        (b"", "body is empty"),
        (b"   ", "body is empty"),
    ],
)
def test_bad_raw_bodies_are_422(client: TestClient, raw: bytes, needle: str) -> None:
    r = client.put("/v1/budget", content=raw, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert needle in r.json()["detail"]


@pytest.mark.parametrize(
    ("headers", "status", "needle"),
    [
        ({}, 401, "Authorization: Bearer"),
        ({"Authorization": f"Basic {TOKEN}"}, 401, "Authorization: Bearer"),
        ({"Authorization": "Bearer"}, 401, "Authorization: Bearer"),
        ({"Authorization": "Bearer wrong"}, 403, "wrong"),
        ({"Authorization": f"Bearer {TOKEN}x"}, 403, "wrong"),
        ({"Authorization": "Bearer caf\u00e9".encode("latin-1")}, 403, "wrong"),  # non-ASCII bytes
    ],
)
def test_token_is_required_for_put(client: TestClient, headers: dict[str, Any], status: int,
                                   needle: str) -> None:
    r = client.put("/v1/budget", json={"target": "1GiB"}, headers=headers)
    assert r.status_code == status and needle in r.json()["detail"]
    if status == 401:
        assert r.headers["www-authenticate"] == "Bearer"
    assert client.get("/v1/budget").json()["pending"] is None


def test_token_is_checked_before_the_body(client: TestClient) -> None:
    r = client.put("/v1/budget", content=b"{broken", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 403


def test_reads_need_no_token(client: TestClient) -> None:
    assert client.get("/v1/stats").status_code == 200


def test_oversized_body_is_413(make_client: Callable[..., TestClient], view: StaticView) -> None:
    client = make_client(view, token=TOKEN, max_body_bytes=256)
    big = {"target": "1GiB", "pad": "x" * 300}
    r = client.put("/v1/budget", json=big, headers=AUTH)
    assert r.status_code == 413 and "exceeds the limit of 256 bytes" in r.json()["detail"]


def test_body_larger_than_its_content_length_is_413(make_client: Callable[..., TestClient],
                                                    view: StaticView) -> None:
    client = make_client(view, token=TOKEN, max_body_bytes=256)

    def chunks() -> Any:
        yield b'{"target": "1GiB", "pad": "'
        yield b"x" * 400
        yield b'"}'

    r = client.put("/v1/budget", content=chunks(), headers=AUTH)  # chunked: no Content-Length
    assert r.status_code == 413


@pytest.mark.parametrize("limit", ["0", "-1", "601", "abc", "1.5", "", "99999999999999999999999"])
def test_bad_history_limit_is_422(client: TestClient, limit: str) -> None:
    r = client.get("/v1/history", params={"limit": limit})
    assert r.status_code == 422 and r.json()["detail"].startswith("limit: ")


def test_unknown_paths_and_methods(client: TestClient) -> None:
    assert client.get("/v1/nothing").status_code == 404
    r = client.delete("/v1/budget", headers=AUTH)
    assert r.status_code == 405 and r.json()["detail"] == "Method Not Allowed"
    assert client.post("/v1/stats").status_code == 405


class _BrokenView(StaticView):
    def snapshot(self) -> Any:
        raise RuntimeError("state lost")

    def request_budget(self, value: object) -> Any:
        raise RuntimeError("queue lost")


@pytest.mark.parametrize(("method", "path"), [("get", "/healthz"), ("get", "/v1/stats"), ("get", "/metrics"),
                                              ("put", "/v1/budget")])
def test_view_failures_become_a_json_500(make_client: Callable[..., TestClient], method: str,
                                         path: str, caplog: pytest.LogCaptureFixture) -> None:
    client = make_client(_BrokenView())
    r = client.request(method, path, json={"target": "1GiB"} if method == "put" else None)
    assert r.status_code == 500
    assert r.json() == {"detail": "internal error (RuntimeError); see the server's log"}
    assert "unhandled error" in caplog.text


def test_a_malformed_snapshot_is_a_500_not_a_crash(make_client: Callable[..., TestClient]) -> None:
    r = make_client(StaticView({"step": "not a number"})).get("/v1/stats")
    assert r.status_code == 500 and "ValidationError" in r.json()["detail"]


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"token": ""}, "token"),
        ({"token": "has space"}, "token"),
        ({"token": 123}, "token"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
        ({"max_body_bytes": 10**9}, "max_body_bytes"),
        ({"history_capacity": 0}, "history_capacity"),
    ],
)
def test_create_app_validates_options(options: dict[str, Any], needle: str) -> None:
    from memctl.api import create_app
    from memctl.errors import ConfigError

    with pytest.raises(ConfigError, match=needle):
        create_app(StaticView(), **options)
