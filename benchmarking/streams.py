"""The load runner's HTTP/1.1 client: keep-alive connections per host, each an asyncio
protocol that feeds httptools' parser, so a streamed answer's chunks are handled in the
socket's own callback and the request's coroutine wakes once, when the answer has ended.

Why not aiohttp: at 512 streams its per-chunk stream reader (a task woken for every chunk)
and per-request bookkeeping were the client's own cost, and that cost lands in every TTFT the
runner measures (make bench, bench_runner: the runner beside wrk).

Load goes only where the operator allows: every connection is vetted by a
`core.outbound.HostPolicy` when it is opened, on the address it is opened to (names
are resolved once a minute, like aiohttp's DNS cache did). No redirect is followed (a
redirect would be the server choosing where we connect next) and no proxy is read from the
environment. https uses the project's one TLS context (SSL_CERT_FILE / SSL_CERT_DIR apply).
"""

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools

from core import outbound

# A resolved name's vetted addresses are reused this long (aiohttp's ttl_dns_cache was 60).
RESOLVE_TTL_SECONDS = 60.0
# What an answer other than 200 keeps of its body, for the error message.
ERROR_BODY_BYTES = 2_000
# Bounds of an answer read whole (GET /metrics): a runaway server cannot fill our memory.
MAX_BODY_BYTES = 64 * 1024 * 1024


class ClientError(Exception):
    """The exchange failed: connection refused or lost, a malformed answer, a timeout."""


class Timeout(ClientError):
    """No connection, or no complete answer, within the request's timeout."""


@dataclass
class Answer:
    status: int
    body: bytes  # the whole body (or its first ERROR_BODY_BYTES when streamed and not 200)


@dataclass
class _Exchange:
    # Called with each piece of a 200 answer's body as it arrives; None: keep the body.
    on_data: Callable[[bytes], None] | None
    future: asyncio.Future
    status: int = 0
    # The answer gives no length and is not chunked: its body ends when the connection does.
    until_close: bool = True
    parts: list[bytes] = field(default_factory=list)
    size: int = 0

    def fail(self, error: Exception) -> None:
        if not self.future.done():
            self.future.set_exception(error)


@dataclass(frozen=True)
class _Origin:
    scheme: str
    host: str
    port: int

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        name = f"[{self.host}]" if ":" in self.host else self.host
        return name if self.port == default else f"{name}:{self.port}"


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one exchange on it at a time."""

    def __init__(self, client: "StreamClient", origin: _Origin) -> None:
        self.client = client
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: _Exchange | None = None
        self.open = False
        self.reusable = False

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.open = True

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._abort(ClientError(f"malformed answer: {error}"))
        except Exception as error:  # raised by a caller's on_data: the exchange fails with it
            self._abort(error)

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        exchange, self.exchange = self.exchange, None
        if exchange is None:
            return
        if exchange.status and exchange.until_close and exc is None:
            # HTTP/1.x: an answer with neither a length nor chunks ends with its connection.
            if not exchange.future.done():
                exchange.future.set_result(Answer(exchange.status, b"".join(exchange.parts)))
            return
        exchange.fail(ClientError("the connection closed before the answer ended"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        exchange = self.exchange
        if exchange is not None and name.lower() in (b"content-length", b"transfer-encoding"):
            exchange.until_close = False

    def on_headers_complete(self) -> None:
        exchange = self.exchange
        if exchange is not None:
            exchange.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        exchange = self.exchange
        if exchange is None:
            return
        if exchange.status == 200 and exchange.on_data is not None:
            exchange.on_data(body)
            return
        limit = ERROR_BODY_BYTES if exchange.on_data is not None else MAX_BODY_BYTES
        if exchange.size < limit:
            exchange.parts.append(body[: limit - exchange.size])
            exchange.size += len(exchange.parts[-1])
        elif exchange.on_data is None:
            self._abort(ClientError(f"the answer is larger than {MAX_BODY_BYTES} bytes"))

    def on_message_complete(self) -> None:
        exchange, self.exchange = self.exchange, None
        if exchange is None:
            return
        self.reusable = self.parser.should_keep_alive()
        if not exchange.future.done():
            exchange.future.set_result(Answer(exchange.status, b"".join(exchange.parts)))

    # ours
    def start(self, request: bytes, exchange: _Exchange) -> None:
        self.exchange = exchange
        self.reusable = False
        assert self.transport is not None
        self.transport.write(request)

    def _abort(self, error: Exception) -> None:
        if self.exchange is not None:
            self.exchange.fail(error)
            self.exchange = None
        self.open = False
        if self.transport is not None:
            self.transport.abort()


class StreamClient:
    """Keep-alive connections to any number of origins, each vetted by `host_policy`."""

    def __init__(self, host_policy: outbound.HostPolicy, *, connections: int = 0) -> None:
        self.host_policy = host_policy
        self.connections = connections  # 0: no bound (the caller's lanes bound it)
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._addresses: dict[tuple[str, int], tuple[float, list[str]]] = {}
        self._all: set[_Connection] = set()
        self._closed = False

    async def post(
        self,
        url: str,
        body: bytes,
        *,
        timeout_seconds: float,
        on_data: Callable[[bytes], None] | None = None,
        accept: str = "text/event-stream",
    ) -> Answer:
        """POST a JSON body. With `on_data`, a 200 answer's body goes to it piece by piece,
        in the socket's callback, as it arrives (an exception it raises fails the exchange);
        the Answer then holds only what an answer other than 200 said."""
        origin, target = _split(url)
        head = (
            f"POST {target} HTTP/1.1\r\nHost: {origin.host_header}\r\n"
            f"Content-Type: application/json\r\nAccept: {accept}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1")
        return await self._exchange(origin, head + body, on_data, timeout_seconds)

    async def get(self, url: str, *, timeout_seconds: float) -> Answer:
        origin, target = _split(url)
        request = f"GET {target} HTTP/1.1\r\nHost: {origin.host_header}\r\n\r\n"
        return await self._exchange(origin, request.encode("latin-1"), None, timeout_seconds)

    async def close(self) -> None:
        self._closed = True
        for connection in list(self._all):
            if connection.transport is not None:
                connection.transport.close()
        self._all.clear()
        self._idle.clear()

    async def _exchange(
        self,
        origin: _Origin,
        request: bytes,
        on_data: Callable[[bytes], None] | None,
        timeout_seconds: float,
    ) -> Answer:
        if self._closed:
            raise ClientError("the client is closed")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_seconds
        connection = self._idle_connection(origin)
        if connection is None:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation
            # that arrives as the connection is made (fixed in 3.12), and the load would then
            # run on to the end of its point, a run ended meanwhile too (test_run_heartbeat).
            try:
                async with asyncio.timeout(timeout_seconds):
                    connection = await self._open(origin)
            except TimeoutError as error:
                raise Timeout(
                    f"no connection to {origin.host_header} within the timeout"
                ) from error
        exchange = _Exchange(on_data, loop.create_future())
        # One timer per exchange, not a wait_for task: it aborts the connection, which fails
        # the exchange.
        timer = loop.call_at(
            deadline,
            connection._abort,
            Timeout(f"no complete answer within {timeout_seconds:g} s"),
        )
        connection.start(request, exchange)
        try:
            answer = await exchange.future
        except asyncio.CancelledError:
            connection._abort(ClientError("cancelled"))
            raise
        finally:
            timer.cancel()
        self._release(connection)
        return answer

    def _idle_connection(self, origin: _Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()
            if connection.open:
                return connection
            self._all.discard(connection)
        return None

    async def _open(self, origin: _Origin) -> _Connection:
        addresses = await self._vetted(origin)
        loop = asyncio.get_running_loop()
        tls = outbound.default_ssl_context() if origin.scheme == "https" else None
        last_error: Exception | None = None
        for address in addresses:
            try:
                _, connection = await loop.create_connection(
                    lambda: _Connection(self, origin),
                    host=address,
                    port=origin.port,
                    ssl=tls,
                    server_hostname=origin.host if tls is not None else None,
                )
            except OSError as error:
                last_error = error
                continue
            self._all.add(connection)
            return connection
        raise ClientError(f"cannot connect to {origin.host_header}: {last_error}")

    def _release(self, connection: _Connection) -> None:
        if connection.open and connection.reusable and not self._closed:
            self._idle.setdefault(connection.origin, []).append(connection)
            return
        self._all.discard(connection)
        if connection.transport is not None:
            connection.transport.close()

    async def _vetted(self, origin: _Origin) -> list[str]:
        """The origin's addresses the policy allows (OutboundRefused when none is)."""
        key = (origin.host, origin.port)
        cached = self._addresses.get(key)
        now = time.monotonic()
        if cached is not None and cached[0] > now:
            return cached[1]
        loop = asyncio.get_running_loop()
        try:
            vetted = await loop.run_in_executor(
                None, self.host_policy.vet_host, origin.host, origin.port
            )
        except (outbound.Unresolvable, outbound.OutboundRefused) as error:
            raise ClientError(str(error)) from error
        addresses = [str(address) for address in vetted]
        self._addresses[key] = (now + RESOLVE_TTL_SECONDS, addresses)
        return addresses


def _split(url: str) -> tuple[_Origin, str]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ClientError(f"not an http(s) URL: {url}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return _Origin(parts.scheme, parts.hostname, port), target
