"""Invoice PDFs: rendered from the CSV's lines, downloaded from the API and the planner UI, and
read back with pdftotext (poppler-utils, installed by scripts/services.py)."""

import csv
import io
import re
import subprocess
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from billing.generation import invoice_generate
from billing.models import Invoice
from billing.rates import rate_card_create
from capacity.metering.rollups import usage_rollup
from capacity.models import Reservation
from tests.conftest import make_cost_model
from tests.support.usage import store_events

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]


def pdf_text(pdf: bytes) -> str:
    """The PDF's text as pdftotext lays it out, each run of white space (a wrapped line too)
    as one space."""
    assert pdf.startswith(b"%PDF-")
    text = subprocess.run(
        ["pdftotext", "-layout", "-", "-"], input=pdf, capture_output=True, check=True
    ).stdout.decode()
    return re.sub(r"\s+", " ", text)


def csv_rows(client, invoice) -> list[dict]:
    response = client.get(f"/api/v1/invoices/{invoice.pk}/csv/")
    assert response.status_code == 200
    return list(csv.DictReader(io.StringIO(response.content.decode())))


@pytest.fixture
def invoice(served_model, gpu_type, acme):
    """acme's November: a commitment, best-effort usage, a refusal credit and a latency credit
    (970 of 1,000 guaranteed requests within the 500 ms objective)."""
    rate_card_create(
        served_model=served_model,
        effective_from=datetime(2026, 10, 1, tzinfo=UTC),
        reserved_price_per_mu_minute_hour=Decimal("0.10"),
        best_effort_price_per_1000_mu=Decimal("2.00"),
        ttft_objective_ms=500,
        latency_credit_tiers=[{"below_attainment_percent": 99, "credit_percent": 10}],
    )
    Reservation.objects.create(
        customer=acme, served_model=served_model, mu_per_minute=100,
        starts_at=datetime(2026, 11, 16, tzinfo=UTC), status="active",
    )  # fmt: skip
    cost_model = make_cost_model(served_model, gpu_type)
    day = datetime(2026, 11, 20, tzinfo=UTC)

    def event(n, **fields):
        return {"event_id": f"e-{n}", "customer_id": acme.pk, "served_model_id": served_model.pk,
                "cost_model_id": cost_model.pk, "finished_at": day + timedelta(seconds=n),
                **fields}  # fmt: skip

    store_events(
        [event(n, admission_class="guaranteed", ttft_ms=900.0 if n < 30 else 200.0)
         for n in range(1000)]
        + [event(n, admission_class="best_effort", mu=3.0) for n in range(1000, 1500)]
        + [event(n, admission_class="guaranteed", outcome="refused", mu=0.0)
           for n in range(1500, 1503)]
    )  # fmt: skip
    usage_rollup()
    invoice_generate(period="2026-11")
    return Invoice.objects.get(customer=acme)


def test_the_pdf_holds_the_csvs_lines_its_totals_and_its_credits_with_their_evidence(
    invoice, owner_client
):
    rows = csv_rows(owner_client, invoice)
    assert {row["kind"] for row in rows} == {"commitment", "best_effort", "credit"}
    assert len([row for row in rows if row["kind"] == "credit"]) == 2
    response = owner_client.get(f"/api/v1/invoices/{invoice.pk}/pdf/")
    assert response.status_code == 200
    assert response["Content-Type"] == "application/pdf"
    assert response["Content-Disposition"] == (
        f'attachment; filename="invoice-acme-2026-11-{invoice.pk}.pdf"'
    )
    text = pdf_text(response.content)

    assert f"Invoice {invoice.pk}" in text and "Acme (acme)" in text and "November 2026" in text
    for row in rows:
        assert f" {row['amount']}" in text, row
        assert row["quantity"] in text, row
    assert f"Subtotal {invoice.subtotal} USD" in text
    assert f"SLA credits {invoice.credits} USD" in text
    assert f"Total {invoice.total} USD" in text
    # The totals are those of the CSV's lines.
    amounts = [Decimal(row["amount"]) for row in rows]
    assert invoice.subtotal == sum(a for a in amounts if a > 0)
    assert invoice.credits == -sum(a for a in amounts if a < 0)
    # Each credit with what it rests on.
    assert "Attainment 97.000 %: 970 of 1,000 guaranteed requests" in text
    assert "within 500 ms" in text
    assert "guaranteed request(s) were refused" in text
    assert "Draft: it may change until it is issued" in text


def test_the_pdf_is_a_download_of_the_planner_ui_and_only_the_customers_own(
    invoice, planner_client, globex_key_client, acme_key_client
):
    detail = planner_client.get(f"/planner/invoices/{invoice.pk}/").content.decode()
    link = re.search(r'href="([^"]+)" data-testid="invoice-pdf"', detail).group(1)
    assert link == f"/api/v1/invoices/{invoice.pk}/pdf/"
    downloaded = planner_client.get(link)
    assert downloaded.status_code == 200
    assert f"Total {invoice.total} USD" in pdf_text(downloaded.content)
    assert acme_key_client.get(link).status_code == 200
    assert globex_key_client.get(link).status_code == 404
