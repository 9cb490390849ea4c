"""Hostile input to the service: huge numbers, foreign Host headers, reads without the token,
half-open requests, /docs with no internet, and 405s that list every method."""

from __future__ import annotations

import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient

from memctl.api import StaticView, create_app, serve
from memctl.errors import ConfigError

from .conftest import AUTH, DEVICE_TOTAL, TOKEN


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b'{"target": "1' + b"0" * 400 + b'"}', "more than any device holds"),
        (b'{"target": "' + b"9" * 310 + b'GiB"}', "more than any device holds"),
        (b'{"target": 1' + b"0" * 400 + b"}", "more than any device holds"),
        (b'{"target": -1' + b"0" * 400 + b"}", "must be positive"),
        (b'{"target": "1000TiB"}', "more than the device's 80.00 GiB"),
        (b'{"target": "0.0000000001%"}', "is 0 bytes of this device's"),
        (b'{"target": "1.5"}', "not a whole number of bytes"),
        (b'{"target": "10Gb"}', "means bits"),
        (b'{"target": "-5GiB"}', "is negative"),
    ],
)
def test_huge_and_odd_budgets_are_422_not_500(client: TestClient, raw: bytes, needle: str) -> None:
    r = client.put("/v1/budget", content=raw, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert needle in r.json()["detail"]
    assert client.get("/v1/budget").json()["pending"] is None


# --- Host header (DNS rebinding) ------------------------------------------------------------

@pytest.mark.parametrize("host", ["evil.example", "evil.example:8765", "127.0.0.1.evil.example",
                                  "localhost.evil.example", "10.0.0.5"])
def test_a_foreign_host_is_refused_before_anything_runs(make_client: Callable[..., TestClient],
                                                         host: str) -> None:
    view = StaticView(device_total_bytes=DEVICE_TOTAL)
    client = make_client(view)  # the default: tokenless, loopback names only
    r = client.put("/v1/budget", json={"target": "1GiB"}, headers={"Host": host})
    assert r.status_code == 421 and "allowed_hosts" in r.json()["detail"]
    assert client.get("/v1/stats", headers={"Host": host}).status_code == 421
    assert view.budget_info()["pending"] is None


@pytest.mark.parametrize("host", ["localhost", "localhost:8765", "127.0.0.1", "127.0.0.1:1",
                                  "[::1]", "[::1]:8765", "LOCALHOST"])
def test_loopback_hosts_are_served(make_client: Callable[..., TestClient], host: str) -> None:
    client = make_client(StaticView(device_total_bytes=DEVICE_TOTAL))
    assert client.get("/healthz", headers={"Host": host}).status_code == 200
    assert client.put("/v1/budget", json={"target": "1GiB"}, headers={"Host": host}).status_code == 200


def test_allowed_hosts_is_configurable(make_client: Callable[..., TestClient]) -> None:
    client = make_client(StaticView(), allowed_hosts=["trainer.example.org"])
    assert client.get("/healthz", headers={"Host": "trainer.example.org:8765"}).status_code == 200
    assert client.get("/healthz", headers={"Host": "localhost"}).status_code == 421
    anyhost = make_client(StaticView(), allowed_hosts=["*"])
    assert anyhost.get("/healthz", headers={"Host": "whatever.example"}).status_code == 200
    for bad in ("localhost", [""], [3]):
        with pytest.raises(ConfigError, match="allowed_hosts"):
            create_app(StaticView(), allowed_hosts=bad)  # type: ignore[arg-type]


# --- reads behind the token -----------------------------------------------------------------

def test_token_for_reads(make_client: Callable[..., TestClient]) -> None:
    client = make_client(StaticView(), token=TOKEN, token_for_reads=True)
    for path in ("/v1/stats", "/v1/layers", "/v1/budget", "/v1/history", "/metrics"):
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 403, path
        assert client.get(path, headers=AUTH).status_code == 200, path
    assert client.get("/healthz").status_code == 200  # liveness probes carry no token
    with pytest.raises(ConfigError, match="token_for_reads=True needs a token"):
        create_app(StaticView(), token_for_reads=True)


def _get(url: str, token: str | None = None, host: str | None = None) -> int:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    if host is not None:
        request.add_header("Host", host)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return err.code


def test_off_loopback_reads_need_the_token_by_default_and_loopback_reads_do_not() -> None:
    with serve(StaticView(), host="0.0.0.0", token=TOKEN) as handle:
        url = f"http://127.0.0.1:{handle.port}"
        assert _get(url + "/v1/stats") == 401
        assert _get(url + "/v1/stats", token=TOKEN) == 200
        assert _get(url + "/healthz") == 200
        assert _get(url + "/healthz", host=socket.gethostname()) == 200  # the machine's own name
        assert _get(url + "/healthz", host="evil.example") == 421
    with serve(StaticView(), token=TOKEN) as handle:
        assert _get(handle.url + "/v1/stats") == 200
    with serve(StaticView(), token=TOKEN, token_for_reads=True) as handle:
        assert _get(handle.url + "/v1/stats") == 401


# --- half-open requests ---------------------------------------------------------------------

def _closed_within(port: int, first: bytes, limit_s: float) -> tuple[float, bytes]:
    """Send ``first``, then nothing; return when the server closes, and what it answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=limit_s) as sock:
        t0 = time.monotonic()
        if first:
            sock.sendall(first)
        answer = b""
        try:
            while chunk := sock.recv(4096):
                answer += chunk
        except TimeoutError:
            pytest.fail(f"the server kept a half-open request open for more than {limit_s} s")
        except ConnectionResetError:
            pass
        return time.monotonic() - t0, answer


@pytest.mark.parametrize(
    "first",
    [
        b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n",  # headers never finished
        b"PUT /v1/budget HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n{\"target\": ",  # body never finished
        b"",  # connected, sent nothing
    ],
)
def test_half_open_requests_time_out(first: bytes) -> None:
    with serve(StaticView(), request_timeout_s=0.5) as handle:
        elapsed, answer = _closed_within(handle.port, first, limit_s=5.0)
        assert elapsed < 4.0
        if first:
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert _get(handle.url + "/healthz") == 200  # the server still answers others


def test_trickling_a_request_does_not_extend_its_deadline() -> None:
    request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 100  # 5 s at 20 bytes/s
    with serve(StaticView(), request_timeout_s=0.5) as handle, \
            socket.create_connection(("127.0.0.1", handle.port), timeout=5) as sock:
        t0 = time.monotonic()
        for byte in request:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break  # closed by the server
            time.sleep(0.05)
            if time.monotonic() - t0 > 3.0:
                break
        try:
            answer = sock.recv(4096)
        except OSError:
            answer = b""
        assert time.monotonic() - t0 < 4.0
        assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:100]


def test_the_deadline_leaves_keep_alive_connections_alone() -> None:
    import http.client

    with serve(StaticView(), request_timeout_s=0.5) as handle:
        conn = http.client.HTTPConnection("127.0.0.1", handle.port, timeout=5)
        try:
            for _ in range(2):
                conn.request("GET", "/healthz")
                response = conn.getresponse()
                assert response.status == 200
                response.read()
                time.sleep(1.0)  # idle longer than the request deadline, shorter than keep-alive
        finally:
            conn.close()


def test_serve_validates_the_new_options() -> None:
    for kwargs in ({"request_timeout_s": 0}, {"request_timeout_s": float("nan")}, {"max_connections": 0}):
        with pytest.raises(ConfigError):
            serve(StaticView(), **kwargs)  # type: ignore[arg-type]


# --- /docs with no internet -----------------------------------------------------------------

def test_docs_are_self_contained(client: TestClient) -> None:
    r = client.get("/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert "openapi.json" in page
    assert not re.search(r"https?://", page), "the page must not load anything from the internet"
    for ref in re.findall(r'(?:src|href)\s*=\s*"([^"]*)"', page):
        assert not ref.startswith("//"), ref
    assert client.get("/openapi.json").json()["info"]["title"] == "memctl"
    assert client.get("/redoc").status_code == 404  # ReDoc needs a CDN: not served


# --- 405 ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("method", "path", "allowed"),
                         [("delete", "/v1/budget", {"GET", "PUT"}),
                          ("post", "/v1/budget", {"GET", "PUT"}),
                          ("post", "/v1/stats", {"GET"})])
def test_405_lists_every_allowed_method(client: TestClient, method: str, path: str,
                                        allowed: set[str]) -> None:
    r = client.request(method, path, headers=AUTH)
    assert r.status_code == 405
    assert {m.strip() for m in r.headers["allow"].split(",")} == allowed
