"""A hop that forwards bytes and does nothing else: the floor of any HTTP hop on these cores.

`python -m bench.relay UPSTREAM_HOST UPSTREAM_PORT PORT [WORKERS]`: WORKERS processes (as the
gateway: one uvloop event loop each, all on PORT with SO_REUSEPORT), each connection relayed
to one upstream connection of its own, bytes passed both ways as they come: no HTTP parsing,
no authentication, no admission, no routing, no usage. bench_gateway drives it beside the
gateway so that what the gateway's own work costs can be told from what any hop costs on
cores it shares with its client and the engine (two more sockets per request, and the
kernel's work for them).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys

import uvloop


class _Upstream(asyncio.Protocol):
    def __init__(self, downstream: asyncio.Transport):
        self.downstream = downstream

    def data_received(self, data: bytes) -> None:
        self.downstream.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.downstream.close()


class _Downstream(asyncio.Protocol):
    def __init__(self, upstream_host: str, upstream_port: int):
        self.address = (upstream_host, upstream_port)
        self.transport: asyncio.Transport | None = None
        self.upstream: asyncio.BaseTransport | None = None
        self.pending: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        assert self.transport is not None
        downstream = self.transport
        loop = asyncio.get_running_loop()
        try:
            upstream, _ = await loop.create_connection(lambda: _Upstream(downstream), *self.address)
        except OSError:
            downstream.close()
            return
        self.upstream = upstream
        for data in self.pending:
            upstream.write(data)  # type: ignore[attr-defined]
        self.pending.clear()

    def data_received(self, data: bytes) -> None:
        if self.upstream is None:
            self.pending.append(data)
        else:
            self.upstream.write(data)  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None:
            self.upstream.close()


def _serve(upstream_host: str, upstream_port: int, port: int) -> None:
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1024)
    loop.run_until_complete(
        loop.create_server(lambda: _Downstream(upstream_host, upstream_port), sock=sock)
    )
    loop.run_forever()


def main() -> None:
    upstream_host, upstream_port, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    workers = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    children = []
    for _ in range(workers):
        pid = os.fork()
        if pid == 0:
            _serve(upstream_host, upstream_port, port)
            os._exit(0)
        children.append(pid)

    def stop(_signum: int, _frame: object) -> None:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for child in children:
        os.waitpid(child, 0)


if __name__ == "__main__":
    main()
