"""A planner (made by create_planner's service, not a superuser), in a real browser: defines a
tier on the Tiers page, changes it, is told why a taken shed order is refused, puts a new
customer in it, and cannot delete it while the customer is there; nothing is refused by the
Content Security Policy on the way."""

import pytest
from playwright.sync_api import expect

from accounts.models import Customer, Tier
from core.models import AuditEntry
from tests.support.browser import log_in, screenshot

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_a_planner_defines_a_tier_and_puts_a_customer_in_it(site, page, planner_user):
    assert not planner_user.is_superuser
    refused = []  # what the Content Security Policy refused, if anything
    page.on(
        "console",
        lambda message: (
            refused.append(message.text) if "Content Security Policy" in message.text else None
        ),
    )
    log_in(page, site, "pat")
    page.get_by_role("link", name="Tiers").click()
    page.wait_for_url(site + "/planner/tiers/")
    expect(page.get_by_test_id("tier-free")).to_be_visible()
    screenshot(page, "tiers")

    form = page.get_by_role("form", name="New tier")
    form.get_by_label("Name").fill("startup")
    form.get_by_label("Label").fill("Start-ups")
    form.get_by_label("Weight").fill("1.5")
    form.get_by_label("Shed order").fill("5")
    form.get_by_role("button", name="Create tier").click()
    expect(page.get_by_text("Tier startup created.")).to_be_visible()
    assert Tier.objects.get(name="startup").weight == 1.5

    change = page.get_by_role("form", name="Change tier startup")
    change.get_by_label("Shed order").fill("1")  # free's place
    change.get_by_role("button", name="Save").click()
    expect(page.get_by_text("The tier free is shed at 1 already")).to_be_visible()
    screenshot(page, "tier-shed-order-taken")
    change = page.get_by_role("form", name="Change tier startup")
    change.get_by_label("Weight").fill("3")
    change.get_by_label("Shed order").fill("6")
    change.get_by_role("button", name="Save").click()
    expect(page.get_by_text("Tier startup saved.")).to_be_visible()
    assert (
        Tier.objects.get(name="startup").weight,
        Tier.objects.get(name="startup").shed_order,
    ) == (
        3.0,
        6,
    )
    assert AuditEntry.objects.filter(action="tier.update", actor="user:pat").exists()

    page.get_by_role("link", name="Customers").click()
    customer = page.get_by_role("form", name="New customer")
    customer.get_by_label("Name").fill("Seedling")
    customer.get_by_label("Slug").fill("seedling")
    customer.get_by_label("Tier").select_option("startup")
    customer.get_by_role("button", name="Create customer").click()
    page.wait_for_url(site + "/planner/customers/seedling/")
    assert Customer.objects.get(slug="seedling").tier_id == "startup"

    page.get_by_role("link", name="Tiers").click()
    row = page.get_by_test_id("tier-startup")
    assert row.get_by_role("button", name="Delete").count() == 0
    assert "move its customers first" in row.inner_text()
    screenshot(page, "tier-with-a-customer")
    assert refused == []
