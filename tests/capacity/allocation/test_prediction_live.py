"""Rule 3c live (issue 36): the hourly fit reads a recorded demand history from the rollups, and
a real tick, through the same `decide()` as the simulator, pre-scales a morning step a cold start
ahead, trusts its replicas with more for an SLO met with margin, stores what it did for the next
tick and the planner, and says which part set the target; the planners' switch turns it off."""

from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from capacity.allocation.prediction import demand_forecast_fit
from capacity.allocation.tick import allocation_tick
from capacity.models import (
    AllocationDecision,
    Deployment,
    ModelPrediction,
    ServedModel,
    UsageEvent,
    UsageMinute,
)

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]

NIGHT_MU, DAY_MU = 100.0, 500.0


def yesterday_at(hour: int, minute: int, second: int = 0) -> datetime:
    today = timezone.now().astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return today - timedelta(days=1) + timedelta(hours=hour, minutes=minute, seconds=second)


def recorded_days(customer, model, until: datetime, days: int = 3) -> None:
    """`days` days of minutes before `until`: 100 MU/min at night, 500 from 08:00 to 20:00."""
    first = until.replace(second=0) - timedelta(days=days)
    rows = []
    for m in range(days * 24 * 60):
        minute = first + timedelta(minutes=m)
        if minute >= until:
            break
        day = 8 <= minute.hour < 20
        rows.append(
            UsageMinute(
                customer=customer,
                served_model=model,
                minute=minute,
                requests=50,
                mu=DAY_MU if day else NIGHT_MU,
            )
        )
    UsageMinute.objects.bulk_create(rows, batch_size=2000)


def fast_requests(customer, model, cost_model, now: datetime, count: int = 400) -> None:
    """The last half hour's requests, every one within the TTFT SLO (120 ms)."""
    start = now - timedelta(minutes=25)
    UsageEvent.objects.bulk_create(
        UsageEvent(
            event_id=f"fast-{i}",
            customer=customer,
            served_model=model,
            started_at=start + timedelta(seconds=3 * i),
            finished_at=start + timedelta(seconds=3 * i + 1),
            minute=(start + timedelta(seconds=3 * i + 1)).replace(second=0, microsecond=0),
            input_tokens=100,
            output_tokens=10,
            outcome="completed",
            admission_class="best_effort",
            mu=0.1,
            ttft_ms=120.0,
            cost_model=cost_model,
            ingested_at=now,
        )
        for i in range(count)
    )


@pytest.fixture
def history(sellable, served_model, globex):
    """llama-8b on one dry-run deployment (100 MU/min a replica at full use, a two-minute cold
    start), and globex's three days of demand until 07:58:30 yesterday."""
    Deployment.objects.filter(name="llama-8b-h100").update(
        current_replicas=1, target_utilisation=1.0, cold_start_seconds=120
    )
    now = yesterday_at(7, 58, 30)
    recorded_days(globex, served_model, now)
    fast_requests(globex, served_model, sellable, now)
    return now


def test_a_real_tick_prescales_the_morning_step_from_the_fitted_forecast_and_says_why(
    history, served_model
):
    now = history
    assert demand_forecast_fit(now=now) == {"fitted": 1, "too_little_history": 0}
    fitted = ModelPrediction.objects.get(served_model=served_model)
    assert fitted.forecast["method"] == "holt-winters daily"
    assert fitted.fit_note.startswith("holt-winters daily on 72 h of demand")

    allocation_tick(now=now)

    decision = AllocationDecision.objects.get(served_model=served_model)
    reasons = {r["code"]: r for r in decision.reasons}
    predicted = reasons["predicted"]
    # Night demand, 100 MU/min: reactive, one replica. The forecast's step to 500 within the
    # cold start, at each replica counted ×1.16 (every request of the last half hour within
    # the SLO: no error budget burnt, 0.4 below the dead band at a gain of 0.4): 100 + 400
    # MU/min over 116 MU/min a replica.
    assert predicted["data"]["set_by"] == "forecast"
    assert predicted["data"]["forecast_lift_mu_per_minute"] == pytest.approx(400, rel=0.05)
    assert predicted["data"]["slo_code"] == "slo_met_with_margin"
    assert predicted["data"]["slo_correction"] == pytest.approx(1.16)
    assert decision.target_replicas == 5
    assert "target set by the forecast's rise within one cold start" in predicted["message"]
    assert "100.00% of 400 requests within the TTFT SLO" in predicted["message"]
    stored = ModelPrediction.objects.get(served_model=served_model)
    assert (stored.set_by, stored.predictive, stored.delivered_requests) == ("forecast", True, 400)
    assert stored.slo_correction == pytest.approx(1.16)
    assert stored.decided_at == now


def test_switched_off_the_model_is_sized_reactively_and_the_reasons_say_so(history, served_model):
    now = history
    demand_forecast_fit(now=now)
    ServedModel.objects.filter(pk=served_model.pk).update(prediction_enabled=False)

    allocation_tick(now=now)

    decision = AllocationDecision.objects.get(served_model=served_model)
    codes = {r["code"] for r in decision.reasons}
    assert "prediction_off" in codes and "predicted" not in codes
    assert decision.target_replicas == 1  # the night's 100 MU/min
    assert ModelPrediction.objects.get(served_model=served_model).predictive is False


def test_with_too_little_history_there_is_no_forecast_and_the_fit_says_why(
    sellable, served_model, globex
):
    now = yesterday_at(7, 58, 30)
    recorded_days(globex, served_model, now, days=1)
    assert demand_forecast_fit(now=now) == {"fitted": 0, "too_little_history": 1}
    row = ModelPrediction.objects.get(served_model=served_model)
    assert row.forecast == {}
    assert row.fit_note == "24 h of demand recorded, of the 48 h a forecast needs: no forecast yet"
