"""Two invoice runs at once: the drafts that remain are built from the newest data."""

import threading
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.db import connection

from billing import generation
from billing.models import Invoice
from billing.rates import rate_card_create
from capacity.models import Reservation

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql_only]


def at(day):
    return datetime(2026, 11, day, tzinfo=UTC)


def reserve(customer, model, mu_per_minute):
    Reservation.objects.create(
        customer=customer,
        served_model=model,
        mu_per_minute=mu_per_minute,
        starts_at=at(16),
        status="active",
    )


def test_an_older_run_never_overwrites_a_newer_runs_drafts(served_model, acme, monkeypatch):
    rate_card_create(
        served_model=served_model,
        effective_from=datetime(2026, 10, 1, tzinfo=UTC),
        reserved_price_per_mu_minute_hour=Decimal("0.10"),
        best_effort_price_per_1000_mu=Decimal("2.00"),
    )
    reserve(acme, served_model, 100)  # 100 MU/min × 360 h × $0.10 = $3,600.00

    older_built, older_may_store = threading.Event(), threading.Event()
    real_build = generation.build_lines

    def build_then_pause_the_older_run(*args, **kwargs):
        built = real_build(*args, **kwargs)
        if threading.current_thread().name == "older":
            older_built.set()
            older_may_store.wait(timeout=30)
        return built

    monkeypatch.setattr(generation, "build_lines", build_then_pause_the_older_run)
    errors = []

    def run():
        try:
            generation.invoice_generate(period="2026-11")
        except Exception as error:  # reported by the test below
            errors.append(error)
        finally:
            connection.close()  # each thread has its own connection

    older = threading.Thread(target=run, name="older")
    older.start()
    assert older_built.wait(timeout=30)

    # While the older run holds what it read, a reservation is sold and a newer run starts.
    reserve(acme, served_model, 50)  # now $5,400.00
    newer = threading.Thread(target=run, name="newer")
    newer.start()
    newer.join(timeout=2)  # it waits for the older run's lock, whatever it would do otherwise
    older_may_store.set()
    older.join(timeout=30)
    newer.join(timeout=30)

    assert not older.is_alive() and not newer.is_alive()
    assert errors == []
    (draft,) = Invoice.objects.filter(customer=acme, period_start="2026-11-01")
    assert draft.total == Decimal("5400.00")
    assert sorted(line.amount for line in draft.lines.all()) == [
        Decimal("1800.00"),
        Decimal("3600.00"),
    ]
