"""The patch the Kubernetes actuator really sends to a pod it drains passes the admission
policy shipped beside its Role (deploy/kubernetes/rbac/replicas-pod-patch-policy.yaml), and
the same pod re-imaged by that identity does not (issue 34, finding 16). The pod before and
after is the fake API server's (tests/support/scale_api.py), changed by the actuator through
the official Kubernetes client; the policy's CEL runs in cel-python."""

import copy

import pytest

from capacity.actuation.kubernetes import POD_DELETION_COST, KubernetesActuator
from tests.capacity.actuation.conftest import scale_request
from tests.deploy.admission_policy import admit
from tests.deploy.test_pod_patch_policy import SCALER, pod_patch_policy

pytestmark = pytest.mark.django_db

NS = "inference"


@pytest.fixture
def cluster(settings, scale_api, monkeypatch):
    monkeypatch.setenv("MU_ACTUATOR_K8S_TOKEN", "k8s-token")
    settings.KUBERNETES_CLUSTERS = {
        "local": {"api_server": scale_api.url, "token_env": "MU_ACTUATOR_K8S_TOKEN"}
    }
    scale_api.add(f"/apis/apps/v1/namespaces/{NS}/deployments/engine", replicas=2)
    scale_api.add_pod(NS, "engine-0", "10.0.0.5", {"app": "engine"})
    scale_api.add_pod(NS, "engine-1", "10.0.0.6", {"app": "engine"}, annotations={"a": "b"})
    return scale_api


def test_the_actuators_drain_patch_is_admitted_and_an_image_change_is_not(cluster):
    before = copy.deepcopy(cluster.pod(NS, "engine-1"))
    config = {"namespace": NS, "cluster": "local", "mode": "replicas", "kind": "Deployment",
              "name": "engine", "pod_selector": "app=engine"}  # fmt: skip
    KubernetesActuator().apply(
        scale_request(config, target_replicas=1, floor_replicas=1, leaving_pods=("engine-1",))
    )
    after = cluster.pod(NS, "engine-1")
    # The actuator did patch the pod (so the verdict below is about a real change).
    assert after["metadata"]["annotations"][POD_DELETION_COST]
    assert [r.resource for r in cluster.patches()].count("pods") == 1
    verdict = admit(pod_patch_policy(), username=SCALER, old=before, new=after)
    assert verdict.matched and verdict.allowed, verdict.denials

    reimaged = copy.deepcopy(after)
    reimaged["spec"]["containers"][0]["image"] = "registry.example/miner:1"
    refused = admit(pod_patch_policy(), username=SCALER, old=before, new=reimaged)
    assert refused.matched and not refused.allowed
