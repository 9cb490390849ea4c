"""A real uvicorn server on a thread, reached over TCP with urllib."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from memctl.api import ServerHandle, StaticView, serve
from memctl.errors import ConfigError, MemctlError

from .conftest import DEVICE_TOTAL, TOKEN


def _call(url: str, method: str = "GET", body: Any = None, token: str | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_live_server_round_trip() -> None:
    view = StaticView({"step": 3}, device_total_bytes=DEVICE_TOTAL)
    t0 = time.perf_counter()
    handle = serve(view, port=0, token=TOKEN)
    started = time.perf_counter() - t0
    try:
        assert isinstance(handle, ServerHandle) and handle.port > 0 and handle.host == "127.0.0.1"
        assert handle.url == f"http://127.0.0.1:{handle.port}" and handle.running
        assert _call(handle.url + "/healthz") == (200, {"status": "ok", "step": 3})
        status, body = _call(handle.url + "/v1/budget", "PUT", {"target": "10GiB"}, token=TOKEN)
        assert status == 200 and body["target_bytes"] == 10 * 2**30 and body["applies_at_step"] == 4
        assert _call(handle.url + "/v1/budget", "PUT", {"target": "10GiB"})[0] == 401
        assert _call(handle.url + "/v1/budget", "PUT", {"target": "12XB"}, token=TOKEN)[0] == 422
    finally:
        t1 = time.perf_counter()
        handle.close()
        stopped = time.perf_counter() - t1
    handle.close()  # idempotent
    assert not handle.running
    assert started < 5.0 and stopped < 3.0
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(handle.url + "/healthz", timeout=2)


def test_context_manager_and_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMCTL_TOKEN", "from-env")
    with serve(StaticView(device_total_bytes=DEVICE_TOTAL)) as handle:
        assert _call(handle.url + "/v1/budget", "PUT", {"target": 2**30})[0] == 401
        assert _call(handle.url + "/v1/budget", "PUT", {"target": 2**30}, token="from-env")[0] == 200
    assert not handle.running


def test_bind_failure_raises_in_the_caller() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        t0 = time.perf_counter()
        with pytest.raises(MemctlError, match=f"could not start on 127.0.0.1:{port}.*in use"):
            serve(StaticView(), port=port, log_level="critical")
        assert time.perf_counter() - t0 < 5.0


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "example.org"])
def test_non_loopback_without_token_is_refused(host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEMCTL_TOKEN", raising=False)
    with pytest.raises(ConfigError, match=rf"refusing to serve on '{host}' without a token.*MEMCTL_TOKEN"):
        serve(StaticView(), host=host)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [({"port": -1}, "port"), ({"port": 70000}, "port"), ({"host": ""}, "host"),
     ({"log_level": "loud"}, "log_level")],
)
def test_serve_validates_arguments(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        serve(StaticView(), **kwargs)


def test_loopback_names_need_no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    from memctl.api.server import _is_loopback

    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LOCALHOST"):
        assert _is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.1", "myhost"):
        assert not _is_loopback(host), host
