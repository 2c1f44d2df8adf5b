"""Drain that the platform honours (issue 33), through the tick, the real actuator, the health
probes and a Kubernetes API server built from the real resource definitions
(tests/support/scale_api.py), whose ReplicaSet and KServe steps pick pods as theirs do.

Where the platform picks the pods a scale-down removes and the mode's Role may patch pods, the
drained pods get the lowest deletion cost; where the Role may not (hpa-bounds), or nothing
would honour a choice (a Knative revision), nothing is drained and the decision says why; and
a drained pod the platform kept serves again once the scale-down has settled."""

from datetime import timedelta

import pytest
from django.utils import timezone

from capacity.allocation.tick import allocation_tick
from capacity.health.probes import probe_round
from capacity.models import Replica
from tests.capacity.allocation.test_kubernetes_reconcile import (  # noqa: F401 - fixtures
    DEPLOYMENT_PATH,
    HPA_PATH,
    NAMESPACE,
    codes,
    fleet,
    k8s,
    latest,
    on_kubernetes,
    published_endpoints,
    reserve,
)

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]

ISVC_PATH = f"/apis/serving.kserve.io/v1beta1/namespaces/{NAMESPACE}/inferenceservices/llama-8b"
PREDICTOR_PATH = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/llama-8b-predictor"
# KServe labels its predictor's pods with the InferenceService's name and the component.
KSERVE_LABELS = {"serving.kserve.io/inferenceservice": "llama-8b", "component": "predictor"}
KSERVE_SELECTOR = "serving.kserve.io/inferenceservice=llama-8b"
DEPLOYMENT_LABELS = {"app": "llama-8b"}
COST = "controller.kubernetes.io/pod-deletion-cost"


def inference_service(server, deployment_mode: str, *, low: int, high: int, replicas: int) -> None:
    """An InferenceService and, in RawDeployment mode, the predictor Deployment KServe made."""
    server.add(
        ISVC_PATH,
        body={
            "metadata": {"annotations": {"serving.kserve.io/deploymentMode": deployment_mode}},
            "spec": {"predictor": {"minReplicas": low, "maxReplicas": high}},
        },
    )
    if deployment_mode == "RawDeployment":
        server.add(PREDICTOR_PATH, replicas=replicas, body=_selecting(KSERVE_LABELS))


def _selecting(labels: dict) -> dict:
    return {
        "spec": {"selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels}}}
    }


def serving_pods(server, deployment, labels: dict, loads: dict[str, float]) -> None:
    """Pods the probes found serving, with the requests their engines were running."""
    for index, (name, running) in enumerate(loads.items()):
        server.add_pod(NAMESPACE, name, f"10.0.0.{index + 5}", labels)
        Replica.objects.create(
            deployment=deployment,
            key=f"pod:{name}",
            url=f"http://10.0.0.{index + 5}:8000",
            last_ok_at=timezone.now(),
            running_requests=running,
        )


def costs(server, names) -> dict[str, str | None]:
    return {
        name: (server.pod(NAMESPACE, name)["metadata"].get("annotations") or {}).get(COST)
        for name in names
    }


def draining() -> set[str]:
    return set(Replica.objects.filter(state=Replica.State.DRAINING).values_list("key", flat=True))


def reason(decision, code: str) -> dict:
    [found] = [r for r in decision.reasons if r["code"] == code]
    return found


def test_a_kserve_raw_deployment_scale_down_lowers_the_deletion_cost_of_exactly_the_pods_it_drains(
    fleet,  # noqa: F811
    k8s,  # noqa: F811
):
    on_kubernetes(fleet, current=3, kind="InferenceService", pod_selector=KSERVE_SELECTOR)
    inference_service(k8s, "RawDeployment", low=3, high=3, replicas=3)
    # In flight when last probed: a long stream on -a.
    loads = {"llama-8b-predictor-a": 7.0, "llama-8b-predictor-b": 0.0, "llama-8b-predictor-c": 2.0}
    serving_pods(k8s, fleet, KSERVE_LABELS, loads)
    allocation_tick()  # no tick in the stabilisation window yet: the count stands
    allocation_tick()

    decision = latest(fleet)
    assert (decision.target_replicas, decision.actuator_ok) == (1, True)
    assert costs(k8s, loads) == {
        "llama-8b-predictor-a": None,
        "llama-8b-predictor-b": "-1000",
        "llama-8b-predictor-c": "-1000",
    }
    # The costs were lowered before KServe was given the bounds its HPA scales down to.
    assert [r.resource for r in k8s.writes()] == ["pods", "pods", "inferenceservices"]
    assert k8s.objects[ISVC_PATH]["spec"]["predictor"] == {"minReplicas": 1, "maxReplicas": 1}
    assert draining() == {"pod:llama-8b-predictor-b", "pod:llama-8b-predictor-c"}
    assert published_endpoints() == {"http://10.0.0.5:8000"}
    drained = reason(decision, "drain")
    assert drained["data"]["pods"] == ["llama-8b-predictor-b", "llama-8b-predictor-c"]
    assert drained["data"]["how"] == "pod-deletion-cost"

    # KServe pins its HPA to 1..1, the HPA the predictor to one replica, and its ReplicaSet
    # deletes the two pods that cost least to delete: the drained ones.
    assert sorted(k8s.run_kserve_raw_deployment(ISVC_PATH)) == [
        "llama-8b-predictor-b",
        "llama-8b-predictor-c",
    ]


def test_a_scale_down_the_replicaset_takes_from_a_pod_still_starting_drains_no_serving_pod(
    fleet,  # noqa: F811
    k8s,  # noqa: F811
    served_model,
    acme,
):
    reserve(acme, served_model, 200)  # two replicas, kept warm
    on_kubernetes(fleet, current=3, pod_selector="app=llama-8b")
    k8s.add(DEPLOYMENT_PATH, replicas=3, body=_selecting(DEPLOYMENT_LABELS))
    serving_pods(k8s, fleet, DEPLOYMENT_LABELS, {"llama-8b-a": 4.0, "llama-8b-b": 0.0})
    # The third pod is still loading its model: not ready, so no replica the probes serve.
    k8s.add_pod(NAMESPACE, "llama-8b-c", "10.0.0.9", DEPLOYMENT_LABELS, ready=False)
    k8s.set_status(DEPLOYMENT_PATH, readyReplicas=2)
    allocation_tick()
    allocation_tick()

    decision = latest(fleet)
    assert (decision.target_replicas, decision.actuator_ok) == (2, True)
    # A ReplicaSet deletes a pod that is not ready before any ready one, whatever their
    # deletion costs: draining a serving pod would only take it out of rotation for nothing.
    assert [r.resource for r in k8s.writes()] == ["deployments/scale"]
    assert draining() == set()
    assert not {"drain", "drain_skipped"} & codes(decision)
    assert k8s.run_replicaset_controller(DEPLOYMENT_PATH) == ["llama-8b-c"]
    assert published_endpoints() == {"http://10.0.0.5:8000", "http://10.0.0.6:8000"}


@pytest.mark.parametrize("kind", ["Deployment", "InferenceService"])
def test_an_hpa_bounds_scale_down_drains_nothing_and_the_decision_says_why(
    fleet,  # noqa: F811
    k8s,  # noqa: F811
    served_model,
    kind,
):
    # No floor and one best-effort replica: the autoscaler may run 1..1, three run now.
    served_model.best_effort_ceiling_replicas = 1
    served_model.save()
    if kind == "Deployment":
        on_kubernetes(fleet, current=3, mode="hpa-bounds", hpa_name="llama-8b",
                      pod_selector="app=llama-8b")  # fmt: skip
        k8s.add(DEPLOYMENT_PATH, replicas=3, body=_selecting(DEPLOYMENT_LABELS))
        k8s.add(HPA_PATH, body={"spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llama-8b"},
            "minReplicas": 1, "maxReplicas": 3}})  # fmt: skip
        labels, bounded = DEPLOYMENT_LABELS, "horizontalpodautoscalers"
    else:
        on_kubernetes(fleet, current=3, kind="InferenceService", mode="hpa-bounds",
                      pod_selector=KSERVE_SELECTOR)  # fmt: skip
        inference_service(k8s, "RawDeployment", low=1, high=3, replicas=3)
        labels, bounded = KSERVE_LABELS, "inferenceservices"
    loads = {"llama-8b-a": 3.0, "llama-8b-b": 0.0, "llama-8b-c": 1.0}
    serving_pods(k8s, fleet, labels, loads)

    allocation_tick()

    decision = latest(fleet)
    assert "hpa_bounds" in codes(decision)
    assert reason(decision, "hpa_bounds")["data"]["bounds"] == [1, 1]
    # The bounds make the autoscaler remove two pods of its choosing; the Role of the mode
    # grants no pod patch to mark them, so none is drained, and the decision says so.
    assert {r.resource for r in k8s.writes()} == {bounded}
    assert draining() == set()
    assert len(published_endpoints()) == 3
    skipped = reason(decision, "drain_skipped")
    assert skipped["data"]["leaving_replicas"] == 2
    assert skipped["data"]["mode"] == "hpa-bounds"
    assert "rbac/hpa-bounds.yaml" in skipped["message"]
    assert "drain" not in codes(decision)


def test_a_metric_mode_scale_down_drains_nothing_and_the_decision_says_why(
    fleet,  # noqa: F811
    k8s,  # noqa: F811
):
    on_kubernetes(fleet, current=3, mode="metric", pod_selector="app=llama-8b")
    k8s.add(DEPLOYMENT_PATH, replicas=3, body=_selecting(DEPLOYMENT_LABELS))
    serving_pods(k8s, fleet, DEPLOYMENT_LABELS, {"llama-8b-a": 1.0, "llama-8b-b": 0.0})
    allocation_tick()
    allocation_tick()

    decision = latest(fleet)
    assert decision.target_replicas == 1
    # KEDA (or an HPA) follows mu_desired_replicas down and picks the pods itself; this mode
    # writes nothing to the cluster, so nothing is drained, and the decision says so.
    assert k8s.writes() == []
    assert draining() == set()
    skipped = reason(decision, "drain_skipped")
    assert (skipped["data"]["mode"], skipped["data"]["leaving_replicas"]) == ("metric", 2)
    assert "rbac/metric.yaml" in skipped["message"]


def test_a_kserve_serverless_scale_down_drains_nothing_since_knative_replaces_the_revision(
    fleet,  # noqa: F811
    k8s,  # noqa: F811
):
    on_kubernetes(fleet, current=3, kind="InferenceService", pod_selector=KSERVE_SELECTOR)
    inference_service(k8s, "Serverless", low=3, high=3, replicas=3)
    loads = {"llama-8b-predictor-00001-a": 7.0, "llama-8b-predictor-00001-b": 0.0}
    serving_pods(k8s, fleet, KSERVE_LABELS, loads)
    allocation_tick()
    allocation_tick()

    decision = latest(fleet)
    assert (decision.target_replicas, decision.actuator_ok) == (1, True)
    assert k8s.objects[ISVC_PATH]["spec"]["predictor"] == {"minReplicas": 1, "maxReplicas": 1}
    # New bounds are a new Knative revision, whose pods replace every pod of this one: no
    # pod is annotated, none leaves the gateways before its revision does.
    assert [r.resource for r in k8s.writes()] == ["inferenceservices"]
    assert draining() == set()
    assert len(published_endpoints()) == 2
    skipped = reason(decision, "drain_skipped")
    assert skipped["data"]["removed_by"] == "Knative"
    assert "revision" in skipped["message"]


@pytest.fixture
def fast_probes(settings):
    settings.HEALTH_PROBE_TIMEOUT_SECONDS = 2.0
    settings.HEALTH_PROBE_FAILURES = 3
    settings.HEALTH_PROBE_QUIET_SECONDS = 0


def test_a_drained_pod_the_platform_kept_serves_again_once_the_scale_down_settles(
    fleet,  # noqa: F811
    k8s,  # noqa: F811
    served_model,
    acme,
    tmp_path,
    fast_probes,
    settings,
):
    from tests.dataplane.supervisor.support import TINY_MODEL
    from tests.support.processes import emulator_process

    served_model.engine_model_id = "tiny"  # what the emulators serve
    served_model.save()
    reserve(acme, served_model, 200)  # two replicas, kept warm
    on_kubernetes(fleet, current=3, kind="InferenceService", pod_selector=KSERVE_SELECTOR)
    inference_service(k8s, "RawDeployment", low=3, high=3, replicas=3)
    names = ["llama-8b-predictor-a", "llama-8b-predictor-b", "llama-8b-predictor-c"]
    config = {"models": [TINY_MODEL]}
    with (
        emulator_process(config, tmp_path) as url_a,
        emulator_process(config, tmp_path) as url_b,
        emulator_process(config, tmp_path) as url_c,
    ):
        urls = dict(zip(names, (url_a, url_b, url_c), strict=True))
        for name, url in urls.items():
            # -c runs on a node its operator empties, who gave it a lower deletion cost than
            # any the control plane sets: the ReplicaSet takes it first, whatever we mark.
            k8s.add_pod(NAMESPACE, name, "127.0.0.1", KSERVE_LABELS,
                        http_port=int(url.rsplit(":", 1)[1]),
                        annotations={COST: "-5000"} if name.endswith("-c") else None)  # fmt: skip
        assert probe_round().probed == 3
        served = set(urls.values())
        assert published_endpoints() == served
        allocation_tick()
        allocation_tick()
        assert latest(fleet).target_replicas == 2
        # All idle: the first by name is drained and leaves the gateways.
        assert draining() == {"pod:llama-8b-predictor-a"}
        assert published_endpoints() == served - {urls["llama-8b-predictor-a"]}

        # KServe's HPA takes the predictor to two replicas; its ReplicaSet deletes -c.
        assert k8s.run_kserve_raw_deployment(ISVC_PATH) == ["llama-8b-predictor-c"]
        probe_round()
        assert Replica.objects.get(key="pod:llama-8b-predictor-c").state == Replica.State.GONE
        # Within the settle time the scale-down may still be under way: -a stays out.
        assert draining() == {"pod:llama-8b-predictor-a"}

        settled = timezone.now() + timedelta(seconds=settings.HEALTH_DRAIN_SETTLE_SECONDS + 1)
        result = probe_round(now=settled)

        survivor = Replica.objects.get(key="pod:llama-8b-predictor-a")
        assert survivor.state == Replica.State.HEALTHY
        assert result.failed == 0 and survivor.last_ok_at == settled  # and it answers
        assert published_endpoints() == served - {urls["llama-8b-predictor-c"]}
