"""A local webhook receiver that checks signatures the way a real one should.

It recomputes HMAC-SHA256 over `f"{X-Timestamp}.{X-Webhook-Id}."` + the raw body with its own
secret, compares in constant time, refuses timestamps more than 300 s from its clock and ids
it has already accepted (401 for all), and answers 200 `{"observed_replicas": N}` — or the
failures it is told to give next.
Written independently of capacity/actuation/webhook.py, so the tests check the scheme itself.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler

from tests.support.servers import BackgroundHTTPServer

HANG = "hang"
MAX_SKEW_SECONDS = 300


@dataclass
class Received:
    headers: dict[str, str]
    raw_body: bytes
    status: int


class WebhookReceiver:
    def __init__(self, secret: str | None):
        self.secret = secret
        self.received: list[Received] = []
        self.accepted_ids: set[str] = set()
        self.observed_replicas = 2
        self._script: list[int | str] = []
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._server = BackgroundHTTPServer(_handler_for(self))
        self.url = f"{self._server.base_url}/hooks/scale"

    def start(self) -> WebhookReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._released.set()  # lets hanging handlers go
        self._server.stop()

    def fail_next(self, *answers: int | str) -> None:
        with self._lock:
            self._script.extend(answers)

    def verdict(self, headers, raw: bytes) -> tuple[int, str]:
        if self.secret is not None:
            timestamp = headers.get("X-Timestamp", "")
            webhook_id = headers.get("X-Webhook-Id", "")
            signature = headers.get("X-Signature-256", "")
            if not timestamp.isdigit() or abs(time.time() - int(timestamp)) > MAX_SKEW_SECONDS:
                return 401, "stale or missing timestamp"
            if not webhook_id:
                return 401, "missing webhook id"
            expected = hmac.new(
                self.secret.encode(), f"{timestamp}.{webhook_id}.".encode() + raw, hashlib.sha256
            ).hexdigest()
            if not hmac.compare_digest(signature, f"sha256={expected}"):
                return 401, "bad signature"
            with self._lock:
                if webhook_id in self.accepted_ids:
                    return 401, "replayed webhook id"
                self.accepted_ids.add(webhook_id)
        with self._lock:
            failure = self._script.pop(0) if self._script else None
        if failure is not None:
            return (0, "") if failure == HANG else (int(failure), "injected failure")
        return 200, json.dumps({"observed_replicas": self.observed_replicas})

    def handle(self, handler: BaseHTTPRequestHandler) -> None:
        raw = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
        status, text = self.verdict(handler.headers, raw)
        headers = {k.lower(): v for k, v in handler.headers.items()}
        self.received.append(Received(headers=headers, raw_body=raw, status=status))
        if status == 0:
            self._released.wait(timeout=30)  # never answers; the sender must time out
            handler.close_connection = True
            return
        data = text.encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)


def _handler_for(receiver: WebhookReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            receiver.handle(self)

        def log_message(self, format, *args):
            pass

    return Handler
