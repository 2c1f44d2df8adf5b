"""The allocation page's prediction panel (rule 3c of capacity.allocation.policy): the forecast
and its band beside the demand, the SLO correction, which part set the target; and a model the
tick or the fit has not written a prediction for yet."""

import uuid
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from capacity.allocation.forecast import HORIZON_STEPS, STEP_SECONDS, Forecast
from capacity.models import AllocationDecision, CapacitySample, ModelPrediction
from tests.support.factories import DeploymentFactory, ServedModelFactory

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]

PAGE = "/planner/allocation/"
PREDICTED = (
    "target set by the burst headroom; burst headroom +40 MU/min over the level; forecast 100 "
    "MU/min now, +5 within one cold start; 99.50% of 1234 requests within the TTFT SLO"
)


def predict_dict(**overrides):
    """A flat 100 MU/min forecast ±12, for a day from an hour ago, as stored."""
    forecast = Forecast(
        start_s=(timezone.now() - timedelta(hours=1)).timestamp(),
        step_seconds=STEP_SECONDS,
        mu_per_minute=(100.0,) * HORIZON_STEPS,
        band_mu_per_minute=12.0,
        method="holt-winters daily",
        history_minutes=3 * 24 * 60,
    )
    return forecast.as_dict() | overrides


def predict(served_model, **overrides):
    """A fitted, applied prediction: predict_dict's forecast, fitted an hour ago."""
    values = {
        "forecast": predict_dict(),
        "fitted_at": timezone.now() - timedelta(hours=1),
        "fit_note": "fitted on 3 days of demand",
        "slo_correction": 1.1,
        "slo_code": "slo_met_with_margin",
        "delivered_slo_attainment": 0.995,
        "delivered_requests": 1234,
        "burst_headroom_mu_per_minute": 40.0,
        "forecast_now_mu_per_minute": 100.0,
        "forecast_lift_mu_per_minute": 5.0,
        "set_by": "burst_headroom",
        "predictive": True,
        "decided_at": timezone.now(),
    }
    return ModelPrediction.objects.create(served_model=served_model, **(values | overrides))


def sample(served_model, *, minutes_ago, used, hot):
    minute = (timezone.now() - timedelta(minutes=minutes_ago)).replace(second=0, microsecond=0)
    CapacitySample.objects.create(
        served_model=served_model,
        minute=minute,
        deployable_mu_per_minute=500.0,
        hot_mu_per_minute=hot,
        sellable_mu_per_minute=400.0,
        sold_mu_per_minute=100.0,
        used_mu_per_minute=used,
    )


def test_the_page_shows_the_forecast_band_the_correction_and_what_set_the_target(
    planner_client, deployment
):
    served_model = deployment.served_model
    predict(served_model)
    sample(served_model, minutes_ago=90, used=80.0, hot=150.0)
    AllocationDecision.objects.create(
        tick_id=uuid.uuid4(),
        deployment=deployment,
        served_model=served_model,
        inputs_digest="0" * 64,
        current_replicas=1,
        recommended_replicas=2,
        target_replicas=2,
        reasons=[{"code": "predicted", "message": PREDICTED, "data": {"set_by": "burst_headroom"}}],
        actuator_kind="dry_run",
    )

    response = planner_client.get(PAGE)
    text = response.content.decode()
    row = text[text.index('data-testid="prediction-row-llama-8b"') :].split("</tr>")[0]
    assert ">on</span>" in row
    assert "the burst headroom" in row
    assert "×1.10" in row and "99.50 % of 1234 requests" in row and "met with margin" in row
    assert "40.0" in row and "100.0" in row and "+5.0" in row
    assert "holt-winters daily over 3.0 days" in text and "±12.0 MU/min" in text
    assert "fitted on 3 days of demand" in text
    # The decision's own reason, human text, in the decisions' "Why".
    assert PREDICTED in text

    (panel,) = response.context["predictions"]
    datasets = {d["label"]: d["data"] for d in panel.chart["data"]["datasets"]}
    forecast = [v for v in datasets["Forecast"] if v is not None]
    # From the fit an hour ago to a day past it, a point a quarter hour: within the window of
    # the last 6 hours and the next 24, all 96 of them (a partial quarter at either end aside).
    assert 95 <= len(forecast) <= 97 and set(forecast) == {100.0}
    assert {v for v in datasets["80 % band: high"] if v is not None} == {112.0}
    assert {v for v in datasets["80 % band: low"] if v is not None} == {88.0}
    assert [v for v in datasets["Used"] if v is not None] == [80.0]
    assert [v for v in datasets["Hot (replicas ready)"] if v is not None] == [150.0]
    assert f'data-chart="{panel.chart_id}"' in text and f'id="{panel.chart_id}"' in text

    detail = planner_client.get(f"/planner/allocation/deployments/{deployment.name}/")
    assert "target set by the burst headroom" in detail.content.decode()


def test_without_a_prediction_the_page_says_no_forecast_yet(planner_client, deployment):
    served_model = deployment.served_model
    response = planner_client.get(PAGE)
    text = response.content.decode()
    assert "no forecast yet" in text and "No forecast yet" in text
    (panel,) = response.context["predictions"]
    assert (panel.state, panel.chart) == ("warming_up", None)
    detail = planner_client.get(f"/planner/allocation/deployments/{deployment.name}/")
    assert "no forecast yet" in detail.content.decode()

    # Switched off by a planner; a row whose fit found too little history; then one whose
    # stored forecast this version cannot read: the page stays up and says why.
    served_model.prediction_enabled = False
    served_model.save()
    prediction = predict(
        served_model,
        forecast={},
        fit_note="1.2 of the 2 days of history a forecast needs",
        predictive=False,
        set_by="",
    )
    sample(served_model, minutes_ago=5, used=10.0, hot=50.0)
    response = planner_client.get(PAGE)
    (panel,) = response.context["predictions"]
    assert panel.state == "off" and panel.forecast is None
    assert "1.2 of the 2 days of history a forecast needs" in response.content.decode()
    datasets = {d["label"]: d["data"] for d in panel.chart["data"]["datasets"]}
    assert all(v is None for v in datasets["Forecast"])

    for unreadable in ({"mu_per_minute": "not a curve"}, predict_dict(step_seconds=0)):
        prediction.forecast = unreadable
        prediction.save()
        response = planner_client.get(PAGE)
        assert "the stored forecast could not be read" in response.content.decode()


def test_the_prediction_panel_does_not_grow_queries_with_models(planner_client, pool):
    def grow(n):
        for _ in range(n):
            served_model = ServedModelFactory()
            DeploymentFactory(served_model=served_model, gpu_pool=pool)
            predict(served_model)
            sample(served_model, minutes_ago=3, used=1.0, hot=2.0)

    def count():
        with CaptureQueriesContext(connection) as captured:
            response = planner_client.get(PAGE)
        assert response.status_code == 200
        return len(captured), len(response.context["predictions"])

    grow(1)
    few, _ = count()
    grow(5)
    many, panels = count()
    assert (many, panels) == (few, 6)
