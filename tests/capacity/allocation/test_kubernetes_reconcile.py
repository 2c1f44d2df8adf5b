"""The tick against a Kubernetes API server that serves what the real resources have
(tests/support/scale_api.py): level-triggered reconciliation, hpa-bounds and metric modes,
the scale-down that picks its pods, and the verbs each mode needs (deploy/kubernetes/rbac/)."""

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from capacity.allocation.tick import allocation_tick
from capacity.models import AllocationDecision, Deployment, Replica, Reservation
from capacity.publication.documents import model_documents
from tests.support.scale_api import ScaleApiServer

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]

NAMESPACE = "inference"
DEPLOYMENT_PATH = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/llama-8b"
STS_PATH = f"/apis/apps/v1/namespaces/{NAMESPACE}/statefulsets/llama-8b"
HPA_PATH = f"/apis/autoscaling/v2/namespaces/{NAMESPACE}/horizontalpodautoscalers/llama-8b"


@pytest.fixture
def k8s(settings, monkeypatch):
    server = ScaleApiServer(token="k8s-token").start()
    monkeypatch.setenv("MU_ACTUATOR_K8S_TOKEN", "k8s-token")
    settings.KUBERNETES_CLUSTERS = {
        "local": {"api_server": server.url, "token_env": "MU_ACTUATOR_K8S_TOKEN"}
    }
    yield server
    server.stop()


@pytest.fixture
def fleet(sellable):
    """llama-8b-h100: 100 MU/min per replica, up to 8."""
    Deployment.objects.filter(name="llama-8b-h100").update(target_utilisation=1.0)
    return Deployment.objects.get(name="llama-8b-h100")


def on_kubernetes(deployment: Deployment, *, current: int, **config) -> None:
    Deployment.objects.filter(pk=deployment.pk).update(
        current_replicas=current,
        actuator_kind="kubernetes",
        actuator_config={
            "namespace": NAMESPACE,
            "name": "llama-8b",
            "cluster": "local",
            "timeout_seconds": 1.0,
        }
        | config,
    )
    deployment.refresh_from_db()


def reserve(customer, model, mu_per_minute: float) -> None:
    Reservation.objects.create(
        customer=customer,
        served_model=model,
        mu_per_minute=mu_per_minute,
        starts_at=timezone.now() - timedelta(hours=1),
        status="active",
        keep_warm=True,
    )


def latest(deployment) -> AllocationDecision:
    return AllocationDecision.objects.filter(deployment=deployment).order_by("-id").first()


def codes(decision) -> set[str]:
    return {reason["code"] for reason in decision.reasons}


def test_a_kubectl_scale_behind_the_control_planes_back_is_corrected_on_the_next_tick(
    fleet, k8s, served_model, acme
):
    reserve(acme, served_model, 200)  # two replicas, kept warm
    on_kubernetes(fleet, current=2)
    k8s.add(DEPLOYMENT_PATH, replicas=2)

    allocation_tick()
    assert k8s.writes() == []  # nothing drifted, nothing changed: nothing written

    k8s.scale(DEPLOYMENT_PATH, 5)  # kubectl scale --replicas=5
    k8s.set_status(DEPLOYMENT_PATH, readyReplicas=1)
    allocation_tick()

    decision = latest(fleet)
    assert k8s.spec_replicas(DEPLOYMENT_PATH) == 2
    [patch] = k8s.patches()
    assert (patch.resource, patch.body) == ("deployments/scale", {"spec": {"replicas": 2}})
    assert decision.observed_spec_replicas == 5
    assert (decision.current_replicas, decision.target_replicas) == (2, 2)
    [drift] = [r for r in decision.reasons if r["code"] == "drift_corrected"]
    assert drift["data"] == {"observed_spec_replicas": 5, "target_replicas": 2}
    assert decision.actuator_ok is True
    # Ready replicas come from the workload itself (no pod selector here).
    assert decision.ready_replicas == 1


def test_in_hpa_bounds_mode_the_hpa_follows_the_policy_and_replicas_are_never_written(
    fleet, k8s, served_model, acme
):
    reserve(acme, served_model, 200)  # a floor of two replicas
    on_kubernetes(fleet, current=1, mode="hpa-bounds", hpa_name="llama-8b")
    k8s.add(DEPLOYMENT_PATH, replicas=3)  # the HPA's own choice
    k8s.add(HPA_PATH, body={"spec": {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llama-8b"},
        "minReplicas": 1, "maxReplicas": 3}})  # fmt: skip

    allocation_tick()

    hpa = k8s.objects[HPA_PATH]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 8)
    assert {r.resource for r in k8s.writes()} == {"horizontalpodautoscalers"}
    assert "hpa_bounds" in codes(latest(fleet))
    fleet.refresh_from_db()
    # The count is the HPA's: capacity follows what runs, not what the tick would pick.
    assert fleet.current_replicas == 3

    # A planner raises the best-effort ceiling to one replica above the floor.
    served_model.best_effort_ceiling_replicas = 1
    served_model.save()
    allocation_tick()
    assert k8s.objects[HPA_PATH]["spec"]["maxReplicas"] == 3
    writes = len(k8s.writes())

    allocation_tick()  # bounds as wanted: nothing written
    assert len(k8s.writes()) == writes
    assert k8s.spec_replicas(DEPLOYMENT_PATH) == 3


def test_in_metric_mode_nothing_is_written_and_every_scrape_reads_the_target_from_the_database(
    fleet, k8s, served_model, acme
):
    reserve(acme, served_model, 300)
    on_kubernetes(fleet, current=1, mode="metric")
    k8s.add(DEPLOYMENT_PATH, replicas=1)

    allocation_tick()

    assert k8s.writes() == []
    decision = latest(fleet)
    assert decision.target_replicas == 3
    line = 'mu_desired_replicas{deployment="llama-8b-h100",model="llama-8b"}'
    assert f"{line} 3.0" in Client().get("/metrics").content.decode()
    # Read at the scrape, from the database: any web process reports the latest target.
    AllocationDecision.objects.filter(pk=decision.pk).update(target_replicas=5)
    assert f"{line} 5.0" in Client().get("/metrics").content.decode()


def pods(k8s, fleet, loads: dict[str, float | None]) -> None:
    for index, (name, running) in enumerate(loads.items()):
        k8s.add_pod(NAMESPACE, name, f"10.0.0.{index + 5}", {"app": "llama-8b"})
        Replica.objects.create(
            deployment=fleet,
            key=f"pod:{name}",
            url=f"http://10.0.0.{index + 5}:8000",
            last_ok_at=timezone.now(),
            running_requests=running,
        )


def scale_down_to_one(fleet, k8s, kind_path: str, kind: str, loads: dict) -> None:
    on_kubernetes(fleet, current=3, kind=kind, pod_selector="app=llama-8b")
    k8s.add(kind_path, replicas=3)
    pods(k8s, fleet, loads)
    allocation_tick()  # no tick in the stabilisation window yet: the count stands
    assert latest(fleet).target_replicas == 3
    allocation_tick()
    assert latest(fleet).target_replicas == 1


def published_endpoints() -> set[str]:
    return {
        replica["endpoint"]
        for document in model_documents(now=timezone.now()).values()
        for replica in document["replicas"]
    }


def test_a_scale_down_marks_the_least_loaded_pods_to_go_first_and_gateways_stop_using_them(
    fleet, k8s
):
    # In flight when last probed: a long stream on -a; -d's engine did not say.
    loads = {"llama-8b-a": 7.0, "llama-8b-b": 0.0, "llama-8b-c": 2.0, "llama-8b-d": None}
    scale_down_to_one(fleet, k8s, DEPLOYMENT_PATH, "Deployment", loads)

    cost = "controller.kubernetes.io/pod-deletion-cost"
    marked = {
        name
        for name in loads
        if (k8s.pod(NAMESPACE, name)["metadata"].get("annotations") or {}).get(cost) == "-1000"
    }
    assert marked == {"llama-8b-b", "llama-8b-c"}
    # The annotations came before the scale-down.
    order = [r.resource for r in k8s.writes()]
    assert order == ["pods", "pods", "deployments/scale"]
    draining = set(
        Replica.objects.filter(state=Replica.State.DRAINING).values_list("key", flat=True)
    )
    assert draining == {"pod:llama-8b-b", "pod:llama-8b-c"}
    assert published_endpoints() == {"http://10.0.0.5:8000", "http://10.0.0.8:8000"}


def test_a_statefulset_scale_down_drains_its_highest_ordinals_whatever_their_load(fleet, k8s):
    loads = {"llama-8b-0": 3.0, "llama-8b-1": 0.0, "llama-8b-2": 9.0}
    scale_down_to_one(fleet, k8s, STS_PATH, "StatefulSet", loads)

    assert [r.resource for r in k8s.writes()] == ["statefulsets/scale"]  # no annotations
    draining = set(
        Replica.objects.filter(state=Replica.State.DRAINING).values_list("key", flat=True)
    )
    assert draining == {"pod:llama-8b-1", "pod:llama-8b-2"}
    assert published_endpoints() == {"http://10.0.0.5:8000"}


def test_a_scale_down_that_fails_puts_its_pods_back_into_service(fleet, k8s):
    loads = {"llama-8b-a": 1.0, "llama-8b-b": 0.0}
    on_kubernetes(fleet, current=2, pod_selector="app=llama-8b")
    k8s.add(DEPLOYMENT_PATH, replicas=2)
    pods(k8s, fleet, loads)
    allocation_tick()
    k8s.fail_always(403)

    allocation_tick()

    assert latest(fleet).actuator_ok is False
    assert not Replica.objects.filter(state=Replica.State.DRAINING).exists()
    assert len(published_endpoints()) == 2
