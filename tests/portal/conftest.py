"""Two customers with something of everything the portal shows: acme (owner `owner`, member
`member`, from tests/conftest.py) and globex (owner `outsider`), each with a reservation, a
day of usage minutes, usage events, a key, an invoice and an admission allowance. Every page
of acme's must show acme's and nothing of globex's."""

import uuid
from dataclasses import dataclass
from datetime import date, timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from accounts.models import ApiKey, Customer
from accounts.services import api_key_create
from billing.models import Invoice, InvoiceLine
from capacity.models import AdmissionAllowance, Reservation, UsageEvent, UsageMinute
from capacity.selling.entitlements import entitlements_set
from capacity.selling.reservations import reservation_create
from tests.support.browser import chromium, collected_static, page, site

__all__ = ["chromium", "collected_static", "page", "site"]


@dataclass
class Side:
    customer: Customer
    reservation: Reservation
    invoice: Invoice
    key: ApiKey
    event_ids: list[str]


def _side(customer, served_model, cost_model, *, mu_per_minute, used_mu, events, now):
    reservation = reservation_create(
        customer=customer,
        served_model=served_model,
        mu_per_minute=mu_per_minute,
        starts_at=now - timedelta(hours=30),
    )
    minute = now.replace(second=0, microsecond=0)
    UsageMinute.objects.bulk_create(
        UsageMinute(
            customer=customer,
            served_model=served_model,
            minute=minute - timedelta(minutes=10 * step),
            requests=10,
            mu=used_mu,
            guaranteed_mu=used_mu,
        )
        for step in range(1, 24 * 6)
    )
    event_ids = [f"{customer.slug}-{uuid.uuid4().hex[:12]}" for _ in range(events)]
    UsageEvent.objects.bulk_create(
        UsageEvent(
            event_id=event_id,
            customer=customer,
            served_model=served_model,
            # One a minute, the first the newest.
            started_at=now - timedelta(minutes=index, seconds=2),
            finished_at=now - timedelta(minutes=index),
            minute=(now - timedelta(minutes=index)).replace(second=0, microsecond=0),
            input_tokens=100 + index,
            output_tokens=20,
            outcome="completed",
            admission_class="guaranteed",
            ttft_ms=120.0,
            mu=0.5,
            guaranteed_mu=0.5,
            cost_model=cost_model,
            ingested_at=now,
        )
        for index, event_id in enumerate(event_ids)
    )
    invoice = Invoice.objects.create(
        customer=customer,
        period_start=date(2026, 10, 1),
        currency="USD",
        subtotal=Decimal(mu_per_minute) * 2,
        total=Decimal(mu_per_minute) * 2,
        generated_at=now,
    )
    InvoiceLine.objects.create(
        invoice=invoice,
        kind=InvoiceLine.Kind.COMMITMENT,
        served_model=served_model,
        reservation=reservation,
        description=f"{mu_per_minute} MU/min of {served_model.name} for {customer.slug}",
        quantity=Decimal("744"),
        unit="MU/min·hour",
        unit_price=Decimal("0.645161"),
        amount=Decimal(mu_per_minute) * 2,
    )
    AdmissionAllowance.objects.create(
        customer=customer,
        served_model=served_model,
        guaranteed_mu_per_minute=mu_per_minute,
        best_effort_mu_per_minute=mu_per_minute / 10,
        tick_id=uuid.uuid4(),
        updated_at=now,
    )
    entitlements_set(customer=customer, served_models=[served_model])
    key = api_key_create(name=f"{customer.slug} gateway", customer=customer).api_key
    return Side(customer, reservation, invoice, key, event_ids)


@pytest.fixture
def world(sellable, served_model, acme, globex, owner, member, outsider):
    """{"acme": Side, "globex": Side}: acme reserves 240 MU/min and uses 120, globex reserves
    300 and uses 250 (numbers no page of acme's may show)."""
    now = timezone.now()
    return {
        "acme": _side(
            acme, served_model, sellable, mu_per_minute=240, used_mu=1200, events=60, now=now
        ),
        "globex": _side(
            globex, served_model, sellable, mu_per_minute=300, used_mu=2500, events=3, now=now
        ),
    }
