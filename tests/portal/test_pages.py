"""What each portal page shows a customer's member: its own numbers, never another's."""

import csv
import io
import json
import re
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from accounts.services import api_key_create
from billing.budgets import budget_create
from billing.rates import rate_card_create
from capacity.admission.limits import request_limit_set
from capacity.metering.rollups import usage_rollup
from tests.billing.test_pdf import pdf_text
from tests.conftest import _client_for_key
from tests.support.factories import CustomerFactory, MembershipFactory
from tests.support.usage import store_events

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]


@pytest.fixture
def acme_client(client, member):
    client.force_login(member)
    return client


def chart_of(response) -> dict:
    match = re.search(
        r'<script id="utilisation" type="application/json">(.*?)</script>',
        response.content.decode(),
        re.S,
    )
    assert match, "no chart on the page"
    return json.loads(match.group(1))


def test_the_overview_charts_ones_own_reserved_and_used(acme_client, world):
    response = acme_client.get("/portal/acme/")
    assert response.status_code == 200
    reserved, used = chart_of(response)["data"]["datasets"]
    assert reserved["label"] == "Reserved MU/min" and used["label"] == "Used MU/min"
    # acme's 240 reserved and 120 used per minute (globex's 300 and 250 are not added in).
    assert max(reserved["data"]) == 240
    assert max(used["data"]) == pytest.approx(120)
    assert b"llama-8b" in response.content  # its entitled model
    seven_days = acme_client.get("/portal/acme/?range=7d&model=llama-8b")
    assert max(chart_of(seven_days)["data"]["datasets"][1]["data"]) == pytest.approx(120)


def test_the_receipts_are_ones_own_events_newest_first_a_page_at_a_time(acme_client, world):
    first = acme_client.get("/portal/acme/usage/").content.decode()
    acme_ids = world["acme"].event_ids  # the newest first
    shown = re.findall(r"<code>(acme-[0-9a-f]+)</code>", first)
    assert shown == acme_ids[:50]
    assert "Page 1 of 2 (60 in all)" in first
    second = acme_client.get("/portal/acme/usage/?page=2").content.decode()
    assert re.findall(r"<code>(acme-[0-9a-f]+)</code>", second) == acme_ids[50:]
    for page in (first, second):
        assert not any(event_id in page for event_id in world["globex"].event_ids)


def test_the_keys_page_lists_ones_own_keys_by_prefix(acme_client, world):
    page = acme_client.get("/portal/acme/keys/").content.decode()
    assert world["acme"].key.prefix in page
    assert world["globex"].key.prefix not in page
    assert world["acme"].key.secret_sha256 not in page


def test_the_limits_page_shows_ones_reservations_and_admission(acme_client, world):
    page = acme_client.get("/portal/acme/limits/").content.decode()
    reservations = page.split('data-testid="reservations"')[1].split("</table>")[0]
    assert "240.00" in reservations and "300.00" not in reservations
    assert f"<td>{world['acme'].reservation.pk}</td>" in reservations
    allowances = page.split('data-testid="allowances"')[1].split("</table>")[0]
    assert "240.00" in allowances and "24.00" in allowances  # guaranteed, best-effort
    assert "30.00" not in allowances
    assert "600/min" in page  # writes per key (API_THROTTLE_WRITES)


def test_the_limits_page_shows_ones_request_limits_for_the_account_and_each_key(acme_client, world):
    acme, globex = world["acme"], world["globex"]
    request_limit_set(customer=acme.customer, requests_per_minute=120, tokens_per_minute=50_000)
    request_limit_set(customer=acme.customer, api_key=acme.key, concurrent_requests=4)
    request_limit_set(customer=globex.customer, requests_per_minute=987)
    request_limit_set(customer=globex.customer, api_key=globex.key, concurrent_requests=65)

    page = acme_client.get("/portal/acme/limits/").content.decode()

    table = page.split('data-testid="request-limits"')[1].split("</table>")[0]
    rows = [
        re.sub(r"<[^>]+>|\s+", " ", row).split()
        for row in re.findall(r"<tr>(.*?)</tr>", table, re.S)[1:]
    ]
    # The account's first (all its keys), then the key's, each limit or "no limit".
    assert rows == [
        ["all", "your", "keys", "120", "50000", "no", "limit"],
        ["key", acme.key.prefix, "(acme", "gateway)", "no", "limit", "no", "limit", "4"],
    ]
    # Exactly acme's two rows above: none of globex's.
    assert globex.key.prefix not in page


def test_the_limits_page_shows_the_accounts_and_each_keys_budget_and_spend(
    acme_client, world, served_model, sellable
):
    acme, globex = world["acme"], world["globex"]
    now = timezone.now()
    rate_card_create(
        served_model=served_model,
        effective_from=now - timedelta(days=400),
        reserved_price_per_mu_minute_hour=Decimal("0"),
        best_effort_price_per_1000_mu=Decimal("2.00"),
    )
    # 5,000 best-effort MU sent with acme's key this month: $10.00.
    store_events(
        [{"event_id": f"k-{n}", "customer_id": acme.customer.pk,
          "served_model_id": served_model.pk, "cost_model_id": sellable.pk,
          "finished_at": now - timedelta(seconds=n), "api_key_prefix": acme.key.prefix,
          "mu": 1000.0} for n in range(5)]
    )  # fmt: skip
    usage_rollup()
    budget_create(customer=acme.customer, monthly_amount=Decimal("250"))
    budget_create(customer=acme.customer, api_key=acme.key, monthly_amount=Decimal("40"),
                  hard_cap=True)  # fmt: skip
    budget_create(customer=globex.customer, api_key=globex.key, monthly_amount=Decimal("777"))

    page = acme_client.get("/portal/acme/limits/").content.decode()

    table = page.split('data-testid="budgets"')[1].split("</table>")[0]
    rows = [
        " ".join(re.sub(r"<[^>]+>", " ", row).split())
        for row in re.findall(r"<tr>(.*?)</tr>", table, re.S)
    ]
    month = f"{timezone.now():%Y-%m}"
    assert rows[1:] == [
        f"your account 250.00 USD 10.00 USD ({month}) 4.0 off",
        f"key {acme.key.prefix} (acme gateway) 40.00 USD 10.00 USD ({month}) 25.0 on: past 100 %, "
        "requests with this key beyond your reservations are refused",
    ]
    assert globex.key.prefix not in page


def test_the_invoice_pdf_downloads_with_its_total(acme_client, outsider_client, world):
    acme_invoice, globex_invoice = world["acme"].invoice, world["globex"].invoice
    listing = acme_client.get("/portal/acme/invoices/").content.decode()
    assert f"/portal/acme/invoices/{acme_invoice.pk}/download/pdf" in listing

    download = acme_client.get(f"/portal/acme/invoices/{acme_invoice.pk}/download/pdf")

    assert download.status_code == 200
    assert download["Content-Type"] == "application/pdf"
    assert download["Content-Disposition"] == (
        f'attachment; filename="invoice-acme-2026-10-{acme_invoice.pk}.pdf"'
    )
    text = pdf_text(download.content)
    assert "Total 480.00 USD" in text
    assert "240 MU/min of llama-8b for acme" in text
    assert "600.00" not in text  # globex's total
    # Another customer's invoice is not there for acme, nor acme's for another customer.
    assert (
        acme_client.get(f"/portal/acme/invoices/{globex_invoice.pk}/download/pdf").status_code
        == 404
    )
    assert (
        outsider_client.get(f"/portal/acme/invoices/{acme_invoice.pk}/download/pdf").status_code
        == 404
    )


def test_invoices_list_ones_own_and_download_as_the_api_exports_them(acme_client, world):
    acme_invoice, globex_invoice = world["acme"].invoice, world["globex"].invoice
    listing = acme_client.get("/portal/acme/invoices/").content.decode()
    assert f"/portal/acme/invoices/{acme_invoice.pk}/download/csv" in listing
    assert "480.00" in listing and "600.00" not in listing
    assert str(globex_invoice.pk) not in re.findall(r"/invoices/(\d+)/", listing)

    detail = acme_client.get(f"/portal/acme/invoices/{acme_invoice.pk}/").content.decode()
    assert "240 MU/min of llama-8b for acme" in detail

    download = acme_client.get(f"/portal/acme/invoices/{acme_invoice.pk}/download/csv")
    assert download["Content-Type"] == "text/csv"
    assert download["Content-Disposition"] == (
        f'attachment; filename="invoice-acme-2026-10-{acme_invoice.pk}.csv"'
    )
    rows = list(csv.DictReader(io.StringIO(download.content.decode())))
    assert [(r["kind"], r["model"], r["amount"]) for r in rows] == [
        ("commitment", "llama-8b", "480.00")
    ]
    # The same file as the API's export (billing.exports renders both).
    api = _client_for_key(api_key_create(name="reader", customer=acme_invoice.customer).plaintext)
    assert api.get(f"/api/v1/invoices/{acme_invoice.pk}/csv/").content == download.content

    unknown = acme_client.get(f"/portal/acme/invoices/{acme_invoice.pk}/download/docx")
    assert unknown.status_code == 404


def test_an_empty_customer_sees_what_will_appear(client, db):
    membership = MembershipFactory(customer=CustomerFactory(slug="newco"), role="owner")
    client.force_login(membership.user)
    expected = {
        "/portal/newco/": "No reservations and no usage yet.",
        "/portal/newco/usage/": "No requests metered yet.",
        "/portal/newco/keys/": "No API keys.",
        "/portal/newco/limits/": "No reservations.",
        "/portal/newco/invoices/": "No invoices yet.",
    }
    for path, text in expected.items():
        response = client.get(path)
        assert response.status_code == 200, path
        assert text in response.content.decode(), path
