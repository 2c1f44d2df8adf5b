"""The portal in a real browser, one walk: acme's owner logs in, sees the chart of its
reservation against its use, creates a key and sees it exactly once, downloads an invoice as
CSV and as PDF (read back with pdftotext), and finds globex's pages answer 404; then acme's
member finds no way to create a key. No script or style is refused by the Content Security
Policy on the way."""

import csv
import io
from pathlib import Path

import pytest
from playwright.sync_api import expect

from accounts.keys import hash_secret
from accounts.models import ApiKey
from tests.billing.test_pdf import pdf_text
from tests.support.browser import chart_points, log_in, screenshot

pytestmark = pytest.mark.django_db(transaction=True)

PASSWORD = "pw-for-tests-only"  # tests.support.factories.UserFactory


def test_the_portal_walk(site, page, world):
    acme, globex = world["acme"], world["globex"]
    blocked = []  # what the Content Security Policy refused, if anything
    page.on(
        "console",
        lambda message: (
            blocked.append(message.text) if "Content Security Policy" in message.text else None
        ),
    )

    # The site's one login page leads a customer's owner to its own portal.
    log_in(page, site, "owner", PASSWORD)
    assert page.url == site + "/portal/acme/"
    points = chart_points(page)
    assert len(points) == 2 and all(count > 0 for count in points)  # reserved, used
    screenshot(page, "overview")

    page.get_by_role("link", name="Usage").click()
    expect(page.get_by_test_id("receipts").get_by_text(acme.event_ids[0])).to_be_visible()
    screenshot(page, "usage")

    page.get_by_role("link", name="API keys").click()
    form = page.get_by_role("form", name="New API key")
    form.get_by_label("Name").fill("ci runner")
    form.get_by_role("button", name="Create key").click()
    shown = page.get_by_test_id("new-key").locator("code").inner_text()
    prefix, _, secret = shown.partition(".")
    key = ApiKey.objects.get(customer=acme.customer, name="ci runner")
    assert key.prefix == prefix and key.secret_sha256 == hash_secret(secret)
    screenshot(page, "key-shown-once")
    page.goto(site + "/portal/acme/keys/")
    assert page.get_by_test_id("new-key").count() == 0
    assert prefix in page.content() and secret not in page.content()

    page.get_by_role("link", name="Invoices").click()
    with page.expect_download() as download_info:
        page.get_by_role("link", name="CSV").click()
    download = download_info.value
    assert download.suggested_filename == f"invoice-acme-2026-10-{acme.invoice.pk}.csv"
    rows = list(csv.DictReader(io.StringIO(Path(download.path()).read_text())))
    assert [(row["kind"], row["amount"]) for row in rows] == [("commitment", "480.00")]
    with page.expect_download() as download_info:
        page.get_by_role("link", name="PDF").click()
    download = download_info.value
    assert download.suggested_filename == f"invoice-acme-2026-10-{acme.invoice.pk}.pdf"
    text = pdf_text(Path(download.path()).read_bytes())
    assert "Total 480.00 USD" in text and "240 MU/min of llama-8b for acme" in text
    screenshot(page, "invoices")

    for path in (
        "/portal/globex/",
        "/portal/globex/keys/",
        f"/portal/globex/invoices/{globex.invoice.pk}/",
        f"/portal/acme/invoices/{globex.invoice.pk}/",
        f"/portal/acme/invoices/{globex.invoice.pk}/download/csv",
        f"/portal/acme/invoices/{globex.invoice.pk}/download/pdf",
    ):
        assert page.goto(site + path).status == 404, path
    screenshot(page, "another-customer-404")

    page.goto(site + "/portal/acme/")
    page.get_by_role("button", name="Log out").click()
    log_in(page, site, "member", PASSWORD)
    page.get_by_role("link", name="API keys").click()
    assert page.get_by_role("form", name="New API key").count() == 0
    expect(page.get_by_test_id("keys-read-only")).to_be_visible()
    assert page.get_by_role("button", name="Revoke").count() == 0
    screenshot(page, "member-keys")
    # Nor by posting the form anyway, with the session's CSRF token.
    token = next(c["value"] for c in page.context.cookies() if c["name"] == "csrftoken")
    forged = page.request.post(
        site + "/portal/acme/keys/new",
        form={"name": "sneaky", "scopes": "read", "csrfmiddlewaretoken": token},
    )
    assert forged.status == 403
    assert not ApiKey.objects.filter(name="sneaky").exists()
    assert blocked == []
