"""The gateway holds slow, half-sent and too many connections only so long (issue 34, finding
7: the idle timer was not re-armed once any byte arrived, there was no read timeout and no
connection cap; 500 half-open connections were held, and 20 connections each sending 9 MB of a
10 MB body took a worker from 124 to 305 MB, where it stayed). Real slow sockets against the
real gateway process: every limit is a GATEWAY_* setting."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from .conftest import wait_for

CHAT_HEAD = (
    "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
)


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    return sock


def answer_and_close(sock: socket.socket, within_seconds: float) -> tuple[bytes, float]:
    """What the gateway wrote before it closed the connection, and how long that took."""
    started = time.monotonic()
    sock.settimeout(within_seconds)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            # Closed with what the client sent still unread: the kernel resets the connection,
            # and the answer written before may be lost with it.
            return data, time.monotonic() - started
        if not chunk:
            return data, time.monotonic() - started
        data += chunk


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_request_whose_headers_never_finish_is_answered_408_and_closed(world, start_gateway):
    world.publish()
    gateway = start_gateway(GATEWAY_HEADER_TIMEOUT_SECONDS="1")
    half_open = [connect(gateway.url) for _ in range(50)]
    for sock in half_open:
        sock.sendall(CHAT_HEAD.encode())  # and never the blank line
    for sock in half_open:
        data, took = answer_and_close(sock, within_seconds=15)
        assert data.startswith(b"HTTP/1.1 408"), data[:80]
        sock.close()


def test_a_body_sent_slower_than_the_minimum_rate_is_answered_408_and_closed(world, start_gateway):
    world.publish()
    gateway = start_gateway(
        GATEWAY_BODY_GRACE_SECONDS="1", GATEWAY_BODY_MIN_BYTES_PER_SECOND="1000"
    )
    sock = connect(gateway.url)
    sock.sendall((CHAT_HEAD + "Content-Length: 100000\r\n\r\n").encode())
    sock.settimeout(0.5)
    sent, refused = 0, None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            sock.sendall(b"x" * 10)  # 10 bytes a second: a hundredth of the minimum
            sent += 10
            refused = sock.recv(65536)
            if refused:
                break
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
        time.sleep(1)
    assert refused and refused.startswith(b"HTTP/1.1 408"), refused
    assert sent < 1000


@pytest.mark.parametrize(
    ("setting", "cap"), [("GATEWAY_MAX_CONNECTIONS_PER_CLIENT", 5), ("GATEWAY_MAX_CONNECTIONS", 5)]
)
def test_connections_beyond_the_caps_are_answered_503_and_closed(
    world, start_gateway, setting, cap
):
    world.publish()
    gateway = start_gateway(**{setting: str(cap)})
    held = [connect(gateway.url) for _ in range(cap)]
    time.sleep(0.3)  # each accepted by the worker
    extra = connect(gateway.url)
    data, _ = answer_and_close(extra, within_seconds=15)
    assert data.startswith(b"HTTP/1.1 503"), data[:80]
    assert b'"busy"' in data
    held.pop().close()
    time.sleep(0.3)
    again = connect(gateway.url)
    again.sendall(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
    assert again.recv(65536).startswith(b"HTTP/1.1 200")
    for sock in [*held, extra, again]:
        sock.close()


def test_half_sent_large_bodies_hold_a_bounded_memory_and_are_dropped(world, start_gateway):
    world.publish()
    gateway = start_gateway(
        GATEWAY_MAX_BODY_BYTES_IN_FLIGHT=str(32 * 1024 * 1024),
        GATEWAY_BODY_GRACE_SECONDS="2",
        GATEWAY_BODY_MIN_BYTES_PER_SECOND="1000000",
    )
    pid = gateway.process.pid  # one worker: the gateway process itself
    before = rss_kib(pid)
    socks = []
    chunk = b"x" * (1024 * 1024)
    for _ in range(20):  # 9 MB of a 10 MB body each, then silence
        sock = connect(gateway.url)
        sock.sendall((CHAT_HEAD + f"Content-Length: {10 * 1024 * 1024}\r\n\r\n").encode())
        try:
            for _ in range(9):
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused for the bytes in flight: closed already
        socks.append(sock)
    grown_mib = (rss_kib(pid) - before) / 1024
    # At most the 32 MiB of bodies in flight (the rest was refused), beside what a worker's
    # allocator keeps: never the 180 MB of twenty 9 MB bodies.
    assert grown_mib < 32 + 32, grown_mib
    # The silent ones are dropped once their pace is too slow; what they held is freed.
    for sock in socks:
        data, _ = answer_and_close(sock, within_seconds=30)
        assert not data or data.startswith((b"HTTP/1.1 408", b"HTTP/1.1 503")), data[:80]
        sock.close()
    # A normal request still fits afterwards: the bytes were given back.
    probe = connect(gateway.url)
    probe.sendall(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
    assert wait_for(lambda: probe.recv(65536)).startswith(b"HTTP/1.1 200")
    probe.close()
