"""The gateway's HTTP/1.1 server: an asyncio protocol on httptools (llhttp, Node.js's parser,
as uvicorn uses it), one per client connection.

Why not a framework: at 256 streams the gateway shares two cores with the engines and the
clients, and every microsecond it spends per request is taken from them. bench_gateway
measured aiohttp's server and client at about 400 us of CPU per streamed request beyond what
a hop that only forwards bytes costs (bench/relay.py), most of it per SSE chunk (a buffered
reader, a task woken, a writer's checks). Here a request is parsed by httptools, handled by
one task, and a streamed answer is written to the socket by the engine connection's own
callback (dataplane/gateway/upstream.py), chunk by chunk, with no task in between.

What it does of HTTP/1.1, and only that: keep-alive and pipelined requests (answered in
order), request bodies by Content-Length or chunked (httptools decodes them), `Expect:
100-continue`, a body limit (413 once the body has been read, or at once when it was only
announced), a header limit (431), malformed requests (400, then the connection is closed),
answers with a Content-Length or chunked, and a connection that the client closes cancels
the task answering it (as aiohttp's handler_cancellation did).

A slow or half-sent request holds nothing for long (`Limits`, every one a GATEWAY_* setting):
its headers must arrive within `header_timeout_seconds` of its first byte, its body at no less
than `body_min_bytes_per_second` after `body_grace_seconds` (408, then the connection is
closed); a worker holds at most `max_connections` connections, at most
`max_connections_per_client` from one address, and at most `max_body_bytes_in_flight` of
request bodies being read or answered (503, then the connection is closed). 0 turns a limit off.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import httptools

log = logging.getLogger("dataplane.gateway")

MAX_HEADER_BYTES = 64 * 1024
# A connection that sends nothing for this long between requests is closed.
KEEP_ALIVE_SECONDS = 75.0
# Requests read ahead of the one being answered (pipelining) before reading pauses.
MAX_QUEUED = 8

_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}


@dataclass(frozen=True)
class Limits:
    """What slow, half-sent or too many connections may hold (module docstring); 0: off."""

    header_timeout_seconds: float = 10.0
    body_grace_seconds: float = 5.0
    body_min_bytes_per_second: float = 16 * 1024
    max_connections: int = 4096
    max_connections_per_client: int = 512
    max_body_bytes_in_flight: int = 256 * 1024 * 1024


class _Shared:
    """One worker's connections: the open ones, per client address, and the request-body bytes
    held (read, or being answered)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.connections: set[ServerConnection] = set()
        self.per_client: Counter[str] = Counter()
        self.body_bytes = 0


class ClientGone(Exception):  # noqa: N818 - a signal: the client closed its connection
    """Writing to the client failed: it has closed its connection."""


class Request:
    """One request as read: method and path as text, headers by lower-case name."""

    __slots__ = ("body", "body_too_large", "headers", "keep_alive", "method", "path")

    def __init__(self) -> None:
        self.method = ""
        self.path = ""
        self.headers: dict[str, str] = {}
        self.body = b""
        self.keep_alive = True
        self.body_too_large = False


Handler = Callable[[Request, "Exchange"], Awaitable[None]]


class Exchange:
    """The answer to one request: a whole response (`respond`), or a stream (`start`, then
    `write` any number of times, then `end`). Writes go straight to the socket; a stream's
    chunks are framed here (chunked transfer encoding)."""

    __slots__ = ("_connection", "_keep_alive", "_state", "on_gone", "on_writable")

    def __init__(self, connection: ServerConnection, keep_alive: bool):
        self._connection = connection
        self._keep_alive = keep_alive
        self._state = 0  # 0 nothing written, 1 streaming, 2 done
        # Called (no arguments) when the client's connection closes while this answers.
        self.on_gone: Callable[[], None] | None = None
        # Called with False when the client stops reading (its socket's buffer full), True
        # when it reads again: a stream passes it on to the engine's connection.
        self.on_writable: Callable[[bool], None] | None = None

    @property
    def gone(self) -> bool:
        return self._connection.closed

    @property
    def started(self) -> bool:
        return self._state != 0

    @property
    def finished(self) -> bool:
        return self._state == 2

    def respond(
        self,
        status: int,
        body: bytes,
        *,
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        if self._state != 0:
            raise RuntimeError("the answer has already begun")
        head = self._head(status, content_type, headers)
        head.append(b"Content-Length: %d\r\n\r\n" % len(body))
        head.append(body)
        self._state = 2
        self._connection.write(b"".join(head))
        self._connection.finished(self._keep_alive)

    def start(
        self, status: int, *, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        if self._state != 0:
            raise RuntimeError("the answer has already begun")
        head = self._head(status, content_type, headers)
        head.append(b"Transfer-Encoding: chunked\r\n\r\n")
        self._state = 1
        self._connection.write(b"".join(head))

    def write(self, data: bytes) -> None:
        """One chunk of a stream (nothing for empty data); ClientGone once the client left."""
        if self._connection.closed:
            raise ClientGone("the client closed its connection")
        if data:
            self._connection.write(b"%x\r\n%b\r\n" % (len(data), data))

    def cork(self) -> None:
        self._connection.cork()

    def uncork(self) -> None:
        self._connection.uncork()

    def end(self) -> None:
        if self._state != 1:
            return
        self._state = 2
        if not self._connection.closed:
            self._connection.write(b"0\r\n\r\n")
        self._connection.finished(self._keep_alive)

    def _head(self, status: int, content_type: str, headers: dict[str, str] | None) -> list[bytes]:
        head = [
            b"HTTP/1.1 %d %b\r\nContent-Type: %b\r\n"
            % (status, _REASONS.get(status, b"Unknown"), content_type.encode("latin-1"))
        ]
        if headers:
            for name, value in headers.items():
                head.append(b"%b: %b\r\n" % (name.encode("latin-1"), value.encode("latin-1")))
        if not self._keep_alive:
            head.append(b"Connection: close\r\n")
        return head


class ServerConnection(asyncio.Protocol):
    """One client connection: parses its requests and answers them one at a time, in order."""

    def __init__(
        self,
        handler: Handler,
        on_error: Callable[[int, str, str], bytes],
        *,
        max_body_bytes: int,
        shared: _Shared,
    ):
        self._handler = handler
        self._error_body = on_error
        self._max_body_bytes = max_body_bytes
        self._shared = shared
        self._connections = shared.connections
        self._client = ""
        # The request being read: when it began (monotonic), the timer that checks its pace,
        # and the body bytes it holds (counted in the worker's bytes in flight).
        self._reading_since = 0.0
        self._body_since = 0.0
        self._pace: asyncio.TimerHandle | None = None
        self._held_bytes = 0
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._request: Request | None = None  # being read
        self._url = b""
        self._header_bytes = 0
        self._body: list[bytes] = []
        self._body_size = 0
        self._queue: deque[Request] = deque()  # read, not yet answered
        self._exchange: Exchange | None = None  # being answered
        self._task: asyncio.Task[None] | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._reading = True
        self._corked: list[bytes] | None = None
        self.closed = False

    # -- the transport -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        limits = self._shared.limits
        peer = transport.get_extra_info("peername")
        self._client = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        too_many = limits.max_connections and len(self._connections) >= limits.max_connections
        per_client = self._shared.per_client
        too_many_here = (
            limits.max_connections_per_client
            and per_client[self._client] >= limits.max_connections_per_client
        )
        self._connections.add(self)
        per_client[self._client] += 1
        if too_many or too_many_here:
            whose = "this gateway worker" if too_many else "your address"
            self._refuse(503, f"Too many connections to {whose}; retry shortly.", "busy")
            return
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._connections.discard(self)
        per_client = self._shared.per_client
        per_client[self._client] -= 1
        if per_client[self._client] <= 0:
            del per_client[self._client]
        self._release_body()
        self._stop_pace()
        if self._idle is not None:
            self._idle.cancel()
        exchange = self._exchange
        if exchange is not None and exchange.on_gone is not None:
            exchange.on_gone()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def pause_writing(self) -> None:
        exchange = self._exchange
        if exchange is not None and exchange.on_writable is not None:
            exchange.on_writable(False)

    def resume_writing(self) -> None:
        exchange = self._exchange
        if exchange is not None and exchange.on_writable is not None:
            exchange.on_writable(True)

    def data_received(self, data: bytes) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, "Protocol upgrades are not supported.", "invalid_request")
        except httptools.HttpParserError as error:
            self._fail(400, f"Malformed HTTP request: {error}.", "invalid_request")
        except _HeadersTooLarge:
            self._fail(431, "The request's headers are too large.", "headers_too_large")
        except _Refused:
            pass  # answered and closed

    def write(self, data: bytes) -> None:
        if self._corked is not None:
            self._corked.append(data)
        elif not self.closed and self._transport is not None:
            self._transport.write(data)

    def cork(self) -> None:
        """Hold writes until `uncork`, then send them in one: what an engine's one read
        brings (often the usage chunk, [DONE] and the end of the stream) costs one send."""
        if self._corked is None:
            self._corked = []

    def uncork(self) -> None:
        corked, self._corked = self._corked, None
        if corked:
            self.write(corked[0] if len(corked) == 1 else b"".join(corked))

    def close(self) -> None:
        self.uncork()
        if self._transport is not None and not self.closed:
            self._transport.close()

    def idle(self) -> bool:
        return self._exchange is None and not self._queue

    # -- httptools' callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._request = Request()
        self._url = b""
        self._header_bytes = 0
        self._body = []
        self._body_size = 0
        self._reading_since = self._loop.time()
        self._body_since = 0.0
        timeout = self._shared.limits.header_timeout_seconds
        if timeout:
            self._stop_pace()
            self._pace = self._loop.call_at(self._reading_since + timeout, self._check_pace)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_header(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header(len(name) + len(value))
        assert self._request is not None
        self._request.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        request = self._request
        assert request is not None
        self._body_since = self._loop.time()
        limits = self._shared.limits
        self._stop_pace()
        if limits.body_min_bytes_per_second:
            self._pace = self._loop.call_at(
                self._body_since + limits.body_grace_seconds, self._check_pace
            )
        request.method = self._parser.get_method().decode("ascii", "replace")
        request.path = self._url.split(b"?", 1)[0].decode("latin-1")
        request.keep_alive = self._parser.should_keep_alive()
        announced = request.headers.get("content-length", "")
        too_large = (
            announced.isascii() and announced.isdigit() and int(announced) > self._max_body_bytes
        )
        if request.headers.get("expect", "").lower() == "100-continue":
            if too_large:
                # The client waits for our word before sending the body: refuse it now.
                request.body_too_large = True
                request.keep_alive = False
                self._queue.append(request)
                self._request = None
                self._next()
                return
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        request = self._request
        if request is None:
            return  # refused before its body (100-continue)
        self._body_size += len(body)
        if self._body_size > self._max_body_bytes:
            request.body_too_large = True  # read to its end, kept no more
            self._release_body()
            self._body = []
        elif not request.body_too_large:
            bound = self._shared.limits.max_body_bytes_in_flight
            if bound and self._shared.body_bytes + len(body) > bound:
                # The worker holds as many request bodies as it may: this one waits for no
                # memory (a flood of large bodies must not grow a worker without bound).
                self._refuse(503, "The gateway is busy reading other requests; retry.", "busy")
                raise _Refused()
            self._shared.body_bytes += len(body)
            self._held_bytes += len(body)
            self._body.append(body)

    def on_message_complete(self) -> None:
        self._stop_pace()
        request = self._request
        if request is None:
            return
        self._request = None
        if self._body and not request.body_too_large:
            request.body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        if request.body_too_large:
            request.keep_alive = False  # what is left on the wire is not worth reading
        self._queue.append(request)
        if len(self._queue) > MAX_QUEUED and self._reading and self._transport is not None:
            self._reading = False
            self._transport.pause_reading()
        self._next()

    # -- answering --------------------------------------------------------------------------

    def _next(self) -> None:
        if self._exchange is not None or not self._queue or self.closed:
            return
        request = self._queue.popleft()
        if not self._reading and len(self._queue) <= MAX_QUEUED and self._transport is not None:
            self._reading = True
            self._transport.resume_reading()
        exchange = self._exchange = Exchange(self, request.keep_alive)
        self._task = self._loop.create_task(self._answer(request, exchange))

    async def _answer(self, request: Request, exchange: Exchange) -> None:
        try:
            await self._handler(request, exchange)
        except asyncio.CancelledError:
            if not exchange.finished and not self.closed:
                self.close()  # cancelled mid-answer (shutdown): nothing sensible to add
            raise
        except Exception:
            log.exception("unhandled error answering %s %s", request.method, request.path)
            if not exchange.started:
                exchange.respond(
                    500, self._error_body(500, "The gateway failed to answer.", "internal")
                )
            else:
                self.close()
        else:
            if not exchange.finished:
                # A handler that returned without finishing its answer (a bug): close, so
                # the client is not left waiting.
                log.error("no complete answer to %s %s", request.method, request.path)
                self.close()

    def finished(self, keep_alive: bool) -> None:
        """The answer being written is complete: the next request, or close."""
        self._exchange = None
        self._task = None
        if not self._queue and self._request is None:
            self._release_body()
        if not keep_alive:
            self.close()
            return
        if self._queue:
            self._loop.call_soon(self._next)
        else:
            self._arm_idle()

    def _arm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._idle = self._loop.call_later(KEEP_ALIVE_SECONDS, self._idle_timeout)

    def _idle_timeout(self) -> None:
        self._idle = None
        if self.idle() and self._request is None:
            self.close()

    # -- what a connection may hold ------------------------------------------------------------

    def _check_pace(self) -> None:
        """A request being read: its headers late, or its body slower than the minimum rate."""
        self._pace = None
        if self._request is None or self.closed:
            return
        limits = self._shared.limits
        now = self._loop.time()
        if not self._body_since:
            self._refuse(408, "The request's headers came too slowly.", "request_timeout")
            return
        elapsed = now - self._body_since - limits.body_grace_seconds
        if self._body_size < limits.body_min_bytes_per_second * max(0.0, elapsed):
            self._refuse(408, "The request's body came too slowly.", "request_timeout")
            return
        self._pace = self._loop.call_at(now + 1.0, self._check_pace)

    def _stop_pace(self) -> None:
        if self._pace is not None:
            self._pace.cancel()
            self._pace = None

    def _release_body(self) -> None:
        if self._held_bytes:
            self._shared.body_bytes -= self._held_bytes
            self._held_bytes = 0

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answered at once (when nothing is being answered) and closed: what the connection
        holds is freed."""
        self._request = None
        self._body = []
        self._release_body()
        self._stop_pace()
        if self._exchange is None and not self.closed:
            Exchange(self, keep_alive=False).respond(
                status, self._error_body(status, message, code)
            )
        else:
            self.close()

    def _count_header(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > MAX_HEADER_BYTES:
            raise _HeadersTooLarge()

    def _fail(self, status: int, message: str, code: str) -> None:
        """A request that cannot be parsed: answered (after the one being answered, if any)
        and the connection closed."""
        self._request = None
        if self._exchange is None and not self.closed:
            body = self._error_body(status, message, code)
            Exchange(self, keep_alive=False).respond(status, body)
        else:
            self.close()


class _HeadersTooLarge(Exception):
    pass


class _Refused(Exception):
    """Raised from a parser callback once the connection was answered and closed."""


async def serve(
    handler: Handler,
    on_error: Callable[[int, str, str], bytes],
    *,
    host: str,
    port: int,
    max_body_bytes: int,
    reuse_port: bool,
    limits: Limits | None = None,
) -> tuple[asyncio.AbstractServer, set[ServerConnection]]:
    """Listen on host:port; returns the server and the set of open connections."""
    loop = asyncio.get_running_loop()
    shared = _Shared(limits or Limits())

    def factory() -> Any:
        return ServerConnection(handler, on_error, max_body_bytes=max_body_bytes, shared=shared)

    server = await loop.create_server(
        factory, host=host, port=port, reuse_port=reuse_port, backlog=1024
    )
    return server, shared.connections
