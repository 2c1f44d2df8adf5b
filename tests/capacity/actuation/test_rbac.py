"""The RBAC in deploy/kubernetes/rbac/ against the verbs the control plane actually calls.

Every path that talks to a cluster runs here in each actuator mode, against the fake API
server (which records each request's verb, resource and subresource): what the tick reads
and writes through the actuator, what the health probes list, and the restart of a pod. The
Role of each mode must grant exactly that: no verb missing (a 403 on a real cluster), none
unused (more than least privilege).
"""

from pathlib import Path

import pytest
import yaml

from capacity.actuation import replicas
from capacity.actuation.kubernetes import (
    POD_DELETION_COST,
    POD_PATCHING_MODES,
    KubernetesActuator,
)
from capacity.models import Deployment
from tests.capacity.actuation.conftest import scale_request
from tests.support.factories import DeploymentFactory

pytestmark = pytest.mark.django_db

RBAC = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes" / "rbac"
NS = "inference"
APPS = f"/apis/apps/v1/namespaces/{NS}"
KSERVE = f"/apis/serving.kserve.io/v1beta1/namespaces/{NS}/inferenceservices"
LWS = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NS}/leaderworkersets"
HPA = f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers"
KINDS = ("Deployment", "StatefulSet", "LeaderWorkerSet", "InferenceService")


@pytest.fixture
def cluster(settings, scale_api, monkeypatch):
    monkeypatch.setenv("MU_ACTUATOR_K8S_TOKEN", "k8s-token")
    settings.KUBERNETES_CLUSTERS = {
        "local": {"api_server": scale_api.url, "token_env": "MU_ACTUATOR_K8S_TOKEN"}
    }
    for name, annotations in (
        ("serverless", {"serving.kserve.io/deploymentMode": "Serverless"}),
        ("raw", {"serving.kserve.io/deploymentMode": "RawDeployment"}),
        ("external", {"serving.kserve.io/deploymentMode": "RawDeployment",
                      "serving.kserve.io/autoscalerClass": "external"}),
    ):  # fmt: skip
        scale_api.add(f"{KSERVE}/{name}", body={"metadata": {"annotations": annotations}})
        scale_api.add(f"{APPS}/deployments/{name}-predictor", replicas=2)
    scale_api.add(f"{APPS}/deployments/engine", replicas=2)
    scale_api.add(f"{APPS}/statefulsets/engine", replicas=2)
    scale_api.add(f"{LWS}/engine", replicas=2)
    scale_api.add(f"{HPA}/engine", body={"spec": {"maxReplicas": 4, "scaleTargetRef": {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": "engine"}}})  # fmt: skip
    scale_api.add_pod(NS, "engine-0", "10.0.0.5", {"app": "engine"})
    scale_api.add_pod(NS, "engine-1", "10.0.0.6", {"app": "engine"})
    return scale_api


def _configs(mode: str) -> list[dict]:
    base = {"namespace": NS, "cluster": "local", "mode": mode, "pod_selector": "app=engine"}
    configs = [base | {"kind": kind, "name": "engine"} for kind in KINDS[:3]]
    configs += [
        base | {"kind": "InferenceService", "name": name}
        for name in ("serverless", "raw", "external")
    ]
    if mode == "hpa-bounds":
        # Under an external autoscaler class the bounds are that controller's (refused).
        configs = [
            c | {"hpa_name": "engine"} if c["kind"] != "InferenceService" else c
            for c in configs
            if c["name"] != "external"
        ]
    return configs


def exercise(mode: str) -> None:
    """Everything the control plane does to a cluster in this mode."""
    actuator = KubernetesActuator()
    for config in _configs(mode):
        observed = actuator.observe(scale_request(config))
        assert observed is not None
        if mode == "metric":
            continue  # the tick never pushes in metric mode
        # The pods a ReplicaSet removes: a Deployment's, a RawDeployment predictor's. Handed
        # to every mode: only one whose Role may patch pods annotates them.
        drainable = config["kind"] == "Deployment" or config["name"] in ("raw", "external")
        leaving = ("engine-1",) if drainable else ()
        actuator.apply(
            scale_request(config, target_replicas=1, floor_replicas=1, ceiling_replicas=3,
                          leaving_pods=leaving)
        )  # fmt: skip
    # The health probes list the pods and restart (delete) an unhealthy one.
    deployment = DeploymentFactory(
        actuator_kind="kubernetes", actuator_config=_configs(mode)[0], current_replicas=2
    )
    assert len(replicas.list_endpoints(deployment)) >= 1
    replicas.restart(Deployment.objects.get(pk=deployment.pk), "pod:engine-0")


def granted(mode: str) -> set[tuple[str, str, str]]:
    documents = list(yaml.safe_load_all((RBAC / f"{mode}.yaml").read_text()))
    roles = [d for d in documents if d and d.get("kind") in ("Role", "ClusterRole")]
    assert [r["kind"] for r in roles] == ["Role"], "one namespaced Role per mode, no ClusterRole"
    return {
        (group, resource, verb)
        for rule in roles[0]["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


@pytest.mark.parametrize("mode", ["replicas", "hpa-bounds", "metric"])
def test_each_modes_role_grants_exactly_the_verbs_the_control_plane_calls(cluster, mode):
    exercise(mode)

    called = cluster.verbs()
    assert not {r for r in cluster.requests if r.verb == ""}, "a request the server did not map"
    assert called - granted(mode) == set(), "missing from the Role: a 403 on a real cluster"
    assert granted(mode) - called == set(), "granted but never called: not least privilege"


@pytest.mark.parametrize("mode", ["replicas", "hpa-bounds", "metric"])
def test_only_modes_whose_role_may_patch_pods_lower_a_drained_pods_deletion_cost(cluster, mode):
    exercise(mode)

    may_patch = ("", "pods", "patch") in granted(mode)
    assert (mode in POD_PATCHING_MODES) == may_patch
    annotated = [
        r.path.rsplit("/", 1)[-1]
        for r in cluster.patches()
        if r.resource == "pods" and POD_DELETION_COST in r.body["metadata"]["annotations"]
    ]
    # Once per scale-down a ReplicaSet carries out: the Deployment's, and the RawDeployment
    # and external InferenceServices' predictors'.
    assert annotated == (["engine-1"] * 3 if may_patch else [])


def test_metric_mode_writes_nothing_to_the_cluster(cluster):
    exercise("metric")

    assert cluster.writes() == []
