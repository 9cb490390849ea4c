"""uvicorn's h11 protocol with a deadline on reading each request.

NOTE [ Half-open requests ]
uvicorn times out idle keep-alive connections (``timeout_keep_alive``) but not a request
that is being read: a client that sends half its headers, or a ``Content-Length`` and
then part of the body, holds its connection (and, for the body, a request task) for as
long as it stays connected; enough of them exhaust the server. This protocol gives every
request a deadline from its first byte (or from the connection, for a client that sends
nothing): when the request is not fully received by then, the server answers 408 if it
has not started a response and closes the connection. The deadline is not extended by
more bytes, so trickling a byte at a time does not keep a connection alive either.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["deadline_protocol"]


def deadline_protocol(request_timeout_s: float) -> type[asyncio.Protocol]:
    """An :class:`H11Protocol` subclass that closes requests not received within ``request_timeout_s``."""

    class DeadlineH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            self._arm()
            super().data_received(data)
            if self.conn.their_state is h11.DONE or self.transport.is_closing():
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is not h11.DONE and self.conn.trailing_data[0]:
                self._arm()  # a pipelined request, partly received, is read from the buffer

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(request_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self.transport.is_closing() or self.conn.their_state is h11.DONE:
                return
            if self.cycle is None or not self.cycle.response_started:
                body = json.dumps({"detail": f"the request was not received within {request_timeout_s:g} s"})
                self.transport.write(
                    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                    b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
                    + body.encode()
                )
            self.transport.close()

    return DeadlineH11Protocol
