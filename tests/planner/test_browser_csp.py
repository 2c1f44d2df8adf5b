"""The planner UI, the admin and the API docs work in a real browser under the Content
Security Policy: no script or style is refused, and htmx, Chart.js and Swagger UI run."""

import pytest
from playwright.sync_api import expect

from tests.support.browser import log_in, screenshot

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_planner_admin_and_api_docs_run_under_the_csp(site, page, planner_user):
    refused = []
    page.on(
        "console",
        lambda message: (
            refused.append(message.text) if "Content Security Policy" in message.text else None
        ),
    )
    planner_user.is_superuser = True
    planner_user.save()
    log_in(page, site, "pat")

    page.goto(site + "/planner/")
    page.wait_for_load_state("networkidle")
    assert page.evaluate("typeof window.htmx") == "object"
    assert page.evaluate("typeof window.Chart") == "function"
    screenshot(page, "planner")

    page.goto(site + "/admin/")
    page.wait_for_load_state("networkidle")
    expect(page.get_by_role("link", name="Deployments").first).to_be_visible()

    page.goto(site + "/api/docs/")
    page.locator(".swagger-ui .info .title").wait_for()
    assert "Model-Unit Control Plane API" in page.locator(".swagger-ui .info .title").inner_text()
    screenshot(page, "api-docs")

    assert refused == []
