"""A local Kubernetes API server for the real client, serving exactly what each resource has.

What it serves is built from the resources' own definitions, never from what the actuator
sends:

- the built-in kinds from the API server's discovery documents (kubernetes/kubernetes
  `api/discovery/apis__apps__v1.json`, `apis__autoscaling__v2.json`, `api__v1.json`):
  deployments, statefulsets and replicasets have `scale` and `status`; horizontalpodautoscalers
  and pods `status` only;
- custom resources from the CRDs vendored in deploy/kubernetes/crds/: each served version's
  `subresources` (KServe's InferenceService: `status` only, so `/scale` is a 404 as on a real
  cluster; LeaderWorkerSet: `scale` at its CRD's specReplicasPath/statusReplicasPath) and its
  `openAPIV3Schema`, which every write is validated against (a 422 names the field).

Like the real server it answers `get`, `list` (with `labelSelector`), `patch` (a JSON merge
patch; a strategic merge patch only for built-in kinds: custom resources answer 415) and
`delete`; objects keep `metadata.annotations`, and HPAs refuse `minReplicas` below 1 and a
`maxReplicas` below it. It records every request with its RBAC verb, resource and
subresource (`verbs()`), and can be told to fail the next requests: an HTTP status (409, 500,
404…) with a Kubernetes `Status` body, or "hang" (accept the request and never answer).

Controllers do not run by themselves: a test sets what they would report with
`set_status()`, or runs one step of the two whose choice the drain relies on
(capacity/actuation/drain.py), as their documented behaviour has it:

- `run_replicaset_controller(deployment)`: a Deployment's ReplicaSet deleting its surplus
  pods, ranked as kubernetes/kubernetes ranks them (pkg/controller/controller_utils.go,
  `ActivePodsWithRanks.Less`, used by the ReplicaSet's `getPodsToDelete`), which is where
  `controller.kubernetes.io/pod-deletion-cost` counts;
- `run_kserve_raw_deployment(inference_service)`: KServe in RawDeployment mode, which makes
  a Deployment `<name>-predictor` and an HPA bounded by the InferenceService's
  `spec.predictor.minReplicas`/`maxReplicas`; the HPA keeps the Deployment's replicas within
  them, and its ReplicaSet removes the surplus.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import yaml
from jsonschema import Draft7Validator

from tests.support.servers import BackgroundHTTPServer

HANG = "hang"
CRD_DIRECTORY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "crds"
_REASONS = {
    409: "Conflict",
    404: "NotFound",
    401: "Unauthorized",
    415: "UnsupportedMediaType",
    422: "Invalid",
    500: "InternalError",
}
_PATH = re.compile(
    r"^/(?:api/(?P<core_version>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
    r"/namespaces/(?P<ns>[^/]+)/(?P<plural>[^/]+)(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?$"
)
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


@dataclass(frozen=True)
class Resource:
    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    subresources: frozenset[str]
    builtin: bool
    spec_replicas_path: str | None = None
    status_replicas_path: str | None = None
    # Left out of hashing: a Resource keys the cache of its schema's validator.
    schema: dict | None = field(default=None, hash=False, compare=False)


# From the discovery documents named in the module docstring (the subresources each lists).
_BUILTIN = (
    Resource(
        "apps",
        "v1",
        "deployments",
        "Deployment",
        frozenset({"scale", "status"}),
        True,
        ".spec.replicas",
        ".status.replicas",
    ),  # fmt: skip
    Resource(
        "apps",
        "v1",
        "statefulsets",
        "StatefulSet",
        frozenset({"scale", "status"}),
        True,
        ".spec.replicas",
        ".status.replicas",
    ),  # fmt: skip
    Resource(
        "apps",
        "v1",
        "replicasets",
        "ReplicaSet",
        frozenset({"scale", "status"}),
        True,
        ".spec.replicas",
        ".status.replicas",
    ),  # fmt: skip
    Resource(
        "autoscaling",
        "v2",
        "horizontalpodautoscalers",
        "HorizontalPodAutoscaler",
        frozenset({"status"}),
        True,
    ),  # fmt: skip
    Resource("", "v1", "pods", "Pod", frozenset({"status", "eviction", "log"}), True),
)


# The fields each resource requires, for objects a test adds without them: a Deployment its
# selector and pod template, a LeaderWorkerSet its leaderWorkerTemplate.workerTemplate (its
# CRD's schema), an InferenceService its predictor.
_POD_TEMPLATE = {
    "metadata": {"labels": {"app": "engine"}},
    "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
}
_REQUIRED_SPEC = {
    # What the API server always returns for these (the client's models refuse less).
    "Deployment": {
        "spec": {"selector": {"matchLabels": {"app": "engine"}}, "template": _POD_TEMPLATE}
    },
    "StatefulSet": {
        "spec": {"selector": {"matchLabels": {"app": "engine"}}, "template": _POD_TEMPLATE}
    },
    "LeaderWorkerSet": {
        "spec": {
            "leaderWorkerTemplate": {
                "size": 2,
                "workerTemplate": {
                    "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}
                },
            }
        }
    },
    "InferenceService": {"spec": {"predictor": {}}},
}


@functools.cache
def _crd_resources() -> tuple[Resource, ...]:
    resources = []
    for path in sorted(CRD_DIRECTORY.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)  # noqa: S506 (safe loader)
        spec = crd["spec"]
        for version in spec["versions"]:
            if not version.get("served", False):
                continue
            subresources = version.get("subresources") or {}
            scale = subresources.get("scale") or {}
            resources.append(
                Resource(
                    group=spec["group"],
                    version=version["name"],
                    plural=spec["names"]["plural"],
                    kind=spec["names"]["kind"],
                    subresources=frozenset(subresources),
                    builtin=False,
                    spec_replicas_path=scale.get("specReplicasPath"),
                    status_replicas_path=scale.get("statusReplicasPath"),
                    schema=(version.get("schema") or {}).get("openAPIV3Schema"),
                )
            )
    return tuple(resources)


@functools.cache
def _validator(resource: Resource) -> Draft7Validator | None:
    if resource.schema is None:
        return None
    return Draft7Validator(_openapi_to_json_schema(resource.schema))


def _openapi_to_json_schema(schema):
    """OpenAPI v3 schemas are JSON Schema but for `nullable` and the x-kubernetes-* marks;
    `int-or-string` fields take both."""
    if isinstance(schema, list):
        return [_openapi_to_json_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        out[key] = _openapi_to_json_schema(value)
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def _resources() -> dict[tuple[str, str, str], Resource]:
    return {(r.group, r.version, r.plural): r for r in (*_BUILTIN, *_crd_resources())}


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: object
    verb: str = ""
    group: str = ""
    resource: str = ""  # plural, with "/<subresource>" when one was addressed
    namespace: str = ""


def _get_path(document: dict, dotted: str):
    for key in dotted.strip(".").split("."):
        if not isinstance(document, dict):
            return None
        document = document.get(key)
    return document


def _set_path(document: dict, dotted: str, value) -> None:
    keys = dotted.strip(".").split(".")
    for key in keys[:-1]:
        document = document.setdefault(key, {})
    document[keys[-1]] = value


def merge_patch(target, patch):
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class _Refusal(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class ScaleApiServer:
    def __init__(self, *, token: str | None = None):
        self.token = token  # when set, requests need `Authorization: Bearer <token>`
        self.resources = _resources()
        # "/apis/apps/v1/namespaces/ns/deployments/x" -> the object
        self.objects: dict[str, dict] = {}
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

    # -- objects -----------------------------------------------------------------------------

    def add(self, path: str, replicas: int | None = None, body: dict | None = None) -> dict:
        """Add an object at its path, e.g. `/apis/apps/v1/namespaces/ns/deployments/x`: with
        `replicas`, a workload whose spec and status both say it (all ready); or `body`."""
        resource, namespace, name = self._resource_of(path)
        # What the resource's schema requires, under what the test gives.
        document = merge_patch(_REQUIRED_SPEC.get(resource.kind, {}), body or {})
        if _get_path(body or {}, ".spec.selector") is not None:
            # A selector is the test's whole: merged with the default's, it would select
            # only pods that carry both.
            document["spec"]["selector"] = copy.deepcopy(body["spec"]["selector"])
        document.setdefault("apiVersion", _api_version(resource))
        document.setdefault("kind", resource.kind)
        metadata = document.setdefault("metadata", {})
        metadata.update({"name": name, "namespace": namespace})
        metadata.setdefault("resourceVersion", "1")
        if replicas is not None:
            document.setdefault("spec", {})["replicas"] = replicas
            status = document.setdefault("status", {})
            status.update({"replicas": replicas, "readyReplicas": replicas})
        self._validate(resource, document)
        self.objects[path] = document
        return document

    def set_status(self, path: str, **status) -> None:
        """What a controller would report, e.g. `set_status(path, readyReplicas=2)`."""
        self.objects[path].setdefault("status", {}).update(status)

    def scale(self, path: str, replicas: int) -> None:
        """A change behind the control plane's back, as `kubectl scale` makes it."""
        self.objects[path]["spec"]["replicas"] = replicas

    def spec_replicas(self, path: str) -> int | None:
        return _get_path(self.objects[path], ".spec.replicas")

    def add_pod(
        self,
        namespace: str,
        name: str,
        ip: str,
        labels: dict,
        *,
        ready: bool = True,
        http_port: int | None = None,
        annotations: dict | None = None,
    ) -> None:
        ports = [{"name": "http", "containerPort": http_port}] if http_port else []
        metadata = {"name": name, "namespace": namespace, "labels": labels}
        if annotations:
            metadata["annotations"] = dict(annotations)
        self.objects[f"/api/v1/namespaces/{namespace}/pods/{name}"] = {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": metadata,
            "spec": {"containers": [{"name": "engine", "image": "vllm", "ports": ports}]},
            "status": {
                "phase": "Running",
                "podIP": ip,
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }

    def pod(self, namespace: str, name: str) -> dict:
        return self.objects[f"/api/v1/namespaces/{namespace}/pods/{name}"]

    def terminating_pods(self) -> set[str]:
        """Pods deleted gracefully and not yet gone (their kubelet is still stopping them)."""
        return {
            document["metadata"]["name"]
            for path, document in self.objects.items()
            if "/pods/" in path and document["metadata"].get("deletionTimestamp")
        }

    # -- controllers, one step at a time (the module docstring) ----------------------------------

    def run_replicaset_controller(self, deployment_path: str) -> list[str]:
        """One sync of the Deployment's ReplicaSet (one ReplicaSet: no rollout under way):
        it deletes as many of its active pods as it runs above `spec.replicas`, first in
        the order of `ActivePodsWithRanks.Less` (`_deletion_rank`), and reports its status.
        A deletion is graceful: the pod gets a `deletionTimestamp` and stays listed while
        its kubelet stops it. Creating pods is not modelled (a test adds them). Returns the
        pods it deleted."""
        deployment = self.objects[deployment_path]
        namespace = deployment["metadata"]["namespace"]
        wanted = _get_path(deployment, ".spec.selector.matchLabels") or {}
        pods = [
            document
            for path, document in sorted(self.objects.items())
            if path.startswith(f"/api/v1/namespaces/{namespace}/pods/")
            and all((document["metadata"].get("labels") or {}).get(k) == v
                    for k, v in wanted.items())
        ]  # fmt: skip
        active = [p for p in pods if _is_active(p)]
        surplus = len(active) - (_get_path(deployment, ".spec.replicas") or 0)
        deleted = []
        if surplus > 0:
            # The ReplicaSet's rank 5: its active pods on the same node (more go first).
            on_node: dict[str, int] = {}
            for pod in active:
                node = _get_path(pod, ".spec.nodeName") or ""
                on_node[node] = on_node.get(node, 0) + 1
            now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            for pod in sorted(active, key=lambda p: _deletion_rank(p, on_node))[:surplus]:
                pod["metadata"]["deletionTimestamp"] = now
                pod["metadata"]["deletionGracePeriodSeconds"] = (
                    _get_path(pod, ".spec.terminationGracePeriodSeconds") or 30
                )
                deleted.append(pod["metadata"]["name"])
            active = [p for p in active if _is_active(p)]
        # A ReplicaSet (and so its Deployment) counts only active pods (calculateStatus).
        ready = sum(_is_ready(p) for p in active)
        deployment.setdefault("status", {}).update(
            {"replicas": len(active), "readyReplicas": ready, "availableReplicas": ready}
        )
        return deleted

    def run_kserve_raw_deployment(self, inference_service_path: str) -> list[str]:
        """KServe in RawDeployment mode, then the HPA it made: the `<name>-predictor`
        Deployment's replicas held within the InferenceService's minReplicas and
        maxReplicas as KServe's HPA reconciler copies them (createHPA: a minimum unset or
        below 1 is 1, a maximum below the minimum is the minimum), then one sync of its
        ReplicaSet. Returns the pods deleted."""
        service = self.objects[inference_service_path]
        low = max(1, _get_path(service, ".spec.predictor.minReplicas") or 0)
        high = max(low, _get_path(service, ".spec.predictor.maxReplicas") or 0)
        namespace, name = service["metadata"]["namespace"], service["metadata"]["name"]
        predictor = f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}-predictor"
        spec = self.objects[predictor]["spec"]
        spec["replicas"] = min(high, max(low, spec.get("replicas") or 0))
        return self.run_replicaset_controller(predictor)

    # -- what was asked ------------------------------------------------------------------------

    def deleted_pods(self) -> list[str]:
        return [
            r.path.split("?", 1)[0].rsplit("/", 1)[-1]
            for r in self.requests
            if r.method == "DELETE" and r.resource == "pods"
        ]

    def patches(self) -> list[Recorded]:
        return [r for r in self.requests if r.method == "PATCH"]

    def writes(self) -> list[Recorded]:
        return [r for r in self.requests if r.verb in ("patch", "update", "create", "delete")]

    def verbs(self) -> set[tuple[str, str, str]]:
        """(API group, resource[/subresource], verb) of every request that was authorized."""
        return {(r.group, r.resource, r.verb) for r in self.requests if r.verb}

    def fail_next(self, *answers: int | str) -> None:
        """Answer the next requests with these statuses (or HANG), then normally again."""
        with self._lock:
            self._script.extend(answers)

    def fail_always(self, answer: int | str) -> None:
        self._always = answer

    # -- request handling (on the server's threads) ------------------------------------------

    def _resource_of(self, path: str) -> tuple[Resource, str, str]:
        match = _PATH.match(path)
        if match is None or not match["name"]:
            raise ValueError(f"not an object path: {path}")
        resource = self._lookup(match)
        if resource is None:
            raise ValueError(f"no such resource: {path}")
        return resource, match["ns"], match["name"]

    def _lookup(self, match) -> Resource | None:
        group = match["group"] or ""
        version = match["core_version"] or match["version"]
        return self.resources.get((group, version, match["plural"]))

    def _next_failure(self) -> int | str | None:
        with self._lock:
            if self._script:
                return self._script.pop(0)
        return self._always

    def handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        parts = urlsplit(handler.path)
        recorded = Recorded(
            method=method,
            path=handler.path,
            headers={k.lower(): v for k, v in handler.headers.items()},
            body=json.loads(raw) if raw else None,
        )
        self.requests.append(recorded)
        authorization = handler.headers.get("Authorization")
        if self.token is not None and authorization != f"Bearer {self.token}":
            return _status(handler, 401, "Unauthorized")
        match = _PATH.match(parts.path)
        resource = self._lookup(match) if match else None
        if resource is None:
            return _status(
                handler, 404, f"the server could not find the requested resource {parts.path}"
            )
        name, sub = match["name"], match["sub"]
        recorded.verb = _verb(method, name)
        recorded.group = resource.group
        recorded.resource = resource.plural + (f"/{sub}" if sub else "")
        recorded.namespace = match["ns"]
        failure = self._next_failure()
        if failure == HANG:
            # Never answer; the client's read timeout has to give up.
            self._released.wait(timeout=30)
            handler.close_connection = True
            return None
        if failure is not None:
            messages = {
                409: f'Operation cannot be fulfilled on {resource.plural} "{name}": the object '
                "has been modified; please apply your changes to the latest version and try again",
                500: "etcdserver: request timed out",
            }
            return _status(handler, int(failure), messages.get(int(failure), "injected failure"))
        if sub is not None and sub not in resource.subresources:
            # What a real server answers for a subresource the resource does not declare.
            return _status(
                handler, 404, f"the server could not find the requested resource {parts.path}"
            )
        try:
            with self._lock:
                answer = self._serve(method, resource, match, recorded, parts.query)
        except _Refusal as refusal:
            return _status(handler, refusal.code, refusal.message)
        return _json(handler, 200, answer)

    def _serve(self, method, resource: Resource, match, recorded: Recorded, query: str) -> dict:
        namespace, name, sub = match["ns"], match["name"], match["sub"]
        collection = f"{_prefix(resource)}/namespaces/{namespace}/{resource.plural}"
        if name is None:
            if method != "GET":
                raise _Refusal(405, f"{method} on a collection is not served here")
            return self._list(resource, collection, query)
        parts_path = f"{collection}/{name}"
        document = self.objects.get(parts_path)
        if document is None:
            group = f".{resource.group}" if resource.group else ""
            raise _Refusal(404, f'{resource.plural}{group} "{name}" not found')
        if method == "DELETE":
            del self.objects[parts_path]
            return document
        if method == "PATCH":
            patch = self._patch_body(resource, recorded)
            if sub == "scale":
                replicas = _get_path(patch, ".spec.replicas")
                if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
                    raise _Refusal(422, "spec.replicas: Invalid value: must be an integer >= 0")
                updated = copy.deepcopy(document)
                _set_path(updated, resource.spec_replicas_path, replicas)
            elif sub is None:
                updated = merge_patch(document, patch)
            else:
                raise _Refusal(405, f"patching {sub} is not served here")
            self._validate(resource, updated)
            version = int(document["metadata"].get("resourceVersion", "1")) + 1
            updated["metadata"]["resourceVersion"] = str(version)
            self.objects[parts_path] = document = updated
        if sub == "scale":
            return self._scale_of(resource, document)
        return document

    def _list(self, resource: Resource, collection: str, query: str) -> dict:
        wanted = {}
        for selector in parse_qs(query).get("labelSelector", []):
            for term in selector.split(","):
                label, _, value = term.partition("=")
                wanted[label] = value
        items = [
            document
            for path, document in sorted(self.objects.items())
            if path.rsplit("/", 1)[0] == collection
            and all(
                (document["metadata"].get("labels") or {}).get(k) == v for k, v in wanted.items()
            )
        ]
        return {
            "kind": f"{resource.kind}List",
            "apiVersion": _api_version(resource),
            "metadata": {},
            "items": items,
        }

    def _patch_body(self, resource: Resource, recorded: Recorded) -> dict:
        content_type = recorded.headers.get("content-type", "").split(";")[0].strip()
        accepted = [MERGE_PATCH] + ([STRATEGIC_MERGE_PATCH] if resource.builtin else [])
        if content_type not in accepted:
            raise _Refusal(
                415,
                f"the body of the request was in an unknown format - accepted media types "
                f"include: {', '.join(accepted)}",
            )
        if not isinstance(recorded.body, dict):
            raise _Refusal(400, "the patch is not a JSON object")
        # A strategic merge patch of maps (all the actuator sends) merges as a merge patch.
        return recorded.body

    def _validate(self, resource: Resource, document: dict) -> None:
        if resource.kind == "HorizontalPodAutoscaler":
            low = _get_path(document, ".spec.minReplicas")
            high = _get_path(document, ".spec.maxReplicas")
            # Without the alpha HPAScaleToZero feature gate (validation of autoscaling/v2).
            if low is not None and low < 1:
                raise _Refusal(
                    422,
                    f"spec.minReplicas: Invalid value: {low}: must be greater than or equal to 1",
                )
            if high is not None and low is not None and high < low:
                raise _Refusal(
                    422,
                    f"spec.maxReplicas: Invalid value: {high}: must be greater than or equal "
                    "to `minReplicas`",
                )
        validator = _validator(resource)
        if validator is None:
            return
        error = next(iter(validator.iter_errors(document)), None)
        if error is not None:
            field = ".".join(str(p) for p in error.absolute_path) or "<root>"
            raise _Refusal(422, f"{field}: Invalid value: {error.message}")

    def _scale_of(self, resource: Resource, document: dict) -> dict:
        metadata = document["metadata"]
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                "name": metadata["name"],
                "namespace": metadata["namespace"],
                "resourceVersion": metadata.get("resourceVersion", "1"),
            },
            "spec": {"replicas": _get_path(document, resource.spec_replicas_path) or 0},
            "status": {
                "replicas": _get_path(document, resource.status_replicas_path or ".status.x") or 0,
                "selector": "app=engine",
            },
        }


def _is_active(pod: dict) -> bool:
    """controller.IsPodActive: not finished, not being deleted."""
    return _get_path(pod, ".status.phase") not in ("Succeeded", "Failed") and not pod[
        "metadata"
    ].get("deletionTimestamp")


def _is_ready(pod: dict) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in _get_path(pod, ".status.conditions") or []
    )


_PHASE_ORDINAL = {"Pending": 0, "Unknown": 1, "Running": 2}


def _deletion_cost(pod: dict) -> int:
    """GetDeletionCostFromPodAnnotations: an int32, without "+" or leading zeros; anything
    else counts as 0."""
    value = (pod["metadata"].get("annotations") or {}).get(
        "controller.kubernetes.io/pod-deletion-cost"
    )
    if not value or not re.fullmatch(r"-?[1-9][0-9]*|0", value):
        return 0
    cost = int(value)
    return cost if -(2**31) <= cost < 2**31 else 0


def _timestamp(value: str | None) -> float | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _newer_first(value: str | None) -> tuple:
    # afterOrZero: an unset time first, then the more recent.
    seconds = _timestamp(value)
    return (0, 0.0) if seconds is None else (1, -seconds)


def _deletion_rank(pod: dict, on_node: dict[str, int]) -> tuple:
    """The order in which a ReplicaSet deletes its pods (ActivePodsWithRanks.Less, first
    deleted first), rule by rule: 1. unassigned before assigned to a node; 2. Pending before
    Unknown before Running; 3. not ready before ready; 4. the lower
    controller.kubernetes.io/pod-deletion-cost (the PodDeletionCost feature, on by default
    since Kubernetes 1.22); 5. more active pods of the set on the same node; 6. ready for
    less time; 7. more container restarts; 8. created more recently. Times are compared as
    they are (with LogarithmicScaleDown the controller compares them on a log scale and
    orders ties by UID, pseudo-randomly); remaining ties go by name here."""
    ready_since = next(
        (
            c.get("lastTransitionTime")
            for c in _get_path(pod, ".status.conditions") or []
            if c.get("type") == "Ready" and c.get("status") == "True"
        ),
        None,
    )
    restarts = max(
        (s.get("restartCount", 0) for s in _get_path(pod, ".status.containerStatuses") or []),
        default=0,
    )
    node = _get_path(pod, ".spec.nodeName") or ""
    return (
        1 if node else 0,
        _PHASE_ORDINAL.get(_get_path(pod, ".status.phase"), 0),
        1 if _is_ready(pod) else 0,
        _deletion_cost(pod),
        -on_node.get(node, 0),
        _newer_first(ready_since) if _is_ready(pod) else (0, 0.0),
        -restarts,
        _newer_first(pod["metadata"].get("creationTimestamp")),
        pod["metadata"]["name"],
    )


def _prefix(resource: Resource) -> str:
    if not resource.group:
        return f"/api/{resource.version}"
    return f"/apis/{resource.group}/{resource.version}"


def _api_version(resource: Resource) -> str:
    return f"{resource.group}/{resource.version}" if resource.group else resource.version


def _verb(method: str, name: str | None) -> str:
    if method == "GET":
        return "get" if name else "list"
    return {"PATCH": "patch", "PUT": "update", "DELETE": "delete", "POST": "create"}.get(
        method, method.lower()
    )


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

        def do_PUT(self):
            server.handle(self, "PUT")

        def log_message(self, format, *args):
            pass  # keep pytest output clean

    return Handler
