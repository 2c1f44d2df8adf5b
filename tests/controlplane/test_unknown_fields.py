"""Every write endpoint names a key it will not use: unknown or read-only, 400, nothing
written. DRF's default was to drop such keys and answer 2xx."""

from datetime import UTC, datetime
from decimal import Decimal

import pytest
from drf_spectacular.generators import SchemaGenerator

from billing.models import Budget
from billing.rates import rate_card_create
from capacity.models import Deployment, RequestLimit, Reservation
from tests.support.factories import GpuTypeFactory

pytestmark = pytest.mark.django_db


def _write_operations():
    schema = SchemaGenerator().get_schema(request=None, public=True)
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            if method in {"post", "put", "patch"} and "requestBody" in operation:
                yield path, method


@pytest.fixture
def rows(served_model, acme, sellable):
    return {
        "reservations": Reservation.objects.create(
            customer=acme, served_model=served_model, mu_per_minute=1,
            starts_at=datetime(2026, 1, 1, tzinfo=UTC), status="active",
        ).pk,
        "rate-cards": rate_card_create(
            served_model=served_model, effective_from=datetime(2026, 1, 1, tzinfo=UTC),
            reserved_price_per_mu_minute_hour=Decimal(1), best_effort_price_per_1000_mu=Decimal(1),
        ).pk,
        "cost-models": sellable.pk,  # activate and reject take a reason, and nothing else
        "request-limits": RequestLimit.objects.create(customer=acme, requests_per_minute=60).pk,
        "budgets": Budget.objects.create(customer=acme, monthly_amount=Decimal(100)).pk,
    }  # fmt: skip


def _concrete(path: str, rows, deployment, acme, served_model) -> str:
    resource = path.split("/")[3]
    names = {
        "deployments": deployment.name,
        "gpu-pools": deployment.gpu_pool.name,
        "gpu-types": deployment.gpu_pool.gpu_type.name,
        "models": served_model.name,
        "benchmark-suites": "nightly",
        "tiers": "premium",
    }
    return (
        path.replace("{name}", names.get(resource, ""))
        .replace("{slug}", acme.slug)
        .replace("{model_name}", served_model.name)
        .replace("{id}", str(rows.get(resource, "")))
    )


def test_every_write_endpoint_refuses_a_field_it_does_not_have(
    planner_client, rows, acme, served_model
):
    deployment = Deployment.objects.get()
    GpuTypeFactory(name="spare")  # so that a PUT of a GPU type has something to rename from
    suite = {"name": "nightly", "grid": [[8, 8]], "slo_ttft_p95_ms": 500, "slo_tpot_p95_ms": 50}
    created = planner_client.post("/api/v1/benchmark-suites/", suite, format="json")
    assert created.status_code == 201, created.content
    checked = []
    for path, method in _write_operations():
        url = _concrete(path, rows, deployment, acme, served_model)
        response = getattr(planner_client, method)(url, {"zz_not_a_field": 1}, format="json")
        assert response.status_code == 400, (method, url, response.content[:300])
        assert "zz_not_a_field" in response.json()["error"]["fields"], (method, url)
        checked.append((method, path))
    assert len(checked) >= 20, checked


def test_a_read_only_field_is_a_400_naming_it(planner_client, deployment):
    response = planner_client.patch(
        f"/api/v1/deployments/{deployment.name}/",
        {"max_replicas": 2, "id": 99, "created_at": "2026-01-01T00:00:00Z"},
        format="json",
    )
    assert response.status_code == 400
    fields = response.json()["error"]["fields"]
    assert fields["id"] == fields["created_at"] == ["is read-only: it cannot be set here."]
    assert Deployment.objects.get(pk=deployment.pk).max_replicas == 4


def test_an_unknown_field_lists_the_fields_that_may_be_set(planner_client):
    response = planner_client.post(
        "/api/v1/gpu-types/",
        {"name": "B200", "memory_gb": 192, "hourly_cost_usd": "6", "memory": 192},
        format="json",
    )
    assert response.status_code == 400
    assert response.json()["error"]["fields"] == {
        "memory": ["is not a field here; the fields you may set: name, memory_gb, hourly_cost_usd."]
    }


def test_unknown_fields_inside_each_shape_are_named_by_index(acme_key_client, sellable):
    response = acme_key_client.post(
        "/api/v1/cost-models/estimate",
        {"model": "llama-8b", "shapes": [{"input_tokens": 1, "output_tokens": 1},
                                         {"input_tokens": 1, "output_tokens": 1, "image": 2}]},
        format="json",
    )  # fmt: skip
    assert response.status_code == 400
    assert list(response.json()["error"]["fields"]) == ["shapes.1.image"]


def test_a_related_name_with_a_control_character_is_a_400_not_a_500(planner_client, gpu_type):
    response = planner_client.post(
        "/api/v1/gpu-pools/", {"name": "p", "gpu_type": "H100\x00", "gpu_count": 1}, format="json"
    )
    assert response.status_code == 400
    assert "gpu_type" in response.json()["error"]["fields"]
