"""Picking an actuator by kind, the dry run, and the config each kind accepts."""

import sys

import pytest

from capacity.actuation.base import PermanentActuatorError
from capacity.actuation.config import validate_actuator_config
from capacity.actuation.dry_run import DryRunActuator
from capacity.actuation.kubernetes import KubernetesActuator
from capacity.actuation.registry import actuator_for
from capacity.actuation.webhook import WebhookActuator
from core.errors import DomainError
from tests.capacity.actuation.conftest import apply, scale_request


@pytest.mark.parametrize(
    ("kind", "actuator_class"),
    [("dry_run", DryRunActuator), ("kubernetes", KubernetesActuator), ("webhook", WebhookActuator)],
)
def test_each_kind_has_its_actuator(kind, actuator_class):
    actuator = actuator_for(kind)
    assert isinstance(actuator, actuator_class)
    assert actuator.kind == kind


def test_an_unknown_kind_is_a_permanent_error():
    with pytest.raises(PermanentActuatorError, match="unknown actuator kind 'ssh'"):
        actuator_for("ssh")


def test_the_process_kind_is_loaded_on_demand():
    assert actuator_for("process").kind == "process"


def test_the_process_kind_is_reported_unavailable_when_its_module_is_missing(monkeypatch):
    # None in sys.modules makes the import fail as if the module did not exist.
    monkeypatch.setitem(sys.modules, "capacity.actuation.process", None)
    with pytest.raises(PermanentActuatorError, match="process actuator unavailable"):
        actuator_for("process")


def test_the_dry_run_touches_nothing_and_observes_nothing(caplog):
    with caplog.at_level("DEBUG", logger="capacity.actuation.dry_run"):
        result = apply(actuator_for("dry_run"), scale_request({}, target_replicas=4))

    assert result.ok
    assert (result.attempts, result.applied_replicas, result.observed_replicas) == (1, 4, None)
    assert "llama-8b-h100 (llama-8b) would scale 1 -> 4 replicas (decision 42)" in caplog.text


KSERVE = {"group": "serving.kserve.io", "version": "v1beta1", "plural": "inferenceservices"}
LWS = {"group": "leaderworkerset.x-k8s.io", "version": "v1", "plural": "leaderworkersets"}


def test_a_custom_resource_is_named_by_group_version_and_plural():
    config = {"namespace": "inference", "name": "llama", "kind": "Custom"} | LWS
    assert validate_actuator_config("kubernetes", config) == config | {"cluster": "in-cluster"}


@pytest.mark.parametrize(
    ("config", "field", "reason"),
    [
        ({"kind": "Custom", "group": "x.example", "version": "v1"}, "plural", "required"),
        ({"kind": "Custom"} | KSERVE | {"version": "beta"}, "version", "API version"),
        ({"kind": "Deployment", "plural": "deployments"}, "plural", "only to kind Custom"),
        ({"kind": "ReplicaSet"}, "kind", "valid choice"),
        # Its CRD has no scale subresource: the kind of its own sets its bounds instead.
        ({"kind": "Custom"} | KSERVE, "kind", "use kind InferenceService"),
        ({"mode": "hpa-bounds"}, "hpa_name", "is required in mode hpa-bounds"),
        ({"mode": "replicas", "hpa_name": "llama"}, "hpa_name", "applies only to mode hpa-bounds"),
        (
            {"mode": "hpa-bounds", "kind": "InferenceService", "hpa_name": "x"},
            "hpa_name",
            "minReplicas/maxReplicas",
        ),  # fmt: skip
        ({"mode": "fight"}, "mode", "valid choice"),
        ({"cluster": "nowhere"}, "cluster", "not a cluster profile of the KUBERNETES_CLUSTERS"),
        ({"api_server": "https://k8s.example:6443"}, "api_server", "KUBERNETES_CLUSTERS"),
        ({"kubeconfig": "/k"}, "kubeconfig", "is an operator setting now"),
        ({"token_env": "MU_ACTUATOR_K8S_TOKEN"}, "token_env", "is an operator setting now"),
        ({"verify_tls": False}, "verify_tls", "is an operator setting now"),
        ({"timeout_seconds": 0}, "timeout_seconds", "greater than or equal"),
    ],
)
def test_it_refuses_a_kubernetes_config_that_cannot_work(config, field, reason):
    with pytest.raises(DomainError) as refused:
        validate_actuator_config("kubernetes", {"namespace": "inference", "name": "x"} | config)
    fields = refused.value.fields
    assert any(reason in text for text in fields[f"actuator_config.{field}"]), fields


def test_the_kubernetes_timeout_is_stored_only_when_given():
    stored = validate_actuator_config(
        "kubernetes",
        {
            "namespace": "inference",
            "name": "x",
            "timeout_seconds": 2,
        },
    )
    assert stored["timeout_seconds"] == 2.0
    assert "timeout_seconds" not in validate_actuator_config(
        "kubernetes", {"namespace": "inference", "name": "x"}
    )


def test_a_webhook_url_must_be_http():
    with pytest.raises(DomainError) as refused:
        validate_actuator_config(
            "webhook", {"url": "ftp://hooks.example/scale", "secret_env": "MU_ACTUATOR_HOOK"}
        )
    assert "actuator_config.url" in refused.value.fields
