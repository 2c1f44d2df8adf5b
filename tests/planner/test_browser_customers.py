"""A planner, in a real browser: creates a customer and a key (seen exactly once), tries a
reservation the fleet cannot serve and reads why, and walks every section with data."""

import uuid
from datetime import date, timedelta
from decimal import Decimal

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from accounts.models import ApiKey, Customer
from billing.models import Invoice, InvoiceLine
from capacity.metering.history import record_capacity
from capacity.models import AllocationDecision, Reservation, UsageMinute
from capacity.selling.reservations import reservation_create
from tests.support.browser import chart_points, log_in, screenshot

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_customer_key_once_and_a_refused_reservation(site, page, planner_user, sellable):
    log_in(page, site, "pat")
    page.get_by_role("link", name="Customers").click()
    expect(page.get_by_text("No customers yet.")).to_be_visible()
    screenshot(page, "customers-empty")

    form = page.get_by_role("form", name="New customer")
    form.get_by_label("Name").fill("Initech")
    form.get_by_label("Slug").fill("initech")
    form.get_by_label("Tier").select_option("premium")
    form.get_by_role("button", name="Create customer").click()
    page.wait_for_url(site + "/planner/customers/initech/")
    expect(page.get_by_text("Customer initech created.")).to_be_visible()
    screenshot(page, "customer-new")

    keys = page.get_by_role("form", name="New API key")
    keys.get_by_label("Name").fill("gateway")
    keys.get_by_label("admission").check()
    keys.get_by_role("button", name="Create key").click()
    shown = page.get_by_test_id("new-key").locator("code").inner_text()
    prefix, _, secret = shown.partition(".")
    key = ApiKey.objects.get(customer__slug="initech")
    assert key.prefix == prefix and len(secret) >= 32
    assert set(key.scopes) == {"read", "write", "admission"}
    screenshot(page, "key-shown-once")
    # Exactly once: the page opened again shows the prefix, never the secret.
    page.goto(site + "/planner/customers/initech/")
    assert page.get_by_test_id("new-key").count() == 0
    assert secret not in page.content() and prefix in page.content()
    screenshot(page, "key-listed")

    reserve = page.get_by_role("form", name="New reservation")
    reserve.get_by_label("MU per minute").fill("1000")
    reserve.get_by_role("button", name="Reserve").click()
    problem = page.get_by_test_id("reservation-problem")
    assert "The reservation was refused." in problem.inner_text()
    assert "Shortfall: 280.00 MU/min" in problem.inner_text()
    assert "Sellable: 720.00 MU/min" in problem.inner_text()
    assert not Reservation.objects.exists()
    screenshot(page, "reservation-refused")

    reserve = page.get_by_role("form", name="New reservation")
    reserve.get_by_label("MU per minute").fill("300")
    reserve.get_by_role("button", name="Reserve").click()
    expect(page.get_by_text("Reserved 300 MU/min of llama-8b.")).to_be_visible()
    assert Reservation.objects.get().mu_per_minute == 300
    screenshot(page, "reservation-made")


def _fleet_with_history(sellable):
    served_model = sellable.served_model
    deployment = served_model.deployments.get()
    deployment.current_replicas = 4
    deployment.save()
    acme = Customer.objects.create(name="Acme", slug="acme")
    reservation_create(
        customer=acme,
        served_model=served_model,
        mu_per_minute=240,
        starts_at=timezone.now() - timedelta(hours=30),
    )
    now = timezone.now().replace(second=0, microsecond=0)
    for minutes_ago in range(0, 24 * 60, 10):
        moment = now - timedelta(minutes=minutes_ago)
        used = 120 + 80 * ((minutes_ago // 60) % 6)
        UsageMinute.objects.create(
            customer=acme, served_model=served_model, minute=moment, requests=50, mu=used
        )
        record_capacity(now=moment)
        decision = AllocationDecision.objects.create(
            tick_id=uuid.uuid4(),
            deployment=deployment,
            served_model=served_model,
            inputs_digest="0" * 64,
            current_replicas=3,
            recommended_replicas=3 + (minutes_ago // 120) % 3,
            target_replicas=3 + (minutes_ago // 120) % 3,
            reasons=[{"code": "demand", "message": "demand needs more replicas", "data": {}}],
            actuator_kind="dry_run",
            actuator_ok=True,
        )
        AllocationDecision.objects.filter(pk=decision.pk).update(created_at=moment)
    invoice = Invoice.objects.create(
        customer=acme,
        period_start=date(2026, 10, 1),
        currency="USD",
        subtotal=Decimal("480.00"),
        total=Decimal("480.00"),
        generated_at=timezone.now(),
    )
    InvoiceLine.objects.create(
        invoice=invoice,
        kind=InvoiceLine.Kind.COMMITMENT,
        description="240 MU/min of llama-8b",
        quantity=Decimal("744"),
        unit="MU/min·hour",
        unit_price=Decimal("0.645161"),
        amount=Decimal("480.00"),
    )
    return deployment, invoice


def test_every_section_with_data(site, page, planner_user, sellable):
    deployment, invoice = _fleet_with_history(sellable)
    log_in(page, site, "pat")

    page.goto(site + "/planner/")
    assert all(points > 0 for points in chart_points(page))
    screenshot(page, "fleet")

    page.goto(site + "/planner/customers/")
    screenshot(page, "customers")
    page.get_by_role("link", name="Acme").click()
    assert all(points > 0 for points in chart_points(page))
    screenshot(page, "customer")

    page.goto(site + "/planner/allocation/")
    expect(page.get_by_text("demand needs more replicas").first).to_be_visible()
    screenshot(page, "allocation")
    page.get_by_role("link", name=deployment.name).first.click()
    assert chart_points(page)[0] > 0
    screenshot(page, "allocation-deployment")

    page.goto(site + "/planner/invoices/")
    screenshot(page, "invoices")
    page.get_by_role("link", name="Acme").click()
    page.get_by_role("button", name="Issue invoice").click()
    expect(page.get_by_text("Invoice issued")).to_be_visible()
    invoice.refresh_from_db()
    assert invoice.status == Invoice.Status.ISSUED
    screenshot(page, "invoice")
