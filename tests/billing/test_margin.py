"""Revenue per model beside its GPU cost, from invoices and allocation decisions."""

import uuid
from datetime import UTC, datetime
from decimal import Decimal

import pytest

from billing.generation import invoice_generate
from billing.margin import _replica_seconds, replica_seconds_in_python
from billing.rates import rate_card_create
from capacity.models import AllocationDecision, Deployment, Reservation

pytestmark = pytest.mark.django_db


def decide(deployment, at, replicas, dry_run=False):
    decision = AllocationDecision.objects.create(
        tick_id=uuid.uuid4(),
        deployment=deployment,
        served_model=deployment.served_model,
        inputs_digest="0" * 64,
        current_replicas=replicas,
        recommended_replicas=replicas,
        target_replicas=replicas,
        actuator_kind="dry_run",
        dry_run=dry_run,
    )
    AllocationDecision.objects.filter(pk=decision.pk).update(created_at=at)


def test_margin_per_model_is_revenue_less_gpu_hours_at_their_cost(
    sellable, served_model, acme, planner_client, acme_key_client
):
    rate_card_create(
        served_model=served_model,
        effective_from=datetime(2026, 10, 1, tzinfo=UTC),
        reserved_price_per_mu_minute_hour=Decimal("0.10"),
        best_effort_price_per_1000_mu=Decimal("2.00"),
    )
    Reservation.objects.create(
        customer=acme,
        served_model=served_model,
        mu_per_minute=100,
        starts_at=datetime(2026, 11, 16, tzinfo=UTC),
        status="active",
    )
    invoice_generate(period="2026-11")  # $3,600.00
    deployment = Deployment.objects.get(name="llama-8b-h100")  # 1 GPU per replica, $2.50/h
    # 2 replicas since October (in force on 1 November), 4 from 16 November; a dry run and a
    # decision in December change nothing: 2 × 360 h + 4 × 360 h = 2,160 GPU-h = $5,400.00.
    decide(deployment, datetime(2026, 10, 31, 12, tzinfo=UTC), 2)
    decide(deployment, datetime(2026, 11, 16, tzinfo=UTC), 4)
    decide(deployment, datetime(2026, 11, 20, tzinfo=UTC), 9, dry_run=True)
    decide(deployment, datetime(2026, 12, 2, tzinfo=UTC), 1)

    body = planner_client.get("/api/v1/billing/margin?period=2026-11").json()
    assert body["models"] == [
        {
            "model": "llama-8b",
            "revenue": "3600.00",
            "gpu_hours": 2160.0,
            "gpu_cost": "5400.00",
            "margin": "-1800.00",
            "margin_share": -0.5,
        }
    ]
    start, end = datetime(2026, 11, 1, tzinfo=UTC), datetime(2026, 12, 1, tzinfo=UTC)
    assert replica_seconds_in_python(start, end) == pytest.approx(_replica_seconds(start, end))
    assert acme_key_client.get("/api/v1/billing/margin?period=2026-11").status_code == 403
