"""A planner runs a what-if in a real browser: the page under gunicorn, the simulation on a real
Celery worker (queue "benchmarks"), the progress page polling until the comparison appears."""

import re

import pytest
from playwright.sync_api import expect

from tests.support.browser import log_in, screenshot
from tests.support.processes import celery_worker_process

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

POLICIES = ["static-peak", "kpa", "hpa-rps", "oracle", "modelunit"]


def small_trace() -> bytes:
    """Six minutes of two customers: acme steady, initech in a burst in minutes 2-4."""
    lines = ["timestamp,input_tokens,output_tokens,client"]
    for tenth in range(6 * 60 * 10):
        t = tenth / 10
        if tenth % 4 == 0:
            lines.append(f"{t:.1f},{400 + tenth % 700},{60 + tenth % 150},acme")
        if 120 <= t < 240 and tenth % 3 == 0:
            lines.append(f"{t:.1f},{900 + tenth % 500},{120 + tenth % 90},initech")
    return ("\n".join(lines) + "\n").encode()


def test_a_planner_runs_a_what_if_and_reads_the_comparison(site, page, planner_user, tmp_path):
    with celery_worker_process(tmp_path, queues="benchmarks"):
        log_in(page, site, "pat")
        page.goto(site + "/planner/what-if/")
        expect(page.get_by_role("heading", name="What-if", exact=True)).to_be_visible()
        expect(page.get_by_text("No what-ifs yet.")).to_be_visible()
        expect(page.get_by_text("No served models yet.")).to_be_visible()
        screenshot(page, "empty")

        page.set_input_files(
            'input[name="trace_file"]',
            files=[{"name": "two-customers.csv", "mimeType": "text/csv", "buffer": small_trace()}],
        )
        reservations = page.get_by_label("Reservations")
        # A typo first: the form comes back with the error on the reservations field.
        reservations.fill("acme = 300\ninitech: 150")
        page.get_by_role("button", name="Run the what-if").click()
        error = page.locator('[data-field="reservations"] .errorlist')
        assert "line 2: expected 'client = MU/min'" in error.inner_text()
        expect(page.get_by_text("The what-if was not started.")).to_be_visible()
        screenshot(page, "form-error")

        # The upload does not survive a failed submit (browsers never refill a file input).
        page.set_input_files(
            'input[name="trace_file"]',
            files=[{"name": "two-customers.csv", "mimeType": "text/csv", "buffer": small_trace()}],
        )
        page.get_by_label("Reservations").fill("acme = 300\ninitech = 150")
        page.get_by_label("Overcommit").fill("1.5")
        page.get_by_label("Simulate the first (minutes)").fill("6")
        for policy in POLICIES:
            box = page.locator(f'input[name="policies"][value="{policy}"]')
            assert box.is_checked()
        screenshot(page, "form-filled")
        # Chromium drops a mouse click right after a full-page screenshot (the viewport is
        # being restored); the keyboard submits the same form.
        page.get_by_role("button", name="Run the what-if").press("Enter")

        page.wait_for_url(re.compile(r"/planner/what-if/\d+/$"))
        expect(page.get_by_text(re.compile(r"What-if \d+ is queued"))).to_be_visible()
        screenshot(page, "progress")
        # htmx polls every 2 s; the worker needs a few seconds to start and simulate.
        table = page.locator("table.comparison")
        table.wait_for(timeout=90_000)
        rows = table.locator("tbody tr")
        assert [rows.nth(i).get_attribute("data-policy") for i in range(rows.count())] == POLICIES
        expect(page.get_by_text("Succeeded").first).to_be_visible()
        expect(page.get_by_text("capped at 3 replicas")).to_be_visible()  # ceil(450 / 1.5 / 100)
        expect(page.get_by_text("from clients acme, initech")).to_be_visible()
        screenshot(page, "comparison")

        page.get_by_role("link", name="← What-if").click()
        listed = page.locator("table tbody tr").first
        assert "two-customers.csv" in listed.inner_text()
        assert "Succeeded" in listed.inner_text()
        screenshot(page, "list")
