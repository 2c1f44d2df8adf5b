"""The planner logs in with a real browser and reads the fleet page."""

import pytest
from playwright.sync_api import expect

from tests.support.browser import log_in, screenshot

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_planner_logs_in_and_sees_the_fleet(site, page, planner_user):
    page.goto(site + "/planner/")
    # Not logged in: the login page, which brings the planner back afterwards.
    assert "/login/" in page.url
    screenshot(page, "login")
    log_in(page, site, "pat")
    page.goto(site + "/planner/")
    expect(page.get_by_role("heading", name="Fleet")).to_be_visible()
    expect(page.get_by_text("No fleet yet.")).to_be_visible()
    screenshot(page, "fleet-empty")
