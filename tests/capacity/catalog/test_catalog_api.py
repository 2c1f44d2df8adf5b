import pytest

from capacity.models import Deployment, GpuPool
from core.models import AuditEntry

pytestmark = pytest.mark.django_db

DEPLOYMENTS = "/api/v1/deployments/"


def deployment_body(**overrides):
    body = {
        "name": "llama-8b-h100-b",
        "served_model": "llama-8b",
        "gpu_pool": "us-east-h100",
        "gpus_per_replica": 1,
        "min_replicas": 1,
        "max_replicas": 4,
        "cold_start_seconds": 90,
        "actuator_kind": "dry_run",
    }
    return body | overrides


def error_fields(response) -> dict:
    return response.json()["error"].get("fields", {})


def test_a_planner_builds_a_catalog_through_the_api(planner_client):
    assert (
        planner_client.post(
            "/api/v1/gpu-types/",
            {"name": "H100-80GB", "memory_gb": 80, "hourly_cost_usd": "4.25"},
            format="json",
        ).status_code
        == 201
    )
    assert (
        planner_client.post(
            "/api/v1/gpu-pools/",
            {"name": "us-east-h100", "gpu_type": "H100-80GB", "gpu_count": 8},
            format="json",
        ).status_code
        == 201
    )
    response = planner_client.post(
        "/api/v1/models/",
        {
            "name": "llama-8b",
            "engine_model_id": "meta-llama/Llama-3.1-8B-Instruct",
            "parameters_billions": 8,
            "reference_gpu_type": "H100-80GB",
            "context_length_tokens": 131072,
        },
        format="json",
    )
    assert response.status_code == 201, response.json()
    response = planner_client.post(
        DEPLOYMENTS,
        deployment_body(
            actuator_kind="kubernetes",
            actuator_config={"namespace": "inference", "name": "llama-8b"},
        ),
        format="json",
    )
    assert response.status_code == 201, response.json()
    deployment = Deployment.objects.get(name="llama-8b-h100-b")
    # Defaults of the kind are filled in and stored.
    assert deployment.actuator_config == {
        "namespace": "inference",
        "name": "llama-8b",
        "kind": "Deployment",
        "cluster": "in-cluster",
    }
    listing = planner_client.get(DEPLOYMENTS + "?served_model__name=llama-8b").json()
    assert [row["name"] for row in listing["results"]] == ["llama-8b-h100-b"]


def test_a_catalog_service_key_may_write_the_catalog(catalog_service_client, gpu_type):
    response = catalog_service_client.post(
        "/api/v1/gpu-pools/",
        {"name": "eu-west", "gpu_type": gpu_type.name, "gpu_count": 4},
        format="json",
    )
    assert response.status_code == 201
    assert GpuPool.objects.filter(name="eu-west").exists()


def test_it_refuses_max_below_min(planner_client, served_model, pool):
    response = planner_client.post(
        DEPLOYMENTS, deployment_body(min_replicas=5, max_replicas=2), format="json"
    )
    assert response.status_code == 400
    assert "max_replicas" in error_fields(response)
    assert "min_replicas (5)" in response.json()["error"]["message"]
    assert not Deployment.objects.exists()


def test_it_refuses_an_unknown_pool(planner_client, served_model, pool):
    response = planner_client.post(DEPLOYMENTS, deployment_body(gpu_pool="nowhere"), format="json")
    assert response.status_code == 400
    assert "gpu_pool" in error_fields(response)
    assert "nowhere" in error_fields(response)["gpu_pool"][0]


@pytest.mark.parametrize("field", ["gpus_per_replica", "max_replicas", "min_replicas"])
def test_it_refuses_negative_counts(planner_client, served_model, pool, field):
    response = planner_client.post(DEPLOYMENTS, deployment_body(**{field: -1}), format="json")
    assert response.status_code == 400
    assert field in error_fields(response)


def test_it_refuses_zero_gpus_per_replica(planner_client, served_model, pool):
    response = planner_client.post(DEPLOYMENTS, deployment_body(gpus_per_replica=0), format="json")
    assert response.status_code == 400
    assert "gpus_per_replica" in error_fields(response)


def test_it_refuses_a_deployment_larger_than_its_pool_with_the_numbers(
    planner_client, served_model, pool
):
    response = planner_client.post(
        DEPLOYMENTS, deployment_body(gpus_per_replica=4, max_replicas=3), format="json"
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "exceeds_pool"
    assert "max_replicas" in error["fields"]
    assert error["details"] == {
        "max_replicas": 3,
        "gpus_per_replica": 4,
        "needed_gpus": 12,
        "pool": "us-east-h100",
        "pool_gpu_count": 8,
    }
    assert "12 GPUs exceeds pool 'us-east-h100', which has 8 GPUs" in error["message"]


@pytest.mark.parametrize(
    ("kind", "config", "field"),
    [
        ("kubernetes", {"name": "llama"}, "actuator_config.namespace"),
        ("kubernetes", {"namespace": "Bad_NS", "name": "llama"}, "actuator_config.namespace"),
        ("webhook", {}, "actuator_config.url"),
        ("webhook", {"url": "http://127.0.0.1:9/scale", "secret": "s3"}, "actuator_config.secret"),
        ("process", {"engine": "vllm"}, "actuator_config.base_port"),
        ("process", {"base_port": 9000}, "actuator_config.engine"),
        ("dry_run", {"anything": 1}, "actuator_config.anything"),
        ("kubernetes", [1, 2], "actuator_config"),
    ],
)
def test_it_refuses_an_actuator_config_missing_or_misnaming_a_field(
    planner_client, served_model, pool, kind, config, field
):
    response = planner_client.post(
        DEPLOYMENTS, deployment_body(actuator_kind=kind, actuator_config=config), format="json"
    )
    assert response.status_code == 400, response.json()
    assert field in error_fields(response)
    assert not Deployment.objects.exists()


def test_it_refuses_an_unknown_actuator_kind(planner_client, served_model, pool):
    response = planner_client.post(DEPLOYMENTS, deployment_body(actuator_kind="ssh"), format="json")
    assert response.status_code == 400
    assert "actuator_kind" in error_fields(response)


def test_an_update_is_checked_like_a_creation(planner_client, deployment):
    url = f"{DEPLOYMENTS}{deployment.name}/"
    response = planner_client.patch(url, {"max_replicas": 9}, format="json")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "exceeds_pool"

    response = planner_client.patch(url, {"min_replicas": 6}, format="json")
    assert response.status_code == 400

    response = planner_client.patch(
        url, {"actuator_kind": "webhook", "actuator_config": {}}, format="json"
    )
    assert "actuator_config.url" in error_fields(response)

    response = planner_client.patch(url, {"max_replicas": 8, "min_replicas": 2}, format="json")
    assert response.status_code == 200
    deployment.refresh_from_db()
    assert (deployment.min_replicas, deployment.max_replicas) == (2, 8)


def test_a_pool_cannot_shrink_below_a_deployment(planner_client, deployment, pool):
    response = planner_client.patch(
        f"/api/v1/gpu-pools/{pool.name}/", {"gpu_count": 2}, format="json"
    )
    assert response.status_code == 409
    assert "llama-8b-h100" in response.json()["error"]["message"]
    pool.refresh_from_db()
    assert pool.gpu_count == 8


def test_a_pool_in_use_cannot_be_deleted(planner_client, deployment, pool):
    response = planner_client.delete(f"/api/v1/gpu-pools/{pool.name}/")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "in_use"
    assert GpuPool.objects.filter(pk=pool.pk).exists()


def test_a_duplicate_name_is_a_clear_400(planner_client, gpu_type):
    response = planner_client.post(
        "/api/v1/gpu-types/",
        {"name": gpu_type.name, "memory_gb": 80, "hourly_cost_usd": "1"},
        format="json",
    )
    assert response.status_code == 400
    assert "name" in error_fields(response)


def test_the_database_refuses_min_above_max_even_without_the_api(deployment):
    from django.db import IntegrityError, transaction

    with pytest.raises(IntegrityError), transaction.atomic():
        Deployment.objects.filter(pk=deployment.pk).update(min_replicas=10, max_replicas=1)


def test_the_database_refuses_zero_gpus_per_replica(deployment):
    from django.db import IntegrityError, transaction

    with pytest.raises(IntegrityError), transaction.atomic():
        Deployment.objects.filter(pk=deployment.pk).update(gpus_per_replica=0)


def test_nightly_benchmarks_and_the_prometheus_selector_are_set_through_the_api(
    planner_client, deployment
):
    from benchmarking.services import suite_create

    suite_create(name="nightly", grid=[[128, 16]], slo_ttft_p95_ms=1000, slo_tpot_p95_ms=100)
    url = f"{DEPLOYMENTS}{deployment.name}/"
    response = planner_client.patch(
        url,
        {
            "benchmark_suite": "nightly",
            "benchmark_nightly": True,
            "prometheus_selector": 'job="vllm",  model_name="llama"',
        },
        format="json",
    )
    assert response.status_code == 200, response.json()
    deployment.refresh_from_db()
    assert deployment.benchmark_nightly is True
    assert deployment.benchmark_suite.name == "nightly"
    assert deployment.prometheus_selector == 'job="vllm", model_name="llama"'


def test_a_malformed_prometheus_selector_is_a_400_naming_it(planner_client, deployment):
    response = planner_client.patch(
        f"{DEPLOYMENTS}{deployment.name}/",
        {"prometheus_selector": 'job="vllm"} or vector(1) or {'},
        format="json",
    )
    assert response.status_code == 400
    assert "prometheus_selector" in error_fields(response)
    deployment.refresh_from_db()
    assert deployment.prometheus_selector == ""


def test_current_replicas_above_max_replicas_is_a_400_naming_it(planner_client, deployment):
    url = f"{DEPLOYMENTS}{deployment.name}/"
    response = planner_client.patch(url, {"current_replicas": 99}, format="json")
    assert response.status_code == 400
    assert "current_replicas" in error_fields(response)
    response = planner_client.post(
        DEPLOYMENTS, deployment_body(current_replicas=5, max_replicas=4), format="json"
    )
    assert response.status_code == 400
    assert "current_replicas" in error_fields(response)
    deployment.refresh_from_db()
    assert deployment.current_replicas == 0
    assert Deployment.objects.count() == 1


def test_max_replicas_may_still_drop_below_what_runs(planner_client, deployment):
    # The replicas running above the new maximum are the next tick's to scale down.
    Deployment.objects.filter(pk=deployment.pk).update(current_replicas=4)
    body = planner_client.get(f"{DEPLOYMENTS}{deployment.name}/").json()
    response = planner_client.patch(
        f"{DEPLOYMENTS}{deployment.name}/",
        {"max_replicas": 2, "current_replicas": body["current_replicas"]},
        format="json",
    )
    assert response.status_code == 200, response.json()
    assert response.json()["max_replicas"] == 2


def test_a_headroom_patch_on_a_model_sets_it_and_a_bad_one_is_a_400(planner_client, served_model):
    # headroom and overcommit were not fields of the model's API: a PATCH that set them
    # answered 200 and changed nothing. Now planners set them; out of range is a 400.
    response = planner_client.patch(
        f"/api/v1/models/{served_model.name}/", {"headroom": 0.25, "overcommit": 1.5},
        format="json",
    )  # fmt: skip
    assert response.status_code == 200, response.json()
    served_model.refresh_from_db()
    assert (served_model.headroom, served_model.overcommit) == (0.25, 1.5)
    response = planner_client.patch(
        f"/api/v1/models/{served_model.name}/", {"headroom": 1.0}, format="json"
    )
    assert response.status_code == 400
    assert "headroom" in response.json()["error"]["fields"]
    served_model.refresh_from_db()
    assert served_model.headroom == 0.25


@pytest.mark.parametrize("client_name", ["planner_client", "catalog_service_client"])
def test_prediction_is_switched_per_model_audited(request, client_name, served_model):
    # The planners' switch of rule 3c (capacity.allocation.policy), by a planner's session and
    # by a catalog:write key: stored, shown, and in the audit log with who changed it.
    client = request.getfixturevalue(client_name)
    url = f"/api/v1/models/{served_model.name}/"
    assert client.get(url).json()["prediction_enabled"] is True
    response = client.patch(url, {"prediction_enabled": False}, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["prediction_enabled"] is False
    served_model.refresh_from_db()
    assert served_model.prediction_enabled is False
    entry = AuditEntry.objects.get(action="served_model.update", object_id=str(served_model.pk))
    assert (entry.before, entry.after) == (
        {"prediction_enabled": True},
        {"prediction_enabled": False},
    )
    assert entry.actor.startswith("user:" if client_name == "planner_client" else "key:")

    response = client.patch(url, {"prediction_enabled": "maybe"}, format="json")
    assert response.status_code == 400
    assert list(error_fields(response)) == ["prediction_enabled"]
    served_model.refresh_from_db()
    assert served_model.prediction_enabled is False
    assert AuditEntry.objects.filter(action="served_model.update").count() == 1


def test_an_engine_profile_is_set_through_the_api_and_shown_to_planners(planner_client, deployment):
    url = f"{DEPLOYMENTS}{deployment.name}/"
    profile = {"max_num_seqs": 128, "kv_cache_tokens": 400_000, "context_length": 16_384}
    response = planner_client.patch(url, {"engine_profile": profile}, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["engine_profile"] == profile
    deployment.refresh_from_db()
    assert deployment.engine_profile == profile
    assert planner_client.get(url).json()["engine_profile"] == profile


@pytest.mark.parametrize(
    ("profile", "field", "message"),
    [
        ({"max_num_seq": 128}, "engine_profile.max_num_seq", "unknown engine parameter"),
        ({"max_num_seqs": 0}, "engine_profile.max_num_seqs", "from 1 to"),
        ({"max_num_seqs": "lots"}, "engine_profile.max_num_seqs", "whole number"),
        ({"max_num_seqs": 2.5}, "engine_profile.max_num_seqs", "whole number"),
        ({"max_num_seqs": True}, "engine_profile.max_num_seqs", "whole number"),
        (
            {"kv_cache_tokens": 4096, "context_length": 8192},
            "engine_profile.kv_cache_tokens",
            "at least one sequence",
        ),
        ([128], "engine_profile", "JSON object"),
    ],
)
def test_a_bad_engine_profile_is_a_400_naming_its_key(
    planner_client, served_model, pool, profile, field, message
):
    response = planner_client.post(
        DEPLOYMENTS, deployment_body(engine_profile=profile), format="json"
    )
    assert response.status_code == 400, response.json()
    assert message in error_fields(response)[field][0]
    assert not Deployment.objects.exists()
