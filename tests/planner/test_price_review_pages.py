"""The planner's price review (issue 21): a version a fit left waiting shows, on its cost-model
page, how it would change each customer's usage charge and each shape's price on last week's
traffic; Activate and Reject (POST, CSRF, planners only) record who decided and why."""

import pytest
from django.test import Client

from capacity.models import CostModel, UsageEvent
from capacity.repricing.services import cost_model_reject, cost_model_retire
from core.models import AuditEntry
from tests.conftest import make_cost_model
from tests.support.usage import gateway_client, last_week_of_traffic, post_usage, scaled

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]


def page_of(served_model, gpu_type, version: int) -> str:
    path = f"/planner/benchmarks/cost-models/{served_model.name}/{gpu_type.pk}/1/"
    return f"{path}?version={version}"


def text(response) -> str:
    return response.content.decode()


@pytest.fixture
def held(make_key, key_client, acme, globex, served_model, gpu_type):
    """v1 active on last week's traffic; v2, 30 % dearer, waits for a planner."""
    gateway = gateway_client(make_key, key_client)
    v1 = last_week_of_traffic(gateway, served_model, gpu_type)
    v2 = make_cost_model(served_model, gpu_type, weights=scaled(1.3))
    assert v2.status == "candidate"
    return v1, v2, gateway


def test_a_held_version_shows_its_change_per_customer_and_per_shape(
    planner_client, held, served_model, gpu_type
):
    v1, v2, _ = held
    page = text(planner_client.get(page_of(served_model, gpu_type, 2)))

    assert 'v2 <span class="badge candidate">Candidate</span>' in page
    assert "Waits for a planner: v1 → v2 moves prices by +30.0 %" in page
    assert (
        "activating v2 changes the usage charge by\n  <strong>+30.0 % on the last 7 days of "
        "traffic (20 requests of 2 customers)</strong>: more than"
    ) in page
    assert (
        "This version would change acme&#x27;s usage charge by +30.0 % on last week&#x27;s traffic."
        in page
    )
    assert "This version would change globex&#x27;s usage charge by +30.0 %" in page
    acme_row = '<tr id="review-customer-acme"><td>Acme <span class="muted">acme</span></td>'
    assert acme_row + '<td class="num">10</td>' in page
    assert "input 256–1k, output 64–256 tokens" in page
    assert "input 1k–4k, output &lt; 64 tokens" in page
    assert f'action="/planner/benchmarks/cost-model-versions/{v2.pk}/activate/"' in page
    assert f'action="/planner/benchmarks/cost-model-versions/{v2.pk}/reject/"' in page
    assert page.count('id="activate-reason"') == 1 and page.count('id="reject-reason"') == 1
    assert (
        '<a href="/planner/benchmarks/cost-models/llama-8b/' in page
        and "waits for a planner</a>" in page
    )

    # The active version has nothing to review; it says who approved it.
    page = text(planner_client.get(page_of(served_model, gpu_type, 1)))
    assert 'id="review"' not in page
    assert "approved by <strong>system:auto</strong>: cross-validated MAPE 2.0 % is within" in page


def test_a_planner_approves_with_a_reason_and_the_next_usage_is_priced_with_it(
    planner_client, held, served_model, gpu_type
):
    v1, v2, gateway = held
    response = planner_client.post(
        f"/planner/benchmarks/cost-model-versions/{v2.pk}/activate/",
        {"reason": "new engine build, measured twice"},
        follow=True,
    )
    assert response.status_code == 200
    assert response.redirect_chain[-1][0] == page_of(served_model, gpu_type, 2)
    page = text(response)
    assert "llama-8b on H100-80GB×1 v2 is active" in page
    assert "approved by <strong>user:planner</strong>: new engine build, measured twice." in page
    v2.refresh_from_db()
    assert (v2.status, v2.approved_by, v2.approval_reason) == (
        "active",
        "user:planner",
        "new engine build, measured twice",
    )
    entry = AuditEntry.objects.get(action="cost_model.activate", object_id=str(v2.pk))
    assert entry.actor == "user:planner" and entry.after["price_change"] == pytest.approx(0.3)

    (event_id,) = post_usage(gateway, "acme", count=1, input_tokens=1000, output_tokens=100)
    assert UsageEvent.objects.get(event_id=event_id).cost_model_id == v2.pk


def test_a_planner_rejects_it_and_the_page_says_by_whom(
    planner_client, held, served_model, gpu_type
):
    v1, v2, _ = held
    response = planner_client.post(
        f"/planner/benchmarks/cost-model-versions/{v2.pk}/reject/",
        {"reason": "the run was noisy"},
        follow=True,
    )
    page = text(response)
    assert "llama-8b on H100-80GB×1 v2 is rejected: it stays on record" in page
    assert "by <strong>user:planner</strong>: the run was noisy." in page
    assert "rejected by user:planner" in page  # the versions table
    assert f'action="/planner/benchmarks/cost-model-versions/{v2.pk}/reject/"' not in page
    v1.refresh_from_db()
    v2.refresh_from_db()
    assert (v1.status, v2.status) == ("active", "rejected")

    # Stale page: rejecting it again is refused, in words.
    response = planner_client.post(
        f"/planner/benchmarks/cost-model-versions/{v2.pk}/reject/", follow=True
    )
    assert "v2 not changed: Version 2 is rejected; only a candidate is rejected." in text(response)


def test_decisions_are_posts_with_csrf_for_planners_only(
    held, planner, member_client, served_model, gpu_type
):
    _, v2, _ = held
    url = f"/planner/benchmarks/cost-model-versions/{v2.pk}/activate/"
    assert member_client.post(url).status_code == 403
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(planner)
    assert strict.post(url, {"reason": "no token"}).status_code == 403
    assert strict.get(url).status_code == 405
    v2.refresh_from_db()
    assert v2.status == CostModel.Status.CANDIDATE
    assert not AuditEntry.objects.filter(action="cost_model.activate", object_id=str(v2.pk))


def test_a_candidate_with_no_active_version_says_nothing_is_repriced(
    planner_client, served_model, gpu_type
):
    v1 = make_cost_model(served_model, gpu_type)
    cost_model_retire(cost_model=v1, actor="user:planner")
    page = text(planner_client.get(page_of(served_model, gpu_type, 1)))
    assert "is active, so there is nothing to compare with" in page
    assert "Activate v1</button>" in page


def test_the_overview_points_at_the_version_waiting_for_review(planner_client, held):
    _, v2, _ = held
    page = text(planner_client.get("/planner/benchmarks/cost-models/"))
    assert "v2 waits for review</span></a>" in page
    assert f"?version={v2.version}#review" in page
    cost_model_reject(cost_model=v2, actor="user:planner")
    page = text(planner_client.get("/planner/benchmarks/cost-models/"))
    assert "waits for review" not in page


def test_a_held_version_says_what_it_was_measured_from_and_which_customer_is_over_the_limit(
    planner_client, make_key, key_client, acme, globex, served_model, gpu_type, settings
):
    """Issue 33: a fit within the total limit that moves one customer past it waits; the page
    says why: the baseline it was measured from and the customer over the limit."""
    from tests.capacity.pricing.conftest import weights_moving

    settings.COST_MODEL_REVIEW_MIN_CUSTOMER_REQUESTS = 10
    last_week_of_traffic(gateway_client(make_key, key_client), served_model, gpu_type)
    v2 = make_cost_model(served_model, gpu_type, weights=scaled(1.04))
    v3 = make_cost_model(served_model, gpu_type, weights=weights_moving(acme=1.25, globex=0.9))
    assert (v2.status, v3.status) == ("active", "candidate")

    page = text(planner_client.get(page_of(served_model, gpu_type, 3)))

    assert (
        '<p id="review-baseline">When it was fitted, v3 was measured from '
        '<a href="?version=1">v1</a>, the first version in force in the last 30 days: '
        '+4.2 %, and from the active <a href="?version=2">v2</a>: +0.2 %.'
    ) in page
    assert (
        "Over <code>COST_MODEL_MAX_AUTO_CHANGE_PERCENT</code> (5 %) among customers with at "
        "least 10 requests in the window:"
    ) in page
    assert (
        '<li id="over-limit-acme">Acme <span class="muted">acme</span>: +25.0 % from v1 '
        "(10 requests)</li>"
    ) in page
    # globex moves by -10 % from v1 and by -13.5 % from v2, whose prices it pays today.
    assert (
        '<li id="over-limit-globex">Globex <span class="muted">globex</span>: -13.5 % from v2 '
        "(10 requests)</li>"
    ) in page
