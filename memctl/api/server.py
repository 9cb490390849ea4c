"""Running the HTTP service in the training process: uvicorn on a daemon thread."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from memctl.api.view import ControllerView
from memctl.errors import ConfigError, MemctlError

__all__ = ["ServerHandle", "serve"]

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
_TOKEN_ENV = "MEMCTL_TOKEN"

# NOTE [ uvicorn on a thread ]
# uvicorn.Server.run() runs its own asyncio loop, so a daemon thread can host it beside the
# training loop; signal handlers are only installed on the main thread, so Ctrl-C still
# reaches training. Two traps: a bind failure makes uvicorn call sys.exit() inside the
# thread, which ends the thread silently (SystemExit is not reported for threads) — so the
# caller polls server.started *and* thread.is_alive(), and the thread's target keeps the
# SystemExit's cause (the OSError of the bind) for the caller's message; and port 0 picks a
# free port that is only known once bound — it is read back from the listening socket. Training code that
# holds the GIL in long Python loops delays answers by tens of milliseconds; NumPy and
# PyTorch kernels release it.
# The threads of a serving controller: docs/design.md, "Threading model".


class ServerHandle:
    """A running server: ``.url``, ``.host``, ``.port``; ``close()`` stops it (also as a context manager)."""

    def __init__(self, server: Any, thread: threading.Thread, host: str, port: int) -> None:
        self._server = server
        self._thread = thread
        self._host = host
        self._port = port
        self._lock = threading.Lock()
        self._closed = False

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234`` (IPv6 hosts in brackets)."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}"

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def close(self, timeout: float = 5.0) -> None:
        """Ask the server to exit and wait up to ``timeout`` s (then force it); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ServerHandle({self.url!r}, running={self.running})"


def serve(view: ControllerView, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None,
          log_level: str = "warning", max_body_bytes: int = 4096, history_capacity: int = 600,
          startup_timeout_s: float = 10.0, allowed_hosts: Sequence[str] | None = None,
          token_for_reads: bool | None = None, request_timeout_s: float = 10.0,
          max_connections: int = 64) -> ServerHandle:
    """Serve :func:`~memctl.api.create_app` over ``view`` on a daemon thread; return once listening.

    Args:
        view: The controller's read-only view.
        host: Address to bind. Anything but a loopback address needs a token.
        port: Port to bind; 0 picks a free one (read it back from ``handle.port``).
        token: Bearer token for ``PUT`` requests; when ``None``, the ``MEMCTL_TOKEN``
            environment variable is used if set.
        log_level: uvicorn's log level (``"warning"`` keeps access logs quiet).
        max_body_bytes, history_capacity: passed to :func:`~memctl.api.create_app`.
        startup_timeout_s: How long to wait for the socket to listen.
        allowed_hosts: Host names the server answers to (NOTE [ Host header ] in
            :mod:`memctl.api.app`); ``None``: the loopback names, ``host`` itself, and when
            ``host`` is a wildcard (``0.0.0.0``, ``::``) this machine's names and addresses.
            ``["*"]`` answers any Host.
        token_for_reads: Require the token for reads as well (``/v1/*``, ``/metrics``);
            ``None``: on when ``host`` is not a loopback address, off on loopback.
        request_timeout_s: A request not fully received this long after its first byte
            gets 408 and its connection is closed (NOTE [ Half-open requests ]).
        max_connections: Connections served at once; beyond it new ones get 503.

    Raises:
        ConfigError: a bad argument, or a non-loopback ``host`` without a token.
        MemctlError: the server could not bind (port in use, address not on this machine)
            or did not start in time.
    """
    import uvicorn

    from memctl.api._protocol import deadline_protocol
    from memctl.api.app import create_app

    if not isinstance(host, str) or not host.strip():
        raise ConfigError(f"host={host!r} must be an address such as '127.0.0.1' or '0.0.0.0'")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"port={port!r} must be an int in [0, 65535] (0 picks a free port)")
    if log_level not in _LOG_LEVELS:
        raise ConfigError(f"log_level={log_level!r} is not one of {', '.join(_LOG_LEVELS)}")
    if token is None:
        token = os.environ.get(_TOKEN_ENV) or None
    if token is None and not _is_loopback(host):
        raise ConfigError(
            f"refusing to serve on {host!r} without a token: anyone who can reach that address could "
            f"change the memory budget. Pass token=... to serve(), or set the {_TOKEN_ENV} environment "
            "variable, or bind to host='127.0.0.1'"
        )
    if isinstance(request_timeout_s, bool) or not isinstance(request_timeout_s, int | float) \
            or not 0 < request_timeout_s <= 3600:
        raise ConfigError(f"request_timeout_s={request_timeout_s!r} must be a number of seconds in (0, 3600]")
    if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
        raise ConfigError(f"max_connections={max_connections!r} must be a positive int")
    if token_for_reads is None:
        token_for_reads = token is not None and not _is_loopback(host)
    if allowed_hosts is None:
        allowed_hosts = _default_hosts(host)
    app = create_app(view, token=token, max_body_bytes=max_body_bytes, history_capacity=history_capacity,
                     allowed_hosts=allowed_hosts, token_for_reads=token_for_reads)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            http=deadline_protocol(float(request_timeout_s)),
                            timeout_keep_alive=5, limit_concurrency=max_connections)
    server = uvicorn.Server(config)
    failures: list[BaseException] = []

    def run() -> None:
        try:
            server.run()
        except SystemExit as exc:  # uvicorn's report of a failed startup
            failures.append(exc.__context__ or exc)

    thread = threading.Thread(target=run, name=f"memctl-api-{host}:{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive():
            cause = failures[0] if failures else None
            why = str(cause) if isinstance(cause, OSError) else _bind_diagnosis(host, port)
            raise MemctlError(
                f"the memctl HTTP server could not start on {host}:{port}: {why}. "
                "Choose another port (port=0 picks a free one) or an address of this machine"
            )
        if time.monotonic() > deadline:
            server.should_exit = True
            thread.join(2.0)
            raise MemctlError(
                f"the memctl HTTP server did not start on {host}:{port} within {startup_timeout_s} s; "
                "see uvicorn's log (log_level='info') for why"
            )
        time.sleep(0.01)
    bound = int(server.servers[0].sockets[0].getsockname()[1])
    return ServerHandle(server, thread, host, bound)


def _default_hosts(host: str) -> list[str]:
    """The Host names served by default: loopback, the bound address, and for a wildcard
    address this machine's own names and addresses (none of which a rebinding page can use)."""
    from memctl.api.app import LOOPBACK_HOSTS

    names = [*LOOPBACK_HOSTS, host.strip().strip("[]")]
    if host.strip().strip("[]") in ("0.0.0.0", "::", ""):
        with contextlib.suppress(OSError):
            hostname = socket.gethostname()
            names += [hostname, socket.getfqdn()]
            for info in socket.getaddrinfo(hostname, None):
                names.append(str(info[4][0]))
    return [n for n in dict.fromkeys(names) if n]


def _is_loopback(host: str) -> bool:
    name = host.strip().strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def _bind_diagnosis(host: str, port: int) -> str:
    """Why binding (host, port) fails, found by trying it (the server thread's error is not kept)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return f"the address does not resolve ({exc})"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            return f"binding failed ({exc})"
    return "the server thread exited during startup (see the 'uvicorn.error' log)"
