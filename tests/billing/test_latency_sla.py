"""The latency SLA on the rate card: guaranteed requests' time to first token against the
model's objective, per customer and month, credited by attainment tier with its evidence."""

import csv
import io
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from billing.generation import invoice_generate
from billing.models import Invoice, RateCard
from billing.rates import rate_card_create
from capacity.models import Reservation
from tests.billing.test_pdf import pdf_text
from tests.conftest import make_cost_model
from tests.support.usage import store_events

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]

TIERS = [
    {"below_attainment_percent": 99, "credit_percent": 10},
    {"below_attainment_percent": 95, "credit_percent": 25},
]
DAY = datetime(2026, 11, 20, tzinfo=UTC)


@pytest.fixture
def sla(served_model, gpu_type, acme, globex):
    """A 500 ms objective on llama-8b's card; acme and globex reserve 100 MU/min from the 16th
    (a 3,600.00 commitment each in November)."""
    rate_card_create(
        served_model=served_model,
        effective_from=datetime(2026, 10, 1, tzinfo=UTC),
        reserved_price_per_mu_minute_hour=Decimal("0.10"),
        best_effort_price_per_1000_mu=Decimal("2.00"),
        ttft_objective_ms=500,
        latency_credit_tiers=TIERS,
    )
    for customer in (acme, globex):
        Reservation.objects.create(
            customer=customer, served_model=served_model, mu_per_minute=100,
            starts_at=datetime(2026, 11, 16, tzinfo=UTC), status="active",
        )  # fmt: skip
    return make_cost_model(served_model, gpu_type)


def requests(customer, cost_model, *, count, ttft_ms, prefix, **fields) -> list[dict]:
    return [
        {
            "event_id": f"{prefix}-{n}",
            "customer_id": customer.pk,
            "served_model_id": cost_model.served_model_id,
            "cost_model_id": cost_model.pk,
            "finished_at": DAY + timedelta(seconds=n),
            "admission_class": "guaranteed",
            "ttft_ms": ttft_ms,
            **fields,
        }
        for n in range(count)
    ]


def a_month(acme, globex, cost_model, *, late: int) -> None:
    """acme: 1,000 guaranteed requests with a TTFT, `late` of them over the objective, and 20
    that sent none; around them, what must not count: acme's best-effort and refused
    requests, and globex's guaranteed requests, all slow."""
    store_events(
        requests(acme, cost_model, count=999 - late, ttft_ms=200.0, prefix="fast")
        # Exactly at the objective is within it.
        + requests(acme, cost_model, count=1, ttft_ms=500.0, prefix="edge")
        + requests(acme, cost_model, count=late, ttft_ms=900.0, prefix="slow")
        + requests(acme, cost_model, count=20, ttft_ms=None, prefix="no-ttft")
        + requests(acme, cost_model, count=300, ttft_ms=9000.0, prefix="be",
                   admission_class="best_effort")
        + requests(acme, cost_model, count=50, ttft_ms=None, prefix="refused",
                   outcome="refused", mu=0.0)
        + requests(globex, cost_model, count=100, ttft_ms=9000.0, prefix="globex")
    )  # fmt: skip


def latency_credits(customer):
    invoice = Invoice.objects.get(customer=customer, period_start="2026-11-01")
    return invoice, [
        line
        for line in invoice.lines.all()
        if line.kind == "credit" and line.evidence.get("sla") == "ttft"
    ]


def latency_reports(customer):
    """The latency SLA's lines without a credit (kind latency_sla)."""
    invoice = Invoice.objects.get(customer=customer, period_start="2026-11-01")
    return list(invoice.lines.filter(kind="latency_sla"))


def test_a_month_with_3_percent_of_guaranteed_requests_late_credits_the_first_tier(
    sla, acme, globex
):
    a_month(acme, globex, sla, late=30)
    invoice_generate(period="2026-11")
    invoice, credits = latency_credits(acme)
    assert len(credits) == 1
    credit = credits[0]
    assert credit.amount == Decimal("-360.00")  # 10 % of the 3,600.00 commitment
    assert credit.evidence == {
        "sla": "ttft",
        "ttft_objective_ms": 500,
        "attainment_percent": 97.0,
        "requests_counted": 1000,
        "requests_within_objective": 970,
        "requests_without_ttft": 20,
        "requests_not_streamed": 0,
        "requests_self_reported": 0,
        "below_attainment_percent": 99,
        "credit_percent": 10,
        "commitment": "3600.00",
    }
    assert credit.description == (
        "Latency SLA credit: 97.000 % of 1,000 guaranteed requests had their first token within "
        "500 ms (below 99 %: 10 % of the commitment); 20 without a TTFT, not counted"
    )
    assert (invoice.subtotal, invoice.credits, invoice.total) == (
        Decimal("3600.00"),
        Decimal("360.00"),
        Decimal("3240.00"),
    )
    # globex's slow requests are globex's: 0 % attainment, the deepest tier.
    _, globex_credits = latency_credits(globex)
    assert [c.amount for c in globex_credits] == [Decimal("-900.00")]
    assert globex_credits[0].evidence["requests_counted"] == 100


@pytest.mark.parametrize(
    ("late", "credited"),
    [
        (5, None),  # 99.5 %: none
        (10, None),  # exactly 99 %: not below it
        (11, Decimal("-360.00")),  # 98.9 %
        (50, Decimal("-360.00")),  # exactly 95 %: still the first tier
        (51, Decimal("-900.00")),  # 94.9 %: 25 %
    ],
)
def test_the_tier_is_the_lowest_threshold_the_attainment_is_below(
    sla, acme, globex, late, credited
):
    a_month(acme, globex, sla, late=late)
    invoice_generate(period="2026-11")
    _, credits = latency_credits(acme)
    assert [c.amount for c in credits] == ([] if credited is None else [credited])


def test_a_month_that_meets_the_sla_shows_its_attainment_and_the_requests_without_a_ttft(
    sla, acme, globex, owner_client
):
    a_month(acme, globex, sla, late=5)  # 99.5 %: no credit
    invoice_generate(period="2026-11")
    invoice, credits = latency_credits(acme)
    assert credits == []
    (report,) = latency_reports(acme)
    assert report.amount == Decimal("0.00")
    assert report.evidence == {
        "sla": "ttft",
        "ttft_objective_ms": 500,
        "attainment_percent": 99.5,
        "requests_counted": 1000,
        "requests_within_objective": 995,
        "requests_without_ttft": 20,
        "requests_not_streamed": 0,
        "requests_self_reported": 0,
        "below_attainment_percent": None,
        "credit_percent": 0,
        "commitment": "3600.00",
    }
    assert report.description == (
        "Latency SLA met: 99.500 % of 1,000 guaranteed requests had their first token within "
        "500 ms (credits start below 99 %); 20 without a TTFT, not counted; no credit due"
    )
    assert (invoice.subtotal, invoice.credits, invoice.total) == (
        Decimal("3600.00"),
        Decimal("0.00"),
        Decimal("3600.00"),
    )

    # In every export the customer downloads: the JSON detail, the CSV and the PDF.
    lines = owner_client.get(f"/api/v1/invoices/{invoice.pk}/").json()["lines"]
    shown = next(line for line in lines if line["kind"] == "latency_sla")
    assert (shown["evidence"]["attainment_percent"], shown["amount"]) == (99.5, "0.00")
    assert shown["evidence"]["requests_without_ttft"] == 20
    exported = list(
        csv.DictReader(
            io.StringIO(owner_client.get(f"/api/v1/invoices/{invoice.pk}/csv/").content.decode())
        )
    )
    (row,) = [row for row in exported if row["kind"] == "latency_sla"]
    assert "99.500 % of 1,000" in row["description"]
    assert "20 without a TTFT" in row["description"]
    assert row["amount"] == "0.00"
    text = pdf_text(owner_client.get(f"/api/v1/invoices/{invoice.pk}/pdf/").content)
    assert "Latency SLA" in text
    assert (
        "Attainment 99.500 %: 995 of 1,000 guaranteed requests had their first token within "
        "500 ms; no credit is due. 20 requests reported no TTFT and are not counted."
    ) in text


def test_a_month_in_which_no_guaranteed_request_reported_a_ttft_says_so(
    sla, acme, globex, owner_client
):
    store_events(requests(acme, sla, count=40, ttft_ms=None, prefix="no-ttft"))
    invoice_generate(period="2026-11")
    invoice, credits = latency_credits(acme)
    assert credits == []
    (report,) = latency_reports(acme)
    assert (report.amount, report.quantity) == (Decimal("0.00"), Decimal(0))
    assert report.evidence["attainment_percent"] is None
    assert report.evidence["requests_without_ttft"] == 40
    assert report.description == (
        "Latency SLA not measured: no guaranteed request reported a TTFT (objective 500 ms); "
        "40 without a TTFT, not counted; no credit due"
    )
    text = pdf_text(owner_client.get(f"/api/v1/invoices/{invoice.pk}/pdf/").content)
    assert "attainment not measured. 40 requests reported no TTFT and are not counted." in text
    # globex, reserved and silent all month, is told there was nothing to measure.
    (silent,) = latency_reports(globex)
    assert silent.description == (
        "Latency SLA: no guaranteed requests ran (objective 500 ms); no credit due"
    )


def test_a_month_with_a_credit_has_no_second_latency_line(sla, acme, globex):
    a_month(acme, globex, sla, late=30)
    invoice_generate(period="2026-11")
    assert latency_reports(acme) == []
    assert len(latency_credits(acme)[1]) == 1


def test_no_objective_on_the_card_means_no_latency_credit(served_model, gpu_type, acme, globex):
    rate_card_create(
        served_model=served_model,
        effective_from=datetime(2026, 10, 1, tzinfo=UTC),
        reserved_price_per_mu_minute_hour=Decimal("0.10"),
        best_effort_price_per_1000_mu=Decimal("2.00"),
    )
    Reservation.objects.create(
        customer=acme, served_model=served_model, mu_per_minute=100,
        starts_at=datetime(2026, 11, 16, tzinfo=UTC), status="active",
    )  # fmt: skip
    a_month(acme, globex, make_cost_model(served_model, gpu_type), late=500)
    invoice_generate(period="2026-11")
    invoice, credits = latency_credits(acme)
    assert credits == [] and invoice.total == Decimal("3600.00")
    assert latency_reports(acme) == []  # no SLA, nothing to report


def test_the_credit_and_its_evidence_are_in_the_customers_exports(sla, acme, globex, owner_client):
    a_month(acme, globex, sla, late=30)
    invoice_generate(period="2026-11")
    invoice, _ = latency_credits(acme)
    lines = owner_client.get(f"/api/v1/invoices/{invoice.pk}/").json()["lines"]
    credit = next(line for line in lines if line["kind"] == "credit")
    assert credit["evidence"]["attainment_percent"] == 97.0
    assert (credit["quantity"], credit["unit"], credit["amount"]) == (
        "10.000000",
        "% of commitment",
        "-360.00",
    )
    exported = owner_client.get(f"/api/v1/invoices/{invoice.pk}/csv/").content.decode()
    assert "97.000 % of 1,000 guaranteed requests" in exported and "-360.00" in exported


def test_the_latency_sla_is_set_on_the_rate_card_and_bad_tables_are_refused(
    served_model, planner_client
):
    body = {
        "model": "llama-8b",
        "effective_from": "2026-12-01T00:00:00Z",
        "reserved_price_per_mu_minute_hour": "0.09",
        "best_effort_price_per_1000_mu": "1.80",
        "ttft_objective_ms": 800,
        # In any order: stored highest attainment first.
        "latency_credit_tiers": list(reversed(TIERS)),
    }
    created = planner_client.post("/api/v1/rate-cards/", body, format="json")
    assert created.status_code == 201, created.json()
    assert (created.json()["ttft_objective_ms"], created.json()["latency_credit_tiers"]) == (
        800,
        TIERS,
    )
    bad_tables = [
        ({"latency_credit_tiers": []}, "latency_credit_tiers"),  # an objective without tiers
        ({"ttft_objective_ms": None}, "latency_credit_tiers"),  # tiers without an objective
        ({"ttft_objective_ms": 0}, "ttft_objective_ms"),
        ({"latency_credit_tiers": {"99": 10}}, "latency_credit_tiers"),
        ({"latency_credit_tiers": [{"below_attainment_percent": 99}]}, "latency_credit_tiers"),
        ({"latency_credit_tiers": [{"below_attainment_percent": 101, "credit_percent": 5}]},
         "latency_credit_tiers"),
        ({"latency_credit_tiers": [{"below_attainment_percent": "99", "credit_percent": 5}]},
         "latency_credit_tiers"),
        # A lower attainment must never credit less.
        ({"latency_credit_tiers": [{"below_attainment_percent": 99, "credit_percent": 25},
                                   {"below_attainment_percent": 95, "credit_percent": 10}]},
         "latency_credit_tiers"),
        ({"latency_credit_tiers": [{"below_attainment_percent": 99, "credit_percent": 10},
                                   {"below_attainment_percent": 99, "credit_percent": 20}]},
         "latency_credit_tiers"),
    ]  # fmt: skip
    for day, (change, field) in enumerate(bad_tables, start=2):
        refused = planner_client.post(
            "/api/v1/rate-cards/",
            {**body, **change, "effective_from": f"2026-12-{day:02d}T00:00:00Z"},
            format="json",
        )
        assert refused.status_code == 400, (change, refused.json())
        assert list(refused.json()["error"]["fields"]) == [field], change
    # An unused card's SLA can change; the change is checked the same way.
    url = f"/api/v1/rate-cards/{created.json()['id']}/"
    changed = planner_client.patch(url, {"ttft_objective_ms": 600}, format="json")
    assert changed.status_code == 200 and changed.json()["ttft_objective_ms"] == 600
    cleared = planner_client.patch(url, {"ttft_objective_ms": None}, format="json")
    assert cleared.status_code == 400
    assert list(cleared.json()["error"]["fields"]) == ["latency_credit_tiers"]


def test_the_admin_holds_the_latency_sla_to_the_same_rules(served_model, client, django_user_model):
    client.force_login(django_user_model.objects.create_superuser("root", "r@example.com", "pw"))
    form = {
        "served_model": served_model.pk,
        "effective_from_0": "2026-12-01",
        "effective_from_1": "00:00:00",
        "currency": "USD",
        "reserved_price_per_mu_minute_hour": "0.10",
        "best_effort_price_per_1000_mu": "2.00",
        "keep_warm_price_per_mu_minute_hour": "0",
        "ttft_objective_ms": "500",
        "latency_credit_tiers": '[{"below_attainment_percent": 95, "credit_percent": 5}, '
        '{"below_attainment_percent": 99, "credit_percent": 10}]',
    }
    refused = client.post("/admin/billing/ratecard/add/", form)
    assert refused.status_code == 200  # the form again, with its error
    assert "must credit more than" in refused.content.decode()
    assert not RateCard.objects.exists()
    form["latency_credit_tiers"] = form["latency_credit_tiers"].replace(
        '"credit_percent": 5', '"credit_percent": 25'
    )
    assert client.post("/admin/billing/ratecard/add/", form).status_code == 302
    card = RateCard.objects.get()
    assert (card.ttft_objective_ms, card.latency_credit_tiers) == (500, TIERS)


# --- What the customer experienced, as a gateway measured it (issue 33, item 5) --------------


def test_whole_answers_and_a_customers_own_reports_are_counted_apart_never_in_the_attainment(
    sla, acme, globex
):
    # 100 streamed requests all in time; 50 whole answers (no first token before their end) and
    # 40 that acme's own key reported as slow and as fast: none of them in the attainment.
    store_events(
        requests(acme, sla, count=100, ttft_ms=200.0, prefix="streamed", streamed=True)
        + requests(acme, sla, count=50, ttft_ms=None, prefix="whole", streamed=False)
        + requests(acme, sla, count=20, ttft_ms=9000.0, prefix="own-slow", self_reported=True)
        + requests(acme, sla, count=20, ttft_ms=10.0, prefix="own-fast", self_reported=True)
    )
    invoice_generate(period="2026-11")
    _, credits = latency_credits(acme)
    assert credits == []  # 100 % of what a gateway measured: no credit from self-reports
    (line,) = latency_reports(acme)
    assert line.evidence["requests_counted"] == 100
    assert line.evidence["attainment_percent"] == 100.0
    assert (
        line.evidence["requests_without_ttft"],
        line.evidence["requests_not_streamed"],
        line.evidence["requests_self_reported"],
    ) == (90, 50, 40)
    assert "90 without a TTFT, not counted (50 not streamed, 40 self-reported)" in (
        line.description
    )


def test_a_cold_start_counts_against_the_sla_only_for_a_customer_that_keeps_warm(sla, acme, globex):
    # Both had every request held 3 s for a cold start, then a first token in 200 ms.
    Reservation.objects.filter(customer=globex).update(keep_warm=True)
    store_events(
        requests(acme, sla, count=100, ttft_ms=200.0, held_ms=3000.0, prefix="acme")
        + requests(globex, sla, count=100, ttft_ms=200.0, held_ms=3000.0, prefix="globex")
    )
    invoice_generate(period="2026-11")
    # acme declined keep-warm: the cold starts it accepted are not late.
    assert latency_credits(acme)[1] == []
    assert latency_reports(acme)[0].evidence["attainment_percent"] == 100.0
    # globex paid to keep the model warm: 3.2 s is late, every one of them.
    _, credits = latency_credits(globex)
    assert [c.amount for c in credits] == [Decimal("-900.00")]
    assert credits[0].evidence["attainment_percent"] == 0.0
