"""Fleet, allocation and invoice pages: empty states, the numbers, the charts, no N+1."""

import uuid
from datetime import date, timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from billing.models import Invoice, InvoiceLine
from capacity.metering.history import record_capacity
from capacity.models import ActuatorCircuit, AllocationDecision, CapacitySample
from capacity.selling.reservations import reservation_create
from tests.support.factories import CustomerFactory, DeploymentFactory

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]


def queries(client, path):
    with CaptureQueriesContext(connection) as captured:
        response = client.get(path)
    assert response.status_code == 200, response.content[:300]
    return len(captured), response


# --- Fleet ------------------------------------------------------------------------------------


def test_the_fleet_page_with_an_empty_database(planner_client):
    response = planner_client.get("/planner/")
    assert b"No fleet yet." in response.content and b"No GPU pools." in response.content


def test_the_fleet_page_shows_capacity_now_and_over_time(planner_client, acme, sellable):
    served_model = sellable.served_model
    deployment = served_model.deployments.get()
    deployment.current_replicas = 3
    deployment.save()
    reservation_create(customer=acme, served_model=served_model, mu_per_minute=200)
    now = timezone.now()
    assert record_capacity(now=now - timedelta(hours=3)) == 1
    assert record_capacity(now=now) == 1
    # A second tick in the same minute writes nothing more.
    assert record_capacity(now=now) == 0
    response = planner_client.get("/planner/")
    (row,) = response.context["models"]
    assert row["capacity"].deployable_mu_per_minute == pytest.approx(800)
    assert row["capacity"].hot_mu_per_minute == pytest.approx(300)
    assert row["sold"] == 200
    assert row["overcommit_ratio"] == pytest.approx(0.25)
    datasets = {d["label"]: d["data"] for d in row["chart"]["data"]["datasets"]}
    # Three hours ago the reservation (which starts now) was not sold yet.
    assert [v for v in datasets["Sold"] if v is not None] == [0, 200]
    assert [v for v in datasets["Hot"] if v is not None] == [300, 300]
    assert [v for v in datasets["Deployable"] if v is not None] == [800, 800]
    (pool,) = response.context["pools"]
    assert (pool["used_gpus"], pool["free_gpus"]) == (3, 5)
    # 3 GPUs running at the H100's hourly price.
    assert pool["running_cost_usd_per_hour"] == 3 * served_model.reference_gpu_type.hourly_cost_usd
    week = planner_client.get("/planner/?range=7d")
    assert len(week.context["models"][0]["chart"]["data"]["labels"]) == 168


def test_capacity_history_is_pruned_after_its_retention(settings, sellable):
    settings.CAPACITY_HISTORY_DAYS = 2
    now = timezone.now()
    record_capacity(now=now - timedelta(days=3))
    record_capacity(now=now)
    assert CapacitySample.objects.count() == 1


# --- Allocation -------------------------------------------------------------------------------


def decide(deployment, *, minutes_ago=0, target=2, ok=True, error=""):
    decision = AllocationDecision.objects.create(
        tick_id=uuid.uuid4(),
        deployment=deployment,
        served_model=deployment.served_model,
        inputs_digest="0" * 64,
        current_replicas=1,
        recommended_replicas=target,
        target_replicas=target,
        reasons=[{"code": "demand", "message": f"demand needs {target} replicas", "data": {}}],
        actuator_kind="dry_run",
        actuator_ok=ok,
        actuator_error=error,
    )
    AllocationDecision.objects.filter(pk=decision.pk).update(
        created_at=timezone.now() - timedelta(minutes=minutes_ago)
    )
    return decision


def test_the_allocation_page_with_nothing(planner_client):
    assert b"No deployments." in planner_client.get("/planner/allocation/").content


def test_the_allocation_page_with_decisions_failures_and_circuits(planner_client, deployment):
    response = planner_client.get("/planner/allocation/")
    assert b"No decisions yet." in response.content
    # Far enough apart never to share a 10-minute bucket of the chart.
    decide(deployment, minutes_ago=40, target=3)
    decide(deployment, minutes_ago=1, target=4, ok=False, error="HTTP 503 from the autoscaler")
    ActuatorCircuit.objects.create(
        deployment=deployment,
        consecutive_failures=5,
        opened_until=timezone.now() + timedelta(minutes=5),
        last_error="HTTP 503 from the autoscaler",
    )
    response = planner_client.get("/planner/allocation/")
    text = response.content.decode()
    (latest,) = response.context["latest"]
    assert latest.target_replicas == 4
    assert "demand needs 4 replicas" in text
    assert "HTTP 503 from the autoscaler" in text
    assert [c.deployment for c in response.context["open_circuits"]] == [deployment]

    detail = planner_client.get(f"/planner/allocation/deployments/{deployment.name}/")
    datasets = {d["label"]: d["data"] for d in detail.context["chart"]["data"]["datasets"]}
    assert sorted(v for v in datasets["Target replicas (max)"] if v is not None) == [3, 4]
    assert b"circuit" in detail.content.lower()


def test_allocation_pages_do_not_grow_queries_with_deployments(planner_client, served_model, pool):
    def grow(n):
        for _ in range(n):
            deployment = DeploymentFactory(served_model=served_model, gpu_pool=pool)
            decide(deployment, ok=False, error="boom")
            ActuatorCircuit.objects.create(deployment=deployment, consecutive_failures=1)

    grow(2)
    few, _ = queries(planner_client, "/planner/allocation/")
    grow(12)
    many, response = queries(planner_client, "/planner/allocation/")
    assert many == few
    assert len(response.context["latest"]) == 14


# --- Invoices ---------------------------------------------------------------------------------


def invoice_for(customer, *, period=date(2026, 10, 1), status=Invoice.Status.DRAFT):
    invoice = Invoice.objects.create(
        customer=customer,
        period_start=period,
        status=status,
        currency="USD",
        subtotal=Decimal("120.00"),
        credits=Decimal("-20.00"),
        total=Decimal("100.00"),
        generated_at=timezone.now(),
    )
    InvoiceLine.objects.create(
        invoice=invoice,
        kind=InvoiceLine.Kind.COMMITMENT,
        description="60 MU/min of llama-8b",
        quantity=Decimal("43200"),
        unit="MU/min·hour",
        unit_price=Decimal("0.002778"),
        amount=Decimal("120.00"),
    )
    return invoice


def test_invoices_empty_list_detail_and_issue(planner_client, acme):
    assert b"No invoices yet." in planner_client.get("/planner/invoices/").content
    invoice = invoice_for(acme)
    response = planner_client.get("/planner/invoices/")
    assert b"Acme" in response.content and b"100.00" in response.content
    detail = planner_client.get(f"/planner/invoices/{invoice.pk}/")
    assert b"60 MU/min of llama-8b" in detail.content
    assert f"/api/v1/invoices/{invoice.pk}/csv/".encode() in detail.content
    response = planner_client.post(f"/planner/invoices/{invoice.pk}/issue", follow=True)
    assert b"Invoice issued" in response.content
    invoice.refresh_from_db()
    assert invoice.status == Invoice.Status.ISSUED
    response = planner_client.post(f"/planner/invoices/{invoice.pk}/issue", follow=True)
    assert b"Only a draft can be issued" in response.content
    # The customer page lists it too.
    assert (
        f"/planner/invoices/{invoice.pk}/".encode()
        in planner_client.get("/planner/customers/acme/").content
    )


def test_invoice_filters_and_query_counts(planner_client):
    customers = [CustomerFactory() for _ in range(30)]
    for customer in customers[:3]:
        invoice_for(customer)
    few, _ = queries(planner_client, "/planner/invoices/")
    for customer in customers[3:]:
        invoice_for(customer, period=date(2026, 9, 1), status=Invoice.Status.ISSUED)
    many, response = queries(planner_client, "/planner/invoices/")
    assert many == few
    _, response = queries(planner_client, "/planner/invoices/?period=2026-10&status=draft")
    assert len(response.context["page"].object_list) == 3
    _, response = queries(planner_client, "/planner/invoices/?status=void")
    assert b"No invoice matches these filters." in response.content


def test_an_invoice_shows_the_keep_warm_premium_as_its_own_line(planner_client, acme, sellable):
    from billing.generation import invoice_generate
    from billing.rates import rate_card_create

    served_model = sellable.served_model
    start = timezone.now().replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    last_month = (start - timedelta(days=1)).replace(day=1)
    rate_card_create(
        served_model=served_model,
        effective_from=last_month,
        reserved_price_per_mu_minute_hour=Decimal("0.10"),
        best_effort_price_per_1000_mu=Decimal("2.00"),
        keep_warm_price_per_mu_minute_hour=Decimal("0.02"),
    )
    reservation_create(
        customer=acme, served_model=served_model, mu_per_minute=100, keep_warm=True,
        starts_at=last_month,
    )  # fmt: skip
    invoice_generate(period=f"{last_month:%Y-%m}")
    invoice = Invoice.objects.get(customer=acme)
    detail = planner_client.get(f"/planner/invoices/{invoice.pk}/").content.decode()
    assert "Keep-warm premium" in detail and "0.020000" in detail


@pytest.mark.parametrize("period", ["99999999999-1", "0000-01", "9999-99"])
def test_an_invoice_period_filter_out_of_range_matches_nothing_instead_of_a_500(
    planner_client, period
):
    invoice_for(CustomerFactory())
    response = planner_client.get("/planner/invoices/", {"period": period})
    assert response.status_code == 200
