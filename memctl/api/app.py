"""The FastAPI app factory: :func:`create_app` over a :class:`~memctl.api.view.ControllerView`."""

import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from memctl._version import __version__
from memctl.api.dashboard import add_pages
from memctl.api.metrics import build_registry
from memctl.api.models import (
    BudgetChangeResponse,
    BudgetInfoResponse,
    BudgetRequest,
    ErrorResponse,
    HealthResponse,
    HistoryResponse,
    LayersResponse,
    RanksResponse,
    StatsResponse,
)
from memctl.api.ranks import rank_rows
from memctl.api.view import ControllerView
from memctl.controller.budget import parse_budget
from memctl.errors import ConfigError, MemctlError

__all__ = ["LOOPBACK_HOSTS", "create_app"]

# This module has no ``from __future__ import annotations``: FastAPI reads the endpoints'
# annotations at runtime, and they refer to create_app's local variables.

_log = logging.getLogger("memctl.api")

_STATS_EVENTS = 50  # events listed by /v1/stats; the snapshot's own list is bounded too
_MAX_BODY_LIMIT = 1 << 20
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (401, 403, 413, 421, 422, 500, 503)
}
#: Host names served when ``allowed_hosts`` is not given: NOTE [ Host header ].
LOOPBACK_HOSTS: tuple[str, ...] = ("localhost", "127.0.0.1", "::1")

# NOTE [ What the service may do ]
# The app holds nothing but the view: it reads snapshots and queues budget requests, so it
# never touches CUDA, the model or the controller's locks beyond the view's own methods.
# Every path a client controls ends in a 4xx: the body is capped before parsing (413),
# the token is checked before the body is read (401/403), the body is parsed by hand
# (so curl's default form content type works and a bad body is a 422 with a sentence,
# not a 400 from the framework), and budgets go through parse_budget before the view.
# Anything unexpected becomes a JSON 500 in _GuardMiddleware, never a dropped connection.
# The status codes a client sees: docs/api.md, "Errors".

# NOTE [ Host header ]
# A tokenless server on 127.0.0.1 is reachable from the user's own browser, so a web page
# can use DNS rebinding (its name re-resolved to 127.0.0.1) to send requests that the
# browser considers same-origin: without a check it could read the state and change the
# budget. Such requests carry the attacker's name in Host, so the app answers only Host
# names it was told are its own: the loopback names by default, the bound address and
# the machine's names when serve() binds elsewhere, or any list given as allowed_hosts
# ("*" turns the check off). Others get 421 before any handler runs.

# NOTE [ Cheap reads ]
# Polling must not slow training. The read handlers are ``async`` (no thread hand-off per
# request), and the bodies of /v1/stats, /v1/layers and /metrics are rendered once per
# published snapshot and reused until the controller publishes the next one: the snapshot
# is immutable and replaced whole at each step boundary, so its identity is the cache key.


class _SnapshotCache:
    """Rendered response bodies, valid while the view's snapshot object is the same."""

    def __init__(self) -> None:
        self._snapshot: object = None
        self._bodies: dict[str, bytes] = {}

    def get(self, snapshot: object, name: str, render: Callable[[], bytes]) -> bytes:
        if snapshot is not self._snapshot:
            self._snapshot, self._bodies = snapshot, {}
        body = self._bodies.get(name)
        if body is None:
            body = self._bodies[name] = render()
        return body


def create_app(view: ControllerView, *, token: str | None = None, max_body_bytes: int = 4096,
               history_capacity: int = 600, allowed_hosts: Sequence[str] | None = None,
               token_for_reads: bool = False) -> FastAPI:
    """A fresh FastAPI app serving ``view``.

    Args:
        view: The controller's read-only view (:class:`~memctl.api.view.ControllerView`).
        token: When set, ``PUT`` requests need ``Authorization: Bearer <token>`` (401 when
            missing, 403 when wrong). Configuration comes only from arguments;
            :func:`~memctl.api.serve` reads ``MEMCTL_TOKEN``.
        max_body_bytes: Larger request bodies get 413, by ``Content-Length`` and by the
            bytes actually sent.
        history_capacity: The largest ``limit`` ``/v1/history`` accepts: the monitor's capacity.
        allowed_hosts: Host names (or addresses) this app answers to, as in the ``Host``
            header, without port; ``None`` means :data:`LOOPBACK_HOSTS`, ``["*"]`` any
            host. Other hosts get 421 (NOTE [ Host header ]).
        token_for_reads: With a ``token``, also require it for every read except
            ``/healthz`` and the static ``/docs`` and ``/openapi.json``: ``/v1/*`` and ``/metrics``.

    Raises:
        ConfigError: an argument is out of range.
    """
    _check_token(token)
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) \
            or not 64 <= max_body_bytes <= _MAX_BODY_LIMIT:
        raise ConfigError(f"max_body_bytes={max_body_bytes!r} must be an int in [64, {_MAX_BODY_LIMIT}]")
    if isinstance(history_capacity, bool) or not isinstance(history_capacity, int) or history_capacity < 1:
        raise ConfigError(
            f"history_capacity={history_capacity!r} must be a positive int (the monitor's capacity)"
        )

    hosts = _check_hosts(allowed_hosts)
    if not isinstance(token_for_reads, bool):
        raise ConfigError(f"token_for_reads={token_for_reads!r} must be True or False")
    if token_for_reads and token is None:
        raise ConfigError("token_for_reads=True needs a token (token=... or MEMCTL_TOKEN)")

    guard = [Depends(_bearer_guard(token))] if token is not None else []
    read_guard = guard if token_for_reads else []
    app = FastAPI(
        title="memctl",
        version=__version__,
        description="Live state and control of a memctl Controller: compressed activations under a budget.",
        responses=_ERRORS,
        docs_url=None,  # served offline by add_pages (memctl/api/dashboard.py)
        redoc_url=None,
    )
    app.add_middleware(_GuardMiddleware, max_body_bytes=max_body_bytes)
    app.add_middleware(_HostMiddleware, allowed=hosts)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    registry = build_registry(view)
    registry_all = build_registry(view, all_ranks=True)
    add_pages(app, token_required=token is not None)

    cache = _SnapshotCache()

    def cached_json(name: str, render: Callable[[Mapping[str, Any]], bytes]) -> Response:
        snap = view.snapshot()
        return Response(cache.get(snap, name, lambda: render(snap)), media_type="application/json")

    @app.get("/healthz", response_model=HealthResponse, tags=["service"])
    async def healthz() -> dict[str, Any]:
        """Liveness, and the last step the controller published."""
        return {"status": "ok", "step": view.snapshot()["step"]}

    def render_stats(snap: Mapping[str, Any]) -> bytes:
        body = dict(snap)
        body["events"] = list(body["events"])[-_STATS_EVENTS:]
        return StatsResponse.model_validate(body).model_dump_json().encode()

    @app.get("/v1/stats", dependencies=read_guard, response_model=StatsResponse, tags=["state"])
    async def stats() -> Response:
        """Step, budget, device memory, activation bytes and ratio, last allocation, recent events."""
        return cached_json("stats", render_stats)

    def render_layers(snap: Mapping[str, Any]) -> bytes:
        body = {"step": snap["step"], "layers": list(snap["layers"])}
        return LayersResponse.model_validate(body).model_dump_json().encode()

    @app.get("/v1/layers", dependencies=read_guard, response_model=LayersResponse, tags=["state"])
    async def layers() -> Response:
        """Per-layer bits or error bound, raw and packed bytes, sensitivity."""
        return cached_json("layers", render_layers)

    def render_ranks(snap: Mapping[str, Any]) -> bytes:
        body = {"step": snap["step"], "rank": snap.get("rank"), "world_size": snap.get("world_size", 1),
                "agreed": snap.get("agreed", True), "ranks": rank_rows(snap)}
        return RanksResponse.model_validate(body).model_dump_json().encode()

    @app.get("/v1/ranks", dependencies=read_guard, response_model=RanksResponse, tags=["state"])
    async def ranks() -> Response:
        """Every rank of the job: step, bits, ratio, bytes, memory, agreement, batch size, budget
        (gathered at each allocation step; one row without a process group)."""
        return cached_json("ranks", render_ranks)

    @app.get("/v1/budget", response_model=BudgetInfoResponse, tags=["budget"], dependencies=read_guard)
    async def get_budget() -> dict[str, Any]:
        """The budget in force and any change queued for the next step."""
        return dict(view.budget_info())

    @app.put("/v1/budget", response_model=BudgetChangeResponse, tags=["budget"], dependencies=guard,
             openapi_extra=_budget_body_schema())
    async def put_budget(request: Request) -> dict[str, Any]:
        """Queue a new budget (bytes, "10GiB", "75%", or null for no limit) for the next step boundary."""
        body = _parse_budget_body(await request.body())
        try:
            parse_budget(body.target)
            result = await run_in_threadpool(view.request_budget, body.target)
        except ConfigError as exc:  # BudgetError included
            raise HTTPException(status_code=422, detail=f"target: {exc}") from None
        except MemctlError as exc:
            raise HTTPException(status_code=503, detail=str(exc)) from None
        return dict(result)

    @app.get("/v1/history", dependencies=read_guard, response_model=HistoryResponse, tags=["state"])
    async def history(
        limit: Annotated[int | None, Query(ge=1, le=history_capacity,
                                           description="most recent samples to return")] = None,
    ) -> dict[str, Any]:
        """The monitor's samples, oldest first."""
        samples = [dict(s) for s in view.history(limit)][-history_capacity:]
        return {"count": len(samples), "samples": samples}

    @app.get("/metrics", tags=["service"], response_class=Response, dependencies=read_guard,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}, OPENMETRICS_CONTENT_TYPE: {}},
                              "description": "Prometheus text format, or OpenMetrics when the Accept "
                                             "header asks for application/openmetrics-text"}})
    async def metrics(
        request: Request,
        ranks: Annotated[Literal["all"] | None, Query(
            description="'all': add the other ranks' series from the aggregated view (serve it on rank 0)"
        )] = None,
    ) -> Response:
        """Prometheus exposition of the controller's state (``memctl_*`` metrics)."""
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        chosen = registry_all if ranks == "all" else registry
        body = cache.get(view.snapshot(), f"metrics:{ranks}:{content_type}", lambda: encoder(chosen))
        return Response(body, headers={"Content-Type": content_type})

    return app


def _check_hosts(allowed_hosts: Sequence[str] | None) -> frozenset[str] | None:
    """The allowed Host names, normalised; ``None`` for any host ("*")."""
    if allowed_hosts is None:
        allowed_hosts = LOOPBACK_HOSTS
    if isinstance(allowed_hosts, str) or not all(isinstance(h, str) and h.strip() for h in allowed_hosts):
        raise ConfigError(
            f"allowed_hosts={allowed_hosts!r} must be a list of host names such as ['localhost', "
            "'trainer.example.org'], or ['*'] for any host"
        )
    if "*" in allowed_hosts:
        return None
    return frozenset(_host_name(h) for h in allowed_hosts)


def _host_name(host: str) -> str:
    """A Host header's name, lower case, without port or IPv6 brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.rstrip(".")


def _check_token(token: str | None) -> None:
    if token is None:
        return
    if not isinstance(token, str) or not token or not all(33 <= ord(c) <= 126 for c in token):
        shown = f"a string of length {len(token)}" if isinstance(token, str) else f"a {type(token).__name__}"
        raise ConfigError(
            f"token must be a non-empty string of visible ASCII characters (no spaces), as sent in "
            f"'Authorization: Bearer <token>'; got {shown}"
        )


def _bearer_guard(token: str) -> Callable[..., Awaitable[None]]:
    expected = token.encode("ascii")
    bearer = HTTPBearer(auto_error=False, description="the token given to create_app / serve (MEMCTL_TOKEN)")

    async def require_token(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> None:
        if credentials is None:
            raise HTTPException(
                status_code=401,
                detail="this endpoint needs 'Authorization: Bearer <token>' (the server's MEMCTL_TOKEN)",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not hmac.compare_digest(credentials.credentials.encode("utf-8", "surrogateescape"), expected):
            raise HTTPException(status_code=403, detail="the bearer token is wrong")

    return require_token


def _budget_body_schema() -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": BudgetRequest.model_json_schema()}},
        }
    }


def _parse_budget_body(raw: bytes) -> BudgetRequest:
    if not raw.strip():
        raise HTTPException(
            status_code=422, detail='the request body is empty; send JSON such as {"target": "10GiB"}'
        )
    try:
        return BudgetRequest.model_validate_json(raw)
    except ValidationError as exc:
        errors = [
            {"loc": ["body", *err["loc"]], "msg": err["msg"], "type": err["type"]} for err in exc.errors()
        ]
        raise RequestValidationError(errors) from None


def _describe_errors(errors: Sequence[Mapping[str, Any]]) -> str:
    parts = []
    in_body = False
    for err in errors:
        loc = list(err.get("loc", ()))
        in_body = in_body or loc[:1] == ["body"]
        field = ".".join(str(x) for x in loc if x not in ("body", "query", "path", "header"))
        field = field or (str(loc[0]) if loc else "request")
        parts.append(f"{field}: {err.get('msg', '')}")
    hint = ' (send JSON such as {"target": "10GiB"})' if in_body else ""
    return "; ".join(parts) + hint


async def _validation_error(request: Request, exc: Exception) -> Response:
    if not isinstance(exc, RequestValidationError):  # pragma: no cover - registered for that type only
        raise exc
    errors = [
        {"loc": [x if isinstance(x, int) else str(x) for x in e.get("loc", ())], "msg": str(e.get("msg", "")),
         "type": str(e.get("type", ""))}
        for e in exc.errors()
    ]
    return JSONResponse({"detail": _describe_errors(errors), "errors": errors}, status_code=422)


async def _http_error(request: Request, exc: Exception) -> Response:
    if not isinstance(exc, StarletteHTTPException):  # pragma: no cover - registered for that type only
        raise exc
    headers = getattr(exc, "headers", None)
    if exc.status_code == 405:  # Starlette lists only the first matching route's methods
        headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request))}
    return JSONResponse({"detail": str(exc.detail)}, status_code=exc.status_code, headers=headers)


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this request's path."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)  # PARTIAL: the path matches, the method does not
        route_methods = getattr(route, "methods", None)
        if match is not Match.NONE and route_methods:
            methods |= set(route_methods)
    return sorted(methods)


async def _send_json(send: Send, status: int, detail: str) -> None:
    response = JSONResponse({"detail": detail}, status_code=status)
    await send({"type": "http.response.start", "status": status, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


class _HostMiddleware:
    """Answers 421 to a Host this app was not told is its own (NOTE [ Host header ])."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str] | None) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.allowed is None:
            await self.app(scope, receive, send)
            return
        host = Headers(scope=scope).get("host")
        if host is None:
            await _send_json(send, 400, "the request has no Host header; HTTP/1.1 requires one")
            return
        if _host_name(host) not in self.allowed:
            shown = host if len(host) <= 100 else host[:100] + "..."
            await _send_json(
                send, 421,
                f"this server does not answer to Host {shown!r}; it answers to {sorted(self.allowed)}. "
                "Use one of those names in the URL, or start the server with allowed_hosts=[...] "
                "naming the host you use",
            )
            return
        await self.app(scope, receive, send)


class _GuardMiddleware:
    """Caps request bodies (413) and turns unexpected exceptions into a JSON 500."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        length = Headers(scope=scope).get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                await _send_json(send, 400, f"Content-Length {length!r} is not a number of bytes")
                return
            if int(length) > limit:
                detail = f"request body of {int(length)} bytes exceeds the limit of {limit} bytes"
                await _send_json(send, 413, detail)
                return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _send_json(send, 413, f"request body exceeds the limit of {limit} bytes")
                return
            chunks.append(chunk)
            more = bool(message.get("more_body", False))
        buffered: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal buffered
            if buffered is not None:
                message, buffered = buffered, None
                return message
            return await receive()

        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, replay, tracking_send)
        except Exception as exc:
            _log.exception("memctl API: unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            await _send_json(send, 500, f"internal error ({type(exc).__name__}); see the server's log")
