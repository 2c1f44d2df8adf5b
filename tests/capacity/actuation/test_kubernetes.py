"""The Kubernetes actuator, through the real kubernetes client, against a local scale API.

The cluster is an operator's profile (KUBERNETES_CLUSTERS), set here with pytest-django's
`settings`; a config only names it.
"""

import logging
import socket
import time

import pytest
from kubernetes.client.exceptions import ApiException

from capacity.actuation.config import validate_actuator_config
from capacity.actuation.kubernetes import KubernetesActuator
from core.errors import DomainError
from tests.capacity.actuation.conftest import apply, scale_request
from tests.support.scale_api import HANG

DEPLOYMENT_PATH = "/apis/apps/v1/namespaces/inference/deployments/llama-8b"
KSERVE_PATH = "/apis/serving.kserve.io/v1beta1/namespaces/inference/inferenceservices/llama-8b"


@pytest.fixture(autouse=True)
def _token(monkeypatch):
    monkeypatch.setenv("MU_ACTUATOR_K8S_TOKEN", "k8s-token")


@pytest.fixture
def local_cluster(settings, scale_api):
    settings.KUBERNETES_CLUSTERS = {
        "local": {"api_server": scale_api.url, "token_env": "MU_ACTUATOR_K8S_TOKEN"}
    }
    return "local"


def config(scale_api, **overrides) -> dict:
    return {
        "namespace": "inference",
        "name": "llama-8b",
        "cluster": "local",
        "timeout_seconds": 0.3,
    } | overrides


LWS_PATH = "/apis/leaderworkerset.x-k8s.io/v1/namespaces/inference/leaderworkersets/llama-8b"
STS_PATH = "/apis/apps/v1/namespaces/inference/statefulsets/llama-8b"
PREDICTOR_PATH = "/apis/apps/v1/namespaces/inference/deployments/llama-8b-predictor"
HPA_PATH = "/apis/autoscaling/v2/namespaces/inference/horizontalpodautoscalers/llama-8b"


@pytest.mark.parametrize(
    ("kind_config", "path", "content_type"),
    [
        ({"kind": "Deployment"}, DEPLOYMENT_PATH, "application/strategic-merge-patch+json"),
        ({"kind": "StatefulSet"}, STS_PATH, "application/strategic-merge-patch+json"),
        # A custom resource takes no strategic merge patch (the server answers 415).
        ({"kind": "LeaderWorkerSet"}, LWS_PATH, "application/merge-patch+json"),
        (
            {
                "kind": "Custom",
                "group": "leaderworkerset.x-k8s.io",
                "version": "v1",
                "plural": "leaderworkersets",
            },
            LWS_PATH,
            "application/merge-patch+json",
        ),
    ],
    ids=["deployment", "statefulset", "leaderworkerset", "custom-with-scale"],
)
def test_it_patches_the_scale_subresource_of_each_kind_that_has_one(
    local_cluster, scale_api, kind_config, path, content_type
):
    scale_api.add(path, replicas=1)

    result = apply(KubernetesActuator(), scale_request(config(scale_api, **kind_config)))

    assert result.ok, result.error
    assert (result.attempts, result.applied_replicas) == (1, 3)
    # status.replicas of the answer: the pods that exist, which lag the new spec.
    assert result.observed_replicas == 1
    assert scale_api.spec_replicas(path) == 3
    [patch] = scale_api.patches()
    assert patch.path == f"{path}/scale"
    assert patch.body == {"spec": {"replicas": 3}}
    assert patch.headers["content-type"] == content_type
    assert patch.headers["authorization"] == "Bearer k8s-token"


def test_the_fake_server_has_no_scale_subresource_for_an_inference_service(
    local_cluster, scale_api
):
    """As on a real cluster (KServe's CRD declares `status` only): what the actuator once
    patched, and a config of kind Custom naming it is refused."""
    from kubernetes import client

    scale_api.add(KSERVE_PATH, body={"spec": {"predictor": {"minReplicas": 1}}})
    configuration = client.Configuration(host=scale_api.url)
    configuration.api_key = {"authorization": "Bearer k8s-token"}
    api = client.CustomObjectsApi(client.ApiClient(configuration))

    with pytest.raises(client.exceptions.ApiException) as refused:
        api.patch_namespaced_custom_object_scale(
            "serving.kserve.io", "v1beta1", "inference", "inferenceservices", "llama-8b",
            {"spec": {"replicas": 3}},
        )  # fmt: skip

    assert refused.value.status == 404
    with pytest.raises(DomainError) as invalid:
        validate_actuator_config(
            "kubernetes",
            config(scale_api, kind="Custom", group="serving.kserve.io", version="v1beta1",
                   plural="inferenceservices"),
        )  # fmt: skip
    assert invalid.value.field == "actuator_config.kind"
    assert "no scale subresource" in invalid.value.message


@pytest.mark.parametrize("deployment_mode", ["Serverless", "RawDeployment"])
def test_an_inference_service_is_pinned_through_its_predictors_bounds(
    local_cluster, scale_api, deployment_mode
):
    scale_api.add(
        KSERVE_PATH,
        body={
            "metadata": {"annotations": {"serving.kserve.io/deploymentMode": deployment_mode}},
            "spec": {"predictor": {"minReplicas": 1, "maxReplicas": 2,
                                   "model": {"modelFormat": {"name": "huggingface"}}}},
        },
    )  # fmt: skip
    if deployment_mode == "RawDeployment":
        scale_api.add(PREDICTOR_PATH, replicas=1)

    result = apply(KubernetesActuator(), scale_request(config(scale_api, kind="InferenceService")))

    assert result.ok, result.error
    [patch] = scale_api.patches()
    assert patch.path == KSERVE_PATH
    assert patch.headers["content-type"] == "application/merge-patch+json"
    assert patch.body == {"spec": {"predictor": {"minReplicas": 3, "maxReplicas": 3}}}
    predictor = scale_api.objects[KSERVE_PATH]["spec"]["predictor"]
    # A merge patch: the rest of the predictor is untouched.
    assert predictor["model"] == {"modelFormat": {"name": "huggingface"}}
    assert not [r for r in scale_api.requests if r.path.endswith("/scale")]


def test_an_inference_service_under_an_external_autoscaler_is_scaled_through_its_deployment(
    local_cluster, scale_api
):
    scale_api.add(
        KSERVE_PATH,
        body={
            "metadata": {"annotations": {"serving.kserve.io/autoscalerClass": "external",
                                         "serving.kserve.io/deploymentMode": "RawDeployment"}},
            "spec": {"predictor": {"minReplicas": 1}},
        },
    )  # fmt: skip
    scale_api.add(PREDICTOR_PATH, replicas=1)

    result = apply(KubernetesActuator(), scale_request(config(scale_api, kind="InferenceService")))

    assert result.ok, result.error
    [patch] = scale_api.patches()
    assert patch.path == f"{PREDICTOR_PATH}/scale"
    assert scale_api.spec_replicas(PREDICTOR_PATH) == 3
    # KServe's own bounds are left alone: the outside controller owns the count.
    assert scale_api.objects[KSERVE_PATH]["spec"]["predictor"] == {"minReplicas": 1}


@pytest.mark.parametrize(
    ("kind", "path", "status", "expected"),
    [
        ("Deployment", DEPLOYMENT_PATH, {"readyReplicas": 1}, (4, 1)),
        ("StatefulSet", STS_PATH, {"readyReplicas": 2}, (4, 2)),
        ("LeaderWorkerSet", LWS_PATH, {"readyReplicas": 3}, (4, 3)),
        # A rollout that has not started any pod reports no readyReplicas at all.
        ("Deployment", DEPLOYMENT_PATH, {"readyReplicas": None}, (4, 0)),
    ],
    ids=["deployment", "statefulset", "leaderworkerset", "none-ready"],
)
def test_it_observes_spec_and_ready_replicas_from_the_resource_itself(
    local_cluster, scale_api, kind, path, status, expected
):
    scale_api.add(path, replicas=4)
    scale_api.set_status(path, **status)

    observation = KubernetesActuator().observe(scale_request(config(scale_api, kind=kind)))

    assert (observation.spec_replicas, observation.ready_replicas) == expected
    assert scale_api.writes() == []
    assert {r.resource for r in scale_api.requests} == {path.split("/")[-2]}


def test_in_hpa_bounds_mode_it_sets_the_hpas_bounds_and_never_the_replicas(
    local_cluster, scale_api
):
    scale_api.add(DEPLOYMENT_PATH, replicas=2)
    scale_api.add(HPA_PATH, body={"spec": {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llama-8b"},
        "minReplicas": 1, "maxReplicas": 3}})  # fmt: skip
    settings = config(scale_api, mode="hpa-bounds", hpa_name="llama-8b")

    observed = KubernetesActuator().observe(scale_request(settings))
    # A floor of 0 (nothing reserved): an HPA refuses minReplicas 0, so 1.
    result = apply(
        KubernetesActuator(),
        scale_request(settings, target_replicas=5, floor_replicas=0, ceiling_replicas=6),
    )

    assert observed.bounds == (1, 3)
    assert result.ok, result.error
    [patch] = scale_api.patches()
    assert patch.path == HPA_PATH
    assert patch.body == {"spec": {"minReplicas": 1, "maxReplicas": 6}}
    assert scale_api.spec_replicas(DEPLOYMENT_PATH) == 2


def test_the_fake_hpa_refuses_a_minimum_of_zero_as_a_real_one_does(local_cluster, scale_api):
    scale_api.add(HPA_PATH, body={"spec": {"maxReplicas": 3, "scaleTargetRef": {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": "llama-8b"}}})  # fmt: skip
    scale_api.add(DEPLOYMENT_PATH, replicas=1)
    from capacity.actuation.kubernetes import _Api, _api_client, _settings

    api = _Api(_api_client(_settings(config(scale_api))), 1.0)
    try:
        with pytest.raises(ApiException) as refused:
            api.patch_hpa("inference", "llama-8b", 0, 3)
    finally:
        api.close()

    assert refused.value.status == 422
    assert "spec.minReplicas" in refused.value.body


def test_in_metric_mode_nothing_is_written(local_cluster, scale_api):
    scale_api.add(DEPLOYMENT_PATH, replicas=2)

    result = apply(KubernetesActuator(), scale_request(config(scale_api, mode="metric")))

    assert result.ok
    assert scale_api.writes() == []


def test_an_inference_service_patch_is_validated_against_kserves_crd(local_cluster, scale_api):
    """The fake server validates writes against the vendored CRD's schema, as a real API
    server does: a string where the CRD wants an integer is a 422 naming the field."""
    scale_api.add(KSERVE_PATH, body={"spec": {"predictor": {"minReplicas": 1}}})
    from capacity.actuation.kubernetes import KSERVE, _Api, _api_client, _settings

    api = _Api(_api_client(_settings(config(scale_api))), 1.0)
    try:
        with pytest.raises(ApiException) as refused:
            api.patch_custom(
                "inference", "llama-8b", {"spec": {"predictor": {"minReplicas": "two"}}}, KSERVE
            )
    finally:
        api.close()

    assert refused.value.status == 422
    assert "spec.predictor.minReplicas" in refused.value.body


def test_a_conflict_is_retried_and_then_succeeds(local_cluster, scale_api):
    scale_api.add(DEPLOYMENT_PATH, replicas=2)
    scale_api.fail_next(409)

    result = apply(KubernetesActuator(), scale_request(config(scale_api), target_replicas=5))

    assert result.ok, result.error
    assert result.attempts == 2
    assert len(scale_api.patches()) == 2
    assert scale_api.spec_replicas(DEPLOYMENT_PATH) == 5


def test_a_server_error_that_persists_fails_after_the_last_attempt(local_cluster, scale_api):
    scale_api.add(DEPLOYMENT_PATH, replicas=2)
    scale_api.fail_always(500)

    result = apply(KubernetesActuator(), scale_request(config(scale_api)), max_attempts=3)

    assert not result.ok
    assert result.attempts == 3
    assert result.error.startswith("transient: Deployment inference/llama-8b: 500")
    assert "etcdserver: request timed out" in result.error
    assert len(scale_api.patches()) == 3
    assert scale_api.spec_replicas(DEPLOYMENT_PATH) == 2


def test_a_server_that_does_not_answer_times_out_as_a_transient_failure(local_cluster, scale_api):
    scale_api.add(DEPLOYMENT_PATH, replicas=2)
    scale_api.fail_next(HANG, HANG)

    started = time.monotonic()
    result = apply(KubernetesActuator(), scale_request(config(scale_api)), max_attempts=2)
    elapsed_seconds = time.monotonic() - started

    assert not result.ok
    assert result.attempts == 2
    assert result.error.startswith("transient:")
    assert "ReadTimeoutError" in result.error
    # One request per attempt: urllib3's own retries are off, so only our backoff retries.
    assert len(scale_api.patches()) == 2
    assert elapsed_seconds < 2.0


def test_a_timeout_followed_by_an_answer_succeeds(local_cluster, scale_api):
    scale_api.add(DEPLOYMENT_PATH, replicas=2)
    scale_api.fail_next(HANG)

    result = apply(KubernetesActuator(), scale_request(config(scale_api)))

    assert result.ok, result.error
    assert result.attempts == 2


def test_a_missing_object_is_a_permanent_failure_tried_once(local_cluster, scale_api):
    result = apply(KubernetesActuator(), scale_request(config(scale_api)))

    assert not result.ok
    assert result.attempts == 1
    assert result.error == (
        'permanent: Deployment inference/llama-8b: 404 Not Found: deployments.apps "llama-8b" '
        "not found"
    )
    assert len(scale_api.patches()) == 1


def test_a_wrong_token_is_a_permanent_failure(local_cluster, scale_api, monkeypatch):
    scale_api.add(DEPLOYMENT_PATH, replicas=2)
    monkeypatch.setenv("MU_ACTUATOR_K8S_TOKEN", "someone-elses-token")

    result = apply(KubernetesActuator(), scale_request(config(scale_api)))

    assert (result.ok, result.attempts) == (False, 1)
    assert "401 Unauthorized" in result.error


def test_an_unset_token_variable_fails_before_any_request(local_cluster, scale_api, monkeypatch):
    monkeypatch.delenv("MU_ACTUATOR_K8S_TOKEN")

    result = apply(KubernetesActuator(), scale_request(config(scale_api)))

    assert (result.ok, result.attempts) == (False, 1)
    assert result.error == (
        "permanent: environment variable MU_ACTUATOR_K8S_TOKEN (token_env of cluster 'local') "
        "is not set."
    )
    assert scale_api.requests == []


def test_an_api_server_that_refuses_connections_is_a_transient_failure(caplog, settings):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    settings.KUBERNETES_CLUSTERS = {"down": {"api_server": f"http://127.0.0.1:{closed_port}"}}
    config = {"namespace": "inference", "name": "llama-8b", "cluster": "down"}

    with caplog.at_level(logging.WARNING, logger="urllib3"):
        result = apply(
            KubernetesActuator(), scale_request(config | {"timeout_seconds": 0.3}), max_attempts=2
        )

    assert (result.ok, result.attempts) == (False, 2)
    assert result.error.startswith("transient:")
    # urllib3 would retry refused connections itself, under our backoff; it must not.
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]


def test_it_reaches_the_cluster_of_a_kubeconfig_file(scale_api, tmp_path, settings):
    scale_api.add(DEPLOYMENT_PATH, replicas=1)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        f"""
apiVersion: v1
kind: Config
clusters:
  - name: local
    cluster: {{server: "{scale_api.url}"}}
users:
  - name: scaler
    user: {{token: k8s-token}}
contexts:
  - name: local
    context: {{cluster: local, user: scaler}}
current-context: local
"""
    )
    settings.KUBERNETES_CLUSTERS = {"lab": {"kubeconfig": str(kubeconfig)}}
    config = {"namespace": "inference", "name": "llama-8b", "cluster": "lab"}

    result = apply(KubernetesActuator(), scale_request(config))

    assert result.ok, result.error
    assert scale_api.patches()[0].headers["authorization"] == "Bearer k8s-token"


def test_a_missing_kubeconfig_file_is_a_permanent_failure(tmp_path, settings):
    settings.KUBERNETES_CLUSTERS = {"lab": {"kubeconfig": str(tmp_path / "nope")}}

    result = apply(
        KubernetesActuator(),
        scale_request({"namespace": "inference", "name": "x", "cluster": "lab"}),
    )

    assert (result.ok, result.attempts) == (False, 1)
    assert "cannot load Kubernetes config of cluster 'lab'" in result.error


def test_outside_a_cluster_the_default_in_cluster_profile_fails_permanently(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)

    result = apply(KubernetesActuator(), scale_request({"namespace": "inference", "name": "x"}))

    assert (result.ok, result.attempts) == (False, 1)
    assert (
        "cannot load Kubernetes config of cluster 'in-cluster' (in-cluster service account)"
        in result.error
    )


def test_a_cluster_profile_the_operator_removed_fails_permanently_naming_the_setting(settings):
    settings.KUBERNETES_CLUSTERS = {"prod": {"in_cluster": True}}

    result = apply(
        KubernetesActuator(),
        scale_request({"namespace": "inference", "name": "x", "cluster": "lab"}),
    )

    assert (result.ok, result.attempts) == (False, 1)
    assert "'lab' is not a cluster profile of the KUBERNETES_CLUSTERS setting" in result.error


def test_a_stored_config_the_schema_no_longer_accepts_fails_naming_the_field(
    local_cluster, scale_api
):
    settings = config(scale_api, kind="Custom", group="serving.kserve.io", version="v1beta1")

    result = apply(KubernetesActuator(), scale_request(settings))

    assert (result.ok, result.attempts) == (False, 1)
    assert "actuator_config.plural" in result.error
    assert scale_api.requests == []
