"""Kubernetes: patch the scale subresource of a Deployment, a StatefulSet or a custom resource.

A custom resource is any kind whose CRD declares a scale subresource (a KServe
InferenceService, a LeaderWorkerSet), named by group/version/plural. The body is the same for
all three, `{"spec": {"replicas": N}}`; the client sends it as a strategic merge patch to
Deployments and StatefulSets and as a JSON merge patch to custom resources (which do not
accept strategic ones). The permissions it needs are in `deploy/rbac.yaml`.

Which cluster, and with which credentials, is the operator's: the config names a profile of
KUBERNETES_CLUSTERS (`cluster`). The profiles are trusted settings, so the client connects to
them without the outbound allow-list (controlplane/outbound.py).
"""

import json
import os

import urllib3
from django.conf import settings as django_settings
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException, OpenApiException
from kubernetes.config.config_exception import ConfigException

from capacity.actuation.base import (
    Actuator,
    PermanentActuatorError,
    ScaleRequest,
    TransientActuatorError,
)
from capacity.actuation.config import (
    DEFAULT_CLUSTER,
    KUBERNETES_DEFAULT_TIMEOUT_SECONDS,
    validate_actuator_config,
)
from controlplane.errors import DomainError

# 409: another writer changed the object between our read and write; 408/429: the server
# asks us to come back. Every 5xx is the server's own trouble.
_TRANSIENT_STATUSES = frozenset({408, 409, 429})
_MAX_ERROR_MESSAGE_CHARS = 300


class KubernetesActuator(Actuator):
    kind = "kubernetes"

    def apply(self, request: ScaleRequest) -> int | None:
        settings = _settings(request.config)
        timeout_seconds = settings.get("timeout_seconds", KUBERNETES_DEFAULT_TIMEOUT_SECONDS)
        target = _describe(settings)
        body = {"spec": {"replicas": request.target_replicas}}
        api_client = _api_client(settings)
        try:
            scale = _patch_scale(
                api_client,
                settings,
                body,
                # A float alone is ignored by the client (it only turns an int into a total
                # timeout); a (connect, read) pair is honoured whatever its type.
                request_timeout=(timeout_seconds, timeout_seconds),
            )
        except ApiException as error:
            raise _classify(error, target) from error
        except urllib3.exceptions.HTTPError as error:
            # Timeouts, refused and reset connections: the API server may be back next try.
            raise TransientActuatorError(f"{target}: {type(error).__name__}: {error}") from error
        except (OpenApiException, ValueError, TypeError) as error:
            # The client refused to build the request or to read the answer.
            raise PermanentActuatorError(f"{target}: {type(error).__name__}: {error}") from error
        finally:
            _close(api_client)
        return _status_replicas(scale)


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
                token = os.environ.get(token_env, "")
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


def _patch_scale(api_client, settings: dict, body: dict, *, request_timeout):
    namespace, name, kind = settings["namespace"], settings["name"], settings["kind"]
    if kind == "Deployment":
        return k8s_client.AppsV1Api(api_client).patch_namespaced_deployment_scale(
            name, namespace, body, _request_timeout=request_timeout
        )
    if kind == "StatefulSet":
        return k8s_client.AppsV1Api(api_client).patch_namespaced_stateful_set_scale(
            name, namespace, body, _request_timeout=request_timeout
        )
    return k8s_client.CustomObjectsApi(api_client).patch_namespaced_custom_object_scale(
        settings["group"],
        settings["version"],
        namespace,
        settings["plural"],
        name,
        body,
        _request_timeout=request_timeout,
    )


def _classify(error: ApiException, target: str) -> Exception:
    status = error.status or 0
    message = f"{target}: {_api_message(error)}"
    if status in _TRANSIENT_STATUSES or status >= 500:
        return TransientActuatorError(message)
    if status == 403:
        message += " (the service account needs get and patch on its scale: deploy/rbac.yaml)"
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
    if isinstance(replicas, int) and not isinstance(replicas, bool):
        return replicas
    return None


def _close(api_client: k8s_client.ApiClient) -> None:
    api_client.close()
    # ApiClient.close() stops its thread pool but leaves the sockets to the garbage collector.
    api_client.rest_client.pool_manager.clear()
