"""A local HTTP server that records every request it gets and answers them all the same way.

For tests that must show a request was never sent (an attacker's listener that receives
nothing) or that a redirect was not followed.
"""

from __future__ import annotations

from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler

from tests.support.servers import BackgroundHTTPServer


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class RecordingServer:
    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        status: int = 200,
        body: bytes = b"{}",
        headers: dict[str, str] | None = None,
    ):
        self.status = status
        self.body = body
        self.headers = {"Content-Type": "application/json"} | (headers or {})
        self.requests: list[Request] = []
        self._server = BackgroundHTTPServer(_handler_for(self), host)
        self.url = self._server.base_url

    def __enter__(self) -> RecordingServer:
        self._server.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.stop()


def _handler_for(server: RecordingServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _handle(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            server.requests.append(
                Request(
                    method=self.command,
                    path=self.path,
                    headers={k.lower(): v for k, v in self.headers.items()},
                    body=body,
                )
            )
            self.send_response(server.status)
            for name, value in server.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(server.body)))
            self.end_headers()
            self.wfile.write(server.body)

        do_GET = do_POST = do_PATCH = do_DELETE = _handle

        def log_message(self, format, *args):
            pass

    return Handler
