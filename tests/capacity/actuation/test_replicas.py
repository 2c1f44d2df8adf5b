"""Finding a deployment's replicas and restarting one, per actuator kind: the Kubernetes pods
through the real client against a local API server, a webhook receiver, and dry runs."""

import json

import pytest

from capacity.actuation.config import validate_actuator_config
from capacity.actuation.replicas import Endpoint, ReplicaError, list_endpoints, restart
from capacity.models import ActuatorKind
from tests.support.scale_api import ScaleApiServer
from tests.support.secret_bindings import bind_secret
from tests.support.webhook_receiver import WebhookReceiver

pytestmark = pytest.mark.django_db


@pytest.fixture
def k8s(monkeypatch, settings):
    monkeypatch.setenv("MU_ACTUATOR_K8S_TOKEN", "k8s-token")
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    server = ScaleApiServer(token="k8s-token").start()
    settings.KUBERNETES_CLUSTERS = {
        "local": {"api_server": server.url, "token_env": "MU_ACTUATOR_K8S_TOKEN"}
    }
    yield server
    server.stop()


def configure(deployment, kind, config, endpoint_url="", current_replicas=1):
    deployment.actuator_kind = kind
    deployment.actuator_config = validate_actuator_config(kind, config)
    deployment.endpoint_url = endpoint_url
    deployment.current_replicas = current_replicas
    deployment.save()
    return deployment


KUBERNETES_CONFIG = {
    "namespace": "inference",
    "name": "llama-8b",
    "cluster": "local",
    "pod_selector": "app=llama-8b",
}


def test_kubernetes_pods_are_the_replicas_and_a_restart_deletes_the_pod(deployment, k8s):
    configure(
        deployment,
        ActuatorKind.KUBERNETES,
        {**KUBERNETES_CONFIG, "pod_port": 8000},
    )
    k8s.add_pod("inference", "llama-8b-a", "10.0.0.5", {"app": "llama-8b"})
    k8s.add_pod("inference", "llama-8b-b", "10.0.0.6", {"app": "llama-8b"})
    k8s.add_pod("inference", "llama-8b-c", "10.0.0.7", {"app": "llama-8b"}, ready=False)
    k8s.add_pod("inference", "other", "10.0.0.9", {"app": "other"})
    k8s.add_pod("staging", "llama-8b-x", "10.0.1.5", {"app": "llama-8b"})
    assert list_endpoints(deployment) == [
        Endpoint("pod:llama-8b-a", "http://10.0.0.5:8000"),
        Endpoint("pod:llama-8b-b", "http://10.0.0.6:8000"),
    ]
    lists = [r for r in k8s.requests if r.method == "GET"]
    assert "labelSelector=app%3Dllama-8b" in lists[-1].path
    assert lists[-1].headers["authorization"] == "Bearer k8s-token"

    assert restart(deployment, "pod:llama-8b-b") == "pod inference/llama-8b-b deleted"
    assert k8s.deleted_pods() == ["llama-8b-b"]
    # Deleting a pod that is already gone is fine: its replacement is on its way.
    assert "deleted" in restart(deployment, "pod:llama-8b-b")


def test_kubernetes_errors_name_what_failed(deployment, k8s):
    configure(
        deployment,
        ActuatorKind.KUBERNETES,
        KUBERNETES_CONFIG,
    )
    k8s.add_pod("inference", "llama-8b-a", "10.0.0.5", {"app": "llama-8b"})
    k8s.fail_next(500)
    with pytest.raises(ReplicaError, match="listing pods app=llama-8b"):
        list_endpoints(deployment)
    k8s.fail_next(500)
    with pytest.raises(ReplicaError, match="deleting pod llama-8b-a: 500"):
        restart(deployment, "pod:llama-8b-a")


def test_without_a_pod_selector_the_endpoint_is_probed_as_a_whole(deployment, k8s):
    configure(
        deployment,
        ActuatorKind.KUBERNETES,
        {"namespace": "inference", "name": "llama-8b", "cluster": "local"},
        endpoint_url="http://llama.inference.svc:8000/",
    )
    assert list_endpoints(deployment) == [Endpoint("endpoint", "http://llama.inference.svc:8000")]


def test_a_webhook_restart_is_a_signed_post(deployment, monkeypatch, settings):
    monkeypatch.setenv("MU_ACTUATOR_HOOK_SECRET", "hook-secret")
    receiver = WebhookReceiver(secret="hook-secret").start()
    bind_secret(settings, "MU_ACTUATOR_HOOK_SECRET", "webhook", receiver.url)
    try:
        configure(
            deployment,
            ActuatorKind.WEBHOOK,
            {"url": receiver.url, "secret_env": "MU_ACTUATOR_HOOK_SECRET"},
            endpoint_url="http://gateway.internal/llama",
        )
        assert list_endpoints(deployment) == [Endpoint("endpoint", "http://gateway.internal/llama")]
        assert restart(deployment, "endpoint").startswith("restart posted to")
        (received,) = receiver.received
        # The receiver checks the signature: 200 means it verified.
        assert received.status == 200
        assert json.loads(received.raw_body) == {
            "action": "restart",
            "deployment": deployment.name,
            "replica": "endpoint",
        }
        receiver.fail_next(503)
        with pytest.raises(ReplicaError, match="answered 503"):
            restart(deployment, "endpoint")
    finally:
        receiver.stop()


def test_a_dry_run_deployment_records_the_restart_only(deployment):
    configure(deployment, ActuatorKind.DRY_RUN, {}, endpoint_url="http://127.0.0.1:9/")
    assert list_endpoints(deployment) == [Endpoint("endpoint", "http://127.0.0.1:9")]
    assert restart(deployment, "endpoint").startswith("recorded only")
    deployment.endpoint_url = ""
    assert list_endpoints(deployment) == []


def test_an_endpoint_at_zero_replicas_is_not_probed(deployment):
    # Scaled to zero on purpose: nothing runs behind the URL, and nothing should restart it.
    configure(deployment, ActuatorKind.DRY_RUN, {}, "http://127.0.0.1:9/", current_replicas=0)
    assert list_endpoints(deployment) == []
