"""A local HTTP server that speaks the Kubernetes scale subresource, for the real client.

It serves `GET`/`PATCH` on

    /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale      (and statefulsets)
    /apis/{group}/{version}/namespaces/{ns}/{plural}/{name}/scale

and the pods of the core API (`GET /api/v1/namespaces/{ns}/pods?labelSelector=k=v`,
`DELETE /api/v1/namespaces/{ns}/pods/{name}`) added with `add_pod()`, for the objects added
with `add()`, answers a `Scale` like the API server (spec = the desired
replicas, status = the replicas observed, which lag until `observe()`), records every request,
and can be told to answer the next requests with a failure: an HTTP status (409, 500, 404…)
with a Kubernetes `Status` body, or "hang" (accept the request and never answer).
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from urllib.parse import unquote

from tests.support.servers import BackgroundHTTPServer

HANG = "hang"
_SCALE_PATH = re.compile(
    r"^/apis/(?P<group_version>[^/]+/[^/]+)/namespaces/(?P<ns>[^/]+)"
    r"/(?P<plural>[^/]+)/(?P<name>[^/]+)/scale$"
)
_PODS_PATH = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods(?:/(?P<name>[^/]+))?$")
_REASONS = {409: "Conflict", 404: "NotFound", 401: "Unauthorized", 500: "InternalError"}


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: object


@dataclass
class ScaledObject:
    spec_replicas: int
    status_replicas: int


class ScaleApiServer:
    def __init__(self, *, token: str | None = None):
        self.token = token  # when set, requests need `Authorization: Bearer <token>`
        self.objects: dict[str, ScaledObject] = {}
        self.pods: dict[tuple[str, str], dict] = {}  # (namespace, name) -> Pod
        self.requests: list[Recorded] = []
        self._script: list[int | str] = []
        self._always: int | str | None = None
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._server = BackgroundHTTPServer(_handler_for(self))
        self.url = self._server.base_url

    def start(self) -> ScaleApiServer:
        self._server.start()
        return self

    def stop(self) -> None:
        self._released.set()  # lets hanging handlers go
        self._server.stop()

    def add(self, path: str, replicas: int) -> None:
        """Add an object at its scale path, e.g. `/apis/apps/v1/namespaces/ns/deployments/x`."""
        self.objects[path] = ScaledObject(spec_replicas=replicas, status_replicas=replicas)

    def add_pod(
        self,
        namespace: str,
        name: str,
        ip: str,
        labels: dict,
        *,
        ready: bool = True,
        http_port: int | None = None,
    ) -> None:
        ports = [{"name": "http", "containerPort": http_port}] if http_port else []
        self.pods[(namespace, name)] = {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"containers": [{"name": "engine", "image": "vllm", "ports": ports}]},
            "status": {
                "phase": "Running",
                "podIP": ip,
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }

    def deleted_pods(self) -> list[str]:
        return [
            r.path.split("?", 1)[0].rsplit("/", 1)[-1]
            for r in self.requests
            if r.method == "DELETE"
        ]

    def _pods(self, handler, method: str, match) -> None:
        namespace, name = match["ns"], match["name"]
        if method == "DELETE" and name:
            pod = self.pods.pop((namespace, name), None)
            if pod is None:
                return _status(handler, 404, f'pods "{name}" not found')
            return _json(handler, 200, pod)
        query = handler.path.split("?", 1)[1] if "?" in handler.path else ""
        wanted = {}
        for part in query.split("&"):
            key, _, value = part.partition("=")
            if key == "labelSelector":
                for term in unquote(value).split(","):
                    label, _, label_value = term.partition("=")
                    wanted[label] = label_value
        items = [
            pod
            for (ns, _), pod in sorted(self.pods.items())
            if ns == namespace
            and all(pod["metadata"]["labels"].get(k) == v for k, v in wanted.items())
        ]
        return _json(
            handler, 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}
        )

    def fail_next(self, *answers: int | str) -> None:
        """Answer the next requests with these statuses (or HANG), then normally again."""
        with self._lock:
            self._script.extend(answers)

    def fail_always(self, answer: int | str) -> None:
        self._always = answer

    def patches(self) -> list[Recorded]:
        return [r for r in self.requests if r.method == "PATCH"]

    # -- request handling (on the server's threads) ------------------------------------------

    def _next_failure(self) -> int | str | None:
        with self._lock:
            if self._script:
                return self._script.pop(0)
        return self._always

    def handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        path = handler.path.split("?", 1)[0]
        self.requests.append(
            Recorded(
                method=method,
                path=handler.path,
                headers={k.lower(): v for k, v in handler.headers.items()},
                body=json.loads(raw) if raw else None,
            )
        )
        authorization = handler.headers.get("Authorization")
        if self.token is not None and authorization != f"Bearer {self.token}":
            return _status(handler, 401, "Unauthorized")
        failure = self._next_failure()
        if failure == HANG:
            # Never answer; the client's read timeout has to give up.
            self._released.wait(timeout=30)
            handler.close_connection = True
            return None
        pods = _PODS_PATH.match(path)
        if pods is not None:
            if failure is not None:
                return _status(handler, int(failure), "injected failure")
            return self._pods(handler, method, pods)
        match = _SCALE_PATH.match(path)
        if match is None:
            return _status(handler, 404, f"the server could not find the requested resource {path}")
        resource = match["plural"]
        if failure is not None:
            messages = {
                409: f'Operation cannot be fulfilled on {resource} "{match["name"]}": the object '
                "has been modified; please apply your changes to the latest version and try again",
                500: "etcdserver: request timed out",
            }
            return _status(handler, int(failure), messages.get(int(failure), "injected failure"))
        scaled = self.objects.get(path.removesuffix("/scale"))
        if scaled is None:
            return _status(handler, 404, f'{resource} "{match["name"]}" not found')
        if method == "PATCH":
            body = self.requests[-1].body
            replicas = body.get("spec", {}).get("replicas") if isinstance(body, dict) else None
            if not isinstance(replicas, int):
                return _status(handler, 422, "spec.replicas: Required value")
            scaled.spec_replicas = replicas
        scale = {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {"name": match["name"], "namespace": match["ns"], "resourceVersion": "7"},
            "spec": {"replicas": scaled.spec_replicas},
            "status": {"replicas": scaled.status_replicas, "selector": "app=engine"},
        }
        return _json(handler, 200, scale)


def _status(handler, code: int, message: str) -> None:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": _REASONS.get(code, HTTPStatus(code).phrase.replace(" ", "")),
        "code": code,
    }
    _json(handler, code, body)


def _json(handler, code: int, body: dict) -> None:
    data = json.dumps(body).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def _handler_for(server: ScaleApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            server.handle(self, "GET")

        def do_PATCH(self):
            server.handle(self, "PATCH")

        def do_DELETE(self):
            server.handle(self, "DELETE")

        def log_message(self, format, *args):
            pass  # keep pytest output clean

    return Handler
