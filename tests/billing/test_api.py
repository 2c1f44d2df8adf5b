"""Invoices over the API: each customer sees its own, exports, the live estimate, issuing."""

import csv
import io
from datetime import UTC, datetime
from decimal import Decimal

import pytest
import time_machine

from billing.generation import invoice_generate
from billing.models import Invoice, RateCard
from billing.rates import rate_card_create
from capacity.models import Reservation

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]


@pytest.fixture
def invoices(served_model, acme, globex):
    rate_card_create(
        served_model=served_model,
        effective_from=datetime(2026, 10, 1, tzinfo=UTC),
        reserved_price_per_mu_minute_hour=Decimal("0.10"),
        best_effort_price_per_1000_mu=Decimal("2.00"),
    )
    for customer, mu in ((acme, 100), (globex, 50)):
        Reservation.objects.create(
            customer=customer,
            served_model=served_model,
            mu_per_minute=mu,
            starts_at=datetime(2026, 11, 16, tzinfo=UTC),
            status="active",
        )
    invoice_generate(period="2026-11")
    return {i.customer.slug: i for i in Invoice.objects.select_related("customer")}


def test_a_customer_sees_only_its_own_invoices(invoices, acme_key_client):
    listed = acme_key_client.get("/api/v1/invoices/").json()["results"]
    assert [(row["customer"], row["total"]) for row in listed] == [("acme", "3600.00")]
    assert acme_key_client.get(f"/api/v1/invoices/{invoices['globex'].pk}/").status_code == 404
    assert acme_key_client.get(f"/api/v1/invoices/{invoices['globex'].pk}/csv/").status_code == 404
    estimate = acme_key_client.get("/api/v1/customers/globex/billing/estimate?period=2026-11")
    assert estimate.status_code == 404


def test_the_detail_is_the_json_export_and_the_csv_holds_the_same_lines(invoices, acme_key_client):
    detail = acme_key_client.get(f"/api/v1/invoices/{invoices['acme'].pk}/").json()
    assert detail["period"] == "2026-11"
    assert [(line["kind"], line["amount"]) for line in detail["lines"]] == [
        ("commitment", "3600.00")
    ]
    response = acme_key_client.get(f"/api/v1/invoices/{invoices['acme'].pk}/csv/")
    assert response["Content-Type"] == "text/csv"
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [(row["kind"], row["model"], row["amount"]) for row in rows] == [
        ("commitment", "llama-8b", "3600.00")
    ]


def test_the_estimate_matches_the_invoice_without_storing_anything(invoices, acme_key_client):
    before = Invoice.objects.count()
    with time_machine.travel(datetime(2026, 12, 5, tzinfo=UTC), tick=False):  # November is over
        estimate = acme_key_client.get("/api/v1/customers/acme/billing/estimate?period=2026-11")
    assert estimate.status_code == 200
    assert estimate.json()["total"] == "3600.00"
    assert Invoice.objects.count() == before
    bad = acme_key_client.get("/api/v1/customers/acme/billing/estimate?period=soon")
    assert bad.status_code == 400
    assert "period" in bad.json()["error"]["fields"]


def test_planners_issue_and_customers_cannot(invoices, acme_key_client, planner_client):
    url = f"/api/v1/invoices/{invoices['acme'].pk}/issue/"
    assert acme_key_client.post(url).status_code == 403
    issued = planner_client.post(url)
    assert issued.status_code == 200
    assert issued.json()["status"] == "issued"
    again = planner_client.post(url)
    assert again.status_code == 409
    listed = planner_client.get("/api/v1/invoices/?period=2026-11&status=issued").json()
    assert [row["customer"] for row in listed["results"]] == ["acme"]


def test_rate_cards_are_versioned_over_the_api(invoices, planner_client, acme_key_client):
    body = {
        "model": "llama-8b",
        "effective_from": "2026-12-01T00:00:00Z",
        "reserved_price_per_mu_minute_hour": "0.09",
        "best_effort_price_per_1000_mu": "1.80",
    }
    assert acme_key_client.post("/api/v1/rate-cards/", body, format="json").status_code == 403
    created = planner_client.post("/api/v1/rate-cards/", body, format="json")
    assert created.status_code == 201, created.json()
    duplicate = planner_client.post("/api/v1/rate-cards/", body, format="json")
    assert duplicate.status_code == 409
    negative = planner_client.post(
        "/api/v1/rate-cards/",
        {**body, "effective_from": "2027-01-01T00:00:00Z", "best_effort_price_per_1000_mu": "-1"},
        format="json",
    )
    assert negative.status_code == 400
    assert "best_effort_price_per_1000_mu" in negative.json()["error"]["fields"]
    # The October card priced November's invoices; once one is issued it cannot change.
    old = planner_client.get("/api/v1/rate-cards/").json()["results"][0]
    planner_client.post(f"/api/v1/invoices/{invoices['acme'].pk}/issue/")
    refused = planner_client.patch(
        f"/api/v1/rate-cards/{old['id']}/",
        {"reserved_price_per_mu_minute_hour": "0.01"},
        format="json",
    )
    assert refused.status_code == 409
    assert acme_key_client.get("/api/v1/rate-cards/").status_code == 200


def test_a_rate_card_cannot_take_effect_inside_an_issued_period(invoices, planner_client):
    """A back-dated card once repriced an issued month through late-usage adjustments."""
    assert planner_client.post(f"/api/v1/invoices/{invoices['acme'].pk}/issue/").status_code == 200
    body = {
        "model": "llama-8b",
        "effective_from": "2026-11-20T00:00:00Z",
        "reserved_price_per_mu_minute_hour": "0.50",
        "best_effort_price_per_1000_mu": "9.00",
    }
    inside = planner_client.post("/api/v1/rate-cards/", body, format="json")
    assert inside.status_code == 409
    error = inside.json()["error"]
    assert (error["code"], list(error["fields"])) == ("inside_issued_period", ["effective_from"])
    assert error["details"]["issued_through"] == "2026-12-01T00:00:00+00:00"
    before = planner_client.post(
        "/api/v1/rate-cards/", {**body, "effective_from": "2026-09-01T00:00:00Z"}, format="json"
    )
    assert before.status_code == 409
    after = planner_client.post(
        "/api/v1/rate-cards/", {**body, "effective_from": "2026-12-01T00:00:00Z"}, format="json"
    )
    assert after.status_code == 201
    # The issued invoice is as it was: regenerating leaves it alone, and it priced at $0.10.
    invoice_generate(period="2026-11")
    invoices["acme"].refresh_from_db()
    assert invoices["acme"].lines.get().unit_price == Decimal("0.10")


def test_a_bad_period_is_a_400_naming_it(invoices, planner_client):
    for url in (
        "/api/v1/invoices/?period=garbage",
        "/api/v1/billing/margin?period=2026-13",
        "/api/v1/customers/acme/billing/estimate?period=26",
        # A year date() cannot hold (OverflowError, a 500), digits int() refuses (issue 34).
        "/api/v1/invoices/?period=99999999999-1",
        "/api/v1/billing/margin?period=2026-²",
        "/api/v1/customers/acme/billing/estimate?period=²²²²-1",
    ):
        response = planner_client.get(url)
        assert response.status_code == 400, url
        assert "period" in response.json()["error"]["fields"], url


@pytest.mark.parametrize("period", ["9999-12", "0001-01", "3000-01", "1969-12"])
@pytest.mark.parametrize(
    "url",
    [
        "/api/v1/customers/acme/billing/estimate",
        "/api/v1/invoices/",
        "/api/v1/billing/margin",
    ],
)
def test_a_period_out_of_range_is_a_400_naming_it_not_a_500(acme, planner_client, url, period):
    response = planner_client.get(url, {"period": period})
    assert response.status_code == 400, response.content[:300]
    assert "period" in response.json()["error"]["fields"]


def test_the_first_and_last_periods_in_range_are_answered(invoices, planner_client):
    for period in ("1970-01", "2999-12"):
        response = planner_client.get("/api/v1/customers/acme/billing/estimate", {"period": period})
        assert response.status_code == 200, response.content[:300]
        assert response.json()["total"] == "0.00"


@pytest.mark.parametrize("effective_from", ["0001-01-01T00:00:00Z", "9999-12-31T23:59:59Z"])
def test_a_rate_card_dated_out_of_range_is_a_400_naming_effective_from(
    invoices, planner_client, effective_from
):
    body = {
        "model": "llama-8b",
        "effective_from": effective_from,
        "reserved_price_per_mu_minute_hour": "0.09",
        "best_effort_price_per_1000_mu": "1.80",
    }
    response = planner_client.post("/api/v1/rate-cards/", body, format="json")
    assert response.status_code == 400
    assert "effective_from" in response.json()["error"]["fields"]
    assert RateCard.objects.count() == 1


def test_this_months_estimate_counts_commitments_to_date_only(served_model, acme, acme_key_client):
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
        starts_at=datetime(2026, 11, 1, tzinfo=UTC),
        status="active",
    )
    # On 11 November at noon: 10.5 days = 252 h × 100 MU/min × $0.10 = $2,520.00, not the month.
    with time_machine.travel(datetime(2026, 11, 11, 12, tzinfo=UTC), tick=False):
        estimate = acme_key_client.get("/api/v1/customers/acme/billing/estimate").json()
    assert (estimate["period"], estimate["total"], estimate["credits"]) == (
        "2026-11",
        "2520.00",
        "0.00",
    )


def test_the_keep_warm_premium_is_priced_over_the_api_and_exported(
    served_model, acme, planner_client, acme_key_client
):
    body = {
        "model": "llama-8b",
        "effective_from": "2026-10-01T00:00:00Z",
        "reserved_price_per_mu_minute_hour": "0.10",
        "best_effort_price_per_1000_mu": "2.00",
        "keep_warm_price_per_mu_minute_hour": "0.02",
    }
    created = planner_client.post("/api/v1/rate-cards/", body, format="json")
    assert created.status_code == 201, created.json()
    assert created.json()["keep_warm_price_per_mu_minute_hour"] == "0.020000"
    negative = planner_client.post(
        "/api/v1/rate-cards/",
        {**body, "effective_from": "2027-01-01T00:00:00Z",
         "keep_warm_price_per_mu_minute_hour": "-0.01"},
        format="json",
    )  # fmt: skip
    assert negative.status_code == 400
    assert "keep_warm_price_per_mu_minute_hour" in negative.json()["error"]["fields"]
    # Without the field a card charges nothing for keep-warm.
    plain = {**body, "effective_from": "2027-02-01T00:00:00Z"}
    del plain["keep_warm_price_per_mu_minute_hour"]
    assert (
        planner_client.post("/api/v1/rate-cards/", plain, format="json").json()[
            "keep_warm_price_per_mu_minute_hour"
        ]
        == "0.000000"
    )
    Reservation.objects.create(
        customer=acme,
        served_model=served_model,
        mu_per_minute=100,
        starts_at=datetime(2026, 11, 16, tzinfo=UTC),
        keep_warm=True,
        status="active",
    )
    invoice_generate(period="2026-11")
    invoice = Invoice.objects.get(customer=acme)
    detail = acme_key_client.get(f"/api/v1/invoices/{invoice.pk}/").json()
    assert [(line["kind"], line["amount"]) for line in detail["lines"]] == [
        ("commitment", "3600.00"),
        ("keep_warm", "720.00"),
    ]
    assert detail["total"] == "4320.00"
    rows = list(
        csv.DictReader(
            io.StringIO(acme_key_client.get(f"/api/v1/invoices/{invoice.pk}/csv/").content.decode())
        )
    )
    assert [(row["kind"], row["unit_price"], row["amount"]) for row in rows] == [
        ("commitment", "0.100000", "3600.00"),
        ("keep_warm", "0.020000", "720.00"),
    ]
