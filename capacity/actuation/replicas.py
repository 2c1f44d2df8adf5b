"""Which engine endpoints a deployment runs, and how to restart one, per actuator kind.

- `process`: the replicas the process supervisor reports (`GET /status`), each at
  http://host:port; restart: `POST /restart` (the supervisor kills and starts it again).
- `kubernetes` with `pod_selector`: the running pods (by IP and `pod_port`); restart: delete
  the pod, so its ReplicaSet (or the like) starts another.
- `webhook`: the deployment's `endpoint_url` as one endpoint (none while it runs no replica);
  restart: a signed POST to the webhook with `"action": "restart"`.
- `dry_run` (and kubernetes without a selector): `endpoint_url` as one endpoint (none at zero
  replicas); a restart is only recorded.

Every HTTP call goes through the guarded client (OUTBOUND_ALLOWED_HOSTS, core/outbound.py)
and reads a secret only where ACTUATOR_SECRET_DESTINATIONS binds it (`outbound.actuator_secret`);
a deployment whose stored actuator config is flagged (`actuator_config_problem`) is neither
listed nor restarted until its config is fixed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
from kubernetes import client as k8s_client
from kubernetes.client.rest import ApiException

from capacity.actuation import kubernetes as k8s_actuator
from capacity.actuation.config import KUBERNETES_DEFAULT_TIMEOUT_SECONDS, validate_actuator_config
from capacity.actuation.webhook import signed_headers
from capacity.models import ActuatorKind, Deployment
from core import outbound
from core.errors import DomainError

ENDPOINT_KEY = "endpoint"
SUPERVISOR_TIMEOUT_SECONDS = 5.0
DEFAULT_POD_PORT = 8000


class ReplicaError(Exception):
    """Listing or restarting replicas failed; the message says where and why."""


@dataclass(frozen=True)
class Endpoint:
    key: str
    url: str


@dataclass(frozen=True)
class Observed:
    """A deployment's replicas as the data plane reports them: serving, loading, leaving."""

    ready: int
    starting: int
    draining: int


def _endpoint_only(deployment: Deployment) -> list[Endpoint]:
    # At zero replicas nothing runs behind the endpoint: probing it would only find it "down"
    # and restart what was scaled away on purpose.
    if not deployment.endpoint_url or deployment.current_replicas == 0:
        return []
    return [Endpoint(ENDPOINT_KEY, deployment.endpoint_url.rstrip("/"))]


def _supervisor(config: dict, path: str) -> tuple[str, dict]:
    """The URL of the supervisor's `path` and the headers that authenticate a call to it."""
    url = f"{config['supervisor_url'].rstrip('/')}{path}"
    headers = {}
    if config.get("token_env"):
        token = _secret(config["token_env"], "token_env", kind=outbound.SUPERVISOR, url=url)
        headers["Authorization"] = f"Bearer {token}"
    return url, headers


def _secret(name: str, field: str, *, kind: str, url: str) -> str:
    try:
        secret = outbound.actuator_secret(name, kind=kind, url=url)
    except outbound.SecretRefused as error:
        raise ReplicaError(f"actuator_config.{field}: {error}") from error
    if not secret:
        raise ReplicaError(f"environment variable {name} is not set")
    return secret


def _config(deployment: Deployment) -> dict:
    if deployment.actuator_config_problem:
        raise ReplicaError(
            f"the stored actuator config breaks the operator's rules: "
            f"{deployment.actuator_config_problem}"
        )
    try:
        # Hosts are checked where the connection is made (the guarded client).
        return validate_actuator_config(
            deployment.actuator_kind, deployment.actuator_config, check_hosts=False
        )
    except DomainError as error:
        raise ReplicaError(str(error)) from error


def list_endpoints(deployment: Deployment) -> list[Endpoint]:
    """The endpoints to probe now (replicas still starting are left out)."""
    return list_replicas(deployment)[0]


def list_replicas(deployment: Deployment) -> tuple[list[Endpoint], Observed | None]:
    """The endpoints to probe now, and what the data plane reports of all its replicas when
    it can tell them apart (the process supervisor, pods by selector); else None."""
    kind = deployment.actuator_kind
    if kind == ActuatorKind.DRY_RUN:
        return _endpoint_only(deployment), None
    config = _config(deployment)
    if kind == ActuatorKind.PROCESS:
        url, headers = _supervisor(config, "/status")
        try:
            response = outbound.request(
                "GET", url, headers=headers, timeout=SUPERVISOR_TIMEOUT_SECONDS
            )
            response.raise_for_status()
            status = response.json()["deployments"].get(deployment.name)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
            raise ReplicaError(f"process supervisor at {url}: {error}") from error
        if status is None:
            return [], Observed(0, 0, 0)
        host = config["host"]
        host = f"[{host}]" if ":" in host else host
        target = status["target"]
        active = [r for r in status["replicas"] if r["replica"] < target]
        ready = [r for r in active if r["state"] == "ready"]
        observed = Observed(
            ready=len(ready),
            # Crashed replicas are being started again.
            starting=sum(r["state"] in ("starting", "crashed") for r in active),
            draining=sum(
                r["replica"] >= target or r["state"] == "draining" for r in status["replicas"]
            ),
        )
        return [
            Endpoint(f"process:{r['replica']}", f"http://{host}:{r['port']}") for r in ready
        ], observed
    if kind == ActuatorKind.KUBERNETES and config.get("pod_selector"):
        with _core_api(config) as core:
            try:
                pods = core.list_namespaced_pod(
                    config["namespace"],
                    label_selector=config["pod_selector"],
                    _request_timeout=config.get(
                        "timeout_seconds", KUBERNETES_DEFAULT_TIMEOUT_SECONDS
                    ),
                )
            except (ApiException, OSError) as error:
                raise ReplicaError(f"listing pods {config['pod_selector']}: {error}") from error
        endpoints = []
        starting = draining = 0
        for pod in pods.items:
            status = pod.status
            ready = any(c.type == "Ready" and c.status == "True" for c in (status.conditions or []))
            if pod.metadata.deletion_timestamp:
                draining += 1
            elif status.phase == "Running" and ready and status.pod_ip:
                port = _pod_port(pod, config)
                endpoints.append(
                    Endpoint(f"pod:{pod.metadata.name}", f"http://{status.pod_ip}:{port}")
                )
            elif status.phase in ("Pending", "Running"):
                starting += 1
        observed = Observed(ready=len(endpoints), starting=starting, draining=draining)
        return sorted(endpoints, key=lambda e: e.key), observed
    return _endpoint_only(deployment), None


def _pod_port(pod, config: dict) -> int:
    """`pod_port` from the config, else the container port named "http", else 8000."""
    if config.get("pod_port"):
        return config["pod_port"]
    for container in (pod.spec.containers if pod.spec else None) or []:
        for port in container.ports or []:
            if port.name == "http":
                return port.container_port
    return DEFAULT_POD_PORT


class _core_api:
    """A CoreV1Api over the same connection settings as the kubernetes actuator."""

    def __init__(self, config: dict):
        self.api_client = k8s_actuator._api_client(config)

    def __enter__(self) -> k8s_client.CoreV1Api:
        return k8s_client.CoreV1Api(self.api_client)

    def __exit__(self, *exc_info) -> None:
        k8s_actuator._close(self.api_client)


def restart(deployment: Deployment, key: str) -> str:
    """Ask the data plane to restart or replace one replica; returns what was done."""
    kind = deployment.actuator_kind
    if kind == ActuatorKind.DRY_RUN:
        return "recorded only (dry run: nothing to restart)"
    config = _config(deployment)
    if kind == ActuatorKind.PROCESS and key.startswith("process:"):
        url, headers = _supervisor(config, "/restart")
        body = {"deployment": deployment.name, "replica": int(key.split(":", 1)[1])}
        try:
            response = outbound.request(
                "POST", url, json=body, headers=headers, timeout=SUPERVISOR_TIMEOUT_SECONDS
            )
        except httpx.HTTPError as error:
            raise ReplicaError(f"process supervisor at {url}: {error}") from error
        if response.status_code != 200:
            raise ReplicaError(
                f"process supervisor at {url} answered {response.status_code}: "
                f"{response.text[:300]}"
            )
        return f"process supervisor restarted replica {body['replica']}"
    if kind == ActuatorKind.KUBERNETES and config.get("mode") == "metric":
        # In metric mode the control plane writes nothing to the cluster (issue 20).
        return (
            "recorded only (metric mode: the control plane writes nothing to the cluster; "
            "the pod's readiness probe and its controller replace it)"
        )
    if kind == ActuatorKind.KUBERNETES and key.startswith("pod:"):
        name = key.split(":", 1)[1]
        with _core_api(config) as core:
            try:
                core.delete_namespaced_pod(
                    name,
                    config["namespace"],
                    grace_period_seconds=0,
                    _request_timeout=config.get(
                        "timeout_seconds", KUBERNETES_DEFAULT_TIMEOUT_SECONDS
                    ),
                )
            except ApiException as error:
                if error.status != 404:  # already gone: its replacement is on its way
                    raise ReplicaError(
                        f"deleting pod {name}: {error.status} {error.reason}"
                    ) from error
            except OSError as error:
                raise ReplicaError(f"deleting pod {name}: {error}") from error
        return f"pod {config['namespace']}/{name} deleted"
    if kind == ActuatorKind.WEBHOOK:
        body = json.dumps(
            {"action": "restart", "deployment": deployment.name, "replica": key},
            separators=(",", ":"),
        ).encode()
        headers = {"Content-Type": "application/json"}
        if config.get("secret_env"):
            secret = _secret(
                config["secret_env"], "secret_env", kind=outbound.WEBHOOK, url=config["url"]
            )
            headers |= signed_headers(secret, body)
        try:
            response = outbound.request(
                "POST",
                config["url"],
                content=body,
                headers=headers,
                timeout=config["timeout_seconds"],
            )
        except httpx.HTTPError as error:
            raise ReplicaError(f"{config['url']}: {error}") from error
        if not 200 <= response.status_code < 300:
            raise ReplicaError(f"{config['url']} answered {response.status_code}")
        return f"restart posted to {config['url']}"
    return "recorded only (dry run: nothing to restart)"
