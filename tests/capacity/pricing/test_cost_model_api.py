from pathlib import Path

import pytest

from benchmarking.services import benchmark_import, cost_model_fit
from capacity.models import CostModel

pytestmark = pytest.mark.django_db

TABLE = (
    Path(__file__).resolve().parents[3]
    / "benchmarking"
    / "data"
    / "trtllm_llama31-8b_fp8_h100_tp1.csv"
)


@pytest.fixture
def fitted():
    run, _ = benchmark_import(csv_text=TABLE.read_text(), model_name="llama-8b", gpu_name="H100")
    return cost_model_fit(run=run)


def test_customers_estimate_mu_per_shape(acme_key_client, fitted):
    response = acme_key_client.post(
        "/api/v1/cost-models/estimate",
        {
            "model": "llama-8b",
            "shapes": [
                {"input_tokens": 1000, "output_tokens": 1000},
                {"input_tokens": 1000, "cached_input_tokens": 900, "output_tokens": 1000},
            ],
        },
        format="json",
    )
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["cost_model_version"] == 1
    assert body["cost_model_status"] == "active"
    first = body["shapes"][0]
    assert first["mu"] == pytest.approx(first["replica_seconds"] * 100 / 60)
    assert first["requests_per_s"] == pytest.approx(15.22, rel=0.1)
    assert body["total_mu"] == pytest.approx(sum(s["mu"] for s in body["shapes"]))


def test_an_estimate_names_the_bad_field(acme_key_client, fitted):
    response = acme_key_client.post(
        "/api/v1/cost-models/estimate",
        {"model": "llama-8b", "shapes": [{"input_tokens": 10, "cached_input_tokens": 20}]},
        format="json",
    )
    assert response.status_code == 400
    assert set(response.json()["error"]["fields"]) >= {"shapes.0.output_tokens"}

    response = acme_key_client.post(
        "/api/v1/cost-models/estimate",
        {
            "model": "llama-8b",
            "shapes": [{"input_tokens": 10, "cached_input_tokens": 20, "output_tokens": 5}],
        },
        format="json",
    )
    assert "shapes.0.cached_input_tokens" in response.json()["error"]["fields"]


def test_an_estimate_without_any_cost_model_is_a_clear_409(planner_client, served_model):
    response = planner_client.post(
        "/api/v1/cost-models/estimate",
        {"model": served_model.name, "shapes": [{"input_tokens": 1, "output_tokens": 1}]},
        format="json",
    )
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "no_cost_model"


def test_planners_retire_and_activate_versions(planner_client, fitted):
    second = cost_model_fit(run=fitted.source_run)
    fitted.refresh_from_db()
    assert (fitted.status, second.status) == ("retired", "active")

    response = planner_client.post(f"/api/v1/cost-models/{fitted.pk}/activate/")
    assert response.status_code == 200
    assert response.json()["status"] == "active"
    second.refresh_from_db()
    assert second.status == "retired"
    assert CostModel.objects.filter(status="active").count() == 1

    response = planner_client.post(f"/api/v1/cost-models/{second.pk}/retire/")
    assert response.status_code == 409


def test_customers_read_but_cannot_activate_cost_models(acme_key_client, fitted):
    assert acme_key_client.get("/api/v1/cost-models/").json()["count"] == 1
    response = acme_key_client.post(f"/api/v1/cost-models/{fitted.pk}/retire/")
    assert response.status_code == 403
    fitted.refresh_from_db()
    assert fitted.status == "active"


def test_customers_see_no_benchmark_runs(acme_key_client, planner_client, fitted):
    assert acme_key_client.get("/api/v1/benchmark-runs/").status_code == 403
    runs = planner_client.get("/api/v1/benchmark-runs/").json()
    assert runs["count"] == 1
    samples = planner_client.get(f"/api/v1/benchmark-runs/{runs['results'][0]['id']}/samples/")
    assert samples.json()["count"] == 10


@pytest.mark.parametrize("tokens", [10**200, 10**400], ids=["1e200", "1e400"])
def test_an_estimate_of_absurdly_many_input_tokens_is_a_400_naming_the_field(
    acme_key_client, sellable, tokens
):
    response = acme_key_client.post(
        "/api/v1/cost-models/estimate",
        {"model": "llama-8b", "shapes": [{"input_tokens": tokens, "output_tokens": 1}]},
        format="json",
    )
    assert response.status_code == 400, response.content[:300]
    assert "shapes.0.input_tokens" in response.json()["error"]["fields"]


def test_an_estimate_of_a_shape_beyond_the_models_context_is_a_400_naming_the_field(
    acme_key_client, sellable, served_model
):
    assert served_model.context_length_tokens == 8192

    def estimate(*shapes):
        return acme_key_client.post(
            "/api/v1/cost-models/estimate",
            {"model": "llama-8b", "shapes": [{"input_tokens": i, "output_tokens": o}
                                             for i, o in shapes]},
            format="json",
        )  # fmt: skip

    assert estimate((8000, 192)).status_code == 200
    response = estimate((8000, 192), (8000, 193), (9000, 0))
    assert response.status_code == 400
    fields = response.json()["error"]["fields"]
    assert set(fields) == {"shapes.1.output_tokens", "shapes.2.input_tokens"}
    assert "8192" in fields["shapes.1.output_tokens"][0]
