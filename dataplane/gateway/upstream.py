"""The gateway's connections to the engines: HTTP/1.1 keep-alive connections on httptools,
pooled per replica, each delivering its answer to a `Sink` by callbacks.

Why not aiohttp's client: see dataplane/gateway/http.py. A streamed answer is not read by a
task here: the connection's `data_received` hands each de-chunked piece of the body straight
to its sink (`EngineAnswer` in relay.py), which writes it to the client's socket. The engines
are the operator's own (vLLM, or anything OpenAI-compatible behind the contract's endpoint):
one request at a time per connection, never pipelined; a connection goes back to its pool
only after a complete answer the engine did not mark `Connection: close`.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import httptools

# Idle connections kept per replica; more are closed as they come back.
MAX_IDLE_PER_REPLICA = 1024


class Sink(Protocol):
    """Who receives an engine's answer. Exactly one of `done` and `failed` is called last."""

    def reading(self, begun: bool) -> None:
        """Around each read from the engine (True before, False after): the writes it causes
        may be sent as one."""

    def head(self, status: int, content_type: str) -> None: ...

    def body(self, data: bytes) -> None: ...

    def done(self) -> None: ...

    def failed(self, error: Exception) -> None: ...


class EngineError(ConnectionError):
    """The connection to an engine failed or closed before its answer was complete."""


class EngineConnection(asyncio.Protocol):
    def __init__(self, pool: Engines, address: tuple[str, int]):
        self._pool = pool
        self.address = address
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.sink: Sink | None = None
        self.closed = False
        self.reused = False  # this connection answered a request before
        self._content_type = ""
        self._framed = False  # the answer's body has a length or is chunked
        self._to_eof = False  # a body that ends when the connection does
        self._got_head = False

    # -- the transport -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        sink = self.sink
        if sink is not None:
            sink.reading(True)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(EngineError(f"malformed answer from the engine: {error}"))
        finally:
            if sink is not None:
                sink.reading(False)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.forget(self)
        sink, self.sink = self.sink, None
        if sink is None:
            return
        if self._got_head and self._to_eof:
            sink.done()
        else:
            sink.failed(EngineError(f"the engine closed the connection ({exc or 'EOF'})"))

    # -- one request ------------------------------------------------------------------------

    def send(self, data: bytes, sink: Sink) -> None:
        self.sink = sink
        self._got_head = False
        self._to_eof = False
        self._content_type = ""
        assert self.transport is not None
        self.transport.write(data)

    def abort(self) -> None:
        """Close (never reuse) the connection: how the engine learns to abort the request."""
        self.sink = None
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def pause(self, paused: bool) -> None:
        if self.transport is None or self.closed:
            return
        if paused:
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()

    def _fail(self, error: Exception) -> None:
        sink = self.sink
        self.abort()
        if sink is not None:
            sink.failed(error)

    # -- httptools' callbacks ---------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"content-type":
            self._content_type = value.decode("latin-1")
        elif lower in (b"transfer-encoding", b"content-length"):
            self._framed = True

    def on_headers_complete(self) -> None:
        self._got_head = True
        # Neither chunked nor a length: the body runs to the connection's end.
        self._to_eof = not self._framed
        self._framed = False
        if self.sink is not None:
            self.sink.head(self._parser.get_status_code(), self._content_type)

    def on_body(self, body: bytes) -> None:
        if self.sink is not None:
            self.sink.body(body)

    def on_message_complete(self) -> None:
        sink, self.sink = self.sink, None
        keep = self._parser.should_keep_alive() and not self._to_eof and not self.closed
        if keep:
            self.reused = True
            self._pool.put(self)
        else:
            self.abort()
        if sink is not None:
            sink.done()


class Engines:
    """Keep-alive connections to the engines, by (host, port)."""

    def __init__(self, *, connect_timeout_seconds: float):
        self.connect_timeout_seconds = connect_timeout_seconds
        self._idle: dict[tuple[str, int], list[EngineConnection]] = {}

    def take(self, address: tuple[str, int]) -> EngineConnection | None:
        idle = self._idle.get(address)
        while idle:
            connection = idle.pop()
            if not connection.closed:
                return connection
        return None

    async def connect(self, address: tuple[str, int]) -> EngineConnection:
        """A new connection; OSError or TimeoutError when the engine cannot be reached."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_seconds):
            _transport, connection = await loop.create_connection(
                lambda: EngineConnection(self, address), *address
            )
        return connection

    def put(self, connection: EngineConnection) -> None:
        idle = self._idle.setdefault(connection.address, [])
        if len(idle) >= MAX_IDLE_PER_REPLICA:
            connection.abort()
        else:
            idle.append(connection)

    def forget(self, connection: EngineConnection) -> None:
        idle = self._idle.get(connection.address)
        if idle and connection in idle:
            idle.remove(connection)

    def close(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.abort()
        self._idle.clear()
