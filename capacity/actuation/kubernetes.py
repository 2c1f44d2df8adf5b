"""Kubernetes: read what each workload runs every tick, and set it the way its owner allows.

Level-triggered (issue 20): `observe` reads the workload itself every tick, its
`spec.replicas` and its ready replicas (a `Scale` object has no ready count, so the resource
is read with `get`); the tick re-applies its target whenever the two disagree, whoever moved
them (`kubectl scale`, an HPA, a controller restarted), and records the drift.

Kinds, each through what the real resource has (the CRDs are in deploy/kubernetes/crds/):

- Deployment, StatefulSet: the `/scale` subresource (strategic merge patch); ready from
  `status.readyReplicas`.
- LeaderWorkerSet: its `/scale` subresource (a JSON merge patch: custom resources take no
  strategic one); ready from `status.readyReplicas`.
- InferenceService (KServe): no scale subresource, only status. Its bounds are
  `spec.predictor.minReplicas`/`maxReplicas` (merge patch), which bound Knative in Serverless
  mode and the HPA KServe makes in RawDeployment mode; `replicas` mode pins both to the
  target. With the annotation `serving.kserve.io/autoscalerClass: external` KServe leaves the
  replicas of the predictor's Deployment (`<name>-predictor`) to an outside controller, so
  that Deployment's scale is patched instead. Ready replicas come from that Deployment in
  RawDeployment mode; a Serverless one reports none (its endpoint probes say).
- Custom: any resource with a scale subresource (group/version/plural); ready unknown.

Modes (`mode` in the config): `replicas` owns the count; `hpa-bounds` patches the named HPA's
`minReplicas`/`maxReplicas` (an InferenceService's own bounds) and never `spec.replicas`, so
the HPA moves fast between ticks inside limits the control plane sets; `metric` writes
nothing (the tick does not push; /metrics publishes `mu_desired_replicas`).

Drain (capacity/actuation/drain.py says, per mode and workload, who picks the pods a
scale-down deletes and whether the tick drains them): in `replicas` mode, before a scale-down
whose pods a ReplicaSet picks (a Deployment; a KServe InferenceService in RawDeployment mode,
whose HPA, pinned to the target, scales the `<name>-predictor` Deployment; one under an
external autoscaler class) the pods the tick chose (`leaving_pods`) get
`controller.kubernetes.io/pod-deletion-cost` lowered, which the ReplicaSet controller honours
among its ready pods. Only the modes in POD_PATCHING_MODES annotate pods: their Role grants
`patch` on pods (the hpa-bounds and metric Roles grant none). StatefulSets and
LeaderWorkerSets remove their highest ordinals, which need no annotation; a Serverless
InferenceService's new bounds are a new Knative revision, which replaces every pod.

Which cluster, and with which credentials, is the operator's: the config names a profile of
KUBERNETES_CLUSTERS (`cluster`). The profiles are trusted settings, so the client connects to
them without the outbound allow-list (core/outbound.py). The verbs each mode needs are
in deploy/kubernetes/rbac/.
"""

import json
from typing import Any

import urllib3
from django.conf import settings as django_settings
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException, OpenApiException
from kubernetes.config.config_exception import ConfigException

from capacity.actuation.base import (
    KNATIVE,
    REPLICA_SET,
    Actuator,
    Observation,
    PermanentActuatorError,
    ScaleRequest,
    TransientActuatorError,
)
from capacity.actuation.config import (
    DEFAULT_CLUSTER,
    KUBERNETES_DEFAULT_TIMEOUT_SECONDS,
    validate_actuator_config,
)
from core import outbound
from core.errors import DomainError

# 409: another writer changed the object between our read and write; 408/429: the server
# asks us to come back. Every 5xx is the server's own trouble.
_TRANSIENT_STATUSES = frozenset({408, 409, 429})
_MAX_ERROR_MESSAGE_CHARS = 300

KSERVE = ("serving.kserve.io", "v1beta1", "inferenceservices")
LWS = ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")
KSERVE_AUTOSCALER_CLASS = "serving.kserve.io/autoscalerClass"
KSERVE_DEPLOYMENT_MODE = "serving.kserve.io/deploymentMode"
POD_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
# Lower than any cost a person would set by hand: these pods go first.
LEAVING_POD_COST = "-1000"
# The modes whose Role (deploy/kubernetes/rbac/<mode>.yaml) grants `patch` on pods, which
# lowering a pod's deletion cost needs; tests/capacity/actuation/test_rbac.py checks the Roles
# agree.
POD_PATCHING_MODES = frozenset({"replicas"})


def mode_of(config: dict) -> str:
    return config.get("mode") or "replicas"


def hpa_bounds(floor_replicas: int, ceiling_replicas: int | None, max_replicas: int) -> tuple:
    """(minReplicas, maxReplicas) for an HPA: it refuses minReplicas 0 unless the alpha
    HPAScaleToZero gate is on, and maxReplicas below minReplicas."""
    low = max(1, floor_replicas)
    high = max(low, ceiling_replicas if ceiling_replicas is not None else max_replicas)
    return low, high


class KubernetesActuator(Actuator):
    kind = "kubernetes"

    def apply(self, request: ScaleRequest) -> int | None:
        settings = _settings(request.config)
        return self._call(settings, lambda api: _apply(api, settings, request))

    def observe(self, request: ScaleRequest) -> Observation | None:
        settings = _settings(request.config)
        return self._call(settings, lambda api: _observe(api, settings))

    def _call(self, settings: dict, action):
        target = _describe(settings)
        api = _Api(_api_client(settings), settings.get("timeout_seconds"))
        try:
            return action(api)
        except ApiException as error:
            raise _classify(error, target) from error
        except urllib3.exceptions.HTTPError as error:
            # Timeouts, refused and reset connections: the API server may be back next try.
            raise TransientActuatorError(f"{target}: {type(error).__name__}: {error}") from error
        except (OpenApiException, ValueError, TypeError) as error:
            # The client refused to build the request or to read the answer.
            raise PermanentActuatorError(f"{target}: {type(error).__name__}: {error}") from error
        finally:
            api.close()


class _Api:
    """The calls the actuator makes, each with the config's timeout; the only place that
    names the client's methods, so deploy/kubernetes/rbac/ can be checked against them."""

    def __init__(self, api_client: k8s_client.ApiClient, timeout_seconds: float | None):
        self.client = api_client
        seconds = timeout_seconds or KUBERNETES_DEFAULT_TIMEOUT_SECONDS
        # A float alone is ignored by the client (it only turns an int into a total timeout);
        # a (connect, read) pair is honoured whatever its type.
        self.timeout = (seconds, seconds)
        self.apps = k8s_client.AppsV1Api(api_client)
        self.custom = k8s_client.CustomObjectsApi(api_client)
        self.core = k8s_client.CoreV1Api(api_client)
        self.autoscaling = k8s_client.AutoscalingV2Api(api_client)

    def get(self, kind: str, namespace: str, name: str, custom=None) -> dict:
        if kind == "Deployment":
            found = self.apps.read_namespaced_deployment(
                name, namespace, _request_timeout=self.timeout
            )
        elif kind == "StatefulSet":
            found = self.apps.read_namespaced_stateful_set(
                name, namespace, _request_timeout=self.timeout
            )
        else:
            group, version, plural = custom
            return self.custom.get_namespaced_custom_object(
                group, version, namespace, plural, name, _request_timeout=self.timeout
            )
        return self.client.sanitize_for_serialization(found)

    def get_scale(self, namespace: str, name: str, custom) -> dict:
        group, version, plural = custom
        return self.custom.get_namespaced_custom_object_scale(
            group, version, namespace, plural, name, _request_timeout=self.timeout
        )

    def patch_scale(self, kind: str, namespace: str, name: str, replicas: int, custom=None):
        body = {"spec": {"replicas": replicas}}
        if kind == "Deployment":
            return self.apps.patch_namespaced_deployment_scale(
                name, namespace, body, _request_timeout=self.timeout
            )
        if kind == "StatefulSet":
            return self.apps.patch_namespaced_stateful_set_scale(
                name, namespace, body, _request_timeout=self.timeout
            )
        group, version, plural = custom
        return self.custom.patch_namespaced_custom_object_scale(
            group, version, namespace, plural, name, body, _request_timeout=self.timeout
        )

    def patch_custom(self, namespace: str, name: str, body: dict, custom) -> dict:
        group, version, plural = custom
        return self.custom.patch_namespaced_custom_object(
            group, version, namespace, plural, name, body, _request_timeout=self.timeout
        )

    def get_hpa(self, namespace: str, name: str) -> dict:
        found = self.autoscaling.read_namespaced_horizontal_pod_autoscaler(
            name, namespace, _request_timeout=self.timeout
        )
        return self.client.sanitize_for_serialization(found)

    def patch_hpa(self, namespace: str, name: str, low: int, high: int) -> None:
        self.autoscaling.patch_namespaced_horizontal_pod_autoscaler(
            name,
            namespace,
            {"spec": {"minReplicas": low, "maxReplicas": high}},
            _request_timeout=self.timeout,
        )

    def mark_leaving(self, namespace: str, pod: str) -> None:
        self.core.patch_namespaced_pod(
            pod,
            namespace,
            {"metadata": {"annotations": {POD_DELETION_COST: LEAVING_POD_COST}}},
            _request_timeout=self.timeout,
        )

    def close(self) -> None:
        _close(self.client)


def _custom(settings: dict):
    kind = settings["kind"]
    if kind == "LeaderWorkerSet":
        return LWS
    if kind == "InferenceService":
        return KSERVE
    if kind == "Custom":
        return settings["group"], settings["version"], settings["plural"]
    return None


def _int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


def _field(document: dict, *path: str) -> Any:
    for key in path:
        if not isinstance(document, dict):
            return None
        document = document.get(key)
    return document


def _kserve(api: _Api, settings: dict) -> tuple[dict, bool, bool]:
    """The InferenceService, whether its replicas are an outside controller's (autoscaler
    class `external`), and whether it runs in RawDeployment mode (a Deployment and an HPA)
    rather than Serverless (Knative)."""
    service = api.get("InferenceService", settings["namespace"], settings["name"], KSERVE)
    annotations = _field(service, "metadata", "annotations") or {}
    external = annotations.get(KSERVE_AUTOSCALER_CLASS) == "external"
    mode = annotations.get(KSERVE_DEPLOYMENT_MODE) or _field(service, "status", "deploymentMode")
    raw = mode in ("RawDeployment", "Standard")
    return service, external, raw or external


def _predictor(settings: dict) -> str:
    # KServe names the predictor's Deployment (and Service) `<name>-predictor`
    # (pkg/constants: PredictorServiceName).
    return f"{settings['name']}-predictor"


def _workload_readiness(api: _Api, settings: dict) -> tuple[int | None, int | None]:
    """(spec.replicas, ready replicas) of the workload that runs the pods."""
    kind, namespace, name = settings["kind"], settings["namespace"], settings["name"]
    if kind in ("Deployment", "StatefulSet", "LeaderWorkerSet"):
        found = api.get(kind, namespace, name, _custom(settings))
        return _int(_field(found, "spec", "replicas")), _int(
            _field(found, "status", "readyReplicas")
        ) or 0
    if kind == "Custom":
        scale = api.get_scale(namespace, name, _custom(settings))
        return _int(_field(scale, "spec", "replicas")), None
    return None, None


def _observe(api: _Api, settings: dict) -> Observation:
    namespace = settings["namespace"]
    mode = mode_of(settings)
    if settings["kind"] == "InferenceService":
        service, external, raw = _kserve(api, settings)
        bounds = _kserve_bounds(service)
        spec = ready = None
        if raw:
            predictor = api.get("Deployment", namespace, _predictor(settings))
            spec = _int(_field(predictor, "spec", "replicas"))
            ready = _int(_field(predictor, "status", "readyReplicas")) or 0
        # A ReplicaSet picks the pods of a predictor Deployment; Knative replaces a
        # revision's pods whole when its bounds change (drain.py).
        removed_by = REPLICA_SET if raw else KNATIVE
        if external:
            return Observation(spec_replicas=spec, ready_replicas=ready, removed_by=removed_by)
        if mode == "replicas" and bounds is not None and bounds[0] == bounds[1]:
            # Pinned by us: what it is asked to run is the pinned count.
            spec = bounds[0] if spec is None else spec
        return Observation(
            spec_replicas=spec, ready_replicas=ready, bounds=bounds, removed_by=removed_by
        )
    spec, ready = _workload_readiness(api, settings)
    bounds = None
    if mode == "hpa-bounds":
        hpa = api.get_hpa(namespace, settings["hpa_name"])
        low, high = (
            _int(_field(hpa, "spec", "minReplicas")),
            _int(_field(hpa, "spec", "maxReplicas")),
        )
        # minReplicas defaults to 1 when unset (autoscaling/v2).
        bounds = (low if low is not None else 1, high) if high is not None else None
    return Observation(spec_replicas=spec, ready_replicas=ready, bounds=bounds)


def _kserve_bounds(service: dict) -> tuple[int, int] | None:
    low = _int(_field(service, "spec", "predictor", "minReplicas"))
    high = _int(_field(service, "spec", "predictor", "maxReplicas"))
    if low is None and high is None:
        return None
    # KServe's defaults: minReplicas 1, maxReplicas 0 meaning "no bound of its own".
    return (low if low is not None else 1, high if high is not None else 0)


def _apply(api: _Api, settings: dict, request: ScaleRequest) -> int | None:
    namespace, name, kind = settings["namespace"], settings["name"], settings["kind"]
    mode = mode_of(settings)
    if mode == "metric":
        # Nothing is written in this mode; the tick does not push, but a direct call must not
        # write either.
        return None
    target = request.target_replicas
    if kind == "InferenceService":
        _, external, raw = _kserve(api, settings)
        if external and mode == "hpa-bounds":
            raise PermanentActuatorError(
                f"InferenceService {namespace}/{name} has autoscalerClass external: its "
                "replicas are an outside controller's. Bound that controller instead, e.g. "
                f"kind Deployment, name {_predictor(settings)}, with its HPA's hpa_name."
            )
        if external:
            _mark_leaving(api, namespace, request, mode)
            scale = api.patch_scale("Deployment", namespace, _predictor(settings), target)
            return _status_replicas(scale)
        if mode == "hpa-bounds":
            low, high = _bounds_for(request)
        else:
            if raw:
                # KServe's HPA, pinned below, scales the predictor Deployment down; its
                # ReplicaSet takes the pods that cost least to delete. (Serverless: new bounds
                # are a new Knative revision, which replaces every pod: nothing to mark.)
                _mark_leaving(api, namespace, request, mode)
            # Pinned: Knative or the HPA can only run the target. maxReplicas 0 would mean
            # "unbounded" to KServe, so a target of 0 keeps a bound of 1 (Knative scales to
            # zero when idle; RawDeployment needs minReplicas 0 allowed by its HPA).
            low, high = target, max(1, target)
        api.patch_custom(
            namespace,
            name,
            {"spec": {"predictor": {"minReplicas": low, "maxReplicas": high}}},
            KSERVE,
        )
        return None
    if mode == "hpa-bounds":
        low, high = _bounds_for(request)
        api.patch_hpa(namespace, settings["hpa_name"], low, high)
        return None
    if kind == "Deployment":
        _mark_leaving(api, namespace, request, mode)
    scale = api.patch_scale(kind, namespace, name, target, _custom(settings))
    return _status_replicas(scale)


def _bounds_for(request: ScaleRequest) -> tuple[int, int]:
    # The same bounds the tick compares with what it observed (capacity/allocation/tick.py),
    # or it would push them again every tick. Knative would take a minimum of 0, the HPA of
    # RawDeployment not: one rule for both.
    return hpa_bounds(request.floor_replicas, request.ceiling_replicas, request.target_replicas)


def _mark_leaving(api: _Api, namespace: str, request: ScaleRequest, mode: str) -> None:
    if mode not in POD_PATCHING_MODES:
        return  # this mode's Role may not patch pods: a 403 would fail the whole push
    for pod in request.leaving_pods:
        try:
            api.mark_leaving(namespace, pod)
        except ApiException as error:
            # A pod gone already is one fewer to choose from, not a reason to keep it.
            if error.status != 404:
                raise


def _settings(config: dict) -> dict:
    # Re-checked at apply time: a row written under an older schema, or edited in the
    # database, must fail with the field's name rather than a KeyError deep in the client.
    try:
        return validate_actuator_config(KubernetesActuator.kind, config, check_hosts=False)
    except DomainError as error:
        raise PermanentActuatorError(str(error)) from error


def _describe(settings: dict) -> str:
    kind = settings["kind"]
    if kind == "Custom":
        kind = f"{settings['plural']}.{settings['group']}/{settings['version']}"
    return f"{kind} {settings['namespace']}/{settings['name']}"


def _api_client(settings: dict) -> k8s_client.ApiClient:
    """A client for the config's cluster profile (the operator's KUBERNETES_CLUSTERS)."""
    name = settings.get("cluster", DEFAULT_CLUSTER)
    profile = django_settings.KUBERNETES_CLUSTERS.get(name)
    if profile is None:
        # Profiles are checked at write time; one the operator has since removed ends here.
        raise PermanentActuatorError(
            f"cluster '{name}' is not a profile of the KUBERNETES_CLUSTERS setting "
            f"(known: {', '.join(sorted(django_settings.KUBERNETES_CLUSTERS)) or 'none'})."
        )
    configuration = k8s_client.Configuration()
    # The client would otherwise let urllib3 retry three times per call, without backoff,
    # underneath apply_with_retries; one retry policy, ours, keeps a tick's time bounded.
    configuration.retries = False
    try:
        if profile.get("api_server"):
            configuration.host = profile["api_server"].rstrip("/")
            configuration.verify_ssl = profile.get("verify_tls", True)
            token_env = profile.get("token_env")
            if token_env:
                try:
                    token = outbound.actuator_secret(token_env, kind=outbound.CLUSTER, cluster=name)
                except outbound.SecretRefused as error:
                    raise PermanentActuatorError(f"cluster '{name}': {error}") from error
                if not token:
                    raise PermanentActuatorError(
                        f"environment variable {token_env} (token_env of cluster '{name}') "
                        "is not set."
                    )
                configuration.api_key = {"authorization": token}
                configuration.api_key_prefix = {"authorization": "Bearer"}
            return k8s_client.ApiClient(configuration)
        if profile.get("kubeconfig"):
            # persist_config=False: a refreshed token is not written back to a file that may be
            # a read-only mounted secret.
            return k8s_config.new_client_from_config(
                config_file=profile["kubeconfig"],
                context=profile.get("context"),
                client_configuration=configuration,
                persist_config=False,
            )
        k8s_config.load_incluster_config(client_configuration=configuration)
        return k8s_client.ApiClient(configuration)
    except (ConfigException, OSError) as error:
        where = profile.get("kubeconfig") or "in-cluster service account"
        raise PermanentActuatorError(
            f"cannot load Kubernetes config of cluster '{name}' ({where}): {error}"
        ) from error


def _classify(error: ApiException, target: str) -> Exception:
    status = error.status or 0
    message = f"{target}: {_api_message(error)}"
    if status in _TRANSIENT_STATUSES or status >= 500:
        return TransientActuatorError(message)
    if status == 403:
        message += " (the service account lacks a verb: deploy/kubernetes/rbac/)"
    # 0 is a TLS failure (the client reports it without a status): a certificate that does not
    # verify will not verify on the next try either.
    return PermanentActuatorError(message)


def _api_message(error: ApiException) -> str:
    """`404 Not Found: deployments.apps "x" not found`, from the Status object the server sends."""
    detail = ""
    if error.body:
        try:
            parsed = json.loads(error.body)
        except (TypeError, ValueError):
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("message"), str):
            detail = parsed["message"]
        else:
            detail = str(error.body)
    reason = (error.reason or "").strip()
    text = f"{error.status} {reason}" if error.status else reason
    if detail:
        text = f"{text}: {detail}"
    return text[:_MAX_ERROR_MESSAGE_CHARS]


def _status_replicas(scale) -> int | None:
    # Deployments and StatefulSets answer a V1Scale; custom resources a plain dict.
    if isinstance(scale, dict):
        status = scale.get("status")
        replicas = status.get("replicas") if isinstance(status, dict) else None
    else:
        status = getattr(scale, "status", None)
        replicas = getattr(status, "replicas", None)
    return _int(replicas)


def _close(api_client: k8s_client.ApiClient) -> None:
    """Close a client made by `_api_client` (capacity/actuation/replicas.py lists pods with
    one)."""
    api_client.close()
    # ApiClient.close() stops its thread pool but leaves the sockets to the garbage collector.
    api_client.rest_client.pool_manager.clear()
